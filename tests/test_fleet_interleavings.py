"""The interleavings of fleet mode's node actions, searched by a Hypothesis state machine.

Two replicas under one Lease (each with its own state dir, committer, approver and Kubernetes client), the
per-VM agents of the nodes, and a world of scheduled events that Resource Graph lists late or partially and the
queue reports in any order. Hypothesis interleaves: snapshots (complete or partial, some committed while the
active replica is reading the nodes), status news, events that end or vanish, takeovers (clean or after
kill -9), node lists that fail, and the agents acting on the same nodes. Everything below the approver is
real: FleetCommitter and its tracker, FleetApprover, FleetNodes with lightkube against the strict Kubernetes
stand-in, the Acknowledger against the ARM stand-in over TLS.

After every step the invariants are checked:
- a node whose ledger has an entry holding a cordon is cordoned;
- an entry of fleet mode for event E is only ever removed once E is over in the world (a final status, or gone),
  so a node cordoned for E is never made schedulable while E is Scheduled or Started; and never written for an
  event the replica's feeds had said ended (not even one whose end came while it was listing the nodes);
- the agents' entries are only ever changed by the agents (fleet mode never writes to them);
- no event is acknowledged twice.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from forewarn.approval.policy import NodeAction, parse_policy
from forewarn.fleet.acknowledge import Acknowledger
from forewarn.fleet.approval import FleetApprover
from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.metrics import FleetMetrics
from forewarn.fleet.nodeactions import FleetNodes
from forewarn.fleet.scope import FleetScope
from forewarn.fleet.service import FleetCommitter
from forewarn.imds.document import Event
from forewarn.node.actions import APPLIED, KubeNodeActor
from forewarn.node.kube import make_client
from forewarn.outbox.outbox import Outbox
from forewarn.owner import Owner
from test_fleet_approval import FixedToken

from peers.arm import ArmPeer
from peers.kube_api import KubeApi
from peers.pki import Authority

ROOT = Path(__file__).parent.parent
FLEET_NODE_ROLE = ROOT / "deploy" / "kubernetes" / "components" / "fleet-node-actions" / "clusterrole.yaml"
SUB = str(uuid.UUID(int=31))
POOL = (f"/subscriptions/{SUB}/resourceGroups/mc_rg-aks_cluster_westeurope/providers/Microsoft.Compute/"
        "virtualMachineScaleSets/aks-pool-vmss")
NODES = tuple(f"aks-pool-vmss00000{i}" for i in range(3))
POLICY = """
rules:
  - name: pool
    action: approve
    match: {event_type: [Reboot, Redeploy]}
    node: [cordon]
"""
SCOPE = FleetScope.of([SUB])
OWNER = SCOPE.owner("forewarn/forewarn-fleet")
AGENT = Owner()
OPEN = ("Scheduled", "Started")


def fleet_event(n: int, instances: tuple[int, ...], status: str = "Scheduled") -> FleetEvent:
    event_id = str(uuid.UUID(int=90_000 + n))
    not_before = datetime.now(timezone.utc) + timedelta(minutes=10)
    resources = tuple(f"aks-pool-vmss_{i}" for i in instances)
    raw = {"EventId": event_id, "EventType": "Reboot", "EventStatus": status, "ResourceType": "VirtualMachine",
           "Resources": list(resources), "NotBefore": not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
           "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
    event = Event(event_id, "Reboot", status, "VirtualMachine", resources, not_before, "", "Platform", -1, raw=raw)
    return FleetEvent(POOL, SUB, "mc_rg-aks_cluster_westeurope", event, "resourcegraph")


def with_status(event: FleetEvent, status: str) -> FleetEvent:
    raw = {**event.event.raw, "EventStatus": status}
    return replace(event, event=replace(event.event, status=status, raw=raw), origin="queue")


@dataclass
class WorldEvent:
    event: FleetEvent
    status: str = "Scheduled"    # Scheduled, Started, Completed, Canceled, or gone (vanished without a status)
    listed: bool = False         # Resource Graph lists it yet (it lags behind the announcement)

    @property
    def open(self) -> bool:
        return self.status in OPEN


class Replica:
    """One `forewarn fleet` replica: its own outbox and committer, an approver with node actions."""

    def __init__(self, name: str, tmp: Path, kubeconfig: str, arm: ArmPeer, active: threading.Event,
                 lease: Any) -> None:
        self.metrics = FleetMetrics(["resourcegraph"])
        self.outbox = Outbox(tmp / name, ["file"])
        self.committer = FleetCommitter(self.outbox, self.metrics, active=active.is_set)
        self.committer.snapshots_expected = True
        self.nodes = FleetNodes(lambda stop: make_client(kubeconfig, stop=stop), self.outbox.append, self.metrics,
                                refresh=0.0, poll=0.05, owner=OWNER)
        self.approver = FleetApprover(parse_policy(POLICY, fleet=True), Acknowledger(arm.base, FixedToken()),
                                      self.view, self.outbox.append, self.metrics.approvals, active=active.is_set,
                                      nodes=self.nodes, scope=SCOPE, held=self.metrics.undo_held,
                                      publish=lambda: lease(self))
        self.committer.on_ended = self.approver.ended
        self.during_list: list[Any] = []   # work to do after the view is read, before the nodes are listed
        self.stop = threading.Event()
        self.stop.set()                    # not in a term yet

    def view(self) -> Any:
        view = self.committer.view()
        while self.during_list:
            self.during_list.pop(0)()
        return view

    def begin(self, notes: dict[str, str | None]) -> None:
        self.stop = threading.Event()
        self.committer.inherit(notes.get("announced"))
        self.approver.inherit(notes.get("approved"))
        self.nodes.begin(self.stop)

    def notes(self) -> dict[str, str | None]:
        return {"announced": self.committer.handover(), "approved": self.approver.handover()}

    def end(self) -> None:
        self.stop.set()
        self.nodes.wait_idle(10)
        self.approver.wait_idle(10)
        self.nodes.end()


def ledger(api: KubeApi, node: str) -> dict[str, dict[str, Any]]:
    text = (api.node(node)["metadata"].get("annotations") or {}).get(APPLIED)
    return json.loads(text) if text else {}


class FleetInterleavings(RuleBasedStateMachine):
    """See the module docstring. `env` holds the stand-ins, made once for all examples."""

    env: dict[str, Any] = {}

    @initialize(first=st.lists(st.lists(st.integers(0, len(NODES) - 1), min_size=1, max_size=2, unique=True),
                               min_size=1, max_size=2))
    def setup(self, first: list[list[int]]) -> None:
        """The stand-ins cleaned, two replicas (a active), and the first events listed and snapshotted, so that
        the interesting part (acting, then takeovers and endings) starts at once."""

        api: KubeApi = self.env["api"]
        tmp: Path = self.env["tmp"] / uuid.uuid4().hex[:8]
        for node in NODES:
            api.update_node(node, lambda obj: (obj["spec"].pop("unschedulable", None),
                                               (obj["metadata"].get("annotations") or {}).pop(APPLIED, None)))
        self.api, self.arm = api, self.env["arm"]
        self.acks_before = len(self.arm.received.acks)
        self.world: dict[int, WorldEvent] = {}
        self.next_event = len(self.env.setdefault("events", [])) * 100
        self.flags = [threading.Event(), threading.Event()]
        self.replicas = [Replica(name, tmp, self.env["kubeconfig"], self.arm, flag, self._publish)
                         for name, flag in zip(("a", "b"), self.flags, strict=True)]
        self.lease_fails = False
        self.active = 0
        self.flags[0].set()
        self.replicas[0].begin({})
        self.published = self.replicas[0].notes()   # what the Lease holds (written at each renew)
        kubeconfig = self.env["kubeconfig"]
        self.agents = {node: KubeNodeActor(make_client(kubeconfig), node, owner=AGENT) for node in NODES}
        self.agent_events: dict[str, set[int]] = {node: set() for node in NODES}
        self.seen: dict[tuple[str, str], dict[str, Any]] = {}   # (node, ledger key) -> entry, as last checked
        self.agent_changed = False
        for instances in first:
            self.announce(instances, listed=True)
        self._snapshot_now(complete=True)

    def teardown(self) -> None:
        for replica in getattr(self, "replicas", []):
            if not replica.stop.is_set():
                replica.end()
            replica.outbox.close()
        for agent in getattr(self, "agents", {}).values():
            agent.client.close()

    @property
    def replica(self) -> Replica:
        return self.replicas[self.active]

    # --- the world -----------------------------------------------------------------------------------
    @rule(instances=st.lists(st.integers(0, len(NODES) - 1), min_size=1, max_size=2, unique=True),
          listed=st.booleans())
    def announce(self, instances: list[int], listed: bool) -> None:
        """A new event; Resource Graph lists it at once, or only later (resource_graph_catches_up)."""
        n = self.next_event = self.next_event + 1
        self.world[n] = WorldEvent(fleet_event(n, tuple(sorted(instances))), listed=listed)
        self._serve()

    def _serve(self) -> None:
        """ARM knows the open events (an acknowledgement of one that ended is 404, as on Azure)."""
        self.arm.rows = [{"id": w.event.arm_id, "name": w.event.event_id, "subscriptionId": SUB}
                         for w in self.world.values() if w.open]

    @precondition(lambda self: any(w.open for w in self.world.values()))
    @rule(data=st.data(), to=st.sampled_from(["Started", "Completed", "Canceled", "gone"]))
    def world_moves(self, data: st.DataObject, to: str) -> None:
        """An event moves on in the world; the agents of its nodes see it at once in IMDS and undo theirs."""
        n = data.draw(st.sampled_from(sorted(k for k, w in self.world.items() if w.open)))
        if to == "Started" and self.world[n].status == "Started":
            to = "Completed"
        self.world[n].status = to
        self._serve()
        for node, events in self.agent_events.items():
            if n in events and not self.world[n].open:
                self.agents[node].undo(self.world[n].event.event.event_id, False, lambda outcome: None)
                events.discard(n)
                self.agent_changed = True

    # --- the sources -------------------------------------------------------------------------------------
    def _snapshot_now(self, complete: bool, dropped: frozenset[int] = frozenset()) -> None:
        rows = [with_status(w.event, w.status) for n, w in self.world.items()
                if w.listed and w.open and n not in dropped]
        self.replica.committer.snapshot(rows, started_at=self.replica.committer.clock(), complete=complete)

    @rule(complete=st.booleans(), catch_up=st.booleans(), drop=st.sets(st.integers(0, 50), max_size=2))
    def snapshot(self, complete: bool, catch_up: bool, drop: set[int]) -> None:
        """A Resource Graph snapshot: complete (every page) or partial (pages missing: some rows left out); it
        lists events announced late only once it caught up with them."""
        if catch_up:
            for world in self.world.values():
                world.listed = True
        self._snapshot_now(complete, frozenset() if complete else frozenset(drop) | {max(self.world, default=0)})

    @precondition(lambda self: any(w.status != "gone" for w in self.world.values()))
    @rule(data=st.data())
    def queue_news(self, data: st.DataObject) -> None:
        """The queue delivers what the world says of one event, or old news (a Scheduled after Started)."""
        n = data.draw(st.sampled_from(sorted(k for k, w in self.world.items() if w.status != "gone")))
        world = self.world[n]
        self.replica.committer.news([with_status(world.event, data.draw(st.sampled_from(["Scheduled",
                                                                                         world.status])))])

    # --- the actors ----------------------------------------------------------------------------------------
    @rule(times=st.integers(1, 3), during=st.sampled_from(["", "complete snapshot", "partial snapshot",
                                                            "an event completes", "node list fails"]))
    def step(self, times: int = 1, during: str = "") -> None:
        """The active approver's ticks (acting takes one, the approval the next). `during` the first one's
        node list: a snapshot is committed (the race of the defect: after the approver read its view), an open
        event completes and the queue says so, or the list fails."""
        if during == "node list fails":
            self.api.fail_next("GET", r"/api/v1/nodes$", 500)
        elif during == "an event completes":
            opened = [w for w in self.world.values() if w.open]
            if opened:
                opened[0].status = "Completed"
                self._serve()
                self.replica.during_list.append(
                    lambda: self.replica.committer.news([with_status(opened[0].event, "Completed")]))
        elif during:
            self.replica.during_list.append(lambda: self._snapshot_now(during == "complete snapshot"))
        for _ in range(times):
            self.replica.approver.step(threading.Event())
            assert self.replica.approver.wait_idle(20), "node work or acknowledgements did not finish"

    def _publish(self, replica: Replica) -> bool:
        """The approver writes its handover into the Lease before it acknowledges (LeaseElector.publish)."""
        if self.lease_fails or replica is not self.replica:
            return False
        self.published = replica.notes()
        return True

    @rule(fails=st.booleans())
    def lease(self, fails: bool) -> None:
        """A renew of the Lease writes the handover notes, or the API server refuses its writes for a while."""
        self.lease_fails = fails
        if not fails:
            self.published = self.replica.notes()

    @rule(kill=st.booleans())
    def takeover(self, kill: bool) -> None:
        """The other replica takes the Lease and reads what the last write to it left: after a clean stop, a
        renew just before it; after kill -9, whatever was written last (a renew, or a publish before an
        acknowledgement)."""
        old = self.replica
        if not kill:
            self.published = old.notes()
        notes = self.published
        self.flags[self.active].clear()
        old.end()
        self.active = 1 - self.active
        self.flags[self.active].set()
        self.replica.begin(notes)
        self.lease_fails = False

    @precondition(lambda self: any(w.open for w in self.world.values()))
    @rule(data=st.data())
    def agent_acts(self, data: st.DataObject) -> None:
        """The per-VM agent of a node cordons it for an event of its IMDS document (which it sees at once,
        before the central feeds list it)."""
        n = data.draw(st.sampled_from(sorted(k for k, w in self.world.items() if w.open)))
        world = self.world[n]
        instance = data.draw(st.sampled_from([int(r.rsplit("_", 1)[1]) for r in world.event.event.resources]))
        node = NODES[instance]
        assert self.agents[node].act([NodeAction("cordon")], world.event.event, False, lambda outcome: None)
        self.agent_events[node].add(n)
        self.agent_changed = True

    # --- the invariants -------------------------------------------------------------------------------
    @invariant()
    def a_node_holding_a_cordon_is_cordoned_and_only_over_events_lose_fleet_entries(self) -> None:
        if not hasattr(self, "api"):
            return
        now: dict[tuple[str, str], dict[str, Any]] = {}
        for node in NODES:
            held = ledger(self.api, node)
            if any(entry.get("cordon") for entry in held.values()):
                assert self.api.node(node)["spec"].get("unschedulable") is True, (node, held)
            now.update({(node, key): entry for key, entry in held.items()})
        by_id = {w.event.event.event_id: w for w in self.world.values()}
        for (node, key), entry in self.seen.items():
            if entry.get("by") == OWNER.id and (node, key) not in now:
                world = by_id[entry["event"]]
                assert not world.open, f"node {node}: fleet's entry for an open ({world.status}) event was undone"
            if entry.get("by") == AGENT.id and not self.agent_changed:
                assert now.get((node, key)) == entry, f"node {node}: the agent's entry {key} changed by fleet mode"
        for (node, key), entry in now.items():
            if entry.get("by") == AGENT.id and not self.agent_changed and (node, key) not in self.seen:
                raise AssertionError(f"node {node}: an agent entry {key} written by fleet mode")
            if entry.get("by") == OWNER.id and (node, key) not in self.seen:
                # Written in this step, after its view: by then the replica's feeds had not said it ended.
                assert not self.replica.committer.tracker.has_ended(entry["event"]), \
                    f"node {node}: fleet mode acted for an event its feeds said had ended"
            assert entry.get("by") in (OWNER.id, AGENT.id), (node, key, entry)
        self.seen = now
        self.agent_changed = False

    @invariant()
    def nothing_is_acknowledged_twice(self) -> None:

        if not hasattr(self, "arm"):
            return
        acked = [event for _, event, _, _ in self.arm.received.acks[self.acks_before:]]
        assert len(acked) == len(set(acked)), f"acknowledged twice: {acked}"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("interleavings")
    authority = Authority("interleavings-ca")
    bundle = tmp / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    arm = ArmPeer(authority, token="ack-token")
    with KubeApi(cluster_role=FLEET_NODE_ROLE, namespaces=["forewarn"]) as api:
        for i, node in enumerate(NODES):
            api.add_node(node, provider_id=f"azure://{POOL.replace('mc_rg', 'MC_rg')}/virtualMachines/{i}")
        yield {"api": api, "arm": arm, "tmp": tmp,
               "kubeconfig": str(api.kubeconfig(tmp / "kubeconfig", namespace="forewarn"))}
    arm.stop()
    monkeypatch.undo()


def test_no_interleaving_undoes_too_early_touches_another_owner_or_acknowledges_twice(
        stand_ins: dict[str, Any]) -> None:
    FleetInterleavings.env = stand_ins
    run_state_machine_as_test(FleetInterleavings, settings=settings(
        max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)))


def test_a_successor_after_kill_9_neither_undoes_nor_acknowledges_again(stand_ins: dict[str, Any]) -> None:
    """The two orders the state machine is there to find, spelt out: the active replica cordons and
    acknowledges, is killed before any renew, and its successor (a tracker that knows nothing) reads the nodes
    while its first complete snapshot is committed."""
    FleetInterleavings.env = stand_ins
    machine = FleetInterleavings()
    machine.setup([[0], [1, 2]])
    try:
        machine.step(times=3)
        assert len(machine.arm.received.acks) - machine.acks_before == 2
        assert all(machine.api.node(node)["spec"].get("unschedulable") for node in NODES)
        machine.a_node_holding_a_cordon_is_cordoned_and_only_over_events_lose_fleet_entries()
        machine.takeover(kill=True)
        machine.step(times=1, during="complete snapshot")
        machine.a_node_holding_a_cordon_is_cordoned_and_only_over_events_lose_fleet_entries()
        machine.snapshot(complete=True, catch_up=False, drop=set())
        machine.step(times=3)
        machine.a_node_holding_a_cordon_is_cordoned_and_only_over_events_lose_fleet_entries()
        machine.nothing_is_acknowledged_twice()
        assert all(machine.api.node(node)["spec"].get("unschedulable") for node in NODES)
    finally:
        machine.teardown()


def test_a_replica_that_gets_the_lease_back_does_not_approve_what_its_successor_approved(
        stand_ins: dict[str, Any]) -> None:
    """Found by the state machine: replica a acts on an event but is killed before approving it; b approves it;
    b is killed and a takes the Lease back with its own track of the event, still waiting: it must take b's
    word from the Lease and not acknowledge it again."""
    FleetInterleavings.env = stand_ins
    machine = FleetInterleavings()
    machine.setup([[0]])
    try:
        machine.step(times=1)                          # a: the cordon, no approval yet
        assert len(machine.arm.received.acks) == machine.acks_before
        machine.takeover(kill=True)
        machine.step(times=3, during="complete snapshot")
        assert len(machine.arm.received.acks) - machine.acks_before == 1, "b approves"
        machine.takeover(kill=True)
        machine.step(times=3, during="complete snapshot")
        machine.nothing_is_acknowledged_twice()
    finally:
        machine.teardown()
