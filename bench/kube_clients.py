"""Compare Kubernetes client libraries for forewarn's node actions: import time and peak RSS of a fresh
interpreter that imports the client and the resources node actions use (Node, Pod eviction, Lease, Event).

    python bench/kube_clients.py [--runs 5]

A library that is not installed is reported as such. Results feed docs/kubernetes.md ("Client library").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBES = {
    "baseline (forewarn.agent)": "import forewarn.agent",
    "lightkube": ("import forewarn.agent\n"
                  "from lightkube import Client, KubeConfig\n"
                  "from lightkube.resources.core_v1 import Node, Pod\n"
                  "from lightkube.resources.coordination_v1 import Lease\n"
                  "from lightkube.resources.events_v1 import Event\n"),
    "kubernetes (official)": ("import forewarn.agent\n"
                              "from kubernetes import client, config\n"
                              "client.CoreV1Api; client.CoordinationV1Api; client.EventsV1Api; client.PolicyV1Api\n"),
    "kr8s": ("import forewarn.agent\n"
             "import kr8s\n"
             "from kr8s.objects import Node, Pod\n"),
}

MEASURE = """
import resource, time, json
start = time.perf_counter()
{code}
elapsed = time.perf_counter() - start
print(json.dumps({{"seconds": elapsed, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
"""


def measure(code: str) -> dict[str, float] | None:
    result = subprocess.run([sys.executable, "-c", MEASURE.format(code=code)], capture_output=True, text=True,
                            timeout=120, check=False)
    if result.returncode != 0:
        return None
    loaded: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"{'client':28} {'import s (median)':>18} {'peak RSS MiB':>13}")
    for name, code in PROBES.items():
        runs = [measure(code) for _ in range(args.runs)]
        if any(run is None for run in runs):
            print(f"{name:28} {'not installed':>18}")
            continue
        seconds = statistics.median(run["seconds"] for run in runs if run)
        rss = statistics.median(run["rss_kib"] for run in runs if run) / 1024
        print(f"{name:28} {seconds:18.3f} {rss:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
