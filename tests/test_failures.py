"""Bad input gets a clear error and changes nothing; a failed load cannot go unnoticed."""

import json
import subprocess
import sys

import pytest
from packaging.version import Version

from sglang_chunk_align import patches, plugin
from sglang_chunk_align.compat import ChunkAlignError
from conftest import SGLANG, published, run_python, sglang_at_least


def _stock():
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    return not patches.installed_names() and "prefill_chunk_align" not in vars(AttentionBackend)


@pytest.fixture
def sglang_version(monkeypatch):
    def pretend(version):
        monkeypatch.setattr(patches, "installed_version", lambda: Version(version))

    return pretend


def test_older_sglang_is_refused(sglang_version):
    sglang_version("0.5.11")
    with pytest.raises(ChunkAlignError, match="SGLang 0.5.11 is older than sglang-chunk-align supports"):
        patches.apply()
    assert _stock()


def test_newer_sglang_is_refused_without_the_override(sglang_version):
    sglang_version("0.6.0")
    with pytest.raises(ChunkAlignError, match="SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED=1"):
        patches.apply()
    assert _stock()


@pytest.mark.skipif(not sglang_at_least("0.5.23"), reason="a pretended newer release needs the newest patch points")
def test_newer_sglang_with_the_override_warns_and_checks_every_point(sglang_version, monkeypatch, caplog):
    sglang_version("0.6.0")
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED", "1")
    patches.apply()
    assert patches.installed_names() == {p.name for p in patches.release_points(Version("0.6.0")) if p.opt_in is None}
    assert "newer than the tested range" in caplog.text


def test_invalid_override_value_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED", "yes")
    with pytest.raises(ChunkAlignError, match="SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' is not valid"):
        patches.apply()
    assert _stock()


def test_missing_patch_point_names_version_and_symbol_and_patches_nothing(monkeypatch):
    missing = patches._wrap("sglang.srt.managers.scheduler", "Scheduler.init_prefill_q_tiles", lambda *a: None, "test")
    monkeypatch.setattr(patches, "PATCH_POINTS", patches.PATCH_POINTS + (missing,))
    with pytest.raises(ChunkAlignError) as error:
        patches.apply()
    assert f"SGLang {SGLANG}" in str(error.value)
    assert "sglang.srt.managers.scheduler.Scheduler.init_prefill_q_tiles" in str(error.value)
    assert _stock()


def test_declaration_that_sglang_already_has_is_a_changed_patch_point(monkeypatch):
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    monkeypatch.setattr(AttentionBackend, "prefill_chunk_align", 64, raising=False)
    with pytest.raises(ChunkAlignError, match="already exists in SGLang"):
        patches.apply()
    assert not patches.installed_names()


def test_failed_load_guards_the_scheduler(sglang_version):
    from sglang.srt.managers.scheduler import Scheduler

    sglang_version("0.5.11")
    with pytest.raises(ChunkAlignError):
        plugin.load()
    assert patches.installed_names() == {patches.FAILURE_GUARD.name}
    with published(deterministic=True) as server_args:
        with pytest.raises(RuntimeError, match="Refusing to start deterministic flashinfer with stock chunk alignment"):
            Scheduler(server_args)
    for fields in ({"attention_backend": None}, {"attention_backend": "triton", "prefill_attention_backend": "flashinfer"}):
        with published(deterministic=True, **fields) as server_args:
            with pytest.raises(RuntimeError, match="Refusing to start"):
                Scheduler(server_args)
    patches.remove()
    assert "__wrapped__" not in dir(vars(Scheduler)["__init__"])


def test_failed_load_through_sglang_loader_is_logged_as_an_error():
    result = run_python(
        "from packaging.version import Version\n"
        "import sglang_chunk_align.patches as patches\n"
        "patches.installed_version = lambda: Version('0.5.11')\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "print(sorted(patches.installed_names()))\n",
        SGLANG_PLUGINS="chunk_align",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sglang-chunk-align FAILED: SGLang 0.5.11 is older" in result.stderr
    assert result.stdout.strip().endswith(repr([patches.FAILURE_GUARD.name]))


def test_doctor_reports_a_working_install():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_chunk_align.cli", "doctor", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["ok"] and report["versions"]["sglang"] == str(SGLANG)
    release = patches.release_points(SGLANG)
    expected = [
        "not for SGLang %s" % SGLANG if p not in release
        else "off (opt in with SGLANG_CHUNK_ALIGN_RADIX_CACHE=1)" if p.opt_in
        else "applied"
        for p in patches.PATCH_POINTS
    ]
    assert [p["status"] for p in report["patch_points"]] == expected
    assert "applied" in expected and "not for SGLang %s" % SGLANG in expected
    rules_available = sglang_at_least("0.5.23")
    assert report["grid_rules"] == ("available" if rules_available else f"not on SGLang {SGLANG} (needs >=0.5.23)")
    assert report["backends"]["FlashInferAttnBackend"] == 128
    assert report["backends"]["FlashInferMLAAttnBackend"] is None
    assert report["backends"]["TboAttnBackend"] == 128
    assert report["switches"] == {
        "SGLANG_CHUNK_ALIGN_RULES": 1, "SGLANG_CHUNK_ALIGN_RADIX_CACHE": 0, "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED": 0,
    }


def test_doctor_fails_on_an_invalid_environment():
    result = run_python(
        "import sys; from sglang_chunk_align.cli import main; sys.exit(main(['doctor']))",
        SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED="yes",
    )
    assert result.returncode == 1
    assert "PROBLEM: SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' is not valid" in result.stdout
    assert "NOT OK" in result.stdout


def test_failure_guard_lets_other_configurations_start():
    from sglang_chunk_align.scheduler_hooks import _is_deterministic_flashinfer

    for deterministic, fields in ((False, {}), (True, {"attention_backend": "fa3"}), (True, {"attention_backend": "triton"})):
        with published(deterministic=deterministic, **fields) as server_args:
            assert not _is_deterministic_flashinfer(server_args)
