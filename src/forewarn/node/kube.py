"""The Kubernetes client forewarn's node actions use (lightkube: see docs/kubernetes.md for the choice),
and the one place its errors become messages people can act on.

Importing this module imports lightkube; only `forewarn.node` does, and only when a policy has node actions.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError, Client, KubeConfig
from lightkube import ConfigError as KubeConfigError
from lightkube.config.client_adapter import verify_cluster

from forewarn.node.transport import DeadlineTransport

#: Where a pod finds its service account (the in-cluster configuration).
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FIELD_MANAGER = "forewarn"


class KubeError(Exception):
    """A Kubernetes API request failed. The message names the request and the reason, never a token."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class Stopped(KubeError):
    """forewarn is stopping: the work under way is left for the next start to resume (not a failure)."""


_decoders_ready = False
_decoders_lock = threading.Lock()


def prepare_decoders() -> None:
    """Build the decoders of every Kubernetes type forewarn reads, once, on one thread.

    msgspec (under lightkube) builds a type's decoder on its first use, and two threads doing that at once
    crashed the process: a segmentation fault in lightkube's decode_object (msgspec 0.22), caught by
    faulthandler in CI while the approver's threads read the node concurrently at start. After this, decoding
    only reads what was built."""
    global _decoders_ready
    with _decoders_lock:
        if _decoders_ready:
            return
        from lightkube.core import decoders
        from lightkube.resources.coordination_v1 import Lease
        from lightkube.resources.core_v1 import Node, Pod, PodEviction
        from lightkube.resources.events_v1 import Event

        # An empty body may not validate: the decoder is built by then, which is all this is for.
        for resource in (Node, Pod, PodEviction, Lease, Event):
            with contextlib.suppress(Exception):
                decoders.decode_object(b"{}", resource)
            with contextlib.suppress(Exception):
                decoders.decode_list(b"{}", resource)
        with contextlib.suppress(Exception):
            decoders.decode_status(b"{}")
        _decoders_ready = True


def make_client(kubeconfig: str | None, timeout: float = 10.0, *, service_account: Path = SERVICE_ACCOUNT,
                stop: threading.Event | None = None) -> Client:
    """A client from `kubeconfig` (a file), else the in-cluster service account (the token, ca.crt and
    namespace files in `service_account`, with KUBERNETES_SERVICE_HOST/PORT), else KUBECONFIG or
    ~/.kube/config. Raises KubeError when none is usable.

    Every request must be done within `timeout` seconds in all (forewarn.node.transport), and a set `stop`
    ends any request under way with Stopped."""
    try:
        if kubeconfig:
            config = KubeConfig.from_file(kubeconfig)
        else:
            config = KubeConfig.from_env(service_account=service_account)
        single = config.get()
        if single is None:
            raise ValueError("no current context")
        if single.user is None:
            raise ValueError(f"context {single.context_name!r} names no user (credentials for the API server)")
        tls = single.cluster.server.startswith("https:")
        # The TLS context as lightkube would build it (the cluster's CA, a client certificate if any);
        # no environment: forewarn talks to the API server directly, never through an HTTP proxy.
        context = verify_cluster(single.cluster, single.user, single.abs_file, trust_env=False) if tls else None
        transport = DeadlineTransport(single.cluster.server, context, timeout=timeout,
                                      stop=stop or threading.Event(), stopped=lambda: Stopped("forewarn is stopping"))
        prepare_decoders()
        return Client(single, field_manager=FIELD_MANAGER, timeout=httpx2.Timeout(timeout), transport=transport,
                      trust_env=False)
    except (KubeConfigError, OSError, ValueError, KeyError) as exc:
        if kubeconfig:
            raise KubeError(f"--kubeconfig {kubeconfig}: cannot load a Kubernetes configuration "
                            f"({type(exc).__name__}: {exc})") from None
        # Name the option first: outside a cluster, --kubeconfig is the fix people look for.
        raise KubeError(f"--kubeconfig not given and no Kubernetes configuration found: no in-cluster service "
                        f"account ({service_account}/token with KUBERNETES_SERVICE_HOST/PORT), no KUBECONFIG, no "
                        f"~/.kube/config ({type(exc).__name__}: {exc}); pass --kubeconfig FILE") from None


def explain(exc: Exception, doing: str) -> KubeError:
    """`exc`, raised while `doing` (e.g. "patch node aks-1"), as a KubeError with a message to act on."""
    if isinstance(exc, KubeError):   # Stopped, raised from inside a request by the transport
        return exc
    if isinstance(exc, ApiError):
        status: Any = exc.status
        code = int(getattr(status, "code", 0) or exc.response.status_code)
        reason = getattr(status, "reason", None) or ""
        message = getattr(status, "message", None) or ""
        if code == 403:
            return KubeError(f"{doing}: forbidden (403): {message or reason}; forewarn's service account needs the "
                             "ClusterRole of deploy/kubernetes/components/node-actions", code)
        return KubeError(f"{doing}: {code} {reason}: {message}".rstrip(": "), code)
    if isinstance(exc, httpx2.HTTPError):
        return KubeError(f"{doing}: cannot reach the Kubernetes API{_at(exc)} ({type(exc).__name__}: {exc})")
    return KubeError(f"{doing}: {type(exc).__name__}: {exc}")


def _at(exc: httpx2.HTTPError) -> str:
    """' at scheme://host:port' of the request that failed, or '' when it has none."""
    try:
        url = exc.request.url
    except RuntimeError:  # an error raised outside a request has none
        return ""
    host = f"[{url.host}]" if ":" in url.host else url.host  # never the userinfo: it may hold a password
    return f" at {url.scheme}://{host}" + (f":{url.port}" if url.port else "")


def lease_expired(spec: dict[str, Any], now: float, default_seconds: float) -> bool:
    """Whether a coordination.k8s.io/v1 Lease with this `spec` is free to take at `now` (epoch seconds): its
    holder last renewed (or acquired) it more than leaseDurationSeconds (`default_seconds` when unset) ago, or
    never, or wrote a time that does not parse. Compares the holder's clock with ours: clocks are assumed to
    be in sync (NTP), as with the drain slots and the fleet lease."""
    renewed = spec.get("renewTime") or spec.get("acquireTime")
    if not renewed:
        return True
    try:
        moment = datetime.fromisoformat(str(renewed).replace("Z", "+00:00"))
    except ValueError:
        return True
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp() + float(spec.get("leaseDurationSeconds") or default_seconds) < now
