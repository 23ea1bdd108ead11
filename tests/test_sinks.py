"""Sink construction: specs, configuration errors, and heavy imports only when a sink needs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forewarn.config import ConfigError
from forewarn.sinks import SinkConfigError, build_sink, build_sinks

PROBE = """
import sys
from forewarn.sinks import build_sinks
build_sinks({specs!r})
heavy = sorted({{m.split('.')[0] + '.' + m.split('.')[1] if '.' in m else m for m in sys.modules
                if m.startswith(('azure.eventhub', 'azure.identity', 'opentelemetry', 'grpc'))}})
print(','.join(heavy))
"""


def loaded_after(specs: list[str], env: dict[str, str] | None = None) -> set[str]:
    import os

    result = subprocess.run([sys.executable, "-c", PROBE.format(specs=specs)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, **(env or {})}, check=True)
    return {name for name in result.stdout.strip().split(",") if name}


def test_heavy_libraries_load_only_for_the_sinks_that_need_them() -> None:
    assert loaded_after(["stdout", "file:/tmp/forewarn-probe.jsonl"]) == set()
    otlp = loaded_after(["otlp"])
    assert "opentelemetry.sdk" in otlp and not any(m.startswith("azure") for m in otlp)


def test_eventhubs_loads_only_azure() -> None:
    probe = PROBE.replace("build_sinks({specs!r})", "from forewarn.sinks.eventhubs import EventHubsSink\n"
                          "EventHubsSink(connection_string='Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=a;"
                          "SharedAccessKey=b;EntityPath=h;UseDevelopmentEmulator=true')")
    result = subprocess.run([sys.executable, "-c", probe.format(specs=[])], capture_output=True, text=True,
                            timeout=60, check=True)
    loaded = set(result.stdout.strip().split(","))
    assert "azure.eventhub" in loaded and not any(m.startswith(("opentelemetry", "grpc")) for m in loaded)


@pytest.mark.parametrize(("spec", "message"), [
    ("kafka", "not a known sink; valid: stdout, file:PATH, otlp, eventhubs"),
    ("file:", "needs a path"),
    ("stdout:x", "not a known sink"),
    ("eventhubs", "needs FOREWARN_EVENTHUBS_CONNECTION_STRING"),
])
def test_bad_specs_name_what_is_valid(spec: str, message: str) -> None:
    with pytest.raises(SinkConfigError, match=message):
        build_sink(spec, {})


def test_build_sinks_names_the_option_and_refuses_a_sink_given_twice(tmp_path: Path) -> None:
    target = str(tmp_path / "records.jsonl")
    sinks = build_sinks(["stdout", f"file:{target}"])
    assert [sink.name for sink in sinks] == ["stdout", f"file:{target}"]
    for sink in sinks:
        sink.close()
    with pytest.raises(ConfigError, match="--sink file:PATH needs a path"):
        build_sinks(["stdout", "file:"])
    with pytest.raises(ConfigError, match="--sink: the same sink is given twice"):
        build_sinks([f"file:{target}", "stdout", f"file:{target}"])


def test_the_file_sink_logs_the_directories_it_creates(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import json
    from datetime import datetime, timezone

    from forewarn.imds.document import parse_document
    from forewarn.imds.instance import VmInfo
    from forewarn.records import to_record
    from forewarn.sinks.file import FileSink
    from forewarn.tracker import diff_documents

    document = parse_document({"DocumentIncarnation": 1, "Events": [
        {"EventId": "E1", "EventType": "Reboot", "Resources": ["vm-0"], "EventStatus": "Scheduled", "NotBefore": ""}]})
    records = [to_record(change, VmInfo(name="vm-0"), datetime.now(timezone.utc))
               for change in diff_documents(None, document)]
    target = tmp_path / "a" / "b" / "records.jsonl"
    sink = FileSink(str(target))
    with caplog.at_level("INFO", logger="forewarn.sinks.file"):
        sink.send(records)
        sink.send(records)
        FileSink(str(tmp_path / "records.jsonl")).send(records)
    assert [r.getMessage() for r in caplog.records] == [
        f"sink file:{target}: created the missing directory {tmp_path / 'a'} (down to {tmp_path / 'a' / 'b'})"]
    assert [json.loads(line)["subject"] for line in target.read_text().splitlines()] == ["E1", "E1"]
    caplog.clear()
    (tmp_path / "one").mkdir()
    with caplog.at_level("INFO", logger="forewarn.sinks.file"):
        FileSink(str(tmp_path / "one" / "two" / "r.jsonl")).send(records)
    assert [r.getMessage() for r in caplog.records] == [
        f"sink file:{tmp_path / 'one' / 'two' / 'r.jsonl'}: created the missing directory {tmp_path / 'one' / 'two'}"]
