"""Where the plugin is not armed, SGLang runs as stock: differential tests.

"Not armed": no deterministic flashinfer backend, no live backend (a
Scheduler built without a worker, as SGLang's own unit tests build one), or
the grid rules not in force. There every patched function must return what
stock returns and raise what stock raises, message included; an exception
stock is not known to raise there fails the test rather than compare equal. Each test sends
the same inputs through stock SGLang and through SGLang with the plugin
loaded, and compares the outcomes; generated inputs where the space is large.
The patch points' stock call sites are SGLang's own: the Scheduler's
alignment steps, and PrefillAdder, Req.init_next_round_input (match_kv_cache)
and the radix tree's checkpoint driven by the tests' scheduling loop.

In process the plugin is loaded with apply(); SGLang's own loader
(load_plugins() with SGLANG_PLUGINS=chunk_align) loads it once per
interpreter, so that way runs in fresh interpreters.
"""

import json
import os
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import sglang_chunk_align
from sglang_chunk_align import prefill_hooks, releases
from sglang_chunk_align.harness import standins
from sglang_chunk_align.compat import RADIX_CACHE_ENV, RULES_ENV, installed_version, sglang_at_least
from sglang_chunk_align.planning import Rules

needs_stock_check = pytest.mark.skipif(
    not sglang_at_least(releases.STOCK_STARTUP_CHECK),
    reason=f"Scheduler.check_truncation_align_fits_chunk came with SGLang {releases.STOCK_STARTUP_CHECK}",
)
EXAMPLES = int(os.environ.get("UNARMED_EXAMPLES", 40))
SWITCH_VALUES = st.sampled_from([None, "0", "1"])  # apply() refuses invalid ones (tests/test_failures.py)


def outcome(call, raises=()):
    """What `call()` returned, or the type and message of what it raised where that is one of
    `raises`, the exceptions stock answers with there. Anything else propagates and fails the
    test: stock and the plugin crashing alike is no agreement."""
    try:
        return "returned", call()
    except raises as error:
        return "raised", type(error).__name__, str(error)


def stock_and_plugin(call, raises=()):
    """(outcome under stock SGLang, outcome with the plugin applied); stock again afterwards."""
    sglang_chunk_align.remove()
    stock = outcome(call, raises)
    sglang_chunk_align.apply()
    try:
        return stock, outcome(call, raises)
    finally:
        sglang_chunk_align.remove()


@contextmanager
def switches(**values):
    """The plugin's environment switches set to `values` (None: unset), restored afterwards."""
    with mock.patch.dict(os.environ):
        for name, value in values.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)
        yield


def unarmed_backends():
    """Live backends of servers without deterministic flashinfer: flashinfer without deterministic
    inference, and deterministic triton, which stock aligns to nothing from 0.5.22. (A deterministic
    flashinfer backend that skips prefill declares no alignment, where stock aligns to the split
    tile by the backend's name: one of the intended differences, tests/test_scheduler.py.)"""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return {
        "flashinfer": lambda: standins.flashinfer_backend(deterministic=False),
        "triton": lambda: standins.backend(TritonAttnBackend, enable_deterministic=True),
    }


def bare_scheduler(backend=None, **state):
    """A Scheduler without __init__ holding only `state`: with a worker only when `backend` is given."""
    from sglang.srt.managers.scheduler import Scheduler

    if backend is not None:
        state["tp_worker"] = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend))
    return standins.bare(Scheduler, **state)


@needs_stock_check
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("attention_backend", ["flashinfer", "triton", "torch_native"])
@pytest.mark.parametrize("split_tile", [None, "128", "1024"])
def test_alignment_without_a_live_backend_is_stock(deterministic, attention_backend, split_tile):
    """init_deterministic_inference_config on a Scheduler without a worker: stock's answer stands,
    the split-tile variable included."""
    def align():
        scheduler = bare_scheduler()
        scheduler.init_deterministic_inference_config()
        return scheduler.truncation_align_size

    with switches(SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE=split_tile), standins.published(
        deterministic, 256, attention_backend=attention_backend
    ):
        stock, plugin = stock_and_plugin(align)
    assert plugin == stock


@needs_stock_check
@settings(max_examples=EXAMPLES * 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    backend=st.sampled_from([None, "flashinfer", "triton"]),
    align=st.one_of(st.none(), st.sampled_from([128, 256, 4096, 8192]), st.integers(1, 10_000)),
    chunk=st.one_of(st.none(), st.sampled_from([-1, 128, 2048, 4096]), st.integers(-1, 20_000)),
    attn_dp_size=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(["NULL", "PREFILL", "DECODE"]),
    rules_switch=SWITCH_VALUES,
    radix_switch=SWITCH_VALUES,
)
def test_startup_check_where_unarmed_is_stock(backend, align, chunk, attn_dp_size, mode, rules_switch, radix_switch):
    """check_truncation_align_fits_chunk, as SGLang's own tests call it (a bare Scheduler, get_parallel
    patched in the scheduler module) and with a live backend that declares no alignment: the same
    return or ValueError, message included, whatever the plugin's switches say."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler as scheduler_module

    def check():
        scheduler = bare_scheduler(
            unarmed_backends()[backend]() if backend else None,
            truncation_align_size=align, chunked_prefill_size=chunk,
            disaggregation_mode=getattr(DisaggregationMode, mode),
        )
        return scheduler.check_truncation_align_fits_chunk()

    parallel = SimpleNamespace(attn_dp_size=attn_dp_size)
    with switches(**{RULES_ENV: rules_switch, RADIX_CACHE_ENV: radix_switch}), mock.patch.object(
        scheduler_module, "get_parallel", return_value=parallel
    ), standins.published(False, chunk):
        stock, plugin = stock_and_plugin(check, raises=ValueError)  # stock's refusal
    assert plugin == stock
    assert prefill_hooks.rules_in_force() is None


@needs_stock_check
@pytest.mark.parametrize("kind", ["flashinfer", "triton"])
@pytest.mark.parametrize("chunk", [100, 200, 256, 4096, None])
def test_alignment_steps_with_an_unarmed_live_backend_are_stock(kind, chunk):
    """All of the Scheduler's alignment steps in stock order, on a stand-in Scheduler whose live
    backend declares no alignment (the DSA kpool and mamba LCM steps included)."""
    with standins.published(kind == "triton", chunk, attention_backend=kind) as server_args:
        stock, plugin = stock_and_plugin(
            lambda: standins.run_alignment_steps(standins.scheduler(server_args, unarmed_backends()[kind]()))
        )
    assert plugin == stock


# --- The launcher's radix-cache decision (handle_deterministic_inference), where no scheduler arms.

# Server args whose prefill does not run FlashInferAttnBackend's fa2 under deterministic inference.
UNARMED_SERVERS = [
    ("attention", {"enable_deterministic_inference": False, "attention_backend": "flashinfer"}),
    ("attention", {"enable_deterministic_inference": True, "attention_backend": "triton"}),
    ("attention", {"enable_deterministic_inference": True, "attention_backend": "fa3"}),
    ("attention", {"enable_deterministic_inference": True, "attention_backend": "flashinfer",
                   "prefill_attention_backend": "fa3"}),
    ("mla", {"enable_deterministic_inference": True, "attention_backend": "flashinfer"}),  # FlashInferMLAAttnBackend
]


@pytest.mark.needs_radix_opt_in
def test_the_launchers_radix_cache_decision_where_unarmed_is_stock(model_paths, resolved_by_launcher):
    """The same radix cache, or the same error (stock refuses absorbed MLA on flashinfer), and the
    same log lines, whatever the plugin's radix switch says."""
    cases = [(model_paths[model], {} if radix is None else {RADIX_CACHE_ENV: radix}, fields)
             for model, fields in UNARMED_SERVERS for radix in (None, "0", "1")]
    outcomes = resolved_by_launcher(cases)
    assert outcomes["plugin"] == outcomes["stock"]
    assert {outcome[0] for outcome in outcomes["stock"]} == {"disable_radix_cache", "ValueError"}
    assert {outcome[1] for outcome in outcomes["stock"] if outcome[0] == "disable_radix_cache"} == {False, True}


# --- PrefillAdder, match_kv_cache and the radix tree's checkpoint, with the rules not in force.

prompt = st.tuples(st.integers(1, 1500), st.integers(0, 1500), st.integers(0, 8), st.booleans())


def schedule(prompts, chunk, align, kv_tokens, radix, page_size, plugin, deterministic):
    """SGLang's scheduling loop (tests' harness) over `prompts` [(length, shared, arrival, ignore_eos)],
    with the plugin loaded but its rules off (SGLANG_CHUNK_ALIGN_RULES=0) or without deterministic
    inference; the same alignment `align` both ways, so that only the admission paths differ."""
    from benchmarks import workload
    from sglang_chunk_align.harness import scheduler_driver

    requests, arrivals = [], []
    for rid, (prompt_len, shared_len, arrival, _) in enumerate(prompts):
        shared_len = min(shared_len, prompt_len - 1)
        request = workload.RequestSpec(rid, arrival, prompt_len, 0 if shared_len else -1, shared_len, 2)
        tokens = [7] * shared_len + [workload.MARKER_BASE + rid] + [11 + rid] * (prompt_len - shared_len - 1)
        arrivals.append((request, tokens))
        requests.append(request)
    ignore_eos = {rid for rid, p in enumerate(prompts) if p[3]}

    class Driver(scheduler_driver.SchedulerDriver):
        def make_req(self, request, tokens):
            req = super().make_req(request, tokens)
            req.sampling_params.ignore_eos = request.rid in ignore_eos
            return req

    spec = workload.WorkloadSpec(
        n_requests=len(prompts), max_prompt=max(p[0] for p in prompts), n_prefix_groups=1,
        shared_fraction=0.5, max_output=2, n_waves=1, wave_gap_steps=1, kv_tokens=kv_tokens,
        max_running_requests=8,
    )
    cfg = workload.SchedulingConfig("differential", chunk, deterministic=deterministic, plugin=plugin, rules=False)
    with scheduler_driver.sglang_config(cfg, radix, page_size) as server_args:
        if plugin:
            scheduler_driver.truncation_align_size(server_args, page_size=page_size)  # the startup check
            assert prefill_hooks.rules_in_force() is None
        return outcome(lambda: Driver(spec, cfg, radix, align, page_size).run(arrivals),
                       raises=(scheduler_driver.CutShort,))


@pytest.mark.needs_grid_rules
@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(prompt, min_size=1, max_size=6),
    chunk=st.sampled_from([128, 256, 384, 1024]),
    align=st.sampled_from([None, 128, 64]),
    kv_tokens=st.sampled_from([2048, 16384]),
    radix=st.booleans() if sglang_at_least(releases.RADIX_OPT_IN) else st.just(False),
    page_size=st.sampled_from([1, 16]),
    deterministic=st.booleans(),
)
# Stock's adder cuts request 2 short here without chunking it (scheduler_driver.CutShort): the plugin must too.
@example(prompts=[(64, 0, 1, True), (129, 0, 0, False), (128, 0, 0, False)], chunk=128, align=64, kv_tokens=2048,
         radix=False, page_size=1, deterministic=False)
def test_admissions_with_the_rules_not_in_force_are_stock(prompts, chunk, align, kv_tokens, radix, page_size,
                                                          deterministic):
    """Whole schedules, step by step: every batch, radix hit and donor the same as stock's."""
    args = (prompts, chunk, align, kv_tokens, radix, page_size)
    assert schedule(*args, True, deterministic) == schedule(*args, False, deterministic)


def budget_classes():
    """The memory-budget classes whose methods the patch table wraps on this release (0.5.21+)."""
    from sglang_chunk_align import patch_table, patches

    wrappers = (prefill_hooks.ride_on_budget, prefill_hooks.fit_on_grid)
    points = patches.release_points(patch_table, installed_version())
    return sorted({p.class_and_attribute[0] for p in points if isinstance(p, patches.Wrap) and p.wrapper in wrappers})


BUDGET_CLASSES = budget_classes()
pool_size = st.integers(-64, 4096)


@pytest.mark.skipif(not BUDGET_CLASSES, reason=f"the adder's memory budget came with SGLang {releases.MEMORY_BUDGET}")
@settings(max_examples=EXAMPLES * 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    free=pool_size, swa_free=pool_size, evictable=st.integers(0, 512), offset=st.integers(0, 2048),
    page_size=st.sampled_from([1, 16]), req_ring=st.booleans(), fits=st.booleans(),
    chunk_limit=st.integers(-16, 4096), extend=st.integers(1, 8192), max_new_tokens=st.integers(0, 64),
    rules=st.booleans(),
)
def test_memory_budget_answers_are_stock_outside_a_continuation(free, swa_free, evictable, offset, page_size,
                                                                 req_ring, fits, chunk_limit, extend, max_new_tokens,
                                                                 rules):
    """Every wrapped memory-budget class (plain, SWA, shared SWA) answers available_chunk_tokens and
    fit_chunk as stock does outside a continuation's cut (only prefill_hooks.continue_on_grid gives
    them one to answer, for the one add_chunked_req call), the rules in force or not. The
    scheduling loop above reaches only the plain budget; these stand in for the KV pools and tree
    an SWA model's budget reads."""
    from sglang.srt.mem_cache import prefill_budget

    allocator = SimpleNamespace(
        page_size=page_size, size_swa=4096, swa_ring_cost_tokens=256,
        available_size=lambda: free, full_available_size=lambda: free, swa_available_size=lambda: swa_free,
        can_reserve=lambda *args, **kwargs: fits,
    )
    tree = SimpleNamespace(
        supports_mamba=lambda: False, evictable_size=lambda: evictable, full_evictable_size=lambda: evictable,
        swa_evictable_size=lambda: evictable, sliding_window_size=512,
    )

    def answers():
        if rules:
            prefill_hooks.activate(Rules())
        results = []
        for name in BUDGET_CLASSES:
            budget = standins.bare(
                getattr(prefill_budget, name), allocator=allocator, tree_cache=tree, page_size=page_size,
                total_offset=offset, current_offset=offset, swa_offset=offset, all_swa=False, req_ring=req_ring,
            )
            results.append(outcome(lambda: budget.available_chunk_tokens(chunk_limit)))
            results.append(outcome(lambda: budget.fit_chunk(
                extend_input_len=extend, max_new_tokens=max_new_tokens, chunk_limit=chunk_limit
            )))
        return results

    stock, plugin = stock_and_plugin(answers)
    assert plugin == stock


# --- The same, with the plugin loaded by SGLang's own loader in a fresh interpreter.

_LOADED_BY_SGLANG = """
import json, os, sys
if sys.argv[1] == "plugin":
    os.environ["SGLANG_PLUGINS"] = "chunk_align"
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_chunk_align import patches
    assert patches.state() == "applied", patches.state()
from tests.test_stock_where_unarmed import bare_scheduler_outcomes
print(json.dumps(bare_scheduler_outcomes()))
"""


def bare_scheduler_outcomes():
    """What SGLang's own unit tests ask of a Scheduler built without a worker (alignment per
    backend name, and the startup check per alignment, chunk, DP size and server role), as
    comparable data."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler as scheduler_module

    results = []
    for backend_name in ("flashinfer", "triton", "fa3"):
        exec_ctx = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=True))
        with mock.patch.object(scheduler_module, "get_exec", return_value=exec_ctx), mock.patch.object(
            scheduler_module, "attention_backends", return_value=(backend_name, None)
        ):
            scheduler = bare_scheduler()
            results.append(outcome(lambda: (scheduler.init_deterministic_inference_config(),
                                            scheduler.truncation_align_size)))
    for align in (None, 128, 4096):
        for chunk in (None, 100, 2048, 4096, 8192):
            for dp in (1, 2):
                for mode in (DisaggregationMode.NULL, DisaggregationMode.DECODE):
                    scheduler = bare_scheduler(truncation_align_size=align, chunked_prefill_size=chunk,
                                               disaggregation_mode=mode)
                    with mock.patch.object(scheduler_module, "get_parallel",
                                           return_value=SimpleNamespace(attn_dp_size=dp)):
                        results.append(outcome(scheduler.check_truncation_align_fits_chunk, ValueError))
    return results


@pytest.mark.skipif(not sglang_at_least(releases.NEWEST), reason=f"SGLang's own test of a bare Scheduler is {releases.NEWEST}'s")
def test_bare_scheduler_is_stock_with_the_plugin_loaded_by_sglang(fresh_python):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for mode in ("stock", "plugin"):
        code = f"import sys; sys.argv[1:] = [{mode!r}]; sys.path.insert(0, {root!r})\n" + _LOADED_BY_SGLANG
        done = fresh_python(code)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["plugin"] == runs["stock"]
    assert ["returned", [None, 4096]] in runs["stock"]  # the inputs reach stock's own answers
    assert any(result[0] == "raised" for result in runs["stock"])
