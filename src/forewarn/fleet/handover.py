"""What the active replica has announced, handed to the next one in the Lease they share.

Each replica keeps its own outbox and saved state (an `emptyDir`), so a replica that takes over does not know
what its predecessor announced, and its first Resource Graph snapshot would announce every open event again:
under the same record ids, yet a notification sink would post them all a second time. So the active replica
writes, into an annotation of the Lease it renews anyway, one short digest per open event as it last
announced it; a replica that takes over reads the annotation with the Lease and does not announce a change
whose digest is there.

A digest goes in only while every record committed before it has reached every sink (no backlog): records
still waiting in a holder's outbox die with its pod, so the news they carry must be announced again by the
next holder. Announcements stay at least once; only what has surely gone out is not repeated.

The annotation holds 8 bytes per event (the start of a SHA-256 of the event's key and documented fields),
base64-encoded, at most MAX_DIGESTS of them: well inside the API server's 256 KiB for all annotations of an
object. Beyond that, the rest is left out and may be announced again after a takeover. What a replica reads
back is hostile input like any other: anything that is not such a list is ignored, with a warning.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Iterable

from forewarn.fleet.feed import FleetEvent
from forewarn.fleet.tracker import event_key, fingerprint

log = logging.getLogger(__name__)

ANNOTATION = "forewarn.io/announced"
#: The events the holder approved (acknowledged, or decided in a dry run): its successor does not approve again.
APPROVED_ANNOTATION = "forewarn.io/approved"
DIGEST_BYTES = 8
#: Digests written at most: 24,000 are 256,000 characters in base64 (with the key, under 256 KiB).
MAX_DIGESTS = 24_000
MAX_TEXT = (MAX_DIGESTS * DIGEST_BYTES + 2) // 3 * 4


def digest(event: FleetEvent) -> bytes:
    """The event as announced: equal for the same event with the same documented fields, from any replica."""
    resource, event_id = event_key(event)
    return hashlib.sha256(f"{resource}\x1f{event_id}\x1f{fingerprint(event)}".encode()).digest()[:DIGEST_BYTES]


def key_digest(event: FleetEvent) -> bytes:
    """The event itself, whatever its fields (an approval is of the event)."""
    resource, event_id = event_key(event)
    return hashlib.sha256(f"{resource}\x1f{event_id}".encode()).digest()[:DIGEST_BYTES]


def encode(digests: Iterable[bytes]) -> str:
    """The annotation's value: the digests (at most MAX_DIGESTS, in a stable order) in base64."""
    chosen = sorted(set(digests))
    if len(chosen) > MAX_DIGESTS:
        log.warning("%d open events announced; handing over %d (the rest may be announced again after a "
                    "takeover)", len(chosen), MAX_DIGESTS)
        chosen = chosen[:MAX_DIGESTS]
    return base64.b64encode(b"".join(chosen)).decode("ascii")


def decode(text: str | None) -> frozenset[bytes]:
    """The digests in an annotation's value; none when it is absent or not what `encode` writes."""
    if not text:
        return frozenset()
    try:
        if len(text) > MAX_TEXT:
            raise ValueError(f"{len(text)} characters, more than {MAX_TEXT}")
        raw = base64.b64decode(text.encode("ascii"), validate=True)
        if len(raw) % DIGEST_BYTES:
            raise ValueError(f"{len(raw)} bytes, not a multiple of {DIGEST_BYTES}")
    except (ValueError, UnicodeEncodeError, binascii.Error) as exc:
        log.warning("a handover annotation of the Lease is not a list of digests (%s); ignoring it: what it "
                    "lists may be announced or approved again", str(exc)[:200])
        return frozenset()
    return frozenset(raw[start:start + DIGEST_BYTES] for start in range(0, len(raw), DIGEST_BYTES))
