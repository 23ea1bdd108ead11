"""One active `forewarn fleet` replica by a Lease: LeaseElector with the real lightkube client (make_client,
forewarn's deadline-bound transport) against the strict API stand-in, which validates every Lease written
against the coordination.k8s.io/v1 schema and checks RBAC against the least-privilege Role below.

Most tests share a fake clock between replicas, so "the lease expired" takes no waiting; the run() tests
use the real clock with a 1 s lease."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.fleet.lease import LeaseElector, default_identity
from forewarn.node.kube import make_client

from conftest import wait_until
from peers.kube_api import KubeApi, schema_errors

NAMESPACE = "forewarn"
NAME = "forewarn-fleet"
# What the fleet Deployment's service account needs: create (RBAC cannot limit a create by name) and
# get/update of its one Lease.
ROLE = f"""\
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: forewarn-fleet-lease, namespace: {NAMESPACE}}}
rules:
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [{NAME}]
  verbs: [get, update]
"""
T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Make = Callable[..., LeaseElector]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeApi]:
    role = tmp_path / "role.yaml"
    role.write_text(ROLE)
    with KubeApi(cluster_role=role, namespaces=[NAMESPACE]) as server:
        yield server


@pytest.fixture
def elector(api: KubeApi, tmp_path: Path) -> Make:
    def make(identity: str, clock: Callable[[], float], *, lease_seconds: int = 2, renew_every: float = 0.5,
             stop: threading.Event | None = None) -> LeaseElector:
        kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{identity}", namespace=NAMESPACE)
        client = make_client(str(kubeconfig), timeout=2.0, stop=stop)
        return LeaseElector(client, NAMESPACE, NAME, identity, lease_seconds=lease_seconds,
                            renew_every=renew_every, clock=clock)
    return make


def the_lease(api: KubeApi) -> dict[str, Any]:
    leases = api.leases()
    assert len(leases) == 1
    assert schema_errors(leases[0]) == []  # the stand-in refuses invalid writes; this checks what it kept
    return leases[0]


def test_of_two_replicas_on_one_lease_exactly_one_is_active(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    for _ in range(6):
        assert (a.step(), b.step()) == (True, False)
        assert (a.is_leader, b.is_leader) == (True, False)
        assert a.holder == b.holder == "a"
        clock.now += 0.5
    lease = the_lease(api)
    assert lease["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "forewarn"}
    spec = lease["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == ("a", 2, 0)
    assert spec["renewTime"] == "2027-01-15T08:00:02.500000Z"  # the last renew, as a MicroTime
    assert spec["acquireTime"] == "2027-01-15T08:00:00.000000Z"  # kept across renewals


def test_a_killed_leader_is_replaced_only_after_its_lease_expires(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert a.step() and not b.step()
    # a is SIGKILLed: it never steps again. b waits out the lease (renewTime + 2 s, strictly after).
    for at in (0.5, 1.0, 1.5, 2.0):
        clock.now = T0 + at
        assert not b.step()
    assert not a.is_leader  # a's own renew deadline (2 s - 0.5 s) passed before b could take over
    clock.now = T0 + 2.01
    assert b.step()
    spec = the_lease(api)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert spec["acquireTime"] == spec["renewTime"]
    # a wakes up after all (a paused VM): it sees b's term and stays standby.
    assert not a.step() and a.holder == "b" and b.step()


def test_a_released_lease_is_taken_at_once(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert a.step() and not b.step()
    assert a.release()
    assert not a.is_leader
    assert "holderIdentity" not in the_lease(api)["spec"]
    assert b.step()  # the same instant: no waiting for the lease time
    spec = the_lease(api)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert not a.release()  # not ours any more: nothing written
    assert the_lease(api)["spec"]["holderIdentity"] == "b"


def test_a_stale_holder_releasing_never_clears_its_successors_lease(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert a.step()
    clock.now += 5     # a was paused past its lease; b took over
    assert b.step()
    assert not a.release()  # a's write carries the resourceVersion of its last renew: 409
    assert [r.status for r in api.requests if r.method == "PUT"][-1] == 409
    assert the_lease(api)["spec"]["holderIdentity"] == "b" and b.step()


def test_a_lost_update_race_leaves_the_loser_standby(api: KubeApi, elector: Make,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    old, a, b = elector("old", clock), elector("a", clock), elector("b", clock)
    assert old.step()
    clock.now = T0 + 10  # old's lease has expired: a and b both see it free
    read = b.client.get

    def read_then_a_takes_it(*args: Any, **kwargs: Any) -> Any:
        lease = read(*args, **kwargs)
        monkeypatch.setattr(b.client, "get", read)
        assert a.step()   # a writes between b's read and b's write
        return lease

    monkeypatch.setattr(b.client, "get", read_then_a_takes_it)
    assert not b.step()  # b's write carried the old resourceVersion: 409
    assert [r.status for r in api.requests if r.method == "PUT"][-1] == 409
    assert (a.is_leader, b.is_leader, b.holder) == (True, False, "a")
    assert the_lease(api)["spec"]["leaseTransitions"] == 1


def test_a_lost_create_race_reads_the_winner(api: KubeApi, elector: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    create = b.client.create

    def a_creates_first(*args: Any, **kwargs: Any) -> Any:
        assert a.step()
        return create(*args, **kwargs)

    monkeypatch.setattr(b.client, "create", a_creates_first)
    assert not b.step()
    assert [r.status for r in api.requests if r.method == "POST"] == [201, 409]
    assert b.holder == "a" and a.is_leader


def step_at_once(replicas: list[LeaseElector]) -> dict[str, bool]:
    """Each replica's step(), all started together on threads of their own: who won."""
    barrier = threading.Barrier(len(replicas))
    results: dict[str, bool] = {}

    def step(replica: LeaseElector) -> None:
        barrier.wait()
        results[replica.identity] = replica.step()

    threads = [threading.Thread(target=step, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


@pytest.mark.parametrize("lease_exists", [False, True])
def test_replicas_stepping_at_once_elect_exactly_one(api: KubeApi, elector: Make, lease_exists: bool) -> None:
    clock = Clock()
    replicas = [elector(f"r{i}", clock) for i in range(4)]
    if lease_exists:
        assert elector("old", clock).step()
        clock.now += 10
    for _ in range(5):
        results = step_at_once(replicas)
        winners = [name for name, won in results.items() if won]
        assert len(results) == 4 and len(winners) == 1, results
        assert the_lease(api)["spec"]["holderIdentity"] == winners[0]
        clock.now += 10  # everyone's lease expired: the next round races again (the holder renews, or loses)
    assert any(r.status == 409 for r in api.requests), "no round raced"


def test_a_leader_that_cannot_reach_the_api_steps_down_before_anyone_can_take_over(
        api: KubeApi, elector: Make, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "forewarn.fleet.lease")
    clock = Clock()
    a = elector("a", clock)
    assert a.step()
    caplog.clear()  # what follows counts from here, whatever an earlier test left the loggers' levels at
    for method in ("GET", "PUT", "POST"):
        api.fail_always(method, "/leases", 503, "etcdserver: request timed out")
    seen = []
    for tick in range(1, 13):
        clock.now = T0 + tick * 0.25
        seen.append((tick * 0.25, a.step()))
        assert not (a.is_leader and clock.now >= T0 + 2)  # never the leader once someone else may be
    assert seen[:5] == [(0.25, True), (0.5, True), (0.75, True), (1.0, True), (1.25, True)]
    assert not any(leader for _, leader in seen[5:])  # down at the renew deadline, 1.5 s after the renew
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "503" in errors[0] and "etcdserver" in errors[0], errors
    assert sum("no longer the active replica (cannot renew it)" in r.getMessage() for r in caplog.records) == 1

    api.recover()  # nobody else took the lease meanwhile: a renews and leads again
    clock.now += 0.25
    assert a.step()
    assert sum("recovered" in r.getMessage() for r in caplog.records) == 1
    assert sum("is now the active replica" in r.getMessage() for r in caplog.records) == 1


def test_a_standby_stays_standby_while_the_api_fails(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    assert a.step() and not b.step()
    api.fail_always("GET", "/leases", 500)
    clock.now += 10
    assert not b.step() and not b.is_leader


def test_a_leader_cut_off_from_the_api_and_its_successor_never_overlap(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    cut = threading.Event()
    a, b = elector("a", clock, stop=cut), elector("b", clock)
    assert a.step() and not b.step()
    cut.set()  # a's requests now fail at once (Stopped), as with a partition; b still reaches the API
    timeline = []
    for tick in range(1, 17):
        clock.now = T0 + tick * 0.25
        timeline.append((tick * 0.25, a.step(), b.step()))
    assert not any(a_leads and b_leads for _, a_leads, b_leads in timeline)
    a_last = max(at for at, a_leads, _ in timeline if a_leads)
    b_first = min(at for at, _, b_leads in timeline if b_leads)
    assert a_last < 1.5 and b_first > 2.0, timeline


def test_missing_permissions_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    role = tmp_path / "get-only.yaml"
    role.write_text(ROLE.replace("verbs: [create]", "verbs: [get]"))
    with KubeApi(cluster_role=role, namespaces=[NAMESPACE]) as api:
        client = make_client(str(api.kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)), timeout=2.0)
        a = LeaseElector(client, NAMESPACE, NAME, "a", lease_seconds=2, renew_every=0.5)
        assert not a.step()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "create lease forewarn/forewarn-fleet: forbidden (403)" in errors[0], errors
    assert "needs create, and get and update of lease forewarn-fleet, on coordination.k8s.io leases in " \
           "namespace forewarn" in errors[0]


def test_a_stopped_api_server_makes_the_leader_step_down(api: KubeApi, elector: Make) -> None:
    clock = Clock()
    a = elector("a", clock)
    assert a.step()
    api.stop()  # connection refused from now on
    clock.now += 1.0
    assert a.step()  # still within the renew deadline
    clock.now += 0.5
    assert not a.step() and not a.is_leader


def test_run_calls_on_start_and_on_stop_in_order_once_per_term(elector: Make,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    a = elector("a", time.time, lease_seconds=1, renew_every=0.01)
    script = iter([False, True, True, False, False, True, True, True])
    stop = threading.Event()
    calls: list[str] = []

    def scripted() -> bool:
        result = next(script, None)
        if result is None:
            stop.set()
            return True
        return result

    monkeypatch.setattr(a, "step", scripted)
    a.run(stop, lambda: calls.append("start"), lambda: calls.append("stop"))
    assert calls == ["start", "stop", "start", "stop"]  # the last on_stop at the stop


def test_replicas_running_hand_over_at_a_clean_stop_and_after_an_outage(api: KubeApi, elector: Make) -> None:
    events: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def note(who: str, what: str) -> Callable[[], None]:
        def record() -> None:
            with lock:
                events.append((time.monotonic(), who, what))
        return record

    replicas = {name: elector(name, time.time, lease_seconds=1, renew_every=0.1) for name in ("a", "b")}
    stops = {name: threading.Event() for name in replicas}
    threads = {name: threading.Thread(target=e.run, args=(stops[name], note(name, "start"), note(name, "stop")),
                                      name=f"lease-{name}") for name, e in replicas.items()}
    for thread in threads.values():
        thread.start()
    try:
        first = wait_until(lambda: next((n for n, e in replicas.items() if e.is_leader), None), 5, message="a leader")
        second = "b" if first == "a" else "a"

        # An outage: the leader steps down within the lease time (on_stop), and leads again after it.
        api.fail_always("PUT", "/leases", 503)
        began = time.monotonic()
        wait_until(lambda: any(e[1:] == (first, "stop") for e in events), 3, message="on_stop in the outage")
        assert time.monotonic() - began < 1.0
        assert not replicas[first].is_leader and not replicas[second].is_leader
        api.recover()
        wait_until(lambda: sum(e[2] == "start" for e in events) == 2, 5, message="a second term")
        leader = next(n for n, e in replicas.items() if e.is_leader)
        other = "b" if leader == "a" else "a"

        # A clean stop: on_stop, the release, and the other replica takes over well within the lease time.
        stops[leader].set()
        threads[leader].join(5)
        stopped = time.monotonic()
        # Its term has begun once on_start ran: is_leader is true a moment before, and a replica told to stop
        # in that moment starts nothing (by design), which the sequence below would then miss.
        wait_until(lambda: any(e[1:] == (other, "start") for e in events), 1, interval=0.01,
                   message="the takeover after a release")
        assert time.monotonic() - stopped < 0.5
    finally:
        for stop in stops.values():
            stop.set()
        for thread in threads.values():
            thread.join(5)
    # Terms never overlap: each start comes after the previous term's stop, and every term ends once.
    sequence = [(who, what) for _, who, what in sorted(events)]
    assert sequence == [(first, "start"), (first, "stop"), (leader, "start"), (leader, "stop"), (other, "start"),
                        (other, "stop")], sequence
    assert "holderIdentity" not in the_lease(api)["spec"]  # the last one released it too


def test_the_default_identity_is_the_pod_name_and_new_for_every_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTNAME", "forewarn-fleet-7d9f-x2k4p")
    first, second = default_identity(), default_identity()
    assert first.startswith("forewarn-fleet-7d9f-x2k4p-") and second.startswith("forewarn-fleet-7d9f-x2k4p-")
    assert first != second


@pytest.mark.parametrize(("lease_seconds", "renew_every"), [(0, 0.1), (2, 2.0), (2, 0.0), (1.5, 0.5)])
def test_a_renew_period_that_cannot_keep_the_lease_is_refused(elector: Make, lease_seconds: Any,
                                                              renew_every: float) -> None:
    with pytest.raises(ValueError, match=r"^(lease_seconds|renew_every) "):
        elector("a", time.time, lease_seconds=lease_seconds, renew_every=renew_every)


def test_the_holder_hands_over_in_the_lease_and_its_successor_reads_it(api: KubeApi, elector: Make) -> None:
    """The handover annotations (forewarn.fleet.handover) ride on the renews: written only by the holder while
    it holds the Lease, kept when another replica takes over, and read by that replica as it takes it."""
    from forewarn.fleet.handover import ANNOTATION

    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    a.handover = lambda: {ANNOTATION: "AAAAAAAAAAA="}
    b.handover = lambda: {ANNOTATION: "not-b-until-it-leads"}
    assert a.step() and a.inherited == {}
    assert ANNOTATION not in (the_lease(api)["metadata"].get("annotations") or {})  # a create hands over nothing
    clock.now = T0 + 0.5
    assert a.step() and not b.step()
    assert the_lease(api)["metadata"]["annotations"][ANNOTATION] == "AAAAAAAAAAA="
    a.handover = dict  # a sink has a backlog: the annotation stays as the last renew left it
    clock.now = T0 + 1.0
    assert a.step()
    assert the_lease(api)["metadata"]["annotations"][ANNOTATION] == "AAAAAAAAAAA="
    clock.now = T0 + 3.1  # a is gone; b takes over and inherits a's note, which the takeover write keeps
    assert b.step() and b.inherited.get(ANNOTATION) == "AAAAAAAAAAA="
    assert the_lease(api)["metadata"]["annotations"][ANNOTATION] == "AAAAAAAAAAA="
    clock.now = T0 + 3.6
    assert b.step()
    assert the_lease(api)["metadata"]["annotations"][ANNOTATION] == "not-b-until-it-leads"


# --- publish(): the handover written now, before acknowledgements go out ------------------------------------

def lease_puts(api: KubeApi) -> list[int | None]:
    """The status of every PUT of the Lease so far."""
    return [r.status for r in list(api.requests) if r.method == "PUT" and "/leases/" in r.path]


def test_the_holder_publishes_its_handover_at_once(api: KubeApi, elector: Make) -> None:
    """publish() renews now, between the loop's rounds, with handover() as it is at that moment."""
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a = elector("a", clock)
    notes = {APPROVED_ANNOTATION: ""}
    a.handover = lambda: dict(notes)
    assert a.step()                      # created: a create hands over nothing
    notes[APPROVED_ANNOTATION] = "AAAAAAAAAAA="
    clock.now += 0.1                     # well before the next round (renew_every 0.5)
    assert a.publish()
    lease = the_lease(api)
    assert lease["metadata"]["annotations"][APPROVED_ANNOTATION] == "AAAAAAAAAAA="
    assert lease["spec"]["renewTime"] == "2027-01-15T08:00:00.100000Z"   # a renew: the term goes on from now
    assert lease_puts(api) == [200] and a.is_leader
    notes[APPROVED_ANNOTATION] = "AAAAAAAAAAA=BBBBBBBBBBB="
    assert a.publish()                   # each publish writes what handover() says then
    assert the_lease(api)["metadata"]["annotations"][APPROVED_ANNOTATION] == "AAAAAAAAAAA=BBBBBBBBBBB="


def test_a_standby_publishes_nothing(api: KubeApi, elector: Make) -> None:
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    b.handover = lambda: {APPROVED_ANNOTATION: "BBBBBBBBBBB="}
    assert not b.publish()               # never stepped: not the holder, and no request at all
    assert api.requests == []
    assert a.step() and not b.step()
    before = len(api.requests)
    assert not b.publish()
    assert len(api.requests) == before, "a standby sent a request to publish"
    assert APPROVED_ANNOTATION not in (the_lease(api)["metadata"].get("annotations") or {})
    assert the_lease(api)["spec"]["holderIdentity"] == "a" and not b.is_leader


def test_a_holder_past_its_renew_deadline_publishes_nothing(api: KubeApi, elector: Make) -> None:
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a = elector("a", clock)
    a.handover = lambda: {APPROVED_ANNOTATION: "AAAAAAAAAAA="}
    assert a.step()
    clock.now += 1.5                     # lease_seconds 2 - renew_every 0.5: no longer sure to hold it
    before = len(api.requests)
    assert not a.publish() and len(api.requests) == before


@pytest.mark.parametrize(("method", "status"), [("PUT", 500), ("PUT", 409), ("GET", 503), ("PUT", 403)])
def test_a_publish_the_api_server_refuses_returns_false(api: KubeApi, elector: Make, method: str,
                                                        status: int) -> None:
    """A refused or failed write is not in the Lease, and publish() says so: the approver then sends nothing.
    The holder stays the holder until its renew deadline (a renew of the loop may still get through)."""
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a = elector("a", clock)
    a.handover = lambda: {APPROVED_ANNOTATION: "AAAAAAAAAAA="}
    assert a.step()
    api.fail_next(method, "/leases/", status)
    assert not a.publish()
    assert APPROVED_ANNOTATION not in (the_lease(api)["metadata"].get("annotations") or {})
    assert a.is_leader
    clock.now += 0.1
    assert a.publish()                   # the next one gets through
    assert the_lease(api)["metadata"]["annotations"][APPROVED_ANNOTATION] == "AAAAAAAAAAA="


def test_a_publish_fails_while_the_api_server_keeps_failing(api: KubeApi, elector: Make) -> None:
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a = elector("a", clock)
    a.handover = lambda: {APPROVED_ANNOTATION: "AAAAAAAAAAA="}
    assert a.step()
    api.fail_always("PUT", "/leases/", 503, "etcdserver: request timed out")
    for _ in range(3):
        clock.now += 0.1
        assert not a.publish()
    assert APPROVED_ANNOTATION not in (the_lease(api)["metadata"].get("annotations") or {})
    api.recover()
    assert a.publish()


def test_a_publish_waits_for_a_round_under_way_and_never_interleaves(api: KubeApi, elector: Make,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's round holds the Lease between its read and its write (the write carries the resourceVersion
    read); a publish coming then must not read and write in between, or one of the two writes gets 409 and the
    holder loses its term. So publish waits for the round, and its own read comes after the round's write."""
    from forewarn.fleet.handover import APPROVED_ANNOTATION

    clock = Clock()
    a = elector("a", clock)
    a.handover = lambda: {APPROVED_ANNOTATION: "AAAAAAAAAAA="}
    assert a.step()
    calls: list[tuple[str, str]] = []
    in_round, go_on = threading.Event(), threading.Event()
    get, replace = a.client.get, a.client.replace

    def read(*args: Any, **kwargs: Any) -> Any:
        calls.append((threading.current_thread().name, "get"))
        lease = get(*args, **kwargs)
        if threading.current_thread().name == "round":
            in_round.set()
            assert go_on.wait(10)            # the round holds between its read and its write
        return lease

    def write(*args: Any, **kwargs: Any) -> Any:
        calls.append((threading.current_thread().name, "replace"))
        return replace(*args, **kwargs)

    monkeypatch.setattr(a.client, "get", read)
    monkeypatch.setattr(a.client, "replace", write)
    results: dict[str, bool] = {}
    clock.now += 0.1
    round_ = threading.Thread(target=lambda: results.update(round=a.step()), name="round")
    round_.start()
    assert in_round.wait(10)
    publish = threading.Thread(target=lambda: results.update(publish=a.publish()), name="publish")
    publish.start()
    # a negative can only be shown over some time: the publish sends nothing while the round holds
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(lambda: any(who == "publish" for who, _ in calls), timeout=0.3, message="a request of publish")
    go_on.set()
    round_.join(10)
    publish.join(10)
    assert results == {"round": True, "publish": True}
    assert calls == [("round", "get"), ("round", "replace"), ("publish", "get"), ("publish", "replace")]
    assert lease_puts(api)[-2:] == [200, 200]
    assert the_lease(api)["metadata"]["annotations"][APPROVED_ANNOTATION] == "AAAAAAAAAAA=" and a.is_leader
