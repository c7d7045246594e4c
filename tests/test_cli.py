"""The `sglang-chunk-align` command: `doctor` on the installed SGLang, and `plan`."""

import json
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from sglang_chunk_align import patches, releases
from sglang_chunk_align.alignment import chunk_size_error
from sglang_chunk_align.compat import RADIX_OPT_IN_NEEDS, installed_version, sglang_at_least

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
    radix = "" if sglang_at_least(releases.RADIX_OPT_IN) else f"; {RADIX_OPT_IN_NEEDS}"
    assert report["grid_rules"] == (
        f"available{radix}" if rules_available else f"not on SGLang {version}: {releases.WITHOUT_GRID_RULES}"
    )
    assert (report["grid"] or "").startswith("128/gcd(128, GQA group) tokens" if rules_available else "")
    assert ("indices_updater_prefill" in report["grid"]) if rules_available else report["grid"] is None
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
    assert result.stdout.count("is not valid") == 1


@pytest.mark.needs_grid_rules
def test_doctor_reports_the_grid_rules_off():
    result = _cli("doctor", "--json", SGLANG_CHUNK_ALIGN_RULES="0")
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["switches"]["SGLANG_CHUNK_ALIGN_RULES"] == 0
    assert report["grid_rules"] == "off (SGLANG_CHUNK_ALIGN_RULES=0)" and report["grid"] is None
    off = [p["name"] for p in report["patch_points"] if p["status"] == "off (SGLANG_CHUNK_ALIGN_RULES=0)"]
    assert off == [p.name for p in patches.release_points(installed_version()) if p.grid_rule]
    assert len(off) >= 4  # at least the PrefillAdder's admission paths
    assert "sglang.srt.managers.scheduler.Scheduler.check_truncation_align_fits_chunk" not in off


def test_doctor_without_sglang_says_so_once(fresh_python):
    result = fresh_python(HIDE.format(ray=False))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "  sglang               not installed" in result.stdout
    assert "PROBLEM: SGLang is not installed" in result.stdout
    assert result.stdout.count("SGLang not installed") == 1
    assert "None" not in result.stdout and "not for SGLang" not in result.stdout
    assert "WARNING" not in result.stdout


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


def test_compare_logprobs_without_a_server_fails_in_one_line():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
        result = subprocess.run(
            [sys.executable, str(EXAMPLES / "compare_logprobs.py"), "--chunked", url, "--unchunked", url, "--prompts", "1"],
            capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 2
    assert result.stderr.startswith(f"compare_logprobs: cannot get logprobs from {url}/generate: ")
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "plugins, expected",
    [(None, "chunk_align"), ("other", "other,chunk_align"), ("other, chunk_align", "other, chunk_align")],
)
def test_launch_server_adds_chunk_align_to_the_plugins(tmp_path, plugins, expected):
    """The script's last step execs `python`; one on PATH that prints SGLANG_PLUGINS stands in for SGLang."""
    (tmp_path / "python").write_text('#!/bin/sh\necho "$SGLANG_PLUGINS"\n')
    (tmp_path / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    result = subprocess.run(["bash", str(EXAMPLES / "launch_server.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
