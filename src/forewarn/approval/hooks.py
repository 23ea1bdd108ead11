"""Prepare and recover hooks: the user's own commands and webhooks, run around an approval.

A command is an argument list and runs without a shell (no quoting surprises, no injection through event
fields). It gets the event as JSON on standard input and a clean environment: PATH, HOME, LANG, LC_*, TZ
from forewarn's, the `FOREWARN_*` event variables, and only the variables its policy entry names in `env`
(forewarn's own environment holds secrets: connection strings, OTLP headers). A webhook gets the same
JSON as a POST body. Success is exit status 0 or an HTTP 2xx within the timeout.
Output is logged (truncated); webhook URLs are logged as scheme and host only, since they often carry a
token.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Mapping
from typing import Any

from forewarn import __version__
from forewarn.approval.policy import Hook
from forewarn.config import safe_url
from forewarn.imds.document import Event
from forewarn.imds.instance import VmInfo
from forewarn.logs import escape_controls

log = logging.getLogger(__name__)

OUTPUT_LIMIT = 2000
#: What every command hook inherits from forewarn's environment (when set), besides LC_* and its `env` list.
BASE_VARIABLES = ("PATH", "HOME", "LANG", "TZ")


def hook_payload(kind: str, event: Event, vm: VmInfo, rule: str | None) -> dict[str, Any]:
    return {"hook": kind, "rule": rule, "event": dict(event.raw), "vm": vm.known()}


def hook_environment(kind: str, event: Event, vm: VmInfo, rule: str | None) -> dict[str, str]:
    """The FOREWARN_* variables. Values come from IMDS and may hold anything: an environment value cannot
    hold NUL (starting the process would fail), and a newline would let the value forge lines in whatever
    the hook logs, so control characters are escaped (`\\n`, `\\x00`); the JSON on standard input keeps
    the exact values."""
    values = {
        "FOREWARN_HOOK": kind,
        "FOREWARN_RULE": rule or "",
        "FOREWARN_EVENT_ID": event.event_id,
        "FOREWARN_EVENT_TYPE": event.event_type,
        "FOREWARN_EVENT_STATUS": event.status,
        "FOREWARN_EVENT_SOURCE": event.source or "",
        "FOREWARN_NOT_BEFORE": event.raw.get("NotBefore", "") if isinstance(event.raw.get("NotBefore"), str) else "",
        "FOREWARN_DURATION": "" if event.duration_seconds is None else str(event.duration_seconds),
        "FOREWARN_RESOURCES": ",".join(event.resources),
        "FOREWARN_VM_NAME": vm.name,
    }
    return {name: escape_controls(value) for name, value in values.items()}


def command_environment(hook: Hook, kind: str, event: Event, vm: VmInfo, rule: str | None,
                        environ: Mapping[str, str]) -> dict[str, str]:
    """A command hook's whole environment, built from `environ` (forewarn's): the base variables, the
    names the hook lists, then the event variables, which nothing can override."""
    passed = {name: value for name, value in environ.items()
              if name in BASE_VARIABLES or name.startswith("LC_") or name in hook.env}
    return {**passed, **hook_environment(kind, event, vm, rule)}


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= OUTPUT_LIMIT else text[:OUTPUT_LIMIT] + " [...]"


def run_hook(hook: Hook, kind: str, event: Event, vm: VmInfo, rule: str | None,
             environ: Mapping[str, str] | None = None) -> str:
    """Run one hook; returns its result: `success`, `failure`, `timeout` or `error` (could not start)."""
    payload = json.dumps(hook_payload(kind, event, vm, rule))
    label = f"{kind} hook {hook.name} for {event.event_id}"
    if hook.webhook:
        import requests  # only for webhook hooks: a policy of command hooks never loads it (about 5 MiB)

        try:
            response = requests.post(hook.webhook, data=payload, timeout=hook.timeout,
                                     headers={"Content-Type": "application/json",
                                              "User-Agent": f"forewarn/{__version__}"})
        except requests.Timeout:
            log.error("%s: %s did not answer within %g s", label, safe_url(hook.webhook), hook.timeout)
            return "timeout"
        except requests.RequestException as exc:
            log.error("%s: %s failed: %s", label, safe_url(hook.webhook), type(exc).__name__)
            return "error"
        if 200 <= response.status_code < 300:
            log.info("%s: %s answered %d", label, safe_url(hook.webhook), response.status_code)
            return "success"
        log.error("%s: %s answered %d: %s", label, safe_url(hook.webhook), response.status_code,
                  _clip(response.text))
        return "failure"

    env = command_environment(hook, kind, event, vm, rule, os.environ if environ is None else environ)
    try:
        done = subprocess.run(list(hook.command), input=payload, capture_output=True, text=True,
                              timeout=hook.timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.error("%s: %s still running after %g s, killed; output: %s", label, hook.command[0], hook.timeout,
                  _clip(output) or "(none)")
        return "timeout"
    except OSError as exc:
        log.error("%s: cannot run %s: %s", label, hook.command[0], exc.strerror or exc)
        return "error"
    except ValueError as exc:  # e.g. a NUL in an argument or a passed variable: counted, never a stalled hook
        log.error("%s: cannot run %s: %s", label, hook.command[0], exc)
        return "error"
    output = _clip((done.stdout or "") + (done.stderr or ""))
    if done.returncode == 0:
        log.info("%s: %s succeeded%s", label, hook.command[0], f"; output: {output}" if output else "")
        return "success"
    log.error("%s: %s exited with %d; output: %s", label, hook.command[0], done.returncode, output or "(none)")
    return "failure"
