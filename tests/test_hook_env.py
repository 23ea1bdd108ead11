"""What a command hook's process sees: a clean environment, the event's FOREWARN_* variables (safe for
any event id), and only the extra variables the policy names for it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from forewarn.approval.hooks import run_hook
from forewarn.approval.policy import Hook, PolicyError, parse_policy
from forewarn.imds.document import Event, parse_document
from forewarn.imds.instance import VmInfo

VM = VmInfo(name="vm-0", vm_id="0000")
#: Dumps its environment and its standard input (the event JSON) to the file named by its argument.
DUMP = ("import json, os, sys; json.dump({'env': dict(os.environ), 'stdin': json.load(sys.stdin)}, "
        "open(sys.argv[1], 'w'))")
LOCALE = {"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "LC_CTYPE": "C.UTF-8"}  # no locale coercion by the child
SECRETS = {"FOREWARN_EVENTHUBS_CONNECTION_STRING": "Endpoint=sb://x/;SharedAccessKey=SECRET",
           "OTEL_EXPORTER_OTLP_HEADERS": "authorization=SECRET", "AWS_SECRET_ACCESS_KEY": "SECRET",
           "PYTHONPATH": "/elsewhere", "LD_PRELOAD": "/tmp/evil.so"}


def event(event_id: str = "E1", resources: tuple[str, ...] = ("vm-0",)) -> Event:
    return parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": list(resources),
         "EventStatus": "Scheduled", "NotBefore": "Mon, 11 Apr 2022 22:26:58 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1}]}).events[0]


def dump_hook(tmp_path: Path, env: tuple[str, ...] = ()) -> tuple[Hook, Path]:
    out = tmp_path / "seen.json"
    return Hook(name="dump", command=(sys.executable, "-c", DUMP, str(out)), timeout=20, env=env), out


def seen(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(out.read_text())
    return loaded


FOREWARN_VARIABLES = {"FOREWARN_HOOK", "FOREWARN_RULE", "FOREWARN_EVENT_ID", "FOREWARN_EVENT_TYPE",
                      "FOREWARN_EVENT_STATUS", "FOREWARN_EVENT_SOURCE", "FOREWARN_NOT_BEFORE", "FOREWARN_DURATION",
                      "FOREWARN_RESOURCES", "FOREWARN_VM_NAME"}


def test_a_hook_sees_only_the_base_and_event_variables(tmp_path: Path) -> None:
    hook, out = dump_hook(tmp_path)
    environ = {"PATH": "/usr/bin:/bin", "HOME": "/home/fw", "TZ": "UTC", "LC_TIME": "C", **LOCALE, **SECRETS}
    assert run_hook(hook, "prepare", event(), VM, "drain", environ=environ) == "success"
    env = seen(out)["env"]
    assert set(env) == {"PATH", "HOME", "TZ", "LC_TIME", *LOCALE} | FOREWARN_VARIABLES
    assert env["PATH"] == "/usr/bin:/bin" and env["HOME"] == "/home/fw" and env["TZ"] == "UTC"
    assert env["FOREWARN_EVENT_ID"] == "E1" and env["FOREWARN_RULE"] == "drain"


def test_by_default_the_base_comes_from_forewarns_environment(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    hook, out = dump_hook(tmp_path)
    assert run_hook(hook, "prepare", event(), VM, "drain") == "success"
    env = seen(out)["env"]
    assert not set(SECRETS) & set(env) and "SECRET" not in json.dumps(env)
    assert "PATH" in env


def test_the_policy_passes_more_by_name(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("rules:\n  - name: drain\n    action: approve\n    prepare:\n"
                    f"      - {{command: {json.dumps([sys.executable, '-c', DUMP, str(tmp_path / 'seen.json')])}, "
                    "env: [KUBECONFIG, DRAIN_TOKEN, NOT_SET_ANYWHERE]}\n")
    (hook,) = parse_policy(path.read_text()).rules[0].prepare
    environ = {"PATH": "/usr/bin", "KUBECONFIG": "/etc/kube", "DRAIN_TOKEN": "t0k", **LOCALE, **SECRETS}
    assert run_hook(hook, "prepare", event(), VM, "drain", environ=environ) == "success"
    env = seen(tmp_path / "seen.json")["env"]
    assert env["KUBECONFIG"] == "/etc/kube" and env["DRAIN_TOKEN"] == "t0k"
    assert "NOT_SET_ANYWHERE" not in env and not set(SECRETS) & set(env)


@pytest.mark.parametrize(("event_id", "shown"), [
    ("E\x001", "E\\x001"),
    ("E1\n2026-01-01T00:00:00Z forged", "E1\\n2026-01-01T00:00:00Z forged"),
    ("E\x1b[2J\x7f\x85", "E\\x1b[2J\\x7f\\x85"),
    ("E\u2028x", "E\\u2028x"),
])
def test_any_event_id_runs_the_hook_with_an_escaped_variable(tmp_path: Path, event_id: str, shown: str) -> None:
    hook, out = dump_hook(tmp_path)
    resources = ("vm-0", "vm-\x00x")
    assert run_hook(hook, "prepare", event(event_id, resources), VM, "drain", environ=LOCALE) == "success"
    got = seen(out)
    assert got["env"]["FOREWARN_EVENT_ID"] == shown
    assert got["env"]["FOREWARN_RESOURCES"] == "vm-0,vm-\\x00x"
    assert got["stdin"]["event"]["EventId"] == event_id  # the JSON carries the exact value


def test_a_nul_in_a_command_argument_is_refused_when_loading() -> None:
    with pytest.raises(PolicyError, match=r"p.yaml:5: rules\[0\].prepare\[0\].command\[1\]: contains a NUL"):
        parse_policy('rules:\n  - name: a\n    action: approve\n    prepare:\n      - {command: [x, "a\\0b"]}\n',
                     "p.yaml")


def test_a_hook_that_cannot_start_is_an_error_not_an_exception(tmp_path: Path) -> None:
    hook = Hook(name="broken", command=("x\x00y",), timeout=5)
    assert run_hook(hook, "prepare", event(), VM, "drain", environ=LOCALE) == "error"
