"""The grid decisions over integers alone (decisions.py); test_admission_paths.py pins the same
cases inside SGLang's real PrefillAdder, where the wrappers read them off."""

import logging
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_chunk_align.decisions import (
    admission_end, continuation_cut, deferral, ignore_eos_end, riding_slack, short_tail,
)
from sglang_chunk_align.kernel_facts import FI072, FI074
from sglang_chunk_align.planning import KEEP, RIDE, WAIT, Rules

# flashinfer 0.7.2's facts, whatever flashinfer is installed: the rules these tests pin.
Rules = partial(Rules, facts=FI072)  # noqa: F811
RULES = Rules()  # a 128-token grid, pieces of at least 65 tokens
# Groups, a known head_dim, a page, and flashinfer 0.7.4's facts (starts anywhere: the page is the grid).
SOME_RULES = st.sampled_from(
    [RULES, Rules(group=4), Rules(group=8, head_dim=128, page_size=16), Rules(facts=FI074, page_size=16)]
)
SHORT_PIECE_KEPT = "final piece runs on a smaller fa2 tile"


@st.composite
def request(draw, rules, shortest=1):
    """(start on the grid, prompt_len at least `shortest` beyond it)."""
    start = draw(st.integers(0, 40)) * rules.grid
    return start, start + draw(st.integers(shortest, 3000))


def assert_on_the_grid(rules, start, end, prompt_len, short_piece_allowed=False):
    """An extend start..end the rules allow: empty (the request waits), or at least min_tail tokens
    ending on the grid or at the prompt's end, with no final piece too short for the full tile."""
    if end == start:
        return
    assert start < end <= prompt_len
    assert end - start >= rules.min_tail or end == prompt_len, (start, end)
    assert end == prompt_len or end % rules.grid == 0, (start, end)
    assert short_piece_allowed or end == prompt_len or prompt_len - end >= rules.min_tail, (start, end, prompt_len)


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


@given(data=st.data(), rules=SOME_RULES, others=st.booleans(), chunk_in_batch=st.booleans(),
       running=st.booleans())
def test_an_admission_ends_on_the_grid_within_its_cut_or_rides(data, rules, others, chunk_in_batch, running):
    start, prompt_len = data.draw(request(rules))
    extend = data.draw(st.integers(1, prompt_len - start))
    budget = data.draw(st.integers(extend, extend + 512) if data.draw(st.booleans()) else st.just(extend))
    end = admission_end(rules, start, extend, prompt_len, budget, others, chunk_in_batch, running)
    keeps = not others and not running and extend < budget  # memory-bound, and nothing will free memory
    assert_on_the_grid(rules, start, end, prompt_len, short_piece_allowed=keeps)
    if chunk_in_batch:
        assert end == start
    if end > start + extend:  # rides: alone, cut by the chunk budget, the piece shorter than min_tail
        assert end == prompt_len and not others and extend >= budget and end - start - extend < rules.min_tail


def test_continuation_slack_takes_in_a_final_piece_no_earlier_cut_can_merge():
    assert riding_slack(RULES, 896, 128, 1040) == 16  # chunk 128: 896 + 128 leaves 16
    assert riding_slack(RULES, 768, 256, 1040) == 0  # chunk 256 ends at 896 instead, leaving 144
    assert riding_slack(Rules(group=4), 896, 128, 1040) == 0  # a 32-token grid merges at 992
    assert riding_slack(RULES, 896, None, 1040) == 0  # chunked prefill off


@given(data=st.data(), rules=SOME_RULES)
def test_riding_slack_is_only_what_lies_beyond_a_budget_with_no_grid_cut(data, rules):
    start, prompt_len = data.draw(request(rules))
    budget = data.draw(st.integers(1, prompt_len - start + 100))
    slack = riding_slack(rules, start, budget, prompt_len)
    if slack:
        assert start + budget + slack == prompt_len and slack < rules.min_tail
        assert continuation_cut(rules, budget, prompt_len - start, WAIT) is None  # without it, it would wait


def test_continuation_under_a_memory_clamp_is_cut_on_the_grid_or_waits():
    assert continuation_cut(RULES, 400, 1244, WAIT) == 384  # from 256: ends at 640
    assert continuation_cut(RULES, 1244, 1244, WAIT) == 1244  # the whole rest
    assert continuation_cut(RULES, 100, 1244, WAIT) is None  # no grid cut below 128
    assert continuation_cut(RULES, 150, 168, WAIT) is None  # 128 would leave 40: waits for memory
    assert continuation_cut(RULES, 150, 168, KEEP) == 128  # nothing will free memory: kept


@given(data=st.data(), rules=SOME_RULES, tail=st.sampled_from([WAIT, KEEP]))
def test_a_continuation_cut_is_on_the_grid_within_the_limit(data, rules, tail):
    remaining = data.draw(st.integers(1, 3000))
    limit = data.draw(st.integers(1, remaining + 200))
    cut = continuation_cut(rules, limit, remaining, tail)
    if limit >= remaining:
        assert cut == limit
    elif cut is not None:
        assert cut <= limit
        assert_on_the_grid(rules, 0, cut, remaining, short_piece_allowed=tail == KEEP)


def test_ignore_eos_request_after_another_is_cut_on_the_grid_or_waits():
    assert ignore_eos_end(RULES, 0, 156, 1000, others=True, chunk_in_batch=False) == 128
    assert ignore_eos_end(RULES, 0, 56, 1000, others=True, chunk_in_batch=False) == 0
    assert ignore_eos_end(RULES, 0, 256, 1000, others=True, chunk_in_batch=True) == 0


@given(data=st.data(), rules=SOME_RULES, others=st.booleans())
def test_an_ignore_eos_chunk_never_leaves_a_short_piece(data, rules, others):
    start, prompt_len = data.draw(request(rules, shortest=2))
    budget = data.draw(st.integers(1, prompt_len - start - 1))  # stock cuts only below what is left
    end = ignore_eos_end(rules, start, budget, prompt_len, others, chunk_in_batch=False)
    assert_on_the_grid(rules, start, end, prompt_len)
    assert end - start <= budget or (end == prompt_len and not others)


def test_a_new_request_waits_behind_a_parked_continuation_and_for_solo_tiles():
    long_member = (256, 256, 1000)  # a 256-token chunk of a 1000-token prompt: the 128-row tile
    assert deferral(RULES, True, [], 0, 1000) is not None  # parked: even into an empty batch
    assert deferral(RULES, False, [], 0, 50) is None
    # 50 tokens alone get the 64-row tile; beside a 256-token chunk the average is 153: the 128-row one.
    assert deferral(RULES, False, [long_member], 0, 50) == "to keep batch members on their solo tiles"
    assert deferral(RULES, False, [long_member], 0, 2000) is None
    # A member whose KV is at most 32 tokens runs exact on any tile (known head_dim below 256): a
    # first 20-token chunk of a 1000-token prompt may join a 60-token request on the 64-row tile.
    assert deferral(Rules(head_dim=128), False, [(20, 20, 1000)], 0, 60) is None
    assert deferral(Rules(head_dim=128), False, [(40, 40, 1000)], 0, 60) is not None
    # Its extend may be as short as min_tail (65): beside a 10-token member, 37 tokens on average.
    assert deferral(Rules(head_dim=128), False, [(10, 10, 10)], 0, 2000) == "to keep batch members on their solo tiles"


@pytest.mark.parametrize("members", [[], [(256, 256, 1000)]])
def test_a_candidate_is_judged_by_its_whole_prompt_kv_and_its_shortest_extend(members):
    """A 1000-token request with 990 cached: at least min(10, min_tail) tokens, KV 1000 (never exempt)."""
    rules = Rules(head_dim=128)
    reason = deferral(rules, False, [(20, 20, 20), *members], 990, 1000)
    assert reason == (None if members else "to keep batch members on their solo tiles")
