<#
.SYNOPSIS
  Installs forewarn as a Windows service (run as Administrator).

.DESCRIPTION
  Creates a Python virtual environment under Program Files, installs forewarn into it, and registers the
  service "forewarn" with NSSM (the Non-Sucking Service Manager, https://nssm.cc; install it first, e.g.
  `winget install NSSM.NSSM` or `choco install nssm`). The service runs as NT AUTHORITY\LocalService, keeps
  its state in %ProgramData%\forewarn, serves metrics on the given port and restarts on failure. NSSM stops
  it with Ctrl+C, which forewarn handles as a clean stop (exit 0). See docs/windows.md.

.EXAMPLE
  .\install-forewarn.ps1
  .\install-forewarn.ps1 -Port 9465 -Package "forewarn[eventhubs]" -Environment @{ FOREWARN_SINK = "stdout,eventhubs" }
#>
[CmdletBinding()]
param(
    [string]$InstallDir = (Join-Path $env:ProgramFiles "forewarn"),
    [string]$StateDir = (Join-Path $env:ProgramData "forewarn"),
    [string]$Python = "py",
    [string]$Nssm = "nssm.exe",
    [string]$Package = "forewarn[all]",
    [int]$Port = 9465,
    [hashtable]$Environment = @{}
)
$ErrorActionPreference = "Stop"

$principal = New-Object Security.Principal.WindowsPrincipal([Security.Principal.WindowsIdentity]::GetCurrent())
if (-not $principal.IsInRole([Security.Principal.WindowsBuiltInRole]::Administrator)) {
    throw "Run this script as Administrator."
}
if (-not (Get-Command $Nssm -ErrorAction SilentlyContinue)) {
    throw "NSSM not found ($Nssm). Install it (winget install NSSM.NSSM) or pass -Nssm C:\path\to\nssm.exe."
}

Write-Host "Installing $Package into $InstallDir"
& $Python -m venv $InstallDir
if ($LASTEXITCODE -ne 0) { throw "python -m venv failed" }
& (Join-Path $InstallDir "Scripts\python.exe") -m pip install --no-cache-dir --disable-pip-version-check $Package
if ($LASTEXITCODE -ne 0) { throw "pip install failed" }

New-Item -ItemType Directory -Force -Path $StateDir | Out-Null
# Only the service account and administrators may read the state (it holds the outbox).
icacls $StateDir /inheritance:r /grant:r "NT AUTHORITY\LocalService:(OI)(CI)M" "BUILTIN\Administrators:(OI)(CI)F" | Out-Null

$exe = Join-Path $InstallDir "Scripts\forewarn.exe"
if (Get-Service forewarn -ErrorAction SilentlyContinue) {
    & $Nssm stop forewarn | Out-Null
    & $Nssm remove forewarn confirm | Out-Null
}
& $Nssm install forewarn $exe run | Out-Null
$envLines = @("FOREWARN_STATE_DIR=$StateDir", "FOREWARN_LISTEN_ADDRESS=:$Port", "FOREWARN_LOG_FORMAT=json")
foreach ($key in $Environment.Keys) { $envLines += "$key=$($Environment[$key])" }
& $Nssm set forewarn AppEnvironmentExtra $envLines | Out-Null
& $Nssm set forewarn DisplayName "forewarn (Azure Scheduled Events)" | Out-Null
& $Nssm set forewarn Description "Advance warning of Azure VM maintenance: Scheduled Events as Prometheus metrics and records." | Out-Null
& $Nssm set forewarn ObjectName "NT AUTHORITY\LocalService" | Out-Null
& $Nssm set forewarn Start SERVICE_AUTO_START | Out-Null
& $Nssm set forewarn AppStopMethodConsole 15000 | Out-Null
& $Nssm set forewarn AppExit Default Restart | Out-Null
& $Nssm set forewarn AppRestartDelay 2000 | Out-Null
& $Nssm set forewarn AppStdout (Join-Path $StateDir "records.jsonl") | Out-Null
& $Nssm set forewarn AppStderr (Join-Path $StateDir "forewarn.log") | Out-Null
& $Nssm set forewarn AppRotateFiles 1 | Out-Null
& $Nssm set forewarn AppRotateBytes 10485760 | Out-Null

if (-not (Get-NetFirewallRule -DisplayName "forewarn metrics" -ErrorAction SilentlyContinue)) {
    New-NetFirewallRule -DisplayName "forewarn metrics" -Direction Inbound -Protocol TCP -LocalPort $Port -Action Allow | Out-Null
}
Start-Service forewarn
Write-Host "forewarn is running: http://localhost:$Port/metrics (logs: $StateDir\forewarn.log)"
