"""Bad numbers, ports, paths and files: every one ends in exit 2 with one line naming where it came from and what
is valid, never a traceback, a hang or a silently odd run (issue 13, part A)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from forewarn.cli import build_parser, main
from forewarn.config import RUN_OPTIONS, parse_listen_address, resolve

EXAMPLE_POLICY = Path(__file__).parent.parent / "examples" / "policies" / "docs-sample.yaml"

#: The documented range of every numeric `forewarn run` option: (lowest, highest, whole numbers only).
RANGES: dict[str, tuple[str, str, bool]] = {
    "poll-interval": ("0.2", "3600", False),
    "imds-timeout": ("0.1", "600", False),
    "imds-max-backoff": ("0.2", "3600", False),
    "imds-max-reply-bytes": ("65536", "268435456", True),
    "web-read-timeout": ("0.1", "600", False),
    "web-max-connections": ("1", "1024", True),
    "web-max-request-bytes": ("1024", "1048576", True),
    "drain-timeout": ("0", "600", False),
    "outbox-max-records": ("100", "10000000", True),
    "ready-window": ("1", "86400", False),
    "compute-refresh": ("10", "86400", False),
    "speed": ("0.01", "10000", False),
    "probe.lb-lead-time": ("0", "86400", False),
    "probe.lb-freeze-threshold": ("0", "86400", False),
    **{f"{kind}-rate-limit": ("0", "10000", False) for kind in ("webhook", "slack", "teams", "template")},
}


def _numeric_options() -> list[str]:
    return [option.name for option in RUN_OPTIONS
            if isinstance(option.default, (int, float)) and not isinstance(option.default, bool)]


def _outside(name: str) -> list[str]:
    """Values just outside the option's range, and text that is not a number of the right kind."""
    low, high, whole = RANGES[name]
    below = str(int(low) - 1) if whole else ("-1" if float(low) == 0 else str(float(low) / 2))
    above = str(int(high) * 2) if whole else str(float(high) + 1)
    return [below, above, "12abc", "", *(["1.5", "1e3"] if whole else [])]


#: Each numeric option with each kind of bad value, as a command-line flag would carry it.
BAD_VALUES = [(name, value) for name in RANGES for value in ["nan", "inf", "-inf", *_outside(name)]]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own FOREWARN_* variables must not change what these tests see."""
    for key in list(os.environ):
        if key.startswith("FOREWARN_"):
            monkeypatch.delenv(key)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port already listening: if a bad value were accepted, `run` would stop at once with a
    --listen-address error (naming the wrong option) instead of running inside the test."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """`forewarn ARGV` in this process: the exit code and stderr. Any other exception fails the test."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    return code, err


def forewarn(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items() if not key.startswith("FOREWARN_")}
    return subprocess.run([sys.executable, "-m", "forewarn", *args], capture_output=True, text=True, timeout=30,
                          env={**clean, **(env or {})})


def assert_usage_error(code: int, err: str, *named: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    for text in named:
        assert text in err, f"{text!r} not in {err!r}"


def run_argv(tmp_path: Path, port: int, *extra: str) -> list[str]:
    return ["run", "--imds-endpoint", "http://127.0.0.1:9", "--listen-address", f"127.0.0.1:{port}",
            "--state-dir", str(tmp_path / "state"), *extra]


def test_every_numeric_run_option_has_a_documented_range(capsys: pytest.CaptureFixture[str]) -> None:
    # A numeric option added later must come with a range: here, in its converter and in its help.
    assert sorted(_numeric_options()) == sorted(RANGES)
    for option in RUN_OPTIONS:
        if option.name in RANGES:
            low, high, whole = RANGES[option.name]
            declared = tuple(getattr(option.convert, key, None) for key in ("low", "high", "whole"))
            assert declared == (float(low), float(high), whole), option.name
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    for name, (low, high, _) in RANGES.items():
        assert f"{low} to {high}" in shown, name


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_number_in_a_flag(tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
                              name: str, value: str) -> None:
    low, high, _ = RANGES[name]
    code, err = cli(capsys, *run_argv(tmp_path, busy_port, f"--{name}={value}"))
    assert_usage_error(code, err, f"--{name}", repr(value), f"{low} to {high}")
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_number_in_an_environment_variable(tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    env = "FOREWARN_" + name.replace("-", "_").replace(".", "_").upper()
    monkeypatch.setenv(env, value)
    code, err = cli(capsys, *run_argv(tmp_path, busy_port))
    assert_usage_error(code, err, env, f"--{name}", repr(value))


#: YAML spellings: .nan/.inf are YAML floats, the rest are read as numbers or strings as YAML sees fit.
YAML_SPELLING = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_bad_number_in_the_config_file(tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
                                       name: str, value: str) -> None:
    config = tmp_path / "forewarn.yaml"
    config.write_text(f"{name}: {YAML_SPELLING.get(value, value)}\n")
    code, err = cli(capsys, *run_argv(tmp_path, busy_port, "--config", str(config)))
    assert_usage_error(code, err, str(config), name, RANGES[name][1])


def test_non_finite_numbers_end_to_end(tmp_path: Path, busy_port: int) -> None:
    # The real program: exit code and stderr as a shell or a service manager sees them.
    config = tmp_path / "forewarn.yaml"
    config.write_text("poll-interval: .inf\n")
    results = [
        forewarn(*run_argv(tmp_path, busy_port, "--poll-interval", "nan")),
        forewarn(*run_argv(tmp_path, busy_port), env={"FOREWARN_IMDS_TIMEOUT": "inf"}),
        forewarn(*run_argv(tmp_path, busy_port, "--config", str(config))),
        forewarn(*run_argv(tmp_path, busy_port, "--simulate", "quiet", "--speed", "nan")),
    ]
    named = ["--poll-interval", "FOREWARN_IMDS_TIMEOUT", "forewarn.yaml", "--speed"]
    for result, option in zip(results, named, strict=True):
        assert_usage_error(result.returncode, result.stderr, option)
        assert "forewarn run: error:" in result.stderr


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:99999", "http://127.0.0.1:0", "http://127.0.0.1:port",
                                      "http://[::1", "http://127.0.0.1:-5", "http://a\tb:80"])
@pytest.mark.parametrize("command", [["run"], ["events"], ["approve", "X1"],
                                     ["policy", "explain", str(EXAMPLE_POLICY)]])
def test_bad_imds_endpoint(tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
                           command: list[str], endpoint: str) -> None:
    argv = [*command, "--imds-endpoint", endpoint]
    if command == ["run"]:
        argv += ["--listen-address", f"127.0.0.1:{busy_port}", "--state-dir", str(tmp_path / "s")]
    code, err = cli(capsys, *argv)
    assert_usage_error(code, err, "--imds-endpoint")


def test_port_out_of_range_in_a_one_shot_command_end_to_end() -> None:
    result = forewarn("events", "--imds-endpoint", "http://127.0.0.1:99999")
    assert_usage_error(result.returncode, result.stderr, "--imds-endpoint", "1 to 65535")


@pytest.mark.parametrize("address", ["127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:", "[zz]:80", "[::1:80",
                                     "a b:80", "host:80:80", "x" * 300 + ":80"])
def test_bad_listen_address(tmp_path: Path, capsys: pytest.CaptureFixture[str], address: str) -> None:
    code, err = cli(capsys, "run", "--imds-endpoint", "http://127.0.0.1:9", "--listen-address", address,
                    "--state-dir", str(tmp_path / "s"))
    assert_usage_error(code, err, "--listen-address", "HOST:PORT")
    code, err = cli(capsys, "simulate", "--listen-address", address)
    assert_usage_error(code, err, "--listen-address", "HOST:PORT")


def test_control_character_in_listen_address_from_the_config_file(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "forewarn.yaml"
    config.write_text('listen-address: "bad\\0host:0"\n')
    code, err = cli(capsys, "run", "--imds-endpoint", "http://127.0.0.1:9", "--config", str(config),
                    "--state-dir", str(tmp_path / "s"))
    assert_usage_error(code, err, "listen-address", str(config))


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "-1", "0", "601", "soon"])
@pytest.mark.parametrize("command", [["events"], ["approve", "X1"], ["policy", "explain", str(EXAMPLE_POLICY)]])
def test_bad_timeout_of_a_one_shot_command(capsys: pytest.CaptureFixture[str], command: list[str],
                                           timeout: str) -> None:
    # Port 9 (discard) is closed on loopback: an accepted timeout would end in exit 1, not 2.
    code, err = cli(capsys, *command, "--imds-endpoint", "http://127.0.0.1:9", f"--timeout={timeout}")
    assert_usage_error(code, err, "--timeout", "0.1 to 600")


@pytest.mark.parametrize("speed", ["nan", "inf", "-inf", "0", "-1", "10001", "fast"])
def test_bad_simulator_speed(busy_port: int, capsys: pytest.CaptureFixture[str], speed: str) -> None:
    code, err = cli(capsys, "simulate", "quiet", "--listen-address", f"127.0.0.1:{busy_port}", f"--speed={speed}")
    assert_usage_error(code, err, "--speed", "0.01 to 10000")


@pytest.mark.parametrize("seed", ["1e3", "1.5", "-1", "nan", str(2**64), "seven"])
def test_bad_simulator_seed(busy_port: int, capsys: pytest.CaptureFixture[str], seed: str) -> None:
    code, err = cli(capsys, "simulate", "quiet", "--listen-address", f"127.0.0.1:{busy_port}", f"--seed={seed}")
    assert_usage_error(code, err, "--seed", "0 to 4294967295")


def test_simulator_accepts_numbers_inside_the_range(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    # Good values pass the argument checks and reach the listen step (busy here, so it ends at once).
    code, err = cli(capsys, "simulate", "quiet", "--listen-address", f"127.0.0.1:{busy_port}", "--speed", "0.01",
                    "--seed", "4294967295")
    assert_usage_error(code, err, "--listen-address", "cannot listen")


def test_config_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("# caf\u00e9 settings\npoll-interval: 2\n".encode("latin-1"))
    code, err = cli(capsys, "run", "--config", str(config))
    assert_usage_error(code, err, str(config), "not UTF-8", "0xe9", "offset 5")


def test_document_file_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = tmp_path / "doc.json"
    document.write_bytes(b'{"DocumentIncarnation": 1, "Events": []}\xff')
    code, err = cli(capsys, "policy", "explain", str(EXAMPLE_POLICY), "--document", str(document), "--vm-name", "v")
    assert_usage_error(code, err, "--document", str(document), "not UTF-8", "0xff", "offset 40")


def test_connection_string_file_that_is_not_utf8_names_the_file_but_no_content(
        tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "connstr"
    secret.write_bytes(b"Endpoint=sb://x/;SharedAccessKey=TOPSECRET\xfe")
    code, err = cli(capsys, *run_argv(tmp_path, busy_port, "--eventhubs-connection-string-file", str(secret)))
    assert_usage_error(code, err, "--eventhubs-connection-string-file", str(secret), "not UTF-8")
    assert "TOPSECRET" not in err and "0xfe" not in err


@pytest.mark.parametrize("source", ["flag", "env", "config"])
@pytest.mark.parametrize("extra", [[], ["--simulate", "quiet"]])
def test_empty_state_dir_is_refused(tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch, source: str, extra: list[str]) -> None:
    # An empty path used to mean "in memory" while azure_scheduled_events_state_writable said 1.
    argv = ["run", "--imds-endpoint", "http://127.0.0.1:9", "--listen-address", f"127.0.0.1:{busy_port}", *extra]
    if source == "flag":
        argv += ["--state-dir", ""]
    elif source == "env":
        monkeypatch.setenv("FOREWARN_STATE_DIR", "")
    else:
        config = tmp_path / "forewarn.yaml"
        config.write_text("state-dir: ''\n")
        argv += ["--config", str(config)]
    code, err = cli(capsys, *argv)
    assert_usage_error(code, err, "--state-dir", "directory")


@pytest.mark.parametrize("endpoint", ["http://user:hunter2@127.0.0.1:99999", "http://127.0.0.1:99999/?sig=hunter2",
                                      "http://user:hunter2@[::1"])
@pytest.mark.parametrize("command", [["run"], ["events"]])
def test_refused_endpoint_is_shown_without_its_credentials(tmp_path: Path, busy_port: int,
                                                           capsys: pytest.CaptureFixture[str], command: list[str],
                                                           endpoint: str) -> None:
    argv = [*command, "--imds-endpoint", endpoint]
    if command == ["run"]:
        argv += ["--listen-address", f"127.0.0.1:{busy_port}", "--state-dir", str(tmp_path / "s")]
    code, err = cli(capsys, *argv)
    assert_usage_error(code, err, "--imds-endpoint", "127.0.0.1" if "127" in endpoint else "http://")
    assert "hunter2" not in err


def test_both_ends_of_each_range_and_every_default_are_accepted() -> None:
    for option in RUN_OPTIONS:
        if option.name in RANGES:
            low, high, _ = RANGES[option.name]
            assert float(low) <= option.default <= float(high), option.name
            for value in (low, high):
                args = build_parser().parse_args(["run", f"--{option.name}={value}"])
                assert resolve(args, environ={}).values[option.dest] == float(value), option.name


@pytest.mark.parametrize(("address", "parsed"), [
    (":9465", ("", 9465)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("localhost:65535", ("localhost", 65535)),
    ("[::]:9465", ("::", 9465)), ("[fe80::1%eth0]:80", ("fe80::1%eth0", 80)),
    ("my-host.example.:1", ("my-host.example.", 1)),
])
def test_usual_listen_addresses_are_accepted(address: str, parsed: tuple[str, int]) -> None:
    assert parse_listen_address(address) == parsed
