"""sdcguard.child_process: how the library's child processes end."""
from __future__ import annotations

import subprocess
import sys


def test_exit_without_finalizing_keeps_the_code_what_was_printed_and_the_atexit_handlers():
    script = ("import atexit, logging, sys\n"
              "from sdcguard.child_process import exit_without_finalizing\n"
              "atexit.register(lambda: print(' and the statistics', end=''))\n"
              "logging.basicConfig(stream=sys.stderr)\n"
              "print('result written', end='')\n"
              "logging.getLogger('x').warning('logged')\n"
              "exit_without_finalizing(3)\n"
              "print('never')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "result written and the statistics"  # flushed, though stdout is a pipe
    assert "logged" in proc.stderr
