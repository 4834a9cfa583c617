"""The checks that run inside every data-parallel rank (docs/design.md §3).

Each check is split into what a rank computes locally (a vote: a norm, a digest, a replay), the
small collectives that exchange the votes (``exchange``), and a pure decision over the gathered
votes that can be unit-tested without processes (``nonfinite.judge_nonfinite``,
``audit.judge_replays``, ``weights.judge_weights``, ``reduce_checksum.judge_checksum``).
``sdcguard.verification`` composes them in the order of docs/design.md §3.
"""
