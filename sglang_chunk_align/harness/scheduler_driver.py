"""SGLang's scheduling loop, driven step by step on CPU over SGLang's real objects: the
harness the tests and the benchmarks share.

SGLang's own PrefillAdder, UnifiedRadixCache (the tree of the installed
release, disabled for radix off; a ChunkCache before 0.5.22), token/request
pools, ScheduleBatch and SchedulePolicy are driven the way
Scheduler.get_next_batch_to_run drives them (0.5.23's; the few calls older
releases with the grid rules spell differently are branched where they are
made). Stand-ins replace only what needs a GPU or a model: the model runner
(no forward pass: each step samples a fixed token), ModelConfig, and the
backend and Scheduler whose alignment steps run (standins.py). Every prefill
step's batch is recorded as (request, start, end) extends, with the fa2 calls
the backend runs it in (`calls`: one per tile class under split attention;
`pads`, beside them: the tokens of each call's padding member, 0 for none),
and radix hits are followed to the request that computed the reused KV (the
"donor"). The plugin's deferrals are counted by reason (`deferrals`, through
prefill_hooks.counting_deferrals: a request deferred in n steps counts n times).

What it takes is duck-typed, so that the package never imports the benchmarks:
a scheduling configuration (name, chunk, deterministic, split_tile_env, plugin,
rules, split_attention, pad_tiles: benchmarks.workload.SchedulingConfig), a workload's pool sizes
(kv_tokens, max_running_requests, max_prompt, max_output:
benchmarks.workload.WorkloadSpec) and requests (rid, arrival_step, output_len:
benchmarks.workload.RequestSpec). In the package, like standins.py, so the
tests reach it without the benchmarks; imported by the tests and benchmarks
only, never by plugin loading or the CLI. Imports SGLang only when called.
"""

import os
from contextlib import contextmanager
from types import SimpleNamespace

from .. import prefill_hooks, releases
from . import standins
from ..compat import req_extend_end, req_prefix_len, sglang_at_least
from ..decisions import tile_groups

# The stand-in model: its vocabulary, and the token it samples for request rid (OUTPUT_BASE + rid),
# unique per request and above every prompt token the workloads draw.
VOCAB_SIZE = 1 << 20
OUTPUT_BASE = 200_000


@contextmanager
def sglang_config(cfg, radix, page_size=1):
    """Publish real ServerArgs for `cfg`, with its env var and the plugin, and undo all of it."""
    env = {
        "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE": cfg.split_tile_env,
        "SGLANG_CHUNK_ALIGN_RULES": None if cfg.rules else 0,
        "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION": None if cfg.split_attention else 0,
        "SGLANG_CHUNK_ALIGN_PAD_TILES": 1 if cfg.pad_tiles else None,
    }
    saved_env = {name: os.environ.get(name) for name in env}
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    plugin = None
    if cfg.plugin:
        import sglang_chunk_align as plugin

        plugin.apply()
    try:
        with standins.published(
            cfg.deterministic, cfg.chunk, disable_radix_cache=not radix, page_size=page_size
        ) as server_args:
            yield server_args
    finally:
        if plugin is not None:
            plugin.remove()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def truncation_align_size(server_args, shape=None, page_size=1):
    """Run the Scheduler's own alignment steps (patched by the plugin when applied) on stand-ins,
    with a backend that plans prefill for `shape` (None: a backend that does not say)."""
    planned = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim) if shape else None
    backend = standins.flashinfer_backend(planned=planned)
    return standins.run_alignment_steps(standins.scheduler(server_args, backend, page_size=page_size))


def prefix_cache(radix, req_pool, allocator, page_size, chunk):
    """The prefix cache the scheduler builds for chunked prefill (mem_cache/registry.py): a
    UnifiedRadixCache, disabled for radix off; before 0.5.22, a ChunkCache for radix off."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=not radix, req_to_token_pool=req_pool, token_to_kv_pool_allocator=allocator,
        page_size=page_size, chunked_prefill_size=chunk, tree_components=(ComponentType.FULL,),
    )
    if not radix and not sglang_at_least(releases.UNIFIED_PREFIX_CACHE):
        from sglang.srt.mem_cache.chunk_cache import ChunkCache

        return ChunkCache(params)
    return UnifiedRadixCache(params)


class CutShort(RuntimeError):
    """SGLang's PrefillAdder admitted a request with part of its prompt and did not make it the chunked
    request: the scheduler would take its partial prefill as finished. Stock's own adder does so for some
    inputs (an ignore_eos request's admission beside a continuation, with an alignment set; found by
    tests/test_stock_where_unarmed.py), so it is an outcome to compare, not a fault of the driver."""


class SchedulerDriver:
    """SGLang's scheduling loop, step by step, over real SGLang objects.

    Mirrors Scheduler.get_next_batch_to_run / _get_new_batch_prefill_raw /
    update_running_batch and the batch-result processors, without overlap,
    mixed chunks, priorities or LoRA (all off by default). Decode runs when
    no prefill batch forms, as in SGLang; a decode step only grows KV.
    """

    def __init__(self, spec, cfg, radix, align, page_size=1):
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.cfg, self.align, self.page_size = cfg, align, page_size
        self.chunk = get_schedule().chunked_prefill_size
        self.max_prefill_tokens = get_schedule().max_prefill_tokens
        self.max_running = spec.max_running_requests
        # KV holds one 1x1 head: the scheduler reads indices, never values.
        kv = MHATokenToKVPool(spec.kv_tokens, page_size, torch.bfloat16, 1, 1, 1, "cpu", False)
        if page_size == 1:
            self.allocator = TokenToKVPoolAllocator(spec.kv_tokens, torch.bfloat16, "cpu", kv, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(
                spec.kv_tokens, page_size, torch.bfloat16, "cpu", kv, need_sort=False
            )
        self.req_pool = ReqToTokenPool(spec.max_running_requests, spec.max_prompt + spec.max_output + 8, "cpu", False)
        self.tree = prefix_cache(radix, self.req_pool, self.allocator, page_size, self.chunk)
        self.policy = SchedulePolicy(get_schedule().schedule_policy, self.tree, False, False, False)
        self.ratio = NewTokenRatioTracker.from_config()
        # Stand-in for ModelConfig (needs model files): the batch reads these two fields.
        self.model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, is_encoder_decoder=False)
        self.new_batch = lambda reqs, chunked=None: ScheduleBatch.init_new(
            reqs, self.req_pool, self.allocator, self.tree, self.model_config, False,
            SpeculativeAlgorithm.NONE, chunked_req=chunked,
        )
        self.running = self.new_batch([])
        self.waiting, self.chunked_req, self.last_prefill = [], None, None
        # Which request computed the KV in each slot, and at which position.
        self.slot_rid = torch.full((spec.kv_tokens + page_size,), -1, dtype=torch.int64)
        self.slot_pos = torch.full((spec.kv_tokens + page_size,), -1, dtype=torch.int64)
        self.steps, self.calls, self.pads, self.donors = [], [], [], {}
        self.extended_to = {}  # rid -> end of its last extend while it holds its KV row
        self.stats = dict(prefill_steps=0, decode_steps=0, retracted=0, aborted=[], radix_hit_tokens=0, deferrals={})

    def make_req(self, request, tokens):
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=request.output_len)
        params.normalize(None)
        req = Req(str(request.rid), "", array("q", tokens), params, vocab_size=VOCAB_SIZE)
        req.spec = request
        return req

    def run(self, arrivals):
        with prefill_hooks.counting_deferrals(self.stats["deferrals"]):
            return self._run(arrivals)

    def _run(self, arrivals):
        pending = sorted(arrivals, key=lambda pair: pair[0].arrival_step)
        step = 0
        while True:
            while pending and pending[0][0].arrival_step <= step:
                request, tokens = pending.pop(0)
                self.waiting.append(self.make_req(request, tokens))
            self.merge_last_prefill()
            batch = self.get_new_batch_prefill()
            if batch is not None:
                self.run_prefill(batch)
            elif not self.running.is_empty():
                self.run_decode()
            elif pending:
                step = pending[0][0].arrival_step
                continue
            elif self.waiting or self.chunked_req:
                raise RuntimeError(f"{self.cfg.name}: no progress with {len(self.waiting)} waiting")
            else:
                break
            step += 1
        return dict(steps=self.steps, calls=self.calls, pads=self.pads, donors=self.donors, **self.stats)

    def merge_last_prefill(self):
        """get_next_batch_to_run's head: stash the chunked request, merge the last prefill."""
        chunked = self.chunked_req
        if chunked is not None and req_extend_end(chunked) > req_prefix_len(chunked):
            checkpoint_kv(chunked, self.tree, stash=True)
        last, self.last_prefill = self.last_prefill, None
        if last is not None:
            size = last.batch_size()
            last.filter_batch([chunked] if chunked is not None else [])  # renamed keyword in 0.5.22
            if last.batch_size() < size:
                self.running.batch_is_full = False
            if not last.is_empty():
                if self.running.is_empty():
                    self.running = last
                else:
                    self.running.merge_batch(last)
        size = self.running.batch_size()
        self.running.filter_batch()
        if self.running.batch_size() < size:
            self.running.batch_is_full = False

    def allocatable(self, num_held_rows=0):
        """Scheduler.get_num_allocatable_reqs for pp_size 1 and no beams."""
        return min(self.max_running - self.running.batch_size(), self.req_pool.available_size() + num_held_rows)

    def get_new_batch_prefill(self):
        """Scheduler._get_new_batch_prefill_raw, for this driver's feature set."""
        from sglang.srt.managers.schedule_policy import AddReqResult

        running = self.running
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        if self.allocatable() <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        adder = self.new_adder()
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            if hasattr(self.policy, "shortest_prefill_chunk_limit"):  # 0.5.21+
                adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
                    self.chunked_req, self.waiting, adder.rem_chunk_tokens or 0, 1
                )
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        for req in self.waiting:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            held = sum(r.kv.holds_kv for r in adder.can_run_list)
            if len(adder.can_run_list) >= self.allocatable(held):
                running.batch_is_full = True
            if running.batch_is_full:
                break
            req.init_next_round_input(self.tree)
            result = adder.add_one_req(
                req, has_chunked_req=self.chunked_req is not None, truncation_align_size=self.align
            )
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = bool(adder.can_run_list) or not running.is_empty()
                break
        can_run = adder.can_run_list
        if not can_run:
            return None
        self.waiting = [r for r in self.waiting if r not in set(can_run)]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        cut_short = [r.rid for r in can_run
                     if r is not self.chunked_req and req_extend_end(r) < len(r.full_untruncated_fill_ids)]
        if cut_short:
            raise CutShort(
                f"{self.cfg.name}: PrefillAdder cut requests {cut_short} short without making them "
                f"the chunked request, so SGLang would treat their partial prefill as finished"
            )
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = self.new_batch(can_run, self.chunked_req)
        batch.prepare_for_extend()
        return batch

    def new_adder(self):
        """A PrefillAdder as Scheduler._get_new_batch_prefill_raw builds one for this step."""
        from sglang.srt.managers.schedule_policy import PrefillAdder

        return PrefillAdder(
            self.page_size, self.tree, self.allocator, self.running, self.ratio.current, self.max_prefill_tokens,
            self.chunk, 0, 0, max_prefill_bs=0, max_running_requests=self.max_running,
            waiting_queue_len=len(self.waiting),
        )

    def run_prefill(self, batch):
        """Record the batch, then Scheduler.process_batch_result_prefill with a stand-in sample."""
        import torch

        entries = []
        for req in batch.reqs:
            rid = req.spec.rid
            row = self.req_pool.req_to_token[req.kv.req_pool_idx]
            start, end = req_prefix_len(req), req_extend_end(req)
            if start > 0 and self.extended_to.get(rid) != start:  # not a continuation: a radix hit
                self.record_donors(rid, row[:start].long())
            self.extended_to[rid] = end
            slots = row[start:end].long()
            self.slot_rid[slots] = rid
            self.slot_pos[slots] = torch.arange(start, end)
            entries.append((rid, start, end))
        self.steps.append(entries)
        for call, pad in fa2_calls(entries):
            self.calls.append(call)
            self.pads.append(pad)
        self.stats["prefill_steps"] += 1
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1  # a middle chunk: no output yet
                continue
            req.output_ids.append(OUTPUT_BASE + req.spec.rid)
            req.update_finish_state()
            if req.finished():
                release_kv(req, self.tree)
            else:
                checkpoint_kv(req, self.tree)
        self.last_prefill = batch

    def record_donors(self, rid, slots):
        """Runs of (donor rid, start, end): who computed each cached position this request reuses."""
        import torch

        owners, positions = self.slot_rid[slots], self.slot_pos[slots]
        if not torch.equal(positions, torch.arange(len(slots))) or bool((owners < 0).any()):
            raise RuntimeError(f"request {rid}: radix hit does not map to computed positions")
        runs, start = [], 0
        for pos in range(1, len(owners) + 1):
            if pos == len(owners) or owners[pos] != owners[start]:
                runs.append((int(owners[start]), start, pos))
                start = pos
        self.donors.setdefault(rid, []).extend(runs)
        self.stats["radix_hit_tokens"] += len(owners)

    def run_decode(self):
        """Scheduler.update_running_batch plus process_batch_result_decode."""
        running = self.running
        if not running.check_decode_mem():
            retracted, self.ratio.current, aborted = running.retract_decode()
            self.stats["retracted"] += len(retracted)
            for req in retracted:
                self.extended_to.pop(req.spec.rid)
            self.stats["aborted"].extend(r.spec.rid for r in aborted)
            self.waiting.extend(retracted)
            running.batch_is_full = False
            if running.is_empty():
                return
        else:
            self.ratio.decay_step()
        running.prepare_for_decode()
        self.stats["decode_steps"] += 1
        for req, slot in zip(running.reqs, running.out_cache_loc.tolist()):
            self.slot_rid[slot] = req.spec.rid
            self.slot_pos[slot] = req.kv.kv_allocated_len - 1
            req.output_ids.append(OUTPUT_BASE + req.spec.rid)
            req.update_finish_state()
            if req.finished():
                release_kv(req, self.tree)


def fa2_calls(entries):
    """A prefill step's (rid, start, end) extends as the fa2 calls the backend runs them in, each
    with its padding member's tokens (0: none): one call per tile class where the rules in force
    split attention (split_attention.plan_by_tile), padded where they pad; else one."""
    rules = prefill_hooks.rules_in_force()
    split = rules is not None and rules.split_attention and tile_groups(
        rules, [end - start for _, start, end in entries], [end for _, _, end in entries])
    if not split:
        return [(entries, 0)]
    return [([entries[i] for i in group], pad) for group, pad in zip(split.groups, split.pads)]


def checkpoint_kv(req, tree, stash=False):
    """The scheduler hands an unfinished request's KV to the tree (`stash`: a chunked request
    between its chunks). Releases before 0.5.22 call this maybe_cache_unfinished_req."""
    from sglang.srt.mem_cache import common

    if hasattr(common, "checkpoint_kv_cache"):
        common.checkpoint_kv_cache(req, tree)
    else:
        common.maybe_cache_unfinished_req(req, tree, chunked=stash)


def release_kv(req, tree):
    """A finished request gives its KV row back, the tree keeping what it takes
    (release_kv_cache; its `checkpoint` flag came with 0.5.22)."""
    from sglang.srt.mem_cache import common

    if hasattr(common, "checkpoint_kv_cache"):
        common.release_kv_cache(req, tree, checkpoint=True)
    else:
        common.release_kv_cache(req, tree)
