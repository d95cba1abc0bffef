"""A worker started by `batchgen run` exits with it: the run sets $BATCHGEN_PARENT_PID for its
workers (jobs.local_run), and each worker (jobs.worker_main) watches that process and hands its
shards back once it is gone, even when it was killed with SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PARENT_PID_ENV = "BATCHGEN_PARENT_PID"  # set by `batchgen run` for its workers: exit when it dies
PARENT_POLL_S = 1.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_GONE_SIGNAL = signal.SIGUSR2  # the kernel's notice; Celery's worker leaves SIGUSR2 alone


def exit_with_parent() -> None:
    """When `batchgen run` started this worker ($BATCHGEN_PARENT_PID): hand the shards in flight back
    and exit once the run is gone, even killed with SIGKILL (the worker is in a session of its own,
    so no signal of the terminal's or the run's reaches it). Linux tells at once (prctl
    PR_SET_PDEATHSIG); everywhere a thread polls getppid() as well. Either ends in one SIGINT to
    this process: Celery's warm shutdown, which hands the shards back (jobs.worker_main)."""
    raw = os.environ.get(PARENT_PID_ENV)
    if not raw:
        return
    parent, gone = int(raw), threading.Event()

    def parent_gone(*_) -> None:
        if not gone.is_set():
            gone.set()
            log.warning("the `batchgen run` that started this worker (pid %d) is gone; handing the "
                        "shards in flight back and exiting", parent)
            os.kill(os.getpid(), signal.SIGINT)

    signal.signal(PARENT_GONE_SIGNAL, parent_gone)
    _ask_kernel_for(PARENT_GONE_SIGNAL)

    def poll() -> None:
        while not gone.is_set():
            if os.getppid() != parent:
                os.kill(os.getpid(), PARENT_GONE_SIGNAL)  # handled in the main thread, like the kernel's
                return
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=poll, name="parent-watch", daemon=True).start()


def _ask_kernel_for(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig) on Linux; elsewhere (or without libc) the poll alone watches."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d); watching the parent by polling",
                        ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.warning("prctl is unavailable (%s); watching the parent by polling", exc)
