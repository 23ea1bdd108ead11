"""What acts on the node an event is about to hit: the approver's seam for Kubernetes node actions.

The approver decides *when* a rule's node actions run (before its approval decision, once per event) and
records each outcome; a NodeActor carries them out. `forewarn.node.KubeNodeActor` does it through the
Kubernetes API; only a policy with node actions loads it, so the client library stays out of every other run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from forewarn.approval.policy import NodeAction
from forewarn.imds.document import Event
from forewarn.imds.instance import VmInfo
from forewarn.metrics.exposition import NODE_ACTION_RESULTS as ACTION_RESULTS
from forewarn.metrics.exposition import NODE_ACTIONS as ACTION_NAMES
from forewarn.records import Record, drain_record, node_action_record

__all__ = ["ACTION_NAMES", "ACTION_RESULTS", "DRAIN_PHASES", "ActionOutcome", "DrainProgress", "NodeActor", "Report",
           "recording_report"]


@dataclass(frozen=True)
class ActionOutcome:
    """One action carried out (or not). `detail` says what was done or why it failed; safe to log."""

    action: str    # one of ACTION_NAMES
    result: str    # one of ACTION_RESULTS
    detail: str


#: The steps of a drain that are reported as they happen (see DrainProgress).
DRAIN_PHASES = ("started", "blocked", "deleted", "done", "failed")


@dataclass(frozen=True)
class DrainProgress:
    """A step of a drain under way, reported as it happens so people can follow it: `started`, `blocked`
    (pods a PodDisruptionBudget keeps, at most once a minute), `deleted` (a pod deleted at the deadline),
    `done`, `failed`. Not an action outcome: the drain's own outcome still comes as an ActionOutcome.

    `key` tells repeats apart (two `blocked` reports a minute apart, one `deleted` per pod) and is the same
    when the same step is reported again after a restart; `facts` are JSON-ready details (pods, budgets,
    counts, seconds) for the record."""

    phase: str     # one of DRAIN_PHASES
    detail: str    # one line for people, safe to log
    key: str = ""
    facts: Mapping[str, Any] = field(default_factory=dict)


Report = Callable[[ActionOutcome | DrainProgress], None]


def recording_report(nodes: Any, record: Callable[[Sequence[Record]], object], event: Event, vm: VmInfo, node: str,
                     rule: str | None, incarnation: int, clock: Callable[[], float]) -> Report:
    """The Report both modes hand a NodeActor: each outcome, and each step of a drain, counted in `nodes` (the
    node-action families: Metrics or fleet mode's NodeMetrics) and recorded with `record` as it comes."""
    def report(outcome: ActionOutcome | DrainProgress) -> None:
        at = datetime.fromtimestamp(clock(), tz=timezone.utc)
        if isinstance(outcome, DrainProgress):
            nodes.node_drain_records.labels(outcome.phase).inc()
            if outcome.phase == "deleted":
                nodes.node_drain_pods.labels("deleted").inc()
            elif outcome.phase in ("done", "failed"):
                nodes.node_drain_pods.labels("evicted").inc(int(outcome.facts.get("evicted_count", 0)))
            record([drain_record(event, vm, node, rule, outcome.phase, outcome.detail, outcome.facts, outcome.key,
                                 incarnation, at)])
            return
        nodes.node_actions.labels(outcome.action, outcome.result).inc()
        record([node_action_record(event, vm, node, rule, outcome.action, outcome.result, outcome.detail,
                                   incarnation, at)])
    return report


class NodeActor(Protocol):
    node: str  # the Kubernetes node acted on

    def act(self, actions: Sequence[NodeAction], event: Event, dry_run: bool, report: Report) -> bool:
        """Carry out `actions` in order for `event`, reporting each outcome as it comes; stops at the first
        failure. True when every action succeeded. Running again for the same event (after a restart) must
        pick up what was done rather than do it twice. `dry_run`: read, decide and report, write nothing."""

    def undo(self, event_id: str, dry_run: bool, report: Report) -> None:
        """Remove what `act` applied for `event_id` (and nothing another party applied); reports one
        `undo` outcome when there was anything to undo."""

    def pending(self) -> Sequence[str]:
        """The ids of the events the node still holds something `act` applied for (what `undo` would take
        back), as the node itself records it, so it survives a restart. Raises when it cannot be read."""

    def close(self) -> None:
        """Stop waiting (a drain in progress gives up at once) and release the client."""
