"""The probe's verdict logic on the recorded H200 runs: each release's facts predict its own
measurements, and not the other release's (so the verdict is sensitive). No GPU, no flashinfer:
the measurements are the recorded ones (tests/gpu/evidence)."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from sglang_chunk_align.tools import probe
from sglang_chunk_align.kernel_facts import FACTS, FI072, FI074, STRICTEST, facts_for

EVIDENCE = pathlib.Path(__file__).parent / "gpu" / "evidence"


def recorded(flashinfer):
    """The fixed-split results of fa2_probe_h200_fi0XX.json as probe results (its bounds are the
    chunk starts, uniform ones elided after 12; split None is not a deterministic plan)."""
    doc = json.loads((EVIDENCE / f"fa2_probe_h200_fi{flashinfer.replace('.', '')}.json").read_text())
    assert doc["flashinfer"] == flashinfer
    results = []
    for r in doc["results"]:
        if r["split"] is None:
            continue
        starts = r["bounds"]
        if "..." in starts:
            starts = list(range(0, r["L"], starts[1]))
        case = probe.Case("tiles", r["name"], r["L"], (*starts, r["L"]), r["split"], extra=r["extra_1tok"])
        results.append({"case": vars(case), "group": r["group"], "head_dim": r["d"], "exact": r["exact"],
                        "n_bad_rows": r["n_bad_rows"], "max_abs": r["max_abs"]})
    return results


@pytest.mark.parametrize("facts", [FI072, FI074], ids=lambda f: f.flashinfer)
def test_each_release_facts_predict_its_recorded_run(facts):
    checked = probe.verdicts(facts, recorded(facts.flashinfer))
    assert len(checked) > 40
    assert [r["case"]["name"] for r in checked if not r["holds"]] == []
    assert probe.summary(facts, checked)[1] == probe.HOLD


def test_the_other_release_facts_do_not_hold():
    """0.7.2's grid fact is refuted by 0.7.4's off-grid starts, and 0.7.4's by 0.7.2's: exit 1."""
    on_074 = probe.verdicts(FI072, recorded("0.7.4"))
    assert {r["case"]["name"] for r in on_074 if not r["holds"]} == {
        "uniform100", "uniform200", "uniform1000", "uniform129", "radix_hit_1000", "cfg_uniform100", "cfg_uniform1000"}
    assert all(r["exact"] and r["expected"] == probe.INEXACT for r in on_074 if not r["holds"])
    assert probe.summary(FI072, on_074)[1] == probe.DO_NOT_HOLD
    on_072 = probe.verdicts(FI074, recorded("0.7.2"))
    assert {r["case"]["name"] for r in on_072 if not r["holds"]} >= {"uniform100", "radix_hit_1000"}
    assert "the table's facts for flashinfer 0.7.4 do NOT hold here" in probe.format_report(FI074, on_072)


def test_data_dependent_facts_are_refuted_only_where_the_table_says_equal():
    case = probe.Case("partial_tile_rows", "rows of a 1042-token prompt", 2500, (0, 1042), 4096, rows=1042)
    differ = [{"case": vars(case), "group": 1, "head_dim": 128, "exact": False, "n_bad_rows": 2, "max_abs": 1e-3}]
    assert probe.verdicts(FI072, differ)[0]["holds"]  # 0.7.2: rows *can* differ
    assert not probe.verdicts(FI074, differ)[0]["holds"]  # 0.7.4 says they are equal


def test_an_error_is_not_a_measurement():
    case = probe.cases(1)[1]
    failed = [{"case": vars(case), "group": 1, "head_dim": 512, "error": "RuntimeError: head_dim 512"}]
    checked = probe.verdicts(FI074, failed)
    assert not checked[0]["holds"] and "RuntimeError: head_dim 512" in probe.format_report(FI074, checked)


def test_every_case_runs_on_each_shape_and_spans_the_thresholds():
    found = probe.cases(4)
    assert len({(c.name, c.split) for c in found}) == len(found)
    # the final pieces straddle 16, 32 and 64 packed rows at group 4: 4, 6, 12, 16 and 18 tokens
    assert [c.prompt_len - 1024 for c in probe.cases(4) if c.name.startswith("final piece")] == [4, 6, 12, 16, 18]
    # at group 1 a token is a packed row: some final piece at or below, and some above, each threshold of the facts
    rows = [c.prompt_len - 1024 for c in probe.cases(1) if c.name.startswith("final piece")]
    thresholds = {above for facts in FACTS.values() for _, classes, _ in facts.tile_classes for above, _ in classes}
    assert thresholds and all(min(rows) <= above < max(rows) for above in thresholds)
    assert [c.fact for c in probe.cases(1, decode=False)].count("decoded_rows") == 0


def test_unmeasured_release_is_checked_against_the_strictest_facts():
    facts, warning = facts_for("0.7.9")
    assert (facts.grid_rows, facts.measured) == (STRICTEST.grid_rows, False) == (128, False)
    assert "flashinfer 0.7.9" in warning and "sglang-chunk-align probe" in warning


MODELS = pathlib.Path(__file__).parent.parent / "benchmarks" / "models"


def test_model_config_gives_the_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512}}))
    assert probe.model_shape(tmp_path) == (4, [256, 512], "32 attention heads / 8 KV heads, head_dim 256 and 512")
    # Gemma-2B: 8 heads on 1 KV head; Granite-3.1-8B gives no head_dim: hidden_size / heads.
    assert probe.model_shape(MODELS / "gemma-2b")[:2] == (8, [256])
    assert probe.model_shape(MODELS / "granite-3.1-8b")[:2] == (4, [128])


@pytest.mark.parametrize(
    "config, says",
    [(None, "has no readable config.json (No such file or directory)"), ("{", "(JSONDecodeError"),
     ({"num_key_value_heads": 8}, "gives no attention heads and head_dim (KeyError: 'num_attention_heads')"),
     ({"num_attention_heads": 32, "num_key_value_heads": 6, "head_dim": 128}, "32 attention heads / 6 KV heads"),
     ({"num_attention_heads": 32, "head_dim": -128}, "are no GQA shape")],
)
def test_a_model_config_without_a_gqa_shape_is_named(tmp_path, config, says):
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(says)):
        probe.model_shape(tmp_path)


@pytest.mark.parametrize("command", [["sglang_chunk_align.tools.probe"], ["sglang_chunk_align.tools.cli", "probe", "--group", "4"],
                                     ["sglang_chunk_align.tools.cli", "probe", "--model-path", str(MODELS / "gemma-2b")]])
def test_without_a_gpu_it_exits_2_with_one_line(command):
    run = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True)
    assert run.returncode == probe.CANNOT_MEASURE == 2
    assert run.stderr.count("\n") == 1 and "cannot measure here" in run.stderr


@pytest.mark.parametrize("command", [["sglang_chunk_align.tools.probe"], ["sglang_chunk_align.tools.cli", "probe"]])
@pytest.mark.parametrize("args", [[], ["--group", "0"]])
def test_with_json_a_failure_is_one_json_document_on_stdout(command, args):
    """As verify --json: no GPU here (exit 2) or a bad argument reads {"ok": false, "error": ...}."""
    run = subprocess.run([sys.executable, "-m", *command, *args, "--json"], capture_output=True, text=True)
    assert run.returncode == 2
    report = json.loads(run.stdout)
    assert list(report) == ["ok", "error"] and report["ok"] is False and report["error"] in run.stderr


@pytest.mark.parametrize("prog", [["sglang_chunk_align.tools.probe"], ["sglang_chunk_align.tools.cli", "probe"]])
@pytest.mark.parametrize(
    "args, bad",
    [(["--group", "0"], "argument --group: '0' is not an integer >= 1"),
     (["--head-dim", "128", "x"], "argument --head-dim: 'x' is not an integer >= 1"),
     (["--model-path", "/nonexistent"],
      "argument --model-path: '/nonexistent' has no readable config.json (No such file or directory)"),
     (["--model-path", str(MODELS / "gemma-2b"), "--group", "4"],
      f"--group 4 disagrees with --model-path {MODELS / 'gemma-2b'} (8 attention heads / 1 KV heads, head_dim 256: "
      "GQA group 8)"),
     (["--model-path", str(MODELS / "gemma-2b"), "--head-dim", "128"],
      f"--head-dim 128 disagrees with --model-path {MODELS / 'gemma-2b'} (8 attention heads / 1 KV heads, head_dim 256)")],
)
def test_a_bad_argument_is_named_before_the_gpu_is_looked_for(prog, args, bad):
    """On a machine without CUDA the mistake is what the user hears of, not the missing GPU."""
    run = subprocess.run([sys.executable, "-m", *prog, *args], capture_output=True, text=True)
    assert run.returncode == 2
    assert f"sglang-chunk-align probe: error: {bad}" in run.stderr and "cannot measure" not in run.stderr


def test_a_start_on_fa2s_own_smaller_tile_is_exact():
    """At head_dim 256 fa2's tile is 64 rows, so 1000 tokens at GQA 8 (8000 rows) start on it:
    exact on 0.7.2 (tests/gpu/logs/h200_flashinfer072_pytest.log, test_fa2_finer_grid_is_exact_too)."""
    uniform1000 = next(c for c in probe.cases(8) if c.name == "uniform1000")
    assert probe.expectation(FI072, 8, 256, uniform1000) == probe.EXACT
    assert probe.expectation(FI072, 4, 256, uniform1000) == probe.INEXACT  # 4000 rows: off the 64-row tile
    assert probe.expectation(FI072, 8, 128, uniform1000) == probe.INEXACT


def test_every_measured_fact_cites_a_recorded_run_in_the_repository():
    root = pathlib.Path(__file__).parent.parent
    for facts in (FI072, FI074):
        sources = [source for _, _, source in facts.evidence if source]
        assert sources and all((root / source).is_file() for source in sources), facts.flashinfer
        assert all(not source.startswith(("/", "..")) for source in sources)


def _shapes_in_recorded_runs(facts):
    """(GQA group, head_dim) of every result row in the JSON runs `facts` cite: probe rows name
    group and head_dim (or d); the rule runs a cfg of q heads / KV heads / head_dim."""
    root = pathlib.Path(__file__).parent.parent
    shapes = set()
    for _, _, source in facts.evidence:
        if not source.endswith(".json"):
            continue
        doc = json.loads((root / source).read_text())
        for row in doc.get("results") or doc.get("rows"):
            if "cfg" in row:
                q_heads, kv_heads, head_dim = map(int, row["cfg"].split("/"))
                shapes.add((q_heads // kv_heads, head_dim))
            elif "group" in row:
                shapes.add((row["group"], row.get("head_dim", row.get("d"))))
    return shapes


@pytest.mark.parametrize("facts", [FI072, FI074], ids=lambda f: f.flashinfer)
def test_the_measured_shapes_are_those_of_the_recorded_runs(facts):
    """What plan and doctor call measured, per release, is what its cited runs measured: no more
    (0.7.4 never ran head_dim 512), no less."""
    claimed = {(group, head_dim) for head_dim, groups in facts.measured_shapes for group in groups}
    assert claimed == _shapes_in_recorded_runs(facts)


@pytest.mark.parametrize("run, holds, cases", [
    ("probe_h200_fi072_d128", True, 72), ("probe_h200_fi072_d256", True, 72), ("probe_h200_fi074_d128", True, 72),
    ("probe_h200_fi074_d256", True, 72), ("probe_h200_fi072_d512", False, 72), ("probe_h100_fi074_g3_d128", True, 24),
])
def test_the_recorded_probe_runs_judged_against_the_table_today(run, holds, cases):
    """`sglang-chunk-align probe` on the H200 (tests/gpu/logs): the table as it stands now predicts
    every case at head_dim 128 and 256 on both releases; at head_dim 512 the short final pieces came
    out exact where the table, read from flashinfer's source, keeps the stricter tile (safe, not tight)."""
    doc = json.loads((EVIDENCE / f"{run}.json").read_text())
    checked = probe.verdicts(facts_for(doc["environment"]["flashinfer"])[0], doc["results"])
    assert (probe.summary(None, checked)[1] == probe.HOLD) == holds
    wrong = [r for r in checked if not r["holds"]]
    assert all(r["case"]["fact"] == "tiles" and r["exact"] and r["expected"] == probe.INEXACT for r in wrong)
    assert len(checked) == cases
