"""SGLang release facts, declared once: the supported range, the release gates, and the
releases CI installs.

Plain data without imports, so `.ci/run` reads it before anything is installed
(`runpy.run_path`). compat.py, the patch table and the tests take every version
from here.
"""

# Every release with the plugin system; test_release_wheels.py reads each one's wheel.
RELEASES = (
    "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1",
    "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)
# Releases whose patch points were read and tested (docs/supported-versions.md).
SUPPORTED = ">=0.5.12,<0.5.24"

# First release where stock SGLang refuses a chunk below the alignment at startup
# (check_truncation_align_fits_chunk) and no longer aligns deterministic triton.
STOCK_STARTUP_CHECK = "0.5.22"
# First release where the grid rules run: PrefillAdder has every admission path they
# patch (_select_prefill_admission for new requests; a continuation's cut is decided before
# its add_chunked_req clamps it, and from MEMORY_BUDGET on answered by the adder's memory budget).
GRID_RULES = "0.5.20"
# First release whose PrefillAdder takes a continuation's cut from a memory budget object
# (memory_budget.available_chunk_tokens, then fit_chunk, whose None makes it wait).
MEMORY_BUDGET = "0.5.21"
# First release where the rules reach radix hits and the tree (match_kv_cache,
# UnifiedRadixCache.checkpoint), so the radix cache stays on under deterministic flashinfer
# (compat.radix_cache; the name is from when SGLANG_CHUNK_ALIGN_RADIX_CACHE=1 had to ask for it).
RADIX_OPT_IN = "0.5.22"
# First release with PrefillAdder.floor_chunked_tokens, through which an ignore_eos request's
# grid cut is handed back.
FLOOR_CHUNKED_TOKENS = "0.5.23"
# First release whose Scheduler._should_defer_prefill is handed the running batch, through which
# decode_wait.py bounds how long decoding requests wait behind prefill chunks.
DECODE_WAIT = "0.5.23"
# First release whose batch-invariant GEMM launcher takes the output dtype (_matmul_persistent_triton's
# out_dtype), from which the plugin runs that kernel with a config per M (gemms.py).
GEMM_CONFIGS = "0.5.20"
# First releases with these attention backends, whose declarations the patch table adds.
MINIMAX_HYBRID_BACKEND = "0.5.16"
DOTS_HYBRID_BACKENDS = "0.5.19"
LLADA2_CFG_BACKEND = "0.5.22"
# First release whose scheduler reads attention DP ranks from --attn-dp-size (get_parallel).
ATTN_DP_SIZE = "0.5.23"
# First release whose prefix cache with the radix cache off is a disabled UnifiedRadixCache (a
# ChunkCache before), and which writes a batch's KV indices without a Triton kernel on CPU.
UNIFIED_PREFIX_CACHE = "0.5.22"
# What a release without the grid rules leaves inexact: the scheduler's startup
# WARNING and doctor say it in these words.
WITHOUT_GRID_RULES = (
    "final pieces shorter than the full fa2 tile, thin batches on a smaller tile, memory-pressure "
    "and ignore_eos cuts off the grid, and radix hits off the grid (the radix cache stays off, as stock keeps it) "
    f"are not bit-exact; SGLang {GRID_RULES} or newer closes this with the grid rules "
    f"({RADIX_OPT_IN} or newer with the radix cache on)"
)

# What CI installs: the newest release runs the whole suite; OLDER_WITH_GRID_RULES runs it
# too, the grid rules on an older PrefillAdder (continuation cuts through its memory budget,
# as on 0.5.21; 0.5.20 and 0.5.21 pin torch 2.13.0, whose CPU build on CI's machine breaks
# PyPI's torchvision, so CI takes 0.5.22); OLDEST_CPU_SCHEDULER is the oldest release whose scheduler imports without
# a GPU (the whole suite, as far as that release goes); OLDEST is the oldest supported
# release, whose scheduler needs libcuda, so CI runs only tests/test_oldest_release.py there.
NEWEST = "0.5.23"
OLDER_WITH_GRID_RULES = "0.5.22"
OLDEST_CPU_SCHEDULER = "0.5.13"
OLDEST = "0.5.12"

# SGLang's own CPU unit tests (paths in SGLang's repository) that reach the patched code. CI
# cannot reach GitHub, so nothing fetches them: tests/test_sglang_upstream.py runs them with the
# plugin loaded where SGLANG_UPSTREAM_TESTS names a checkout of SGLang at the installed release,
# and skips otherwise.
UPSTREAM_UNIT_TESTS = ("test/registered/unit/managers/test_deterministic_chunk_align.py",)
