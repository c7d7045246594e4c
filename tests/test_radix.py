"""The radix cache under deterministic flashinfer: on where the grid rules make it exact, stock's
behaviour elsewhere (compat.radix_cache); SGLANG_CHUNK_ALIGN_RADIX_CACHE=0 keeps stock's behaviour,
=1 asks for the radix cache and is refused where it cannot be exact.

The launcher decides (SGLang's own handle_deterministic_inference, wrapped), then each scheduler
logs the decision on its startup line and refuses what it cannot serve.
"""

import pytest

from sglang_chunk_align import releases
from sglang_chunk_align.compat import pretended_sglang
from sglang_chunk_align.harness.standins import bare, published, scheduler_alignment

RADIX, RULES = "SGLANG_CHUNK_ALIGN_RADIX_CACHE", "SGLANG_CHUNK_ALIGN_RULES"
STOCK_OFF = "Currently radix cache is not compatible with flashinfer attention backend for deterministic inference"
DETERMINISTIC_FLASHINFER = {"enable_deterministic_inference": True, "attention_backend": "flashinfer"}
MAMBA_WHY = "a mamba prefix cache: a prefix rounded to the grid would need a mamba state there"
OLDER = releases.RELEASES[releases.RELEASES.index(releases.RADIX_OPT_IN) - 1]


# (model, environment, extra ServerArgs fields) the launcher resolves deterministic flashinfer for.
LAUNCHED = [
    ("attention", {}, {}), ("attention", {RADIX: "1"}, {}), ("attention", {RADIX: "0"}, {}),
    ("attention", {}, {"disable_radix_cache": True}),
    ("mamba", {}, {}), ("mamba", {RADIX: "1"}, {}),
    ("attention", {RULES: "0"}, {}), ("attention", {RULES: "0", RADIX: "1"}, {}),
    ("unreadable", {}, {}),
]


@pytest.fixture(scope="module")
def launched(model_paths, resolved_by_launcher):
    """launched(model, env, **fields) -> (stock's outcome, the plugin's) in SGLang's launcher, for
    a case of LAUNCHED; all of them resolved in one fresh interpreter (conftest._LAUNCHER)."""
    paths = {**model_paths, "unreadable": "no-such-model"}
    outcomes = resolved_by_launcher(
        [(paths[model], env, {**DETERMINISTIC_FLASHINFER, **fields}) for model, env, fields in LAUNCHED]
    )

    def outcome(model, env, **fields):
        case = LAUNCHED.index((model, env, fields))
        return outcomes["stock"][case], outcomes["plugin"][case]

    return outcome


@pytest.mark.needs_radix_opt_in
def test_the_launcher_keeps_the_radix_cache_on_by_default_for_an_attention_only_model(launched):
    stock, plugin = launched("attention", {})
    assert stock == ["disable_radix_cache", True, [f"{STOCK_OFF}. It will be supported in the future."]]
    assert plugin == ["disable_radix_cache", False, []]


@pytest.mark.needs_radix_opt_in
def test_radix_cache_1_keeps_it_on_and_0_keeps_stocks_behaviour(launched):
    assert launched("attention", {RADIX: "1"})[1] == ["disable_radix_cache", False, []]
    stock, plugin = launched("attention", {RADIX: "0"})
    assert plugin == stock and stock[:2] == ["disable_radix_cache", True]


@pytest.mark.needs_radix_opt_in
def test_disable_radix_cache_is_respected(launched):
    stock, plugin = launched("attention", {}, disable_radix_cache=True)
    assert plugin[:2] == stock[:2] == ["disable_radix_cache", True]


@pytest.mark.needs_radix_opt_in
@pytest.mark.parametrize("model, env", [
    ("mamba", {}),  # a mamba prefix cache
    ("mamba", {RADIX: "1"}),  # its scheduler refuses (test_radix_cache_1_is_refused_where_it_cannot_be_exact)
    ("attention", {RULES: "0"}),
    ("attention", {RULES: "0", RADIX: "1"}),
    ("unreadable", {}),  # no model config: its mamba state is unknown
])
def test_where_the_rules_cannot_make_it_exact_the_launcher_runs_as_stock(launched, model, env):
    """Stock's decision and its own log line, nothing of the plugin's: the scheduler says why."""
    stock, plugin = launched(model, env)
    assert plugin == stock and stock[:2] == ["disable_radix_cache", True]


# --- The scheduler: its startup line, and its refusals.

def prefix_cache(on, mamba=False):
    """SGLang's UnifiedRadixCache as the scheduler builds it: disabled where the radix cache is
    off, with a mamba component where the model keeps mamba state. Its pools stand in: the
    scheduler's are allocated on the GPU."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    with published() as server_args:
        server_args._mamba_cache_chunk_size = 64  # as SGLang's own fixtures seed it: no model config to read
        return UnifiedRadixCache(CacheInitParams(
            disable=not on, req_to_token_pool=bare(HybridReqToTokenPool) if mamba else None,
            token_to_kv_pool_allocator=None, page_size=1,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA) if mamba else (ComponentType.FULL,),
        ))


def startup(caplog, tree):
    """Start a stand-in scheduler on `tree`: (its startup line, every line the plugin logged)."""
    caplog.clear()
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        assert scheduler_alignment(chunk=256, state={"tree_cache": tree}) == 128
    logged = [r.getMessage() for r in caplog.records if r.name == "sglang_chunk_align"]
    (line,) = [line for line in logged if "prefill chunks aligned to 128 tokens" in line]
    return line, logged


def clause(line, words):
    """Whether the startup line holds `words` as one whole clause (clauses end at "; " or the line's end)."""
    return f"{words}; " in line or line.endswith(words)


def said_once(caplog, tree, why):
    """The startup line says the radix cache is off and why; no other line says why."""
    line, logged = startup(caplog, tree)
    assert clause(line, f"; radix cache off, as stock ({why})")
    assert [said for said in logged if why in said] == [line]


@pytest.mark.needs_radix_opt_in
def test_the_startup_line_says_whether_the_radix_cache_is_on_and_why(plugin, monkeypatch, caplog):
    line, _ = startup(caplog, prefix_cache(on=True))
    assert clause(line, "; radix cache on (default: the grid rules make radix hits exact)")
    monkeypatch.setenv(RADIX, "1")
    line, _ = startup(caplog, prefix_cache(on=True))
    assert clause(line, f"; radix cache on ({RADIX}=1)")
    monkeypatch.setenv(RADIX, "0")
    line, _ = startup(caplog, prefix_cache(on=False))
    assert clause(line, f"; radix cache off, as stock ({RADIX}=0)")
    line, _ = startup(caplog, prefix_cache(on=True))  # stock keeps it on for --attention-backend fa3, say
    assert clause(line, "; radix cache on, as SGLang keeps it for these server args")
    monkeypatch.delenv(RADIX)
    line, _ = startup(caplog, prefix_cache(on=False))  # the launcher kept it on; --disable-radix-cache did not
    assert clause(line, "; radix cache off (--disable-radix-cache, or an SGLang setting that implies it)")


@pytest.mark.needs_radix_opt_in
@pytest.mark.parametrize("mamba, env, why", [
    (True, {}, MAMBA_WHY),
    (False, {RULES: "0"}, f"the grid rules are off: {RULES}=0"),
])
def test_where_it_cannot_be_exact_unset_starts_as_stock_with_one_line_saying_why(plugin, monkeypatch, caplog,
                                                                                mamba, env, why):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    said_once(caplog, prefix_cache(on=False, mamba=mamba), why)


def test_on_a_release_before_the_radix_cache_unset_starts_as_stock_with_one_line_saying_why(plugin, caplog):
    """A release below RADIX_OPT_IN, pretended (compat.pretended_sglang: the plugin's release checks
    answer for it, on this release's Scheduler); CI's oldest CPU release runs it through its own
    alignment step."""
    with pretended_sglang(OLDER):
        said_once(caplog, None, f"SGLang {OLDER} is older than {releases.RADIX_OPT_IN}, where the grid rules reach "
                                "radix hits and the tree")


@pytest.mark.needs_radix_opt_in
@pytest.mark.parametrize("tree_on", [False, True])
def test_radix_cache_1_is_refused_where_it_cannot_be_exact(plugin, monkeypatch, tree_on):
    monkeypatch.setenv(RADIX, "1")
    with pytest.raises(ValueError, match=f"{RADIX}=1 is not supported with a mamba prefix cache"):
        scheduler_alignment(chunk=256, state={"tree_cache": prefix_cache(on=tree_on, mamba=True)})
    monkeypatch.setenv(RULES, "0")
    with pytest.raises(ValueError, match=f"{RADIX}=1 needs the grid rules"):
        scheduler_alignment(chunk=256, state={"tree_cache": prefix_cache(on=tree_on)})
    with pretended_sglang(OLDER), pytest.raises(ValueError, match=f"{RADIX}=1 needs SGLang {releases.RADIX_OPT_IN} or newer"):
        scheduler_alignment(chunk=256, state={"tree_cache": prefix_cache(on=tree_on)})
