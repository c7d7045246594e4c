"""Scheduler wrappers: take the chunk alignment from the live attention backend.

Stock SGLang maps the backend *name* to SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE
(4096) and refuses every smaller chunk. Here the alignment is whatever the
live backend declares as `prefill_chunk_align`, the split-tile variable stays
a pure kernel knob, and SGLang's later LCM steps (DSA kpool, mamba grid) keep
combining with it. Wrappers use wrapt's (wrapped, instance, args, kwargs)
signature; patches.py says where each one goes.
"""

import logging

from . import prefill_hooks, releases
from .alignment import chunk_size_error
from .backends import backend_alignment
from .compat import RADIX_CACHE_ENV, RULES_ENV, env_flag
from .planning import Rules

logger = logging.getLogger("sglang_chunk_align")


def live_backend(scheduler):
    return scheduler.tp_worker.model_runner.attn_backend


def init_alignment_from_backend(wrapped, instance, args, kwargs):
    """Replaces Scheduler.init_deterministic_inference_config."""
    instance.truncation_align_size, _ = backend_alignment(live_backend(instance))


def init_alignment_and_check(wrapped, instance, args, kwargs):
    """Replaces init_deterministic_inference_config on releases without the stock
    startup check (before 0.5.22): without it a chunk below the alignment
    leaves long prompts waiting forever (SGLang issue 36344)."""
    init_alignment_from_backend(wrapped, instance, args, kwargs)
    _check_chunk(instance, rules_available=False)


def check_chunk_serves_alignment(rules_available):
    """Replaces Scheduler.check_truncation_align_fits_chunk, which runs after the LCM steps.

    Where this release has the PrefillAdder patch points, it also activates
    planning.py's rules for them.
    """

    def check(wrapped, instance, args, kwargs):
        _check_chunk(instance, rules_available)

    return check


def _check_chunk(scheduler, rules_available):
    q_tile, declared = backend_alignment(live_backend(scheduler))
    align = scheduler.truncation_align_size
    rules = None
    if q_tile is not None and env_flag(RULES_ENV, True) and rules_available:
        rules = Rules(grid=align, head_dim=getattr(scheduler.model_config, "head_dim", None))
    logger.info(
        "sglang-chunk-align: prefill chunks aligned to %s (%s); grid rules %s",
        f"{align} tokens" if align else "nothing",
        declared,
        "on" if rules else "off" if rules_available else "not available on this SGLang release",
    )
    _check_radix_cache(scheduler, q_tile, rules)
    prefill_hooks.activate(rules)
    if rules is not None:
        _keep_batches_on_solo_tiles(scheduler, rules)
    if _is_decode_server(scheduler):
        return  # A decode server never prefills a prompt.
    problem = chunk_size_error(
        scheduler.chunked_prefill_size, align, q_tile, _attn_dp_size(scheduler.server_args)
    )
    if problem:
        raise ValueError(problem)


def _check_radix_cache(scheduler, q_tile, rules):
    """The radix opt-in matters under deterministic flashinfer, and only with the grid rules."""
    if q_tile is None or not env_flag(RADIX_CACHE_ENV, False):
        return
    if rules is None:
        raise ValueError(
            f"{RADIX_CACHE_ENV}=1 needs the grid rules (SGLang {releases.GRID_RULES} or newer, {RULES_ENV} not 0): "
            f"drop {RADIX_CACHE_ENV}, or turn the rules back on."
        )
    if not getattr(scheduler.tree_cache, "disable", True) and scheduler.tree_cache.supports_mamba():
        raise ValueError(
            f"{RADIX_CACHE_ENV}=1 is not supported with a mamba prefix cache: a prefix rounded to "
            f"the grid would need a mamba state there. Drop {RADIX_CACHE_ENV} for this model."
        )


def _keep_batches_on_solo_tiles(scheduler, rules):
    if getattr(scheduler, "is_mixed_chunk", False):
        scheduler.is_mixed_chunk = False
        logger.warning(
            "sglang-chunk-align: --enable-mixed-chunk turned off: decodes mixed into a prefill "
            "batch move its requests onto a smaller fa2 tile, which breaks bit-exactness."
        )
    chunk = scheduler.chunked_prefill_size
    if chunk is not None and 0 < chunk < 2 * rules.grid:
        logger.warning(
            "sglang-chunk-align: --chunked-prefill-size %s leaves no room to merge a final chunk "
            "shorter than %s tokens into the one before it; such a tail runs on a smaller fa2 tile "
            "and is not bit-exact. Use at least %s.",
            chunk, rules.min_tail, 2 * rules.grid,
        )


def _is_decode_server(scheduler):
    mode = getattr(scheduler, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "decode"


def _attn_dp_size(server_args):
    return server_args.dp_size if getattr(server_args, "enable_dp_attention", False) else 1


def refuse_deterministic_flashinfer(error):
    """A Scheduler.__init__ wrapper for when apply() failed: never run stock alignment silently."""

    def refuse(wrapped, instance, args, kwargs):
        server_args = kwargs.get("server_args", args[0] if args else None)
        if _is_deterministic_flashinfer(server_args):
            raise RuntimeError(
                f"sglang-chunk-align is selected (SGLANG_PLUGINS) but could not patch SGLang: "
                f"{error} Refusing to start deterministic flashinfer with stock chunk "
                f"alignment. Install a supported SGLang, or drop chunk_align from SGLANG_PLUGINS."
            )
        return wrapped(*args, **kwargs)

    return refuse


def _is_deterministic_flashinfer(server_args):
    """From the raw fields: an unset --attention-backend (chosen later, maybe flashinfer) counts."""
    backend = getattr(server_args, "attention_backend", None)
    prefill_backend = getattr(server_args, "prefill_attention_backend", None)
    return getattr(server_args, "enable_deterministic_inference", False) and (
        backend in ("flashinfer", None) or prefill_backend == "flashinfer"
    )
