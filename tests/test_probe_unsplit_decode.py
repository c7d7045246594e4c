"""benchmarks/probe_unsplit_decode.py without a GPU: the plans it makes (the plugin's UNSPLIT for the
fix, stock's for the rest, through a flashinfer that records them), its verdict on made-up rows,
its JSON document and summary, its shapes against benchmarks/models, and its dry run."""

import json
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from benchmarks import probe_unsplit_decode as probe
from sglang_chunk_align.unsplit_decode import UNSPLIT

ROOT = pathlib.Path(__file__).parent.parent


class RecordingWrapper:
    """flashinfer's BatchDecodeWithPagedKVCacheWrapper as far as planning goes: it keeps what it is given."""

    def __init__(self, workspace, layout, **kwargs):
        self.made_with, self.plans = kwargs, []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


@pytest.fixture
def recording_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper))


@pytest.mark.parametrize("variant, made_with, split", [
    ("eager_stock", {}, dict(fixed_split_size=2048, disable_split_kv=False)),
    ("eager_fix", {}, UNSPLIT),
    ("graph", {"use_cuda_graph": True}, dict(fixed_split_size=None, disable_split_kv=True)),
])
def test_each_variant_is_planned_as_it_runs_in_sglang(recording_flashinfer, variant, made_with, split):
    shape = probe.SHAPES[0]
    lens = probe.batch_lens(3000, 8)
    kv_indptr, kv_indices = probe.fa2.indptr(lens), torch.arange(sum(lens), dtype=torch.int32)
    wrapper = probe.planned(variant, "workspace", shape, kv_indptr, kv_indices).wrapper
    assert wrapper.made_with.items() >= {"use_tensor_cores": True, **made_with}.items()
    assert wrapper.made_with.get("use_cuda_graph", False) == (variant == "graph")
    [(args, kwargs)] = wrapper.plans
    assert {k: kwargs[k] for k in ("fixed_split_size", "disable_split_kv")} == split
    assert args[3:7] == (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 1)
    assert args[0].tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]


def test_the_fix_variant_is_the_plugins_own_plan():
    assert probe.EAGER_PLANS["eager_fix"] is UNSPLIT


def test_a_batch_is_the_request_under_test_then_every_other_length():
    assert probe.batch_lens(3000, 1) == [3000]
    lens = probe.batch_lens(3000, 8)
    assert lens[0] == 3000 and set(lens) == set(probe.KV_LENS) and lens[1] == 4097
    assert probe.batch_lens(32768, 3) == [32768, 1000, 2049]


def test_its_shapes_are_the_models_own():
    for shape in probe.SHAPES:
        config = json.loads((ROOT / "benchmarks" / "models" / shape.name / "config.json").read_text())
        heads = config["num_attention_heads"]
        assert (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim) == (
            heads, config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // heads)
    assert {s.head_dim for s in probe.SHAPES} == {128, 256}


def measured(differing=(), shapes=("qwen2.5-7b", "gemma-2b")):
    """Made-up results: every row exact but the (variant, KV length) pairs named, at every batch."""
    return [dict(shape=name, cells=[dict(kv_len=kv_len, variant=variant, batch=batch,
                                         exact=(variant, kv_len) not in differing,
                                         max_abs=0.0 if (variant, kv_len) not in differing else 2e-3)
                                    for kv_len, variant, batch in probe.cells_planned()]) for name in shapes]


STOCK_SPLITS = {("eager_stock", n) for n in probe.KV_LENS if n > 2048}


def test_the_fix_holds_where_every_fix_and_graph_row_is_exact():
    v = probe.verdict(measured(STOCK_SPLITS))
    assert (v["fix"], v["stock_inexact"], v["suspect"]) == (probe.HOLDS, True, False)
    assert v["reasons"] == ["every eager_fix and graph row of 2 shapes exact",
                            "stock's eager split differs in 36 of 36 rows past 2048"]


def test_stock_exact_everywhere_is_not_shown_inexact():
    v = probe.verdict(measured())
    assert (v["fix"], v["stock_inexact"]) == (probe.HOLDS, False)
    assert v["reasons"][-1] == "stock's eager split differs in 0 of 36 rows past 2048"


def test_a_fix_or_graph_row_that_differs_refutes_the_fix_and_says_where():
    v = probe.verdict(measured(STOCK_SPLITS | {("eager_fix", 8192), ("eager_fix", 32768), ("graph", 4097)}))
    assert (v["fix"], v["suspect"]) == (probe.DOES_NOT_HOLD, False)
    assert v["reasons"][0] == ("differs from the graph reference: qwen2.5-7b graph at KV [4097], batches [8] (max abs "
                               "0.002); qwen2.5-7b eager_fix at KV [8192, 32768], batches [1, 8, 64] (max abs 0.002); "
                               "gemma-2b graph at KV [4097], batches [8] (max abs 0.002); "
                               "gemma-2b eager_fix at KV [8192, 32768], batches [1, 8, 64] (max abs 0.002)")


def test_a_row_within_the_split_that_differs_makes_the_probe_suspect_and_shows_no_split():
    v = probe.verdict(measured({("eager_stock", 1000)}))
    assert (v["fix"], v["suspect"], v["stock_inexact"]) == (probe.DOES_NOT_HOLD, True, False)
    assert v["reasons"][0].startswith("probe suspect: rows within the 2048 split differ: qwen2.5-7b eager_stock at KV [1000]")
    assert v["reasons"][-1] == "stock's eager split differs in 0 of 36 rows past 2048"


def test_a_failed_shape_or_nothing_measured_never_holds():
    failed = measured(STOCK_SPLITS, shapes=("qwen2.5-7b",)) + [dict(shape="gemma-2b", cells_error="RuntimeError: JIT")]
    v = probe.verdict(failed)
    assert v["fix"] == probe.DOES_NOT_HOLD and v["reasons"][0] == "gemma-2b: RuntimeError: JIT"
    v = probe.verdict([])
    assert (v["fix"], v["stock_inexact"], v["reasons"]) == (probe.DOES_NOT_HOLD, False,
                                                            ["nothing was measured", "stock not measured"])


def test_main_writes_the_document_and_prints_its_summary(monkeypatch, tmp_path, capsys):
    """main as on a GPU, its measurements made up: the JSON document's keys and the summary."""
    cells = {r["shape"]: r["cells"] for r in measured(STOCK_SPLITS, shapes=[s.name for s in probe.SHAPES])}
    monkeypatch.setattr(probe, "has_gpu", lambda: True)
    monkeypatch.setattr(probe, "environment", lambda: dict(torch="2.9", flashinfer="0.7.2", cuda="12.9", gpu="H200"))
    monkeypatch.setattr(probe, "measure", lambda shape: cells[shape.name])

    def time_calls(shape):
        if shape.name == "gemma-2b":
            raise RuntimeError("CUDA out of memory")
        return [dict(shape=shape.name, kv_len=4096, batch=1, eager_stock_ms=0.02, eager_fix_ms=0.03, fix_over_stock=1.5)]

    monkeypatch.setattr(probe, "time_calls", time_calls)
    out = tmp_path / "unsplit.json"
    assert probe.main(["--json", str(out), "--shapes", "qwen2.5-7b", "gemma-2b"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"environment", "kv_lens", "batches", "graph_batch", "plans", "results", "timings", "verdict"}
    assert doc["environment"] == dict(torch="2.9", flashinfer="0.7.2", cuda="12.9", gpu="H200", decode_split=2048)
    assert doc["plans"] == dict(eager_stock=dict(fixed_split_size=2048, disable_split_kv=False), eager_fix=UNSPLIT,
                                graph=dict(fixed_split_size=None, disable_split_kv=True))
    assert [r["shape"] for r in doc["results"]] == ["qwen2.5-7b", "gemma-2b"]
    assert doc["results"][1]["timings_error"] == "RuntimeError: CUDA out of memory"
    assert doc["timings"] == [dict(shape="qwen2.5-7b", kv_len=4096, batch=1, eager_stock_ms=0.02, eager_fix_ms=0.03,
                                   fix_over_stock=1.5)]
    assert doc["verdict"]["fix"] == probe.HOLDS and doc["verdict"]["stock_inexact"]
    printed = capsys.readouterr().out
    assert "qwen2.5-7b KV 3000: eager_stock@1 differs (0.002), eager_stock@8 differs (0.002)" in printed
    assert "gemma-2b timings_error: RuntimeError: CUDA out of memory" in printed
    assert "qwen2.5-7b KV 4096 batch 1: stock 0.0200 ms, fix 0.0300 ms, fix/stock 1.50" in printed
    assert printed.rstrip().splitlines()[-1].startswith("fix holds; stock shown inexact: yes: every eager_fix")


def test_a_json_path_in_no_folder_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        probe.main(["--json", str(tmp_path / "missing" / "unsplit.json")])
    assert exit_.value.code == 2 and "argument --json: no folder" in capsys.readouterr().err


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run")
    assert probe.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_dry_run_plans_without_torch_or_flashinfer():
    code = ("import sys; from benchmarks.probe_unsplit_decode import main; main(['--dry-run', '--shapes', 'llama-3.1-8b']);"
            " print(sorted({'torch', 'flashinfer'} & set(sys.modules)))")
    printed = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = printed.splitlines()
    assert lines[-1] == "[]"
    assert "eager_fix {'fixed_split_size': None, 'disable_split_kv': True}" in lines[1]
    assert lines[3] == ("llama-3.1-8b (32 q heads, 8 KV heads, head_dim 128): 56 decode rows (14 CUDA graphs), "
                        "16 timings (368 calls); timed KV 32.0 GiB")
