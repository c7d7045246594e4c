"""The `sglang-chunk-align` command: `doctor` on the installed SGLang, and `plan`."""

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_chunk_align import patch_table, patches, releases
from sglang_chunk_align.alignment import chunk_size_error
from sglang_chunk_align.compat import RADIX_OPT_IN_NEEDS, installed_version, radix_cache, sglang_at_least
from sglang_chunk_align.kernel_facts import MEASURED_SHAPES, installed_facts
from sglang_chunk_align.standins import scheduler_alignment

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Hides the installed SGLang from a fresh interpreter (its metadata and its import), and
# with ray=True makes `ray` look installed, so doctor runs as on a machine without/with them.
HIDE = """
import importlib.machinery, importlib.metadata, sys
real_version = importlib.metadata.version
def version(dist):
    if dist == "sglang":
        raise importlib.metadata.PackageNotFoundError(dist)
    return real_version(dist)
importlib.metadata.version = version
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang":
            raise ImportError("sglang is hidden")
        if name == "ray" and {ray}:
            return importlib.machinery.ModuleSpec("ray", None)
sys.meta_path.insert(0, Hide())
from sglang_chunk_align.cli import main
sys.exit(main(["doctor"]))
"""


def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "sglang_chunk_align.cli", *args], capture_output=True, text=True, env={**os.environ, **env}
    )


def test_doctor_reports_a_working_install():
    result = _cli("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads(result.stdout)
    version = installed_version()
    assert report["ok"] and report["versions"]["sglang"] == str(version)
    release = patches.release_points(patch_table, version)
    expected = [f"not for SGLang {version}" if p not in release else "applied" for p in patch_table.PATCH_POINTS]
    assert [p["status"] for p in report["patch_points"]] == expected
    assert "applied" in expected and f"not for SGLang {version}" in expected
    rules_available = sglang_at_least(releases.GRID_RULES)
    radix = "" if sglang_at_least(releases.RADIX_OPT_IN) else f"; {RADIX_OPT_IN_NEEDS}"
    assert report["grid_rules"] == (
        f"available{radix}" if rules_available else f"not on SGLang {version}: {releases.WITHOUT_GRID_RULES}"
    )
    assert (report["grid"] or "").startswith("128/gcd(128, GQA group) tokens" if rules_available else "")
    assert ("indices_updater_prefill" in report["grid"]) if rules_available else report["grid"] is None
    assert report["backends"]["FlashInferAttnBackend"] == 128
    facts = installed_facts()  # SGLang 0.5.23 pins flashinfer 0.7.2 (measured), 0.5.22 0.7.1 (not)
    assert report["kernel_facts"] == {"flashinfer": facts.flashinfer, "measured": facts.measured,
                                      "summary": facts.describe(), "shapes": MEASURED_SHAPES}
    assert any("its fa2 kernel facts were not measured" in w for w in report["warnings"]) == (not facts.measured)
    assert report["backends"]["FlashInferMLAAttnBackend"] is None
    assert report["backends"]["TboAttnBackend"] == 128
    assert report["switches"] == {
        "SGLANG_CHUNK_ALIGN_RULES": 1, "SGLANG_CHUNK_ALIGN_RADIX_CACHE": None, "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED": 0,
    }
    mamba = ("; for a mamba model: off, as stock (a mamba prefix cache: a prefix rounded to the grid would need a "
             "mamba state there)")
    assert report["radix_cache"] == (
        f"on (default: the grid rules make radix hits exact){mamba}" if sglang_at_least(releases.RADIX_OPT_IN)
        else f"off, as stock (SGLang {version} is older than {releases.RADIX_OPT_IN}, where the grid rules reach "
             "radix hits and the tree)"
    )


def test_doctor_fails_on_an_invalid_environment(fresh_python):
    """The problem comes first, before the patch points; every switch stays shown, the bad one raw."""
    result = fresh_python(
        "import sys; from sglang_chunk_align.cli import main; sys.exit(main(['doctor']))",
        SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED="yes",
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    problem = lines.index(
        "PROBLEM: SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' is not valid: use 1 or 0 (unset means 0)."
    )
    assert problem < lines.index("patch points:")
    assert {"  SGLANG_CHUNK_ALIGN_RULES=1", "  SGLANG_CHUNK_ALIGN_RADIX_CACHE unset",
            "  SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED='yes' (invalid)"} <= set(lines[:problem])
    assert (
        f"  kernel facts         {installed_facts().describe()}; measured at {MEASURED_SHAPES}; "
        "plan --group --head-dim warns on others"
    ) in lines
    assert lines[-1] == "NOT OK: 1 PROBLEM line(s) above"
    assert result.stdout.count("is not valid") == 1


def test_doctor_makes_the_refusals_the_scheduler_makes_from_the_switches(plugin, monkeypatch):
    """The same text from one function (compat.radix_cache): what doctor calls OK starts."""
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RADIX_CACHE", "1")
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "0")
    with pytest.raises(ValueError) as refused:
        scheduler_alignment(chunk=256)
    result = _cli("doctor", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and not report["ok"]
    assert report["problems"][0] == str(refused.value)
    assert "SGLANG_CHUNK_ALIGN_RADIX_CACHE=1 needs" in report["problems"][0]
    assert report["switches"]["SGLANG_CHUNK_ALIGN_RULES"] == 0


@pytest.mark.needs_grid_rules
def test_doctor_reports_the_grid_rules_off():
    result = _cli("doctor", "--json", SGLANG_CHUNK_ALIGN_RULES="0")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["switches"]["SGLANG_CHUNK_ALIGN_RULES"] == 0
    assert report["grid_rules"] == "off (SGLANG_CHUNK_ALIGN_RULES=0)" and report["grid"] is None
    off = [p["name"] for p in report["patch_points"] if p["status"] == "off (SGLANG_CHUNK_ALIGN_RULES=0)"]
    assert off == [p.name for p in patches.release_points(patch_table, installed_version()) if p.grid_rule]
    assert len(off) >= 4  # at least the PrefillAdder's admission paths
    assert "sglang.srt.managers.scheduler.Scheduler.check_truncation_align_fits_chunk" not in off
    assert report["radix_cache"].startswith("off, as stock (")  # one obstacle for every model: no mamba clause
    assert ("the grid rules are off: SGLANG_CHUNK_ALIGN_RULES=0" in report["radix_cache"]) == sglang_at_least(
        releases.RADIX_OPT_IN  # older releases name the release first
    )


def test_doctor_shows_the_radix_cache_decision_next_to_the_switches():
    result = _cli("doctor", SGLANG_CHUNK_ALIGN_RADIX_CACHE="0")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    switch = lines.index("  SGLANG_CHUNK_ALIGN_RADIX_CACHE=0")
    assert lines[switch + 2] == (
        "  radix cache          under deterministic flashinfer: off, as stock (SGLANG_CHUNK_ALIGN_RADIX_CACHE=0)"
    )


def test_radix_refusals_are_in_the_schedulers_order():
    radix, rules = "SGLANG_CHUNK_ALIGN_RADIX_CACHE", "SGLANG_CHUNK_ALIGN_RULES"
    older = Version(releases.RELEASES[releases.RELEASES.index(releases.RADIX_OPT_IN) - 1])
    assert radix_cache({radix: False, rules: False}, older, mamba=True)[2] == []
    assert radix_cache({radix: None, rules: False}, older, mamba=True)[2] == []  # unset: off, never refused
    assert radix_cache({radix: True, rules: True}, Version(releases.RADIX_OPT_IN))[2] == []
    assert radix_cache({radix: True, rules: True}, None)[2] == []  # no release to check
    release, grid_rules, mamba = radix_cache({radix: True, rules: False}, older, mamba=True)[2]
    assert release == f"{RADIX_OPT_IN_NEEDS}: drop {radix}, or upgrade SGLang."
    assert grid_rules.startswith(f"{radix}=1 needs the grid rules ({rules} not 0)")
    assert mamba.startswith(f"{radix}=1 is not supported with a mamba prefix cache")



def test_doctor_without_sglang_says_so_once(fresh_python):
    result = fresh_python(HIDE.format(ray=False))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "  sglang               not installed" in result.stdout
    assert (
        f"PROBLEM: SGLang is not installed: install a supported release, pip install 'sglang{releases.SUPPORTED}' "
        f"(the newest, sglang=={releases.NEWEST}, needs Python 3.11 or newer)." in result.stdout
    )
    assert result.stdout.count("SGLang not installed") == 1
    assert "None" not in result.stdout and "not for SGLang" not in result.stdout
    # Only an unmeasured flashinfer (0.5.22 pins 0.7.1) is warned of: its kernel facts are the strictest.
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == (not installed_facts().measured) and all("kernel facts were not measured" in w for w in warnings)


def test_doctor_without_sglang_and_with_a_bad_switch_names_both(fresh_python):
    result = fresh_python(HIDE.format(ray=False), SGLANG_CHUNK_ALIGN_RULES="yes")
    assert result.returncode == 1, result.stderr[-2000:]
    problems = [line for line in result.stdout.splitlines() if line.startswith("PROBLEM: ")]
    assert len(problems) == 2 and problems[0].startswith("PROBLEM: SGLang is not installed: install a supported")
    assert problems[1] == "PROBLEM: SGLANG_CHUNK_ALIGN_RULES='yes' is not valid: use 1 or 0 (unset means 1)."


def test_doctor_warns_that_ray_schedulers_do_not_load_the_plugin(fresh_python):
    result = fresh_python(HIDE.format(ray=True))
    assert "WARNING: Ray is installed: SGLang's Ray scheduler actors" in result.stdout
    assert "never load plugins" in result.stdout


def test_version():
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"sglang-chunk-align {metadata.version('sglang-chunk-align')}\n"



def test_plan_command_shows_both_schedules_and_flags_hazards():
    result = _cli("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "256", "--group", "4")
    assert result.returncode == 0, result.stderr
    assert "upstream length alignment: 6 chunks, 6 with hazards" in result.stdout
    assert "sglang-chunk-align: 6 chunks, 0 with hazards" in result.stdout
    assert "[   992,   1248)  tile 128  ok" in result.stdout  # group 4: the 32-token grid
    unknown_group = _cli("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "256")
    assert "[   896,   1152)  tile 128  ok" in unknown_group.stdout  # group 1: the 128-token grid


def test_plan_command_json_shows_the_short_final_piece_riding_along_at_chunk_128():
    result = _cli("plan", "--prompt-len", "1040", "--chunk", "128", "--json")
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)
    assert plans["sglang-chunk-align"][-1] == {"start": 896, "end": 1040, "tile": 128, "hazards": []}
    assert plans["upstream length alignment"][-1] == {
        "start": 1024, "end": 1040, "tile": 16, "hazards": ["runs on the 16-row tile, solo prefill on 128"],
    }


@pytest.mark.parametrize("chunk", [-1, 0])
def test_plan_command_plans_chunked_prefill_off_as_one_piece(plugin, chunk):
    """The scheduler takes a size <= 0 as chunked prefill off (the README's reference server runs CHUNK=-1)."""
    assert scheduler_alignment(chunk=chunk) == 128  # the scheduler starts with it (it raises otherwise)
    result = _cli("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", str(chunk))
    assert result.returncode == 0, result.stderr
    assert "chunked prefill off: one piece from the reused prefix to the end" in result.stdout
    assert "sglang-chunk-align: 1 chunk, 0 with hazards\n  [   896,   2500)  tile 128  ok" in result.stdout
    assert "upstream length alignment: 1 chunk, 1 with hazards\n  [  1000,   2500)" in result.stdout


def test_plan_command_bounds_the_prompt_length():
    result = _cli("plan", "--prompt-len", "1000000000000", "--chunk", "128", "--json")
    assert result.returncode == 2
    assert "argument --prompt-len: '1000000000000' is above 10000000, the longest prompt plan lists" in result.stderr
    assert _cli("plan", "--prompt-len", "10000000", "--chunk", "4096").returncode == 0


@pytest.mark.parametrize(
    "shape, warned",
    [((), False), (("--group", "3", "--head-dim", "64"), False), (("--group", "8", "--head-dim", "256"), False),
     (("--group", "6"), "GQA group 6"), (("--group", "16"), "GQA group 16"),
     (("--head-dim", "96"), "head_dim 96"), (("--group", "12", "--head-dim", "48"), "GQA group 12 and head_dim 48")],
)
def test_plan_command_says_which_shapes_the_kernel_facts_cover(shape, warned):
    text = _cli("plan", "--prompt-len", "300", "--chunk", "128", *shape)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"{installed_facts().describe()}; measured at {MEASURED_SHAPES}\n")
    assert ("WARNING: " in text.stdout) == bool(warned)
    report = json.loads(_cli("plan", "--prompt-len", "300", "--chunk", "128", "--json", *shape).stdout)
    if warned:
        assert text.stdout.splitlines()[1] == f"WARNING: {warned}: not measured; the kernel facts cover {MEASURED_SHAPES}, " \
            "so bit-exactness here is the rules' arithmetic, unchecked on a GPU"
        assert report["warnings"] == [text.stdout.splitlines()[1].removeprefix("WARNING: ")]
    else:
        assert report["warnings"] == []


def test_plan_command_counts_one_chunk():
    result = _cli("plan", "--prompt-len", "100", "--chunk", "128")
    assert result.returncode == 0, result.stderr
    assert "sglang-chunk-align: 1 chunk, 0 with hazards" in result.stdout


@pytest.mark.parametrize("chunk", [100, 200])
def test_plan_command_refuses_what_the_scheduler_refuses(chunk):
    """Below the grid (100) or off it (200): the scheduler's own message, for --chunk alone."""
    result = _cli("plan", "--prompt-len", "100", "--chunk", str(chunk))
    message = chunk_size_error(chunk, align=128, q_tile=128)
    assert message and ("at least 128" if chunk < 128 else "not a multiple of 128") in message
    assert result.returncode == 2 and f"plan: error: argument --chunk: {message}" in result.stderr
    assert "usage: sglang-chunk-align plan" in result.stderr


def test_plan_command_shows_the_rules_of_a_flashinfer_release_not_installed():
    """0.7.4's facts: chunk 192 accepted, the radix hit reused whole (chunk starts anywhere are
    exact there); an unmeasured release: the strictest facts, one WARNING, 192 refused."""
    args = ("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "192", "--group", "4")
    result = _cli(*args, "--flashinfer", "0.7.4", "--json")
    assert result.returncode == 0, result.stderr
    chunks = json.loads(result.stdout)["sglang-chunk-align"]
    assert [c["start"] for c in chunks[:2]] == [1000, 1192] and not any(c["hazards"] for c in chunks)
    unmeasured = _cli(*args, "--flashinfer", "0.7.9")
    assert unmeasured.returncode == 2 and "not a multiple of 128" in unmeasured.stderr
    assert unmeasured.stderr.count("flashinfer 0.7.9: its fa2 kernel facts were not measured") == 1


@pytest.mark.parametrize(
    "args, bad",
    [
        (["--head-dim", "0"], "argument --head-dim: '0' is not an integer >= 1"),
        (["--head-dim", "-1"], "argument --head-dim: '-1' is not an integer >= 1"),
        (["--group", "0"], "argument --group: '0' is not an integer >= 1"),
        (["--cached", "-1"], "argument --cached: '-1' is not an integer >= 0"),
        (["--cached", "100"], "--cached 100 must be below --prompt-len 100"),
        (["--cached", "101"], "--cached 101 must be below --prompt-len 100"),
    ],
)
def test_plan_command_names_the_one_bad_argument(args, bad):
    result = _cli("plan", "--prompt-len", "100", "--chunk", "128", *args)
    assert result.returncode == 2
    assert f"sglang-chunk-align plan: error: {bad}" in result.stderr
    assert "usage: sglang-chunk-align plan" in result.stderr


@pytest.mark.parametrize(
    "plugins, expected",
    [(None, "chunk_align"), ("other", "other,chunk_align"), ("other, chunk_align", "other, chunk_align")],
)
def test_launch_server_adds_chunk_align_to_the_plugins(tmp_path, plugins, expected):
    """The script's last step execs `sglang serve`; an `sglang` on PATH that prints SGLANG_PLUGINS and
    its first argument stands in for SGLang."""
    (tmp_path / "sglang").write_text('#!/bin/sh\necho "$SGLANG_PLUGINS $1"\n')
    (tmp_path / "sglang").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    result = subprocess.run(["bash", str(EXAMPLES / "launch_server.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{expected} serve"
