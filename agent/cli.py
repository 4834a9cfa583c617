"""The ``sdcguard`` command: ``drill``, ``sidecar`` and ``operator``."""
from __future__ import annotations

import argparse
import importlib
import sys

from .drill import launch as drill

# Subcommands that live in modules with their own argument parsers (and heavier imports).
DELEGATED = {
    "sidecar": ("sdcguard.sidecar", "publish spooled alarms as Kubernetes Events; serve metrics"),
    "operator": ("sdcguard_operator.cli", "run the kopf operator (same as kopf run -m sdcguard_operator)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        return importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="sdcguard", description="silent-data-corruption detection for PyTorch training")
    sub = parser.add_subparsers(dest="command", required=True)
    drill.add_arguments(sub.add_parser("drill", help="run a fault-injection drill (multi-process DDP)"))
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    return _drill(args)


def _drill(args: argparse.Namespace) -> int:
    try:
        cfg = drill.config_from_args(args)
    except drill.DrillInputError as exc:
        print(f"sdcguard drill: error: {exc}", file=sys.stderr)
        return 2
    return drill.run(cfg, args.report, args.spool)


if __name__ == "__main__":
    sys.exit(main())
