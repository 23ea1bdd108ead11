"""Secrets stay out of logs and output: URL credentials and queries, OTLP header values, webhook URLs;
log lines cannot be forged by values from IMDS; third-party chatter stays quiet."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.util.re import parse_env_headers

from forewarn.cli import main
from forewarn.logs import setup_logging
from forewarn.sinks import SinkConfigError
from forewarn.sinks.otlp import OtlpSink

from conftest import CollectorProcess, SimulatorHandle, free_port, wait_until

SECRET = "S3CRET-TOKEN-42"


@pytest.fixture
def logged() -> Iterator[Callable[..., io.StringIO]]:
    """`setup_logging(...)` writing to a buffer instead of stderr; the logging setup is restored after."""
    root = logging.getLogger()
    handlers, root_level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in ("azure", "uamqp", "urllib3", "opentelemetry")}

    def setup(fmt: str = "text", level: str = "info") -> io.StringIO:
        buffer = io.StringIO()
        stderr, sys.stderr = sys.stderr, buffer
        try:
            setup_logging(fmt, level)
        finally:
            sys.stderr = stderr
        return buffer

    yield setup
    root.handlers[:] = handlers
    root.setLevel(root_level)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


class _NotFound(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


# --- URLs with credentials ------------------------------------------------------------------------

def test_imds_endpoint_credentials_are_not_in_the_start_up_log(simulator: Callable[..., SimulatorHandle],
                                                                  collector: Callable[..., CollectorProcess]) -> None:
    sim = simulator("quiet")
    endpoint = sim.url.replace("http://", f"http://user:{SECRET}@")
    proc = collector(endpoint)
    wait_until(lambda: "polling" in proc.log(), timeout=10, message="the start-up line")
    proc.stop()
    assert "polling http://<redacted>@127.0.0.1" in proc.log()
    assert SECRET not in proc.log()


def test_one_shot_command_errors_hide_endpoint_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://user:{SECRET}@127.0.0.1:{server.server_address[1]}"
        assert main(["events", "--imds-endpoint", url, "--timeout", "2"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert "cannot read Scheduled Events from http://<redacted>@127.0.0.1" in err
    assert SECRET not in err


# --- OTLP -----------------------------------------------------------------------------------------

def test_otlp_endpoint_token_is_not_in_the_exporters_own_warnings(
        simulator: Callable[..., SimulatorHandle], collector: Callable[..., CollectorProcess]) -> None:
    # Nothing listens there: the HTTP exporter retries and logs the transport error, whose text holds the
    # request URL with its query.
    endpoint = f"http://127.0.0.1:{free_port()}/v1/logs?token={SECRET}"
    sim = simulator("hardware-failure", speed=100)
    proc = collector(sim.url, "--sink", "otlp", "--otlp-protocol", "http/protobuf", "--otlp-endpoint", endpoint,
                     env={"OTEL_EXPORTER_OTLP_TIMEOUT": "3"})
    wait_until(lambda: "Transient error" in proc.log(), timeout=20, message="the exporter's retry warning")
    proc.stop()
    log = proc.log()
    assert "/v1/logs?<redacted>" in log
    assert SECRET not in log


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_malformed_otlp_header_is_refused_by_name_only(monkeypatch: pytest.MonkeyPatch,
                                                       logged: Callable[..., io.StringIO], variable: str,
                                                       protocol: str) -> None:
    out = logged()
    monkeypatch.setenv(variable, f'x-tenant=acme,authorization=Bearer "{SECRET}"')
    with pytest.raises(SinkConfigError) as caught:
        OtlpSink(endpoint="http://127.0.0.1:4318/v1/logs", protocol=protocol)
    message = str(caught.value)
    assert variable in message and "'authorization'" in message
    assert SECRET not in message and SECRET not in out.getvalue()


def test_malformed_header_without_a_name_is_refused_without_echo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"{SECRET};")
    with pytest.raises(SinkConfigError) as caught:
        OtlpSink(endpoint="http://127.0.0.1:4318/v1/logs")
    assert "OTEL_EXPORTER_OTLP_HEADERS" in str(caught.value) and SECRET not in str(caught.value)


def test_the_sdk_header_warning_is_logged_without_the_header(logged: Callable[..., io.StringIO]) -> None:
    out = logged()
    parse_env_headers(f'authorization=Bearer "{SECRET}"', liberal=True)
    assert "Header format invalid" in out.getvalue() and SECRET not in out.getvalue()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_third_party_messages_lose_url_credentials_and_queries(logged: Callable[..., io.StringIO],
                                                               fmt: str) -> None:
    out = logged(fmt)
    urllib3 = logging.getLogger("urllib3.connectionpool")
    urllib3.warning("Retrying after connection broken by '%s': %s", "NewConnectionError",
                    f"/v1/logs?sig={SECRET}")
    logging.getLogger("opentelemetry.exporter.x").warning(
        "Transient error %s", f"HTTPConnectionPool(host='h', port=1): Max retries exceeded with url: "
        f"/v1/logs?token={SECRET} (Caused by X)")
    logging.getLogger("opentelemetry.exporter.grpc").warning("exporting to %s", f"user:{SECRET}@h:4317")
    logging.getLogger("azure.eventhub").warning("link: %s", f"sb://ns/?SharedAccessSignature=sr%3Dx&sig={SECRET}")
    text = out.getvalue()
    assert text.count("\n") == 4 and "/v1/logs?<redacted>" in text
    assert SECRET not in text


# --- policy output --------------------------------------------------------------------------------

WEBHOOK = f"https://hooks.example.com/drain/{SECRET}?code={SECRET}"


def forewarn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("hook", [
    f"{{webhook: '{WEBHOOK}', timeout: -1}}",
    f"{{webhook: 'ftp://user:{SECRET}@hooks.example.com/{SECRET}'}}",
    f"{{webhook: 'hooks.example.com/{SECRET}'}}",
    f"{{webhook: '{WEBHOOK}', name: [x]}}",
    f"{{webhook: '{WEBHOOK}', command: [x]}}",
    f"{{webhook: '{WEBHOOK}', env: [A]}}",
    f"{{webhook: '{WEBHOOK}', 'timeout': .nan}}",
])
def test_policy_errors_never_show_a_webhook_url(tmp_path: Path, hook: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"rules:\n  - name: a\n    action: approve\n    prepare:\n      - {hook}\n")
    done = forewarn("policy", "check", str(path))
    assert done.returncode == 2 and "p.yaml:" in done.stderr, done.stderr
    assert SECRET not in done.stderr + done.stdout
    assert "Traceback" not in done.stderr


def test_policy_check_and_explain_never_show_a_webhook_url(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(f"rules:\n  - name: a\n    action: approve\n    prepare: [{{webhook: '{WEBHOOK}'}}]\n"
                    f"hooks:\n  recover: [{{webhook: 'https://u:{SECRET}@hooks.example.com/x'}}]\n")
    document = tmp_path / "doc.json"
    document.write_text('{"DocumentIncarnation": 1, "Events": [{"EventId": "E1", "EventType": "Reboot", '
                        '"ResourceType": "VirtualMachine", "Resources": ["vm-0"], "EventStatus": "Scheduled", '
                        '"NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "", '
                        '"EventSource": "Platform", "DurationInSeconds": -1}]}')
    check = forewarn("policy", "check", str(path))
    explain = forewarn("policy", "explain", str(path), "--document", str(document), "--vm-name", "vm-0")
    assert check.returncode == 0 and explain.returncode == 0, check.stderr + explain.stderr
    assert "https://hooks.example.com/..." in check.stdout
    assert "https://hooks.example.com/..." in explain.stdout
    for done in (check, explain):
        assert SECRET not in done.stdout + done.stderr


# --- the log itself -------------------------------------------------------------------------------

def test_a_newline_in_a_logged_value_cannot_forge_a_line(logged: Callable[..., io.StringIO]) -> None:
    out = logged()
    log = logging.getLogger("forewarn.test")
    log.info("event %s (%s)", "E1\n2026-01-01T00:00:00.000Z INFO    forged", "Reboot\r\x1b[2J\x00\x85\u2028")
    text = out.getvalue()
    assert text.count("\n") == 1, text
    assert "E1\\n2026-01-01T00:00:00.000Z INFO    forged" in text
    assert "Reboot\\r\\x1b[2J\\x00\\x85\\u2028" in text


def test_a_traceback_stays_multi_line(logged: Callable[..., io.StringIO]) -> None:
    out = logged()
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("forewarn.test").exception("failed on %s", "a\nb")
    text = out.getvalue()
    assert "failed on a\\nb\nTraceback (most recent call last):\n" in text
    assert text.rstrip().endswith("RuntimeError: boom")


@pytest.mark.parametrize("name", ["azure.eventhub._producer", "azure.core.pipeline.policies.http_logging_policy",
                                  "azure.identity._credentials.managed_identity", "uamqp.connection"])
def test_azure_sdk_info_is_quiet_unless_debug(logged: Callable[..., io.StringIO], name: str) -> None:
    out = logged("text", "info")
    logging.getLogger(name).info("retrying %s", "link")
    logging.getLogger(name).warning("link lost")
    assert "retrying link" not in out.getvalue() and "link lost" in out.getvalue()
    out = logged("text", "debug")
    logging.getLogger(name).info("retrying %s", "link")
    assert "retrying link" in out.getvalue()
