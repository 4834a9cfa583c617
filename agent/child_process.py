"""Child processes that cannot outlive the command that started them."""
from __future__ import annotations

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
