"""The `sglang-chunk-align` command: `doctor` on the installed SGLang, and `plan`."""

import inspect
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.version import Version

from sglang_chunk_align import patch_table, patches, releases
from sglang_chunk_align.alignment import chunk_size_error
from sglang_chunk_align.compat import RADIX_OPT_IN_NEEDS, installed_version, radix_cache, sglang_at_least
from sglang_chunk_align.kernel_facts import FACTS, facts_for, installed_facts, installed_flashinfer
from sglang_chunk_align.harness import standins
from sglang_chunk_align.harness.standins import scheduler_alignment
from sglang_chunk_align.tools import fa2, probe

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MODELS = EXAMPLES.parent / "benchmarks" / "models"
# The start of a fresh interpreter's code in which the distribution DIST has no metadata.
HIDE_METADATA = """
import importlib.machinery, importlib.metadata, sys
real_version = importlib.metadata.version
def version(dist):
    if dist == "DIST":
        raise importlib.metadata.PackageNotFoundError(dist)
    return real_version(dist)
importlib.metadata.version = version
"""
# Hides the installed SGLang from a fresh interpreter (its metadata and its import), and
# with ray=True makes `ray` look installed, so doctor runs as on a machine without/with them.
HIDE = HIDE_METADATA.replace("DIST", "sglang") + """class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang":
            raise ImportError("sglang is hidden")
        if name == "ray" and {ray}:
            return importlib.machinery.ModuleSpec("ray", None)
sys.meta_path.insert(0, Hide())
from sglang_chunk_align.tools.cli import main
sys.exit(main(["doctor"]))
"""


def _cli(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "sglang_chunk_align.tools.cli", *args], capture_output=True, text=True, env={**os.environ, **env}
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
    # Both releases CI installs start chunks on the grid (0.7.2 by its facts, 0.7.1 by the strictest): the
    # doctor names the measured release that does not, and how to install it.
    assert report["grid_cost"] == (
        "radix hits and chunk cuts round down to the grid (128 tokens at odd GQA groups); flashinfer 0.7.4 starts "
        "chunks anywhere: pip install 'flashinfer-python[cu13]==0.7.4'" if rules_available else None)
    assert report["backends"]["FlashInferAttnBackend"] == 128
    facts = installed_facts()  # SGLang 0.5.23 pins flashinfer 0.7.2 (measured), 0.5.22 0.7.1 (not)
    assert report["kernel_facts"] == {"flashinfer": facts.flashinfer, "measured": facts.measured,
                                      "summary": facts.headline(), "shapes": facts.describe_shapes()}
    assert any("its fa2 kernel facts were not measured" in w for w in report["warnings"]) == (not facts.measured)
    assert report["backends"]["FlashInferMLAAttnBackend"] is None
    assert report["backends"]["TboAttnBackend"] == 128
    assert report["switches"] == {
        "SGLANG_CHUNK_ALIGN_RULES": 1, "SGLANG_CHUNK_ALIGN_RADIX_CACHE": None, "SGLANG_CHUNK_ALIGN_DECODE_WAIT": 0,
        "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION": 1, "SGLANG_CHUNK_ALIGN_PAD_TILES": 0,
        "SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE": 1,
        "SGLANG_CHUNK_ALIGN_GEMMS": 1, "SGLANG_CHUNK_ALIGN_FAST_GEMMS": 0, "SGLANG_CHUNK_ALIGN_NORMS": 1,
        "SGLANG_CHUNK_ALIGN_ALLOW_UNTESTED": 0,
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
        "import sys; from sglang_chunk_align.tools.cli import main; sys.exit(main(['doctor']))",
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
        f"  kernel facts         {installed_facts().headline()}; plan --group --head-dim warns on others"
        if installed_facts().measured else f"  kernel facts         {installed_facts().headline()}"
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
    assert report["grid_cost"] is None
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
    switch, plugins = lines.index("  SGLANG_CHUNK_ALIGN_RADIX_CACHE=0"), lines.index(
        next(line for line in lines if line.startswith("  SGLANG_PLUGINS ")))
    assert switch < plugins and lines[plugins + 1] == (
        "  radix cache          under deterministic flashinfer: off, as stock (SGLANG_CHUNK_ALIGN_RADIX_CACHE=0)"
    )


@pytest.mark.parametrize("switch, says", [
    (None, "off, stock's prefill-first order; SGLANG_CHUNK_ALIGN_DECODE_WAIT=1 bounds decoding requests' wait at "
           "100 ms. Not the default: on Granite-3.1-8B's shape (H200) it cost 3.8% of RL rollout throughput"),
    ("1", "on (SGLANG_CHUNK_ALIGN_DECODE_WAIT=1): decoding requests wait at most 100 ms behind prefill chunks"),
])
def test_doctor_says_whether_decode_waits_and_why_the_bound_is_not_the_default(switch, says):
    result = _cli("doctor", "--json", **({} if switch is None else {"SGLANG_CHUNK_ALIGN_DECODE_WAIT": switch}))
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert json.loads(result.stdout)["decode_wait"].startswith(says)
    lines = _cli("doctor", **({} if switch is None else {"SGLANG_CHUNK_ALIGN_DECODE_WAIT": switch})).stdout.splitlines()
    assert f"  decode wait          {says}" in "\n".join(lines)


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
    assert "WARNING: Ray is installed: SGLang's Ray scheduler actors (--use-ray, RayEngine) never load plugins" \
        in result.stdout
    assert "An sglang.Engine inside a Ray actor is fine" in result.stdout


def _installed_plugins():
    return sorted({ep.name for ep in metadata.entry_points(group="sglang.srt.plugins")})


@pytest.mark.parametrize(
    "value", [None, "", "chunk_align", "chunk_align,smg-zmq", " chunk_align , smg-servicer ,", ",", "none", "chunk-align"]
)
def test_plugin_selection_is_what_sglangs_own_loader_loads(monkeypatch, value):
    """Against SGLang's load_plugins_by_group and the installed entry points (chunk_align, and
    smg-grpc-servicer's smg-servicer and smg-zmq where SGLang installed it)."""
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    from sglang_chunk_align.tools.cli import PLUGINS_GROUP, plugin_selection

    assert PLUGINS_GROUP == GENERAL_PLUGINS_GROUP
    if value is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", value)
    loaded = sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP))
    selection = plugin_selection(value)
    assert "chunk_align" in selection["installed"] and sorted(selection["installed"]) == _installed_plugins()
    assert selection["loaded"] == loaded
    assert selection["skipped"] == sorted(set(_installed_plugins()) - set(loaded))
    if selection["skipped"]:  # the value it suggests loads every plugin the current one names or skips
        monkeypatch.setenv("SGLANG_PLUGINS", selection["keep"])
        assert sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP)) == sorted({*loaded, *selection["skipped"]})


def test_doctor_lists_the_plugins_sglang_plugins_skips_and_how_to_keep_them(monkeypatch):
    others = [name for name in _installed_plugins() if name != "chunk_align"]
    report = json.loads(_cli("doctor", "--json", SGLANG_PLUGINS="chunk_align").stdout)
    assert report["plugins"]["loaded"] == ["chunk_align"] and report["plugins"]["skipped"] == others
    warned = [w for w in report["warnings"] if w.startswith("SGLANG_PLUGINS=")]
    if others:  # SGLang 0.5.23 installs smg-grpc-servicer, whose plugins this skips
        keep = ",".join(["chunk_align", *others])
        named = ", ".join(f"{name} ({report['plugins']['installed'][name]})" for name in others)
        assert report["plugins"]["keep"] == keep
        assert warned == [f"SGLANG_PLUGINS='chunk_align' makes SGLang skip the installed plugin{'s' * (len(others) > 1)} "
                          f"{named}. To keep {'them' if len(others) > 1 else 'it'}: SGLANG_PLUGINS={keep} "
                          "(or leave SGLANG_PLUGINS unset: every installed plugin loads)."]
    else:
        assert warned == [] and report["plugins"]["keep"] is None
    text = _cli("doctor", SGLANG_PLUGINS="none").stdout.splitlines()
    assert f"  SGLANG_PLUGINS       'none': SGLang loads no plugin; skips {', '.join(_installed_plugins())}; " \
        "no installed plugin is named none" in text
    stock = [line for line in text if line.startswith("PROBLEM: SGLANG_PLUGINS='none'")]
    assert len(stock) == 1 and "chunk_align is among them: SGLang runs stock." in stock[0]
    assert f"To keep them: SGLANG_PLUGINS={','.join(_installed_plugins())} " in stock[0] or len(_installed_plugins()) == 1
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    unset = _cli("doctor").stdout
    assert f"  SGLANG_PLUGINS       unset: SGLang loads every installed plugin ({', '.join(_installed_plugins())})" in unset
    assert "WARNING: SGLANG_PLUGINS" not in unset


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


def test_plan_command_says_what_the_grid_costs_and_which_release_starts_chunks_anywhere():
    """At GQA 7 flashinfer 0.7.2's grid is 128 tokens: plan names 0.7.4 and its install command; on 0.7.4 the
    grid is the page, and nothing is said."""
    said = "to which radix hits and chunk cuts round down (flashinfer 0.7.4 starts chunks anywhere: pip install"
    for release, costs in (("0.7.2", True), ("0.7.4", False)):
        args = ("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "256", "--group", "7", "--flashinfer", release)
        grid = next(line for line in _cli(*args).stdout.splitlines() if line.startswith("grid rules: "))
        assert grid.startswith(f"grid rules: {128 if costs else 1}-token grid, pieces over 9 tokens (GQA group 7")
        assert (said in grid) == costs
        assert json.loads(_cli(*args, "--json").stdout)["grid_rules"] == grid.removeprefix("grid rules: ")


def test_plan_command_keeps_a_radix_hit_whole_where_calls_are_padded():
    """GQA 3 on 0.7.4: 10 tokens after a hit are 30 packed rows, the 64-row tile alone. Padded calls run them on
    their solo tile (128 rows), so the hit stays whole; without pads it is cut back to 22 tokens, the fewest that
    get the full tile. Upstream's schedule is never padded: the rules off, nothing splits."""
    args = ("plan", "--prompt-len", "2500", "--cached", "2490", "--chunk", "256", "--group", "3", "--head-dim", "128",
            "--flashinfer", "0.7.4")
    padded = _cli(*args, SGLANG_CHUNK_ALIGN_PAD_TILES="1").stdout
    assert "sglang-chunk-align: 1 chunk, 0 with hazards\n  [  2490,   2500)  tile 128 (its call padded by 34 tokens)  ok" in padded
    assert "[  2490,   2500)  tile 64  runs on the 64-row tile, solo prefill on 128" in padded
    assert "pieces over 21 tokens before a prompt's end, final pieces of any length (calls padded to their tiles)" in padded
    assert "sglang-chunk-align: 1 chunk, 0 with hazards\n  [  2478,   2500)  tile 128  ok" in _cli(*args).stdout
    unsplit = _cli(*args, SGLANG_CHUNK_ALIGN_PAD_TILES="1", SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION="0").stdout
    assert "[  2478,   2500)  tile 128  ok" in unsplit  # pads need split attention


def test_plan_command_json_shows_the_short_final_piece_riding_along_at_chunk_128():
    result = _cli("plan", "--prompt-len", "1040", "--chunk", "128", "--json")
    assert result.returncode == 0, result.stderr
    plans = json.loads(result.stdout)
    assert plans["sglang-chunk-align"][-1] == {"start": 896, "end": 1040, "tile": 128, "hazards": [], "pad": 0}
    assert plans["upstream length alignment"][-1] == {
        "start": 1024, "end": 1040, "tile": 16, "hazards": ["runs on the 16-row tile, solo prefill on 128"], "pad": 0,
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
    "flashinfer, shape, warned",  # warned: (the unmeasured shape, the probe arguments that measure it), or None
    [("0.7.2", (), None), ("0.7.2", ("--group", "8", "--head-dim", "512"), None), ("0.7.2", ("--group", "16"), None),
     ("0.7.2", ("--group", "2", "--head-dim", "512"), ("GQA group 2 at head_dim 512", "--group 2 --head-dim 512")),
     ("0.7.2", ("--group", "16", "--head-dim", "256"), ("GQA group 16 at head_dim 256", "--group 16 --head-dim 256")),
     ("0.7.2", ("--group", "6"), ("GQA group 6", "--group 6")),
     ("0.7.2", ("--head-dim", "96"), ("head_dim 96", "--group 1 --head-dim 96")),
     ("0.7.2", ("--group", "3", "--head-dim", "64"), ("GQA group 3 and head_dim 64", "--group 3 --head-dim 64")),
     ("0.7.4", ("--group", "2", "--head-dim", "256"), None),
     ("0.7.4", ("--group", "4", "--head-dim", "512"), ("head_dim 512", "--group 4 --head-dim 512")),  # 0.7.2's only
     ("0.7.4", ("--group", "2", "--head-dim", "128"), ("GQA group 2 at head_dim 128", "--group 2 --head-dim 128")),
     ("0.7.9", ("--group", "6", "--head-dim", "96"), None)],  # unmeasured: the release's own WARNING says it
)
def test_plan_command_says_which_shapes_the_kernel_facts_of_its_release_cover(flashinfer, shape, warned):
    facts = facts_for(flashinfer)[0]
    args = ("plan", "--prompt-len", "300", "--chunk", "128", "--flashinfer", flashinfer, *shape)
    text = _cli(*args)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"{facts.headline()}\n")
    assert ("WARNING: " in text.stdout) == bool(warned)
    report = json.loads(_cli(*args, "--json").stdout)
    if warned:
        unmeasured, probed = warned
        assert text.stdout.splitlines()[1] == (
            f"WARNING: {unmeasured}: not measured on flashinfer {flashinfer}, whose kernel facts were measured at "
            f"{facts.describe_shapes()}, so bit-exactness here is the rules' arithmetic with those facts, unchecked "
            f"on a GPU; run `sglang-chunk-align probe {probed}` on a GPU to measure it"
        )
        assert report["warnings"] == [text.stdout.splitlines()[1].removeprefix("WARNING: ")]
    else:
        assert report["warnings"] == []


def test_the_docs_state_each_releases_measured_shapes_as_the_kernel_facts_hold_them():
    """kernel_facts.py is the one source; docs/kernel-facts.md repeats it, release by release."""
    readme = " ".join((EXAMPLES.parent / "docs" / "kernel-facts.md").read_text().split())
    for release, facts in FACTS.items():
        assert f"flashinfer {release}: {facts.describe_shapes()}" in readme, release
    assert "not measured yet" not in readme


def test_plan_command_counts_one_chunk():
    result = _cli("plan", "--prompt-len", "100", "--chunk", "128")
    assert result.returncode == 0, result.stderr
    assert "sglang-chunk-align: 1 chunk, 0 with hazards" in result.stdout


@pytest.mark.parametrize("chunk", [100, 200])
def test_plan_command_refuses_what_the_scheduler_refuses(chunk):
    """Below the grid (100) or off it (200): the scheduler's own message, for --chunk alone, whose
    advice names the flag the user typed (--chunk), not the server's --chunked-prefill-size."""
    result = _cli("plan", "--prompt-len", "100", "--chunk", str(chunk))
    message = chunk_size_error(chunk, align=128, q_tile=128, flag="--chunk")
    assert message and ("at least 128" if chunk < 128 else "not a multiple of 128") in message
    assert result.returncode == 2 and f"plan: error: argument --chunk: {message}" in result.stderr
    assert ("Raise --chunk to at least 128." if chunk < 128 else "Use --chunk 128 or 256.") in result.stderr
    assert "--chunked-prefill-size" not in result.stderr
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
        (["--flashinfer", "banana"], "argument --flashinfer: 'banana' is not a flashinfer release such as 0.7.2"),
        (["--flashinfer", "0.7.x"], "argument --flashinfer: '0.7.x' is not a flashinfer release such as 0.7.2"),
        (["--model-path", "/nonexistent"],
         "argument --model-path: '/nonexistent' has no readable config.json (No such file or directory)"),
        (["--model-path", str(MODELS / "qwen3-8b"), "--group", "8"],
         f"--group 8 disagrees with --model-path {MODELS / 'qwen3-8b'} (32 attention heads / 8 KV heads, "
         "head_dim 128: GQA group 4); give one of them"),
        (["--model-path", str(MODELS / "qwen3-8b"), "--head-dim", "256"],
         f"--head-dim 256 disagrees with --model-path {MODELS / 'qwen3-8b'} (32 attention heads / 8 KV heads, head_dim 128)"),
    ],
)
def test_plan_command_names_the_one_bad_argument(args, bad):
    result = _cli("plan", "--prompt-len", "100", "--chunk", "128", *args)
    assert result.returncode == 2
    assert f"sglang-chunk-align plan: error: {bad}" in result.stderr
    assert "usage: sglang-chunk-align plan" in result.stderr


@pytest.mark.parametrize("model, shape", [("qwen3-8b", ("--group", "4", "--head-dim", "128")),
                                          ("gemma-2b", ("--group", "8", "--head-dim", "256"))])
def test_plan_command_takes_the_shape_from_a_model_config(model, shape):
    """--model-path plans exactly as the group and head_dim of the model's config.json; giving
    them too, where they agree, changes nothing."""
    args = ("plan", "--prompt-len", "2500", "--cached", "1000", "--chunk", "256", "--json")
    given = _cli(*args, *shape)
    assert given.returncode == 0, given.stderr
    assert _cli(*args).stdout != given.stdout  # the shape matters to this plan
    for extra in ((), shape):
        from_model = _cli(*args, "--model-path", str(MODELS / model), *extra)
        assert from_model.returncode == 0, from_model.stderr
        assert from_model.stdout == given.stdout


def test_plan_command_asks_which_head_dim_of_a_model_with_two(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512}))
    args = ("plan", "--prompt-len", "300", "--chunk", "128", "--model-path", str(tmp_path))
    refused = _cli(*args)
    assert refused.returncode == 2
    assert (f"--model-path {tmp_path} uses head_dim 256 and 512: give --head-dim, the one its flashinfer prefill "
            "is planned with") in refused.stderr
    chosen = _cli(*args, "--head-dim", "512", "--json")
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout == _cli("plan", "--prompt-len", "300", "--chunk", "128", "--group", "2", "--head-dim", "512",
                                 "--json").stdout


def test_plan_help_shows_every_default():
    text = " ".join(_cli("plan", "--help").stdout.split())
    for default in ("--cached CACHED radix-cache hit length in tokens (default 0)",
                    "(default: the model's with --model-path, else 1: the coarsest grid, safe for every model)",
                    "(default: the model's with --model-path, else unknown: tiles compared at every head_dim)",
                    "take the GQA group and head_dim from its config.json",
                    f"(default: the installed one, {installed_flashinfer() or 'none installed'})"):
        assert default in text


def test_plan_command_reads_a_flashinfer_release_as_its_metadata_spells_it():
    args = ("plan", "--prompt-len", "2500", "--chunk", "192", "--group", "4", "--json")
    assert _cli(*args, "--flashinfer", "v0.7.4").stdout == _cli(*args, "--flashinfer", "0.7.4").stdout != ""


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


def test_launch_server_starts_verifys_reference_as_stock_unchunked_without_radix(tmp_path):
    """REFERENCE=1: no plugin of ours (SGLANG_PLUGINS=none), chunked prefill off, radix cache off."""
    (tmp_path / "sglang").write_text('#!/bin/sh\necho "$SGLANG_PLUGINS $*"\n')
    (tmp_path / "sglang").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "REFERENCE": "1", "SGLANG_PLUGINS": "chunk_align"}
    result = subprocess.run(["bash", str(EXAMPLES / "launch_server.sh"), "--tp", "2"], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["none", "serve"] and "--enable-deterministic-inference" in words
    assert " --chunked-prefill-size -1 --disable-radix-cache --tp 2" in result.stdout


@pytest.mark.parametrize("args", [("plan", "--prompt-len", "200000", "--chunk", "128"),
                                  ("plan", "--prompt-len", "200000", "--chunk", "128", "--json")])
def test_a_reader_that_stops_early_ends_the_command_without_a_traceback(args):
    """`plan ... | head -2`: the listing is larger than a pipe holds, so the command is still writing
    when the reader closes the pipe; it stops there, quietly, as a command killed by SIGPIPE does."""
    command = subprocess.Popen([sys.executable, "-m", "sglang_chunk_align.tools.cli", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert command.stdout.readline() and command.stdout.readline()
    command.stdout.close()
    stderr = command.stderr.read()
    # Nothing but the warning a release with unmeasured kernel facts gets (flashinfer 0.7.1, SGLang 0.5.22's).
    assert command.wait() == 141 and all(UNMEASURED in line for line in stderr.splitlines()), stderr


@pytest.mark.parametrize("args", [("--prompt-len", "0", "--chunk", "128"), ("--prompt-len", "100", "--chunk", "200")])
def test_plan_json_reports_a_refusal_as_one_json_document(args):
    """As verify --json and probe --json: a bad argument or a refused chunk reads {"ok": false, "error": ...}."""
    result = _cli("plan", *args, "--json")
    assert result.returncode == 2
    report = json.loads(result.stdout)
    assert list(report) == ["ok", "error"] and report["ok"] is False and report["error"] in result.stderr


# Hides the installed flashinfer (its metadata) from a fresh interpreter, then runs the command.
WITHOUT_FLASHINFER = HIDE_METADATA.replace("DIST", "flashinfer-python") + """from sglang_chunk_align.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""
UNMEASURED = "its fa2 kernel facts were not measured"


@pytest.mark.parametrize("command", [("doctor",), ("plan", "--prompt-len", "300", "--chunk", "128"),
                                     ("plan", "--prompt-len", "300", "--chunk", "128", "--flashinfer", "9.9.9")])
def test_an_unmeasured_flashinfer_is_said_once_plainly_with_the_facts_used(command):
    """Without flashinfer, or with a release nobody measured: one WARNING says it was not measured
    and which facts are taken instead (0.7.2's and 0.7.4's strictest); no line claims a measurement."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_FLASHINFER, *command], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    output = result.stdout + result.stderr
    release = "flashinfer 9.9.9" if "9.9.9" in command else "no flashinfer installed"
    assert output.count(UNMEASURED) == 1 and f"{release}: {UNMEASURED}, so the grid rules take the strictest " \
        "measured ones (flashinfer 0.7.2 and 0.7.4)" in output
    facts_line = next(line for line in result.stdout.splitlines() if "kernel facts" in line and UNMEASURED not in line)
    assert facts_line.endswith("the strictest measured kernel facts (flashinfer 0.7.2 and 0.7.4): chunk starts on "
                               "128-row q-tiles")
    assert "measured at" not in output and "NOT measured" not in output and "not measured)" not in output


@pytest.mark.parametrize("value", ["chunkalign", "smg-zmq"])
def test_doctor_fails_where_sglang_plugins_keeps_the_plugin_from_loading(value):
    """A value that skips chunk_align (a typo, `none`, another plugin alone) is a problem: SGLang
    would run stock. Text and JSON say so, and the status is 1."""
    text = _cli("doctor", SGLANG_PLUGINS=value)
    assert text.returncode == 1
    assert any(line.startswith(f"PROBLEM: SGLANG_PLUGINS={value!r} makes SGLang skip") and
               "chunk_align is among them: SGLang runs stock." in line for line in text.stdout.splitlines())
    assert text.stdout.splitlines()[-1].startswith("NOT OK")
    report = json.loads(_cli("doctor", "--json", SGLANG_PLUGINS=value).stdout)
    assert report["ok"] is False and any("chunk_align is among them" in p for p in report["problems"])


def _schedulers_workspace_refusal(chunk, longest_prompt):
    """What the real Scheduler's startup steps say of `chunk` on a deterministic flashinfer backend
    planned as Granite-3.1-8B on one GPU (32 q / 8 KV heads, head_dim 128, SGLang's 2 GiB workspace):
    None where it starts, else its message."""
    workspace = SimpleNamespace(numel=lambda: fa2.DETERMINISTIC_WORKSPACE_BYTES, element_size=lambda: 1)
    backend = lambda: standins.flashinfer_backend(planned=(32, 8, 128), workspace_buffer=workspace)  # noqa: E731
    try:
        scheduler_alignment(backend, chunk=chunk, state={"max_req_input_len": longest_prompt})
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("chunk, context", [(4096, None), (4096, 126982), (4096, 126983), (1024, None), (-1, 20000),
                                            (-1, 30000)])
def test_plan_refuses_exactly_the_chunks_the_scheduler_refuses_at_the_models_context(plugin, chunk, context):
    """The workspace check: at Granite-3.1-8B's context (131072 from its config.json, or --context-length),
    plan accepts a chunk where the scheduler starts and refuses it, with the scheduler's message, where
    the scheduler refuses it. SGLang admits prompts of context - 6 tokens (test_the_longest_prompt_plan_admits_is_sglangs)."""
    longest = (context or 131072) - 6
    expected = _schedulers_workspace_refusal(chunk, longest)
    given = ("--context-length", str(context)) if context else ()
    result = _cli("plan", "--prompt-len", "1000", "--chunk", str(chunk), "--model-path", str(MODELS / "granite-3.1-8b"),
                  *given)
    assert result.returncode == (2 if expected else 0), result.stderr
    if expected:
        said = f"--context-length {context}" if context else "--context-length 131072 (the model's, from its config.json)"
        assert f"plan: error: at {said}: {expected}" in result.stderr
    assert (chunk, context, bool(expected)) in {(4096, None, True), (4096, 126982, False), (4096, 126983, True),
                                                (1024, None, False), (-1, 20000, False), (-1, 30000, True)}


def test_the_longest_prompt_plan_admits_is_sglangs():
    """plan's bound on a prompt (context - 6) is SGLang's TpModelWorker's max_req_input_len, read
    from the installed wheel's source; --prompt-len above it is refused naming the context."""
    from sglang.srt.managers import tp_worker

    # Attributes on 0.5.13 (self.max_req_len), locals on 0.5.23: the same arithmetic.
    source = " ".join(inspect.getsource(tp_worker).split()).replace("self.", "")
    assert "max_req_len = min( model_config.context_len - 1," in source
    assert "max_req_input_len = max_req_len - 5" in source
    args = ("plan", "--chunk", "256", "--model-path", str(MODELS / "gemma-2b"))
    assert _cli(*args, "--prompt-len", "8186").returncode == 0
    refused = _cli(*args, "--prompt-len", "8187")
    assert refused.returncode == 2 and ("--prompt-len 8187 is longer than the 8186 tokens a server at --context-length "
                                        "8192 (the model's, from its config.json) admits") in refused.stderr
    without_model = _cli("plan", "--prompt-len", "100", "--chunk", "256", "--context-length", "4096")
    assert without_model.returncode == 2 and "--context-length needs --model-path" in without_model.stderr


@pytest.mark.parametrize("config", [
    *[json.loads((MODELS / name / "config.json").read_text()) for name in ("granite-3.1-8b", "gemma-2b", "qwen3-8b")],
    {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    {"max_position_embeddings": 8192, "rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 8192}},
    {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    {"seq_length": 4096, "max_position_embeddings": 32768}, {"hidden_size": 64},
])
def test_plans_context_length_is_sglangs(config):
    from sglang.srt.utils.hf_transformers.common import get_context_length

    assert probe.context_length(config) == get_context_length(SimpleNamespace(**config))
