"""benchmarks/gemm_configs.py's and probe_split_k.py's plans and verdicts, without a GPU: the GEMM
shapes read from benchmarks/models' configs, the configs proven, and verdicts that fail where any
config differs from stock, where stock or a fixed split is batch-variant, or where a control could
not be seen. (Their runs under Triton's interpreter: TRITON_INTERPRET=1 python3 -m
benchmarks.gemm_configs --stand-in, and the same for benchmarks.probe_split_k.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gemm_configs, probe_split_k
from sglang_chunk_align import gemms


def test_qwen_gemms_are_its_layers_at_tp1():
    found = {layer: (shape, per_step) for layer, shape, per_step in gemm_configs.model_gemms("qwen2.5-7b", "bfloat16")}
    assert found == {
        "qkv": (gemms.Shape("bfloat16", (28 + 2 * 4) * 128, 3584, True), 28),  # Qwen2 projects q, k, v with a bias
        "o": (gemms.Shape("bfloat16", 3584, 3584, False), 28),
        "gate_up": (gemms.Shape("bfloat16", 2 * 18944, 3584, False), 28),
        "down": (gemms.Shape("bfloat16", 3584, 18944, False), 28),
        "lm_head": (gemms.Shape("bfloat16", 152064, 3584, False), 1),
    }


def test_moe_experts_are_not_gemms_here_but_the_router_is_and_the_vocabulary_is_padded():
    found = {layer: shape for layer, shape, _ in gemm_configs.model_gemms("qwen3-30b-a3b", "float16")}
    assert set(found) == {"qkv", "o", "router", "lm_head"}
    assert found["router"] == gemms.Shape("float16", 128, 2048, False)
    granite = {layer: shape for layer, shape, _ in gemm_configs.model_gemms("granite-3.1-8b", "bfloat16")}
    assert granite["lm_head"].n == 49216  # 49,155 padded to a multiple of 64


def test_the_proof_covers_every_tunable_config_and_more():
    for dtype in gemms.STOCK:
        tunable = {c for top in gemms.BUCKETS for c in gemms.candidates(dtype, top)}
        proven = set(gemm_configs.proven_configs(dtype))
        assert tunable < proven and {c.block_k for c in proven} == {gemms.STOCK[dtype].block_k}


SOUND = {"configs_differing": {}, "stock_rows_differ_from_its_largest_m": [],
         "cublas_differs_from_stock_at": [1, 64], "cublas_rows_differ_from_its_largest_m": []}


@pytest.mark.parametrize("fault, holds", [
    ({}, True),
    ({"configs_differing": {"[16, 64, 64, 3, 4]": [1]}}, False),
    ({"stock_rows_differ_from_its_largest_m": [7]}, False),
    ({"cublas_differs_from_stock_at": []}, False),  # the control could not be seen
])
def test_the_verdict_holds_only_with_stock_bits_everywhere_and_the_control_seen(fault, holds):
    verdict = gemm_configs.verdict([{**SOUND, **fault}])
    assert (verdict["bit_compatible"] and verdict["control_seen"]) is holds


def _split_k_shape(fault=None):
    check = {splits: {"rows_differ_from_largest_m": [], "rows_differ_from_alone": [],
                      "differs_from_stock_at": [] if splits == 1 else [1]} for splits in probe_split_k.SPLITS}
    check["control_rows_differ_from_largest_m"] = [3]
    fast_mode = {"splits": 4, "tiles": {"256": [128, 128, 64, 4, 8]}, "tiles_of_other_bits": []}
    for key, value in (fault or {}).items():
        if isinstance(key, tuple):
            check[key[0]][key[1]] = value
        elif key in fast_mode:
            fast_mode[key] = value
        else:
            check[key] = value
    return {"check": check, "fast_mode": fast_mode}


@pytest.mark.parametrize("fault, holds", [
    (None, True),
    ({(4, "rows_differ_from_largest_m"): [64]}, False),  # a split whose rows change with the batch
    ({(2, "rows_differ_from_alone"): [17]}, False),
    ({(1, "differs_from_stock_at"): [1]}, False),  # one split must be stock's own sum
    ({"control_rows_differ_from_largest_m": []}, False),  # the split chosen by M went unseen
    ({"tiles_of_other_bits": [[64, 64, 64, 3, 4]]}, False),  # split_tiles refused a tile: not the split's bits
])
def test_the_split_k_probe_holds_only_batch_invariant_with_its_controls_seen(fault, holds):
    verdict = probe_split_k.verdict([_split_k_shape(fault)])
    assert all(verdict.values()) is holds


INTERRUPTED = """
import json, sys
from benchmarks import gemm_configs
bench = gemm_configs.Bench(stand_in=True)
qkv, down = gemm_configs.stand_in_gemms("stand-in", "float16")

def gemms_of(model, dtype):  # SIGINT lands in the second model, after one of its GEMMs was measured
    yield qkv
    if model == "second":
        yield down
        raise KeyboardInterrupt

bench.gemms_of = gemms_of
doc = gemm_configs.measured(bench, ["first", "second"], ["float16"])
json.dump({"doc": doc, "summary": gemm_configs.summary(doc)}, sys.stdout)
"""


def test_an_interrupted_run_keeps_each_shape_measured_and_no_half_summed_decode_step():
    """The GPU plan's time limit interrupts a probe with SIGINT: the record keeps both shapes measured,
    is marked incomplete, and sums the decode step of the first model only. SGLang's kernel runs
    under Triton's interpreter, which must be set before Triton is imported: a process of its own."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", INTERRUPTED], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    doc = found["doc"]
    assert doc["complete"] is False and len(doc["shapes"]) == 2
    assert [row["model"] for row in doc["results"]] == ["first"]
    assert list(doc["decode_step_gemms"]) == ["first float16"]
    assert "INTERRUPTED" in found["summary"].splitlines()[0]


KILLED = """
import os, sys
from benchmarks import probe_split_k
sound = {splits: {"rows_differ_from_largest_m": [], "rows_differ_from_alone": [],
                  "differs_from_stock_at": [] if splits == 1 else [1]} for splits in probe_split_k.SPLITS}
sound["control_rows_differ_from_largest_m"] = [3]
checked = []

def check(tensors, rows):  # the second shape's check never returns: the process dies as a KILL would end it
    checked.append(rows)
    if len(checked) == 2:
        os._exit(137)
    return sound

probe_split_k.check = check
probe_split_k.timing = lambda bench, shape, tensors, rows: ({}, {"splits": 4, "tiles": {}, "tiles_of_other_bits": []})
probe_split_k.main(["--stand-in", "--json", sys.argv[1]])
"""


def test_the_split_k_probe_keeps_each_shape_it_finished_when_killed(tmp_path):
    """The time limit may end the probe where no Python runs (call7's wrote nothing of two finished shapes):
    the record holds every shape finished before the end, marked incomplete."""
    record = tmp_path / "probe_split_k.json"
    run = subprocess.run([sys.executable, "-c", KILLED, str(record)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 137, run.stderr[-3000:]
    doc = json.loads(record.read_text())
    assert doc["complete"] is False
    assert [shape["layer"] for shape in doc["shapes"]] == [probe_split_k.STAND_IN_GEMMS[0][0]]
    assert all(doc["verdict"].values())
