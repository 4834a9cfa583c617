"""Check 3's vote, without processes: who is named, and what the evidence holds."""
from sdcguard.fingerprint import Fingerprint
from sdcguard.checks.weights import judge_weights, strict_majority

GOOD = [Fingerprint(1, 2), Fingerprint(3, 4)]
BAD = [Fingerprint(1, 2), Fingerprint(3, 5)]
NAMES = ["a.weight", "b.weight"]


def test_rank_zero_is_named_like_any_other():
    digests = [b"x" * 16, b"g" * 16, b"g" * 16]
    verdict = judge_weights(digests, [BAD, GOOD, None], NAMES)  # rank 2's details were not fetched
    assert verdict.suspects == [0] and not verdict.ambiguous
    assert verdict.evidence["differing_parameters"] == {0: {"count": 1, "names": ["b.weight"]}}
    assert verdict.evidence["majority_size"] == 2


def test_no_strict_majority_is_ambiguous():
    digests = [b"x" * 16, b"g" * 16]
    assert strict_majority(digests) is None
    verdict = judge_weights(digests, [None, None], NAMES)
    assert verdict.suspects == [0, 1] and verdict.ambiguous
    assert verdict.evidence["digest_groups"] == {(b"x" * 16).hex(): 1, (b"g" * 16).hex(): 1}


def test_evidence_stays_small_with_many_ranks():
    digests = [b"g" * 16] * 999 + [b"x" * 16]
    fingerprints = [None] * 1000
    fingerprints[0], fingerprints[999] = GOOD, BAD
    verdict = judge_weights(digests, fingerprints, NAMES)
    assert verdict.suspects == [999]
    assert len(str(verdict.evidence)) < 400
