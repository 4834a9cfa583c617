"""The spool: a directory where the training process leaves alarm records for the sidecar.

The training process never talks to the Kubernetes API (SPEC §4). It writes each record
atomically — a temporary file in the same directory, fsync, then rename — so the sidecar only
ever sees whole records. Standard library only.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

from . import alarm as _alarm

ALARM_SUFFIX = ".alarm.json"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def alarm_path(spool: str | os.PathLike[str], alarm_id: str) -> Path:
    """Where the record with this id lives in the spool."""
    return Path(spool) / (_SAFE_NAME.sub("_", alarm_id) + ALARM_SUFFIX)


def write_alarm(spool: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    """Validate and write one record atomically; return its path."""
    _alarm.validate(dict(record))
    return write_json_atomic(alarm_path(spool, record["id"]), _alarm.dumps(record))


def write_json_atomic(path: Path, text: str, durable: bool = True) -> Path:
    """Write ``text`` to ``path`` so a reader sees either nothing or the whole file; with
    ``durable`` also survive a crash of the machine (fsync of the file and the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)
    return path


def list_alarms(spool: str | os.PathLike[str]) -> list[Path]:
    """Complete records in the spool, oldest first (temporary files are hidden dot-files)."""
    root = Path(spool)
    if not root.is_dir():
        return []
    files = [p for p in root.iterdir() if p.name.endswith(ALARM_SUFFIX) and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX); harmless where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
