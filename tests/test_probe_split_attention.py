"""benchmarks/probe_split_attention.py without a GPU: its batches exercise what the premise needs
at every shape, its verdict reads measurements right, and importing it uses no torch (the GPU
machine imports it before anything else)."""

import pathlib
import subprocess
import sys

import pytest

from benchmarks import probe_split_attention as probe
from benchmarks.workload import SHAPES, ModelShape
from sglang_chunk_align.kernel_facts import FI072

ROOT = pathlib.Path(__file__).parent.parent


def rules_of(shape):
    """flashinfer 0.7.2's rules (what the H200 runs) at a shape, whatever is installed here."""
    return probe.rules_at(shape, FI072)


def predicted(shape):
    """Every member of every batch at a shape, as predictions() sees it."""
    return [m for batch in probe.batches(shape.group) for m in probe.predictions(rules_of(shape), batch)[1]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_extend_starts_on_the_grid_within_its_prompt(shape):
    grid = rules_of(shape).grid
    assert all(m["start"] % grid == 0 and m["start"] < m["end"] <= m["prompt_len"] for m in predicted(shape))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_at_every_shape_the_control_moves_a_member_off_its_tile_that_the_split_keeps_on(shape):
    """Otherwise the probe could not tell split attention from the mixed call at that shape."""
    assert any(probe.on_tile(m, "split") and not probe.on_tile(m, "mixed") for m in predicted(shape))


def test_the_probe_also_measures_what_the_split_cannot_fix():
    """A 10-token final piece alone in the 128-row class: off its tile split too, at GQA 1 and 4."""
    off = {shape.name for shape in SHAPES for m in predicted(shape) if not probe.on_tile(m, "split")}
    assert off == {"g1-d128", "g4-d128"}


def measured_as_predicted(shape):
    """A fake run at one shape: every member exact exactly where the rules predict it."""
    results = []
    for batch in probe.batches(shape.group):
        groups, members = probe.predictions(rules_of(shape), batch)
        for m in members:
            for call in ("split", "mixed", "backend"):
                m[f"{call}_exact"] = probe.on_tile(m, call)
                m[f"{call}_max_abs"] = 0.0 if m[f"{call}_exact"] else 1e-3
        results.append(dict(shape=shape.name, batch=batch.name, groups=groups, members=members))
    return results


def test_the_premise_holds_where_measurements_follow_the_tile():
    outcome, reasons = probe.verdict([r for shape in SHAPES for r in measured_as_predicted(shape)])
    assert outcome == probe.HOLDS, reasons
    lines = [probe.format_member(m) for r in measured_as_predicted(SHAPES[3]) for m in r["members"]]
    assert any("split tile 64 exact; mixed tile 128 differs (max abs 0.001)" in line for line in lines)


def test_the_backend_pads_the_piece_the_split_leaves_off_its_tile():
    """The same members, padded in the backend's SplitPrefill (issue 48): the probe measures pads there."""
    padded = {shape.name for shape in SHAPES for m in predicted(shape)
              if probe.on_tile(m, "backend") and not probe.on_tile(m, "split")}
    assert padded == {"g1-d128", "g4-d128"}
    assert all(probe.on_tile(m, "backend") for shape in SHAPES for m in predicted(shape))
    outcome, reasons = probe.verdict([r for shape in SHAPES for r in measured_as_predicted(shape)])
    assert "(2 of them only in a padded call)" in reasons[0]


def test_a_padded_member_that_differs_in_the_backend_refutes_the_premise():
    results = measured_as_predicted(next(s for s in SHAPES if s.name == "g1-d128"))
    member = next(m for r in results for m in r["members"] if not probe.on_tile(m, "split"))
    member["backend_exact"] = False
    assert probe.verdict(results)[0] == probe.DOES_NOT_HOLD


def test_a_member_on_its_tile_that_differs_split_refutes_the_premise():
    results = measured_as_predicted(SHAPES[0])
    member = next(m for r in results for m in r["members"] if probe.on_tile(m, "split"))
    member["split_exact"] = False
    assert probe.verdict(results)[0] == probe.DOES_NOT_HOLD


def test_a_control_that_never_differs_or_a_failed_batch_is_inconclusive():
    results = measured_as_predicted(SHAPES[0])
    for m in (m for r in results for m in r["members"]):
        m["mixed_exact"] = True
    assert probe.verdict(results)[0] == probe.INCONCLUSIVE
    failed = [*measured_as_predicted(SHAPES[0]), dict(shape="g2-d256", batch="b", error="RuntimeError: JIT")]
    outcome, reasons = probe.verdict(failed)
    assert outcome == probe.INCONCLUSIVE and "g2-d256, b: RuntimeError: JIT" in reasons


def test_importing_the_probe_uses_no_torch():
    code = "import sys, benchmarks.probe_split_attention; print(sorted({'torch', 'flashinfer'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_without_cuda_it_says_so_and_exits_2(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the probe would run")
    assert probe.main([]) == 2
    assert "needs a CUDA GPU and flashinfer" in capsys.readouterr().err


class TileKernel:
    """Stand-in for fa2 on the CPU: a row is its Q plus its own position's K, off by its call's tile
    unless its causal KV is at most rules.exempt_kv; `tile_of` reads the tile off the call's
    extend lengths (fa2: their average)."""

    def __init__(self, shape, rules, tile_of=None):
        self.group, self.rules = shape.group, rules
        self.tile_of = tile_of or rules.batch_tile

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, fixed_split):
        import torch

        tile = self.tile_of(qo_indptr.diff().tolist())
        out = torch.empty_like(q)
        for i in range(len(qo_indptr) - 1):
            rows = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
            kv = kv_indices[int(kv_indptr[i]): int(kv_indptr[i + 1])].long()
            positions = torch.arange(len(kv) - (rows.stop - rows.start), len(kv))
            skew = (positions + 1 > self.rules.exempt_kv).to(q.dtype)[:, None, None] * tile / 64
            out[rows] = q[rows] + k_cache[kv[positions], 0].repeat_interleave(self.group, 1) + skew
        return out


# The groups and head_dims of SHAPES, with one KV head: what the rules read, at a CPU's cost.
SMALL_SHAPES = [ModelShape(s.name, s.group, 1, s.head_dim) for s in SHAPES]


def run_on_cpu(make_kernel):
    pytest.importorskip("torch")
    return [
        probe.measure(shape, rules_of(shape), batch, make_kernel(shape, rules_of(shape)), device="cpu")
        for shape in SMALL_SHAPES
        for batch in probe.batches(shape.group)
    ]


def test_measured_on_a_tile_rule_kernel_every_member_is_exact_where_predicted():
    """The probe's rows, end to end on the CPU: solo, split and mixed calls through run_batches."""
    results = run_on_cpu(TileKernel)
    members = [m for r in results for m in r["members"]]
    assert all(m[f"{call}_exact"] == probe.on_tile(m, call) for m in members for call in ("split", "mixed"))
    assert probe.verdict(results)[0] == probe.HOLDS


def test_a_kernel_that_tiles_on_the_total_not_the_average_refutes_the_premise():
    results = run_on_cpu(lambda shape, rules: TileKernel(shape, rules, lambda lens: rules.batch_tile([sum(lens)])))
    assert probe.verdict(results)[0] == probe.DOES_NOT_HOLD
