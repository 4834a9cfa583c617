"""``sdcguard operator [--namespace NS ...] [--verbose] [--liveness URL]``: run the operator with kopf.

Same as ``kopf run -m sdcguard_operator --standalone``; namespaces default to SDCGUARD_NAMESPACES
(all namespaces when empty).
"""
from __future__ import annotations

import argparse
import sys

from .settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdcguard operator", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        print(f"sdcguard operator: error: {exc}", file=sys.stderr)
        return 2
    namespaces = args.namespace or list(settings.namespaces)
    kopf_argv = ["kopf", "run", "-m", "sdcguard_operator", "--standalone"]
    kopf_argv += [f"--namespace={ns}" for ns in namespaces] or ["--all-namespaces"]
    if args.verbose:
        kopf_argv.append("--verbose")
    if args.liveness:
        kopf_argv.append(f"--liveness={args.liveness}")
    from kopf.cli import main as kopf_main

    try:
        kopf_main.main(args=kopf_argv[1:], prog_name="kopf", standalone_mode=False)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
