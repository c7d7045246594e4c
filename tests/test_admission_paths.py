"""The grid rules in SGLang's real PrefillAdder, one admission path at a time.

test_grid_rules.py drives whole schedules through the scheduler driver;
these build SGLang's own PrefillAdder, Req, KV allocator and (disabled)
prefix cache directly, so each path (continuation under a memory clamp, a
riding final piece, a new request's cut, ignore_eos) is pinned on its own.
Each case also runs with the rules off, to show that stock cuts off the grid
there. The rules are activated by the Scheduler's own startup check.
"""

from array import array
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from sglang_chunk_align import prefill_hooks, releases
from sglang_chunk_align.harness import scheduler_driver, standins
from sglang_chunk_align.compat import req_extend_end, sglang_at_least
from sglang_chunk_align.planning import Rules

pytestmark = pytest.mark.needs_grid_rules

VOCAB_SIZE = 1000


@contextmanager
def adder_with(chunk, kv_tokens, rules, max_new_tokens=2, attn_backend=None):
    """(a fresh PrefillAdder factory, a Req factory) under chunk `chunk` and `kv_tokens` of KV,
    with the grid rules activated by the startup check (rules=True) or left off; the live backend
    a deterministic FlashInferAttnBackend unless `attn_backend` (a function making one) says."""
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    with standins.published(True, chunk, disable_radix_cache=True) as server_args:
        live = (attn_backend or standins.flashinfer_backend)()
        standins.run_alignment_steps(standins.scheduler(server_args, live))
        if not rules:
            prefill_hooks.activate(None)
        expected = Rules(split_attention=True, packed_chunk=live.prefill_declaration.packed_chunk)
        assert prefill_hooks.rules_in_force() == (expected if rules else None)
        kv = MHATokenToKVPool(kv_tokens, 1, torch.bfloat16, 1, 1, 1, "cpu", False)
        allocator = TokenToKVPoolAllocator(kv_tokens, torch.bfloat16, "cpu", kv, need_sort=False)
        req_pool = ReqToTokenPool(4, 4096, "cpu", False)
        tree = scheduler_driver.prefix_cache(False, req_pool, allocator, 1, chunk)

        def new_adder(running_batch=None):
            return PrefillAdder(1, tree, allocator, running_batch, 1.0, 16384, chunk, max_running_requests=4)

        def new_req(rid, prompt_len, ignore_eos=False):
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
            params.normalize(None)
            req = Req(str(rid), "", array("q", [100 + rid] * prompt_len), params, vocab_size=VOCAB_SIZE)
            req.init_next_round_input(tree)
            return req

        yield new_adder, new_req


def continue_from(req, prefix_len):
    """`req` after its earlier chunks, whose KV is its prefix (Req.prefix_len from 0.5.22, its KV indices before)."""
    import torch

    if hasattr(req, "prefix_indices"):
        req.prefix_indices = torch.arange(prefix_len)
    else:
        req.prefix_len = prefix_len


def continuation_under_memory_clamp(new_adder, new_req, prompt_len, running):
    """Request 0's continuation from 896 of `prompt_len`, on an adder whose KV memory clamps it,
    with one request decoding beside it where `running` (it will free KV): the continuation does
    not finish. Returns (request, adder, running batch)."""
    req = new_req(0, prompt_len)
    continue_from(req, 896)
    running_batch = SimpleNamespace(batch_size=lambda: 1, reqs=[new_req(1, 8)]) if running else None
    adder = new_adder(running_batch)
    assert adder.add_chunked_req(req) is req  # not finished
    return req, adder, running_batch


def admit_new(adder, req):
    return adder.add_one_req(req, has_chunked_req=False, truncation_align_size=128)


@pytest.mark.parametrize("rules, end", [(True, 640), (False, None)])
def test_continuation_under_a_memory_clamp_ends_on_the_grid(plugin, rules, end):
    """KV memory for about 400 tokens cuts a continuation at 256 + 400ish; the rules cut at 640."""
    with adder_with(512, kv_tokens=400, rules=rules) as (new_adder, new_req):
        req = new_req(0, 1500)
        continue_from(req, 256)  # its first chunk, on the grid
        adder = new_adder()
        assert adder.add_chunked_req(req) is req  # not finished
        if rules:
            assert req_extend_end(req) == end
            assert adder.rem_chunk_tokens == 512 - (end - 256)  # charged what it admitted
        else:
            assert req_extend_end(req) % 128 != 0


@pytest.mark.parametrize("running, parked", [(False, False), (True, True)])
def test_memory_bound_short_final_piece_waits_while_running_requests_will_free_kv(
    plugin, caplog, running, parked
):
    """KV memory for about 150 tokens, 168 left: a grid cut leaves a 40-token final piece. While a
    request runs (it will free KV) the continuation waits and admits no one behind it in its step;
    with nothing running, waiting would be forever, so the short piece is kept, with a WARNING."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    with adder_with(512, kv_tokens=150, rules=True) as (new_adder, new_req):
        req, adder, running_batch = continuation_under_memory_clamp(new_adder, new_req, 1064, running)
        if parked:
            assert adder.can_run_list == [] and adder.rem_chunk_tokens == 512
            assert admit_new(adder, new_req(2, 16)) == AddReqResult.OTHER and adder.can_run_list == []
            next_step = new_adder(running_batch)  # parked for its own step only
            assert admit_new(next_step, new_req(3, 16)) == AddReqResult.CONTINUE and len(next_step.can_run_list) == 1
        else:
            assert adder.can_run_list == [req] and req_extend_end(req) == 1024
            assert "40-token final piece runs on a smaller fa2 tile" in caplog.text


@pytest.mark.parametrize("rules, end", [(True, 1040), (False, 1024)])
def test_short_final_piece_of_a_continuation_rides_along(plugin, rules, end):
    """Chunk 128 has no earlier cut to merge into: the 16-token tail rides with the last chunk."""
    with adder_with(128, kv_tokens=4096, rules=rules) as (new_adder, new_req):
        req = new_req(0, 1040)
        continue_from(req, 896)
        adder = new_adder()
        finished = adder.add_chunked_req(req) is None
        assert req_extend_end(req) == end and finished == rules
        budget = getattr(adder, "memory_budget", None)  # 0.5.21+
        if budget is not None:  # it answers the continuation's call alone: stock's answers again after it
            assert budget.available_chunk_tokens(128) == 128
            assert budget.fit_chunk(extend_input_len=144, max_new_tokens=0, chunk_limit=100) == 100


@pytest.mark.parametrize("running", [False, True])
def test_riding_final_piece_under_a_memory_clamp_is_cut_on_the_grid(plugin, caplog, running):
    """Chunk 128 from 896 of 1040 lets the 16-token tail ride (144 tokens), but KV memory holds 136:
    the continuation is cut at the grid's 1024, the short piece kept with a WARNING where nothing
    runs to free memory, or it waits where a request runs, as any memory-bound continuation."""
    with adder_with(128, kv_tokens=136, rules=True) as (new_adder, new_req):
        req, adder, _ = continuation_under_memory_clamp(new_adder, new_req, 1040, running)
        if running:
            assert adder.can_run_list == []
        else:
            assert adder.can_run_list == [req] and req_extend_end(req) == 1024
            assert "16-token final piece runs on a smaller fa2 tile" in caplog.text


@pytest.mark.parametrize("rules, end", [(True, 384), (False, 512)])
def test_new_request_ends_a_grid_step_early_rather_than_leave_a_short_tail(plugin, rules, end):
    """Stock cuts 560 tokens at 512, leaving 48 (a 48-row tile); the rules cut at 384, leaving 176."""
    with adder_with(512, kv_tokens=4096, rules=rules) as (new_adder, new_req):
        adder = new_adder()
        req = new_req(0, 560)
        admit_new(adder, req)
        assert adder.can_run_list == [req] and req_extend_end(req) == end and adder.new_chunked_req is req


def test_no_second_chunked_request_joins_a_batch(plugin):
    """Chunk 512: a 560-token request is cut at 384 (stock's 512 would leave 48), still unfinished;
    a 1000-token request would be cut in the 128 tokens left, a second unfinished chunked request
    in one batch, which SGLang cannot track (it keeps one): it waits for the next step. (Stock
    fills the chunk with the first request, so no second one is cut there.)"""
    from sglang.srt.managers.schedule_policy import AddReqResult

    with adder_with(512, kv_tokens=4096, rules=True) as (new_adder, new_req):
        adder = new_adder()
        first, second = new_req(0, 560), new_req(1, 1000)
        admit_new(adder, first)
        assert admit_new(adder, second) == AddReqResult.OTHER
        assert adder.can_run_list == [first] and req_extend_end(first) == 384 and adder.new_chunked_req is first


@pytest.mark.parametrize("rules, end", [(True, 160), (False, 128)])
def test_new_request_alone_lets_its_short_final_piece_ride(plugin, rules, end):
    """At chunk 128 no earlier cut can take in a 32-token tail: alone in the batch, it rides."""
    with adder_with(128, kv_tokens=4096, rules=rules) as (new_adder, new_req):
        adder = new_adder()
        req = new_req(0, 160)
        admit_new(adder, req)
        assert req_extend_end(req) == end and (adder.new_chunked_req is None) == rules


def record_floor_calls(monkeypatch):
    """[(the length stock passes PrefillAdder.floor_chunked_tokens, the chunk budget then)] per
    call from now on, from 0.5.23; None before, where the method does not exist."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    if not sglang_at_least(releases.FLOOR_CHUNKED_TOKENS):
        return None
    calls, floor = [], PrefillAdder.floor_chunked_tokens  # the plugin's wrapper, where it is applied

    def spy(adder, trunc_len, remaining):
        calls.append((trunc_len, adder.rem_chunk_tokens))
        return floor(adder, trunc_len, remaining)

    monkeypatch.setattr(PrefillAdder, "floor_chunked_tokens", spy)
    return calls


@pytest.mark.parametrize("rules, end, verdict", [(True, 128, "CONTINUE"), (False, 156, "OTHER")])
def test_ignore_eos_request_after_another_is_cut_on_the_grid(plugin, monkeypatch, rules, end, verdict):
    """After a 100-token request, stock cuts an ignore_eos request at the 156 tokens left of chunk 256.
    The rules cut it at 128 and leave 28 tokens of chunk budget, which the adder's verdict reports.
    From 0.5.23 stock floors the budget as it reads it (156) through floor_chunked_tokens, which
    hands the grid cut back: the budget is never moved around the stock call."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    with adder_with(256, kv_tokens=8192, rules=rules) as (new_adder, new_req):
        floored = record_floor_calls(monkeypatch)
        adder = new_adder()
        first, second = new_req(0, 100), new_req(1, 1000, ignore_eos=True)
        admit_new(adder, first)
        assert admit_new(adder, second) == getattr(AddReqResult, verdict)
        assert adder.can_run_list == [first, second]
        assert req_extend_end(second) == end and adder.new_chunked_req is second
        assert adder.rem_chunk_tokens == 256 - 100 - (end - 0)
    assert floored in (None, [(156, 156)])


def test_ignore_eos_request_alone_rides_with_the_chunk_budget_moved_back(plugin):
    """Chunk 128, an ignore_eos request of 160 tokens alone: no earlier cut takes in its 32-token
    tail, so it rides (160 tokens). Stock's "last chunk" test reads rem_chunk_tokens itself, so the
    budget is raised by 32 for the stock call (_stock_with_chunk_budget) and lowered again after
    it: stock's charge of 160 stays, the budget ends at 128 - 160 and the batch is closed."""
    with adder_with(128, kv_tokens=4096, rules=True) as (new_adder, new_req):
        adder = new_adder()
        req = new_req(0, 160, ignore_eos=True)
        admit_new(adder, req)
        assert adder.can_run_list == [req] and req_extend_end(req) == 160 and adder.new_chunked_req is None
        assert adder.rem_chunk_tokens == 128 - 160


class PrefillDelayer:
    """Stands in for SGLang's prefill delayer (a collective across DP ranks): records each report."""

    def __init__(self):
        self.reports = 0

    def negotiate_should_allow_prefill(self, **kwargs):
        self.reports += 1
        return True


@pytest.mark.parametrize("rules, admitted, reports", [(True, 1, 1), (False, 2, 2)])
def test_ignore_eos_request_with_no_grid_cut_waits_without_reporting(plugin, rules, admitted, reports):
    """Chunk 256 less 200 admitted tokens leaves 56: no grid cut fits, so it waits (stock cuts 56),
    and it waits before stock reports the rank prefillable to the prefill delayer."""
    with adder_with(256, kv_tokens=8192, rules=rules) as (new_adder, new_req):
        adder = new_adder()
        adder.prefill_delayer_single_pass = delayer = PrefillDelayer()
        adder.running_batch = SimpleNamespace(batch_size=lambda: 0, reqs=[])  # nothing runs yet
        first, second = new_req(0, 200), new_req(1, 1000, ignore_eos=True)
        admit_new(adder, first)
        admit_new(adder, second)
        assert len(adder.can_run_list) == admitted and delayer.reports == reports


def mamba2_hybrid():
    """A Mamba2 hybrid's live backend: fa2 for attention, Mamba2's scan in 256-token chunks."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    return HybridLinearAttnBackend(standins.flashinfer_backend(), standins.mamba2_backend(256), [0])


@pytest.mark.parametrize("rules", [True, False])
def test_a_mamba2_hybrid_prefills_one_request_a_batch(plugin, rules):
    """Mamba2 chunks a prefill batch's packed tokens from the batch's first token, so a second
    request's chunks would start wherever the first ends: under the rules it waits for a batch of
    its own. Stock puts both in one batch."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    with adder_with(512, kv_tokens=4096, rules=rules, attn_backend=mamba2_hybrid) as (new_adder, new_req):
        adder = new_adder()
        first, second = new_req(0, 100), new_req(1, 100)
        admit_new(adder, first)
        waits = admit_new(adder, second) == AddReqResult.OTHER
        assert waits == rules and adder.can_run_list == ([first] if rules else [first, second])


def test_a_mamba2_hybrid_is_cut_on_its_kernel_chunks_and_continues_alone(plugin):
    """Chunk 512, a 530-token prompt: fa2's grid alone would cut at 384 (leaving the final 146
    tokens their full tile), the Mamba2 kernel chunks at 256. The continuation finishes alone too."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    with adder_with(512, kv_tokens=4096, rules=True, attn_backend=mamba2_hybrid) as (new_adder, new_req):
        adder = new_adder()
        first, second = new_req(0, 530), new_req(1, 100)
        admit_new(adder, first)
        assert req_extend_end(first) == 256 and admit_new(adder, second) == AddReqResult.OTHER
        continue_from(first, 256)
        adder = new_adder()
        assert adder.add_chunked_req(first) is None  # the last 274 tokens: it finishes
        assert admit_new(adder, second) == AddReqResult.OTHER and adder.can_run_list == [first]
    with adder_with(512, kv_tokens=4096, rules=True) as (new_adder, new_req):
        adder = new_adder()
        admit_new(adder, new_req(0, 530))
        assert req_extend_end(adder.can_run_list[0]) == 384


@pytest.mark.parametrize("chunk, refused", [(128, "at least 256"), (384, "Use --chunked-prefill-size 256 or 512"),
                                            (256, None), (512, None)])
def test_a_mamba2_hybrid_refuses_chunks_off_its_kernel_chunks(plugin, chunk, refused):
    """The scheduler's startup check over the hybrid's declared 256 tokens, as on the H200."""
    if refused is None:
        assert standins.scheduler_alignment(mamba2_hybrid, chunk=chunk) == 256
        return
    with pytest.raises(ValueError, match=refused):
        standins.scheduler_alignment(mamba2_hybrid, chunk=chunk)
