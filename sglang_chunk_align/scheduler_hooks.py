"""Scheduler wrappers: take the chunk alignment from the live attention backend; and the
launcher's, which keep the radix cache on where the grid rules make it exact and refuse Ray.

Stock SGLang maps the backend *name* to SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE
(4096) and refuses every smaller chunk. Here the alignment is whatever the
live backend declares as `prefill_chunk_align`, the split-tile variable stays
a pure kernel knob, and SGLang's later LCM steps (DSA kpool, mamba grid) keep
combining with it. Wrappers use wrapt's (wrapped, instance, args, kwargs)
signature; patch_table.py says where each one goes.
"""

import logging
import sys

from . import decode_wait, prefill_hooks, releases, split_attention, unsplit_decode
from .alignment import chunk_size_error
from .backends import NOTHING, facts_needed, planned_prefill
from .compat import (
    DECODE_WAIT_ENV, PAD_TILES_ENV, RULES_ENV, UNSPLIT_DECODE_ENV, check_switches, installed_version,
    radix_cache, sglang_at_least, switch,
)
from .planning import switched_rules

logger = logging.getLogger("sglang_chunk_align")


def live_backend(scheduler):
    """The attention backend the scheduler's model runs, or None on a bare Scheduler
    (SGLang's own unit tests build one without a worker: stock then answers)."""
    worker = getattr(scheduler, "tp_worker", None)
    return worker.model_runner.attn_backend if worker is not None else None


def init_alignment_from_backend(wrapped, instance, args, kwargs):
    """Replaces Scheduler.init_deterministic_inference_config. With no live backend there is
    nothing to read the alignment from, so stock's answer stands."""
    backend = live_backend(instance)
    if backend is None:
        return wrapped(*args, **kwargs)
    instance.truncation_align_size = backend.prefill_chunk_align


def init_alignment_and_check(rules_available):
    """Replaces init_deterministic_inference_config on releases without the stock
    startup check (before 0.5.22): without it a chunk below the alignment
    leaves long prompts waiting forever (SGLang issue 36344). Where this
    release has the PrefillAdder patch points, it also activates planning.py's
    rules for them. Where the plugin is not armed (Startup.armed) stock had no
    check, so none runs.
    """

    def init(wrapped, instance, args, kwargs):
        init_alignment_from_backend(wrapped, instance, args, kwargs)
        startup = _arm(instance, rules_available)
        if startup.armed:
            _check_chunk_size(instance, startup)

    return init


def check_chunk_and_activate_rules(wrapped, instance, args, kwargs):
    """Replaces Scheduler.check_truncation_align_fits_chunk (0.5.22+), which runs after the LCM
    steps, and activates planning.py's rules for the PrefillAdder patch points. Where the
    plugin is not armed, stock's own check answers (its message included)."""
    startup = _arm(instance, rules_available=True)
    if not startup.armed:
        return wrapped(*args, **kwargs)
    _check_chunk_size(instance, startup)


class Startup:
    """What the scheduler's live backend asks of the plugin, decided before anything changes.

    A plain class with slots (patches.py's import-cost rule).
    """

    __slots__ = ("backend", "declared", "facts", "rules", "rules_available", "radix", "radix_refusal", "decode_wait",
                 "decode_wait_note", "unsplit_decode")

    def __init__(self, backend, declared, facts, rules_available):
        self.backend = backend  # the live attention backend, or None on a bare Scheduler
        self.declared = declared  # its prefill_declaration (backends.Declaration)
        self.facts = facts  # the kernel facts its fa2 grid is counted with (backends.facts_needed), or None
        self.rules_available = rules_available  # whether this release has the points the rules need
        # Decided only where armed (_decide), None elsewhere:
        self.rules = None  # the grid rules to activate, or None
        self.radix = None  # the radix cache, on or off and why (_radix_cache)
        self.radix_refusal = None  # why it must not start so (SGLANG_CHUNK_ALIGN_RADIX_CACHE=1), or None
        self.decode_wait = None  # the decode_wait.DecodeWait to activate, or None
        self.decode_wait_note = None  # what the startup line says of it
        self.unsplit_decode = False  # whether eager decode is planned as the CUDA graphs plan it (unsplit_decode.py)

    @property
    def q_tile(self):
        """What the backend declares as prefill_chunk_align."""
        return self.declared.align(self.facts)

    @property
    def armed(self):
        """Whether it declares that alignment for fa2's q-tile grid (deterministic flashinfer, or a
        wrapper forwarding to it): only then does the plugin refuse, change or check anything;
        elsewhere SGLang runs as stock, deterministic triton's kept alignment included."""
        return bool(self.declared.fa2)


def _arm(scheduler, rules_available):
    """Decide, refuse what the decision cannot serve, then apply it; in that order, so that a
    refused configuration changes nothing."""
    startup = _decide(scheduler, rules_available)
    _log(startup, scheduler.truncation_align_size)
    _warn_of_unmeasured_shape(startup)
    if startup.armed:
        _refuse(scheduler, startup)
        if startup.rules is not None:
            _turn_mixed_chunks_off(scheduler)
    prefill_hooks.activate(startup.rules)
    decode_wait.activate(startup.decode_wait)
    unsplit_decode.activate(startup.unsplit_decode)
    return startup


def _decide(scheduler, rules_available):
    backend = live_backend(scheduler)
    declared = backend.prefill_declaration if backend is not None else NOTHING
    facts = facts_needed(declared)  # read here, where SGLang calls in, and passed on
    startup = Startup(backend, declared, facts, rules_available)
    if not startup.armed:
        return startup
    if scheduler.truncation_align_size is not None and rules_available and switch(RULES_ENV):
        startup.rules = _rules_for(scheduler, declared, facts)
    startup.radix, startup.radix_refusal = _radix_cache(scheduler)
    startup.decode_wait, startup.decode_wait_note = _decode_wait(scheduler)
    startup.unsplit_decode = switch(UNSPLIT_DECODE_ENV)
    return startup


def _decode_wait(scheduler):
    """Whether decoding requests wait at most decode_wait.DECODE_WAIT_S behind prefill chunks here,
    and the startup line's words for it."""
    interval = getattr(scheduler, "prefill_decode_interval", 0)
    if not switch(DECODE_WAIT_ENV):
        return None, f"decode waits behind every queued chunk (stock's order; {DECODE_WAIT_ENV}=1 bounds the wait)"
    if interval:
        return None, f"decode waits as --prefill-decode-interval {interval} says (SGLang's own interval)"
    if not sglang_at_least(releases.DECODE_WAIT):
        return None, f"decode waits behind every queued chunk (the bound needs SGLang {releases.DECODE_WAIT} or newer)"
    if getattr(scheduler, "require_mlp_sync", False):
        return None, "decode waits behind every queued chunk (DP attention: ranks must agree on each step)"
    limit_ms = round(decode_wait.DECODE_WAIT_S * 1000)
    return decode_wait.DecodeWait(decode_wait.DECODE_WAIT_S), f"decode waits at most {limit_ms} ms behind prefill chunks"


def _log(startup, align):
    if startup.backend is None:
        return
    logger.info(
        "sglang-chunk-align: prefill chunks aligned to %s (%s.prefill_chunk_align = %s); grid rules %s%s%s%s",
        "nothing" if not align else "1 token (chunks start anywhere)" if align == 1 else f"{align} tokens",
        type(startup.backend).__name__, startup.q_tile,
        _describe_rules(startup.rules, startup.declared) if startup.rules else "off" if startup.rules_available
        else "not available on this SGLang release",
        f"; radix cache {startup.radix}" if startup.radix else "",
        f"; {startup.decode_wait_note}" if startup.decode_wait_note else "",
        f"; {_unsplit_decode_note(startup.unsplit_decode)}" if startup.armed else "",
    )


def _unsplit_decode_note(unsplit):
    if unsplit:
        return "eager decode planned as in CUDA graphs (no KV split: the same bits at every decode batch size)"
    return (f"eager decode splits the KV at 2048 as stock does ({UNSPLIT_DECODE_ENV}=0): a request decoding in a "
            "batch over the CUDA graphs' sizes gets other bits past 2048 tokens")


def _warn_of_unmeasured_shape(startup):
    """Where the kernel facts were not measured at the armed backend's GQA group and head_dim,
    the WARNING `plan` prints for it (KernelFacts.shape_warning), once per scheduler. An unknown
    geometry gets the conservative rules for every model, which the startup line says."""
    geometry = startup.declared.geometry
    if not startup.armed or geometry is None:
        return
    warning = startup.facts.shape_warning(geometry.group, geometry.head_dim)
    if warning:
        logger.warning("sglang-chunk-align: %s.", warning)


def _refuse(scheduler, startup):
    """Configurations the plugin cannot keep bit-exact, refused at startup rather than served."""
    if startup.radix_refusal:
        raise ValueError(startup.radix_refusal)
    if startup.rules is not None:
        _refuse_paths_the_rules_cannot_keep(scheduler.server_args)


def _check_chunk_size(scheduler, startup):
    """The chunk must cover the combined alignment and sit on the q-tile grid; a decode server
    never prefills a prompt, so it is not checked."""
    if _is_decode_server(scheduler):
        return
    if not startup.rules_available:
        logger.warning("sglang-chunk-align: no grid rules on this SGLang release: %s.", releases.WITHOUT_GRID_RULES)
    chunk, align = scheduler.chunked_prefill_size, scheduler.truncation_align_size
    rules = startup.rules
    problem = chunk_size_error(
        chunk, align, startup.q_tile, _attn_dp_size(scheduler), min_piece=rules.min_tail if rules is not None else None
    ) or _workspace_refusal(scheduler, startup)
    if problem:
        raise ValueError(problem)


def _workspace_refusal(scheduler, startup):
    """Whether the longest admitted prompt's worst chunk step fits the workspace of each fa2
    backend the declaration is for (workspace.py)."""
    max_prompt = getattr(scheduler, "max_req_input_len", None)
    if not max_prompt:
        return None
    for planned in filter(None, map(planned_prefill, startup.declared.fa2)):
        problem = planned.refusal(scheduler.chunked_prefill_size, max_prompt, startup.facts.cta_tile)
        if problem:
            return problem
    return None


def _rules_for(scheduler, declared, facts):
    """The grid rules for the live backend's declaration and `facts`: its q-tile geometry
    (conservative where it does not say), split attention where every fa2 backend it is for can
    split its prefill (split_attention.serves) and the switch leaves it on, and padded calls where
    their switch asks (Rules keeps them to split attention at a known head_dim)."""
    page_size = getattr(scheduler, "page_size", None) or 1
    geometry = declared.geometry
    shape = {} if geometry is None else {"group": geometry.group, "head_dim": geometry.head_dim}
    return switched_rules(all(map(split_attention.serves, declared.fa2)), **shape, page_size=page_size, facts=facts,
                          packed_chunk=declared.packed_chunk)


def _describe_rules(rules, declared):
    source = declared.source if declared.geometry else "geometry unknown: the conservative rules for every model"
    split = ("split attention on: one fa2 call per tile class" if rules.split_attention
             else "split attention off: requests wait to keep each batch on one tile")
    if rules.pad_tiles:
        split += ", padded onto it where its pieces average too few rows"
    elif switch(PAD_TILES_ENV):
        split += f"; {PAD_TILES_ENV}=1 ignored: padded calls need split attention and a known head_dim"
    return f"on: {rules.describe()}, from {source}; {split}"


def _refuse_paths_the_rules_cannot_keep(server_args):
    """Paths where fa2 prefill is planned with CUDA-graph tiles (from a maximum q length, not the
    batch average) and no fixed split, so neither the rules nor stock determinism hold."""
    from sglang.srt.runtime_context import get_exec, get_spec

    graphs = get_exec().graph.cuda_graph_config
    prefill_graph = graphs.prefill.backend if graphs is not None else server_args.cuda_graph_backend_prefill
    if str(getattr(prefill_graph, "value", prefill_graph)) == "full":
        raise ValueError(
            "sglang-chunk-align: --cuda-graph-backend-prefill full plans fa2 prefill with CUDA-graph "
            "tiles and no fixed split, so chunked prefill is not bit-exact. Use the default "
            f"(breakable) prefill graph, or set {RULES_ENV}=0 to accept that."
        )
    if get_spec().speculative_algorithm:
        raise ValueError(
            f"sglang-chunk-align: speculative decoding ({get_spec().speculative_algorithm}) plans fa2 "
            "prefill for target verify and draft extend with CUDA-graph tiles and no fixed split, "
            "which the grid rules cannot keep bit-exact. Drop --speculative-algorithm, or set "
            f"{RULES_ENV}=0 to accept that."
        )


def _radix_cache(scheduler):
    """(the radix cache as this armed scheduler runs it, on or off and why; why it must not
    start, or None). The launcher took compat.radix_cache's decision
    (keep_radix_cache_where_exact) from the same switches and release, and from the model,
    whose mamba state the prefix cache tells here; the tree is what came of it."""
    tree = scheduler.tree_cache  # None on a stand-in Scheduler
    mamba = tree is not None and tree.supports_mamba()
    on, why, refusals = radix_cache(check_switches(), installed_version(), mamba)
    tree_on = not getattr(tree, "disable", True)  # a ChunkCache before 0.5.22 has no switch: off
    if refusals or tree_on == on:
        return why, refusals[0] if refusals else None
    if tree_on:  # stock keeps it on for another backend (--attention-backend fa3 with flashinfer prefill, say)
        return "on, as SGLang keeps it for these server args", None
    return "off (--disable-radix-cache, or an SGLang setting that implies it)", None


def _turn_mixed_chunks_off(scheduler):
    """Mixed chunks run a decoding request's new token as a one-token extend in fa2 prefill. Issue
    32 measured that row against the decode step's on an H200 (benchmarks/probe_mixed_decode.py):
    it differs, so the request's next token could change with the batch it landed in."""
    if getattr(scheduler, "is_mixed_chunk", False):
        scheduler.is_mixed_chunk = False
        logger.warning(
            "sglang-chunk-align: --enable-mixed-chunk turned off: a decoding request's row computed as "
            "a one-token extend in a prefill batch differs from its decode step's (measured on an H200, "
            "flashinfer 0.7.2: beside a prefill chunk from 100 KV tokens on, 17 at head_dim 256; in a call "
            "of its own past 2048, where prefill splits the KV at 4096 and decode at 2048), so its next token "
            "could change; decodes run in decode steps."
        )


def _is_decode_server(scheduler):
    mode = getattr(scheduler, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "decode"


def _attn_dp_size(scheduler):
    """Attention data-parallel ranks, as stock's check reads them (--attn-dp-size from 0.5.23):
    through the scheduler module's own binding of get_parallel where it has one."""
    get_parallel = getattr(sys.modules[type(scheduler).__module__], "get_parallel", None)
    if get_parallel is None:
        try:
            from sglang.srt.runtime_context import get_parallel
        except ImportError:  # releases before the published runtime config
            server_args = scheduler.server_args
            return server_args.dp_size if getattr(server_args, "enable_dp_attention", False) else 1
    return get_parallel().attn_dp_size


def refuse_deterministic_flashinfer(error):
    """A Scheduler.init_deterministic_inference_config wrapper for when patching failed:
    never run stock alignment silently."""

    def refuse(wrapped, instance, args, kwargs):
        if _is_deterministic_flashinfer(instance.server_args):
            raise RuntimeError(
                f"sglang-chunk-align is selected (SGLANG_PLUGINS) but could not patch SGLang: "
                f"{error} Refusing to start deterministic flashinfer with stock chunk "
                f"alignment. {error.remedy}"
            )
        return wrapped(*args, **kwargs)

    return refuse


def refuse_ray_schedulers(wrapped, instance, args, kwargs):
    """Wraps the classmethod Engine._launch_subprocesses (`instance` is the class), in the launcher.

    SGLang's Ray scheduler actors never call load_plugins(), so the plugin
    cannot run where the chunks are cut; deterministic flashinfer there would
    silently run stock alignment.
    """
    server_args = kwargs.get("server_args", args[0] if args else None)
    if instance.__module__.startswith("sglang.srt.ray.") and _is_deterministic_flashinfer(server_args):
        raise RuntimeError(
            "sglang-chunk-align is selected (SGLANG_PLUGINS), but SGLang's Ray scheduler actors (--use-ray, "
            "RayEngine) never load plugins, so it cannot align their prefill chunks. Refusing to start "
            "deterministic flashinfer on them: launch without --use-ray (an sglang.Engine inside a Ray actor "
            "is fine: it starts its schedulers as processes, which load the plugin), or drop chunk_align "
            "from SGLANG_PLUGINS."
        )
    return wrapped(*args, **kwargs)


def keep_radix_cache_where_exact(wrapped, instance, args, kwargs):
    """Wraps handle_deterministic_inference, where the launcher resolves its server args.

    Stock turns the radix cache off under deterministic inference on a backend missing from
    RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND, flashinfer among them. Where
    compat.radix_cache keeps it on (_keeps_radix_cache), flashinfer is on that list for the
    call, so stock keeps it on as it does for fa3, --disable-radix-cache included; elsewhere
    stock decides alone. The scheduler logs what came of it and refuses what it cannot serve
    (_radix_cache).
    """
    from sglang.srt.server_args import RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND as radix_backends

    server_args = kwargs.get("server_args", args[0] if args else None)
    if not _keeps_radix_cache(server_args):
        return wrapped(*args, **kwargs)
    radix_backends.append("flashinfer")
    try:
        return wrapped(*args, **kwargs)
    finally:
        radix_backends.remove("flashinfer")


def _keeps_radix_cache(server_args):
    """compat.radix_cache's answer for a server whose prefill runs FlashInferAttnBackend's fa2
    under deterministic inference, where its schedulers arm the plugin; False elsewhere, so an
    absorbed-MLA model (FlashInferMLAAttnBackend) keeps stock's refusal on flashinfer.

    The model config is the one stock resolves server args with; where it cannot be read, its
    mamba state is unknown, and stock decides.
    """
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    view = resolving_view(server_args)
    # Where stock reads the list (rl_on_policy_target turns deterministic inference on): elsewhere
    # the list changes nothing, and reading the model's mamba state would cost an import.
    deterministic = view.enable_deterministic_inference or view.rl_on_policy_target is not None
    if not deterministic or {view.attention_backend, view.prefill_attention_backend} - {None, "flashinfer"}:
        return False
    try:
        model = model_config_of(server_args)
    except Exception:  # stock's handle_deterministic_inference goes on without it too
        return False
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.kv_cache_builder import uses_ssm_state  # what gives the tree its mamba component

    if model.attention_arch == AttentionArch.MLA:
        return False
    on, _, _ = radix_cache(check_switches(), installed_version(), uses_ssm_state(model))
    return on


def _is_deterministic_flashinfer(server_args):
    """From the raw fields: an unset --attention-backend (chosen later, maybe flashinfer) counts."""
    backend = getattr(server_args, "attention_backend", None)
    prefill_backend = getattr(server_args, "prefill_attention_backend", None)
    return getattr(server_args, "enable_deterministic_inference", False) and (
        backend in ("flashinfer", None) or prefill_backend == "flashinfer"
    )
