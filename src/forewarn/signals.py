"""The one place that turns POSIX signals into what the long-running commands do.

SIGTERM, SIGINT and SIGQUIT stop cleanly (Kubernetes sends SIGTERM, a terminal SIGINT, some supervisors
SIGQUIT); SIGHUP reloads what can be reloaded, as daemons conventionally do, and never stops the process.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# SIGQUIT and SIGHUP do not exist on Windows, where forewarn also runs (as a service, stopped by SIGINT/SIGTERM).
STOP_SIGNALS = tuple(signum for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGQUIT", None))
                     if signum is not None)


def handle_signals(stop: threading.Event, reload: Callable[[], None] | None = None) -> None:
    """Set `stop` on a stop signal; run `reload` on SIGHUP, on a thread of its own.

    The reload runs off the signal handler because the main thread may hold a lock that reloading needs
    (the approver's) when the signal lands; SIGHUPs in quick succession reload one after another.
    """

    def on_stop(signum: int, frame: Any) -> None:
        # `timeout`, shells and supervisors often signal the process and then its group: say it once.
        if not stop.is_set():
            log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    reloading = threading.Lock()

    def reload_serially() -> None:
        with reloading:
            if reload is None:
                log.info("received SIGHUP: nothing to reload")
            else:
                reload()

    def on_hangup(signum: int, frame: Any) -> None:
        threading.Thread(target=reload_serially, name="reload", daemon=True).start()

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_stop)
    hangup = getattr(signal, "SIGHUP", None)
    if hangup is not None:
        signal.signal(hangup, on_hangup)


def ignore_stop_signals() -> None:
    """Once stopped: a stop signal arriving while the interpreter shuts down would otherwise meet the
    default handler (Python restores it for handlers it installed) and kill the process with a signal
    instead of exit 0. Supervisors and terminals often send a second one."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
