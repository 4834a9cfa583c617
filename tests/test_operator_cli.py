"""The operator's commands (operator/cli.py, operator/main.py): ``sdcguard operator`` and
``kopf run -m sdcguard_operator.main`` read the settings once, when the operator starts, flags
over the environment; importing a module of the operator registers nothing and reads nothing.

Named ``test_operator_cli`` because tests/test_cli.py is the agent's CLI (``sdcguard drill``).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sdcguard_operator import cli


@pytest.mark.parametrize("command", [["-m", "sdcguard.cli", "operator"],
                                     ["-m", "kopf", "run", "-m", "sdcguard_operator.main", "--standalone", "--all-namespaces"]],
                         ids=["sdcguard", "kopf"])
def test_the_real_command_refuses_bad_settings_in_one_line(command):
    """Before: the package read its settings while being imported, so a bad value died in a
    traceback and the CLI's clean exit path was never reached. Now ``sdcguard operator`` reads
    them before kopf starts, and ``kopf run -m`` in the entry module's startup hook."""
    env = {**os.environ, "SDCGUARD_POLL_SECONDS": "abc", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "SDCGUARD_POLL_SECONDS must be a number, got 'abc'" in lines[0], proc.stderr


def test_an_explicit_flag_beats_the_environment_which_beats_the_default(monkeypatch):
    """Issue 19: every sdcguard command, flag > environment > default; the operator's --namespace
    also reaches the environment ``kopf run -m sdcguard_operator.main`` reads its settings from
    (intake accepts exactly the namespaces kopf watches)."""
    from sdcguard.sidecar import publisher

    env = {"SDCGUARD_NAMESPACES": "from-env"}
    assert cli.settings_for([], dict(env)).namespaces == ("from-env",)
    flagged = dict(env)
    assert cli.settings_for(["a", "b"], flagged).namespaces == ("a", "b")
    assert flagged["SDCGUARD_NAMESPACES"] == "a,b"
    assert cli.settings_for([], {}).namespaces == ()
    monkeypatch.delenv("SDCGUARD_SPOOL", raising=False)
    assert publisher.build_parser().parse_args([]).spool == "/var/run/sdcguard"
    monkeypatch.setenv("SDCGUARD_SPOOL", "/from-env")
    assert publisher.build_parser().parse_args([]).spool == "/from-env"
    assert publisher.build_parser().parse_args(["--spool", "/from-flag"]).spool == "/from-flag"
    monkeypatch.setenv("SDCGUARD_ALARM_KEY_FILE", "/env/key")
    assert publisher.build_parser().parse_args(["--key-file", "/flag/key"]).key_file == "/flag/key"


IMPORT_EVERY_MODULE = """
import importlib.util, json, os, pkgutil, sys
ours = tuple(importlib.util.find_spec("sdcguard_operator").submodule_search_locations)
reads = []
class Environ(type(os.environ)):
    def __getitem__(self, key):  # os.environ.get() and [] alike; who asks is one or two frames up
        callers = (sys._getframe(1).f_code.co_filename, sys._getframe(2).f_code.co_filename)
        if any(c.startswith(ours) for c in callers):
            reads.append(key)
        return super().__getitem__(key)
os.environ.__class__ = Environ
import kopf
before = {kind: [h.id for h in getattr(kopf.get_default_registry(), kind).get_all_handlers()]
          for kind in ("_activities", "_indexing", "_watching", "_spawning", "_changing", "_webhooks")}
import sdcguard_operator
modules = sorted(m.name for m in pkgutil.iter_modules(sdcguard_operator.__path__) if m.name != "main")
for name in modules:
    importlib.import_module(f"sdcguard_operator.{name}")
registry = kopf.get_default_registry()
after = {kind: [h.id for h in getattr(registry, kind).get_all_handlers() if h.id not in before[kind]]
         for kind in before}
threads = sorted(t.name for t in __import__("threading").enumerate())
reads_before_main = sorted(set(reads))
import sdcguard_operator.main
main_handlers = {kind: [h.id for h in getattr(registry, kind).get_all_handlers() if h.id not in before[kind]]
                 for kind in before}
print(json.dumps({"modules": modules, "after": after, "threads": threads, "reads": reads_before_main,
                  "main": main_handlers,
                  "reads_main": sorted(set(reads))}))
"""


def test_importing_the_operator_registers_nothing_and_reads_no_setting():
    """Every module of ``sdcguard_operator`` imports with no kopf handler registered, no setting
    read and no thread started; the entry module ``main`` adds exactly one startup hook (what
    ``kopf run -m sdcguard_operator.main`` needs) and still reads nothing. (kopf's own default
    login handlers, there before any of ours is imported, are left out.)"""
    env = {**os.environ, "PYTHONSAFEPATH": "1", "SDCGUARD_POLL_SECONDS": "abc"}
    proc = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    import json

    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"cli", "webhook", "admission", "incident", "replacement", "intake", "kube"} <= set(seen["modules"])
    assert all(ids == [] for ids in seen["after"].values()), seen["after"]
    assert seen["threads"] == ["MainThread"], seen["threads"]
    assert seen["reads"] == [] and seen["reads_main"] == [], seen
    assert seen["main"]["_activities"] == ["sdcguard-start"]
    assert all(ids == [] for kind, ids in seen["main"].items() if kind != "_activities"), seen["main"]


def test_register_puts_every_handler_into_the_registry_it_is_given():
    """One registration function, explicit registry and settings: the handlers and both webhooks;
    the leader-elected command splits them over two registries."""
    import kopf

    from sdcguard_operator import main
    from sdcguard_operator.settings import Settings

    def ids(registry: kopf.OperatorRegistry) -> set[str]:
        return {h.id.split("/")[0] for kind in ("_activities", "_watching", "_changing", "_spawning", "_webhooks")
                for h in getattr(registry, kind).get_all_handlers()}

    everything = kopf.OperatorRegistry()
    main.register(everything, Settings(poll_seconds=7.0))
    assert {"sdcguard-configure", "sdcguard-login", "alarm_event", "incident_contain", "incident_tick",
            "replacement_tick", "replacement_decided", "replacement_released", "replacement_changed",
            "job_alarm_key", "job_alarm_key_recheck", "sdcguard-pod-inject",
            "sdcguard-nodereplacement-admission"} <= ids(everything)
    [tick] = [h for h in everything._spawning.get_all_handlers() if h.id == "replacement_tick"]
    assert tick.interval == 7.0
    serving, acting = kopf.OperatorRegistry(), kopf.OperatorRegistry()
    main.register(serving, Settings(), handlers_too=False)
    main.register(acting, Settings(), webhooks_too=False)
    webhooks = {"sdcguard-pod-inject", "sdcguard-pod-ephemeral-containers", "sdcguard-nodereplacement-admission"}
    assert ids(serving) == {"sdcguard-configure", "sdcguard-login"} | webhooks
    assert "alarm_event" in ids(acting) and not ids(acting) & webhooks


@pytest.mark.parametrize("env, said", [
    ({"SDCGUARD_SIDECAR_GRACE_SECONDS": "x"}, "SDCGUARD_SIDECAR_GRACE_SECONDS must be an integer, got 'x'"),
    ({"SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT": "soon"}, "SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT must be a number, got 'soon'"),
])
def test_the_webhooks_settings_are_checked_at_start_too(env, said, capsys):
    """What the webhooks read when the operator starts is checked with the rest: one line, exit 2."""
    from sdcguard_operator import main

    with pytest.raises(SystemExit) as stopped:
        main.load_settings(env, prog="sdcguard operator")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"sdcguard operator: error: {said}\n"
