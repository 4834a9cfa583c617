"""Check 2's attribution rules, every branch, without processes (see sdcguard.checks.attribution)."""
from sdcguard.checks.attribution import (
    NEITHER, OWNER, REPLAYER, attribute, mismatching_pairs, settle, suspects_after,
)

GOOD, BAD, ODD = b"g" * 16, b"b" * 16, b"o" * 16


def ring(world, offset):
    return lambda r: (r + offset) % world


def test_no_mismatch_no_pairs():
    digests = [[GOOD, GOOD] for _ in range(6)]
    assert mismatching_pairs(digests, ring(6, 2)) == []


def test_a_wrong_own_pass_mismatches_once():
    # rank 3's own pass is wrong; rank 1 replays rank 3 (offset 2): one pair (1, 3)
    digests = [[GOOD, GOOD] for _ in range(6)]
    digests[3][0] = BAD
    assert mismatching_pairs(digests, ring(6, 2)) == [(1, 3)]


def test_persistent_fault_is_the_rank_in_two_pairs():
    # rank 3 computes wrong both for itself and when it replays rank 5
    found = attribute([(1, 3), (3, 5)], units=3)
    assert found.suspects == {3} and not found.ambiguous and found.tiebreaks == []


def test_single_pair_asks_for_a_tiebreak():
    found = attribute([(1, 3)], units=3)
    assert found.suspects == set() and found.tiebreaks == [(1, 3)] and not found.ambiguous


def test_fewer_than_three_units_names_both_sides_ambiguously():
    found = attribute([(0, 1)], units=2)
    assert found.suspects == {0, 1} and found.ambiguous and found.tiebreaks == []


def test_pairs_touching_a_persistent_suspect_need_no_tiebreak():
    found = attribute([(1, 3), (3, 5), (0, 2)], units=3)
    assert found.suspects == {3} and found.tiebreaks == [(0, 2)]


def test_tiebreak_agreeing_with_the_owner_names_the_replayer():
    agrees = settle(owner_digest=GOOD, replay_digest=BAD, third_opinion=GOOD)
    assert agrees == OWNER and suspects_after(agrees, replayer=1, owner=3) == {1}


def test_tiebreak_agreeing_with_the_replayer_names_the_owner():
    agrees = settle(owner_digest=BAD, replay_digest=GOOD, third_opinion=GOOD)
    assert agrees == REPLAYER and suspects_after(agrees, replayer=1, owner=3) == {3}


def test_tiebreak_agreeing_with_neither_names_both():
    agrees = settle(owner_digest=GOOD, replay_digest=BAD, third_opinion=ODD)
    assert agrees == NEITHER and suspects_after(agrees, replayer=1, owner=3) == {1, 3}
