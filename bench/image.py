"""The container image: size of the full and slim images and what each layer adds, the biggest packages of the
venv, build time, and idle RSS inside the container against the same command outside it, in the same run.

    python bench/image.py [--settle 30] [--samples 10]

Builds with scripts/image.py (buildah, the Dockerfile unchanged but for BASE: a Debian bookworm base made with
mmdebstrap, since registries of container images are out of reach here; the release builds on python:3.12-slim,
whose size is given beside it from Docker Hub's published figure, not measured). Needs root, buildah, podman and
mmdebstrap. Idle: `forewarn run --simulate quiet --sink file:...` at 1 poll/s, left to settle, then VmRSS sampled
once a second; the baseline is the same command from the checkout's .venv on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import BENCH, free_port, header, rss_mib, write_results

ROOT = BENCH.parent
SCRIPT = ROOT / "scripts" / "image.py"
BASE = "localhost/forewarn-test-base:bookworm-amd64"
UID = 65532


def sh(*argv: str, timeout: float = 3600) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout).stdout


def image_size(image: str) -> int:
    return int(json.loads(sh("podman", "image", "inspect", image))[0]["Size"])


def build(extras: str) -> dict[str, Any]:
    tag = f"localhost/forewarn-bench:{extras}"
    started = time.monotonic()
    sh(sys.executable, str(SCRIPT), "build", "--base", BASE, "--extras", extras, "--tag", tag, "--no-cache")
    seconds = time.monotonic() - started
    layers = json.loads(sh(sys.executable, str(SCRIPT), "layers", tag))["layers"]
    return {"tag": tag, "build_s": round(seconds, 1), "size": image_size(tag),
            "layers": [{"size": layer["size"], "created_by": layer["created_by"][:160]} for layer in layers]}


def biggest_packages(image: str, count: int = 12) -> list[dict[str, Any]]:
    """The largest entries of the venv's site-packages (bytes on disk), from the image's own root."""
    container = sh("buildah", "from", "--pull-never", "--quiet", image).strip()
    try:
        root = Path(sh("buildah", "mount", container).strip())
        (site,) = root.glob("opt/forewarn/lib/python3*/site-packages")
        sizes = {}
        for entry in site.iterdir():
            files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
            sizes[entry.name] = sum(p.lstat().st_size for p in files)
        venv = sum(p.lstat().st_size for p in (root / "opt/forewarn").rglob("*") if p.is_file())
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
    top = sorted(sizes.items(), key=lambda item: -item[1])[:count]
    return [{"name": "(venv total)", "size": venv}] + [{"name": name, "size": size} for name, size in top]


def idle_rss(argv: list[str], settle: float, samples: int) -> dict[str, Any]:
    """Start argv, find the forewarn process (argv's own, or the container's PID 1 under unshare), settle,
    sample VmRSS once a second, stop it."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        target = None
        while target is None and time.monotonic() < deadline:
            target = find_forewarn(proc.pid)
            time.sleep(0.2)
        if target is None:
            raise RuntimeError(f"no forewarn process under {argv[:3]}")
        time.sleep(settle)
        readings = []
        for _ in range(samples):
            readings.append(rss_mib(target))
            time.sleep(1)
        return {"rss_mib": round(statistics.median(readings), 1), "min": round(min(readings), 1),
                "max": round(max(readings), 1)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def find_forewarn(pid: int) -> int | None:
    """pid itself when it is forewarn, else the first forewarn among its descendants."""
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            cmdline = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")
            if any(part.endswith(b"/forewarn") or part == b"forewarn" for part in cmdline[:2]) \
                    and b"_inner" not in cmdline:
                return current
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo += [int(child) for child in children]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settle", type=float, default=30)
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args()
    if subprocess.run(["buildah", "inspect", "--type", "image", BASE], capture_output=True).returncode != 0:
        sh(sys.executable, str(SCRIPT), "base", "--tag", BASE)
    results: dict[str, Any] = {**header(), "base": BASE, "base_size": image_size(BASE)}
    for extras in ("all", "slim"):
        results[extras] = build(extras)
        results[extras]["packages"] = biggest_packages(results[extras]["tag"])
    command = ["run", "--simulate", "quiet", "--sink", "file:/var/lib/forewarn/records.jsonl"]
    with tempfile.TemporaryDirectory() as scratch:
        for extras in ("all", "slim"):
            state = Path(scratch) / extras
            state.mkdir()
            os.chown(state, UID, UID)
            results[extras]["idle"] = idle_rss(
                [sys.executable, str(SCRIPT), "run", results[extras]["tag"], "--state", str(state), "--", *command],
                args.settle, args.samples)
        host_state = Path(scratch) / "host"
        host_command = [str(ROOT / ".venv" / "bin" / "forewarn"), "run", "--simulate", "quiet",
                        "--listen-address", f"127.0.0.1:{free_port()}", "--state-dir", str(host_state),
                        "--sink", f"file:{host_state}/records.jsonl"]
        results["host_idle"] = idle_rss(host_command, args.settle, args.samples)
    write_results("image", results)
    print(json.dumps({key: value for key, value in results.items() if key in ("all", "slim", "host_idle")},
                     indent=1)[:3000])


if __name__ == "__main__":
    main()
