"""The container image, built from the Dockerfile and run the way a cluster runs it.

scripts/image.py makes a Debian base from Debian's packages (registries of container images are out of reach
here), builds the Dockerfile with buildah, unchanged but for its BASE argument, and runs the image with the
root filesystem read-only, as UID 65532, every capability dropped, the state dir the only writable path.
These tests check what users get: `forewarn version` and `--version`, the HEALTHCHECK command passing against
`forewarn run --simulate`, /metrics answering from inside, nothing of the build left behind, the slim
variant, and the arm64 image where this machine can run arm64 programs (qemu-user-static).

Needs root, buildah, podman and mmdebstrap: scripts/test installs them (skipped with a reason elsewhere).
A base already in buildah's storage is reused; the images are built anew on every run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from forewarn import __version__

from conftest import require_tool, wait_until

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "scripts" / "image.py"
pytestmark = pytest.mark.slow

#: The tags these tests build (apart from a release's localhost/forewarn:VERSION a maintainer may build).
FULL, SLIM, FULL_ARM64 = "localhost/forewarn-test:full", "localhost/forewarn-test:slim", "localhost/forewarn-test:arm64"
UID = 65532
#: Names that are build tools wherever they are (the base has none either).
BUILD_TOOLS = {"gcc", "cc", "c++", "g++", "make", "ld", "as", "cpp", "clang", "rustc", "cargo"}


def image_tools() -> None:
    if os.geteuid() != 0:
        pytest.skip("building and running images needs root (buildah storage, mount and PID namespaces)")
    for tool in ("buildah", "podman", "mmdebstrap"):
        require_tool(tool, f"Debian package {tool}, installed by scripts/test")
    for tool in ("unshare", "nsenter"):
        require_tool(tool, "Debian package util-linux")


def image_cli(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"scripts/image.py {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def has_image(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True,
                          timeout=60).returncode == 0


def base_image(arch: str) -> str:
    name = f"localhost/forewarn-test-base:bookworm-{arch}"
    if not has_image(name):
        image_cli("base", "--arch", arch, "--tag", name, timeout=1800)
    return name


@dataclass
class Image:
    name: str
    config: dict[str, Any]
    build_seconds: float

    def run(self, *args: str, entrypoint: str | None = None, state: Path | None = None,
            timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        options = [*(["--entrypoint", entrypoint] if entrypoint else []), *(["--state", str(state)] if state else [])]
        return image_cli("run", self.name, *options, "--", *args, timeout=timeout, check=check)

    def python(self, code: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("-c", code, entrypoint="python", **kwargs)


def build(arch: str, extras: str, tag: str) -> Image:
    base = base_image(arch)
    started = time.monotonic()
    image_cli("build", "--arch", arch, "--base", base, "--extras", extras, "--tag", tag, timeout=3600)
    seconds = time.monotonic() - started
    info = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", tag], capture_output=True,
                                     text=True, check=True, timeout=60).stdout)
    config = dict(info["OCIv1"]["config"])
    config["Healthcheck"] = ((info.get("Docker") or {}).get("config") or {}).get("Healthcheck")
    config["Architecture"] = info["OCIv1"]["architecture"]
    return Image(tag, config, seconds)


@pytest.fixture(scope="module")
def full() -> Iterator[Image]:
    image_tools()
    yield build("amd64" if os.uname().machine == "x86_64" else "arm64", "all", FULL)
    subprocess.run(["buildah", "rmi", "--prune"], capture_output=True, timeout=300)  # the replaced builds


@pytest.fixture(scope="module")
def slim(full: Image) -> Image:
    return build(full.config["Architecture"], "slim", SLIM)


def state_dir(tmp_path: Path) -> Path:
    """The volume on the state dir, owned by the image's user (as Kubernetes' fsGroup makes it)."""
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, UID, UID)
    return state


# --- version and labels --------------------------------------------------------------------------------

def test_version_and_labels(full: Image) -> None:
    for args in (["version"], ["--version"]):
        out = full.run(*args).stdout
        assert out.splitlines()[0] == f"forewarn {__version__}", (args, out)
    labels = full.config["Labels"]
    assert labels["org.opencontainers.image.version"] == __version__
    assert labels["io.forewarn.extras"] == "all"
    assert full.config["User"] == f"{UID}:{UID}"
    assert full.config["Entrypoint"] == ["forewarn"] and full.config["Cmd"] == ["run"]


# --- how it runs ----------------------------------------------------------------------------------------

PROBE = """
import json, os
def attempt(path):
    try:
        with open(os.path.join(path, "probe"), "w") as f:
            f.write("x")
        return "written"
    except OSError as exc:
        return exc.strerror
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
    "caps": {k: v.strip() for k, v in status.items() if k.startswith("Cap")},
    "no_new_privs": status["NoNewPrivs"].strip(),
    "writes": {p: attempt(p) for p in ("/", "/tmp", "/etc", "/opt/forewarn/bin", os.environ["FOREWARN_STATE_DIR"])},
}))
"""


def test_it_runs_as_65532_on_a_read_only_root_with_no_capabilities(full: Image, tmp_path: Path) -> None:
    state = state_dir(tmp_path)
    report = json.loads(full.python(PROBE, state=state).stdout)
    assert report["ids"] == [UID, UID, UID, []]
    assert report["caps"] == {name: "0000000000000000" for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    assert report["no_new_privs"] == "1"
    writes = report["writes"]
    assert writes.pop("/var/lib/forewarn") == "written"  # the state dir, and nothing else
    assert set(writes.values()) == {"Read-only file system"}, writes
    assert (state / "probe").stat().st_uid == UID


def test_the_healthcheck_passes_and_metrics_answer_from_inside(full: Image, tmp_path: Path) -> None:
    healthcheck = full.config["Healthcheck"]
    assert healthcheck and healthcheck["Test"][0] == "CMD", "built with --format docker, the HEALTHCHECK is kept"
    # nothing listens yet: the same check fails, so a pass below means the agent answered
    assert image_cli("healthcheck", full.name, check=False, timeout=60).returncode != 0

    state, pidfile, out = state_dir(tmp_path), tmp_path / "container.pid", tmp_path / "stdout"
    with out.open("w") as stdout, (tmp_path / "stderr").open("w") as stderr:
        container = subprocess.Popen([sys.executable, str(SCRIPT), "run", full.name, "--state", str(state),
                                      "--pidfile", str(pidfile), "--", "run", "--simulate", "spot-preempt"],
                                     stdout=stdout, stderr=stderr)
    try:
        wait_until(pidfile.exists, timeout=60, message="the container to start")

        def healthy() -> bool:
            result = image_cli("healthcheck", full.name, "--pidfile", str(pidfile), check=False, timeout=60)
            return result.returncode == 0

        wait_until(healthy, timeout=60, interval=0.5, message="the image's HEALTHCHECK to pass")
        fetch = ("import urllib.request; "
                 "print(urllib.request.urlopen('http://127.0.0.1:9465/metrics', timeout=5).read().decode())")

        def metrics() -> str:
            return image_cli("exec", full.name, "--pidfile", str(pidfile), "--", "python", "-c", fetch).stdout

        wait_until(lambda: 'event_type="Preempt"' in metrics(), timeout=60, interval=0.5,
                   message="the simulated Preempt in /metrics")
        text = metrics()
        assert f'azure_scheduled_events_build_info{{api_version="2020-07-01",version="{__version__}"}} 1.0' in text
        # the outbox lives in the state dir, written by the image's user
        assert {path.stat().st_uid for path in state.iterdir()} == {UID}
        assert any(path.name.startswith("forewarn") for path in state.iterdir())
        wait_until(lambda: out.read_text().strip(), timeout=30, message="the stdout sink's first record")
    finally:
        container.send_signal(signal.SIGTERM)
        code = container.wait(60)
    assert code == 0, (tmp_path / "stderr").read_text()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and records[0]["type"].endswith("scheduled_event.added")


# --- what is (not) in it --------------------------------------------------------------------------------

def files_of(image: str) -> set[str]:
    container = subprocess.run(["buildah", "from", "--pull-never", "--quiet", image], capture_output=True,
                               text=True, check=True, timeout=120).stdout.strip()
    try:
        root = Path(subprocess.run(["buildah", "mount", container], capture_output=True, text=True, check=True,
                                   timeout=60).stdout.strip())
        return {"/" + str(path.relative_to(root)) for path in root.rglob("*")}
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, timeout=60)


def test_the_image_holds_no_build_tools_caches_tests_or_build_secrets(full: Image) -> None:
    files = files_of(full.name)
    added = files - files_of(full.config["Labels"].get("io.forewarn.base") or base_image(full.config["Architecture"]))
    assert "/opt/forewarn/bin/forewarn" in added and len(added) > 1000  # the listing saw the venv
    tools = sorted(path for path in files if path.rsplit("/", 1)[-1] in BUILD_TOOLS and "/bin/" in path)
    assert not tools, tools
    site = "/opt/forewarn/lib/"
    leftovers = sorted(path for path in added if
                       path.startswith(("/src", "/root/.cache", "/tmp/", "/etc/pip.conf", "/run/secrets"))
                       or path.endswith((".whl", ".o", ".tar.gz", ".zip"))  # (headers some wheels ship stay)
                       or "/.cache/" in path
                       or (path.startswith(site) and ("/tests/" in path or path.endswith("/tests")))
                       or any(part in path for part in ("/site-packages/pip/", "/site-packages/setuptools/",
                                                        "/site-packages/wheel/", "/bin/pip")))
    assert not leftovers, leftovers[:20]
    history = subprocess.run(["podman", "history", "--no-trunc", "--format", "{{.CreatedBy}}", full.name],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert "PIP_CERT" not in history and "pip-ca" not in history  # the build secret stayed in the build stage


SLIM_MODULES = ("lightkube", "jinja2", "cloudevents", "bcrypt", "azure.eventhub", "azure.identity",
                "azure.storage.queue", "opentelemetry.sdk", "grpc")
#: Which of {modules} the image's python can import (a missing parent package counts as missing).
FIND_MODULES = """
import importlib.util, json
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
print(json.dumps({{name: found(name) for name in {modules!r}}}))
"""


def test_the_slim_image_has_the_light_sinks_only_and_says_what_is_missing(full: Image, slim: Image,
                                                                          tmp_path: Path) -> None:
    assert slim.run("--version").stdout.strip() == f"forewarn {__version__}"
    assert slim.config["Labels"]["io.forewarn.extras"] == "slim"
    present = slim.python(FIND_MODULES.format(modules=SLIM_MODULES)).stdout
    assert json.loads(present) == {"lightkube": True, "jinja2": True, "cloudevents": True, "bcrypt": True,
                                   "azure.eventhub": False, "azure.identity": False, "azure.storage.queue": False,
                                   "opentelemetry.sdk": False, "grpc": False}
    assert json.loads(full.python(FIND_MODULES.format(modules=SLIM_MODULES)).stdout) == \
        dict.fromkeys(SLIM_MODULES, True)  # the full image has them all, fleet mode's included
    refused = slim.run("run", "--simulate", "--sink", "otlp", "--otlp-endpoint", "http://127.0.0.1:4318",
                       state=state_dir(tmp_path), check=False, timeout=60)
    assert refused.returncode == 2 and "forewarn[otlp]" in refused.stderr, refused.stderr
    assert size(slim.name) < size(full.name)


def size(image: str) -> int:
    out = subprocess.run(["podman", "image", "inspect", image], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return int(json.loads(out)[0]["Size"])


# --- arm64 -----------------------------------------------------------------------------------------------

def arm64_runs_here() -> str | None:
    """Why arm64 programs cannot run on this machine, or None when they can."""
    if os.uname().machine == "aarch64":
        return None
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists():
        return ("no qemu-aarch64 binfmt_misc entry: install qemu-user-static and binfmt-support and run "
                "`update-binfmts --enable qemu-aarch64` (scripts/test does, where the kernel lets it)")
    text = entry.read_text()
    if "enabled" not in text.splitlines()[0]:
        return "the qemu-aarch64 binfmt_misc entry is disabled"
    if "F" not in next((line for line in text.splitlines() if line.startswith("flags:")), ""):
        return "the qemu-aarch64 entry lacks the F flag, so the interpreter is not found inside a chroot"
    return None


def test_the_arm64_image_builds_and_runs() -> None:
    image_tools()
    reason = arm64_runs_here()
    if reason:
        pytest.skip(f"arm64 image not built: {reason}")
    image = build("arm64", "all", FULL_ARM64)
    assert image.config["Architecture"] == "arm64"
    out = image.run("version", timeout=300).stdout
    assert out.splitlines()[0] == f"forewarn {__version__}"
    assert image.python("import platform; print(platform.machine())", timeout=300).stdout.strip() == "aarch64"
