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


def _grow(bm, s, tokens):
    """Decode `tokens` more tokens of s, one block-crossing at a time (as decode steps allocate)."""
    for _ in range(tokens):
        bm.allocate(s, 1)
        s.num_computed_tokens += 1


def test_sequences_growing_side_by_side_keep_their_blocks_in_runs():
    """Prompts allocated one after the other, then decodes that cross block boundaries in turns: each
    sequence's table is one run of consecutive blocks (the cursor left each room for its max_tokens),
    where taking the free list's first block would have interleaved them."""
    bm = BlockManager(64, 4)
    seqs = [Sequence(f"s{i}", list(range(10)), SamplingParams(max_tokens=12)) for i in range(3)]
    for s in seqs:
        bm.allocate(s, s.num_uncomputed_tokens)
        s.num_computed_tokens = s.num_tokens
    for _ in range(12):
        for s in seqs:
            _grow(bm, s, 1)
    for s in seqs:
        assert len(s.block_table) == 6
        assert s.block_table == list(range(s.block_table[0], s.block_table[0] + 6)), s.block_table
    assert len({b for s in seqs for b in s.block_table}) == 18


def test_a_run_that_meets_a_neighbour_continues_at_the_cursor_and_every_block_stays_usable():
    """A sequence that outgrows its room (max_tokens says 4, it decodes 40) goes on in a new run
    past every other; a cache filled to its last block still hands out every free one."""
    bm = BlockManager(16, 4)
    a, b = (Sequence(r, list(range(8)), SamplingParams(max_tokens=4)) for r in "ab")
    for s in (a, b):
        bm.allocate(s, 8)
        s.num_computed_tokens = 8
    _grow(bm, a, 12)
    assert a.block_table[:3] == [0, 1, 2] and a.block_table[3] > max(b.block_table)
    hog = Sequence("hog", list(range(4 * bm.num_free_blocks)), SamplingParams(max_tokens=1))
    bm.allocate(hog, hog.num_tokens)
    assert bm.num_free_blocks == 0
    assert sorted(a.block_table + b.block_table + hog.block_table) == list(range(16))


def test_runs_leave_cached_prefix_blocks_to_their_prefix():
    """A freed block that holds a cached prefix is not taken for a new run while uncached free
    blocks remain, so the prefix still hits afterwards."""
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    first = seq([1, 2, 3, 4, 5], "first")
    compute_all(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    bm.cursor = cached[0]  # a run starting where the cached blocks lie (the cursor came round)
    other = seq(range(100, 104), "other")
    bm.allocate(other, other.num_tokens)
    assert not set(cached) & set(other.block_table) and len(other.block_table) == 2
    again = seq([1, 2, 3, 4, 9], "again")
    assert bm.match_prefix(again) == 4 and again.block_table == cached


def test_runs_start_from_the_bottom_again_once_every_block_is_free():
    """When the last sequence frees its blocks the cursor goes back to block 0, so the next batch
    reuses the blocks (and the resident pages) the last one used instead of moving on through the
    cache."""
    bm = BlockManager(64, 4)
    first = [Sequence(f"a{i}", list(range(8)), SamplingParams(max_tokens=8)) for i in range(3)]
    for s in first:
        bm.allocate(s, 8)
    used = sorted(b for s in first for b in s.block_table)
    for s in first:
        bm.free(s)
    again = [Sequence(f"b{i}", list(range(8)), SamplingParams(max_tokens=8)) for i in range(3)]
    for s in again:
        bm.allocate(s, 8)
    assert sorted(b for s in again for b in s.block_table) == used and bm.cursor > 0
