"""The grid decisions over integers alone (decisions.py); test_admission_paths.py pins the same
cases inside SGLang's real PrefillAdder, where the wrappers read them off."""

import logging
from functools import partial

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from sglang_chunk_align.decisions import (
    ALONE_FOR_PACKED_CHUNKS, OFF_TILE_IN_ITS_CALL, ONE_TILE_PER_BATCH, admission_end, continuation_cut, deferral,
    ignore_eos_end, riding_slack, short_tail, tile_groups,
)
from sglang_chunk_align.kernel_facts import FI072, FI074
from sglang_chunk_align.planning import KEEP, RIDE, WAIT, Rules
from tests import kernel_oracle as oracle

# flashinfer 0.7.2's facts, whatever flashinfer is installed: the rules these tests pin.
Rules = partial(Rules, facts=FI072)  # noqa: F811
RULES = Rules()  # a 128-token grid, pieces of at least 65 tokens
GROUP_4 = Rules(group=4)  # a 32-token grid, pieces of at least 17 tokens
STARTS_ANYWHERE = Rules(facts=FI074)  # flashinfer 0.7.4: a 1-token grid, pieces of at least 65 tokens
# Groups, a known head_dim (128, and 256 with its 64-row cap), a page, and 0.7.4's facts (the page is the grid).
SOME_RULES = st.sampled_from([
    RULES, GROUP_4, STARTS_ANYWHERE, Rules(group=8, head_dim=128, page_size=16), Rules(group=2, head_dim=256),
    Rules(facts=FI074, page_size=16),
])
SHORT_PIECE_KEPT = "final piece runs on a smaller fa2 tile"


def requests(longest=3000):
    """Strategies for a request: how many oracle start steps its extend starts after, and how many
    tokens of its prompt are left from there."""
    return st.integers(0, 40), st.integers(1, longest)


def request(rules, steps, left):
    """(start, prompt_len) of a request `steps` oracle start steps in, with `left` tokens left: a
    request the rules may have cut there (the rest after a cut can still be prefilled exactly)."""
    start = steps * oracle.start_step(rules.facts, rules.group, rules.page_size)
    assume(not oracle.rest_problems(rules.facts, rules.group, rules.head_dim, start, start + left))
    return start, start + left


def assert_exact(rules, start, end, prompt_len, kept_within=None):
    """A decision's extend start..end, as kernel_oracle judges it (not by the rules' own lengths):
    empty (the request waits), or a chunk that ends on a page or at the prompt's end, is exact in
    a call of its own, and leaves a rest that can still be prefilled exactly. Where KV memory binds
    at `kept_within` tokens and nothing will free any, a short rest may be kept, only where no
    exact cut fits those tokens; it still starts on the tiles."""
    assert start <= end <= prompt_len, (start, end, prompt_len)
    if end == start:
        return
    assert end == prompt_len or end % rules.page_size == 0, (start, end)
    facts, group, head_dim = rules.facts, rules.group, rules.head_dim
    problems = oracle.call_problems(facts, group, head_dim, [(start, end, prompt_len)])
    rest = oracle.rest_problems(facts, group, head_dim, end, prompt_len)
    if kept_within is None or can_progress(rules, start, kept_within, prompt_len):
        problems += rest
    elif end < prompt_len and not oracle.on_tile_start(facts, group, end):
        problems.append(f"the rest starts at {end}, off the tiles")
    assert not problems, (start, end, prompt_len, problems)


def too_short_to_cut_off(rules, cut, prompt_len):
    """Whether the piece cut..prompt_len would not be exact in a call of its own: why a rest may
    ride beyond the chunk budget. Judged only where the prompt gets the largest tile
    (oracle.gets_largest_tile): a shorter prompt's rest rides sooner than it need."""
    facts, group, head_dim = rules.facts, rules.group, rules.head_dim
    if not oracle.gets_largest_tile(facts, group, head_dim, prompt_len):
        return True
    return bool(oracle.call_problems(facts, group, head_dim, [(cut, prompt_len, prompt_len)]))


def can_progress(rules, start, budget, prompt_len):
    return oracle.can_progress(rules.facts, rules.group, rules.head_dim, rules.page_size, start, budget, prompt_len)


def test_short_tail_rides_alone_waits_for_room_and_keeps_only_where_waiting_is_forever():
    assert short_tail(True, False, True) == RIDE
    assert [short_tail(False, others, running) for others, running in ((True, False), (False, True))] == [WAIT] * 2
    assert short_tail(False, False, False) == KEEP


def test_new_request_ends_a_grid_step_early_rather_than_leave_a_short_tail():
    """Stock cuts 560 tokens at 512 (chunk 512), leaving 48; the grid cut is 384, leaving 176."""
    assert admission_end(RULES, 0, 512, 560, 512, others=False, chunk_in_batch=False, running=False) == 384


def test_new_request_alone_lets_its_short_final_piece_ride_only_where_the_chunk_budget_cut_it():
    assert admission_end(RULES, 0, 128, 160, 128, others=False, chunk_in_batch=False, running=False) == 160
    # Behind another request, the 32-token tail would ride on budget others left over: it waits.
    assert admission_end(RULES, 0, 128, 160, 128, others=True, chunk_in_batch=False, running=False) == 0


def test_no_second_chunked_request_joins_a_batch():
    assert admission_end(RULES, 0, 256, 1000, 256, others=True, chunk_in_batch=True, running=False) == 0


def test_memory_bound_short_piece_is_kept_only_where_nothing_will_free_memory(caplog):
    """KV memory for 100 of 168 tokens: a grid cut would leave 40. Nothing running: kept, WARNING."""
    assert admission_end(RULES, 896, 128, 1064, 512, others=False, chunk_in_batch=False, running=True) == 896
    assert SHORT_PIECE_KEPT not in caplog.text
    with caplog.at_level(logging.WARNING, "sglang_chunk_align"):
        assert admission_end(RULES, 896, 128, 1064, 512, others=False, chunk_in_batch=False, running=False) == 1024
    assert "its 40-token final piece" in caplog.text and SHORT_PIECE_KEPT in caplog.text


# Boundary cases: stock's cut leaves exactly one token less than the shortest piece on the full
# tile (64 tokens at group 1, 16 at group 4: 64 rows, the 64-row tile), or exactly that piece.
@example(rules=RULES, steps=0, left=576, cut=512, slack=0, others=False, chunk_in_batch=False, running=False)
@example(rules=RULES, steps=2, left=577, cut=512, slack=0, others=True, chunk_in_batch=False, running=True)
@example(rules=GROUP_4, steps=3, left=528, cut=512, slack=0, others=True, chunk_in_batch=False, running=False)
@example(rules=STARTS_ANYWHERE, steps=7, left=164, cut=100, slack=0, others=False, chunk_in_batch=False, running=True)
@example(rules=STARTS_ANYWHERE, steps=5, left=130, cut=100, slack=28, others=False, chunk_in_batch=False, running=False)
@given(rules=SOME_RULES, steps=requests()[0], left=requests()[1], cut=st.integers(1, 3000),
       slack=st.one_of(st.just(0), st.integers(1, 512)), others=st.booleans(), chunk_in_batch=st.booleans(),
       running=st.booleans())
def test_an_admission_is_exact_within_its_cut_or_rides(rules, steps, left, cut, slack, others, chunk_in_batch,
                                                       running):
    """Stock cut `extend` tokens with `slack` more of chunk budget left (0: the chunk budget cut it)."""
    start, prompt_len = request(rules, steps, left)
    extend = min(cut, left)
    budget = extend + slack
    end = admission_end(rules, start, extend, prompt_len, budget, others, chunk_in_batch, running)
    keeps = not others and not running and extend < budget  # memory-bound, and nothing will free memory
    assert_exact(rules, start, end, prompt_len, kept_within=extend if keeps else None)
    if chunk_in_batch:
        assert end == start
    alone_cut_by_the_chunk = not others and not chunk_in_batch and extend >= budget
    if alone_cut_by_the_chunk and can_progress(rules, start, extend, prompt_len):
        assert end > start  # it would wait for nothing
    if end > start + extend:  # rides: alone, cut by the chunk budget, the rest too short to cut off
        assert end == prompt_len and alone_cut_by_the_chunk
        assert too_short_to_cut_off(rules, start + extend, prompt_len)


def test_continuation_slack_takes_in_a_final_piece_no_earlier_cut_can_merge():
    assert riding_slack(RULES, 896, 128, 1040) == 16  # chunk 128: 896 + 128 leaves 16
    assert riding_slack(RULES, 768, 256, 1040) == 0  # chunk 256 ends at 896 instead, leaving 144
    assert riding_slack(Rules(group=4), 896, 128, 1040) == 0  # a 32-token grid merges at 992
    assert riding_slack(RULES, 896, None, 1040) == 0  # chunked prefill off


@example(rules=RULES, steps=7, left=192, budget=128)  # 64 beyond the budget: rides
@example(rules=RULES, steps=7, left=193, budget=128)  # 65 beyond: cut off on the grid
@given(rules=SOME_RULES, steps=requests()[0], left=requests()[1], budget=st.integers(1, 3100))
def test_riding_slack_is_only_a_rest_too_short_to_cut_off(rules, steps, left, budget):
    """A continuation is alone in its batch: its rest rides beyond the chunk budget only where the
    part beyond would not be exact cut off, and the whole rest is."""
    start, prompt_len = request(rules, steps, left)
    slack = riding_slack(rules, start, budget, prompt_len)
    assert slack in (0, prompt_len - start - budget)
    if slack:
        assert too_short_to_cut_off(rules, start + budget, prompt_len)
        assert_exact(rules, start, prompt_len, prompt_len)
        assert continuation_cut(rules, budget, left, WAIT) is None  # without it, it would wait
    if can_progress(rules, start, budget, prompt_len):  # a continuation alone never waits for nothing
        assert continuation_cut(rules, budget + slack, left, WAIT) is not None


def test_continuation_under_a_memory_clamp_is_cut_on_the_grid_or_waits():
    assert continuation_cut(RULES, 400, 1244, WAIT) == 384  # from 256: ends at 640
    assert continuation_cut(RULES, 1244, 1244, WAIT) == 1244  # the whole rest
    assert continuation_cut(RULES, 100, 1244, WAIT) is None  # no grid cut below 128
    assert continuation_cut(RULES, 150, 168, WAIT) is None  # 128 would leave 40: waits for memory
    assert continuation_cut(RULES, 150, 168, KEEP) == 128  # nothing will free memory: kept


@example(rules=RULES, steps=2, remaining=576, limit=520, tail=WAIT)  # 512 would leave 64
@example(rules=GROUP_4, steps=5, remaining=528, limit=520, tail=KEEP)  # 512 would leave 16
@example(rules=STARTS_ANYWHERE, steps=3, remaining=130, limit=100, tail=KEEP)  # 65 leaves exactly 65
@given(rules=SOME_RULES, steps=requests()[0], remaining=requests()[1], limit=st.integers(1, 3200),
       tail=st.sampled_from([WAIT, KEEP]))
def test_a_continuation_cut_is_exact_within_the_limit(rules, steps, remaining, limit, tail):
    start, prompt_len = request(rules, steps, remaining)
    cut = continuation_cut(rules, limit, remaining, tail)
    if limit >= remaining:
        assert cut == limit
    elif cut is not None:
        assert cut <= limit
        assert_exact(rules, start, start + cut, prompt_len, kept_within=limit if tail == KEEP else None)


def test_ignore_eos_request_after_another_is_cut_on_the_grid_or_waits():
    assert ignore_eos_end(RULES, 0, 156, 1000, others=True, chunk_in_batch=False) == 128
    assert ignore_eos_end(RULES, 0, 56, 1000, others=True, chunk_in_batch=False) == 0
    assert ignore_eos_end(RULES, 0, 256, 1000, others=True, chunk_in_batch=True) == 0


@example(rules=RULES, steps=1, left=575, budget=512, others=True)  # 512 would leave 64
@example(rules=RULES, steps=1, left=575, budget=512, others=False)
@example(rules=GROUP_4, steps=9, left=527, budget=512, others=False)  # 512 would leave 16
@given(rules=SOME_RULES, steps=requests()[0], left=requests(longest=3000)[1], budget=st.integers(1, 3000),
       others=st.booleans())
def test_an_ignore_eos_chunk_is_exact_and_leaves_no_short_rest(rules, steps, left, budget, others):
    start, prompt_len = request(rules, steps, left + 1)
    budget = min(budget, left)  # stock cuts only below what is left
    end = ignore_eos_end(rules, start, budget, prompt_len, others, chunk_in_batch=False)
    assert_exact(rules, start, end, prompt_len)
    assert end - start <= budget or (end == prompt_len and not others)
    if not others and can_progress(rules, start, budget, prompt_len):
        assert end > start


def test_a_new_request_waits_behind_a_parked_continuation_and_for_solo_tiles():
    long_member = (256, 256, 1000)  # a 256-token chunk of a 1000-token prompt: the 128-row tile
    assert deferral(RULES, True, [], 0, 1000) is not None  # parked: even into an empty batch
    assert deferral(RULES, False, [], 0, 50) is None
    # 50 tokens alone get the 64-row tile; beside a 256-token chunk the average is 153: the 128-row one.
    assert deferral(RULES, False, [long_member], 0, 50) == ONE_TILE_PER_BATCH
    assert deferral(RULES, False, [long_member], 0, 2000) is None
    # A member whose KV is at most 32 tokens runs exact on any tile (known head_dim below 256): a
    # first 20-token chunk of a 1000-token prompt may join a 60-token request on the 64-row tile.
    assert deferral(Rules(head_dim=128), False, [(20, 20, 1000)], 0, 60) is None
    assert deferral(Rules(head_dim=128), False, [(40, 40, 1000)], 0, 60) is not None
    # Its extend may be as short as min_tail (65): beside a 10-token member, 37 tokens on average.
    assert deferral(Rules(head_dim=128), False, [(10, 10, 10)], 0, 2000) == ONE_TILE_PER_BATCH


def test_where_a_kernel_chunks_the_packed_batch_a_request_prefills_alone():
    """Mamba2 (packed_chunk): any member ahead makes a new request wait, even one split attention
    would let in; an empty batch takes it; a parked continuation still holds the queue first."""
    mamba = Rules(group=4, head_dim=128, split_attention=True, packed_chunk=256)
    assert deferral(mamba, False, [], 0, 100) is None
    assert deferral(mamba, False, [(256, 256, 1000)], 0, 2000) == ALONE_FOR_PACKED_CHUNKS
    assert deferral(Rules(group=4, head_dim=128, split_attention=True), False, [(256, 256, 1000)], 0, 2000) is None
    assert deferral(mamba, True, [], 0, 100) is not None and deferral(mamba, True, [], 0, 100) != ALONE_FOR_PACKED_CHUNKS


def test_split_attention_defers_only_what_one_call_per_tile_class_cannot_keep_on_its_tile():
    split = Rules(head_dim=128, split_attention=True)
    assert deferral(split, True, [], 0, 1000) is not None  # a parked continuation still holds the queue
    # Each of these waits without split attention (above); split, each class gets its own call.
    assert deferral(split, False, [(256, 256, 1000)], 0, 50) is None
    assert deferral(split, False, [(60, 60, 60)], 0, 1000) is None
    assert deferral(split, False, [(10, 10, 10)], 0, 2000) is None
    # What a split cannot fix: a 10-token final piece over 1024 cached, alone in the 128-row class,
    # gets a small tile in any call of its own; a 100-token prompt in its class keeps it waiting.
    assert deferral(split, False, [(10, 1034, 1034)], 0, 100) == OFF_TILE_IN_ITS_CALL
    assert deferral(Rules(head_dim=128), False, [(10, 1034, 1034)], 0, 100) is not None
    # Where calls are padded (issue 48) that piece's call gets a pad, and nobody waits for it.
    padded = Rules(head_dim=128, split_attention=True, pad_tiles=True)
    assert deferral(padded, False, [(10, 1034, 1034)], 0, 100) is None


@given(members=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 1500), st.integers(0, 1500)), min_size=1,
                        max_size=8),
       group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([None, 128, 256]))
def test_split_calls_partition_the_batch_and_keep_rules_made_members_on_their_solo_tiles(members, group, head_dim):
    """tile_groups over what the backend sees (extend, KV end) of extends the grid rules make
    (over a cached prefix, or ending before the prompt does, an extend is at least min_tail
    long): every member in exactly one call, and each call gives each member its solo tile, as
    kernel_oracle judges from the facts alone."""
    rules = Rules(group=group, head_dim=head_dim, split_attention=True)
    batch = []  # (start, end, prompt_len)
    for extend, cached, rest in members:
        cached = cached // rules.grid * rules.grid  # every extend starts on the grid
        if cached or rest:
            extend = max(extend, rules.min_tail)
        batch.append((cached, cached + extend, cached + extend + rest))
    split = tile_groups(rules, [e - s for s, e, _ in batch], [e for _, e, _ in batch])
    groups = split.groups if split else (tuple(range(len(batch))),)
    assert sorted(i for g in groups for i in g) == list(range(len(batch)))
    for g in groups:
        assert not oracle.call_problems(rules.facts, group, head_dim, [batch[i] for i in g]), (batch, groups)


@given(members=st.lists(st.tuples(st.integers(1, 600), st.integers(0, 1500), st.integers(0, 1500)), min_size=1,
                        max_size=8),
       group=st.sampled_from([1, 2, 3, 4, 7, 8]), head_dim=st.sampled_from([128, 256]),
       facts=st.sampled_from([FI072, FI074]))
def test_padded_calls_keep_final_pieces_of_any_length_on_their_solo_tiles(members, group, head_dim, facts):
    """As above where split attention pads calls (issue 48): a final piece may be any length (a radix
    hit kept whole), a cut before the prompt's end still min_tail; each padded call gives each member
    its solo tile, as kernel_oracle judges from the facts, and never moves one off it."""
    rules = Rules(group=group, head_dim=head_dim, split_attention=True, pad_tiles=True, facts=facts)
    batch = []  # (start, end, prompt_len)
    for extend, cached, rest in members:
        cached = cached // rules.grid * rules.grid
        if rest:
            extend = max(extend, rules.min_tail)
        batch.append((cached, cached + extend, cached + extend + rest))
    split = tile_groups(rules, [e - s for s, e, _ in batch], [e for _, e, _ in batch])
    calls = zip(split.groups, split.pads) if split else [(tuple(range(len(batch))), 0)]
    for g, pad in calls:
        assert not oracle.call_problems(rules.facts, group, head_dim, [batch[i] for i in g], pad), (batch, split)


@pytest.mark.parametrize("members", [[], [(256, 256, 1000)]])
def test_a_candidate_is_judged_by_its_whole_prompt_kv_and_its_shortest_extend(members):
    """A 1000-token request with 990 cached: at least min(10, min_tail) tokens, KV 1000 (never exempt)."""
    rules = Rules(head_dim=128)
    reason = deferral(rules, False, [(20, 20, 20), *members], 990, 1000)
    assert reason == (None if members else ONE_TILE_PER_BATCH)
