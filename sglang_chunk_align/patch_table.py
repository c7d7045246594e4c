"""SGLang's patch points, with their reasons and version ranges, in one table for patches.apply().

A point is a class attribute, or a function its caller imports at call time
(handle_deterministic_inference), both looked up when called; or, once, the
module binding its caller uses:
schedule_batch imports match_kv_cache with `from ... import`, so the point is
schedule_batch's name, not mem_cache.common's. Every version comes from
releases.py. A point that only runs planning.py's grid rules says so
(grid_rule=True): doctor reports it off under SGLANG_CHUNK_ALIGN_RULES=0. A
wrapped function's row also holds what its wrapper relies on there
(patches.Wrap's signature, calls and statements), which
tests/test_release_wheels.py checks in every release's source.
"""

from . import backends, decode_wait, gemms, norms, prefill_hooks, releases, scheduler_hooks, split_attention, unsplit_decode
from .patches import ALL_RELEASES, Declare, Wrap

_ATTN = "sglang.srt.layers.attention."
_POLICY = "sglang.srt.managers.schedule_policy"
_SCHEDULER = "sglang.srt.managers.scheduler"
GRID_RULES_RELEASES = f">={releases.GRID_RULES}"
_STOCK_CHECK = releases.STOCK_STARTUP_CHECK
_FLOOR = f">={releases.FLOOR_CHUNKED_TOKENS}"
_BUDGET = f">={releases.MEMORY_BUDGET}"  # the adder's memory budget object answers a continuation's chunk
_BUDGET_MODULE = "sglang.srt.mem_cache.prefill_budget"
_RADIX = f">={releases.RADIX_OPT_IN}"  # the grid rules for radix hits and the tree, and the radix cache kept on
_ALIGN = property(backends.prefill_chunk_align)  # every declaring class's, read from its prefill_declaration


def _declare(module, class_name, declaration, reason, versions=ALL_RELEASES):
    """A backend class's one declaration, `prefill_declaration`, and `prefill_chunk_align` read from
    it (backends.prefill_chunk_align). `declaration`: a getter in backends.py, a backends.Forward,
    or None where the class declares nothing; its prefill_chunk_align is then None on the class
    too, as AttentionBackend's default reads."""
    if declaration is None:
        getter, align = property(backends.declares_nothing), None
    else:
        getter = declaration if isinstance(declaration, backends.Forward) else property(declaration)
        align = _ALIGN
    return (
        Declare(module, f"{class_name}.prefill_declaration", getter, reason, versions),
        Declare(module, f"{class_name}.prefill_chunk_align", align, reason, versions),
    )


def _forward(module, class_name, children, reason, versions=ALL_RELEASES):
    """A wrapper backend forwards the declaration of the children that run its prefill."""
    return _declare(module, class_name, backends.Forward(*children), reason, versions)


PATCH_POINTS = (
    *_declare(_ATTN + "base_attn_backend", "AttentionBackend", None,
              "default: a backend needs no prefill chunk alignment, and its q-tile geometry is unknown, "
              "so the grid rules stay conservative"),
    *_declare(_ATTN + "flashinfer_backend", "FlashInferAttnBackend", backends.flashinfer_declaration,
              "deterministic fa2 paged prefill is exact only for chunks on its 128-row q-tile grid; "
              "the heads and head_dim it is planned with give the grid in packed rows"),
    *_declare(_ATTN + "trtllm_mha_backend", "TRTLLMHAAttnBackend", None,
              "FlashInferAttnBackend subclass whose prefill runs TRT-LLM kernels"),
    *_declare(_ATTN + "llada2_cfg_flashinfer_backend", "LLaDA2CFGFlashInferAttnBackend", None,
              "FlashInferAttnBackend subclass whose diffusion prefill is not chunked fa2",
              f">={releases.LLADA2_CFG_BACKEND}"),
    *_declare(_ATTN + "triton_backend", "TritonAttnBackend", backends.triton_declaration,
              "keeps what these releases aligned deterministic triton to", f"<{_STOCK_CHECK}"),
    *_forward(_ATTN + "hybrid_attn_backend", "HybridAttnBackend", ("prefill_backend",),
              "EXTEND runs on the prefill backend"),
    *_forward(_ATTN + "hybrid_linear_attn_backend", "HybridLinearAttnBackend", ("full_attn_backend", "linear_attn_backend"),
              "full-attention layers prefill on the full-attention child, linear-attention layers on the linear one"),
    *_declare(_ATTN + "hybrid_linear_attn_backend", "Mamba2AttnBackend", backends.mamba2_declaration,
              "Mamba2's chunked scan chunks a prefill batch's packed tokens from the batch's first token, so chunk "
              "starts must join its chunk and a prefill batch hold one request"),
    *_forward(_ATTN + "tbo_backend", "TboAttnBackend", ("primary",),
              "runs its primary's prefill; from 0.5.15 its __getattr__ would, but a base-class default shadows it"),
    *_forward(_ATTN + "minimax_sparse_backend", "MiniMaxHybridAttnBackend", ("dense", "sparse"),
              "dense and sparse layers both prefill; the chunk must suit both", f">={releases.MINIMAX_HYBRID_BACKEND}"),
    *_forward(_ATTN + "dots_hybrid_backend", "DotsSWAMLAAttnBackend", ("backend",),
              "adds latent-cache SWA around its inner backend, which runs the prefill",
              f">={releases.DOTS_HYBRID_BACKENDS}"),
    *_forward(_ATTN + "dots_hybrid_backend", "DotsHybridAttnBackend", ("dsa_backend", "swa_backend"),
              "DSA and SWA layers both prefill; the chunk must suit both", f">={releases.DOTS_HYBRID_BACKENDS}"),
    Wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
         scheduler_hooks.init_alignment_and_check(rules_available=False),
         "stock maps backend names to the 4096-token split tile and has no startup check", f"<{releases.GRID_RULES}",
         signature="self"),
    Wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
         scheduler_hooks.init_alignment_and_check(rules_available=True),
         "as above; it activates the grid rules below", f"{GRID_RULES_RELEASES},<{_STOCK_CHECK}", signature="self"),
    Wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
         scheduler_hooks.init_alignment_from_backend,
         "stock maps backend names to the 4096-token split tile; read the live backend instead", f">={_STOCK_CHECK}",
         signature="self"),
    Wrap(_SCHEDULER, "Scheduler.check_truncation_align_fits_chunk", scheduler_hooks.check_chunk_and_activate_rules,
         "stock points users at the split-tile variable and accepts chunks off the q-tile grid; "
         "it activates the grid rules below", f">={_STOCK_CHECK}", signature="self"),
    Wrap(_SCHEDULER, "Scheduler._should_defer_prefill", decode_wait.bound_decode_wait,
         "stock runs every queued prefill chunk before decode: decoding requests wait behind all of them",
         f">={releases.DECODE_WAIT}", signature="self, running_batch"),
    Wrap(_ATTN + "flashinfer_backend", "FlashInferIndicesUpdaterDecode.call_begin_forward", unsplit_decode.plan_as_graph,
         "deterministic decode splits a request's KV at 2048 when eager (a batch over the CUDA graphs' sizes) and "
         "not in a graph: past 2048 tokens its bits would depend on the batch",
         signature="self, wrapper, ..., *, fixed_split_size, disable_split_kv",
         calls=(("wrapper.begin_forward", "fixed_split_size"), ("wrapper.begin_forward", "disable_split_kv"))),
    Wrap(gemms.KERNEL_MODULE, "_matmul_persistent_triton", gemms.per_m_config,
         "stock launches its batch-invariant GEMM with one 128-row tile at every M: at decode sizes mostly empty rows "
         "and idle SMs; the same kernel with a config per M, its BLOCK_K kept, is checked for stock's bits",
         f">={releases.GEMM_CONFIGS}", signature="a, b, out_dtype, bias",
         statements=(gemms.stock_configs_statement(),)),
    Wrap("sglang.srt.model_executor.model_runner", "ModelRunner.configure_kv_cache_dtype", gemms.tune_at_startup,
         "the step after SGLang turns batch-invariant ops on: the model is loaded, its CUDA graphs not yet captured; "
         "the GEMM configs are tuned there", f">={releases.GEMM_CONFIGS}", signature="self"),
    Wrap(_SCHEDULER, "Scheduler.get_init_info", gemms.report_sums,
         "a server in fast mode sums K unlike stock's GEMMs: /server_info must say so, for verify to refuse a stock "
         "reference", f">={releases.GEMM_CONFIGS}", signature="self"),
    Wrap("sglang.srt.layers.layernorm", "RMSNorm.forward_native", norms.fuse_residual_norm,
         "under batch-invariant mode SGLang runs every RMSNorm that adds a residual here, as eleven kernels; "
         "the same arithmetic runs as three", signature="self, x, residual, post_residual_addition, ...",
         statements=(  # the arithmetic norm_kernels.add_rms_norm restates
             "orig_dtype = self.override_orig_dtype or x.dtype",
             "x = x + residual.to(torch.float32)",
             "residual = x.to(orig_dtype)",
             "variance = x_var.pow(2).mean(dim=-1, keepdim=True)",
             "x = x * torch.rsqrt(variance + self.variance_epsilon)",
             "x = (x * self.weight).to(orig_dtype)",
         )),
    Wrap("sglang.srt.entrypoints.engine", "Engine._launch_subprocesses", scheduler_hooks.refuse_ray_schedulers,
         "Ray scheduler actors never load plugins: refuse deterministic flashinfer there, never run stock",
         signature="cls, server_args, ..."),
    # The grid rules (planning.py), where SGLang has every admission path they need.
    Wrap("sglang.srt.managers.schedule_batch", "match_kv_cache", prefill_hooks.match_on_grid,
         "a radix hit may end anywhere; Req.init_next_round_input calls this module binding", _RADIX,
         grid_rule=True, signature="req, tree_cache, ..., *, max_prefix_len"),
    Wrap(_POLICY, "PrefillAdder._select_prefill_admission", prefill_hooks.admit_on_grid,
         "SGLang floors a new request's chunk length but leaves final pieces too short for the full tile",
         GRID_RULES_RELEASES, grid_rule=True, signature="self, req, ..."),
    Wrap(_POLICY, "PrefillAdder.floor_chunked_tokens", prefill_hooks.hand_back_ignore_eos_cut,
         "stock floors an ignore_eos request's chunk budget here; the grid cut is handed back instead",
         _FLOOR, grid_rule=True, signature="self, trunc_len, remaining"),
    Wrap(_POLICY, "PrefillAdder.add_chunked_req", prefill_hooks.continue_on_grid,
         "a continuation's short final piece rides along: its memory budget is told the slack",
         _BUDGET, grid_rule=True, signature="self, req",
         calls=(("self.memory_budget.available_chunk_tokens", None),
                ("self.memory_budget.fit_chunk", "extend_input_len"))),
    Wrap(_POLICY, "PrefillAdder.add_chunked_req", prefill_hooks.continue_on_grid_by_clamp,
         "as above, and a continuation whose clamp holds no grid cut waits: stock clamps it "
         "itself and has no answer that says wait", f"{GRID_RULES_RELEASES},<{releases.MEMORY_BUDGET}",
         grid_rule=True, signature="self, req",
         statements=(  # the continuation's clamp, which prefill_hooks._stock_clamp restates
             "_rem_tokens = min(self.rem_chunk_tokens, int(self.rem_total_tokens))",
             "if self.is_hybrid_swa and (not self._swa_req_ring):",
             "_rem_tokens = min(_rem_tokens, int(self.rem_swa_tokens) - self.page_size)",
             "if _rem_tokens <= 0:",
             "if self.is_hybrid_swa:",
             "return req",
             "_rem_tokens = self.rem_chunk_tokens",
             "new_len = min(cand_extend_input_len, _rem_tokens)",
         )),
    *(Wrap(_BUDGET_MODULE, f"{budget}.available_chunk_tokens", prefill_hooks.ride_on_budget,
           "a continuation's chunk budget, which its riding final piece's slack raises", _BUDGET, grid_rule=True,
           signature="self, chunk_limit")
      for budget in ("PrefillBudget", "SWAPrefillBudget", "SharedSWAPrefillBudget")),
    *(Wrap(_BUDGET_MODULE, f"{budget}.fit_chunk", prefill_hooks.fit_on_grid,
           "continuation and memory-pressure cuts are not aligned at all; None is stock's wait", _BUDGET,
           grid_rule=True, signature="self, ..., *, extend_input_len")
      for budget in ("PrefillBudget", "SharedSWAPrefillBudget")),
    Wrap(_POLICY, "PrefillAdder.add_one_req_ignore_eos", prefill_hooks.ignore_eos_on_grid,
         "stock cuts an ignore_eos request at the chunk budget, off the grid; one with no grid cut "
         "waits as a continuation does, before it reports to the prefill delayer", _FLOOR, grid_rule=True,
         signature="self, req", calls=(("self.floor_chunked_tokens", None),)),
    Wrap(_POLICY, "PrefillAdder.add_one_req_ignore_eos", prefill_hooks.ignore_eos_on_grid_by_chunk_budget,
         "as above; stock cuts at rem_chunk_tokens itself, which is lowered to the grid cut",
         f"{GRID_RULES_RELEASES},<{releases.FLOOR_CHUNKED_TOKENS}", grid_rule=True, signature="self, req",
         statements=("trunc_len = self.rem_chunk_tokens",)),  # the chunk budget the cut is taken from
    Wrap(_POLICY, "PrefillAdder.add_one_req", prefill_hooks.keep_solo_tiles,
         "fa2 picks one tile per call; a member split attention cannot keep on its solo tile waits, "
         "and requests behind a waiting chunked request would take its KV memory", GRID_RULES_RELEASES,
         grid_rule=True, signature="self, req, has_chunked_req, truncation_align_size"),
    Wrap(_ATTN + "flashinfer_backend", "FlashInferAttnBackend.init_forward_metadata", split_attention.plan_by_tile,
         "fa2 plans one tile per call; a batch mixing tile classes runs as one call per class", GRID_RULES_RELEASES,
         grid_rule=True, signature="self, forward_batch",
         calls=(("self.indices_updater_prefill.update", "prefill_wrappers"),)),
    Wrap("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.checkpoint", prefill_hooks.publish_full_tiles,
         "the tree would serve KV computed in a prompt's partial final q-tile, or by decode", _RADIX,
         grid_rule=True, signature="self, req, ..., *, up_to"),
    Wrap("sglang.srt.arg_groups.attention_hook", "handle_deterministic_inference",
         scheduler_hooks.keep_radix_cache_where_exact,
         "stock turns the radix cache off under deterministic flashinfer; it stays on where the grid rules make it "
         "exact (compat.radix_cache)", _RADIX, signature="server_args",
         # Stock reads the radix backends' list at call time, from the module the wrapper adds flashinfer through.
         statements=("from sglang.srt.server_args import RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND",
                     "if attention_backend not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:")),
)


def failure_guard(error):
    """The point installed only when patching fails, refusing deterministic flashinfer with `error`.

    A failure SGLang's plugin loader swallows must still stop deterministic
    flashinfer from starting with stock alignment. The guard sits on the
    scheduler's first alignment step, which runs once the model runner (and so
    every attention backend in use) exists: a patch point that fails when its
    module is imported there is caught too. It is built around its cause, so
    the refusal names what went wrong and its remedy.
    """
    return Wrap(_SCHEDULER, "Scheduler.init_deterministic_inference_config",
                scheduler_hooks.refuse_deterministic_flashinfer(error),
                "refuse deterministic flashinfer when the plugin could not patch SGLang", signature="self")


def reset():
    """Forget what the hooks activated, the rules, the decode wait, the unsplit decode plan, the
    GEMM configs and the norms' switch: stock SGLang has none of them (patches.remove())."""
    prefill_hooks.activate(None)
    decode_wait.activate(None)
    unsplit_decode.activate(False)
    gemms.activate(None)
    norms.reset()
