"""Every patch point, with its reason and SGLang version range, in one table.

apply() checks the SGLang version, resolves every point that the version
gates select, and changes nothing unless all of them are found: a missing or
changed point raises ChunkAlignError naming the version and the symbol.
Each installed point records what its owner's __dict__ held (never read
through getattr, which would bind descriptors), so remove() restores stock
exactly and apply() twice is a no-op.

A point is a class attribute, looked up at call time; a list SGLang reads
at call time; or, once, the module binding its caller uses:
schedule_batch imports match_kv_cache with `from ... import`, so the point is
schedule_batch's name, not mem_cache.common's. Opt-in points are selected
only when their environment switch is 1.

The table checks itself: a point has exactly one kind, no two points a
release selects share a target (their version ranges would overlap, and the
second wrapper would hide the first from remove()), and an install that fails
partway is rolled back before the error is raised.
"""

import importlib
import logging
import sys
import threading
from dataclasses import dataclass, replace
from typing import Callable

import wrapt

from . import backends, prefill_hooks, releases, scheduler_hooks
from .compat import RADIX_CACHE_ENV, ChunkAlignError, admits, check_sglang_version, env_flag, installed_version

logger = logging.getLogger("sglang_chunk_align")

_ATTN = "sglang.srt.layers.attention."
_POLICY = "sglang.srt.managers.schedule_policy"
_SCHEDULER = "sglang.srt.managers.scheduler"
ALL_RELEASES = ""  # every release compat.SUPPORTED_SGLANG admits
GRID_RULES_RELEASES = f">={releases.GRID_RULES}"
_STOCK_CHECK = releases.STOCK_STARTUP_CHECK
_FLOOR = f">={releases.FLOOR_CHUNKED_TOKENS}"
_BUDGET = f">={releases.MEMORY_BUDGET}"  # the adder's memory budget object answers a continuation's chunk
_BUDGET_MODULE = "sglang.srt.mem_cache.prefill_budget"
_RADIX = f">={releases.RADIX_OPT_IN}"  # the grid rules for radix hits and the tree, and the radix opt-in
_ABSENT = object()


# Neither frozen nor compared by value: every method a dataclass generates costs each process
# that loads plugins ~1 ms at import (commit 304b862), and nothing changes or compares the table's points.
@dataclass(eq=False)
class PatchPoint:
    module: str
    target: str  # "Class.attribute", or "attribute" of the module
    versions: str  # a version gate (compat.admits): ">=0.5.22", "<0.5.22", ALL_RELEASES
    reason: str
    # Exactly one of: a wrapt wrapper for an existing function or method; a
    # new attribute value to declare; an item to add to an existing list.
    wrapper: Callable = None
    declare: object = _ABSENT
    member: object = _ABSENT
    opt_in: str = None  # environment switch (compat.env_flag) that selects the point
    # It only runs planning.py's grid rules, which SGLANG_CHUNK_ALIGN_RULES=0 turns off (doctor says so).
    grid_rule: bool = False

    def __post_init__(self):
        kinds = (self.wrapper is not None) + (self.declare is not _ABSENT) + (self.member is not _ABSENT)
        if kinds != 1:
            raise ValueError(f"patch point {self.name}: give exactly one of wrapper, declare and member")

    @property
    def name(self):
        return f"{self.module}.{self.target}"

    @property
    def class_and_attribute(self):
        """(the owning class's name, or None for a module attribute; the attribute's name)."""
        class_name, _, attribute = self.target.rpartition(".")
        return class_name or None, attribute


def owner_of(point):
    """(the module or class whose __dict__ holds the point's attribute, the attribute's name).

    Imports the point's module; raises ImportError or AttributeError where SGLang lacks it.
    """
    class_name, attribute = point.class_and_attribute
    owner = importlib.import_module(point.module)
    return (getattr(owner, class_name) if class_name else owner), attribute


def _declare(module, target, value, reason, versions=ALL_RELEASES):
    return PatchPoint(module, target, versions, reason, declare=value)


def _wrap(module, target, wrapper, reason, versions=ALL_RELEASES):
    return PatchPoint(module, target, versions, reason, wrapper=wrapper)


def _grid_rule(module, target, wrapper, reason, versions):
    """A wrapper that only runs planning.py's grid rules (prefill_hooks.py)."""
    return PatchPoint(module, target, versions, reason, wrapper=wrapper, grid_rule=True)


def _add_member(module, target, member, reason, opt_in, versions=ALL_RELEASES):
    return PatchPoint(module, target, versions, reason, member=member, opt_in=opt_in)


def _forward(module, class_name, children, reason, versions=ALL_RELEASES):
    """A wrapper backend forwards both declarations from the children that run its prefill."""
    return (
        _declare(module, f"{class_name}.prefill_chunk_align", property(backends.forward_to(*children)), reason, versions),
        _declare(module, f"{class_name}.prefill_q_tile_geometry", property(backends.forward_geometry_to(*children)),
                 reason, versions),
    )


PATCH_POINTS = (
    _declare(_ATTN + "base_attn_backend", "AttentionBackend.prefill_chunk_align", None,
             "default: a backend needs no prefill chunk alignment"),
    _declare(_ATTN + "base_attn_backend", "AttentionBackend.prefill_q_tile_geometry", None,
             "default: the q-tile geometry is unknown, so the grid rules stay conservative"),
    _declare(_ATTN + "flashinfer_backend", "FlashInferAttnBackend.prefill_chunk_align",
             property(backends.flashinfer_prefill_chunk_align),
             "deterministic fa2 paged prefill is exact only for chunks on its 128-row q-tile grid"),
    _declare(_ATTN + "flashinfer_backend", "FlashInferAttnBackend.prefill_q_tile_geometry",
             property(backends.flashinfer_q_tile_geometry),
             "the heads and head_dim fa2 prefill is planned with: the grid in packed rows"),
    _declare(_ATTN + "trtllm_mha_backend", "TRTLLMHAAttnBackend.prefill_chunk_align", None,
             "FlashInferAttnBackend subclass whose prefill runs TRT-LLM kernels"),
    _declare(_ATTN + "llada2_cfg_flashinfer_backend",
             "LLaDA2CFGFlashInferAttnBackend.prefill_chunk_align", None,
             "FlashInferAttnBackend subclass whose diffusion prefill is not chunked fa2",
             f">={releases.LLADA2_CFG_BACKEND}"),
    _declare(_ATTN + "triton_backend", "TritonAttnBackend.prefill_chunk_align",
             property(backends.triton_prefill_chunk_align),
             "keeps what these releases aligned deterministic triton to", f"<{_STOCK_CHECK}"),
    *_forward(_ATTN + "hybrid_attn_backend", "HybridAttnBackend", ("prefill_backend",),
              "EXTEND runs on the prefill backend"),
    *_forward(_ATTN + "hybrid_linear_attn_backend", "HybridLinearAttnBackend", ("full_attn_backend",),
              "full-attention layers run on the full-attention child; the mamba grid is SGLang's own LCM step"),
    *_forward(_ATTN + "tbo_backend", "TboAttnBackend", ("primary",),
              "runs its primary's prefill; from 0.5.15 its __getattr__ would, but a base-class default shadows it"),
    *_forward(_ATTN + "minimax_sparse_backend", "MiniMaxHybridAttnBackend", ("dense", "sparse"),
              "dense and sparse layers both prefill; the chunk must suit both", f">={releases.MINIMAX_HYBRID_BACKEND}"),
    *_forward(_ATTN + "dots_hybrid_backend", "DotsSWAMLAAttnBackend", ("backend",),
              "adds latent-cache SWA around its inner backend, which runs the prefill",
              f">={releases.DOTS_HYBRID_BACKENDS}"),
    *_forward(_ATTN + "dots_hybrid_backend", "DotsHybridAttnBackend", ("dsa_backend", "swa_backend"),
              "DSA and SWA layers both prefill; the chunk must suit both", f">={releases.DOTS_HYBRID_BACKENDS}"),
    _wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
          scheduler_hooks.init_alignment_and_check(rules_available=False),
          "stock maps backend names to the 4096-token split tile and has no startup check", f"<{releases.GRID_RULES}"),
    _wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
          scheduler_hooks.init_alignment_and_check(rules_available=True),
          "as above; it activates the grid rules below", f"{GRID_RULES_RELEASES},<{_STOCK_CHECK}"),
    _wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
          scheduler_hooks.init_alignment_from_backend,
          "stock maps backend names to the 4096-token split tile; read the live backend instead", f">={_STOCK_CHECK}"),
    _wrap(_SCHEDULER, "Scheduler.check_truncation_align_fits_chunk", scheduler_hooks.check_chunk_and_activate_rules,
          "stock points users at the split-tile variable and accepts chunks off the q-tile grid; "
          "it activates the grid rules below", f">={_STOCK_CHECK}"),
    _wrap("sglang.srt.entrypoints.engine", "Engine._launch_subprocesses", scheduler_hooks.refuse_ray_schedulers,
          "Ray scheduler actors never load plugins: refuse deterministic flashinfer there, never run stock"),
    # The grid rules (planning.py), where SGLang has every admission path they need.
    _grid_rule("sglang.srt.managers.schedule_batch", "match_kv_cache", prefill_hooks.match_on_grid,
                "a radix hit may end anywhere; Req.init_next_round_input calls this module binding", _RADIX),
    _grid_rule(_POLICY, "PrefillAdder._select_prefill_admission", prefill_hooks.admit_on_grid,
                "SGLang floors a new request's chunk length but leaves final pieces too short for the full tile",
                GRID_RULES_RELEASES),
    _grid_rule(_POLICY, "PrefillAdder.floor_chunked_tokens", prefill_hooks.hand_back_ignore_eos_cut,
                "stock floors an ignore_eos request's chunk budget here; the grid cut is handed back instead",
                _FLOOR),
    _grid_rule(_POLICY, "PrefillAdder.add_chunked_req", prefill_hooks.continue_on_grid,
                "a continuation's short final piece rides along: its memory budget is told the slack",
                _BUDGET),
    _grid_rule(_POLICY, "PrefillAdder.add_chunked_req", prefill_hooks.continue_on_grid_by_clamp,
                "as above, and a continuation whose clamp holds no grid cut waits: stock clamps it "
                "itself and has no answer that says wait", f"{GRID_RULES_RELEASES},<{releases.MEMORY_BUDGET}"),
    *(_grid_rule(_BUDGET_MODULE, f"{budget}.available_chunk_tokens", prefill_hooks.ride_on_budget,
                 "a continuation's chunk budget, which its riding final piece's slack raises", _BUDGET)
      for budget in ("PrefillBudget", "SWAPrefillBudget", "SharedSWAPrefillBudget")),
    *(_grid_rule(_BUDGET_MODULE, f"{budget}.fit_chunk", prefill_hooks.fit_on_grid,
                 "continuation and memory-pressure cuts are not aligned at all; None is stock's wait", _BUDGET)
      for budget in ("PrefillBudget", "SharedSWAPrefillBudget")),
    _grid_rule(_POLICY, "PrefillAdder.add_one_req_ignore_eos", prefill_hooks.ignore_eos_on_grid,
                "stock cuts an ignore_eos request at the chunk budget, off the grid; one with no grid cut "
                "waits as a continuation does, before it reports to the prefill delayer", _FLOOR),
    _grid_rule(_POLICY, "PrefillAdder.add_one_req_ignore_eos", prefill_hooks.ignore_eos_on_grid_by_chunk_budget,
                "as above; stock cuts at rem_chunk_tokens itself, which is lowered to the grid cut",
                f"{GRID_RULES_RELEASES},<{releases.FLOOR_CHUNKED_TOKENS}"),
    _grid_rule(_POLICY, "PrefillAdder.add_one_req", prefill_hooks.keep_solo_tiles,
                "fa2 picks one tile per batch; thin batches move members off their solo tile, "
                "and requests behind a waiting chunked request would take its KV memory", GRID_RULES_RELEASES),
    _grid_rule("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.checkpoint",
               prefill_hooks.publish_full_tiles,
                "the tree would serve KV computed in a prompt's partial final q-tile, or by decode", _RADIX),
    _add_member("sglang.srt.arg_groups.choices", "RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND",
                "flashinfer", "stock turns the radix cache off under deterministic flashinfer",
                RADIX_CACHE_ENV, _RADIX),
)

# Installed only when patching fails, so that a failure SGLang's plugin loader
# swallows still stops deterministic flashinfer from starting with stock alignment.
# It sits on the scheduler's first alignment step, which runs once the model
# runner (and so every attention backend in use) exists: a patch point that
# fails when its module is imported there is caught too. Its wrapper is a
# factory: install_failure_guard() builds the wrapper around the cause.
FAILURE_GUARD = _wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
                      scheduler_hooks.refuse_deterministic_flashinfer,
                      "refuse deterministic flashinfer when the plugin could not patch SGLang")

STOCK, APPLIED, GUARDED = "stock", "applied", "guarded"  # what this process has installed
_lock = threading.RLock()  # re-entered when installing a point imports a module with a pending hook
_state = STOCK
_version = None  # the SGLang release the points were selected for
_installed = {}  # point name -> (point, owner, attribute, what owner.__dict__ held)
_pending = {}  # module name -> points to install when SGLang imports it
_hooked = set()  # modules with a post-import hook (wrapt cannot unregister one; it checks _pending)


def apply(now=False):
    """Install every patch point for the installed SGLang; a no-op when already applied.

    Points in modules this process has imported are installed at once, all
    resolved before anything changes; the others when SGLang imports their
    module (a post-import hook), so a process that never schedules pays
    almost nothing. `now` imports them all here instead (doctor, tests). A
    point that fails when its module is imported restores stock SGLang,
    logs an ERROR and installs the failure guard.
    """
    global _state, _version
    with _lock:
        if _state == APPLIED:
            return
        version = installed_version()
        warning = check_sglang_version(version)
        if warning:
            logger.warning("sglang-chunk-align: %s", warning)
        by_module = {}
        for point in selected_points(version):
            by_module.setdefault(point.module, []).append(point)
        ready = {module for module in by_module if now or module in sys.modules}
        resolved = [(point, *_resolve(point, version)) for module in ready for point in by_module[module]]
        _restore_all()  # drops a failure guard left by an earlier attempt
        _install_all(resolved, version)
        _state, _version = APPLIED, version
        for module in by_module.keys() - ready:
            _install_when_imported(module, by_module[module])


def install_failure_guard(error):
    """Make the scheduler refuse deterministic flashinfer, citing `error`; only over stock SGLang."""
    global _state
    with _lock:
        if _state != STOCK:
            return
        _state = GUARDED
        _install_when_imported(FAILURE_GUARD.module, [replace(FAILURE_GUARD, wrapper=FAILURE_GUARD.wrapper(error))])


def state():
    """STOCK, APPLIED, or GUARDED (only the failure guard is installed)."""
    return _state


def remove():
    """Restore every patched attribute to exactly what stock SGLang had, and install nothing later."""
    with _lock:
        _restore_all()


def installed_names():
    return set(_installed)


def release_points(version):
    """The points whose version gate admits `version`, opt-in or not; at most one per target."""
    points = [p for p in PATCH_POINTS if admits(p.versions, version)]
    names = [p.name for p in points]
    overlapping = sorted({name for name in names if names.count(name) > 1})
    if overlapping:
        raise ChunkAlignError(
            f"SGLang {version}: the patch table selects {', '.join(overlapping)} more than once "
            f"(overlapping version ranges); nothing was patched."
        )
    return points


def selected_points(version):
    """The points apply() installs on `version`: its release points, less opt-ins left off."""
    return [p for p in release_points(version) if p.opt_in is None or env_flag(p.opt_in, False)]


def _install_all(resolved, version):
    """Install resolved points; one that fails rolls every installed point back."""
    for point, owner, attribute, stock in resolved:
        try:
            _install(point, owner, attribute, stock)
        except Exception as error:
            _restore_all()
            raise ChunkAlignError(
                f"SGLang {version}: installing patch point {point.name} failed "
                f"({type(error).__name__}: {error}); every point was restored to stock."
            ) from error


def _install_when_imported(module, points):
    _pending[module] = points
    if module in sys.modules:
        _on_import(sys.modules[module])
    elif module not in _hooked:
        _hooked.add(module)
        wrapt.register_post_import_hook(_on_import, module)


def _on_import(module):
    """Install the points pending for `module`, which SGLang has just imported."""
    with _lock:
        points = _pending.pop(module.__name__, None)
        if not points:
            return
        try:
            _install_all([(point, *_resolve(point, _version)) for point in points], _version)
        except ChunkAlignError as error:  # never raised into SGLang's import
            if _state == GUARDED:
                logger.error("sglang-chunk-align: could not install its failure guard either: %s", error)
                return
            logger.error("%s", error.failure_report())
            _restore_all()
            install_failure_guard(error)


def _install(point, owner, attribute, stock):
    if point.wrapper is not None:
        wrapt.wrap_function_wrapper(owner, attribute, point.wrapper)
    elif point.member is not _ABSENT:
        stock.append(point.member)
    else:
        setattr(owner, attribute, point.declare)
    _installed[point.name] = (point, owner, attribute, stock)


def _restore_all():
    global _state
    for point, owner, attribute, stock in reversed(list(_installed.values())):
        if point.member is not _ABSENT:
            stock.remove(point.member)
        elif stock is _ABSENT:
            delattr(owner, attribute)
        else:
            setattr(owner, attribute, stock)
    _installed.clear()
    _pending.clear()
    _state = STOCK
    prefill_hooks.activate(None)


def _resolve(point, version):
    """(owner, attribute, stock value in its __dict__), or ChunkAlignError."""
    try:
        owner, attribute = owner_of(point)
    except (ImportError, AttributeError) as error:
        raise ChunkAlignError(
            f"SGLang {version}: patch point {point.name} is missing or does not import "
            f"({type(error).__name__}: {error}); nothing was patched."
        ) from error
    # A failure guard on this target is dropped before the point goes in: stock is what it replaced.
    stock = _installed[point.name][3] if point.name in _installed else owner.__dict__.get(attribute, _ABSENT)
    if point.wrapper is not None and not (callable(stock) or isinstance(stock, classmethod)):
        raise ChunkAlignError(
            f"SGLang {version}: patch point {point.name} is missing: "
            f"no function {attribute} there; nothing was patched."
        )
    if point.member is not _ABSENT:
        if not isinstance(stock, list) or point.member in stock:
            raise ChunkAlignError(
                f"SGLang {version}: patch point {point.name} has changed: expected a list "
                f"without {point.member!r}; nothing was patched."
            )
    elif point.wrapper is None and stock is not _ABSENT:
        raise ChunkAlignError(
            f"SGLang {version}: patch point {point.name} already exists in SGLang; "
            f"this release needs a newer sglang-chunk-align. Nothing was patched."
        )
    return owner, attribute, stock
