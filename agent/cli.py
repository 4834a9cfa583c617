"""The ``sdcguard`` command: ``drill``, ``verify-checkpoint``, ``report``, ``sidecar``, ``operator``, and the
local sandbox: ``sandbox`` (serve it) and ``demo`` (the whole loop once)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

from .child_process import stop_on_sigterm
from .drill import launch as drill

# Subcommands that live in modules with their own argument parsers (and heavier imports), and
# the extra that installs what they import.
DELEGATED = {
    "sidecar": ("sdcguard.sidecar", "sidecar", "publish spooled alarms as Kubernetes Events; serve metrics"),
    "operator": ("sdcguard_operator.cli", "operator",
                 "run the kopf operator, leader-elected (one replica: kopf run -m sdcguard_operator.main)"),
    "sandbox": ("sdcguard.sandbox.serve", "sandbox", "serve a local stand-in HyperPod cluster running the operator"),
    "demo": ("sdcguard.sandbox.demo", "sandbox",
             "the whole loop once in the sandbox: fault, alarm, cordon, approval, replacement"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        module, extra, _ = DELEGATED[argv[0]]
        try:
            command = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            print(f"sdcguard {argv[0]}: error: {exc.name} is not installed (pip install 'sdcguard[{extra}]')",
                  file=sys.stderr)
            return 2
        return command.main(argv[1:])
    parser = argparse.ArgumentParser(prog="sdcguard", description="silent-data-corruption detection for PyTorch training")
    sub = parser.add_subparsers(dest="command", required=True)
    drill.add_arguments(sub.add_parser(
        "drill", help="run a fault-injection drill (multi-process DDP, FSDP2 with --shard, a pipeline with --pp)", description=drill.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    verify = sub.add_parser("verify-checkpoint", help="check a checkpoint against its manifest (exit 0 good, 1 mismatch, 2 bad input)",
                            description="Check a checkpoint file against its manifest (PATH.sdcguard.json), a "
                                        "sharded model's DCP directory, a pipeline's directory (pipeline.json and "
                                        "stage-P.pt per position), or a Hugging Face Trainer checkpoint-N "
                                        "folder (sdcguard-trainer.json) against the manifest inside it: its bytes, "
                                        "its weights (each shard's or stage's fingerprint) and, with --step / "
                                        "--sha256, that it is the checkpoint an alarm named "
                                        "(last_good_checkpoint_step / last_good_checkpoint_sha256; for a pipeline, "
                                        "the SHA-256 of pipeline.json).")
    verify.add_argument("path", type=Path, help="the checkpoint file (its manifest is PATH.sdcguard.json), the "
                                                "directory of a sharded or pipeline checkpoint, or a checkpoint-N "
                                                "folder")
    verify.add_argument("--step", type=int, help="the step the alarm named: refuse a file that holds another")
    verify.add_argument("--sha256", help="the SHA-256 the alarm named: refuse a file with other bytes (a "
                                          "pipeline's directory: the SHA-256 of its pipeline.json)")
    verify.add_argument("--allow-global", action="append", default=[], metavar="MODULE.NAME",
                        help="a class the file may hold besides tensors and plain values (e.g. pathlib.PosixPath "
                             "among Lightning hyperparameters): built by torch.load(weights_only=True); repeatable. "
                             "Only classes: functions, other callables and anything from modules that can run "
                             "code or touch the system (builtins, os, subprocess, sys, importlib, shutil, ...) "
                             "are refused")
    report = sub.add_parser("report", help="what a job's integrity checking cost, from its spool",
                            description="Read a spool's statistics and alarms: steps run, checks run by kind, the "
                                        "premium each kind of check added (measured while training), the audit "
                                        "interval and why, each alarm's rollback waste, and the cost of the "
                                        "integrity-checked run in GPU-hours (docs/library.md, The cost of a checked run).")
    report.add_argument("spool", type=Path, help="the spool directory (SDCGUARD_SPOOL: stats/rank-*.json, alarms)")
    report.add_argument("-o", "--output", choices=("text", "json"), default="text")
    for name, (_, _, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    if args.command == "verify-checkpoint":
        return _verify_checkpoint(args.path, args.step, args.sha256, args.allow_global)
    if args.command == "report":
        from .run_cost import main as report_main
        return report_main(str(args.spool), args.output)
    return _drill(args)


def _verify_checkpoint(path: Path, step: int | None, sha256: str | None, allow: list[str]) -> int:
    """For the person deciding where to resume: no process group, no model needed."""
    if path.is_dir():
        from .checkpoint_folder import is_checkpoint_folder
        from .layouts.pipeline_store import is_pipeline_checkpoint
        if is_checkpoint_folder(path):
            return _verify_folder(path, step, sha256)
        if is_pipeline_checkpoint(path):
            return _verify_pipeline(path, step, sha256, allow)
        return _verify_sharded_checkpoint(path, step, sha256)
    if not path.is_file():
        print(f"sdcguard verify-checkpoint: error: {path} is not a file", file=sys.stderr)
        return 2
    from .checkpoint import manifest_path, verify_checkpoint
    if not manifest_path(path).is_file():
        print(f"sdcguard verify-checkpoint: error: {path} has no manifest {manifest_path(path).name}", file=sys.stderr)
        return 2
    found, code = _verified(verify_checkpoint, path, step, sha256, allow)
    if found is None:
        return code
    print(f"OK {found.path}: step {found.step}, {found.parameters} parameters, weight digest {found.weight_digest}, "
          f"sha256 {found.sha256}, {_coverage(found.audited, found.audited_step)}")
    return 0


def _verified(verify: Any, path: Path, step: int | None, sha256: str | None, allow: list[str]) -> tuple[Any, int]:
    """``(what verify found, 0)``, or ``(None, exit code)`` said on stdout (a mismatch: 1) or stderr (2)."""
    from .checkpoint import CheckpointError, UnsafeGlobals
    allowed = _allowed_classes(allow)
    if allowed is None:
        return None, 2
    try:
        return verify(path, expect_step=step, expect_sha256=sha256, allow_globals=allowed), 0
    except UnsafeGlobals as exc:  # the bytes are the manifest's; what they hold is for the user to allow
        print(f"sdcguard verify-checkpoint: error: {exc}", file=sys.stderr)
        return None, 2
    except CheckpointError as exc:
        print(f"MISMATCH {exc}")
        return None, 1


def _coverage(audited: bool, audited_step: int | None) -> str:
    return ("on an audited step" if audited else
            f"covered by the audit at step {audited_step}" if audited_step is not None else "not covered by any audit")


def _allowed_classes(allow: list[str]) -> list[object] | None:
    """The classes ``--allow-global`` names, or None (said on stderr) when one may not be allowed."""
    try:
        return [_allowed_class(name) for name in allow]
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"sdcguard verify-checkpoint: error: --allow-global: {exc}", file=sys.stderr)
        return None


def _allowed_class(name: str) -> object:
    """The class ``name`` names, when it may be allowed (``sdcguard.checkpoint.refuse_global``): a
    name in a refused module is refused before anything is imported; ValueError says why."""
    from .checkpoint import refuse_global, refused_name
    if refused_name(name):
        raise ValueError(f"{name} is from a module that can run code or touch the system; it is never allowed")
    found = _global(name)
    reason = refuse_global(found)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    return found


def _global(name: str) -> object:
    """``module.Name`` (``module.Outer.Inner``) as the object it names."""
    module, _, attr = name.rpartition(".")
    if not module:
        raise ValueError(f"{name!r} is not MODULE.NAME")
    while True:
        try:
            found: object = importlib.import_module(module)
            break
        except ModuleNotFoundError:
            if "." not in module:
                raise
            module, _, outer = module.rpartition(".")
            attr = f"{outer}.{attr}"
    for part in attr.split("."):
        found = getattr(found, part)
    return found


def _verify_folder(path: Path, step: int | None, sha256: str | None) -> int:
    """A Hugging Face Trainer checkpoint-N folder (no transformers needed)."""
    from .checkpoint import CheckpointError
    from .checkpoint_folder import verify_folder
    try:
        manifest = verify_folder(path, expect_step=step, expect_sha256=sha256)
    except CheckpointError as exc:
        print(f"MISMATCH {exc}")
        return 1
    print(f"OK {path}: step {manifest['step']}, Trainer checkpoint folder, {len(manifest['files'])} files as written, "
          f"{len(manifest['parameters'])} parameters, weight digest {manifest['weight_digest']}, "
          f"sha256 {manifest['sha256']}, {_coverage(bool(manifest.get('audited')), manifest.get('audited_step'))}")
    return 0


def _verify_pipeline(path: Path, step: int | None, sha256: str | None, allow: list[str]) -> int:
    """A pipeline's directory: pipeline.json (its SHA-256 is what an alarm names) and every stage file."""
    from .layouts.pipeline_verify import verify_pipeline
    found, code = _verified(verify_pipeline, path, step, sha256, allow)
    if found is None:
        return code
    audited = _coverage(found.audited, found.audited_step)
    checked = ("weights cross-checked across replicas" if found.weights_verified else
               "weights not cross-checked (one replica: no alarm names it)")
    print(f"OK {found.path}: step {found.step}, pipeline of {found.num_stages} stages on {found.positions} positions x "
          f"{found.replicas} replicas ({found.replication}), {len(found.stages)} stage files and their weights as "
          f"pipeline.json records them, {found.parameters} parameters, sha256 {found.sha256} (pipeline.json), "
          f"{checked}, {audited}")
    for position, stage in enumerate(found.stages):
        print(f"  position {position}: {Path(stage.path).name}, {stage.parameters} parameters, "
              f"weight digest {stage.weight_digest}, sha256 {stage.sha256}")
    return 0


def _verify_sharded_checkpoint(path: Path, step: int | None, sha256: str | None) -> int:
    from .checkpoint import CheckpointError
    from .sharding.dcp_manifest import MANIFEST_NAME, is_sharded_checkpoint, verify_directory
    if not is_sharded_checkpoint(path):
        print(f"sdcguard verify-checkpoint: error: {path} is a directory without a manifest ({MANIFEST_NAME} "
              "for a sharded checkpoint, pipeline.json for a pipeline's, sdcguard-trainer.json for a Trainer "
              "checkpoint-N folder)", file=sys.stderr)
        return 2
    try:
        found = verify_directory(path, expect_step=step, expect_sha256=sha256)
    except CheckpointError as exc:
        print(f"MISMATCH {exc}")
        return 1
    checked = (f"weights cross-checked across {found.replicas} replicas" if found.weights_verified else
               "weights not cross-checked (one replica: no alarm names it)")
    audited = f"covered by the audit at step {found.audited_step}" if found.audited_step is not None else "not covered by any audit"
    print(f"OK {found.path}: step {found.step}, sharded (DCP) on {found.replicas} x {found.shards} ranks, "
          f"{found.files} files and every shard's fingerprint as written, sha256 {found.sha256}, {checked}, {audited}")
    return 0


def _drill(args: argparse.Namespace) -> int:
    try:
        cfg = drill.config_from_args(args)
    except drill.DrillInputError as exc:
        print(f"sdcguard drill: error: {exc}", file=sys.stderr)
        return 2
    stop_on_sigterm()  # stop the ranks and remove the work directory, as Ctrl-C does
    try:
        return drill.run(cfg, args.report, args.spool)
    except KeyboardInterrupt:
        print("sdcguard drill: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
