"""The stop signal the poll loop sleeps on (sources.StopSignal): a pause ends when the event is set, and only
then reports it set; it behaves as an Event for everyone else."""

from __future__ import annotations

import threading

from forewarn.sources import StopSignal


def test_a_pause_without_a_stop_runs_out_and_reports_not_set() -> None:
    stop = StopSignal()
    assert stop.pause(0.01) is False
    assert stop.pause(0.0) is False
    assert not stop.is_set()


def test_setting_the_event_ends_a_pause_under_way() -> None:
    stop = StopSignal()
    result: list[bool] = []
    sleeper = threading.Thread(target=lambda: result.append(stop.pause(3600)))
    sleeper.start()
    stop.set()
    sleeper.join(30)  # a bound for a hung test, not a speed claim: the pause itself is an hour
    assert not sleeper.is_alive()
    assert result == [True]


def test_a_set_event_ends_every_later_pause_at_once_and_clear_rearms_it() -> None:
    stop = StopSignal()
    stop.set()
    stop.set()  # twice is harmless
    assert stop.pause(3600) is True
    assert stop.pause(3600) is True
    assert stop.wait(3600) is True  # an Event for everyone else
    stop.clear()
    assert stop.pause(0.01) is False
