"""The command line: precedence, errors people can act on, one-shot commands."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from forewarn.cli import build_parser, format_table
from forewarn.config import RUN_OPTIONS, ConfigError, redact_url, resolve
from forewarn.imds.document import parse_document

from conftest import SimulatorHandle, free_port, wait_until


def forewarn(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def parse_run(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = tmp_path / "forewarn.yaml"
    config.write_text("poll-interval: 3\napi_version: 2019-08-01\nlisten-address: 127.0.0.1:1\nsink: [stdout]\n")
    env = {"FOREWARN_POLL_INTERVAL": "2", "FOREWARN_LISTEN_ADDRESS": "127.0.0.1:2"}
    settings = resolve(parse_run("--config", str(config), "--poll-interval", "1.5"), environ=env)
    assert settings.poll_interval == 1.5 and settings.sources["poll_interval"] == "--poll-interval"
    assert settings.listen_address == "127.0.0.1:2" and settings.sources["listen_address"] == "FOREWARN_LISTEN_ADDRESS"
    assert settings.api_version == "2019-08-01"
    assert settings.imds_timeout == 2.0 and settings.sources["imds_timeout"] == "default"


def test_config_file_from_environment_and_repeatable_sinks(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("sink: [stdout, 'file:/tmp/x.jsonl']\n")
    settings = resolve(parse_run(), environ={"FOREWARN_CONFIG": str(config)})
    assert settings.sink == ["stdout", "file:/tmp/x.jsonl"]
    assert resolve(parse_run(), environ={"FOREWARN_SINK": "stdout,file:/a"}).sink == ["stdout", "file:/a"]
    assert resolve(parse_run("--sink", "file:/b", "--sink", "stdout"), environ={}).sink == ["file:/b", "stdout"]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--poll-interval", "abc"], {}, "--poll-interval"),
    (["--poll-interval", "0.1"], {}, "at least 0.2"),
    (["--api-version", "2018-02-02"], {}, "2020-07-01"),
    (["--listen-address", "nowhere"], {}, "HOST:PORT"),
    (["--imds-endpoint", "ftp://x"], {}, "discover"),
    ([], {"FOREWARN_POLL_INTERVAL": "soon"}, "FOREWARN_POLL_INTERVAL"),
    ([], {"FOREWARN_LOG_FORMAT": "xml"}, "text, json"),
])
def test_bad_values_name_their_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(parse_run(*argv), environ=env)


def test_config_file_errors_name_file_and_position(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("poll-interval: 1\nsink: [stdout\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+, column \d+"):
        resolve(parse_run("--config", str(bad)), environ={})
    bad.write_text("pol-interval: 1\n")
    with pytest.raises(ConfigError, match="unknown option 'pol-interval'"):
        resolve(parse_run("--config", str(bad)), environ={})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(parse_run("--config", str(tmp_path / "missing.yaml")), environ={})


@pytest.mark.parametrize(("command", "text", "message"), [
    ("run", "poll_intervall: 5\n", "unknown option 'poll_intervall' (did you mean poll-interval?)"),
    ("run", "dry-runn: true\nsink: [stdout]\n", "unknown option 'dry-runn' (did you mean dry-run?)"),
    ("run", "reconcile_intervall: 60\n",
     "unknown option 'reconcile_intervall' (did you mean reconcile-interval of forewarn fleet?)"),
    ("run", "subscription: [s]\n", "unknown option 'subscription' (an option of forewarn fleet, which forewarn "
                                     "run does not take)"),
    ("fleet", "reconcile-intervall: 60\nqueue_urll: https://a.queue.core.windows.net/q\n",
     "unknown options 'reconcile-intervall' (did you mean reconcile-interval?); 'queue_urll' (did you mean "
     "queue-url?)"),
    ("fleet", "poll-interval: 1\n", "unknown option 'poll-interval' (an option of forewarn run, which forewarn "
                                      "fleet does not take)"),
])
def test_an_unknown_config_key_is_refused_with_the_nearest_option(tmp_path: Path, command: str, text: str,
                                                                   message: str) -> None:
    from forewarn.config import resolve_fleet

    config = tmp_path / "forewarn.yaml"
    config.write_text(text)
    args = build_parser().parse_args([command, "--config", str(config)])
    with pytest.raises(ConfigError) as refused:
        resolve_fleet(args, environ={}) if command == "fleet" else resolve(args, environ={})
    assert str(refused.value) == f"--config {config}: {message}"


def test_the_one_shot_commands_read_runs_config_file_and_refuse_its_misspellings(tmp_path: Path) -> None:
    from forewarn.cli import IMDS_OPTIONS

    config = tmp_path / "forewarn.yaml"
    config.write_text("imds-endpoint: http://127.0.0.1:9\npoll-interval: 2\nsink: [stdout]\n")
    settings = resolve(build_parser().parse_args(["events"]), IMDS_OPTIONS, environ={"FOREWARN_CONFIG": str(config)})
    assert settings.imds_endpoint == "http://127.0.0.1:9"
    config.write_text("imds-endpoint: http://127.0.0.1:9\nimds-timout: 2\n")
    with pytest.raises(ConfigError) as refused:
        resolve(build_parser().parse_args(["events"]), IMDS_OPTIONS, environ={"FOREWARN_CONFIG": str(config)})
    assert str(refused.value) == f"--config {config}: unknown option 'imds-timout' (did you mean imds-timeout?)"


def test_an_unknown_config_key_near_no_option_is_refused_with_the_valid_ones(tmp_path: Path) -> None:
    config = tmp_path / "forewarn.yaml"
    config.write_text("xyzzy: 1\n")
    with pytest.raises(ConfigError) as refused:
        resolve(parse_run("--config", str(config)), environ={})
    assert str(refused.value) == f"--config {config}: unknown option 'xyzzy'; valid: " + ", ".join(
        option.name for option in RUN_OPTIONS)


def test_every_run_option_has_an_environment_variable() -> None:
    assert all(option.env == "FOREWARN_" + option.name.replace("-", "_").replace(".", "_").upper()
               for option in RUN_OPTIONS)


def test_redaction_hides_credentials_and_tokens() -> None:
    assert redact_url("https://user:pw@hooks.example/x?sig=abc") == "https://<redacted>@hooks.example/x?<redacted>"
    assert redact_url("file:/var/log/x.jsonl") == "file:/var/log/x.jsonl"
    settings = resolve(parse_run("--imds-endpoint", "http://u:secretpw@127.0.0.1:1"), environ={})
    assert "secretpw" not in json.dumps(settings.redacted())


@pytest.mark.parametrize("argv", [
    ["run", "--poll-interval", "x"],
    ["run", "--sink", "kafka"],
    ["run", "--sink", "file:"],
    ["run", "--bogus"],
    ["run", "--simulate", "no-such-scenario", "--listen-address", "127.0.0.1:0"],
    ["events", "--api-version", "1999-01-01"],
    ["simulate", "--fault", "nope:1"],
    [],
])
def test_user_errors_exit_2_without_traceback(argv: list[str]) -> None:
    result = forewarn(*argv)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()


def test_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = forewarn("run", "--simulate", "quiet", "--listen-address", f"127.0.0.1:{port}")
    assert result.returncode == 2 and "--listen-address" in result.stderr and "Traceback" not in result.stderr


def test_version() -> None:
    result = forewarn("version")
    assert result.returncode == 0
    assert "forewarn 0.1.0" in result.stdout and "2020-07-01" in result.stdout and "python 3." in result.stdout


def test_events_table_and_json(simulator: Callable[..., SimulatorHandle]) -> None:
    sim = simulator("other-vm")
    wait_until(lambda: sim.sim.current()[1], timeout=5)
    table = forewarn("events", "--imds-endpoint", sim.url, "--vm-name", "vm-1")
    assert table.returncode == 0, table.stderr
    assert "Reboot" in table.stdout and "Scheduled" in table.stdout and "*vm-1" in table.stdout
    as_json = forewarn("events", "--imds-endpoint", sim.url, "--output", "json")
    document = json.loads(as_json.stdout)
    assert document["Events"][0]["Resources"] == ["vm-1"]


def test_events_reports_an_unreachable_imds_without_traceback() -> None:
    result = forewarn("events", "--imds-endpoint", f"http://127.0.0.1:{free_port()}", "--timeout", "1")
    assert result.returncode == 1
    assert "cannot read Scheduled Events" in result.stderr and "Traceback" not in result.stderr


def test_format_table_shows_countdown_and_unknown_duration() -> None:
    from datetime import datetime, timezone

    document = parse_document({"DocumentIncarnation": 3, "Events": [
        {"EventId": "E", "EventType": "Reboot", "EventStatus": "Scheduled", "Resources": ["vm-0"],
         "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "DurationInSeconds": -1}]})
    text = format_table(document, "vm-0", datetime(2022, 4, 11, 22, 12, 0, tzinfo=timezone.utc))
    assert "in 14m58s" in text and "unknown" in text and "*vm-0" in text


def test_simulate_command_serves_imds_for_the_events_command() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "simulate", "spot-preempt", "--listen-address",
                             f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def events() -> str:
            result = forewarn("events", "--imds-endpoint", f"http://127.0.0.1:{port}", "--timeout", "2")
            return result.stdout if "Preempt" in result.stdout else ""
        assert "Preempt" in wait_until(events, timeout=20, interval=0.5)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_simulate_list() -> None:
    result = forewarn("simulate", "--list")
    assert result.returncode == 0
    for name in ("live-migration", "spot-preempt", "hardware-failure", "degraded-hardware", "tour"):
        assert name in result.stdout


def test_run_simulate_serves_metrics_and_prints_records() -> None:
    import requests

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "run", "--simulate", "spot-preempt", "--speed", "10",
                             "--listen-address", f"127.0.0.1:{port}", "--poll-interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def metrics_with_event() -> str:
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
        except requests.RequestException:
            return ""
        return text if "azure_scheduled_event_info{" in text else ""

    try:
        text = wait_until(metrics_with_event, timeout=15)
        assert "azure_scheduled_events_imds_up 1.0" in text
        assert 'event_type="Preempt"' in text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert json.loads(out.splitlines()[0])["data"]["event"]["EventType"] == "Preempt"


def test_settings_has_one_typed_field_per_option_of_the_table() -> None:
    import dataclasses

    from forewarn.config import RUN_OPTIONS, Settings

    fields = {f.name for f in dataclasses.fields(Settings)} - {"sources"}
    assert fields == {option.dest for option in RUN_OPTIONS}


def test_one_shot_commands_read_the_same_options_and_variables_as_run(
        simulator: Callable[..., SimulatorHandle], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.cli import main

    sim = simulator("quiet")
    monkeypatch.setenv("FOREWARN_IMDS_ENDPOINT", sim.url)
    assert main(["events", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["DocumentIncarnation"] >= 0
    assert main(["events", "--imds-timeout", "nan"]) == 2
    assert "--imds-timeout" in capsys.readouterr().err


# --- typos: unknown variables, abbreviations, unknown flags (#37) ------------------------------------------

def environment_without_forewarn(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.upper().startswith("FOREWARN_")}, **extra}


@pytest.mark.parametrize(("command", "variable", "nearest"), [
    ("run", "FOREWARN_POLL_INTERVALL", "did you mean FOREWARN_POLL_INTERVAL, --poll-interval?"),
    ("run", "forewarn_dry_run", "did you mean FOREWARN_DRY_RUN, --dry-run?"),
    ("fleet", "FOREWARN_RECONCILE_INTERVALL", "did you mean FOREWARN_RECONCILE_INTERVAL, --reconcile-interval?"),
    ("fleet", "FOREWARN_POLL_INTERVALL", "did you mean FOREWARN_POLL_INTERVAL, --poll-interval of forewarn run?"),
])
def test_an_unknown_variable_stops_run_and_fleet_naming_the_nearest_option(command: str, variable: str,
                                                                            nearest: str) -> None:
    result = subprocess.run([sys.executable, "-m", "forewarn", command, "--simulate", "--listen-address",
                             "127.0.0.1:0"], capture_output=True, text=True, timeout=30,
                            env=environment_without_forewarn(**{variable: "5"}))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"forewarn {command}: error: unknown variable {variable} ({nearest})"), \
        result.stderr
    assert "Traceback" not in result.stderr


def test_variables_of_the_other_command_are_noted_and_forewarns_own_are_accepted() -> None:
    from datetime import datetime, timezone

    from forewarn.approval.hooks import hook_environment
    from forewarn.config import check_environment
    from forewarn.imds.instance import VmInfo

    assert check_environment({"FOREWARN_SUBSCRIPTION": "x", "FOREWARN_SINK": "stdout", "PATH": "/bin"}, "run") == [
        "FOREWARN_SUBSCRIPTION is an option of forewarn fleet (--subscription); forewarn run ignores it"]
    assert check_environment({"FOREWARN_POLL_INTERVAL": "1", "FOREWARN_SIMULATE": "tour"}, "fleet") == [
        "FOREWARN_POLL_INTERVAL is an option of forewarn run (--poll-interval); forewarn fleet ignores it"]
    # a hook gets the event's FOREWARN_* variables, and may run forewarn: they are forewarn's, never an error
    event = parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Reboot", "Resources": ["vm-0"], "EventStatus": "Scheduled",
         "NotBefore": datetime.now(timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")}]}).events[0]
    hook_variables = hook_environment("prepare", event, VmInfo(name="vm-0"), "rule")
    for command in ("run", "fleet"):
        assert check_environment({**hook_variables, "FOREWARN_CONFIG": "/etc/forewarn.yaml"}, command) == []
    with pytest.raises(ConfigError, match=r"^unknown variables FOREWARN_DRY_RUNN \(did you mean FOREWARN_DRY_RUN, "
                       r"--dry-run\?\); FOREWARN_XYZZY: "):
        check_environment({"FOREWARN_XYZZY": "1", "FOREWARN_DRY_RUNN": "1"}, "run")


def service_links(service: str, cluster_ip: str, ports: list[tuple[str, int, str]]) -> dict[str, str]:
    """The variables the kubelet gives a pod for a Service of its namespace (pkg/kubelet/envvars, service links):
    `ports` as (name, port, protocol), the first one unnamed as Kubernetes allows."""
    prefix = service.upper().replace("-", "_").replace(".", "_")
    host = f"[{cluster_ip}]" if ":" in cluster_ip else cluster_ip
    links = {f"{prefix}_SERVICE_HOST": cluster_ip, f"{prefix}_SERVICE_PORT": str(ports[0][1]),
             f"{prefix}_PORT": f"{ports[0][2].lower()}://{host}:{ports[0][1]}"}
    for name, port, protocol in ports:
        if name:
            links[f"{prefix}_SERVICE_PORT_{name.upper().replace('-', '_')}"] = str(port)
        each = f"{prefix}_PORT_{port}_{protocol}"
        links |= {each: f"{protocol.lower()}://{host}:{port}", f"{each}_PROTO": protocol.lower(),
                  f"{each}_PORT": str(port), f"{each}_ADDR": cluster_ip}
    return links


def test_variables_kubernetes_sets_for_a_forewarn_service_are_noted_not_refused() -> None:
    from forewarn.config import check_environment

    # a user's Service named forewarn-push, the chart's own "forewarn" (a named metrics port, IPv6) and a UDP one
    links = {**service_links("forewarn-push", "10.0.0.11", [("", 443, "TCP"), ("metrics-http", 9465, "TCP")]),
             **service_links("forewarn", "fd00::5", [("metrics", 9465, "TCP")]),
             **service_links("forewarn-dns", "10.0.0.10", [("", 53, "UDP"), ("sctp-x", 7, "SCTP")])}
    assert len(links) == 32
    for command in ("run", "fleet"):
        notes = check_environment({**links, "PATH": "/bin"}, command)
        assert notes == [f"{', '.join(sorted(links))}: the form of the variables Kubernetes sets for each Service of "
                         f"the pod's namespace (service links), not forewarn's; forewarn {command} ignores them "
                         "(enableServiceLinks: false in the pod spec leaves them out)"]
    # a name of those forms with a value Kubernetes would not give it is a misspelt option all the same
    for name, value in [("FOREWARN_LISTEN_PORT", "9465"), ("FOREWARN_PUSH_SERVICE_HOST", "push.example"),
                        ("FOREWARN_PUSH_PORT_443_TCP_PROTO", "https"), ("FOREWARN_PUSH_SERVICE_PORT", "https")]:
        with pytest.raises(ConfigError, match=f"^unknown variable {name}"):
            check_environment({**links, name: value}, "run")


def test_run_logs_a_variable_it_ignores_and_starts() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "forewarn", "run", "--simulate", "quiet", "--listen-address",
                             "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=environment_without_forewarn(FOREWARN_QUEUE_URL="https://a.queue.core.windows.net/q",
                                                             **service_links("forewarn-push", "10.0.0.11",
                                                                             [("", 443, "TCP")])))
    assert proc.stderr is not None
    lines: list[str] = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "polling" in line:
                break
    finally:
        proc.terminate()
        proc.wait(10)
    assert any("WARNING" in line and line.rstrip().endswith(
        "FOREWARN_QUEUE_URL is an option of forewarn fleet (--queue-url); forewarn run ignores it")
        for line in lines), lines
    assert any("WARNING" in line and "FOREWARN_PUSH_SERVICE_HOST" in line and "(service links)" in line
               for line in lines), lines


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += all_parsers(sub)
    return found


def test_no_parser_takes_an_abbreviated_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.cli import parse_arguments

    checked = 0
    top = build_parser()
    for parser in all_parsers(top):
        words = parser.prog.split()[1:]
        flags = {flag for action in parser._actions for flag in action.option_strings}
        for flag in sorted(flags):
            short = flag[:-1]
            if not flag.startswith("--") or len(short) < 4 or short in flags:
                continue
            # a positional after it, for the commands that need one; not where it would be read as a command
            value = [] if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions) else ["x"]
            with pytest.raises(SystemExit) as stopped:
                parse_arguments(top, [*words, short, *value])
            error = capsys.readouterr().err
            assert stopped.value.code == 2 and f"error: unrecognized arguments: {short}" in error, (short, error)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize(("argv", "usage", "hint"), [
    (["run", "--polll-interval", "1"], "usage: forewarn run ", "did you mean --poll-interval?"),
    (["run", "--simul", "tour", "--bogus"], "usage: forewarn run ", "did you mean --simulate?"),
    (["fleet", "--reconcile-intervall=5"], "usage: forewarn fleet ", "did you mean --reconcile-interval?"),
    (["fleet", "--poll-interval", "1"], "usage: forewarn fleet ", "--poll-interval is an option of forewarn run"),
    (["policy", "check", "--flet", "p.yaml"], "usage: forewarn policy check ", "did you mean --fleet?"),
    (["events", "--outptu", "json"], "usage: forewarn events ", "did you mean --output?"),
    (["--bogus", "run"], "usage: forewarn [-h]", ""),
])
def test_an_unknown_flag_gets_its_commands_usage_and_nearest_flag(argv: list[str], usage: str, hint: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    error = capsys.readouterr().err
    assert stopped.value.code == 2
    assert error.startswith(usage), error
    last = error.rstrip().splitlines()[-1]
    assert last.endswith(f"; {hint}" if hint else "unrecognized arguments: --bogus"), last


def test_dash_dash_version_prints_forewarns_version_and_version_says_more(
        capsys: pytest.CaptureFixture[str]) -> None:
    from forewarn import __version__
    from forewarn.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0 and capsys.readouterr().out == f"forewarn {__version__}\n"
    assert main(["version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["forewarn", "scheduled", "python"]


def test_the_readme_says_what_imds_max_backoff_help_says() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `--imds-max-backoff SECONDS`"))
    meaning = row.split("|")[3].strip().replace("`", "")
    option = next(option for option in RUN_OPTIONS if option.name == "imds-max-backoff")
    assert option.help_text.startswith(meaning), (meaning, option.help_text)
