"""Shared helpers: real SGLang 0.5.23 objects, with stand-ins only where a GPU is needed.

A real FlashInferAttnBackend.__init__ allocates CUDA buffers and flashinfer
wrappers, so `flashinfer_backend()` builds the instance without __init__ and
sets the state that __init__ derives from the published server config. The
scheduler is likewise built without __init__ (which loads a model), and its
own alignment methods then run in their stock order.
"""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

import sglang_chunk_align

# Nothing here may reach a model hub: SGLang's argument hooks look up model names.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Scheduler.__init__ calls these in this order (test_scheduler pins the order).
ALIGNMENT_STEPS = (
    "init_deterministic_inference_config",
    "init_dsa_kpool_truncation_align",
    "init_mamba_truncation_align",
    "check_truncation_align_fits_chunk",
)


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
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils import get_int_env_var

    backend = (cls or FlashInferAttnBackend).__new__(cls or FlashInferAttnBackend)
    backend.enable_deterministic = get_exec().deterministic.enable_deterministic_inference
    backend.prefill_backend = "fa2"
    backend.skip_prefill = skip_prefill
    backend.prefill_split_tile_size = (
        get_int_env_var("SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", 4096)
        if backend.enable_deterministic
        else None
    )
    backend.token_to_kv_pool = backend.req_to_token_pool = backend.kv_index_translator = None
    return backend


def published(deterministic=True, chunk=256, **fields):
    """SGLang's own test helper: publish a real ServerArgs as the runtime config."""
    from sglang.test.test_utils import published_topology

    return published_topology(
        enable_deterministic_inference=deterministic,
        attention_backend="flashinfer",
        chunked_prefill_size=chunk,
        **fields,
    )


def scheduler_alignment(make_backend=flashinfer_backend, deterministic=True, chunk=256, hf_config=None, tree_cache=None,
                        scheduler_state=None, **fields):
    """Run the Scheduler's own alignment steps; return truncation_align_size (or raise).

    `scheduler_state` (a dict) seeds attributes earlier init steps set, and
    receives the scheduler's attributes afterwards.
    """
    import transformers
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import get_schedule

    with published(deterministic, chunk, **fields) as server_args:
        scheduler = Scheduler.__new__(Scheduler)
        scheduler.server_args = server_args
        scheduler.chunked_prefill_size = get_schedule().chunked_prefill_size  # as init_chunked_prefill reads it
        # Stand-ins: a real ModelConfig needs model files, a real model runner a GPU.
        scheduler.model_config = SimpleNamespace(hf_config=hf_config or transformers.LlamaConfig())
        scheduler.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=make_backend()))
        scheduler.disaggregation_mode = DisaggregationMode.NULL
        scheduler.tree_cache = tree_cache
        vars(scheduler).update(scheduler_state or {})
        for step in ALIGNMENT_STEPS:
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
