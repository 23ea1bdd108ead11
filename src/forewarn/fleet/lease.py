"""One active `forewarn fleet` replica, chosen by a coordination.k8s.io/v1 Lease.

Every replica runs a `LeaseElector` on the same Lease. The holder renews it every `renew_every` seconds;
the others read it at the same pace and take it once its holder has not renewed it for
leaseDurationSeconds (`lease_seconds`), or at once when the holder released it at a clean stop. Writes
carry the resourceVersion they read, so when two replicas race for a free Lease the API server lets one
write through and answers 409 Conflict to the other: never two holders.

A holder cut off from the API server cannot learn that it lost the Lease, so it steps down on its own
clock: `lease_seconds - renew_every` after its last successful renew, which is before anyone else may
take over (at `lease_seconds`), provided each request is bounded by `renew_every` (the client's timeout)
and the replicas' clocks agree (as the drain slots assume: expiry compares the holder's renewTime with
the reader's clock, `forewarn.node.kube.lease_expired`). This is client-go's leader election with its
RenewDeadline set to lease duration minus retry period (10 s of 15 s by default).

Importing this module imports lightkube (the `kubernetes` extra); load it only when the Lease is used.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

from lightkube import ApiError, Client
from lightkube.resources.coordination_v1 import Lease

from forewarn.logs import StateLog
from forewarn.node.actions import rfc3339
from forewarn.node.kube import KubeError, explain, lease_expired

log = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "forewarn-fleet"


def default_identity() -> str:
    """This pod's name (HOSTNAME, which Kubernetes sets to it) and a random suffix: a pod restarted under
    the same name is a new holder, so it waits for the old term to end rather than resuming it unawares."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{secrets.token_hex(3)}"


class LeaseElector:
    """Holds, renews and releases one Lease for this replica; `step()` is one round, `run()` the loop.

    `client`: a lightkube Client over forewarn's deadline-bound transport (`forewarn.node.kube.make_client`)
    whose timeout is at most `renew_every`, and whose stop signal is NOT the service's: the release at stop
    goes through it. `clock`: epoch seconds (written into renewTime, compared with other replicas' times).
    """

    def __init__(self, client: Client, namespace: str, name: str = DEFAULT_LEASE_NAME, identity: str | None = None,
                 lease_seconds: int = 15, renew_every: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if lease_seconds < 1 or int(lease_seconds) != lease_seconds:
            raise ValueError(f"lease_seconds {lease_seconds}: must be a whole number of seconds, at least 1")
        if not 0 < renew_every < lease_seconds:
            raise ValueError(f"renew_every {renew_every:g}: must be more than 0 and less than lease_seconds "
                             f"{lease_seconds} (a third of it leaves two tries before the holder steps down)")
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.lease_seconds = int(lease_seconds)
        self.renew_every = renew_every
        self.clock = clock
        self._until = 0.0            # we are the leader while clock() < this (0: not leader)
        self._holder: str | None = None
        self._written: dict[str, Any] | None = None  # the Lease as our last write left it (for the release)
        self._said: str | None = None  # the last role logged, to log each change once
        self._api = StateLog(log, f"lease {namespace}/{name}")
        self._rounds = threading.Lock()   # a round of the loop and a publish take turns
        #: The annotations each renew writes into the Lease (forewarn.fleet.handover): called only while this
        #: replica holds the Lease; annotations it leaves out keep their values.
        self.handover: Callable[[], Mapping[str, str]] = dict
        #: The Lease's annotations as the previous holder left them, read when this replica took the Lease
        #: (empty when it created the Lease or renewed its own).
        self.inherited: Mapping[str, str] = {}

    # --- what metrics and the service read -------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """Whether this replica is the active one now: it holds the Lease and renewed it recently enough
        that nobody else can have taken it over (also while a renew is under way or failing)."""
        return self.clock() < self._until

    @property
    def holder(self) -> str | None:
        """This replica while it leads, else the holder as last read (None: nobody, or not read yet)."""
        return self.identity if self.is_leader else self._holder

    # --- one round -------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Read the Lease and create, renew or take it when we may; returns whether we hold it now.

        A failure other than 404/409 (an API error, a timeout, no connection, a stop) changes nothing: a
        holder stays the leader until its renew deadline, a standby stays standby; it is logged once per
        state change."""
        with self._rounds:
            return self._step()

    def _step(self) -> bool:
        now = self.clock()
        try:
            held = self._round(now)
        except KubeError as exc:
            self._api.failing(f"{exc.code or type(exc).__name__}", f"{exc}; "
                              + ("stepping down at the renew deadline unless a renew gets through"
                                 if self.is_leader else "staying standby"))
        else:
            self._api.ok()
            self._until = now + self.lease_seconds - self.renew_every if held else 0.0
        leader = self.is_leader
        self._say(leader)
        return leader

    def publish(self) -> bool:
        """Renew now, writing `handover()` as it is now; True once it is in the Lease. The approver calls this
        before it sends acknowledgements, so that a successor taking over after a kill -9 knows them."""
        with self._rounds:
            if not self.is_leader:
                return False
            now = self.clock()
            try:
                held = self._round(now)
            except KubeError as exc:
                log.warning("lease %s/%s: writing the handover failed: %s", self.namespace, self.name, exc)
                return False
            if held:
                self._until = now + self.lease_seconds - self.renew_every
            return held

    def _round(self, now: float) -> bool:
        lease = self._get()
        if lease is None:
            if self._create(now):
                return True
            lease = self._get()        # 409: another replica created it first
            if lease is None:          # and it is gone again: the next round creates it
                self._holder = None
                return False
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        self._holder = holder
        if holder not in (None, self.identity) and not lease_expired(spec, now, self.lease_seconds):
            return False
        return self._write(lease, now)

    def _call(self, doing: str, request: Callable[[], Any], tolerated: tuple[int, ...]) -> dict[str, Any] | None:
        """The object `request()` answers as a dict, or None when the API server answered one of the
        `tolerated` codes; any other failure (an API error, the transport's) raised as a KubeError."""
        try:
            return cast(dict[str, Any], request().to_dict())
        except ApiError as exc:
            if exc.status.code in tolerated:
                return None
            raise self._explain(exc, f"{doing} lease {self.namespace}/{self.name}") from None
        except Exception as exc:
            raise self._explain(exc, f"{doing} lease {self.namespace}/{self.name}") from None

    def _get(self) -> dict[str, Any] | None:
        return self._call("get", lambda: self.client.get(Lease, self.name, namespace=self.namespace), (404,))

    def _create(self, now: float) -> bool:
        body = self._body(None, {"holderIdentity": self.identity, "acquireTime": rfc3339(now, micro=True),
                                 "renewTime": rfc3339(now, micro=True), "leaseTransitions": 0})
        written = self._call("create", lambda: self.client.create(body, namespace=self.namespace), (409,))
        if written is None:
            return False
        self.inherited = {}
        self._holder = self.identity
        self._written = written
        return True

    def _write(self, lease: dict[str, Any], now: float) -> bool:
        """Renew our Lease, or take a free one; False when another replica wrote it since we read it."""
        spec = lease.get("spec") or {}
        ours = spec.get("holderIdentity") == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        acquired = spec.get("acquireTime") if ours and spec.get("acquireTime") else rfc3339(now, micro=True)
        # A renew hands over what this term has announced; taking the Lease keeps the predecessor's note.
        handover = dict(self.handover()) if ours and self.is_leader else {}
        body = self._body(lease, {"holderIdentity": self.identity, "acquireTime": acquired,
                                  "renewTime": rfc3339(now, micro=True), "leaseTransitions": transitions}, handover)
        written = self._call("update", lambda: self.client.replace(body), (404, 409))
        if written is None:  # written or deleted since we read it: not ours this round
            self._holder = self._current_holder()
            return False
        if not ours:
            self.inherited = dict((lease.get("metadata") or {}).get("annotations") or {})
        self._holder = self.identity
        self._written = written
        return True

    def _explain(self, exc: Exception, doing: str) -> KubeError:
        """`explain`, with the permissions the fleet needs when the API server says forbidden."""
        if isinstance(exc, ApiError) and exc.status.code == 403:
            return KubeError(f"{doing}: forbidden (403): {exc.status.message or exc.status.reason}; forewarn "
                             f"fleet's service account needs create, and get and update of lease {self.name}, "
                             f"on coordination.k8s.io leases in namespace {self.namespace} (a Role)", 403)
        return explain(exc, doing)

    def _current_holder(self) -> str | None:
        """The holder now, after a lost race (for the log and the metric; None when it cannot be read)."""
        try:
            lease = self._get()
        except KubeError:
            return None
        return ((lease or {}).get("spec") or {}).get("holderIdentity") or None

    def _body(self, current: dict[str, Any] | None, holding: dict[str, Any],
              annotations: dict[str, str] | None = None) -> Lease:
        """The Lease to write: `current`'s metadata (its resourceVersion makes the write conditional) with
        `annotations` set, and our duration, with `holding`'s fields (none: released)."""
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace,
                                    "labels": {"app.kubernetes.io/managed-by": "forewarn"}}
        if current is not None:
            old = current.get("metadata") or {}
            metadata["labels"] = {**(old.get("labels") or {}), **metadata["labels"]}
            metadata["resourceVersion"] = old.get("resourceVersion")
            for key in ("annotations", "ownerReferences"):
                if old.get(key):
                    metadata[key] = old[key]
        if annotations:
            metadata["annotations"] = {**(metadata.get("annotations") or {}), **annotations}
        spec = {"leaseDurationSeconds": self.lease_seconds, **holding}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
        return cast(Lease, Lease.from_dict(body))

    def _say(self, leader: bool) -> None:
        role = "leader" if leader else f"standby:{self._holder or ''}"
        if role == self._said:
            return
        was_leader = self._said == "leader"
        self._said = role
        where = f"lease {self.namespace}/{self.name}"
        if leader:
            log.info("%s: %s is now the active replica", where, self.identity)
        elif was_leader:
            log.warning("%s: %s is no longer the active replica (%s)", where, self.identity,
                        f"held by {self._holder}" if self._holder not in (None, self.identity)
                        else "cannot renew it")
        else:
            log.info("%s: %s is standby (active: %s)", where, self.identity, self._holder or "none")

    # --- release and the loop --------------------------------------------------------------------------
    def release(self) -> bool:
        """Clear holderIdentity when we hold the Lease, so a standby takes over at its next round instead of
        after the lease time. One write, conditional on the resourceVersion of our last one: if anyone wrote
        the Lease since, it is not ours to clear (409). Best effort, bounded by the client's timeout; returns
        whether it was done."""
        self._until = 0.0
        written, self._written = self._written, None
        if written is None or self._holder != self.identity:
            return False
        body = self._body(written, {"leaseTransitions": int((written.get("spec") or {}).get("leaseTransitions") or 0)})
        try:
            released = self._call("release", lambda: self.client.replace(body), (404, 409))
        except KubeError as exc:
            log.warning("%s; a standby takes over when the lease expires (%d s)", exc, self.lease_seconds)
            return False
        if released is None:  # written (taken over) or deleted since our last write: not ours to clear
            log.info("lease %s/%s changed since %s last held it; nothing to release", self.namespace, self.name,
                     self.identity)
            return False
        self._holder = None
        self._said = None
        log.info("lease %s/%s released by %s", self.namespace, self.name, self.identity)
        return True

    def run(self, stop: threading.Event, on_start: Callable[[], None], on_stop: Callable[[], None]) -> None:
        """`step()` every `renew_every` seconds until `stop` is set; `on_start()` when this replica becomes
        the active one, `on_stop()` when it stops being it, each once per term, in order. At stop: `on_stop()`
        if active, then the Lease is released (after the work stopped, so no two replicas ever work at
        once). An exception from a callback ends the loop, releasing the Lease, and propagates."""
        active = False
        try:
            while not stop.is_set():
                leader = self.step()
                if stop.is_set():  # became the leader just as we stop: start nothing, release below
                    break
                if leader != active:
                    active = leader
                    (on_start if leader else on_stop)()
                wait = self.renew_every
                if active:  # wake at the renew deadline at the latest, to step down on time
                    wait = min(wait, max(0.0, self._until - self.clock()))
                stop.wait(wait)
        finally:
            try:
                if active:
                    on_stop()
            finally:
                self.release()
