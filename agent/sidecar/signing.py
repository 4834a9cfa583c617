"""The job's alarm-signing key, as the sidecar sees it: a file from the mounted Secret.

The operator creates the Secret ``sdcguard-alarm-key-<job>`` and the pod webhook mounts it into
this container only (docs/design.md §4). The kubelet replaces a Secret volume's files atomically (a new
directory behind a symlink) when the Secret changes, so the file is stat'ed before every pass and
read again whenever it is a different file or has changed: a rotated key is used from the first
pass after the kubelet has updated the volume. A key that is missing, unreadable or shorter than
``ALARM_KEY_MIN_BYTES`` is no key: records then wait in the spool.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..contract import names

log = logging.getLogger("sdcguard.sidecar")


class AlarmKey:
    """``current()`` is the key bytes now in ``path`` (None while there is no usable key)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int, int] | None = None
        self._key: bytes | None = None
        self._problem: str | None = None

    def current(self) -> bytes | None:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data symlink
        except OSError as exc:
            self._forget(f"no alarm key at {self.path} ({exc.strerror})")
            return None
        seen = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return self._key
        try:
            key = self.path.read_bytes()
        except OSError as exc:
            self._forget(f"cannot read the alarm key {self.path} ({exc.strerror})")
            return None
        if len(key) < names.ALARM_KEY_MIN_BYTES:
            self._forget(f"the alarm key {self.path} has {len(key)} bytes, fewer than {names.ALARM_KEY_MIN_BYTES}")
            return None
        if self._key is not None and key != self._key:
            log.info("sdcguard sidecar: the alarm key changed (rotated); signing with the new key")
        elif self._key is None:
            log.info("sdcguard sidecar: signing alarms with the key in %s", self.path)
        self._seen, self._key, self._problem = seen, key, None
        return key

    def problem(self) -> str | None:
        """Why there is no key, for logs (None when there is one)."""
        return self._problem

    def _forget(self, problem: str) -> None:
        if problem != self._problem:
            log.warning("sdcguard sidecar: %s; alarms wait in the spool until it appears", problem)
        self._seen, self._key, self._problem = None, None, problem
