"""Replay benchmark: what fraction of requests get bit-exact attention under a real scheduler.

Why: deterministic flashinfer prefill is only worth having if a request's
attention output does not depend on how the scheduler happened to cut and
co-batch it. The kernel probes (shared/evidence) test hand-picked chunkings;
this benchmark asks the question for a whole mixed workload: for every
request, is every attention row it computes bit-for-bit equal (torch.equal)
to the row it gets when prefilled alone and unchunked?

It runs in two phases because SGLang and the GPU live on different machines:

1. ``schedule`` (CPU, needs the SGLang 0.5.23 wheel). A seeded workload is
   scheduled by SGLang's own PrefillAdder, UnifiedRadixCache (the 0.5.23
   tree, disabled for radix off), token/request pools, ScheduleBatch and
   SchedulePolicy, driven step by step the way Scheduler.get_next_batch_to_run
   drives them. Stand-ins replace only what needs a GPU or a model: the model
   runner (no forward pass: each step samples a fixed token), ModelConfig,
   and the backend/Scheduler instances whose alignment steps run. Every
   prefill step's batch is recorded as (request, start, end) extends. The same command prints schedule statistics and the hazards
   predicted from fa2's tile rule; on a small workload this is the CPU-only
   mode that CI runs.
2. ``replay`` (GPU, needs CUDA and flashinfer). Every recorded batch runs
   through flashinfer's fa2 paged prefill exactly as SGLang's deterministic
   backend plans it (page size 1, bf16, fixed split from
   SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, causal), with seeded Q/K/V that
   are identical in every configuration, and each request's rows are compared
   with its solo unchunked reference.

Radix-cache hits are followed through the tree: the cached KV a request
reuses was computed by another request (the "donor"), so a request counts as
exact only if its donors computed those positions exactly too.
"""

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Optional

# ---------------------------------------------------------------------------
# Workload. Fixed before any result was seen (issue 5): do not tune it.
# ---------------------------------------------------------------------------

WORKLOAD_SEED = 20261129


@dataclass(frozen=True)
class WorkloadSpec:
    n_requests: int
    max_prompt: int  # prompt lengths are log-uniform in [1, max_prompt]
    n_prefix_groups: int  # shared prefixes, so radix hits land at arbitrary positions
    shared_fraction: float  # probability that a request starts with a group prefix
    max_output: int  # decode lengths are log-uniform in [1, max_output]
    n_waves: int  # requests arrive in waves, so chunks co-batch with short extends
    wave_gap_steps: int  # scheduler steps between waves
    kv_tokens: int  # KV pool size: the cap on KV memory
    max_running_requests: int


FULL_WORKLOAD = WorkloadSpec(
    n_requests=240, max_prompt=8192, n_prefix_groups=12, shared_fraction=0.6,
    max_output=128, n_waves=10, wave_gap_steps=64, kv_tokens=32768, max_running_requests=128,
)
# The CI workload: same generator, small enough for a unit test.
SMALL_WORKLOAD = WorkloadSpec(
    n_requests=40, max_prompt=2048, n_prefix_groups=4, shared_fraction=0.6,
    max_output=16, n_waves=4, wave_gap_steps=16, kv_tokens=8192, max_running_requests=32,
)
UNCAPPED_KV_TOKENS = 1 << 20

# Token ids: group prefixes and random suffixes draw from [RANDOM_TOKEN_LOW,
# MARKER_BASE); each request's first own token is a unique marker, so a radix
# match never runs past the shared prefix; output tokens are unique per request.
RANDOM_TOKEN_LOW = 1000
MARKER_BASE = 100_000
OUTPUT_BASE = 200_000
VOCAB_SIZE = 1 << 20


@dataclass(frozen=True)
class RequestSpec:
    rid: int
    arrival_step: int
    prompt_len: int
    group: int  # -1: no shared prefix
    shared_len: int  # tokens [0, shared_len) are the group's prefix
    output_len: int


def log_uniform_int(rng, low, high):
    return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


def make_workload(spec: WorkloadSpec, seed: int = WORKLOAD_SEED):
    """(requests, group prefix lengths); deterministic in (spec, seed)."""
    rng = random.Random(seed)
    group_lens = [log_uniform_int(rng, 32, spec.max_prompt // 2) for _ in range(spec.n_prefix_groups)]
    per_wave = math.ceil(spec.n_requests / spec.n_waves)
    requests = []
    for rid in range(spec.n_requests):
        prompt_len = log_uniform_int(rng, 1, spec.max_prompt)
        group = rng.randrange(spec.n_prefix_groups) if rng.random() < spec.shared_fraction else -1
        shared_len = min(group_lens[group], prompt_len - 1) if group >= 0 else 0
        requests.append(RequestSpec(
            rid=rid,
            arrival_step=(rid // per_wave) * spec.wave_gap_steps,
            prompt_len=prompt_len,
            group=group,
            shared_len=shared_len,
            output_len=log_uniform_int(rng, 1, spec.max_output),
        ))
    return requests, group_lens


def prompt_tokens(request: RequestSpec, group_tokens):
    rng = random.Random(f"{WORKLOAD_SEED}/request/{request.rid}")
    own = request.prompt_len - request.shared_len
    tail = [rng.randrange(RANDOM_TOKEN_LOW, MARKER_BASE) for _ in range(own - 1)]
    shared = group_tokens[request.group][: request.shared_len] if request.group >= 0 else []
    return shared + [MARKER_BASE + request.rid] + tail


def group_token_lists(group_lens):
    rng = random.Random(f"{WORKLOAD_SEED}/groups")
    return [[rng.randrange(RANDOM_TOKEN_LOW, MARKER_BASE) for _ in range(n)] for n in group_lens]


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------

SGLANG_DEFAULT_SPLIT_TILE = 4096  # SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE default


@dataclass(frozen=True)
class SchedulingConfig:
    name: str
    chunk: int  # --chunked-prefill-size
    deterministic: bool = True  # --enable-deterministic-inference
    split_tile_env: Optional[int] = None  # SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, None: default
    plugin: bool = False  # sglang_chunk_align.apply() before scheduling
    rules: bool = True  # with the plugin: its grid rules (SGLANG_CHUNK_ALIGN_RULES=0 turns them off)

    @property
    def fixed_split(self):
        """The fixed_split_size SGLang's flashinfer backend plans prefill with."""
        if not self.deterministic:
            return None
        return self.split_tile_env or SGLANG_DEFAULT_SPLIT_TILE


CONFIGS = (
    # Stock: alignment = split tile = 4096, so the chunk must be >= 4096.
    SchedulingConfig("stock-4096", 4096),
    # What stock SGLang offers for 128-token alignment: lower the split tile to
    # 128, which makes truncation_align_size 128 (length flooring) and also
    # plans the kernel with a 128-token fixed split.
    SchedulingConfig("stock-split-128", 256, split_tile_env=128),
    # Upstream's design: the backend declares 128 and SGLang floors chunk
    # lengths to it; the split tile stays 4096. The plugin with its rules off.
    SchedulingConfig("upstream-128", 256, plugin=True, rules=False),
    *(SchedulingConfig(f"plugin-{chunk}", chunk, plugin=True) for chunk in (128, 256, 512, 1024)),
    # Non-deterministic baseline, for scale: no fixed split.
    SchedulingConfig("nondeterministic", 4096, deterministic=False),
)


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self):
        return self.num_qo_heads // self.num_kv_heads


SHAPES = (
    ModelShape("g4-d128", 32, 8, 128),
    ModelShape("g8-d128", 32, 4, 128),
    ModelShape("g2-d256", 16, 8, 256),
)

# ---------------------------------------------------------------------------
# Phase 1: scheduling with SGLang's real PrefillAdder (CPU)
# ---------------------------------------------------------------------------

# Scheduler.__init__ runs these in this order to settle truncation_align_size.
ALIGNMENT_STEPS = (
    "init_deterministic_inference_config",
    "init_dsa_kpool_truncation_align",
    "init_mamba_truncation_align",
    "check_truncation_align_fits_chunk",
)


@contextmanager
def sglang_config(cfg: SchedulingConfig, radix: bool):
    """Publish real ServerArgs for `cfg`, with its env var and the plugin, and undo all of it."""
    from sglang.test.test_utils import published_topology

    env = {
        "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE": cfg.split_tile_env,
        "SGLANG_CHUNK_ALIGN_RULES": None if cfg.rules else 0,
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
        with published_topology(
            enable_deterministic_inference=cfg.deterministic,
            attention_backend="flashinfer",
            chunked_prefill_size=cfg.chunk,
            disable_radix_cache=not radix,
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


def truncation_align_size(server_args, cfg: SchedulingConfig):
    """Run the Scheduler's own alignment steps (patched by the plugin when applied).

    Stand-ins: Scheduler.__init__ loads a model, and a live FlashInferAttnBackend
    allocates CUDA buffers, so both are built without __init__ and given the
    state their __init__ derives from the published config.
    """
    import transformers
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_schedule

    backend = FlashInferAttnBackend.__new__(FlashInferAttnBackend)
    backend.enable_deterministic = cfg.deterministic
    backend.prefill_backend = "fa2"
    backend.skip_prefill = False
    backend.prefill_split_tile_size = cfg.fixed_split
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.server_args = server_args
    scheduler.chunked_prefill_size = get_schedule().chunked_prefill_size
    scheduler.model_config = SimpleNamespace(hf_config=transformers.LlamaConfig())
    scheduler.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    scheduler.disaggregation_mode = DisaggregationMode.NULL
    for step in ALIGNMENT_STEPS:
        getattr(scheduler, step)()
    return scheduler.truncation_align_size


class SchedulerDriver:
    """SGLang's scheduling loop, step by step, over real SGLang objects.

    Mirrors Scheduler.get_next_batch_to_run / _get_new_batch_prefill_raw /
    update_running_batch and the batch-result processors, without overlap,
    mixed chunks, priorities or LoRA (all off by default). Decode runs when
    no prefill batch forms, as in SGLang; a decode step only grows KV.
    """

    def __init__(self, spec: WorkloadSpec, cfg: SchedulingConfig, radix: bool, align):
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.schedule_policy import SchedulePolicy
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_schedule
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.cfg, self.align = cfg, align
        self.chunk = get_schedule().chunked_prefill_size
        self.max_prefill_tokens = get_schedule().max_prefill_tokens
        self.max_running = spec.max_running_requests
        # KV holds one 1x1 head: the scheduler reads indices, never values.
        kv = MHATokenToKVPool(spec.kv_tokens, 1, torch.bfloat16, 1, 1, 1, "cpu", False)
        self.allocator = TokenToKVPoolAllocator(spec.kv_tokens, torch.bfloat16, "cpu", kv, need_sort=False)
        self.req_pool = ReqToTokenPool(spec.max_running_requests, spec.max_prompt + spec.max_output + 8, "cpu", False)
        self.tree = UnifiedRadixCache(CacheInitParams(
            disable=not radix,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
            chunked_prefill_size=self.chunk,
            tree_components=(ComponentType.FULL,),
        ))
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
        self.slot_rid = torch.full((spec.kv_tokens + 1,), -1, dtype=torch.int64)
        self.slot_pos = torch.full((spec.kv_tokens + 1,), -1, dtype=torch.int64)
        self.steps, self.donors = [], {}
        self.extended_to = {}  # rid -> end of its last extend while it holds its KV row
        self.stats = dict(prefill_steps=0, decode_steps=0, retracted=0, aborted=[], radix_hit_tokens=0)

    def make_req(self, request: RequestSpec, tokens):
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=request.output_len)
        params.normalize(None)
        req = Req(str(request.rid), "", array("q", tokens), params, vocab_size=VOCAB_SIZE)
        req.spec = request
        return req

    def run(self, arrivals):
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
        return dict(steps=self.steps, donors=self.donors, **self.stats)

    def merge_last_prefill(self):
        """get_next_batch_to_run's head: stash the chunked request, merge the last prefill."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        chunked = self.chunked_req
        if chunked is not None and chunked.extend_end > chunked.prefix_len:
            checkpoint_kv_cache(chunked, self.tree)
        last, self.last_prefill = self.last_prefill, None
        if last is not None:
            size = last.batch_size()
            last.filter_batch(reqs_to_exclude=[chunked] if chunked is not None else [])
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
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        running = self.running
        if running.is_empty():
            running.batch_is_full = False
        if (running.batch_is_full or not self.waiting) and self.chunked_req is None:
            return None
        if self.allocatable() <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None
        self.policy.calc_priority(self.waiting, running)
        adder = PrefillAdder(
            1, self.tree, self.allocator, running, self.ratio.current, self.max_prefill_tokens,
            self.chunk, 0, 0, max_prefill_bs=0, max_running_requests=self.max_running,
            waiting_queue_len=len(self.waiting),
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
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
                     if r is not self.chunked_req and r.extend_end < len(r.full_untruncated_fill_ids)]
        if cut_short:
            raise RuntimeError(
                f"{self.cfg.name}: PrefillAdder cut requests {cut_short} short without making them "
                f"the chunked request, so SGLang would treat their partial prefill as finished"
            )
        if self.chunked_req is not None:
            self.chunked_req.inflight_middle_chunks += 1
        batch = self.new_batch(can_run, self.chunked_req)
        batch.prepare_for_extend()
        return batch

    def run_prefill(self, batch):
        """Record the batch, then Scheduler.process_batch_result_prefill with a stand-in sample."""
        import torch

        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        entries = []
        for req in batch.reqs:
            rid = req.spec.rid
            row = self.req_pool.req_to_token[req.kv.req_pool_idx]
            start, end = req.prefix_len, req.extend_end
            if start > 0 and self.extended_to.get(rid) != start:  # not a continuation: a radix hit
                self.record_donors(rid, row[:start].long())
            self.extended_to[rid] = end
            slots = row[start:end].long()
            self.slot_rid[slots] = rid
            self.slot_pos[slots] = torch.arange(start, end)
            entries.append((rid, start, end))
        self.steps.append(entries)
        self.stats["prefill_steps"] += 1
        for req in batch.reqs:
            if req.inflight_middle_chunks > 0:
                req.inflight_middle_chunks -= 1  # a middle chunk: no output yet
                continue
            req.output_ids.append(OUTPUT_BASE + req.spec.rid)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=True)
            else:
                checkpoint_kv_cache(req, self.tree)
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
        from sglang.srt.mem_cache.common import release_kv_cache

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
                release_kv_cache(req, self.tree, checkpoint=True)


def schedule_workload(spec: WorkloadSpec, configs=CONFIGS, radix_modes=(False, True)):
    """Schedule the workload under every configuration; the schedule document."""
    from importlib import metadata

    requests, group_lens = make_workload(spec)
    groups = group_token_lists(group_lens)
    arrivals = [(request, prompt_tokens(request, groups)) for request in requests]
    schedules = []
    for radix in radix_modes:
        for cfg in configs:
            with sglang_config(cfg, radix) as server_args:
                align = truncation_align_size(server_args, cfg)
                result = SchedulerDriver(spec, cfg, radix, align).run(arrivals)
            schedules.append(dict(
                config=cfg.name, radix=radix, chunk=cfg.chunk, fixed_split=cfg.fixed_split,
                truncation_align_size=align, plugin=cfg.plugin, **result,
            ))
    return dict(
        meta=dict(sglang=metadata.version("sglang"), seed=WORKLOAD_SEED, workload=asdict(spec),
                  checkout=checkout_state()),
        requests=[asdict(request) for request in requests],
        group_lens=group_lens,
        schedules=schedules,
    )


def checkout_state():
    """The commit the plugin rows were scheduled with, and whether its package had local edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()

    return dict(commit=git("rev-parse", "HEAD") or None,
                plugin_modified=bool(git("status", "--porcelain", "sglang_chunk_align")))


def load_requests(doc):
    return {r["rid"]: RequestSpec(**r) for r in doc["requests"]}


def donor_runs(schedule):
    """rid -> [(donor rid, start, end)]; JSON turns the rid keys into strings."""
    return {int(rid): [tuple(run) for run in runs] for rid, runs in schedule["donors"].items()}


# ---------------------------------------------------------------------------
# Schedule statistics and predicted hazards (pure Python, from the document)
# ---------------------------------------------------------------------------

GRID_TOKENS = 128  # fa2's 128-row q-tile is 128 tokens or fewer for every GQA group
SHORT_KV_TOKENS = 32  # rows whose causal KV is this short matched their solo rows in every probe


def schedule_stats(schedule, requests):
    entries = [tuple(e) for step in schedule["steps"] for e in step]
    extends_per_req = {}
    for rid, _, _ in entries:
        extends_per_req[rid] = extends_per_req.get(rid, 0) + 1
    return dict(
        prefill_steps=schedule["prefill_steps"],
        decode_steps=schedule["decode_steps"],
        extends=len(entries),
        mean_batch=round(len(entries) / max(1, schedule["prefill_steps"]), 2),
        chunked_requests=sum(n > 1 for n in extends_per_req.values()),
        starts_off_128=sum(s % GRID_TOKENS != 0 for _, s, _ in entries),
        short_cuts=sum(e < requests[rid].prompt_len and e - s < schedule["chunk"] for rid, s, e in entries),
        radix_hit_tokens=schedule["radix_hit_tokens"],
        retracted=schedule["retracted"],
        aborted=len(schedule["aborted"]),
    )


def cta_tile_q(avg_packed_qo_len, head_dim):
    """flashinfer 0.7.2 FA2DetermineCtaTileQ for head_dim < 512 on sm80+."""
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16


def predict_hazards(schedule, requests, shape: ModelShape):
    """rid -> sorted hazards: tile (batch tile != solo tile), off-grid (start off the solo q-tile
    grid), donor (a hazard in the rows that computed the KV it reuses).

    A hazard covers the rows of its extend whose causal KV is longer than
    SHORT_KV_TOKENS and that lie in the prompt (re-prefilled outputs are not
    compared). None when the configuration has no fixed split: its KV split
    follows the batch.
    """
    if schedule["fixed_split"] is None:
        return None
    g, d = shape.group, shape.head_dim
    solo_tile = {rid: cta_tile_q(r.prompt_len * g, d) for rid, r in requests.items()}
    spans = {rid: [] for rid in requests}  # rid -> [(first row, end row, hazards)]
    for step in schedule["steps"]:
        tile = cta_tile_q(sum((e - s) * g for _, s, e in step) // len(step), d)
        for rid, s, e in step:
            rows = (max(s, SHORT_KV_TOKENS), min(e, requests[rid].prompt_len))
            found = {"tile"} if tile != solo_tile[rid] else set()
            if s * g % solo_tile[rid]:
                found.add("off-grid")
            if found and rows[0] < rows[1]:
                spans[rid].append((*rows, found))
    hazards = {rid: set().union(*(h for _, _, h in own)) for rid, own in spans.items()}
    for rid, runs in donor_runs(schedule).items():
        if any(lo < b and a < hi for donor, a, b in runs for lo, hi, _ in spans[donor]):
            hazards[rid].add("donor")
    return {rid: sorted(h) for rid, h in hazards.items()}


def prediction_summary(hazards):
    if hazards is None:
        return dict(predicted_exact_pct=None)
    n = len(hazards)
    return dict(
        predicted_exact_pct=round(100 * sum(not h for h in hazards.values()) / n, 1),
        tile=sum("tile" in h for h in hazards.values()),
        off_grid=sum("off-grid" in h for h in hazards.values()),
        donor=sum("donor" in h for h in hazards.values()),
    )


# ---------------------------------------------------------------------------
# Phase 2: replay on the GPU
# ---------------------------------------------------------------------------

WORKSPACE_BYTES = 12 << 30  # an unchunked 8k prompt at split 128 keeps ~9 GiB of partials


class Fa2PagedPrefill:
    """flashinfer fa2 paged prefill, planned the way SGLang's deterministic flashinfer backend plans it."""

    def __init__(self, shape: ModelShape, device="cuda"):
        import flashinfer
        import torch

        self.shape = shape
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self.plan_calls, self.plan_s, self.events = 0, 0.0, []

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, fixed_split):
        import torch

        shape = self.shape
        # plan() refills a pinned host buffer whose copy to the GPU the previous
        # step may not have made yet. SGLang reads each step's sampled tokens
        # before it plans the next, so the replay waits for the GPU here too.
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.wrapper.plan(
            qo_indptr, kv_indptr, kv_indices,
            torch.ones(len(qo_indptr) - 1, dtype=torch.int32),  # page size 1: every last page is full
            shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 1,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, fixed_split_size=fixed_split,
        )
        self.plan_s += time.perf_counter() - start
        self.plan_calls += 1
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.wrapper.forward(q, (k_cache, v_cache), causal=True, sm_scale=shape.head_dim**-0.5)
        end.record()
        self.events.append((begin, end))
        return out

    def take_timing(self):
        """(plan calls, plan ms, kernel ms) since the last call."""
        import torch

        torch.cuda.synchronize()
        kernel_ms = sum(b.elapsed_time(e) for b, e in self.events)
        timing = (self.plan_calls, self.plan_s * 1e3, kernel_ms)
        self.plan_calls, self.plan_s, self.events = 0, 0.0, []
        return timing


class Content:
    """Seeded Q/K/V for every request position, identical in every configuration.

    A position's values are a function of the tokens up to it: rows of a shared
    prefix come from the group's generator, a request's own rows from its own.
    Each request gets room for its prompt plus its outputs (a retracted request
    re-prefills both).
    """

    def __init__(self, requests, group_lens, shape: ModelShape, device):
        import torch

        self.device = device
        self.offset, total = {}, 0
        for rid in sorted(requests):
            self.offset[rid] = total
            total += requests[rid].prompt_len + requests[rid].output_len
        self.q = torch.empty(total, shape.num_qo_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
        self.k = torch.empty(total, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
        self.v = torch.empty_like(self.k)
        groups = [self._rows(shape, n, f"group/{g}") for g, n in enumerate(group_lens)]
        for rid, r in requests.items():
            start, length = self.offset[rid], r.prompt_len + r.output_len
            own = self._rows(shape, length - r.shared_len, f"request/{rid}")
            for i, buf in enumerate((self.q, self.k, self.v)):
                if r.shared_len:
                    buf[start : start + r.shared_len] = groups[r.group][i][: r.shared_len]
                buf[start + r.shared_len : start + length] = own[i]
        # Paged NHD layout, page size 1: page i is position row i.
        self.k_cache = self.k.view(total, 1, shape.num_kv_heads, shape.head_dim)
        self.v_cache = self.v.view(total, 1, shape.num_kv_heads, shape.head_dim)

    def _rows(self, shape, n, name):
        import torch

        gen = torch.Generator(device=self.device).manual_seed(_seed(f"{shape.name}/{name}"))
        heads = (shape.num_qo_heads, shape.num_kv_heads, shape.num_kv_heads)
        return [
            torch.randn(n, h, shape.head_dim, generator=gen, device=self.device).to(torch.bfloat16)
            for h in heads
        ]


def _seed(name):
    return int(hashlib.sha256(f"{WORKLOAD_SEED}/{name}".encode()).hexdigest()[:15], 16)


def run_batches(content: Content, kernel, batches, fixed_split):
    """Run each batch of (rid, start, end) extends; out rows land at the request's positions."""
    import torch

    out = torch.zeros_like(content.q)
    dev = content.device
    offset = content.offset
    for entries in batches:
        q_rows = torch.cat([torch.arange(offset[r] + s, offset[r] + e, device=dev) for r, s, e in entries])
        kv_indices = torch.cat([torch.arange(offset[r], offset[r] + e, device=dev) for r, _, e in entries])
        qo_indptr = torch.tensor([0] + [e - s for _, s, e in entries], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv_indptr = torch.tensor([0] + [e for _, _, e in entries], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out[q_rows] = kernel(
            content.q[q_rows], content.k_cache, content.v_cache,
            qo_indptr, kv_indptr, kv_indices.to(torch.int32), fixed_split,
        )
    return out


def compare(content: Content, out, ref, schedule, requests):
    """Per request: own rows vs its solo rows, and reused (radix) rows vs what their donor computed."""
    import torch

    computed = {rid: [] for rid in requests}
    for step in schedule["steps"]:
        for rid, s, e in step:
            if s < requests[rid].prompt_len:
                computed[rid].append((s, min(e, requests[rid].prompt_len)))
    donors = donor_runs(schedule)
    aborted = set(schedule["aborted"])
    per_request = {}
    for rid, r in requests.items():
        base = content.offset[rid]
        got, want = out[base : base + r.prompt_len], ref[base : base + r.prompt_len]
        own_rows = torch.zeros(r.prompt_len, dtype=torch.bool)
        for s, e in computed[rid]:
            own_rows[s:e] = True
        own_bad = own_rows & ~(got == want).flatten(1).all(1).cpu()
        covered = own_rows.clone()
        diff = _max_abs(got[own_bad.to(got.device)], want[own_bad.to(got.device)])
        inherited, inherited_bad = 0, 0
        for donor, a, b in donors.get(rid, []):
            theirs = out[content.offset[donor] + a : content.offset[donor] + b]
            mine = want[a:b]
            bad = ~(theirs == mine).flatten(1).all(1)
            inherited += b - a
            inherited_bad += int(bad.sum())
            diff = max(diff, _max_abs(theirs[bad], mine[bad]))
            covered[a:b] = True
        if rid not in aborted and not bool(covered.all()):
            raise RuntimeError(f"{schedule['config']}: request {rid} rows {int((~covered).sum())} never computed")
        per_request[rid] = dict(
            own_rows=int(own_rows.sum()), own_bad=int(own_bad.sum()),
            inherited_rows=inherited, inherited_bad=inherited_bad, max_abs=diff,
            exact=rid not in aborted and not bool(own_bad.any()) and inherited_bad == 0,
        )
    return per_request


def _max_abs(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def replay(doc, shapes=SHAPES, device="cuda", make_kernel=Fa2PagedPrefill):
    """Measure every schedule in `doc` on every model shape; a list of result rows."""
    requests = load_requests(doc)
    rows = []
    for shape in shapes:
        content = Content(requests, doc["group_lens"], shape, device)
        kernel = make_kernel(shape, device)
        solo = {}
        for schedule in doc["schedules"]:
            split = schedule["fixed_split"]
            if split not in solo:  # each request alone and unchunked, same fixed split
                alone = [[(rid, 0, r.prompt_len)] for rid, r in requests.items()]
                solo[split] = run_batches(content, kernel, alone, split)
                kernel.take_timing()
            out = run_batches(content, kernel, schedule["steps"], split)
            plan_calls, plan_ms, kernel_ms = kernel.take_timing()
            per_request = compare(content, out, solo[split], schedule, requests)
            del out
            hazards = predict_hazards(schedule, requests, shape)
            rows.append(dict(
                shape=shape.name, config=schedule["config"], radix=schedule["radix"],
                exact_pct=round(100 * sum(p["exact"] for p in per_request.values()) / len(per_request), 1),
                rows_mismatched=sum(p["own_bad"] for p in per_request.values()),
                rows_computed=sum(p["own_rows"] for p in per_request.values()),
                inherited_rows_mismatched=sum(p["inherited_bad"] for p in per_request.values()),
                max_abs_diff=max(p["max_abs"] for p in per_request.values()),
                kernel_ms=round(kernel_ms, 2), plan_calls=plan_calls, plan_ms=round(plan_ms, 1),
                prefill_steps=schedule["prefill_steps"],
                **prediction_summary(hazards),
                prediction_check=_prediction_check(hazards, per_request),
                inexact_rids=sorted(rid for rid, p in per_request.items() if not p["exact"]),
            ))
            print(_format_row(rows[-1]), flush=True)
        del content, kernel, solo
    return rows


def _prediction_check(hazards, per_request):
    """How the tile-rule prediction fared: counts of (predicted hazard?, measured exact?)."""
    if hazards is None:
        return None
    counts = {"hazard_inexact": 0, "hazard_exact": 0, "clear_inexact": 0, "clear_exact": 0}
    for rid, p in per_request.items():
        counts[("hazard_" if hazards[rid] else "clear_") + ("exact" if p["exact"] else "inexact")] += 1
    return counts


# ---------------------------------------------------------------------------
# Reporting and command line
# ---------------------------------------------------------------------------


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def schedule_report(doc, shapes=SHAPES):
    """Schedule statistics and predicted hazards, one row per (radix, configuration)."""
    requests = load_requests(doc)
    header = ["radix", "config", "chunk", "align", "split", "prefill steps", "decode steps", "mean batch",
              "chunked reqs", "starts off 128", "short cuts", "radix hit tokens", "retracted"]
    header += [f"predicted exact % {s.name} (tile/off-grid/donor)" for s in shapes]
    rows = []
    for schedule in doc["schedules"]:
        stats = schedule_stats(schedule, requests)
        row = ["on" if schedule["radix"] else "off", schedule["config"], schedule["chunk"],
               schedule["truncation_align_size"], schedule["fixed_split"], stats["prefill_steps"],
               stats["decode_steps"], stats["mean_batch"], stats["chunked_requests"],
               stats["starts_off_128"], stats["short_cuts"], stats["radix_hit_tokens"], stats["retracted"]]
        for shape in shapes:
            p = prediction_summary(predict_hazards(schedule, requests, shape))
            row.append("n/a" if p["predicted_exact_pct"] is None
                       else f"{p['predicted_exact_pct']} ({p['tile']}/{p['off_grid']}/{p['donor']})")
        rows.append(row)
    return _table(header, rows)


RESULT_COLUMNS = ("shape", "radix", "config", "exact_pct", "predicted_exact_pct", "rows_mismatched",
                  "inherited_rows_mismatched", "max_abs_diff", "kernel_ms", "plan_calls", "prefill_steps")


def _cells(row):
    cells = dict(row, radix="on" if row["radix"] else "off", max_abs_diff=f"{row['max_abs_diff']:.3g}")
    return [cells[c] for c in RESULT_COLUMNS]


def _format_row(row):
    return "  ".join(f"{c}={v}" for c, v in zip(RESULT_COLUMNS, _cells(row)))


def results_table(rows):
    return _table(RESULT_COLUMNS, [_cells(r) for r in rows])


def summary_table(rows):
    """One row per (radix, configuration): exact % per shape as measured (and as predicted), and
    the requests the tile rule called clear that still came out inexact, per shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    groups = {}
    for r in rows:
        groups.setdefault((r["radix"], r["config"]), {})[r["shape"]] = r
    header = ["radix", "config", *(f"exact % {s} (predicted)" for s in shapes), "rows mismatched",
              "inherited rows mismatched", "clear but inexact", "max abs diff", f"kernel ms {shapes[0]}",
              "plan calls", "prefill steps"]
    table = []
    for (radix, config), by_shape in groups.items():
        first = by_shape[shapes[0]]
        table.append([
            "on" if radix else "off", config,
            *(f"{by_shape[s]['exact_pct']} ({by_shape[s]['predicted_exact_pct'] or '-'})" for s in shapes),
            " / ".join(str(by_shape[s]["rows_mismatched"]) for s in shapes),
            " / ".join(str(by_shape[s]["inherited_rows_mismatched"]) for s in shapes),
            " / ".join(str((by_shape[s]["prediction_check"] or {}).get("clear_inexact", "-")) for s in shapes),
            f"{max(by_shape[s]['max_abs_diff'] for s in shapes):.3g}",
            first["kernel_ms"], first["plan_calls"], first["prefill_steps"],
        ])
    return _table(header, table)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sched = sub.add_parser("schedule", help="CPU: schedule with SGLang's PrefillAdder, print stats and predicted hazards")
    sched.add_argument("--small", action="store_true", help="the small CI workload")
    sched.add_argument("--uncapped", action="store_true", help="no cap on KV memory")
    sched.add_argument("--out", help="write the schedule document (JSON) here")
    sched.add_argument("--configs", nargs="+", choices=[c.name for c in CONFIGS],
                       default=[c.name for c in CONFIGS], help="schedule only these configurations")
    rep = sub.add_parser("replay", help="GPU: replay a schedule document through flashinfer fa2")
    rep.add_argument("--schedules", required=True)
    rep.add_argument("--json", help="write the results (JSON) here")
    rep.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    show = sub.add_parser("report", help="print the tables of a results document (JSON)")
    show.add_argument("--results", required=True)
    args = parser.parse_args(argv)

    if args.command == "report":
        with open(args.results) as f:
            results = json.load(f)
        print(f"{results['meta']}\n\n{summary_table(results['rows'])}\n\n{results_table(results['rows'])}")
        return 0

    if args.command == "schedule":
        # Benchmark the plugin in this checkout, installed or not.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        spec = SMALL_WORKLOAD if args.small else FULL_WORKLOAD
        if args.uncapped:
            spec = WorkloadSpec(**{**asdict(spec), "kv_tokens": UNCAPPED_KV_TOKENS})
        start = time.perf_counter()
        doc = schedule_workload(spec, [c for c in CONFIGS if c.name in args.configs])
        print(schedule_report(doc))
        print(f"\nscheduled {len(doc['requests'])} requests x {len(doc['schedules'])} schedules "
              f"in {time.perf_counter() - start:.1f} s (SGLang {doc['meta']['sglang']})")
        if args.out:
            _write_json(args.out, doc)
        return 0

    import torch

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    if flashinfer is None or not torch.cuda.is_available():
        print("replay needs CUDA and flashinfer; `schedule` is the CPU-only mode", file=sys.stderr)
        return 2
    with open(args.schedules) as f:
        doc = json.load(f)
    start, rows = time.perf_counter(), []
    meta = dict(doc["meta"], gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                flashinfer=flashinfer.__version__)
    for shape in SHAPES:
        if shape.name in args.shapes:
            rows += replay(doc, [shape])
            meta["replay_s"] = round(time.perf_counter() - start, 1)
            if args.json:  # after each shape, so a run cut short keeps what it measured
                _write_json(args.json, dict(meta=meta, rows=rows))
    print(f"\n{meta}\n\n{summary_table(rows)}\n\n{results_table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
