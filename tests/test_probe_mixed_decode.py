"""benchmarks/probe_mixed_decode.py without a GPU: its verdict reads measurements right, and it
refuses to run without one (the H200 run is its record: benchmarks/logs/split_attention_h200/)."""

import pytest

from benchmarks import probe_mixed_decode as probe

VARIANTS = (*probe.DECODE_VARIANTS, *probe.MIXED_VARIANTS)


def measured(differing=()):
    """A fake result: every row exact but the (variant, KV length) pairs named."""
    rows = [{"kv_len": n, **{v: dict(exact=(v, n) not in differing, max_abs=1e-3 * ((v, n) in differing))
                             for v in VARIANTS}} for n in probe.KV_LENS]
    return [dict(shape="g4-d128", rows=rows)]


def test_every_row_identical_everywhere_holds():
    outcome, reasons = probe.verdict(measured())
    assert outcome == probe.HOLDS and str(len(probe.KV_LENS)) in reasons[0]


def test_a_mixed_row_or_a_decode_variant_that_differs_refutes_it_and_says_where():
    outcome, reasons = probe.verdict(measured({("mixed", 3000), ("mixed", 6000)}))
    assert outcome == probe.DOES_NOT_HOLD
    assert reasons == ["one-token extends differ from the decode step: mixed at KV lengths [3000, 6000]"]
    outcome, reasons = probe.verdict(measured({("decode_graph", 4097)}))
    assert reasons == ["decode steps differ among themselves: decode_graph at KV lengths [4097]"]


def test_a_failed_shape_or_nothing_measured_never_holds():
    assert probe.verdict([dict(shape="g2-d256", error="RuntimeError: JIT")])[0] == probe.DOES_NOT_HOLD
    assert probe.verdict([])[0] == probe.DOES_NOT_HOLD


def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run")
    assert probe.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
