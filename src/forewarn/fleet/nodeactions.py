"""Node actions from fleet mode: a rule's cordon, taint, label, condition, event and drain, on the AKS nodes of
the VMs an event acts on, from the one active replica.

Each VM the event names becomes its node through `spec.providerID` (forewarn.fleet.nodes); a VM that is no
node of this cluster is counted and left alone. On each node the per-VM agent's own `KubeNodeActor` does the
work, with everything it does there: the node's ledger (the `forewarn.io/applied` annotation) that makes a
second run pick up where the first stopped, drains through the Eviction API in priority tiers with the grace
clamped to NotBefore, the cluster-wide cap on nodes draining at once (drain Leases), the
`forewarn.io/node-actions: disabled` opt-out, and undo of only what forewarn applied. Every outcome and every
step of a drain is a record through the outbox, as in the per-VM agent, naming the node and the VM.

Every entry this instance writes in a node's ledger names it as the owner (forewarn.owner: its scope and
Lease), so the replicas under one Lease share their entries and nobody else's are touched. What is applied
is undone once the event is known to be over (forewarn.fleet.approval decides when); a replica that takes
over (or restarts) reads the ledgers of all nodes every `refresh` seconds and undoes its instance's entries
for events known to be over, whichever replica applied them; what they hold for an open event is resumed by
acting again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from forewarn.approval.actor import ActionOutcome, DrainProgress, recording_report
from forewarn.approval.policy import Rule
from forewarn.fleet.feed import FleetEvent, vm_ids
from forewarn.fleet.nodes import NodeIndex, load_nodes
from forewarn.fleet.records import FLEET_INCARNATION, fleet_vm
from forewarn.imds.document import Event
from forewarn.imds.instance import VmInfo
from forewarn.owner import Owner
from forewarn.records import Record

log = logging.getLogger(__name__)

#: Seconds between reads of the cluster's nodes (new nodes, and ledgers left by an earlier term).
DEFAULT_REFRESH = 30.0


class FleetNodes:
    """The Kubernetes side of the fleet approver. `make_client(stop)` gives a lightkube client whose requests
    end at `stop` (forewarn.node.kube.make_client); `record` commits records; `metrics` is FleetMetrics."""

    def __init__(self, make_client: Callable[[threading.Event], Any], record: Callable[[Sequence[Record]], object],
                 metrics: Any, clock: Callable[[], float] = time.time, refresh: float = DEFAULT_REFRESH,
                 workers: int = 8, poll: float = 1.0, owner: Owner | None = None) -> None:
        self.make_client = make_client
        self.owner = owner or Owner.fleet("any")   # whose ledger entries these are (FleetScope.owner)
        self.record = record
        self.metrics = metrics
        self.clock = clock
        self.refresh = refresh
        self.workers = workers
        self.poll = poll
        self._client: Any = None
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._index: NodeIndex | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()
        self._draining: dict[str, int] = {}
        self._blocked: dict[str, float] = {}
        self._under_way: set[Future[Any]] = set()

    # --- a term -------------------------------------------------------------------------------------------
    def begin(self, stop: threading.Event) -> None:
        self._stop = stop
        self._client = self.make_client(stop)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="fleet-node")
        self._index, self._read_at = None, 0.0

    def end(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
        self._pool, self._client = None, None

    def _submit(self, work: Callable[..., Any], *args: Any) -> Future[Any]:
        assert self._pool is not None
        future = self._pool.submit(work, *args)
        with self._lock:
            self._under_way.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self._under_way.discard(future)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no action, undo or after-eviction work is under way (what was submitted so far has
        finished); False if some still is after `timeout` seconds."""
        with self._lock:
            under_way = set(self._under_way)
        return not wait(under_way, timeout=timeout).not_done

    def index(self, fresh: bool = False) -> tuple[NodeIndex, bool]:
        """The cluster's nodes, read again when `refresh` seconds old (or `fresh` is asked for), and whether
        they were read just now (so their ledgers are worth reconciling). Raises KubeError when they cannot be
        read."""
        from forewarn.node.kube import KubeError, explain

        now = self.clock()
        if fresh or self._index is None or now - self._read_at >= self.refresh:
            try:
                self._index, self._read_at = load_nodes(self._client), now
            except KubeError:
                raise
            except Exception as exc:  # lightkube's ApiError, or its transport's: one kind of error for the caller
                raise explain(exc, "list nodes") from None
            return self._index, True
        return self._index, False

    # --- acting and undoing -------------------------------------------------------------------------------
    def nodes_of(self, event: FleetEvent, index: NodeIndex) -> dict[str, str]:
        """Node name -> VM ID for the VMs of `event` that are nodes here; the others are counted."""
        nodes: dict[str, str] = {}
        for vm in vm_ids(event):
            node = index.node_of(vm)
            if node is None:
                self.metrics.vms_without_node.inc()
            else:
                nodes[node] = vm
        return nodes

    def act(self, event: FleetEvent, rule: Rule, nodes: Mapping[str, str], dry_run: bool,
            listed: bool = True) -> Future[bool]:
        """Run `rule`'s node actions on each of `nodes` (at once, one thread each); the future is True when
        every node's actions succeeded. `listed`: Resource Graph lists the event (written in the entries)."""
        assert self._pool is not None
        parts = [self._submit(self._act_one, event, rule, node, vm, dry_run, listed) for node, vm in nodes.items()]
        return _all(parts)

    def undo(self, event: Event, nodes: Mapping[str, str], dry_run: bool, fleet_event: FleetEvent | None,
             legacy: bool = False) -> None:
        """Take back what this instance's entries hold for `event` on each of `nodes` (node -> VM ID, or node ->
        "" when the VM is not known), on the pool; with `legacy`, also a legacy entry (one without an owner)."""
        if self._pool is None:
            return
        for node, vm in nodes.items():
            self._submit(self._undo_one, event, node, vm, dry_run, fleet_event, legacy)

    def held(self, event_id: str, node: str, detail: str) -> None:
        """Say that an undo on `node` is held back, and why: a log line and a `node_action` record (action
        `undo`, result `held`)."""
        log.warning("%s", detail)
        self._reporter(left_over(event_id), VmInfo(name=node), node, None)(ActionOutcome("undo", "held", detail))

    def after_eviction(self, event: FleetEvent, rule: Rule, nodes: Mapping[str, str], dry_run: bool) -> None:
        """`rule.after_eviction` on each of `nodes` (forewarn.fleet.gone), on the pool."""
        if self._pool is None:
            return
        for node, vm in nodes.items():
            self._submit(self._gone_one, event, rule, node, vm, dry_run)

    def back_in_service(self, nodes: Sequence[str], dry_run: bool) -> None:
        """Take forewarn's out-of-service taint off those of `nodes` that are Ready again, on the pool."""
        if self._pool is None:
            return
        for node in nodes:
            self._submit(self._back_one, node, dry_run)

    def _gone_one(self, event: FleetEvent, rule: Rule, node: str, vm: str, dry_run: bool) -> None:
        from forewarn.fleet.gone import GoneNode
        from forewarn.node.kube import KubeError

        action = rule.after_eviction or ""
        report = self._reporter(event.event, self._vm(event, vm, node), node, rule.name)
        handle = GoneNode(self._client, node, stopping=self._stop, owner=self.owner)
        try:
            result, detail = (handle.out_of_service(event.event.event_id, dry_run) if action == "out_of_service"
                              else handle.delete(dry_run))
        except KubeError as exc:
            result, detail = "failed", str(exc)
        (log.error if result == "failed" else log.warning)("node %s, event %s: %s", node, event.event.event_id,
                                                            detail)
        report(ActionOutcome(action, result, detail))

    def _back_one(self, node: str, dry_run: bool) -> None:
        from forewarn.fleet.gone import GoneNode
        from forewarn.node.kube import KubeError

        try:
            handle = GoneNode(self._client, node, stopping=self._stop, owner=self.owner)
            event_id, detail = handle.back_in_service(dry_run)
        except KubeError as exc:
            log.error("node %s: taking the out-of-service taint off failed: %s", node, exc)
            return
        if detail:
            log.warning("%s", detail)
            self._reporter(left_over(event_id), VmInfo(name=node), node, None)(
                ActionOutcome("undo", "dry_run" if dry_run else "ok", detail))

    def _actor(self, node: str, listed: bool = True) -> Any:
        from forewarn.node.actions import KubeNodeActor

        return KubeNodeActor(self._client, node, poll=self.poll, stopping=self._stop, owner=self.owner,
                             note={"listed": listed},
                             draining=lambda count: self._count(self._draining, node, count),
                             blocked=lambda since: self._count(self._blocked, node, since))

    def _act_one(self, event: FleetEvent, rule: Rule, node: str, vm: str, dry_run: bool, listed: bool) -> bool:
        try:
            return bool(self._actor(node, listed).act(rule.node, event.event, dry_run,
                                              self._reporter(event.event, self._vm(event, vm, node), node, rule.name)))
        except Exception:  # a bug must not leave the event acting forever: it counts as a failed action
            log.exception("node actions for event %s on node %s failed unexpectedly", event.event.event_id, node)
            return False

    def _undo_one(self, event: Event, node: str, vm: str, dry_run: bool, fleet_event: FleetEvent | None,
                  legacy: bool) -> None:
        try:
            self._actor(node).undo(event.event_id, dry_run,
                                   self._reporter(event, self._vm(fleet_event, vm, node), node, None), legacy=legacy)
        except Exception:
            log.exception("undoing the node actions of event %s on node %s failed unexpectedly", event.event_id,
                          node)

    @staticmethod
    def _vm(event: FleetEvent | None, vm: str, node: str) -> VmInfo:
        return fleet_vm(event, vm) if event is not None and vm else VmInfo(name=node)

    def _reporter(self, event: Event, vm: VmInfo, node: str,
                  rule: str | None) -> Callable[[ActionOutcome | DrainProgress], None]:
        return recording_report(self.metrics.nodes, self.record, event, vm, node, rule, FLEET_INCARNATION,
                                self.clock)

    def _count(self, table: dict[str, Any], node: str, value: float) -> None:
        """The gauges over every node: drains under way (a sum), blocked since (the earliest)."""
        with self._lock:
            if value:
                table[node] = value
            else:
                table.pop(node, None)
            drains = sum(self._draining.values())
            blocked = min(self._blocked.values(), default=0.0)
        self.metrics.nodes.node_drains.set(drains)
        self.metrics.nodes.node_drain_blocked_since.set(blocked)


def left_over(event_id: str) -> Event:
    """An event a node still holds something for, known by its id only (it is no longer open)."""
    return Event(event_id=event_id, event_type="", status="", resource_type="", resources=(), not_before=None,
                 raw={"EventId": event_id, "EventType": "", "EventStatus": ""})


def _all(parts: Sequence[Future[bool]]) -> Future[bool]:
    """A future done when every part is, True when all were (no thread waits for them)."""
    whole: Future[bool] = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_part: Future[bool]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            whole.set_result(all(not part.cancelled() and part.exception() is None and part.result()
                                 for part in parts))
    if not parts:
        whole.set_result(True)
    for part in parts:
        part.add_done_callback(one_done)
    return whole
