"""Batch-invariant GEMMs with a tile config per M: stock's bits, without stock's one big tile.

SGLang's deterministic inference sends mm and addmm to batch_invariant_ops'
persistent Triton kernel with one config per dtype (bf16: 128x128x64 tiles,
8 warps). At decode sizes that tile is mostly empty rows, and a 4,608-wide
GEMM has 36 tiles for 132 SMs: the GEMMs cost 3x cuBLAS there (issue 47).

Each output element's sum over K is the kernel's K loop of BLOCK_K-wide
tl.dot steps. BLOCK_M, BLOCK_N, warps and stages only choose which outputs a
program computes and how it pipelines its loads, so the same kernel with
those changed and BLOCK_K kept should give the same bits: reported so on the
H200 (issue 47) and on 50 shapes on an H100 (gemms_h200/call1), but the compiler does not promise it. So nothing here takes it on
trust. A config serves a GEMM shape (dtype, N, K, bias) only after it gave
stock's bits for that shape on this GPU at its bucket's probe M (probe_rows),
and was faster than stock's: tuned at startup, before CUDA graphs
are captured, from the model's own weights, or read from the cache an earlier
process wrote on the same GPU, Triton and SGLang kernel source. Timing noise
may pick another admitted config on another run; the bits cannot change.

Shapes not tuned, M above 256 (where stock's 128-row tiles fill the GPU),
other layouts and dtypes keep stock's config; bf16 GEMMs that SGLang sends to
DeepGEMM (a full install on sm90 and newer) stay there, with its bits.
On by default; SGLANG_CHUNK_ALIGN_GEMMS=0 keeps stock's one config everywhere.
"""

import logging
import os
import time
from typing import NamedTuple

logger = logging.getLogger("sglang_chunk_align")

KERNEL_MODULE = "sglang.srt.batch_invariant_ops.batch_invariant_ops"
GROUP_SIZE_M = 8  # stock's; it orders the tiles a program visits, never a sum


class Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int

    def launch_args(self):
        return {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n, "BLOCK_SIZE_K": self.block_k,
                "GROUP_SIZE_M": GROUP_SIZE_M, "num_stages": self.stages, "num_warps": self.warps}


# Stock's one config per input dtype, as _matmul_persistent_triton's `configs` holds it (the patch
# table's row states it: tests/test_release_wheels.py checks it in every release's source).
STOCK = {
    "bfloat16": Config(128, 128, 64, 3, 8),
    "float16": Config(128, 256, 64, 3, 8),
    "float32": Config(128, 128, 32, 3, 8),
}


def stock_configs_statement():
    """STOCK as _matmul_persistent_triton writes it (ast.unparse): the patch table's row checks it in
    every release."""
    entries = ", ".join(f"torch.{dtype}: {config.launch_args()!r}" for dtype, config in STOCK.items())
    return f"configs = {{{entries}}}"


# The largest M of each bucket a config is tuned for; M above the last keeps stock's config.
BUCKETS = (16, 32, 64, 128, 256)


class Shape(NamedTuple):
    """What a tuned config is proven for: b is a weight's transpose (N x K, rows contiguous), a and
    the output have rows contiguous, the output has a's dtype."""
    dtype: str
    n: int
    k: int
    bias: bool

    @property
    def key(self):
        return f"{self.dtype} {self.n}x{self.k}{' +bias' if self.bias else ''}"


def bucket(m):
    """The largest M of the bucket `m` rows fall in, or None above the last."""
    return next((top for top in BUCKETS if m <= top), None)


def bucket_rows(top):
    """The rows of the bucket whose largest M is `top`, as "low-top"."""
    index = BUCKETS.index(top)
    return f"{BUCKETS[index - 1] + 1 if index else 1}-{top}"


def candidates(dtype, top):
    """Configs tried for a bucket: stock's BLOCK_K (it fixes each sum's order), tiles of about the
    bucket's rows, 3 or 4 stages, and 64 or 128 columns, or 32 up to 64 rows: at decode sizes a GEMM
    is a stream of its weight, and narrow tiles give every SM a part of it (4,608 columns are 144
    tiles of 32 for the H200's 132 SMs, 36 of stock's 128)."""
    block_k = STOCK[dtype].block_k
    block_ms = [m for m in (16, 32, 64, 128) if min(top, 64) // 2 <= m <= max(top, 16)]
    block_ns = (32, 64, 128) if top <= 64 else (64, 128)
    return [Config(m, n, block_k, stages, 8 if m == 128 else 4)
            for m in block_ms for n in block_ns for stages in (3, 4)]


class Table:
    """What this process serves: configs {Shape: {bucket top: Config}} (a bucket left out keeps
    stock's), and in fast mode splits {Shape: K's ranges} (split_k.py), at every M, and split_tiles
    {Shape: {bucket top: Config}}, the buckets where a split shape runs one program per tile."""

    def __init__(self, configs, splits=None, split_tiles=None):
        self.configs = configs
        self.splits = splits or {}
        self.split_tiles = split_tiles or {}
        self._untuned = set()  # shapes seen without a config, each reported once

    @staticmethod
    def shape(a, b, out_dtype, bias):
        """The call's Shape, or None where it is not one a config or a split is proven for."""
        if out_dtype != a.dtype or a.stride(1) != 1 or b.stride(0) != 1:
            return None
        return Shape(dtype_name(a.dtype), b.shape[1], b.shape[0], bias is not None)

    def config(self, a, b, out_dtype, bias):
        """The config for this call, or None for stock's."""
        return self.config_for(a.shape[0], self.shape(a, b, out_dtype, bias))

    def config_for(self, rows, shape):
        """The config for `rows` rows of `shape` (None: a call no config is proven for), or None for stock's."""
        top = bucket(rows)
        if top is None or shape is None:
            return None
        tuned = self.configs.get(shape)
        if tuned is None:
            if shape not in self._untuned:
                self._untuned.add(shape)
                logger.info("sglang-chunk-align: GEMM %s was not tuned at startup: stock's config", shape.key)
            return None
        return tuned.get(top)


_table = None  # the Table this process's model runner tuned, or None: stock everywhere


def activate(table):
    global _table
    _table = table


def per_m_config(wrapped, instance, args, kwargs):
    """Wraps batch_invariant_ops._matmul_persistent_triton, through which SGLang's batch-invariant
    mm, addmm and mm.dtype reach the Triton kernel: the same kernel, with the tuned config. With
    no table (the switch off, or no model runner tuned in this process) a call costs the wrapper alone."""
    if _table is None:
        return wrapped(*args, **kwargs)
    a, b, out_dtype, bias = _gemm_args(*args, **kwargs)
    shape = Table.shape(a, b, out_dtype, bias)
    splits = _table.splits.get(shape)
    if splits:
        from . import split_k

        tile = _table.split_tiles.get(shape, {}).get(bucket(a.shape[0]))
        return split_k.launch(a, b, out_dtype, bias, splits, STOCK[shape.dtype].block_k, config=tile)
    config = _table.config_for(a.shape[0], shape)
    if config is None:
        return wrapped(*args, **kwargs)
    return launch(a, b, out_dtype, bias, config)


def _gemm_args(a, b, out_dtype, bias=None):
    return a, b, out_dtype, bias


def dtype_name(dtype):
    """torch.bfloat16 -> "bfloat16", as STOCK and Shape name it."""
    return str(dtype).removeprefix("torch.")


def launch(a, b, out_dtype, bias, config):
    """Stock's launch of stock's kernel (_matmul_persistent_triton), with `config` for its one."""
    import torch
    import triton

    from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels

    num_sms = kernels.get_device_core_count()
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    grid = (min(num_sms, triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)),)
    kernels.matmul_kernel_persistent[grid](
        a, b, c, bias, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        NUM_SMS=num_sms, A_LARGE=a.numel() > 2**31, B_LARGE=b.numel() > 2**31, C_LARGE=c.numel() > 2**31,
        HAS_BIAS=bias is not None, **config.launch_args())
    return c


def stock(a, b, out_dtype, bias):
    """Stock's kernel with stock's config, the reference every candidate must match."""
    return launch(a, b, out_dtype, bias, STOCK[dtype_name(a.dtype)])


def same_bits(x, y):
    import torch

    width = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.view(width), y.view(width))


def probe_rows(low, top):
    """The M at which a bucket's candidates must give stock's bits: its smallest and largest, and one
    below the largest. Triton compiles the kernel apart for M of 1, for M a multiple of 16 and for the
    rest, so each bucket's configs run in every variant they will serve in."""
    return sorted({low, max(low, top - 1), top})


def tune(shape, weight, bias, time_config):
    """{bucket top: Config} for `shape`, from its `weight` (N x K) and `bias`: per bucket, the
    fastest candidate that gives stock's bits at the bucket's probe_rows, where it beats
    stock's config; `time_config(config, a, b, bias)` -> seconds. Also the candidates that gave
    other bits, sorted (a finding: the startup line names them)."""
    rows, b = probe_inputs(shape, weight), weight.t()
    tuned, differing = {}, set()
    for top, probes in bucket_probes(rows):
        references = [stock(a, b, a.dtype, bias) for a in probes]
        best, best_time = None, time_config(STOCK[shape.dtype], rows[:top], b, bias)
        for config in candidates(shape.dtype, top):
            same = gives_bits(lambda a: launch(a, b, a.dtype, bias, config), probes, references)
            if same is False:
                differing.add(config)
            elif same and (seconds := time_config(config, rows[:top], b, bias)) < best_time:
                best, best_time = config, seconds
        if best is not None:
            tuned[top] = best
    return tuned, sorted(differing)


def bucket_probes(rows):
    """(bucket top, `rows` cut at each of its probe_rows) for every bucket: what a tuner checks."""
    low = 1
    for top in BUCKETS:
        yield top, [rows[:m] for m in probe_rows(low, top)]
        low = top + 1


def gives_bits(run, probes, references):
    """Whether run(a) gives the bits of `references` at every one of `probes`; None where `run`'s config
    needs more shared memory or registers than this GPU has."""
    from triton.runtime.errors import OutOfResources

    try:
        outputs = [run(a) for a in probes]
    except OutOfResources:
        return None
    return all(map(same_bits, outputs, references))


def probe_inputs(shape, weight):
    """BUCKETS[-1] rows of `shape`'s K, the same on every run: what the tuners' probes and clocks take."""
    import torch

    generator = torch.Generator(device=weight.device).manual_seed(0)
    return torch.randn(BUCKETS[-1], shape.k, generator=generator, device=weight.device).to(weight.dtype)


def split_tiles(shape, weight, bias, splits, configs, time_split=None):
    """Fast mode's {bucket top: Config} for a `shape` split into `splits` K ranges: per bucket, the
    shape's per-M config (`configs` from tune(), stock's where it has none) run as one program per
    tile that adds every range itself, where that gave the default launch's bits at the bucket's
    probe_rows and was faster at its top. At prefill sizes a per-M tile fills the GPU on its own and
    the default launch's fp32 partials cost more than the extra programs give (call5: a 256-token
    chunk's GEMMs took 10.06 ms in fast mode, 8.73 with the per-M configs). The tile only picks
    which outputs a program computes, so the bits should be the default launch's; the check makes
    sure on this GPU. `time_split(config or None, a, b, bias)` -> seconds; None: this GPU's clock.
    Also the configs that gave other bits (a finding: the startup line names them)."""
    from . import split_k

    rows, b, block_k = probe_inputs(shape, weight), weight.t(), STOCK[shape.dtype].block_k

    def run(a, config=None):
        return split_k.launch(a, b, a.dtype, bias, splits, block_k, config=config)

    time_split = time_split or (lambda config, a, b, bias: gpu_seconds(lambda: run(a, config)))
    tiles, differing = {}, set()
    for top, probes in bucket_probes(rows):
        config = configs.get(top, STOCK[shape.dtype])
        same = gives_bits(lambda a: run(a, config), probes, [run(a) for a in probes])
        if same is False:
            differing.add(config)
        elif same and time_split(config, rows[:top], b, bias) < time_split(None, rows[:top], b, bias):
            tiles[top] = config
    return tiles, sorted(differing)


def model_shapes(model):
    """{Shape: (weight, bias)} for the model's GEMMs that reach stock's Triton kernel: unquantized
    linear layers and vocabulary projections, one module's tensors per shape."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    shapes = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (LinearBase, VocabParallelEmbedding)) or weight is None or weight.dim() != 2:
            continue
        dtype = dtype_name(weight.dtype)
        if dtype not in STOCK or _deepgemm_takes(dtype, *weight.shape):
            continue
        bias = getattr(module, "bias", None) if isinstance(module, LinearBase) else None
        shapes.setdefault(Shape(dtype, weight.shape[0], weight.shape[1], bias is not None), (weight, bias))
    return shapes


# What a server in fast mode adds to its scheduler's init info, which SGLang's /server_info serves:
# verify reads it (absent: stock's sums) and refuses to compare servers whose GEMMs sum K differently.
SUMS_KEY = "sglang_chunk_align_gemm_sums"
SPLIT_SUMS = "split-k fixed per shape (SGLANG_CHUNK_ALIGN_FAST_GEMMS=1)"


def report_sums(wrapped, instance, args, kwargs):
    """Wraps Scheduler.get_init_info, the dict SGLang merges into /server_info: where fast mode splits
    a GEMM of this process's model, it says so (SUMS_KEY); elsewhere the dict stays stock's."""
    info = wrapped(*args, **kwargs)
    if _table is not None and _table.splits:
        info[SUMS_KEY] = SPLIT_SUMS
    return info


def _deepgemm_takes(dtype, n, k):
    """Whether SGLang sends this GEMM to DeepGEMM instead of the Triton kernel (its matmul_persistent's
    test, for a weight's transpose)."""
    return _deepgemm_on() and dtype == "bfloat16" and n >= 16 and (n * 2) % 16 == 0 and (k * 2) % 16 == 0


def _deepgemm_on():
    """Whether SGLang sends batch-invariant bf16 GEMMs to DeepGEMM on this install."""
    from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels

    return bool(kernels._ENABLE_MM_DEEPGEMM and kernels.ENABLE_JIT_DEEPGEMM)


def tune_at_startup(wrapped, instance, args, kwargs):
    """Wraps ModelRunner.configure_kv_cache_dtype, the step after SGLang turns batch-invariant ops
    on (ModelRunner.initialize): the model is loaded, its KV cache not yet sized, its CUDA graphs
    not yet captured. Each shape is tuned once per process: a second runner (a draft model's)
    keeps the first one's configs and splits and adds its own shapes."""
    import torch

    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    # CUDA (or ROCm) only: elsewhere (NPU) SGLang's batch-invariant GEMMs are not the Triton kernel.
    if is_batch_invariant_mode_enabled() and torch.cuda.is_available():
        activate(startup_table(instance.model, _table))
    return wrapped(*args, **kwargs)


def startup_table(model, previous, tune_shape=None, tile_split=None):
    """The Table for `model`, keeping what the `previous` Table (or None) serves, and the startup
    lines; None where both switches keep stock's one config. `tune_shape(shape, weight, bias)` ->
    tune()'s answer; None: tune() on this GPU's clock. `tile_split(shape, weight, bias, splits,
    configs)` -> split_tiles()'s answer; None: split_tiles() on this GPU's clock."""
    from .compat import FAST_GEMMS_ENV, GEMMS_ENV, switch

    per_m, fast = switch(GEMMS_ENV), switch(FAST_GEMMS_ENV)
    if not (per_m or fast):
        logger.info("sglang-chunk-align: batch-invariant GEMMs keep stock's one config (%s=0)", GEMMS_ENV)
        return None
    known = Table({}) if previous is None else previous
    shapes = model_shapes(model)
    if not shapes:
        logger.info("sglang-chunk-align: no GEMM of this model reaches SGLang's Triton kernel%s: nothing to tune",
                    " (bf16 GEMMs run on DeepGEMM)" if _deepgemm_on() else "")
        return Table(dict(known.configs), dict(known.splits), dict(known.split_tiles))
    splits = split_shapes(shapes) if fast else {}
    if not per_m:
        logger.info("sglang-chunk-align: the other batch-invariant GEMMs keep stock's one config (%s=0)", GEMMS_ENV)
    # A split shape is tuned too: its per-M configs are the tiles split_tiles tries (stock's with the switch off).
    configs = tuned_configs(shapes, known.configs, tune_shape, splits) if per_m else {}
    tiles = tiled_splits({shape: shapes[shape] for shape in splits.keys() - known.split_tiles.keys()}, splits,
                         configs, tile_split)
    return Table({**known.configs, **{shape: c for shape, c in configs.items() if shape not in splits}},
                 {**known.splits, **splits}, {**known.split_tiles, **tiles})


def split_shapes(shapes):
    """Fast mode's {Shape: K's ranges} for the model's `shapes` whose split (split_k.splits_for) is
    above 1, and its startup line; the others keep the per-M configs and stock's bits."""
    from . import split_k
    from .compat import FAST_GEMMS_ENV

    splits = {shape: count for shape in shapes if (count := split_k.splits_for(shape.n, shape.k)) > 1}
    logger.info(
        "sglang-chunk-align: fast GEMMs (%s=1) sum K as fixed ranges per shape, the same at every M, for %d of the "
        "model's %d Triton GEMM shapes (%s): batch-invariant, but not stock's bits, so check this server against a "
        "reference with the same switch (chunking and radix cache off), never a stock one",
        FAST_GEMMS_ENV, len(splits), len(shapes),
        ", ".join(f"{shape.key}: {count}" for shape, count in sorted(splits.items())) or "none wins")
    return splits


def tuned_configs(shapes, known, tune_shape=None, splits=()):
    """{Shape: {bucket top: Config}} for `shapes` ({Shape: (weight, bias)}): the `known` ones, those in
    this GPU's cache, the rest tuned (and cached); and the startup line, where the shapes fast mode
    `splits` are tiles to try, not stock's kernel."""
    import torch

    tune_shape = tune_shape or (lambda shape, weight, bias: tune(shape, weight, bias, gpu_clock))
    path = cache_path(next(iter(shapes.values()))[0].device)
    cached = {**read_cache(path), **known}
    started, configs, notes = time.monotonic(), {}, []
    for shape, (weight, bias) in shapes.items():
        if shape in cached:
            configs[shape] = cached[shape]
            continue
        try:
            configs[shape], differing = tune_shape(shape, weight, bias)
        except Exception as error:  # a shape that cannot be tuned keeps stock's config, and the line says why
            notes.append(f"{shape.key} keeps stock's config: tuning failed ({type(error).__name__}: {error})")
            continue
        notes.extend(f"{shape.key}: {config} gave bits other than stock's, not used" for config in differing)
    torch.cuda.empty_cache()
    fresh = configs.keys() - cached.keys()
    if fresh:
        write_cache(path, {**cached, **configs})
    _log_startup(len(shapes) - len(splits), configs, splits, len(fresh), time.monotonic() - started, path, notes)
    return configs


def _log_startup(unsplit, configs, splits, fresh, seconds, path, notes):
    faster = sorted(shape.key for shape, tuned in configs.items() if tuned and shape not in splits)
    logger.info(
        "sglang-chunk-align: batch-invariant GEMMs run stock's kernel with a tile config per M for %d of %d "
        "Triton GEMM shapes%s (%s), each checked for stock's bits on this GPU (%d tuned in %.1f s, "
        "%d read from %s); M above %d, the other shapes%s keep stock's config",
        len(faster), unsplit, f" not split by fast mode (its {len(splits)} split shapes' configs are tiles it tries)"
        if splits else "", ", ".join(faster) or "none faster", fresh, seconds, len(configs) - fresh, path,
        BUCKETS[-1], " and bf16 GEMMs on DeepGEMM" if _deepgemm_on() else "")
    for note in notes:
        logger.warning("sglang-chunk-align: GEMM %s", note)


def tiled_splits(shapes, splits, configs, tile_split=None):
    """{Shape: {bucket top: Config}}: split_tiles() for each of `shapes` ({Shape: (weight, bias)}) that
    fast mode `splits`, from its per-M `configs`; and the startup line."""
    tile_split = tile_split or split_tiles
    started, tiles, notes = time.monotonic(), {}, []
    for shape, (weight, bias) in shapes.items():
        try:
            tiles[shape], differing = tile_split(shape, weight, bias, splits[shape], configs.get(shape, {}))
        except Exception as error:  # the shape keeps fast mode's default launch, and the line says why
            notes.append(f"{shape.key} keeps fast mode's default launch: checking its tiles failed "
                         f"({type(error).__name__}: {error})")
            continue
        notes.extend(f"{shape.key}: {config} in one program per tile gave bits other than the split's, not used"
                     for config in differing)
    if shapes:
        logger.info(
            "sglang-chunk-align: fast GEMMs run one program per tile, the shape's per-M tile, in the M buckets where "
            "that gave the split's bits on this GPU and was faster (%s; checked in %.1f s); elsewhere split_k's "
            "default launch", "; ".join(
                f"{shape.key}: " + (f"M {', '.join(map(bucket_rows, sorted(tops)))}" if tops else "none")
                for shape, tops in sorted(tiles.items())) or "none", time.monotonic() - started)
    for note in notes:
        logger.warning("sglang-chunk-align: GEMM %s", note)
    return tiles


def gpu_seconds(call):
    """The median seconds of `call` on the GPU (triton.testing.do_bench, the L2 cache flushed before each)."""
    import triton.testing

    return triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median") / 1000


def gpu_clock(config, a, b, bias):
    """tune()'s clock on a GPU: one launch of `config`."""
    return gpu_seconds(lambda: launch(a, b, a.dtype, bias, config))


def cache_path(device):
    """Where tuned configs for this GPU, Triton and SGLang kernel source are kept:
    $XDG_CACHE_HOME (or ~/.cache)/sglang-chunk-align/gemms/<fingerprint>.json."""
    import hashlib

    import torch
    import triton

    from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels

    with open(kernels.__file__, "rb") as source:
        fingerprint = hashlib.sha256(source.read())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    fingerprint.update(f"{gpu} {triton.__version__}".encode())
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang-chunk-align", "gemms", f"{fingerprint.hexdigest()[:16]}.json")


def read_cache(path):
    """{Shape: {bucket top: Config}} from `path`; {} where it is absent or unreadable (a WARNING says
    so). A config with another BLOCK_K than stock's, which would change the bits, is dropped."""
    import json

    try:
        with open(path) as cache:
            entries = json.load(cache)
        return {
            Shape(**entry["shape"]): {
                int(top): config for top, fields in entry["configs"].items()
                if (config := Config(*fields)) in candidates(entry["shape"]["dtype"], int(top))
            }
            for entry in entries
        }
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("sglang-chunk-align: ignoring the GEMM cache %s (%s): tuning again", path, error)
        return {}


def write_cache(path, configs):
    """Write `configs` to `path` whole or not at all (ranks of one server share it); a WARNING where
    it cannot, and the configs still serve this process."""
    import json
    import tempfile

    entries = [{"shape": shape._asdict(), "configs": {str(top): list(config) for top, config in tuned.items()}}
               for shape, tuned in configs.items()]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as temporary:
            json.dump(entries, temporary, indent=1)
        os.replace(temporary.name, path)
    except OSError as error:
        logger.warning("sglang-chunk-align: could not write the GEMM cache %s (%s): the next start tunes again",
                       path, error)
