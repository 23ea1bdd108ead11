"""Acknowledgements sent independently (forewarn.fleet.acks) through the real Acknowledger against the strict ARM
stand-in over TLS: a target ARM keeps failing never delays another's approval; its next try comes its backoff
(or ARM's Retry-After) after the failed call ENDED; never more calls under way than workers, never two for one
target; a refusal is final; the stop ends everything at once. Times are the stand-in's (time.monotonic())."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from forewarn.fleet.acknowledge import Acknowledger
from forewarn.fleet.acks import AckResult, AckRounds
from test_fleet_approval import FixedToken

from conftest import wait_until
from peers.arm import AckCall, ArmPeer, Faults
from peers.pki import Authority

SUB = str(uuid.UUID(int=21))
MakeRounds = Callable[..., AckRounds]


def vm(n: int) -> str:
    return f"/subscriptions/{SUB}/resourceGroups/rg-acks/providers/Microsoft.Compute/virtualMachines/vm-{n}"


VMSS = f"/subscriptions/{SUB}/resourceGroups/rg-acks/providers/Microsoft.Compute/virtualMachineScaleSets/pool"


def eid(n: int) -> str:
    return str(uuid.UUID(int=50_000 + n))


@pytest.fixture
def arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ArmPeer]:
    """The stand-in, with event n on vm-n (n = 1..10) and events 11..13 on the scale set."""
    authority = Authority("ack-rounds-test-ca")
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(authority.pem)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    events = [(vm(n), n) for n in range(1, 11)] + [(VMSS, n) for n in (11, 12, 13)]
    peer = ArmPeer(authority, token="ack-token", rows=[
        {"id": f"{target}/providers/Microsoft.Maintenance/scheduledevents/{eid(n)}", "name": eid(n),
         "subscriptionId": SUB} for target, n in events])
    yield peer
    peer.stop()


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def rounds_for(arm: ArmPeer) -> Iterator[MakeRounds]:
    """AckRounds on time.monotonic() (the stand-in's clock), the Acknowledger sharing its stop; all closed at
    the end (the stand-in's stop ends a call still under way)."""
    made: list[AckRounds] = []

    def make(stop: threading.Event, **options: Any) -> AckRounds:
        made.append(AckRounds(Acknowledger(arm.base, FixedToken(), timeout=10.0, stop=stop), time.monotonic, stop,
                              **options))
        return made[-1]

    yield make
    for rounds in made:
        rounds.stop.set()
        rounds.close()


def failing(status: int, retry_after: str | None, times: int = 10**6, delay: float = 0.0) -> Faults:
    return Faults(throttle=times if status == 429 else 0, retry_after=retry_after,
                  fail=times if status != 429 else 0, fail_status=status, fail_retry_after=retry_after, delay=delay)


def calls(arm: ArmPeer, target: str) -> list[AckCall]:
    with arm.received.lock:
        return [call for call in arm.received.ack_calls if call.target == target.lower()]


class Caller:
    """What the approver's step does with AckRounds: sends every target not yet done with whenever it is ready
    (asking `ready` first, then its own state, as `done` updates that state before the target is ready again),
    and keeps every result."""

    def __init__(self, rounds: AckRounds, wanted: dict[str, list[str]]) -> None:
        self.rounds = rounds
        self.open = dict(wanted)
        self.results: list[AckResult] = []
        self.sent: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def step(self) -> None:
        for target in list(self.open):
            now = time.monotonic()
            with self._lock:
                if not self.rounds.ready(target, now) or target not in self.open:
                    continue
                self.sent.setdefault(target, []).append(now)
                self.rounds.send(target, self.open[target], self.done)

    def done(self, result: AckResult) -> None:
        with self._lock:
            self.results.append(result)
            if result.ok or result.final:
                self.open.pop(result.target, None)

    def results_of(self, target: str) -> list[AckResult]:
        with self._lock:
            return [result for result in self.results if result.target == target]

    def run_until(self, predicate: Any, timeout: float, message: str) -> None:
        """Steps every 10 ms (the approver steps once a second, or at once after a commit) until `predicate`."""
        def stepped() -> Any:
            self.step()
            return predicate()

        wait_until(stepped, timeout=timeout, interval=0.01, message=message)


@pytest.mark.parametrize("status", [500, 429])
def test_a_target_that_keeps_failing_does_not_delay_another(arm: ArmPeer, rounds_for: MakeRounds,
                                                            stop: threading.Event, status: int) -> None:
    bad, good = vm(1), vm(2)
    arm.target_faults[bad.lower()] = failing(status, "5")
    rounds = rounds_for(stop)
    caller = Caller(rounds, {bad: [eid(1)], good: [eid(2)]})   # the failing one first, as it was
    caller.run_until(lambda: caller.results_of(good) and caller.results_of(bad), 5, "both results")
    (failed,) = caller.results_of(bad)
    sent = caller.sent[good][0]
    (acknowledged,) = calls(arm, good)
    assert acknowledged.status == 200 and acknowledged.arrived - sent < 0.5   # no Retry-After wait before it
    assert caller.results_of(good)[0].ok and arm.received.acks == [(good.lower(), eid(2), "single",
                                                                     "2025-10-01-preview")]
    assert failed.retryable and not failed.ok and failed.status == status and failed.failures == 1
    assert failed.next_attempt - calls(arm, bad)[0].answered >= 5.0           # ARM's Retry-After is kept ...
    assert not rounds.ready(bad, time.monotonic()) and len(calls(arm, bad)) == 1   # ... by no sleeping worker
    assert f"failed 1 time(s) in a row (HTTP {status}); next try in" in rounds.waiting(bad, time.monotonic())
    assert rounds.waiting(good, time.monotonic()) == ""
    rounds.close()


def test_the_next_try_comes_its_wait_after_the_failed_call_ended(arm: ArmPeer, rounds_for: MakeRounds,
                                                                 stop: threading.Event) -> None:
    slow, plain, capped = vm(3), vm(4), vm(5)
    # ARM takes 1 s to fail, and asks for 1.5 s: from the call's start, the retry would follow its end at once
    arm.target_faults[slow.lower()] = failing(500, "1.5", times=2, delay=1.0)
    arm.target_faults[plain.lower()] = failing(503, None, times=1, delay=1.0)   # no Retry-After: the backoff
    arm.target_faults[capped.lower()] = failing(429, "100", times=1)            # more than the cap asks
    rounds = rounds_for(stop, base=0.8, cap=3.0)
    caller = Caller(rounds, {slow: [eid(3)], plain: [eid(4)], capped: [eid(5)]})
    caller.run_until(lambda: not caller.open, 15, "every target acknowledged")
    first, second, third = calls(arm, slow)
    for earlier, later in ((first, second), (second, third)):
        assert earlier.status == 500 and later.arrived - earlier.arrived >= 2.5   # 1 s answering + 1.5 s after
        assert 1.5 <= later.arrived - earlier.answered < 2.0
    assert third.status == 200 and [r.failures for r in caller.results_of(slow)] == [1, 2, 0]
    failed, retried = calls(arm, plain)
    assert failed.status == 503 and 0.4 <= retried.arrived - failed.answered < 1.3   # base 0.8, jittered to half
    failed, retried = calls(arm, capped)
    assert failed.status == 429 and 1.5 <= retried.arrived - failed.answered < 3.5    # the cap, not 100 s
    assert caller.results_of(capped)[0].next_attempt - failed.answered <= 3.0 + 0.2
    rounds.close()


def test_never_more_calls_under_way_than_workers_nor_two_for_one_target(arm: ArmPeer, rounds_for: MakeRounds,
                                                                        stop: threading.Event) -> None:
    targets = {vm(n): [eid(n)] for n in range(1, 11)} | {VMSS: [eid(11), eid(12), eid(13)]}
    for n in range(1, 11):   # slow answers, each target failing twice before it goes through
        arm.target_faults[vm(n).lower()] = failing(500, "0", times=2, delay=0.2)
    arm.target_faults[VMSS.lower()] = Faults(delay=0.2)
    rounds = rounds_for(stop, workers=3, base=0.05, cap=0.1)
    caller = Caller(rounds, targets)
    caller.step()
    assert not rounds.ready(VMSS, time.monotonic())
    assert rounds.waiting(VMSS, time.monotonic()) == "an acknowledgement of its target is under way"
    with pytest.raises(RuntimeError, match="under way"):
        rounds.send(VMSS, [eid(11)], caller.done)
    caller.run_until(lambda: not caller.open, 20, "every target acknowledged")
    assert arm.received.ack_most_in_flight == 3                     # the pool was used, and bounded
    assert max(arm.received.ack_most_per_target.values()) == 1
    assert len(arm.received.ack_calls) == 10 * 3 + 1
    assert sorted(event for _, event, _, _ in arm.received.acks) == sorted(eid(n) for n in range(1, 14))
    assert calls(arm, VMSS)[0].event_ids == (eid(11), eid(12), eid(13))   # a target's events in one call
    rounds.close()
    acknowledger = rounds.acknowledger
    assert isinstance(acknowledger, Acknowledger)
    acknowledger.close()                                            # its kept-alive connections; a call opens anew
    assert acknowledger.acknowledge(vm(1), [eid(1)], attempts=1).requests == 1


def test_a_refusal_is_final_and_not_tried_again(arm: ArmPeer, rounds_for: MakeRounds,
                                                stop: threading.Event) -> None:
    gone, forbidden = vm(6), vm(7)
    arm.target_faults[forbidden.lower()] = failing(403, None, times=1)
    rounds = rounds_for(stop)
    caller = Caller(rounds, {gone: [eid(1)], forbidden: [eid(7)]})   # event 1 is vm-1's: 404 on vm-6
    caller.run_until(lambda: not caller.open, 5, "both refused")
    (missing,), (refused,) = caller.results_of(gone), caller.results_of(forbidden)
    assert missing.final and missing.status == 404 and "no such event" in missing.error
    assert refused.final and refused.status == 403 and "Scheduled Events Contributor" in refused.error
    assert (missing.failures, refused.failures) == (0, 0) and "ack-token" not in missing.error + refused.error
    assert len(calls(arm, gone)) == len(calls(arm, forbidden)) == 1
    # not ready-and-failing: a new event of the same target is sent at once (the refusal was for those events)
    assert rounds.ready(gone, time.monotonic()) and rounds.ready(forbidden, time.monotonic())
    # a caller's `done` that raises does not leave its target under way
    finished = threading.Event()

    def broken(result: AckResult) -> None:
        finished.set()
        raise RuntimeError("a bug in the caller")

    rounds.send(forbidden, [eid(7)], broken)
    wait_until(lambda: finished.is_set() and rounds.ready(forbidden, time.monotonic()), message="ready again")
    assert [call.status for call in calls(arm, forbidden)] == [403, 200]
    rounds.close()


def test_the_stop_ends_calls_under_way_and_those_queued_at_once(arm: ArmPeer, rounds_for: MakeRounds,
                                                                stop: threading.Event) -> None:
    hung = [vm(1), vm(2)]
    for target in hung:
        arm.target_faults[target.lower()] = Faults(hang=True)
    before = set(threading.enumerate())    # other tests' pools may still be about: only this one's count
    rounds = rounds_for(stop, workers=2)
    caller = Caller(rounds, {vm(1): [eid(1)], vm(2): [eid(2)], vm(3): [eid(3)], vm(4): [eid(4)]})
    caller.step()                          # two calls hang on both workers; two more wait for a worker
    wait_until(lambda: sum(arm.received.ack_in_flight.values()) == 2, message="both hung calls under way")
    stopped_at = time.monotonic()
    stop.set()
    wait_until(lambda: len(caller.results) == 4, timeout=2, interval=0.01, message="every result")
    rounds.close()
    assert time.monotonic() - stopped_at < 1.0
    assert all(result.stopped and result.retryable and not result.ok for result in caller.results)
    assert not calls(arm, vm(3)) and not calls(arm, vm(4)) and not arm.received.acks   # the queued never sent
    assert not [thread for thread in set(threading.enumerate()) - before if thread.name.startswith("fleet-ack")]
    with pytest.raises(RuntimeError, match="closed"):
        rounds.send(vm(5), [eid(5)], caller.done)
