"""Child processes that cannot outlive the command that started them."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys


def die_with_parent() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: on Linux the child gets SIGKILL when its parent
    dies, however the parent ends (SIGKILL included), so a killed drill, demo or test leaves no
    ranks, operators or sidecars behind. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop_on_sigterm() -> None:
    """Treat SIGTERM (kill, a timeout, a closing terminal) like Ctrl-C: ``KeyboardInterrupt`` runs
    the ``finally`` and ``with`` blocks that stop children and remove temporary files."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)


def exit_without_finalizing(code: int) -> None:
    """End a torch.distributed worker whose results are on disk: the ``atexit`` handlers run (a
    Guard's statistics, logging), interpreter finalization does not. Why: FSDP2's own all-gathers
    and reduce-scatters drop their gloo ops after ``wait()``, and a gloo worker thread that lets go
    of the last reference during finalization is killed inside a C++ destructor ("terminate called
    without an active exception", SIGABRT: a passed run read as failed; seen in CI at the end of a
    4-rank pure-FSDP drill under load). The library holds its own ops (``checks.exchange.hold``)
    but cannot hold FSDP2's."""
    atexit._run_exitfuncs()  # what a normal exit runs first, while the interpreter is whole
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
