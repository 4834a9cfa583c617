"""The operator's commands (operator/cli.py, operator/main.py): ``sdcguard operator`` and
``kopf run -m sdcguard_operator`` read the settings once, flags over the environment.

Named ``test_operator_cli`` because tests/test_cli.py is the agent's CLI (``sdcguard drill``).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdcguard_operator import cli


@pytest.mark.parametrize("command", [["-m", "sdcguard.cli", "operator"], ["-m", "kopf", "run", "-m", "sdcguard_operator",
                                                                          "--standalone"]], ids=["sdcguard", "kopf"])
def test_the_real_command_refuses_bad_settings_in_one_line(command):
    """Before: the package read its settings while being imported, so a bad value died in a
    traceback and the CLI's clean exit path was never reached."""
    env = {**os.environ, "SDCGUARD_POLL_SECONDS": "abc", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SDCGUARD_POLL_SECONDS must be a number, got 'abc'" in lines[0], proc.stderr


def test_an_explicit_flag_beats_the_environment_which_beats_the_default(monkeypatch):
    """Issue 19: every sdcguard command, flag > environment > default; the operator's --namespace
    also reaches the handlers' settings (intake accepts exactly the namespaces kopf watches)."""
    from sdcguard.sidecar import publisher
    from sdcguard_operator import handlers

    env = {"SDCGUARD_NAMESPACES": "from-env"}
    assert cli.settings_for([], dict(env)).namespaces == ("from-env",)
    assert cli.settings_for(["a", "b"], dict(env)).namespaces == ("a", "b")
    assert handlers.SETTINGS.namespaces == ("a", "b")
    assert cli.settings_for([], {}).namespaces == ()
    monkeypatch.delenv("SDCGUARD_SPOOL", raising=False)
    assert publisher.build_parser().parse_args([]).spool == "/var/run/sdcguard"
    monkeypatch.setenv("SDCGUARD_SPOOL", "/from-env")
    assert publisher.build_parser().parse_args([]).spool == "/from-env"
    assert publisher.build_parser().parse_args(["--spool", "/from-flag"]).spool == "/from-flag"
    monkeypatch.setenv("SDCGUARD_ALARM_KEY_FILE", "/env/key")
    assert publisher.build_parser().parse_args(["--key-file", "/flag/key"]).key_file == "/flag/key"
