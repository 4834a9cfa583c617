"""A replay that fails on one rank fails on every rank: none is left waiting in a collective.

A replay can fail where its rank alone sees it: the neighbour's batch does not arrive whole or will
not load, ``loss_fn`` raises, the device runs out of memory. The other ranks are by then on their
way into the next collective (the audit's agreement, the confirmation's gather, the all-gathers of
a sharded replay, a pipeline's sends) and would wait there until the process group's timeout. So
a failure is carried into a collective every rank makes anyway, or into a 16-byte agreement made
before a replay that is itself collective, and every rank raises the same ``ReplayError``.

What no agreement can cover: a collective replay (sharded, pipelined) that fails part-way, with
its peers inside its own all-gathers or sends; there the process group's timeout is the limit.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import ReplayError
from .exchange import DIGEST_BYTES, agree, gather_objects

log = logging.getLogger("sdcguard")

CONFIRMATION = "the non-finite confirmation's replay"


def raise_replay_failures(step: int, failure: Exception | None, group: dist.ProcessGroup | None,
                          device: torch.device, what: str = "the audit's replay") -> None:
    """Collective: every rank learns which ranks' replays failed and raises the same ReplayError;
    returns when none did."""
    said = gather_objects(None if failure is None else f"{type(failure).__name__}: {failure}", group, device)
    failures = {rank: msg for rank, msg in enumerate(said) if msg is not None}
    if failures:
        raise ReplayError(step, failures, what) from failure


def received_everywhere(step: int, receive: Callable[[], Any], source: int, device: torch.device,
                        group: dist.ProcessGroup | None, what: str = "the audit's replay") -> Any:
    """Collective, before a replay that is itself collective: ``receive()`` the batch of rank
    ``source`` (and load it), then agree that every rank holds its own; one that does not would
    leave the others in the replay's first collective. A failure anywhere is a ReplayError on
    every rank."""
    received, failure = None, None
    try:
        received = receive()
    except Exception as exc:  # noqa: BLE001 - raised on every rank below
        log.exception("sdcguard: receiving rank %d's batch failed", source)
        failure = exc
    if not agree(bytes(DIGEST_BYTES), device, group, veto=failure is not None):
        raise_replay_failures(step, failure, group, device, what)
    return received
