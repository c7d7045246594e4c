"""Stand-ins for the SGLang objects that need a GPU or a model, shared by `doctor`,
the tests and the replay benchmark.

A real FlashInferAttnBackend.__init__ allocates CUDA buffers and flashinfer
wrappers, and Scheduler.__init__ loads a model. So both are built without
__init__ and given the state their __init__ derives from the server config.
Everything else is SGLang's own: real ServerArgs, published as the runtime
config where the release has one, and the Scheduler's own alignment steps,
run in stock order. Imports SGLang only when called.
"""

import contextlib
from types import SimpleNamespace

SPLIT_TILE_ENV = "SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE"
# Scheduler.__init__ calls these in this order (tests/test_scheduler.py pins it from the source).
ALIGNMENT_STEPS = (
    "init_deterministic_inference_config",
    "init_dsa_kpool_truncation_align",
    "init_mamba_truncation_align",
    "check_truncation_align_fits_chunk",
)
_published = []  # the server args of the innermost published() block


@contextlib.contextmanager
def published(deterministic=True, chunk=256, **fields):
    """Real ServerArgs for deterministic flashinfer, published as the runtime config (0.5.17+)."""
    fields = {
        "enable_deterministic_inference": deterministic, "attention_backend": "flashinfer",
        "chunked_prefill_size": chunk, **fields,
    }
    try:
        from sglang.test.test_utils import published_topology  # SGLang's own test helper (0.5.21+)
    except ImportError:
        publishing = _published_without_test_helper(fields)
    else:
        publishing = published_topology(**fields)
    with publishing as server_args:
        _published.append(server_args)
        try:
            yield server_args
        finally:
            _published.pop()


@contextlib.contextmanager
def _published_without_test_helper(fields):
    """Before 0.5.21: publish as SGLang's processes do (runtime_context.publish, 0.5.17+), or
    not at all on releases without a runtime config."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", **fields)
    try:
        from sglang.srt.runtime_context import publish, reset_context
    except ImportError:
        yield server_args
        return
    reset_context()
    publish(server_args, role="test")
    try:
        yield server_args
    finally:
        reset_context()


def bare(cls, **state):
    """An instance built without __init__, holding `state`."""
    instance = cls.__new__(cls)
    vars(instance).update(state)
    return instance


def backend(cls, **state):
    """An attention backend without __init__, holding `state` and the pool references wrappers copy."""
    return bare(cls, token_to_kv_pool=None, req_to_token_pool=None, kv_index_translator=None, **state)


def flashinfer_state(deterministic=None):
    """What FlashInferAttnBackend.__init__ sets for its prefill kernel choice.

    `deterministic` None follows the innermost published() config, and is
    True outside one (doctor asks what backends declare under deterministic inference).
    """
    from sglang.srt.utils import get_int_env_var

    if deterministic is None:
        deterministic = _published[-1].enable_deterministic_inference if _published else True
    return {
        "enable_deterministic": deterministic,
        # Read from the environment under deterministic inference only.
        "prefill_split_tile_size": get_int_env_var(SPLIT_TILE_ENV, 4096) if deterministic else None,
        "prefill_backend": "fa2",
        "skip_prefill": False,
    }


def flashinfer_backend(cls=None, *, deterministic=None, planned=None, **state):
    """A FlashInferAttnBackend (or subclass) in the state its __init__ sets, overridden by `state`.

    `planned` (q heads, KV heads, head_dim per rank) stands for the
    indices_updater_prefill __init__ builds from the model config; without it
    the backend does not say how its prefill is planned.
    """
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    if planned is not None:
        num_qo_heads, num_kv_heads, head_dim = planned
        state["indices_updater_prefill"] = SimpleNamespace(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
        )
    return backend(cls or FlashInferAttnBackend, **{**flashinfer_state(deterministic), **state})


def mamba2_backend(chunk=None):
    """A Mamba2AttnBackend whose kernel chunks `chunk` tokens (None: one that does not say), without
    the model runner its __init__ reads. From 0.5.20 mamba_chunk_size is a property reading the
    model config once; before, an attribute __init__ sets."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend

    linear = bare(Mamba2AttnBackend)
    if chunk is not None:
        reads_config = isinstance(getattr(Mamba2AttnBackend, "mamba_chunk_size", None), property)
        setattr(linear, "_mamba_chunk_size" if reads_config else "mamba_chunk_size", chunk)
    return linear


def stock_alignment_steps():
    """The alignment steps this release's Scheduler has (the later ones came in 0.5.20-0.5.23)."""
    from sglang.srt.managers.scheduler import Scheduler

    return [step for step in ALIGNMENT_STEPS if step in vars(Scheduler)]


def scheduler(server_args, attn_backend, **state):
    """A Scheduler without __init__, holding what its alignment steps read, overridden by `state`.

    Stand-ins: a real ModelConfig needs model files, a real model runner a GPU.
    """
    import transformers
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    chunk = server_args.chunked_prefill_size
    read_by_alignment_steps = {
        "server_args": server_args,
        "chunked_prefill_size": chunk if chunk is not None and chunk > 0 else None,  # as init_chunked_prefill sets it
        "model_config": SimpleNamespace(hf_config=transformers.LlamaConfig()),
        "tp_worker": SimpleNamespace(model_runner=SimpleNamespace(attn_backend=attn_backend)),
        "disaggregation_mode": DisaggregationMode.NULL,
        "tree_cache": None,
    }
    return bare(Scheduler, **{**read_by_alignment_steps, **state})


def run_alignment_steps(scheduler):
    """Run the Scheduler's own alignment steps in stock order; return truncation_align_size (or raise)."""
    for step in stock_alignment_steps():
        getattr(scheduler, step)()
    return scheduler.truncation_align_size


def scheduler_alignment(make_backend=flashinfer_backend, *, deterministic=True, chunk=256, state=None, **fields):
    """Publish ServerArgs, run a stand-in Scheduler's alignment steps: truncation_align_size (or raise).

    `state` (a dict) seeds attributes earlier init steps set, and receives
    the scheduler's attributes afterwards.
    """
    with published(deterministic, chunk, **fields) as server_args:
        stand_in = scheduler(server_args, make_backend(), **(state or {}))
        try:
            return run_alignment_steps(stand_in)
        finally:
            if state is not None:
                state.update(vars(stand_in))
