"""Shared helpers: real SGLang objects, with stand-ins only where a GPU is needed.

A real FlashInferAttnBackend.__init__ allocates CUDA buffers and flashinfer
wrappers, so `flashinfer_backend()` builds the instance without __init__ and
sets the state that __init__ derives from the server config. The scheduler is
likewise built without __init__ (which loads a model), and its own alignment
methods then run in their stock order.

The suite runs against whichever supported release is installed (.ci/run
runs it on 0.5.23 and 0.5.13); what a release lacks is skipped with a reason.
"""

import contextlib
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from packaging.version import Version

import sglang_chunk_align
from sglang_chunk_align.compat import installed_version

SGLANG = installed_version()  # None where only the GPU kernel test runs


def sglang_at_least(version):
    return SGLANG is not None and SGLANG >= Version(version)


# The grid rules need admission paths that SGLang 0.5.23 first has (patches.py).
needs_grid_rules = pytest.mark.skipif(
    not sglang_at_least("0.5.23"), reason=f"the grid rules need SGLang 0.5.23 or newer, not {SGLANG}"
)
# Stock SGLang has refused chunks below the alignment at startup since 0.5.22.
STOCK_STARTUP_CHECK = sglang_at_least("0.5.22")
_published = []  # the server args of the innermost published() block

# Nothing here may reach a model hub: SGLang's argument hooks look up model names.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Scheduler.__init__ calls these in this order (test_scheduler pins the order).
ALIGNMENT_STEPS = (
    "init_deterministic_inference_config",
    "init_dsa_kpool_truncation_align",
    "init_mamba_truncation_align",
    "check_truncation_align_fits_chunk",
)


def stock_alignment_steps():
    """The alignment steps this release's Scheduler has (the later ones came in 0.5.20-0.5.23)."""
    from sglang.srt.managers.scheduler import Scheduler

    return [step for step in ALIGNMENT_STEPS if step in vars(Scheduler)]


@pytest.fixture(autouse=True)
def stock_after_each_test():
    yield
    sglang_chunk_align.remove()


@pytest.fixture
def plugin():
    sglang_chunk_align.apply()
    yield
    sglang_chunk_align.remove()


def flashinfer_backend(cls=None, *, skip_prefill=False):
    """A FlashInferAttnBackend (or subclass) in the state its __init__ sets; call inside published()."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.utils import get_int_env_var

    backend = (cls or FlashInferAttnBackend).__new__(cls or FlashInferAttnBackend)
    backend.enable_deterministic = _published[-1].enable_deterministic_inference
    backend.prefill_backend = "fa2"
    backend.skip_prefill = skip_prefill
    backend.prefill_split_tile_size = (
        get_int_env_var("SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", 4096)
        if backend.enable_deterministic
        else None
    )
    backend.token_to_kv_pool = backend.req_to_token_pool = backend.kv_index_translator = None
    return backend


@contextlib.contextmanager
def published(deterministic=True, chunk=256, **fields):
    """A real ServerArgs, published as the runtime config where SGLang has one (0.5.17+)."""
    fields = {
        "enable_deterministic_inference": deterministic, "attention_backend": "flashinfer",
        "chunked_prefill_size": chunk, **fields,
    }
    try:
        from sglang.test.test_utils import published_topology  # SGLang's own test helper
    except ImportError:
        from sglang.srt.server_args import ServerArgs

        publishing = contextlib.nullcontext(ServerArgs(model_path="dummy", **fields))
    else:
        publishing = published_topology(**fields)
    with publishing as server_args:
        _published.append(server_args)
        try:
            yield server_args
        finally:
            _published.pop()


def scheduler_alignment(make_backend=flashinfer_backend, deterministic=True, chunk=256, hf_config=None, tree_cache=None,
                        scheduler_state=None, **fields):
    """Run the Scheduler's own alignment steps; return truncation_align_size (or raise).

    `scheduler_state` (a dict) seeds attributes earlier init steps set, and
    receives the scheduler's attributes afterwards.
    """
    import transformers
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    with published(deterministic, chunk, **fields) as server_args:
        scheduler = Scheduler.__new__(Scheduler)
        scheduler.server_args = server_args
        scheduler.chunked_prefill_size = server_args.chunked_prefill_size  # as init_chunked_prefill reads it
        # Stand-ins: a real ModelConfig needs model files, a real model runner a GPU.
        scheduler.model_config = SimpleNamespace(hf_config=hf_config or transformers.LlamaConfig())
        scheduler.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=make_backend()))
        scheduler.disaggregation_mode = DisaggregationMode.NULL
        scheduler.tree_cache = tree_cache
        vars(scheduler).update(scheduler_state or {})
        for step in stock_alignment_steps():
            getattr(scheduler, step)()
        if scheduler_state is not None:
            scheduler_state.update(vars(scheduler))
        return scheduler.truncation_align_size


def run_python(code, **env):
    """Run `code` in a fresh interpreter; return the CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def pytest_sessionfinish(session, exitstatus):
    """A run in which every test skipped checked nothing: fail it rather than pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if exitstatus == 0 and reporter is not None and not reporter.stats.get("passed"):
        reporter.write_line("no test passed (all skipped): failing the run", red=True)
        session.exitstatus = 1
