"""Server-side fault injection for the sandbox's API server: a share of some users' requests
answered as an overloaded API server answers them (500, 409 on writes, 429) or stalled."""
from __future__ import annotations

from typing import Any

import attrs


@attrs.define(kw_only=True)
class Faults:
    """Server-side fault injection for requests made by some users (the operator), not the caller's own.

    Each request of a user in ``users`` is, with probability ``rate``, answered with one of
    ``codes`` (500, 409, 429: the Status a real API server sends) or stalled for ``stall`` seconds
    before being served (a slow or hung API server; the client's own timeouts apply).  ``counts``
    says how many of each were injected.  ``rate = 0`` (the default) turns injection off.
    """

    rate: float = 0.0
    users: set[str] = attrs.field(factory=set)
    codes: tuple[int, ...] = (500, 409, 429)
    stall_share: float = 0.25
    """Share of the faults that are stalls rather than error answers."""
    stall: tuple[float, float] = (1.0, 4.0)
    seed: int | None = None
    counts: dict[str, int] = attrs.field(factory=dict)
    _rng: Any = attrs.field(default=None, init=False)

    def pick(self, user: str, write: bool = True) -> int | float | None:
        """None: serve normally; an int: answer that status; a float: stall that many seconds.
        A read (``write=False``) is never answered 409: an API server answers Conflict to writes only."""
        import random
        if self.rate <= 0 or user not in self.users:
            return None
        if self._rng is None:
            self._rng = random.Random(self.seed)
        if self._rng.random() >= self.rate:
            return None
        if self._rng.random() < self.stall_share:
            self.counts["stall"] = self.counts.get("stall", 0) + 1
            return self._rng.uniform(*self.stall)
        code = self._rng.choice([c for c in self.codes if write or c != 409] or [500])
        self.counts[str(code)] = self.counts.get(str(code), 0) + 1
        return code


REASONS = {500: "InternalError", 409: "Conflict", 429: "TooManyRequests"}
