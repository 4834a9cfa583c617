"""sdcguard.child_process: how the library's child processes end."""
from __future__ import annotations

import subprocess
import sys


def test_exit_without_finalizing_keeps_the_code_and_what_was_printed_and_runs_no_atexit():
    script = ("import atexit, logging, sys\n"
              "from sdcguard.child_process import exit_without_finalizing\n"
              "atexit.register(lambda: print('finalized'))\n"
              "logging.basicConfig(stream=sys.stderr)\n"
              "print('result written', end='')\n"
              "logging.getLogger('x').warning('logged')\n"
              "exit_without_finalizing(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "result written"  # flushed, though stdout is a pipe; no atexit ran
    assert "logged" in proc.stderr
