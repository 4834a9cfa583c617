"""The checks that run inside every data-parallel rank (SPEC §3).

Each check is split into what a rank computes locally (a vote: a norm, a digest, a replay), the
small collectives that exchange the votes (``exchange``), and a pure decision over the gathered
votes that can be unit-tested without processes (``nonfinite.judge_nonfinite``,
``attribution.attribute_replays``, ``weights.judge_weights``). ``sdcguard.step`` composes them in the
SPEC's order.
"""
