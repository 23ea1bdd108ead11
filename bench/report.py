"""Markdown tables from the results of the benchmarks (bench/results/*.json), each titled with its run's date
and commit: the detail behind the rows of docs/performance.md's "Current figures", and what a new run's rows
are taken from. Partial runs count: `bench/cost.py --only PART` writes cost-PART.json, shown as its part.

    python bench/report.py
"""

from __future__ import annotations

import json
from typing import Any

from common import RESULTS


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def when(results: dict[str, Any]) -> str:
    """The run's date and commit, as docs/performance.md gives them."""
    head = results.get("header", results)
    return f"{head['date']}, commit {head.get('commit') or 'not recorded'}"


def ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}x" if base else "-"


def mb(mib: float) -> float:
    """MiB (what /proc reports, in KiB) as the MB of the targets."""
    return mib * 1.048576


def rss(mib: float) -> str:
    return f"{mib:.1f} MiB ({mb(mib):.1f} MB)"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def latency(results: dict[str, Any]) -> list[str]:
    lines = [f"Reaction latency ({when(results)}, {results['changes']} changes per series)", "",
             "| poll interval | where the change shows | p50 | p99 | target (p99) | baseline p50 / p99 | "
             "p99 vs baseline | |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted((k for k in results if k.startswith("forewarn_")), key=lambda k: -float(k[9:-1])):
        interval = float(key.split("_")[1].rstrip("s"))
        series, base = results[key], results.get(f"baseline_{interval:g}s", {}).get("printed", {})
        target = interval * 1000 + 100
        for label in ("metric", "file", "otlp", "eventhubs"):
            row = series[label]
            lines.append(f"| {interval:g} s | {label} | {row['p50_ms']:.0f} ms | {row['p99_ms']:.0f} ms | "
                         f"<= {target:.0f} ms | {base.get('p50_ms', 0):.0f} / {base.get('p99_ms', 0):.0f} ms | "
                         f"{ratio(row['p99_ms'], base.get('p99_ms', 0))} | {verdict(row['p99_ms'] <= target)} |")
        approvals = results.get(f"approvals_{interval:g}s")
        if approvals:
            row = approvals["approval_from_detection"]
            lines.append(f"| {interval:g} s | approval POST, from detection | {row['p50_ms']:.0f} ms | "
                         f"{row['p99_ms']:.0f} ms | <= 50 ms | - | - | {verdict(row['p99_ms'] <= 50)} |")
    return lines


def cost(results: dict[str, Any]) -> list[str]:
    """bench/cost.py's parts present in `results`: steady state, a changing document, scrapes."""
    lines = [f"Steady-state cost and scrape cost ({when(results)})"]
    if "steady_1_poll_per_s" in results or "changing_1_poll_per_s" in results:
        lines += ["", "| polls | configuration | polls/s | CPU per poll | vs baseline | CPU (% of a core) | RSS | |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in (("steady_1_poll_per_s", "1/s"), ("steady_5_polls_per_s", "5/s")):
        if key not in results:
            continue
        block = results[key]
        for name in ("prometheus_only", "file_sink", "every_sink", "baseline"):
            row = block[name]
            limit = 100 if name == "every_sink" else 60
            ok = name == "baseline" or (row["cpu_ms_per_poll"] < 1 and row.get("cpu_vs_baseline", 0) <= 0.5
                                        and row["rss_mib"] < limit)
            if key == "steady_1_poll_per_s" and name == "file_sink":  # issue 26: <= 0.15x, idle RSS <= 25 MB
                ok = row["cpu_vs_baseline"] <= 0.15 and mb(row["rss_mib"]) <= 25
            lines.append(f"| {label} | {name.replace('_', ' ')} | {row['polls_per_s']} | "
                         f"{row['cpu_ms_per_poll']:.3f} ms | {row.get('cpu_vs_baseline', 1):.3f}x | "
                         f"{row['cpu_percent_of_a_core']:.2f}% | {rss(row['rss_mib'])} | "
                         f"{'-' if name == 'baseline' else verdict(ok)} |")
    if "changing_1_poll_per_s" in results:
        block = results["changing_1_poll_per_s"]
        for name in ("file_sink", "baseline"):
            row = block[name]
            lines.append(f"| 1/s, every poll a new document | {name.replace('_', ' ')} | {row['polls_per_s']} | "
                         f"{row['cpu_ms_per_poll']:.3f} ms | {row.get('cpu_vs_baseline', 1):.3f}x | "
                         f"{row['cpu_percent_of_a_core']:.2f}% | {rss(row['rss_mib'])} | "
                         f"{'-' if name == 'baseline' else 'measured'} |")
    if "scrape" not in results:
        return lines
    scrape = results["scrape"]
    lines += ["", "| /metrics | p50 | p99 | max | size |", "| --- | --- | --- | --- | --- |"]
    for events in (0, 10, 100, 1000):
        row = scrape[f"{events}_events"]
        lines.append(f"| {events} events, sequential, kept alive | {row['p50_ms']:.2f} ms | {row['p99_ms']:.2f} ms | "
                     f"{row['max_ms']:.1f} ms | {row['bytes'] / 1000:.0f} kB |")
    for key, label in (("floor_100_events", "floor: the same 100-event body from a bare server"),
                       ("100_events_again", "100 events again, after the floor"),
                       ("100_events_alternating_with_the_floor", "100 events, in turns with the floor"),
                       ("floor_alternating", "the floor, in turns")):
        if key in scrape:
            row = scrape[key]
            size = f"{row['bytes'] / 1000:.0f} kB" if "bytes" in row else ""
            lines.append(f"| {label} | {row['p50_ms']:.2f} ms | {row['p99_ms']:.2f} ms | {row['max_ms']:.1f} ms | "
                         f"{size} |")
    row = scrape["50_scrapers_100_events"]
    lines.append(f"| 100 events, 50 scrapers at once every second | {row['p50_ms']:.1f} ms | "
                 f"{row['p99_ms']:.1f} ms | {row['max_ms']:.1f} ms | |")
    for key, label in (("poll_jitter_without_scrapes", "no scrapes"), ("poll_jitter_under_50_scrapers", "50 scrapers")):
        row = scrape[key]
        lines.append(f"| poll cadence jitter, {label} | {row['p50_ms']:.1f} ms | {row['p99_ms']:.1f} ms | "
                     f"{row['max_ms']:.1f} ms | |")
    return lines


#: The drain targets of issue 26, in records per second.
DRAIN_TARGETS = {"otlp-grpc": 10_000, "eventhubs": 10_000, "file": 50_000}


def forwarding(results: dict[str, Any]) -> list[str]:
    baseline = (load("forwarding-baseline") or {}).get("drain", {})
    lines = [f"Backlog drain ({when(results)})", "",
             "| sink | records | forewarn records/s | CPU per record | the peer's ceiling (bare client) | "
             "before (same harness) | target |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in results["drain"].items():
        ceiling = f"{row['peer_ceiling_per_s']:,.0f}/s" if "peer_ceiling_per_s" in row else "-"
        cpu = f"{row['cpu_us_per_record']:.0f} µs" if "cpu_us_per_record" in row else "-"
        before = baseline.get(name)
        was = f"{before['records_per_s']:,.0f}/s ({before['cpu_us_per_record']:.0f} µs)" if before else "-"
        target = DRAIN_TARGETS.get(name)
        goal = f">= {target:,}/s: {verdict(row['records_per_s'] >= target)}" if target else ""
        lines.append(f"| {name} | {row['records']:,} | {row['records_per_s']:,.0f} | {cpu} | {ceiling} | {was} | "
                     f"{goal} |")
    return lines


def soak(results: dict[str, Any]) -> list[str]:
    row = results["soak"]
    trouble = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(row["trouble"].items()))
    return [f"Fault soak ({when(results)})", "", "| measure | result | target |", "| --- | --- | --- |",
            f"| simulated time | {row['simulated_hours']} h at {row['speed']}x, {row['events']} events | >= 30 h |",
            f"| transitions produced / reported | {row['transitions_produced']} / {row['transitions_reported']} | |",
            f"| missed transitions | {len(row['missed'])} | 0 |",
            f"| phantom transitions | {len(row['phantom'])} | 0 |",
            f"| duplicate records beyond the same id | {row['duplicates_beyond_same_id']} | 0 |",
            f"| records redelivered with the same id (allowed) | {row['records_redelivered_with_same_id']} | |",
            f"| records missing at the OTLP receiver / AMQP peer | {row['missing_at_otlp']} / "
            f"{row['missing_at_eventhubs']} | 0 |",
            f"| crashes | {row['crashes']} | 0 |",
            f"| most IMDS requests in any second; over-budget replies | {row['imds_max_requests_in_any_second']}; "
            f"{row['imds_over_budget_replies']} | <= 5; 0 |",
            f"| trouble injected | {trouble} | |"]


MB = 1_000_000 / 2**20  # MiB in a MB: the memory goal is in MB, /proc reports KiB


def hostile(results: dict[str, Any]) -> list[str]:
    run = "quick run: " if results.get("quick") else ""
    memory = results["memory"]
    limit_mib = 100 * MB
    lines = [f"Hostile IMDS ({run}{when(results)})", "",
             f"| hostile reply, {memory['seconds_each']:g} s each | requests | the collector's outcome | "
             "RSS before | peak RSS | sampled RSS max | alive, /metrics | next valid event in | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in memory["replies"].items():
        peak = row["peak_rss_mib"] if row["peak_rss_mib"] is not None else row["sampled_rss_max_mib"]
        codes = ", ".join(f"{code} x{count}" for code, count in row["codes"].items())
        ok = peak <= limit_mib and row["alive"] and row["metrics_answer"]
        lines.append(f"| {name} | {row['hostile_requests']} | {codes} | {row.get('rss_at_start_mib', 0):.0f} MiB | "
                     f"{peak:.0f} MiB | "
                     f"{row['sampled_rss_max_mib']:.0f} MiB | {'yes' if row['alive'] else '**no**'}, "
                     f"{'yes' if row['metrics_answer'] else '**no**'} | {row['next_event_s']:.2f} s | {verdict(ok)} |")
    start = memory["startup"]
    overall = memory["overall_peak_rss_mib"]
    lines += [f"| overall (from start, peak {start['peak_rss_mib']:.0f} MiB before the first) | | | | "
              f"{overall:.0f} MiB | | | | {verdict(overall <= limit_mib)} |", "",
              f"RSS 10 s after the last hostile reply, polling normally: {memory['rss_10_s_after_mib']:.0f} MiB "
              f"(exit code on SIGTERM: {memory['exit_code']})."]
    lines += ["", "| SIGTERM during a hung read | median | max | samples | target | |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, row in results["stop"].items():
        lines.append(f"| {name} | {row['median_s']:.2f} s | {row['max_s']:.2f} s | {len(row['samples_s'])} | "
                     f"<= 2 s | {verdict(row['max_s'] <= 2)} |")
    lines += ["", "| outage, then a new event | blind time to the file record, median / max | to the /metrics "
              "series | first request after recovery | requests/s during the outage; most in any second | "
              "target | |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in results["outage"].items():
        file, metric, first = row["blind_file"], row["blind_metric"], row["first_request_after"]
        ok = file["max_s"] <= 1 + 1 and row["requests_per_s_max"] <= 2 and row["most_in_any_second"] <= 2
        lines.append(f"| {row['outage_s']:g} s of {name if name == 'reset' else f'HTTP {name}'}"
                     f"{'s' if name == 'reset' else ''}, x{row['repetitions']} | {file['median_s']:.2f} / "
                     f"{file['max_s']:.2f} s | {metric['median_s']:.2f} / {metric['max_s']:.2f} s | "
                     f"{first['median_s']:.2f} / {first['max_s']:.2f} s | {row['requests_per_s_max']:.2f}; "
                     f"{row['most_in_any_second']} | <= 2 s; <= 2/s | {verdict(ok)} |")
    idle = results["idle"]
    lines += ["", "| RSS, normal polling, file sink | after | RSS | published (bench/cost.py) | difference |",
              "| --- | --- | --- | --- | --- |",
              f"| 1 poll/s, quiet scenario | {idle['seconds']:g} s | {idle['rss_mib']:.0f} MiB | "
              f"{idle['published_rss_mib']:.0f} MiB | {idle['difference_mib']:+.1f} MiB |"]
    return lines


def node_actions(results: dict[str, Any]) -> list[str]:
    run = "quick run: " if results.get("quick") else ""
    steady = results["with_node_actions"]["steady_s"]
    lines = [f"Node actions ({run}{when(results)}; file sink, 1 poll/s, {steady:g} s of steady polling after the "
             "event)", "",
             "| configuration | RSS | peak RSS (VmHWM) | goal | |", "| --- | --- | --- | --- | --- |"]
    for key, label in (("idle_no_policy", "no policy (idle)"), ("without_node_actions", "policy, no node actions"),
                       ("with_node_actions", "policy with cordon, condition, event, drain")):
        row = results.get(key)
        if row is None:
            continue
        goal, ok = ("<= 45 MB", max(row["rss_mib"], row["peak_rss_mib"]) <= 45 * MB) if key == "with_node_actions" \
            else ("-", None)
        lines.append(f"| {label} | {row['rss_mib']:.1f} MiB ({row['rss_mib'] / MB:.1f} MB) | "
                     f"{row['peak_rss_mib']:.1f} MiB ({row['peak_rss_mib'] / MB:.1f} MB) | {goal} | "
                     f"{'' if ok is None else verdict(ok)} |")
    acted = results["with_node_actions"]
    lines += ["", f"Node actions ok: {acted['node_actions_ok']}; failed: {acted['node_actions_failed']:g}; "
              f"{acted['evictions']} evictions, {acted['api_requests']} API requests; "
              f"difference with node actions: {results['difference_mib']:+.1f} MiB."]
    return lines


def image(results: dict[str, Any]) -> list[str]:
    full, slim, host = results["all"], results["slim"], results["host_idle"]
    base = results["base_size"]
    lines = [f"Container image ({when(results)}; base {results['base']}: {base / 1e6:.0f} MB)", "",
             "| image | size | added to the base | build time | idle RSS in the container | same command outside |",
             "| --- | --- | --- | --- | --- | --- |"]
    for label, row in (("full (`all`)", full), ("slim", slim)):
        lines.append(f"| {label} | {row['size'] / 1e6:.0f} MB | {(row['size'] - base) / 1e6:.1f} MB | "
                     f"{row['build_s']:.0f} s | {row['idle']['rss_mib']:.1f} MiB | {host['rss_mib']:.1f} MiB |")
    lines += ["", "Layers of the full image:", "", "| size | instruction |", "| --- | --- |"]
    for layer in full["layers"]:
        lines.append(f"| {layer['size'] / 1e6:.1f} MB | `{layer['created_by'][:90].strip()}` |")
    lines += ["", "The largest entries of the full image's venv:", "", "| entry | size |", "| --- | --- |"]
    lines += [f"| {entry['name']} | {entry['size'] / 1e6:.1f} MB |" for entry in full["packages"]]
    return lines


def fleet(results: dict[str, Any]) -> list[str]:
    run = "quick run: " if results.get("quick") else ""
    snap, rss, scrape, lat, tp = (results["snapshot"], results["rss"], results["metrics"], results["latency"],
                                  results["throughput"])
    floor, mfloor, idle = snap["floor"], scrape["floor"], rss["per_vm_agent_idle"]
    at_size = max(rss["hwm_after_snapshot_mib"], rss.get("hwm_after_first_scrape_mib", 0),
                  rss.get("hwm_after_scrapes_mib", 0))
    streaming = max(rss["stream_hwm_mib"] or 0, rss["stream_max_rss_mib"])
    waited = "" if tp["finished"] else \
        f" (stopped at {tp['bounded_at_s']:g} s: {tp['records']:,} of {tp['messages']:,})"
    lines = [f"Fleet mode ({run}{when(results)}; {snap['events']:,} events, {snap['vms']:,} VMs, "
             f"{snap['subscriptions']} subscriptions, pages of {snap['page_rows']} rows)", "",
             "| measure | forewarn fleet | same-run floor or baseline | target | |", "| --- | --- | --- | --- | --- |",
             f"| full snapshot: first query to the last of {snap['records']:,} records in the file (process start "
             f"to it) | {snap['first_query_to_last_record_s']:.1f} s ({snap['start_to_last_record_s']:.1f} s) | "
             f"bare paging read {floor['median_s'] * 1000:.0f} ms (median of {floor['reads']}) | <= 10 s | "
             f"{verdict(snap['first_query_to_last_record_s'] <= 10)} |",
             "| `azure_scheduled_events_reconcile_duration_seconds`, first snapshot (later ones) | "
             f"{snap['reconcile_metric_s']:.2f} s "
             f"({', '.join(f'{v:.2f}' for v in snap.get('reconcile_metric_values_s', [])[1:]) or '-'}) | "
             f"{floor['median_s']:.2f} s | <= 10 s | {verdict(snap['reconcile_metric_s'] <= 10)} |",
             f"| queue throughput, {tp['messages']:,} preloaded, no Resource Graph{waited} | "
             f"{tp['messages_per_s']:,.1f} messages/s (by fifths: "
             f"{', '.join(f'{v:.0f}' for v in tp['records_per_s_by_fifth'])}) | "
             f"bare receive+delete {tp['floor']['messages_per_s']:,.0f}/s; 8 deletes at once "
             f"{tp['floor_parallel']['messages_per_s']:,.0f}/s | >= 500/s | {verdict(tp['messages_per_s'] >= 500)} |",
             f"| queue to record, {lat['rate_per_s']:g}/s for {lat['seconds']:g} s, p50 / p99 / max "
             f"({lat['missing']} of {lat['sent']} missing) | {lat['p50_ms'] / 1000:.2f} / {lat['p99_ms'] / 1000:.2f} / "
             f"{lat['max_ms'] / 1000:.2f} s ({lat['records_per_s']} records/s) | - | p99 <= 1.5 s | "
             f"{verdict(lat['p99_ms'] <= 1500 and lat['missing'] == 0)} |",
             f"| RSS with {snap['events']:,} events open: after the snapshot; after the first scrape; after the "
             f"{scrape['samples']} scrapes (VmHWM) | {rss['after_snapshot_mib']:.1f}; "
             f"{rss['after_first_scrape_mib']:.1f}; {rss['after_scrapes_mib']:.1f} MiB ({at_size:.1f}) | per-VM agent "
             f"idle {idle['rss_mib']:.1f} MiB | <= 80 MB ({80 * MB:.1f} MiB) | {verdict(at_size <= 80 * MB)} |",
             f"| RSS during the stream, which opens {lat['sent']:,} more events (open until a later snapshot ends "
             f"them), max (VmHWM) | {rss['stream_max_rss_mib']:.1f} MiB ({rss['stream_hwm_mib'] or 0:.1f}) | | "
             f"<= 80 MB at {snap['events']:,} open | {verdict(streaming <= 80 * MB)} |",
             f"| RSS, queue only, after {tp['records']:,} messages (VmHWM) | {tp['rss_mib']:.0f} MiB "
             f"({tp['hwm_mib']:.0f}) | | <= 80 MB | {verdict(max(tp['rss_mib'], tp['hwm_mib']) <= 80 * MB)} |",
             f"| /metrics with {snap['events']:,} events open ({scrape['series']:,} VM series, "
             f"{scrape['bytes'] / 1e6:.1f} MB; {scrape.get('bytes_sent', scrape['bytes']) / 1e3:,.0f} kB sent"
             f"{' as gzip' if scrape.get('content_encoding') == 'gzip' else ''}), p50 / p99, {scrape['samples']} "
             f"scrapes, inflated by the client | {scrape['p50_ms']:.0f} / "
             f"{scrape['p99_ms']:.0f} ms | prometheus_client alone, same series: {mfloor['p50_ms']:.0f} / "
             f"{mfloor['p99_ms']:.0f} ms | p99 <= 50 ms | {verdict(scrape['p99_ms'] <= 50)} |"]
    return lines


def tls(results: dict[str, Any]) -> list[str]:
    lines = [f"/metrics over TLS with basic auth ({when(results)}; {results['events']} events, bcrypt cost "
             f"{results['bcrypt_cost']})", "", "| /metrics | p50 | p99 | max | scrapes | |",
             "| --- | --- | --- | --- | --- | --- |"]
    for key, label in (("tls_basic_auth_kept_alive", "TLS + basic auth, kept alive"),
                       ("tls_basic_auth_new_connection", "TLS + basic auth, a handshake per scrape"),
                       ("plain_kept_alive", "plain HTTP, kept alive")):
        row = results[key]
        goal = f"goal p99 <= 10 ms: {verdict(row['p99_ms'] <= 10)}" if key == "tls_basic_auth_kept_alive" else ""
        lines.append(f"| {label} | {row['p50_ms']:.2f} ms | {row['p99_ms']:.2f} ms | {row['max_ms']:.2f} ms | "
                     f"{row['samples']} | {goal} |")
    return lines


def fleet_act(results: dict[str, Any]) -> list[str]:
    run = "quick run: " if results.get("quick") else ""
    ack, over = results["acknowledge"], results["failover"]
    lat, floor = ack["latency"], ack["floor_bare_acknowledge"]
    once = ack["acknowledged"] == ack["messages"] and ack["acknowledged_twice"] == 0
    return [f"Fleet mode, acting ({run}{when(results)})", "",
            "| measure | forewarn fleet | same-run floor | target | |", "| --- | --- | --- | --- | --- |",
            f"| queued message to its acknowledgement, p50 / p99 / max ({ack['acknowledged']} of {ack['messages']} "
            f"acknowledged, {ack['acknowledged_twice']} twice) | {lat['p50_ms']:.0f} / {lat['p99_ms']:.0f} / "
            f"{lat['max_ms']:.0f} ms | the call alone {floor['p50_ms']:.1f} / {floor['p99_ms']:.1f} ms | "
            f"p99 <= {ack['target_p99_ms']} ms | {verdict(lat['p99_ms'] <= ack['target_p99_ms'] and once)} |",
            f"| SIGKILL of the active replica to the other active, {over['rounds']} rounds | "
            f"{min(over['takeover_s']):.2f}-{over['max_s']:.2f} s | the lease, {over['lease_seconds']} s | "
            f"<= {over['target_s']} s | {verdict(over['max_s'] <= over['target_s'])} |"]


def main() -> None:
    for name, render in (("latency", latency), ("cost", cost), ("cost-steady", cost), ("cost-changing", cost),
                         ("cost-scrape", cost), ("tls", tls), ("forwarding", forwarding), ("soak", soak),
                         ("hostile", hostile), ("node_actions", node_actions), ("image", image),
                         ("fleet", fleet), ("fleet_act", fleet_act)):
        results = load(name)
        if results is not None:
            print("\n".join(render(results)) + "\n")


if __name__ == "__main__":
    main()
