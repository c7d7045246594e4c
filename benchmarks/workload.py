"""The replay benchmark's workload, scheduling configurations and model shapes.

Importable library code: benchmarks/scheduling.py schedules this workload,
benchmarks/replay_determinism.py replays it, and the tests drive both.
"""

import math
import random
from dataclasses import dataclass
from typing import Optional

# ---------------------------------------------------------------------------
# Workload. Fixed before any result was seen, and never to be tuned: it is the yardstick
# every scheduling rule is measured against, so tuning it would make a rule look good.
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
    # Multi-turn chat when above 0: each prefix group is one conversation of this many
    # turns, every turn's prompt extends the one before, and turn t arrives in wave t.
    turns: int = 0


FULL_WORKLOAD = WorkloadSpec(
    n_requests=240, max_prompt=8192, n_prefix_groups=12, shared_fraction=0.6,
    max_output=128, n_waves=10, wave_gap_steps=64, kv_tokens=32768, max_running_requests=128,
)
# The CI workload: same generator, small enough for a unit test.
SMALL_WORKLOAD = WorkloadSpec(
    n_requests=40, max_prompt=2048, n_prefix_groups=4, shared_fraction=0.6,
    max_output=16, n_waves=4, wave_gap_steps=16, kv_tokens=8192, max_running_requests=32,
)
# Multi-turn chat: radix hits come from earlier turns of the same conversation.
CHAT_WORKLOAD = WorkloadSpec(
    n_requests=96, max_prompt=8192, n_prefix_groups=24, shared_fraction=1.0,
    max_output=64, n_waves=4, wave_gap_steps=256, kv_tokens=32768, max_running_requests=128, turns=4,
)
SMALL_CHAT_WORKLOAD = WorkloadSpec(
    n_requests=24, max_prompt=2048, n_prefix_groups=8, shared_fraction=1.0,
    max_output=16, n_waves=3, wave_gap_steps=64, kv_tokens=8192, max_running_requests=32, turns=3,
)
WORKLOADS = {"mixed": FULL_WORKLOAD, "chat": CHAT_WORKLOAD, "small": SMALL_WORKLOAD, "small-chat": SMALL_CHAT_WORKLOAD}
UNCAPPED_KV_TOKENS = 1 << 20

# Token ids: group prefixes and random suffixes draw from [RANDOM_TOKEN_LOW,
# MARKER_BASE); each request's first own token is a unique marker, so a radix
# match never runs past the shared prefix. Output tokens, unique per request, and the
# vocabulary are the scheduler driver's (sglang_chunk_align.harness.scheduler_driver.OUTPUT_BASE).
RANDOM_TOKEN_LOW = 1000
MARKER_BASE = 100_000


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
    if spec.turns:
        return make_chat_workload(spec, seed)
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


def make_chat_workload(spec: WorkloadSpec, seed: int = WORKLOAD_SEED):
    """Conversations: a system prompt, then one user message per turn; turn t's prompt is the
    conversation so far, drawn from its group, and ends in the request's own marker token, so
    the next turn's radix hit covers this turn's prompt but its last token."""
    rng = random.Random(f"{seed}/chat")
    conversations = []
    for _ in range(spec.n_prefix_groups):
        lengths = [log_uniform_int(rng, 32, spec.max_prompt // 4)]
        lengths += [log_uniform_int(rng, 1, spec.max_prompt // (2 * spec.turns)) for _ in range(spec.turns)]
        conversations.append([sum(lengths[: turn + 2]) for turn in range(spec.turns)])
    requests = [
        RequestSpec(
            rid=turn * spec.n_prefix_groups + group, arrival_step=turn * spec.wave_gap_steps,
            prompt_len=prompt_lens[turn], group=group, shared_len=prompt_lens[turn] - 1,
            output_len=log_uniform_int(rng, 1, spec.max_output),
        )
        for turn in range(spec.turns)
        for group, prompt_lens in enumerate(conversations)
    ]
    return requests, [prompt_lens[-1] for prompt_lens in conversations]


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
    split_attention: bool = True  # with the rules: split attention (SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION=0 turns it off)
    pad_tiles: bool = False  # with split attention: padded calls (SGLANG_CHUNK_ALIGN_PAD_TILES=1 turns them on)

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
# Chunk sizes only flashinfer releases whose chunk starts do not matter (0.7.4) accept; scheduled
# only when named (replay_determinism schedule --configs ... --flashinfer 0.7.4).
OFF_GRID_CHUNK_CONFIGS = tuple(SchedulingConfig(f"plugin-{chunk}", chunk, plugin=True) for chunk in (192, 320))
# The rules before split attention (issue 32): requests wait to keep each batch on one tile. Only when named.
NO_SPLIT_CONFIGS = (SchedulingConfig("plugin-256-no-split", 256, plugin=True, split_attention=False),)
# Padded calls (issue 48, SGLANG_CHUNK_ALIGN_PAD_TILES=1): radix hits kept whole. Only when named.
PAD_CONFIGS = (SchedulingConfig("plugin-256-pad", 256, plugin=True, pad_tiles=True),)
NAMED_CONFIGS = CONFIGS + OFF_GRID_CHUNK_CONFIGS + NO_SPLIT_CONFIGS + PAD_CONFIGS  # what --configs may name


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
    ModelShape("g1-d128", 32, 32, 128),
)
