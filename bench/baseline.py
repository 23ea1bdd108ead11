"""The baseline every figure is compared with: the polling loop Microsoft's documentation shows.

A plain `requests.get` per poll with the Metadata header, the JSON parsed, the incarnation compared
with the last one; on a change, the events are printed as one JSON line. No session, no state file,
no metrics server, no retries beyond trying again at the next poll. It is what a team writes in an
afternoon, and the yardstick for what forewarn's extra work costs.

    python bench/baseline.py http://127.0.0.1:8169 [--interval 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("endpoint")
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args()
    url = args.endpoint.rstrip("/") + "/metadata/scheduledevents?api-version=2020-07-01"
    last = None
    while True:
        try:
            document = requests.get(url, headers={"Metadata": "true"}, timeout=5,
                                    proxies={"http": "", "https": ""}).json()
            if document["DocumentIncarnation"] != last:
                last = document["DocumentIncarnation"]
                print(json.dumps(document["Events"]), flush=True)
        except (requests.RequestException, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
