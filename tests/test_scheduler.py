"""The Scheduler's own alignment steps, stock and patched, on real server configs."""

import contextlib
import inspect
import re

import pytest

import sglang_chunk_align
from sglang_chunk_align import prefill_hooks, releases
from sglang_chunk_align.compat import sglang_at_least
from sglang_chunk_align.kernel_facts import installed_facts
from sglang_chunk_align.planning import Rules
from sglang_chunk_align.harness.standins import (
    backend, bare, flashinfer_backend, published, scheduler, scheduler_alignment, stock_alignment_steps,
)

needs_grid_rules = pytest.mark.needs_grid_rules


def test_stock_scheduler_runs_the_alignment_steps_in_this_order():
    from sglang.srt.managers.scheduler import Scheduler

    source = inspect.getsource(Scheduler.__init__)
    positions = [source.index(f"self.{step}()") for step in stock_alignment_steps()]
    assert positions == sorted(positions)


def assert_stock_refuses_256():
    """Stock aligns to the 4096-token split tile; from 0.5.22 it refuses a smaller chunk,
    before that it accepts one and long prompts would wait forever."""
    if sglang_at_least(releases.STOCK_STARTUP_CHECK):
        with pytest.raises(ValueError, match="SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE"):
            scheduler_alignment(chunk=256)
    else:
        assert scheduler_alignment(chunk=256) == 4096


def test_stock_aligns_to_the_split_tile():
    assert_stock_refuses_256()
    assert scheduler_alignment(chunk=4096) == 4096


def test_plugin_aligns_to_the_q_tile(plugin):
    assert scheduler_alignment(chunk=256) == 128
    assert scheduler_alignment(chunk=128) == 128


def test_remove_restores_stock(plugin):
    assert scheduler_alignment(chunk=256) == 128
    sglang_chunk_align.remove()
    assert_stock_refuses_256()


def test_chunk_below_the_alignment_is_refused(plugin):
    with pytest.raises(ValueError, match="aligned to 128 tokens") as refused:
        scheduler_alignment(chunk=100)
    assert "at least 128" in str(refused.value)
    assert "SPLIT_TILE" not in str(refused.value)


@pytest.mark.parametrize("chunk, sizes", [(200, "128 or 256"), (300, "256 or 384"), (1000, "896 or 1024")])
def test_chunk_off_the_grid_is_refused_with_the_nearest_valid_sizes(plugin, chunk, sizes):
    with pytest.raises(ValueError, match="not a multiple of 128") as refused:
        scheduler_alignment(chunk=chunk)
    assert f"--chunked-prefill-size {sizes}" in str(refused.value)


@pytest.mark.parametrize("chunk", [100, 200])
def test_a_decode_server_is_armed_but_its_chunk_is_not_checked(plugin, chunk):
    """A decode server (PD disaggregation) never prefills a prompt, so an armed one starts with a
    chunk the check refuses a prefill server (below the alignment, off the grid)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    decode = {"disaggregation_mode": DisaggregationMode.DECODE}
    assert scheduler_alignment(chunk=chunk, state=decode) == 128
    assert (prefill_hooks.rules_in_force() is not None) == sglang_at_least(releases.GRID_RULES)


def test_split_tile_variable_does_not_move_the_alignment(plugin, monkeypatch):
    monkeypatch.setenv("SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", "1024")
    assert scheduler_alignment(chunk=256) == 128


def test_split_tile_variable_moves_stock_alignment(monkeypatch):
    """The check above is sensitive: stock follows the variable."""
    monkeypatch.setenv("SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE", "1024")
    assert scheduler_alignment(chunk=1024) == 1024


def test_no_alignment_without_deterministic_inference(plugin):
    assert scheduler_alignment(deterministic=False, chunk=100) is None


def test_no_alignment_when_the_backend_skips_prefill(plugin):
    assert scheduler_alignment(lambda: flashinfer_backend(skip_prefill=True), chunk=100) is None


@pytest.mark.parametrize("chunk", [256, 5000, 8192])
def test_deterministic_triton_keeps_stock_alignment_unarmed_before_the_stock_check(
    monkeypatch, triton_before_the_stock_check, chunk
):
    """Before 0.5.22 stock aligns deterministic triton to 4096 and checks nothing at startup; the
    plugin keeps that alignment (TritonAttnBackend declares it there) and stays unarmed: no chunk
    refused, no grid rules, mixed chunking left on. That release's wrapper and declaration are put
    on this release's Scheduler: what they decide does not depend on the release."""
    import wrapt
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_chunk_align import scheduler_hooks

    init = wrapt.FunctionWrapper(
        vars(Scheduler)["init_deterministic_inference_config"],
        scheduler_hooks.init_alignment_and_check(rules_available=True),
    )
    monkeypatch.setattr(Scheduler, "init_deterministic_inference_config", init)
    with published(True, chunk, attention_backend="triton") as server_args:
        triton_backend = backend(triton_before_the_stock_check, enable_deterministic=True)
        triton = scheduler(server_args, triton_backend, is_mixed_chunk=True)
        triton.init_deterministic_inference_config()
    assert triton.truncation_align_size == 4096
    assert prefill_hooks.rules_in_force() is None and triton.is_mixed_chunk


def test_dp_attention_message_names_the_total_size():
    from sglang_chunk_align.alignment import chunk_size_error

    message = chunk_size_error(100, 128, 128, attn_dp_size=2)
    assert "split across 2 DP attention ranks" in message and "at least 256" in message


@pytest.mark.skipif(not sglang_at_least(releases.ATTN_DP_SIZE), reason=f"--attn-dp-size came with SGLang {releases.ATTN_DP_SIZE}")
def test_dp_attention_size_is_read_as_stock_reads_it(plugin):
    with pytest.raises(ValueError, match="split across 2 DP attention ranks.*at least 256"):
        scheduler_alignment(chunk=100, attn_dp_size=2, tp_size=2)


@pytest.mark.skipif("init_mamba_truncation_align" not in stock_alignment_steps(), reason="SGLang has the mamba LCM step from 0.5.23")
def test_mamba_grid_combines_by_lcm(plugin, monkeypatch):
    from sglang.srt.managers import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "mamba_prefill_chunk_grid", lambda: 256)
    assert scheduler_alignment(chunk=512) == 256
    with pytest.raises(ValueError, match="aligned to 256 tokens"):
        scheduler_alignment(chunk=128)


def test_scheduler_logs_the_chosen_alignment_and_backend(plugin, caplog):
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        scheduler_alignment(chunk=256)
    assert "aligned to 128 tokens (FlashInferAttnBackend.prefill_chunk_align = 128)" in caplog.text


@needs_grid_rules
def test_grid_rules_turn_mixed_chunk_off_with_a_warning(plugin, caplog):
    state = {"is_mixed_chunk": True}
    with caplog.at_level("WARNING", logger="sglang_chunk_align"):
        scheduler_alignment(chunk=256, state=state)
    assert state["is_mixed_chunk"] is False
    assert "--enable-mixed-chunk turned off: a decoding request's row computed as a one-token extend" in caplog.text


def test_mixed_chunk_stays_on_without_the_rules(plugin, monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "0")
    state = {"is_mixed_chunk": True}
    scheduler_alignment(chunk=256, state=state)
    assert state["is_mixed_chunk"] is True


@needs_grid_rules
def test_rules_take_the_grid_from_the_planned_heads_and_log_it(plugin, caplog):
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        scheduler_alignment(lambda: flashinfer_backend(planned=(32, 8, 128)), chunk=128, state={"page_size": 16})
    assert prefill_hooks.rules_in_force() == Rules(group=4, head_dim=128, page_size=16, split_attention=True)
    assert (
        "grid rules on: 32-token grid, pieces over 16 tokens (GQA group 4, head_dim 128, page 16; "
        f"{installed_facts().describe()}), "  # SGLang 0.5.23 pins flashinfer 0.7.2 (measured), 0.5.22 0.7.1 (not)
        "to which radix hits and chunk cuts round down (flashinfer 0.7.4 starts chunks anywhere: "
        "pip install 'flashinfer-python[cu13]==0.7.4'), "  # both start chunks on the grid
        "from FlashInferAttnBackend.indices_updater_prefill: 32 q / 8 KV heads, head_dim 128; "
        "split attention on: one fa2 call per tile class"
    ) in caplog.text
    # Chunk 128 is exact: its short final pieces ride along. (An unmeasured flashinfer warns of that alone.)
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "kernel facts were not measured" not in r.getMessage()]


@needs_grid_rules
@pytest.mark.parametrize("planned, padded", [((32, 8, 128), True), (None, False)])
def test_padded_calls_are_on_where_asked_and_the_startup_line_says_where_they_cannot_be(plugin, monkeypatch, caplog,
                                                                                      planned, padded):
    """SGLANG_CHUNK_ALIGN_PAD_TILES=1 with the backend's head_dim known: final pieces of any length. Where the
    backend does not say its geometry, pads cannot be planned, and the startup line says so instead of
    dropping the switch silently."""
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_PAD_TILES", "1")
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        scheduler_alignment(lambda: flashinfer_backend(planned=planned), chunk=256)
    rules = prefill_hooks.rules_in_force()
    assert rules.pad_tiles is padded and rules.min_final == (1 if padded else rules.min_tail)
    said = ("split attention on: one fa2 call per tile class, padded onto it where its pieces average too few rows"
            if padded else "SGLANG_CHUNK_ALIGN_PAD_TILES=1 ignored: padded calls need split attention and a known head_dim")
    assert said in caplog.text


@pytest.fixture
def flashinfer_release():
    """Make the plugin take the kernel facts of the flashinfer release named, as the harness
    chooses them (kernel_facts.chosen): its WARNING, where unmeasured, is logged when named."""
    from sglang_chunk_align import kernel_facts

    with contextlib.ExitStack() as chosen:
        yield lambda version: chosen.enter_context(kernel_facts.chosen(kernel_facts.release_facts(version)))


@needs_grid_rules
def test_the_installed_flashinfer_sets_the_alignment_and_the_rules(plugin, flashinfer_release, caplog):
    """0.7.4: chunk starts anywhere are exact, so the backend declares 1, a chunk of 192 is accepted
    and the grid is the page; a chunk too short for the full tile is still refused."""
    flashinfer_release("0.7.4")
    planned = lambda: flashinfer_backend(planned=(32, 8, 128))  # noqa: E731
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        assert scheduler_alignment(planned, chunk=192) == 1
    assert (prefill_hooks.rules_in_force().grid, prefill_hooks.rules_in_force().min_tail) == (1, 17)
    assert "aligned to 1 token (chunks start anywhere)" in caplog.text and "flashinfer 0.7.4 kernel facts, measured" in caplog.text
    with pytest.raises(ValueError, match="at least 17"):
        scheduler_alignment(planned, chunk=16)


@needs_grid_rules
def test_an_unmeasured_flashinfer_gets_the_strictest_facts_and_one_warning(plugin, flashinfer_release, caplog):
    flashinfer_release("0.7.9")
    with caplog.at_level("WARNING", logger="sglang_chunk_align"):
        assert scheduler_alignment(chunk=256) == 128
        with pytest.raises(ValueError, match="not a multiple of 128"):
            scheduler_alignment(chunk=192)
    warnings = [r.getMessage() for r in caplog.records if "flashinfer 0.7.9" in r.getMessage()]
    assert len(warnings) == 1 and "sglang-chunk-align probe" in warnings[0]


@pytest.mark.parametrize("planned, unmeasured", [
    ((32, 8, 64), "head_dim 64"),  # Granite-4.0-H's head_dim
    ((24, 8, 128), "GQA group 3 at head_dim 128"),
    ((32, 8, 128), None),
    (None, None),  # geometry unknown: the conservative rules, as the startup line says
])
def test_each_scheduler_warns_once_at_startup_of_a_shape_its_kernel_facts_were_not_measured_at(
    plugin, flashinfer_release, caplog, planned, unmeasured
):
    """The scheduler's startup logs `plan`'s WARNING for the shape (KernelFacts.shape_warning),
    with the facts taken instead and the probe that measures it; a measured shape gets none."""
    facts = flashinfer_release("0.7.2")
    with caplog.at_level("WARNING", logger="sglang_chunk_align"):
        scheduler_alignment(lambda: flashinfer_backend(planned=planned), chunk=256)
    # The shape's warnings: a release without the grid rules warns of that too (compat), whatever the shape.
    warnings = [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "not measured on flashinfer" in r.getMessage()]
    if unmeasured is None:
        assert warnings == []
        return
    group, head_dim = planned[0] // planned[1], planned[2]
    assert warnings == [f"sglang-chunk-align: {facts.shape_warning(group, head_dim)}."]
    assert warnings[0].startswith(f"sglang-chunk-align: {unmeasured}: not measured on flashinfer 0.7.2, whose kernel facts")
    assert f"run `sglang-chunk-align probe --group {group} --head-dim {head_dim}` on a GPU" in warnings[0]


@needs_grid_rules
def test_rules_stay_conservative_where_the_geometry_is_unknown(plugin, caplog):
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        scheduler_alignment(chunk=256)
    assert prefill_hooks.rules_in_force() == Rules(split_attention=True)
    assert "128-token grid, pieces over 64 tokens" in caplog.text and "geometry unknown" in caplog.text


@needs_grid_rules
@pytest.mark.parametrize("why", ["switched off", "multi-item scoring"])
def test_without_split_attention_requests_wait_for_one_tile_and_the_log_says_so(plugin, monkeypatch, caplog, why):
    """SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION=0, or a backend whose plan a group cannot take a slice
    of (split_attention.serves): the rules keep deferring, as before split attention."""
    state = {}
    if why == "switched off":
        monkeypatch.setenv("SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION", "0")
    else:
        state = dict(enable_mis=True)
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        scheduler_alignment(lambda: flashinfer_backend(planned=(32, 8, 128), **state), chunk=128)
    assert prefill_hooks.rules_in_force() == Rules(group=4, head_dim=128)
    assert "split attention off: requests wait to keep each batch on one tile" in caplog.text


@needs_grid_rules
@pytest.mark.parametrize(
    "fields, refused",
    [({"cuda_graph_backend_prefill": "full"}, "--cuda-graph-backend-prefill full"),
     ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "dummy"}, "speculative decoding (EAGLE)")],
)
def test_paths_with_cuda_graph_prefill_tiles_are_refused_with_the_rules(plugin, monkeypatch, fields, refused):
    with pytest.raises(ValueError, match=re.escape(refused)):
        scheduler_alignment(chunk=256, **fields)
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "0")
    assert scheduler_alignment(chunk=256, **fields) == 128


needs_stock_check = pytest.mark.skipif(
    not sglang_at_least(releases.STOCK_STARTUP_CHECK),
    reason=f"Scheduler.check_truncation_align_fits_chunk came with SGLang {releases.STOCK_STARTUP_CHECK}",
)


@needs_stock_check
def test_bare_scheduler_without_a_worker_checks_as_stock(plugin):
    """SGLang's own unit tests call the check on a Scheduler without a worker or backend."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    def check(align, chunk, mode=DisaggregationMode.NULL):
        with published(chunk=chunk) as server_args:
            bare_scheduler = bare(Scheduler, server_args=server_args, truncation_align_size=align,
                                  chunked_prefill_size=chunk, disaggregation_mode=mode)
            bare_scheduler.check_truncation_align_fits_chunk()

    check(4096, 8192)
    check(None, 256)
    check(4096, None)
    check(4096, 256, DisaggregationMode.DECODE)
    with pytest.raises(ValueError, match="at least 4096"):
        check(4096, 256)
    assert prefill_hooks.rules_in_force() is None


@needs_stock_check
def test_no_alignment_arms_no_rules(plugin):
    with published(chunk=256) as server_args:
        stand_in = scheduler(server_args, flashinfer_backend(), truncation_align_size=None)
        stand_in.check_truncation_align_fits_chunk()
    assert prefill_hooks.rules_in_force() is None


@needs_grid_rules
def test_invalid_rules_switch_is_refused(plugin, monkeypatch):
    from sglang_chunk_align.compat import ChunkAlignError

    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "off")
    with pytest.raises(ChunkAlignError, match="SGLANG_CHUNK_ALIGN_RULES='off' is not valid"):
        scheduler_alignment(chunk=256)


def test_radix_opt_in_without_the_grid_rules_is_refused(plugin, monkeypatch):
    """Before the rules reach radix hits and the tree (SGLang 0.5.22), or with the rules turned off
    by SGLANG_CHUNK_ALIGN_RULES=0: refused, never ignored."""
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RADIX_CACHE", "1")
    if not sglang_at_least(releases.RADIX_OPT_IN):
        with pytest.raises(ValueError, match=f"RADIX_CACHE=1 needs SGLang {releases.RADIX_OPT_IN} or newer"):
            scheduler_alignment(chunk=256)
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "0")
    with pytest.raises(ValueError, match="SGLANG_CHUNK_ALIGN_RADIX_CACHE=1 needs"):
        scheduler_alignment(chunk=256)
    assert scheduler_alignment(deterministic=False, chunk=256) is None  # the switch matters only there


def test_releases_without_the_grid_rules_warn_what_is_not_bit_exact(plugin, caplog):
    """On releases before the grid rules the startup check runs with rules_available=False."""
    from sglang_chunk_align import scheduler_hooks

    init_and_check = scheduler_hooks.init_alignment_and_check(rules_available=False)
    with published(chunk=256) as server_args:
        stand_in = scheduler(server_args, flashinfer_backend())
        with caplog.at_level("WARNING", logger="sglang_chunk_align"):
            init_and_check(None, stand_in, (), {})
    assert f"no grid rules on this SGLang release: {releases.WITHOUT_GRID_RULES}." in caplog.text
    caplog.clear()
    with published(deterministic=False, chunk=256) as server_args:
        stand_in = scheduler(server_args, flashinfer_backend())
        init_and_check(None, stand_in, (), {})
    assert "no grid rules" not in caplog.text  # only where deterministic flashinfer runs
