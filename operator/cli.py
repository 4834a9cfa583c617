"""``sdcguard operator [--namespace NS ...] [--verbose] [--liveness URL]``: run the operator with kopf.

With leader election (``SDCGUARD_LEADER_ELECTION``, on by default; the chart runs two replicas)
every replica serves the webhooks (pod mutation, NodeReplacement admission) and the liveness
endpoint from one kopf instance at once, while the handlers run in a second kopf instance only
once this replica holds the Lease (:mod:`.leader`).  ``--no-leader-election`` (or the variable set
to false) is ``kopf run -m sdcguard_operator.main --standalone``: one replica only.  Namespaces default
to SDCGUARD_NAMESPACES (all namespaces when empty); as everywhere in ``sdcguard``, an explicit flag
beats the environment, which beats the default.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from .settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdcguard operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--log-format", default="full", choices=("plain", "full", "json"))
    parser.add_argument("--no-leader-election", action="store_true",
                        help="act without a Lease (one replica only; same as SDCGUARD_LEADER_ELECTION=false)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from . import main as _entry  # noqa: F401 - kopf, the Kubernetes client, boto3
    except ModuleNotFoundError as exc:
        print(f"sdcguard operator: error: {exc.name} is not installed (pip install 'sdcguard[operator]')",
              file=sys.stderr)
        return 2
    try:
        settings = settings_for(args.namespace)
    except SystemExit as exc:  # main.BadSettings: already said on one line
        return int(exc.code or 2)
    namespaces = list(settings.namespaces)
    if settings.leader_election and not args.no_leader_election:
        return run_elected(settings, namespaces, args.liveness, args.log_format,
                           dict(verbose=args.verbose, debug=args.debug, quiet=args.quiet))
    from .main import ENTRY

    kopf_argv = ["kopf", "run", "-m", ENTRY, "--standalone"]
    kopf_argv += [f"--namespace={ns}" for ns in namespaces] or ["--all-namespaces"]
    kopf_argv += [f"--{flag}" for flag in ("verbose", "debug", "quiet") if getattr(args, flag)]
    kopf_argv.append(f"--log-format={args.log_format}")
    if args.liveness:
        kopf_argv.append(f"--liveness={args.liveness}")
    from kopf.cli import main as kopf_main

    try:
        kopf_main.main(args=kopf_argv[1:], prog_name="kopf", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def settings_for(namespace_flags: list[str], env: "os._Environ[str] | None" = None) -> Settings:
    """The settings, an explicit flag over the environment over the default: ``--namespace`` (each
    one given) replaces SDCGUARD_NAMESPACES for everything the operator does (the namespaces kopf
    watches and those whose alarms intake accepts). It is written into ``env`` too, so that
    ``kopf run -m sdcguard_operator.main`` (without leader election), which reads the settings in
    its startup hook, reads the same."""
    env = os.environ if env is None else env
    if namespace_flags:
        env["SDCGUARD_NAMESPACES"] = ",".join(namespace_flags)
    from .main import load_settings

    return load_settings(env)


def run_elected(settings: Settings, namespaces: list[str], liveness: str | None, log_format: str,
                levels: dict[str, bool]) -> int:
    """Webhooks always (a kopf instance in a thread); handlers only while leader (the main thread)."""
    import asyncio

    import kopf

    from . import leader, main, metrics

    kopf.configure(log_format=kopf.LogFormat[log_format.upper()], **levels)
    scope = dict(clusterwide=not namespaces, namespaces=namespaces)
    serving = kopf.OperatorRegistry()
    main.register(serving, settings, handlers_too=False)
    threading.Thread(target=lambda: asyncio.run(kopf.operator(registry=serving, standalone=True,
                                                              liveness_endpoint=liveness, **scope)),
                     name="sdcguard-webhooks", daemon=True).start()
    metrics.serve(settings.metrics_port)
    elector = leader.Elector(settings)
    elector.acquire()
    holding = elector.start_holding()
    acting = kopf.OperatorRegistry()
    main.register(acting, settings, webhooks_too=False)
    stop = threading.Event()
    watchers = WatcherFailure(stop)
    logging.getLogger("kopf._core.reactor.orchestration").addHandler(watchers)
    try:
        kopf.run(registry=acting, standalone=True, stop_flag=stop, **scope)
    except Exception:  # kopf re-raises the failed watcher's error once it has stopped
        if not watchers.failed:
            raise
    finally:
        # kopf has stopped (SIGTERM, or a fatal error), but handler threads may still be inside an
        # AWS call: keep the Lease (still renewed) until they are done, then hand it over.
        main.drain()
        holding.set()
        elector.release()
    if watchers.failed:
        logging.getLogger("sdcguard_operator").error(
            "sdcguard operator: stopped: %s; the Lease is released for the other replica", watchers.failed)
        return 1
    return 0


class WatcherFailure(logging.Handler):
    """kopf does not restart a resource watcher that failed for good (a 403 after an RBAC change,
    an error it does not retry): its task just ends, and the leader would go on renewing its Lease
    with dead watches, acting on nothing. Seeing kopf's log of it, stop kopf (``stop``), so that
    this replica hands the Lease over and exits non-zero for the Deployment to restart it."""

    def __init__(self, stop: "threading.Event") -> None:
        super().__init__(logging.ERROR)
        self.stop = stop
        self.failed = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Watcher for ") and " has failed" in message:
            self.failed = self.failed or message.split(":", 1)[0].lower()
            self.stop.set()
