#!/usr/bin/env python3
"""The floors of forewarn's direct dependencies, read from pyproject.toml, and the tests run on them.

pyproject.toml's lower bounds are a promise: forewarn works with each direct dependency at its floor.
scripts/test keeps it by installing forewarn with every runtime extra into a second venv (.cache/venv-floor) with
each direct dependency pinned to its floor (the constraints printed here, never kept by hand), and running
there the tests that exercise those libraries (FLOOR_TESTS below). The main .venv has the newest releases.

    scripts/floors.py constraints   # name==floor for every direct dependency, for `pip install -c`
    scripts/floors.py install       # what the floor venv installs: forewarn[all] and the test tools it needs
    scripts/floors.py tests         # the tests run there (pytest node ids), one a line
"""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip carries the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

#: The extra of test tools; every other extra is a runtime one (what `forewarn[all]` installs).
TEST_EXTRA = "test"

#: The test tools the floor venv installs, at their floors from the test extra: the runner, Hypothesis (the
#: property tests), prometheus-client (the reference the exposition tests compare forewarn with), cryptography
#: (the certificates of the TLS peers) and kubernetes-validate (the schemas of tests/peers/kube_api.py).
FLOOR_TEST_TOOLS = ("pytest", "hypothesis", "prometheus-client", "cryptography", "kubernetes-validate")

#: The tests run in the floor venv (pytest node ids), and why each: every one exercises a library at its floor
#: through forewarn's own code (imports, API calls, wire formats, the messages forewarn passes on); forewarn's
#: logic alone is the main venv's business. Kept to about a minute of tests: it is paid on every CI run.
FLOOR_TESTS: dict[str, str] = {
    "tests/test_dependency_floors.py": "every module imports, and what is installed is the floors",
    "tests/test_amqp_wire.py": "azure-eventhub: forewarn's AMQP encoding against the SDK's, byte for byte, and "
                               "the real producer against the local AMQP peer (UseDevelopmentEmulator)",
    "tests/test_otlp_wire.py::test_the_request_is_the_sdks_request_byte_for_byte":
        "opentelemetry-sdk: forewarn's OTLP encoding against the SDK's, byte for byte",
    "tests/test_otlp_wire.py::test_the_grpc_sinks_request_is_the_sdks_request_byte_for_byte":
        "opentelemetry-exporter-otlp-proto-grpc: the request the gRPC sink sends",
    "tests/test_otlp_wire.py::test_the_exporter_sends_the_encoded_bytes_through_its_own_client":
        "opentelemetry-exporter-otlp-proto-*: the exporter's private client, which the sink hands its bytes",
    "tests/test_otlp_wire.py::test_any_json_value_encodes_as_the_sdk_encodes_it":
        "opentelemetry-sdk: every JSON value as the SDK encodes it (Hypothesis)",
    "tests/test_secrets.py": "the OTLP exporter's and the Azure SDK's own log messages, which forewarn filters",
    "tests/test_notify_logs.py": "azure-monitor-ingestion and azure-identity (managed identity): rows, chunks, "
                                 "tokens, a private CA through requests",
    "tests/test_notify.py::test_webhook_posts_cloudevents_the_sdk_parses": "cloudevents and requests",
    "tests/test_notify.py::test_template_renders_in_a_sandbox_and_is_checked_at_start": "jinja2's sandbox",
    "tests/test_notify.py::test_bad_templates_stop_the_start_with_one_line": "jinja2's errors, passed on",
    "tests/test_kube_transport.py": "lightkube's client over forewarn's own transport (httpx2)",
    "tests/test_node_actions.py": "lightkube: cordon, drain, events and the node's ledger",
    "tests/test_fleet_lease.py": "lightkube: the fleet's Lease",
    "tests/test_fleet_nodes.py": "lightkube: the fleet's node list",
    "tests/test_fleet_queue.py": "azure-storage-queue against Azurite (skipped without npm)",
    "tests/test_fleet_resourcegraph.py": "azure-core: Resource Graph through its pipeline",
    "tests/test_metrics_core.py": "prometheus-client, the reference: the exposition and the Accept negotiation",
    "tests/test_policy.py": "jsonschema and PyYAML: policy errors as jsonschema words them",
    "tests/test_records.py": "jsonschema: the record schema",
    "tests/test_web_tls.py::test_basic_auth_over_tls_takes_the_right_password_and_refuses_others_with_401":
        "bcrypt (and cryptography for the test's certificates)",
}


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        project: dict[str, object] = tomllib.load(file)["project"]
        return project


def requirements() -> dict[str, list[Requirement]]:
    """pyproject.toml's direct requirements by group: "" (the core) and each extra; forewarn's own
    self-references (`forewarn[...]` in `all` and `slim`) left out."""
    project = _pyproject()
    groups: dict[str, list[str]] = {"": list(project.get("dependencies", []))}  # type: ignore[call-overload]
    groups.update(project.get("optional-dependencies", {}))  # type: ignore[call-overload]
    return {group: [r for r in map(Requirement, reqs) if canonicalize_name(r.name) != "forewarn"]
            for group, reqs in groups.items()}


def floor(requirement: Requirement) -> str | None:
    """The version a requirement's lower bound names (`>=X` or `==X`), or None without one."""
    for spec in requirement.specifier:
        if spec.operator in (">=", "==", "~="):
            return spec.version
    return None


def floors() -> dict[str, str]:
    """Every direct dependency's floor, by canonical name: the runtime ones (core and every runtime extra)
    and FLOOR_TEST_TOOLS from the test extra. A dependency named in several runtime extras must have one
    floor in all of them (tests/test_dependency_floors.py checks it); the highest is taken here."""
    result: dict[str, str] = {}
    for group, reqs in requirements().items():
        for req in reqs:
            name = canonicalize_name(req.name)
            version = floor(req)
            if version is None:
                continue
            if group == TEST_EXTRA and name not in map(canonicalize_name, FLOOR_TEST_TOOLS):
                continue
            if name not in result or _key(version) > _key(result[name]):
                result[name] = version
    return dict(sorted(result.items()))


def _key(version: str) -> Version:
    return Version(version)


def main(argv: list[str]) -> int:
    if argv == ["constraints"]:
        print("# Generated by scripts/floors.py from pyproject.toml's lower bounds; do not edit.")
        for name, version in floors().items():
            print(f"{name}=={version}")
    elif argv == ["install"]:
        print("-e .[all]")
        for tool in FLOOR_TEST_TOOLS:
            print(tool)
    elif argv == ["tests"]:
        for path in FLOOR_TESTS:
            print(path)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
