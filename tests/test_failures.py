"""Bad input gets a clear error and changes nothing; a failed load cannot go unnoticed."""

import contextlib
from types import SimpleNamespace

import pytest
from packaging.version import Version

from sglang_chunk_align import patch_table, patches, plugin, releases
from sglang_chunk_align.compat import ChunkAlignError, installed_version, pretended_sglang, sglang_at_least
from sglang_chunk_align.harness.standins import published, scheduler_alignment

UNSUPPORTED_OLDER = "0.5.11"  # the release before releases.OLDEST
GUARD = patch_table.failure_guard(ChunkAlignError("test"))


def _stock():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    return not patches.installed_names() and "prefill_chunk_align" not in vars(AttentionBackend)


@pytest.fixture
def sglang_version():
    with contextlib.ExitStack() as pretended:
        yield lambda version: pretended.enter_context(pretended_sglang(version))


def test_older_sglang_is_refused(sglang_version):
    sglang_version(UNSUPPORTED_OLDER)
    with pytest.raises(ChunkAlignError, match=f"SGLang {UNSUPPORTED_OLDER} is older than sglang-chunk-align supports"):
        patches.apply(patch_table)
    assert _stock()


def test_newer_sglang_is_refused_without_the_override(sglang_version):
    sglang_version("0.6.0")
    with pytest.raises(ChunkAlignError, match="SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED=1"):
        patches.apply(patch_table)
    assert _stock()


@pytest.mark.skipif(
    not sglang_at_least(releases.NEWEST), reason="a pretended newer release needs the newest patch points"
)
def test_newer_sglang_with_the_override_warns_and_checks_every_point(sglang_version, monkeypatch, caplog):
    sglang_version("0.6.0")
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED", "1")
    patches.apply(patch_table, now=True)
    assert patches.installed_names() == {p.name for p in patches.release_points(patch_table, Version("0.6.0"))}
    assert "newer than the tested range" in caplog.text


def test_invalid_override_value_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED", "yes")
    with pytest.raises(ChunkAlignError, match="SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' is not valid"):
        patches.apply(patch_table)
    assert _stock()


def test_invalid_radix_switch_is_refused_with_what_unset_means(monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RADIX_CACHE", "yes")
    with pytest.raises(ChunkAlignError) as refused:
        patches.apply(patch_table)
    assert str(refused.value) == (
        "SGLANG_CHUNK_ALIGN_RADIX_CACHE='yes' is not valid: use 1 or 0 (unset means on where the grid rules make it exact)."
    )
    assert _stock()


def test_missing_patch_point_names_version_and_symbol_and_patches_nothing():
    missing = patches.Wrap("sglang.srt.managers.scheduler", "Scheduler.init_prefill_q_tiles", lambda *a: None, "test")
    table = SimpleNamespace(PATCH_POINTS=patch_table.PATCH_POINTS + (missing,), failure_guard=patch_table.failure_guard,
                            reset=patch_table.reset)  # any such object is a table (patches.py)
    with pytest.raises(ChunkAlignError) as error:
        patches.apply(table)
    assert f"SGLang {installed_version()}" in str(error.value)
    assert "sglang.srt.managers.scheduler.Scheduler.init_prefill_q_tiles" in str(error.value)
    assert _stock()


def test_declaration_that_sglang_already_has_is_a_changed_patch_point(monkeypatch):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    monkeypatch.setattr(AttentionBackend, "prefill_chunk_align", 64, raising=False)
    with pytest.raises(ChunkAlignError, match="already exists in SGLang"):
        patches.apply(patch_table)
    assert not patches.installed_names()


def test_failed_load_guards_the_scheduler(sglang_version):
    from sglang.srt.managers.scheduler import Scheduler

    sglang_version(UNSUPPORTED_OLDER)
    plugin.load()  # logs the failure, never raises it: SGLang's loader would log it again
    assert patches.installed_names() == {GUARD.name}
    with pytest.raises(RuntimeError, match="Refusing to start deterministic flashinfer with stock chunk alignment"):
        scheduler_alignment(chunk=4096)
    for fields in ({"attention_backend": None}, {"attention_backend": "triton", "prefill_attention_backend": "flashinfer"}):
        with pytest.raises(RuntimeError, match="Refusing to start"):
            scheduler_alignment(chunk=4096, **fields)
    assert scheduler_alignment(deterministic=False, chunk=4096) is None  # other configurations start
    patches.remove()
    assert "__wrapped__" not in dir(vars(Scheduler)["init_deterministic_inference_config"])


def test_guard_for_a_bad_switch_names_that_switch(monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "yes")
    plugin.load()
    with pytest.raises(RuntimeError, match=r"Fix SGLANG_CHUNK_ALIGN_RULES \(1 or 0, or unset\)\.$"):
        scheduler_alignment(chunk=4096)


def test_failed_load_through_sglang_loader_is_logged_once_with_its_remedy(fresh_python, reported_once):
    result = fresh_python(
        "import sglang_chunk_align.patches as patches\n"
        "from sglang_chunk_align.compat import pretended_sglang\n"
        "from sglang.srt.plugins import load_plugins\n"
        f"with pretended_sglang({UNSUPPORTED_OLDER!r}):\n"
        "    load_plugins()\n"
        "assert not patches.installed_names()  # the guard waits for the scheduler module\n"
        "import sglang.srt.managers.scheduler\n"
        "print(sorted(patches.installed_names()))\n",
        SGLANG_PLUGINS="chunk_align",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reported_once(
        result.stderr, f"SGLang {UNSUPPORTED_OLDER} is older", "Upgrade SGLang to a supported release"
    )
    assert "Traceback" not in result.stderr
    assert result.stdout.strip().endswith(repr([GUARD.name]))


@pytest.mark.parametrize("switch, value", [("SGLANG_CHUNK_ALIGN_RULES", "yes"), ("SGLANG_CHUNK_ALIGN_RADIX_CACHE", "2")])
def test_invalid_switch_fails_at_load_through_sglang_loader(fresh_python, reported_once, switch, value):
    """Every switch is checked when SGLang loads the plugin, not later when the scheduler reads it."""
    result = fresh_python(
        "import sglang_chunk_align.patches as patches\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import sglang.srt.managers.scheduler\n"
        "print(sorted(patches.installed_names()))\n",
        SGLANG_PLUGINS="chunk_align", **{switch: value},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    reported_once(result.stderr, f"{switch}={value!r} is not valid: use 1 or 0", f"Fix {switch} (1 or 0, or unset).")
    assert "Traceback" not in result.stderr
    assert result.stdout.strip().endswith(repr([GUARD.name]))


def test_failed_load_carries_the_remedy_for_its_cause(monkeypatch, sglang_version):
    """The failure guard repeats error.remedy, so it must name what actually went wrong."""
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "yes")
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED", "no")
    with pytest.raises(ChunkAlignError) as bad_switch:
        patches.apply(patch_table)
    assert "SGLANG_CHUNK_ALIGN_RULES='yes'" in str(bad_switch.value)
    assert "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='no'" in str(bad_switch.value)
    assert bad_switch.value.remedy == "Fix SGLANG_CHUNK_ALIGN_RULES, SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED (1 or 0, or unset)."
    monkeypatch.delenv("SGLANG_CHUNK_ALIGN_RULES")
    monkeypatch.delenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED")
    sglang_version(UNSUPPORTED_OLDER)
    with pytest.raises(ChunkAlignError) as older:
        patches.apply(patch_table)
    assert older.value.remedy.startswith("Upgrade SGLang to a supported release")


def test_failure_guard_lets_other_configurations_start():
    from sglang_chunk_align.scheduler_hooks import _is_deterministic_flashinfer

    for deterministic, fields in ((False, {}), (True, {"attention_backend": "fa3"}), (True, {"attention_backend": "triton"})):
        with published(deterministic=deterministic, **fields) as server_args:
            assert not _is_deterministic_flashinfer(server_args)


class StockLaunchRan(Exception):
    """Raised where stock's Engine._launch_subprocesses begins: it configures the logger first."""


def test_ray_schedulers_are_refused_under_deterministic_flashinfer(plugin, monkeypatch):
    """Ray's scheduler actors never load plugins; RayEngine (which needs ray) is stood in for by a
    subclass that lives where it does. The plain Engine, which an RL framework builds inside a Ray
    actor and which starts its schedulers as processes that load the plugin, is not refused."""
    from sglang.srt.entrypoints import engine as engine_module
    from sglang.srt.entrypoints.engine import Engine

    def stock_launch_began(server_args):
        raise StockLaunchRan

    monkeypatch.setattr(engine_module, "configure_logger", stock_launch_began)

    ray_engine = type("RayEngine", (Engine,), {"__module__": "sglang.srt.ray.engine"})
    with published(deterministic=True) as server_args:
        with pytest.raises(RuntimeError, match=r"Ray scheduler actors \(--use-ray, RayEngine\) never load plugins") as refused:
            ray_engine._launch_subprocesses(server_args, None, None, None)
        assert "launch without --use-ray (an sglang.Engine inside a Ray actor is fine" in str(refused.value)
    for engine, deterministic in ((ray_engine, False), (Engine, True)):
        with published(deterministic=deterministic) as server_args:
            with pytest.raises(StockLaunchRan):  # stock goes on, where nothing is launched here
                engine._launch_subprocesses(server_args, None, None, None)
