"""The `sglang-chunk-align` command: `doctor` on the installed SGLang, and `plan`."""

import json
import subprocess
import sys

from sglang_chunk_align import patches, releases
from sglang_chunk_align.compat import installed_version, sglang_at_least


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sglang_chunk_align.cli", *args], capture_output=True, text=True)


def test_doctor_reports_a_working_install():
    result = _cli("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads(result.stdout)
    version = installed_version()
    assert report["ok"] and report["versions"]["sglang"] == str(version)
    release = patches.release_points(version)
    expected = [
        f"not for SGLang {version}" if p not in release
        else "off (opt in with SGLANG_CHUNK_ALIGN_RADIX_CACHE=1)" if p.opt_in
        else "applied"
        for p in patches.PATCH_POINTS
    ]
    assert [p["status"] for p in report["patch_points"]] == expected
    assert "applied" in expected and f"not for SGLang {version}" in expected
    rules_available = sglang_at_least(releases.GRID_RULES)
    assert report["grid_rules"] == (
        "available" if rules_available else f"not on SGLang {version} (needs >={releases.GRID_RULES})"
    )
    assert report["backends"]["FlashInferAttnBackend"] == 128
    assert report["backends"]["FlashInferMLAAttnBackend"] is None
    assert report["backends"]["TboAttnBackend"] == 128
    assert report["switches"] == {
        "SGLANG_CHUNK_ALIGN_RULES": 1, "SGLANG_CHUNK_ALIGN_RADIX_CACHE": 0, "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED": 0,
    }


def test_doctor_fails_on_an_invalid_environment(fresh_python):
    result = fresh_python(
        "import sys; from sglang_chunk_align.cli import main; sys.exit(main(['doctor']))",
        SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED="yes",
    )
    assert result.returncode == 1
    assert "PROBLEM: SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' is not valid" in result.stdout
    assert "NOT OK" in result.stdout



def test_plan_command_shows_both_schedules_and_flags_hazards():
    result = _cli("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "256", "--group", "4")
    assert result.returncode == 0, result.stderr
    assert "upstream length alignment: 6 chunks, 6 with hazards" in result.stdout
    assert "sglang-chunk-align: 7 chunks, 0 with hazards" in result.stdout
    assert "[   896,   1152)  tile 128  ok" in result.stdout


def test_plan_command_json_and_unavoidable_hazard_exit_code():
    result = _cli("plan", "--prompt-len", "1040", "--chunk", "128", "--json")
    assert result.returncode == 1
    last = json.loads(result.stdout)["sglang-chunk-align"][-1]
    assert last == {"start": 1024, "end": 1040, "tile": 16, "hazards": ["runs on the 16-row tile, solo prefill on 128"]}


def test_plan_command_rejects_a_chunk_below_the_grid():
    result = _cli("plan", "--prompt-len", "100", "--chunk", "100")
    assert result.returncode == 2 and "--chunk >= 128" in result.stderr
