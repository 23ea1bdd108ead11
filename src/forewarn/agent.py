"""The agent, `forewarn run`: build every part from settings, wire signals, run until stopped.

This is the one place where the parts meet: the IMDS client, the poller, the metrics and their web
endpoints, the outbox and its delivery workers, the sinks, the approver, and the simulator when asked.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forewarn import __version__
from forewarn.config import ConfigError, Settings, redact_url
from forewarn.imds.client import ImdsClient, RequestObserver
from forewarn.metrics import Metrics
from forewarn.outbox.delivery import DeliveryWorker, finish_delivery
from forewarn.outbox.outbox import Outbox
from forewarn.poller import DeliveryMetrics, OutboxMetrics, Poller
from forewarn.records import Record
from forewarn.signals import handle_signals, ignore_stop_signals
from forewarn.sinks import build_sinks
from forewarn.sources import StopSignal
from forewarn.web.endpoints import DrainPolicy, add_lb_probe, add_metrics_endpoints, exposition, readiness_check
from forewarn.web.setup import web_gate, web_server

if TYPE_CHECKING:  # the approval engine (jsonschema, YAML, requests for webhooks) loads only with --policy
    import tempfile

    from forewarn.approval.actor import NodeActor
    from forewarn.approval.approver import Approver

log = logging.getLogger(__name__)


def run_agent(settings: Settings) -> int:
    """`forewarn run`: build everything from settings, run until SIGTERM/SIGINT, return the exit code."""
    # Signals first: a SIGTERM while the parts are being built (a slow sink, a first IMDS call) stops cleanly.
    stop = StopSignal()
    metrics = Metrics(api_version=settings.api_version)
    reloadable: list[Approver | None] = []
    handle_signals(stop, reload=lambda: reload_policy(settings, reloadable[0] if reloadable else None,
                                                      metrics))
    sinks = build_sinks(settings.sink, settings)
    gate = web_gate(settings)  # before the simulator and temporary state, which a refused file would leave behind
    simulator_server = None
    scratch: tempfile.TemporaryDirectory[str] | None = None  # a simulated run's state, removed at stop
    endpoint = settings.imds_endpoint
    state_dir = Path(settings.state_dir) if settings.state_dir else None
    if settings.simulate:
        from forewarn.simulator import start_simulator

        try:
            simulator_server = start_simulator(settings.simulate, settings.speed, settings.fault)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        endpoint = simulator_server.url
        if state_dir is None:
            import tempfile  # only for a simulated run: tempfile brings shutil, bz2 and lzma

            scratch = tempfile.TemporaryDirectory(prefix="forewarn-sim-", ignore_cleanup_errors=True)
            state_dir = Path(scratch.name)
        log.info("simulator: scenario %s at %gx speed on %s", simulator_server.simulator.scenario.name,
                 settings.speed, endpoint)
    elif endpoint == "discover":
        from forewarn.imds.discovery import discover_endpoint

        endpoint = discover_endpoint()

    server = web_server(settings, gate)
    add_metrics_endpoints(server, exposition(metrics.render_parts),
                          readiness_check(lambda: metrics.views.view.last_success, settings.ready_window),
                          inline_metrics=True)
    add_lb_probe(server, lambda: metrics.views.view,
                 DrainPolicy(settings.probe_lb_lead_time, settings.probe_lb_freeze_threshold))

    outbox = Outbox(state_dir, [sink.name for sink in sinks], settings.outbox_max_records, OutboxMetrics(metrics))
    workers = [DeliveryWorker(sink, outbox, DeliveryMetrics(metrics)) for sink in sinks]
    for sink in sinks:
        metrics.add_sink(sink.name)

    client = ImdsClient(endpoint, settings.api_version, timeout=settings.imds_timeout,
                        observe=request_observer(metrics),
                        max_reply_bytes=settings.imds_max_reply_bytes)
    collector = Poller(client, metrics, outbox, vm_name=settings.vm_name, poll_interval=settings.poll_interval,
                       max_backoff=settings.imds_max_backoff, compute_refresh=settings.compute_refresh)
    approver = build_approver(settings, collector, client, metrics)
    if approver is not None:
        collector.listeners.append(approver)

    reloadable.append(approver)
    # What is alive now (modules, the SDK clients) lives as long as the agent: the cyclic collector need not
    # walk it again at every full collection (a backlog drain allocates enough to run several a second).
    gc.freeze()
    server.start()
    for worker in workers:
        worker.start()
    log.info("forewarn %s polling %s every %.3g s; metrics on %s/metrics; sinks: %s", __version__,
             redact_url(endpoint), collector.poll_interval, server.url,
             ", ".join(s.name for s in sinks) or "none (metrics only)")
    try:
        collector.run(stop)
    finally:
        stop.set()
        finish_delivery(workers, sinks, settings.drain_timeout)
        if approver is not None:
            approver.close()
        outbox.close()
        server.stop()
        client.close()
        if simulator_server is not None:
            simulator_server.stop()
        if scratch is not None:
            scratch.cleanup()
        log.info("stopped")
        ignore_stop_signals()
    return 0


def request_observer(metrics: Metrics) -> RequestObserver:
    """Each IMDS request counted by method and outcome, and timed. A labelled child is looked up once and
    kept: every poll makes a request, and `labels()` takes the family's lock and checks the labels each time."""
    children: dict[tuple[str, str], tuple[Any, Any]] = {}  # (method, code) -> (counter, histogram)

    def observe(method: str, code: str, seconds: float) -> None:
        pair = children.get((method, code))
        if pair is None:
            pair = children[(method, code)] = (metrics.imds_requests.labels(method, code),
                                               metrics.imds_duration.labels(method))
        pair[0].inc()
        pair[1].observe(seconds)

    return observe


def build_approver(settings: Settings, collector: Poller, client: ImdsClient, metrics: Metrics) -> Approver | None:
    """The approver when a policy is given; without one nothing is ever approved."""
    if not settings.policy:
        if settings.dry_run:
            log.info("--dry-run without --policy: nothing would be approved anyway")
        return None
    from forewarn.approval.policy import PolicyError, load_policy

    try:
        policy = load_policy(settings.policy)
    except PolicyError as exc:
        raise ConfigError(f"--policy {exc}") from None
    from forewarn.approval.starter import ImdsStarter

    def record(records: Sequence[Record]) -> None:
        # Without a document: only the poll loop moves the saved state forward, with its own records.
        collector.outbox.append(records)

    from forewarn.approval.approver import Approver

    actor = build_actor(settings, policy.uses_node_actions, metrics) if policy.uses_node_actions else None
    approver = Approver(policy, ImdsStarter(client), metrics, record, dry_run=settings.dry_run, actor=actor)
    metrics.policy_reload_time.set(time.time())
    log.info("approval policy %s: %d rule(s), leader mode %s%s", settings.policy, len(policy.rules),
             policy.leader_mode, ", DRY RUN (no approval is sent)" if approver.dry_run else "")
    return approver


def build_actor(settings: Settings, needed: bool, metrics: Metrics) -> NodeActor | None:
    """The Kubernetes node actor for a policy with node actions (`needed`). The client library is imported
    here only, so a run without node actions never loads it."""
    if not needed:
        return None
    if not settings.node_name:
        raise ConfigError(f"--policy {settings.policy}: rules have node actions (node:), which need --node-name "
                          "(FOREWARN_NODE_NAME; a DaemonSet sets it from spec.nodeName)")
    try:
        from forewarn.node import KubeError
        from forewarn.node import build_actor as kube_actor
    except ImportError as exc:
        raise ConfigError(f"--policy {settings.policy}: node actions need the Kubernetes client: pip install "
                          f"'forewarn[kubernetes]' ({exc})") from None
    try:
        actor = kube_actor(settings.node_name, settings.kubeconfig, draining=metrics.node_drains.set,
                           blocked=metrics.node_drain_blocked_since.set)
    except KubeError as exc:
        raise ConfigError(str(exc)) from None
    log.info("node actions on Kubernetes node %s%s", settings.node_name,
             f" (kubeconfig {settings.kubeconfig})" if settings.kubeconfig else "")
    return actor


def reload_policy(settings: Settings, approver: Approver | None, metrics: Metrics) -> None:
    """SIGHUP: read --policy again. A valid file decides from the next poll on; a refused one is logged
    with its position and the policy in use stays (the metrics say which happened, as Prometheus does)."""
    if approver is None or not settings.policy:
        log.info("received SIGHUP: no --policy to reload; carrying on")
        return
    from forewarn.approval.policy import PolicyError, load_policy

    try:
        policy = load_policy(settings.policy)
    except PolicyError as exc:
        metrics.policy_reload_ok.set(0)
        log.error("received SIGHUP: cannot reload the policy (%s); keeping the previous policy", exc)
        return
    if policy.uses_node_actions and approver.actor is None:
        # As at start-up (exit 2): node actions need a node, and a Kubernetes client built for it.
        try:
            approver.actor = build_actor(settings, True, metrics)
        except ConfigError as exc:
            metrics.policy_reload_ok.set(0)
            log.error("received SIGHUP: cannot reload the policy (%s); keeping the previous policy", exc)
            return
    approver.replace_policy(policy, dry_run=settings.dry_run)
    metrics.policy_reload_ok.set(1)
    metrics.policy_reload_time.set(time.time())
    log.info("reloaded policy %s: %d rule(s), leader mode %s%s", settings.policy, len(policy.rules),
             policy.leader_mode, ", DRY RUN (no approval is sent)" if approver.dry_run else "")
