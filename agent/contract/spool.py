"""The spool: a directory where the training process leaves alarm records for the sidecar.

The training process never talks to the Kubernetes API (docs/design.md §4). It writes each record
atomically — a temporary file in the same directory, fsync, then rename — so the sidecar only
ever sees whole records. Standard library only.

Confirmation of publication (the contract between the library and the sidecar): the sidecar moves
a record to ``<spool>/published/`` only after the Kubernetes Event for it exists (created, or
found already there), and to ``<spool>/quarantine/`` when the API server refused it for good.
The training process, after :func:`write_alarm`, calls :func:`wait_published` (bounded) before its
exception leaves: True means the alarm is in the API and may leave with the pod; False means it
is still in the spool (the sidecar keeps trying through the pod's termination grace period).
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from . import alarm as _alarm

ALARM_SUFFIX = ".alarm.json"
PUBLISHED_DIR = "published"
"""Where the sidecar moves a record once its Event exists (the confirmation marker)."""
QUARANTINE_DIR = "quarantine"
"""Where the sidecar moves a record it can never publish (corrupt, or refused by the API server)."""
PUBLISH_WAIT_SECONDS = 30.0
"""The library's default bound on :func:`wait_published` (tens of seconds: the sidecar retries
with a backoff of at most 30 s, and the pod's grace period must cover this wait plus the sidecar's)."""
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
        fsync_dir(path.parent)
    return path


RESUME_SUFFIX = ".resume.json"
"""A resume record (:mod:`.resume`): published like an alarm, but nobody waits for it."""


def resume_path(spool: str | os.PathLike[str], resume_id: str) -> Path:
    return Path(spool) / (_SAFE_NAME.sub("_", resume_id) + RESUME_SUFFIX)


def write_resume(spool: str | os.PathLike[str], record: Mapping[str, Any]) -> Path:
    """Validate and write one resume record atomically; return its path."""
    from . import resume
    resume.validate(dict(record))
    return write_json_atomic(resume_path(spool, record["id"]), resume.dumps(record))


def list_records(spool: str | os.PathLike[str]) -> list[Path]:
    """Alarm and resume records waiting in the spool, oldest first (what the sidecar publishes)."""
    root = Path(spool)
    if not root.is_dir():
        return []
    files = [p for p in root.iterdir() if p.name.endswith((ALARM_SUFFIX, RESUME_SUFFIX)) and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))


def list_alarms(spool: str | os.PathLike[str]) -> list[Path]:
    """Complete records in the spool, oldest first (temporary files are hidden dot-files)."""
    root = Path(spool)
    if not root.is_dir():
        return []
    files = [p for p in root.iterdir() if p.name.endswith(ALARM_SUFFIX) and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))


def fsync_dir(directory: Path) -> None:
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


def _landed(spool: str | os.PathLike[str], subdir: str, alarm_id: str) -> bool:
    name = alarm_path(spool, alarm_id).name
    folder = Path(spool) / subdir
    # A record published twice (e.g. rewritten after a restart) is kept as name.<ns> beside the first.
    return (folder / name).exists() or (folder.is_dir() and any(p.name.startswith(name + ".")
                                                                 for p in folder.iterdir()))


def published(spool: str | os.PathLike[str], alarm_id: str) -> bool:
    """True once the sidecar has confirmed that the Event for this alarm exists in the API."""
    return _landed(spool, PUBLISHED_DIR, alarm_id)


def state(spool: str | os.PathLike[str], alarm_id: str) -> str:
    """"published", "quarantined" (never publishable: waiting longer does not help), "pending"
    (in the spool, not yet published) or "missing" (never written here)."""
    if published(spool, alarm_id):
        return "published"
    if _landed(spool, QUARANTINE_DIR, alarm_id):
        return "quarantined"
    return "pending" if alarm_path(spool, alarm_id).exists() else "missing"


def wait_published(spool: str | os.PathLike[str], alarm_id: str, timeout: float = PUBLISH_WAIT_SECONDS,
                   poll: float = 0.2, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait up to ``timeout`` seconds for the sidecar's confirmation; True if published.

    Returns early (False) when the record was quarantined or is not in the spool at all: nothing
    will ever confirm it.  Never raises for a slow or absent sidecar: the caller raises its own
    exception either way, and logs that the alarm may not have reached the API if this is False.
    """
    deadline = clock() + max(0.0, timeout)
    while True:
        now_state = state(spool, alarm_id)
        if now_state == "published":
            return True
        if now_state in ("quarantined", "missing") or clock() >= deadline:
            return False
        sleep(min(poll, max(0.0, deadline - clock())))
