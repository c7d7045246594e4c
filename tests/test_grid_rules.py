"""The grid rules inside SGLang's real PrefillAdder, over random workloads.

sglang_chunk_align/harness/scheduler_driver.py drives SGLang's own scheduling
objects step by step (PrefillAdder, Req, the radix cache, the KV allocator);
these tests run it with the plugin on random prompts, shared prefixes,
arrival orders, chunk sizes and KV budgets, and check every prefill batch.
"""

import contextlib
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import analysis, scheduling, workload
from sglang_chunk_align import kernel_facts, prefill_hooks, releases
from sglang_chunk_align.harness import scheduler_driver
from sglang_chunk_align.compat import sglang_at_least
from sglang_chunk_align.planning import Rules
from tests import kernel_oracle as oracle

pytestmark = pytest.mark.needs_grid_rules
needs_radix_opt_in = pytest.mark.needs_radix_opt_in
# Releases before RADIX_OPT_IN keep the radix cache off under deterministic flashinfer, as stock.
RADIX_MODES = st.booleans() if sglang_at_least(releases.RADIX_OPT_IN) else st.just(False)

RULES = Rules()  # the rules where the backend does not say its geometry
SHAPES = {shape.name: shape for shape in workload.SHAPES}


def run_schedule(prompts, chunk, kv_tokens, radix, rules=True, shape=None, page_size=1, facts=None, split=True):
    """prompts: [(prompt_len, shared_len, arrival_step)]; returns the driver's result.

    `shape` is the model the stand-in backend plans prefill for (None: it does not say); `facts`
    the kernel facts the plugin plans with (kernel_facts.chosen; None: the installed release's);
    `split` the configuration's split attention (SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION).
    """
    with kernel_facts.chosen(facts) if facts else contextlib.nullcontext():
        return _run_schedule(prompts, chunk, kv_tokens, radix, rules, shape, page_size, split)


def _run_schedule(prompts, chunk, kv_tokens, radix, rules, shape, page_size, split):
    base = [random.Random(1).randrange(1000, 90_000) for _ in range(max(p[0] for p in prompts))]
    requests, arrivals = [], []
    for rid, (prompt_len, shared_len, arrival) in enumerate(prompts):
        shared_len = min(shared_len, prompt_len - 1)
        request = workload.RequestSpec(rid, arrival, prompt_len, 0 if shared_len else -1, shared_len, 2)
        own = random.Random(rid).choices(range(1000, 90_000), k=prompt_len - shared_len - 1)
        arrivals.append((request, base[:shared_len] + [workload.MARKER_BASE + rid] + own))
        requests.append(request)
    spec = workload.WorkloadSpec(
        n_requests=len(prompts), max_prompt=max(p[0] for p in prompts), n_prefix_groups=1,
        shared_fraction=0.5, max_output=2, n_waves=1, wave_gap_steps=1, kv_tokens=kv_tokens,
        max_running_requests=16,
    )
    cfg = workload.SchedulingConfig(f"plugin-{chunk}", chunk, plugin=True, rules=rules, split_attention=split)
    with scheduler_driver.sglang_config(cfg, radix, page_size) as server_args:
        align = scheduler_driver.truncation_align_size(server_args, shape, page_size)
        assert prefill_hooks.rules_in_force() == (
            None if not rules
            else Rules(shape.group, shape.head_dim, page_size, split_attention=split) if shape
            else Rules(page_size=page_size, split_attention=split)
        )
        return requests, scheduler_driver.SchedulerDriver(spec, cfg, radix, align, page_size).run(arrivals)


def assert_every_batch_is_exact(requests, result, chunk, rules=RULES, shape=None):
    """Every fa2 call keeps its members exact as tests/kernel_oracle.py judges one (from the kernel
    facts alone, not the rules' own lengths), every extend starts on a KV page, and every request
    finishes; for a known model shape, the replay benchmark's hazard predictor agrees. The calls
    are the batches, or under split attention the groups the backend splits them into."""
    lengths = {r.rid: r.prompt_len for r in requests}
    finished = {rid: 0 for rid in lengths}
    # the calls run every extend of the batches, once
    assert sorted(e for call in result["calls"] for e in call) == sorted(e for step in result["steps"] for e in step)
    for call in result["calls"]:
        members = [(start, end, lengths[rid]) for rid, start, end in call]
        problems = oracle.call_problems(rules.facts, rules.group, rules.head_dim, members)
        assert not problems, (call, problems)
        for rid, start, end in call:
            assert start % rules.page_size == 0, f"request {rid} starts at {start}, off a page"
            finished[rid] = max(finished[rid], end)
    assert all(finished[rid] >= lengths[rid] for rid in lengths), "a request never finished prefill"
    if shape is not None:
        schedule = dict(result, fixed_split=4096)
        hazards = analysis.predict_hazards(schedule, {r.rid: r for r in requests}, shape, rules.facts)
        assert not any(hazards.values()), hazards


prompt = st.tuples(st.integers(1, 1500), st.integers(0, 1500), st.integers(0, 12))


@settings(max_examples=int(os.environ.get("GRID_RULES_EXAMPLES", 60)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(prompt, min_size=1, max_size=10),
    chunk=st.sampled_from([128, 256, 384, 512, 1024]),
    kv_tokens=st.sampled_from([2048, 4096, 16384]),
    radix=RADIX_MODES,
    shape=st.sampled_from([None, *SHAPES]),
    page_size=st.sampled_from([1, 16]),
    facts=st.sampled_from([None, kernel_facts.FI074]),  # the installed release's, and flashinfer 0.7.4's
)
def test_plugin_schedules_start_on_the_grid_on_solo_tiles_and_finish(prompts, chunk, kv_tokens, radix, shape, page_size,
                                                                     facts):
    shape = SHAPES.get(shape)
    requests, result = run_schedule(prompts, chunk, kv_tokens, radix, shape=shape, page_size=page_size, facts=facts)
    facts = facts or kernel_facts.installed_facts()
    rules = Rules(shape.group, shape.head_dim, page_size, facts) if shape else Rules(page_size=page_size, facts=facts)
    assert_every_batch_is_exact(requests, result, chunk, rules, shape)


@needs_radix_opt_in
def test_a_known_group_rounds_radix_hits_to_its_finer_grid():
    shape = SHAPES["g4-d128"]
    requests, result = run_schedule([(1500, 1000, 0), (2500, 1000, 8)], 256, 16384, radix=True, shape=shape)
    starts = [start for step in result["steps"] for rid, start, _ in step if rid == 1]
    assert starts[0] == 992 and result["radix_hit_tokens"] == 992  # 1000 on the 32-token grid
    assert_every_batch_is_exact(requests, result, 256, Rules(4, 128), shape)


@needs_radix_opt_in
def test_page_16_keeps_the_reused_prefix_on_the_grid_and_the_page():
    shape = SHAPES["g8-d128"]
    requests, result = run_schedule([(1500, 1000, 0), (2500, 1000, 8)], 256, 16384, radix=True, shape=shape,
                                    page_size=16)
    assert result["radix_hit_tokens"] == 992  # 16-token grid and 16-token page: 1000 rounds to 992
    assert_every_batch_is_exact(requests, result, 256, Rules(8, 128, 16), shape)


def test_chunk_128_short_final_piece_rides_with_the_chunk_before_it():
    shape = SHAPES["g1-d128"]
    requests, result = run_schedule([(1040, 0, 0)], 128, 16384, radix=False, shape=shape)
    assert [step for step in result["steps"]][-1] == [(0, 896, 1040)]  # 144 tokens, not 128 + a 16-token tail
    assert_every_batch_is_exact(requests, result, 128, Rules(1, 128), shape)


@needs_radix_opt_in
def test_radix_hit_is_rounded_down_to_the_grid():
    requests, result = run_schedule([(1500, 1000, 0), (2500, 1000, 8)], 256, 16384, radix=True)
    starts = [start for step in result["steps"] for rid, start, _ in step if rid == 1]
    assert starts[0] == 896  # the 1000 shared tokens (plus the marker) reused up to the grid
    assert result["radix_hit_tokens"] == 896
    assert_every_batch_is_exact(requests, result, 256)


@pytest.mark.parametrize("split", [True, False])
def test_a_short_prompt_beside_a_long_one_runs_in_its_own_call_or_waits_for_its_own_batch(split):
    """GQA 1: a 50-token prompt gets the 64-row tile alone, the 128-row one beside a 900-token
    prompt. Split attention runs them in one step as two fa2 calls; without it the short one waits."""
    shape = SHAPES["g1-d128"]
    requests, result = run_schedule([(900, 0, 0), (50, 0, 0)], 1024, 16384, radix=False, shape=shape, split=split)
    assert_every_batch_is_exact(requests, result, 1024, Rules(1, 128), shape)
    if split:
        assert result["steps"][0] == [(0, 0, 900), (1, 0, 50)]
        assert result["calls"][:2] == [[(0, 0, 900)], [(1, 0, 50)]]
    else:
        assert result["steps"][:2] == [[(0, 0, 900)], [(1, 0, 50)]] == result["calls"][:2]


@needs_radix_opt_in
def test_length_alignment_alone_fails_the_same_checks():
    """The checks are sensitive: with the rules off (SGLANG_CHUNK_ALIGN_RULES=0) SGLang's schedule breaks them."""
    prompts = [(1500, 1000, 0), (2500, 1000, 8), (1040, 0, 8), (50, 0, 8)]
    requests, result = run_schedule(prompts, 256, 16384, radix=True, rules=False)
    starts = [start for step in result["steps"] for rid, start, _ in step if rid == 1]
    assert starts[0] == 1000
    with pytest.raises(AssertionError, match=r"1000\.\.1256 of 2500: starts off the 128-row tiles"):
        assert_every_batch_is_exact(requests, result, 256)


def test_length_alignment_alone_leaves_a_short_final_piece():
    """Radix off, on every release with the rules: with the rules off, SGLang's 128-aligned cuts
    leave a 16-token final piece, which the same checks catch."""
    requests, result = run_schedule([(1040, 0, 0)], 256, 16384, radix=False, rules=False)
    with pytest.raises(AssertionError, match="1024..1040 of 1040: the 16-row tile"):
        assert_every_batch_is_exact(requests, result, 256)


@needs_radix_opt_in
def test_the_tree_serves_only_kv_computed_in_full_q_tiles():
    """Three turns of one conversation at group 1: turn 1 reuses turn 0 up to the grid (1024) and
    recomputes 1024..1041 in a full q-tile. Stock's tree keeps turn 0's copy of those rows (computed
    in its partial final tile) and serves it to turn 2; with the rules it never took that copy."""
    shape = SHAPES["g1-d128"]
    prompts = [(1042, 1041, 0), (1500, 1499, 8), (2000, 1999, 16)]
    requests, result = run_schedule(prompts, 512, 16384, radix=True, shape=shape)
    turn_2 = scheduling.donor_runs(result)[2]
    assert [donor for donor, _, end in turn_2 if end > 1024] == [1]
    assert_every_batch_is_exact(requests, result, 512, Rules(1, 128), shape)
