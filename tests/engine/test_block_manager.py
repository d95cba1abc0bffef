"""BlockManager mechanics, prefix caching included. No torch."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=4))


def compute_all(bm, s):
    bm.allocate(s, s.num_uncomputed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free_conserve_blocks():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    assert bm.blocks_needed(a, 10) == 3 and bm.can_allocate(a, 10)
    bm.allocate(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.can_allocate(seq(range(30)), 30)
    with pytest.raises(RuntimeError):
        bm.allocate(seq(range(30)), 30)
    bm.free(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_prefix_cache_reuses_full_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "first")
    compute_all(bm, first)
    same_prefix = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43], "second")
    assert bm.match_prefix(same_prefix) == 8
    assert same_prefix.block_table == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    exact = seq([1, 2, 3, 4, 5, 6, 7, 8], "exact")  # fully cached: the last block is recomputed
    assert bm.match_prefix(exact) == 4
    other = seq([9, 2, 3, 4, 5, 6, 7, 8, 1], "other")  # same second block, different first: no hit
    assert bm.match_prefix(other) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq([1, 2, 3, 4, 9], "again")
    assert bm.match_prefix(again) == 4  # both full blocks still cached after the free
    bm.free(again)
    hog = seq(range(100, 108), "hog")  # needs every block: evicts the cached ones
    bm.allocate(hog, 8)
    bm.free(hog)
    assert bm.match_prefix(seq([1, 2, 3, 4, 9], "late")) == 0


def test_without_prefix_caching_nothing_matches():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5])
    compute_all(bm, a)
    assert bm.match_prefix(seq([1, 2, 3, 4, 7], "b")) == 0
