"""The ``sdcguard`` command: ``sdcguard drill ...`` (more subcommands join as they land)."""
from __future__ import annotations

import argparse
import sys

from . import drill


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdcguard", description="silent-data-corruption detection for PyTorch training")
    sub = parser.add_subparsers(dest="command", required=True)
    drill.add_arguments(sub.add_parser("drill", help="run a fault-injection drill (multi-process DDP)"))
    args = parser.parse_args(argv)
    if args.command == "drill":
        return _drill(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _drill(args: argparse.Namespace) -> int:
    try:
        cfg = drill.config_from_args(args)
    except drill.DrillInputError as exc:
        print(f"sdcguard drill: error: {exc}", file=sys.stderr)
        return 2
    return drill.run(cfg, args.report, args.spool)


if __name__ == "__main__":
    sys.exit(main())
