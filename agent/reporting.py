"""From a verdict to the alarm every rank raises: the record, the spool, the wait, the barrier.

Every rank builds the same record (the verdict and the history are the same everywhere); only the
reporting rank (the lowest one not under suspicion) writes it into the spool, where the sidecar
finds it, and waits — bounded — until the sidecar confirms that the Event exists. Every rank waits
with it at a barrier, so that no rank ends the job (and its pod, spool and all) first.
"""
from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from . import recovery
from .checks.exchange import wait
from .checks.topology import Topology
from .checks.verdict import Verdict
from .config import Config
from .contract import spool
from .contract.alarm import make_alarm
from .contract.stats import CheckStats
from .errors import SDCDetected

log = logging.getLogger("sdcguard")


class AlarmReporter:
    """Turns verdicts into published alarm records; counts them."""

    __slots__ = ("config", "topology", "stats", "group", "alarms_raised")

    def __init__(self, config: Config, topology: Topology, stats: CheckStats, group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.topology = topology
        self.stats = stats
        self.group = group
        self.alarms_raised = 0

    def _cost_fields(self) -> dict[str, Any]:
        """What the operator needs for the rollback's cost: this rank's measured checked step time
        (absent before a step was measured) and the job's ranks (``operator/cost.py``)."""
        cost = self.stats.cost()
        seconds = {"step_seconds": cost["checked_step_s"]} if cost is not None else {}
        return {**seconds, "world_size": self.topology.world_size}

    def raise_alarm(self, step: int, verdict: Verdict, history: recovery.History) -> None:
        """Report ``verdict`` and raise :class:`SDCDetected` with its record (on every rank)."""
        raise SDCDetected(alarm=self.report(step, verdict, history))

    def report(self, step: int, verdict: Verdict, history: recovery.History) -> dict[str, Any]:
        """Build the record every rank raises; the reporter spools it and waits for the sidecar."""
        self.alarms_raised += 1
        topo = self.topology
        reporter = topo.reporter(verdict.suspects)
        record = make_alarm(
            alarm_id=f"{topo.run_id}-{self.alarms_raised}-{verdict.check}-step{step}",
            job=self.config.job,
            check=verdict.check,
            step=step,
            suspect_ranks=verdict.suspects,
            identities=topo.identities,
            ambiguous=verdict.ambiguous,
            reporter_rank=reporter,
            evidence=verdict.evidence,
            **recovery.recovery_fields(verdict.check, step, history),
            **({"drill": True} if self.config.drill else {}),
            **self._cost_fields(),
        )
        patience = self.config.publish_wait() if self.config.spool else 0.0
        if topo.rank == reporter:
            log.error("sdcguard alarm: %s", SDCDetected(alarm=record))
            if self.config.spool:
                spool.write_alarm(self.config.spool, record)
                if patience and not spool.wait_published(self.config.spool, record["id"], timeout=patience):
                    log.error("sdcguard: the sidecar has not confirmed alarm %s within %.0f s (%s); it stays in "
                              "the spool %s and the sidecar keeps trying while the pod terminates",
                              record["id"], patience, spool.state(self.config.spool, record["id"]), self.config.spool)
        if patience and topo.world_size > 1:
            wait(dist.barrier(group=self.group, async_op=True))  # no rank leaves (and ends the job) before the reporter's wait
        self.stats.alarms += 1
        self.stats.flush(self.config.spool, force=True)
        return record

    def report_resume(self, step: int, history: recovery.History) -> None:
        """The run started from the checkpoint of ``step``: rank 0 leaves a resume record (path, step,
        sha256) in the spool for the sidecar to publish, so that the job's incident records which
        checkpoint it actually resumed from (contract/resume.py). Nobody waits for it; outside a
        Kubernetes job with a spool nothing is written."""
        if self.topology.rank != 0 or not self.config.spool or self.config.job is None:
            return
        checkpoint = next((c for c in reversed(history.checkpoints) if c.step == step), None)
        if checkpoint is None:
            return
        from .contract.resume import ResumeError, make_resume
        try:
            record = make_resume(resume_id=f"{self.topology.run_id}-resume-step{step}", job=self.config.job,
                                 reporter=self.topology.identities[self.topology.rank], path=checkpoint.path,
                                 step=step, sha256=checkpoint.sha256)
            spool.write_resume(self.config.spool, record)
        except (ResumeError, OSError) as exc:  # the record is evidence, never a reason to stop training
            log.warning("sdcguard: could not spool the resume record for step %d: %s", step, exc)
