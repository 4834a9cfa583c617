"""Forward randomness that a replay can reproduce: one seed per (step, rank, micro-batch).

Dropout drawn from the global RNG would differ between a rank's own pass and another rank's
replay of it. Each forward instead runs inside a forked RNG seeded from (base seed, step, rank,
micro-batch), and the caller's RNG streams come back untouched afterwards.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch


def forward_seed(base: int, step: int, rank: int, micro: int) -> int:
    """A 63-bit seed that depends on every argument and on nothing else."""
    key = f"{base}:{step}:{rank}:{micro}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block on RNG streams seeded with ``seed``; restore the caller's streams after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        # Seed only the generators the forward uses: torch.manual_seed would also visit every
        # accelerator backend, ~1 ms per call on a CPU-only machine.
        torch.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()].manual_seed(seed)
        yield
