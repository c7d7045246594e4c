"""Fast GEMMs (split_k.py): the split rule, the kernel's batch invariance and bits, the dispatch, the
switch and the startup line.

The kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are defined, so
in a subprocess of its own) on CPU tensors. There each BLOCK_K block is one numpy product, so a split
of several blocks regroups each sum: fp32 shows it in the last bits, which fp16 outputs may round away.
On a GPU the same checks are tests/gpu/test_gemm_bits.py's.
"""

import logging

import pytest
from conftest import run_interpreted

from sglang_chunk_align import gemms
from sglang_chunk_align.compat import FAST_GEMMS_ENV, GEMMS_ENV

pytestmark = pytest.mark.needs_gemm_configs

INTERPRETED = r"""
from sglang_chunk_align import gemms, patch_table, patches, split_k

torch.manual_seed(0)
report = {}
rows = (1, 3, 17, 40)
for dtype in (torch.float16, torch.float32):
    weight, bias = (torch.randn(96, 1024) * 0.02).to(dtype), torch.randn(96).to(dtype)
    a = torch.randn(rows[-1], 1024).to(dtype)
    block_k = gemms.STOCK[gemms.dtype_name(dtype)].block_k
    stock = gemms.stock(a, weight.t(), dtype, bias)
    def run(m, splits, **how):
        return split_k.launch(a[:m], weight.t(), dtype, bias, splits, block_k, **how)
    found = {"one_range_is_stock": gemms.same_bits(run(rows[-1], 1), stock)}
    for splits in (2, 4):
        largest = run(rows[-1], splits)
        found[splits] = {
            "differs_from_stock": not gemms.same_bits(largest, stock),
            "rows_differ_from_largest_m": [m for m in rows if not gemms.same_bits(run(m, splits), largest[:m])],
            "rows_differ_from_alone": [i for i in range(3) if not gemms.same_bits(
                split_k.launch(a[i:i + 1], weight.t(), dtype, bias, splits, block_k), largest[i:i + 1])],
            "in_program_differs": [m for m in rows if not gemms.same_bits(
                run(m, splits, in_program=True), run(m, splits, in_program=False))],
            "tile_differs": [m for m in rows if not gemms.same_bits(
                run(m, splits, config=gemms.Config(32, 32, block_k, 4, 4)), run(m, splits, in_program=False))],
        }
    # The control: a split chosen by M, as a split-K that is not batch-invariant chooses it.
    by_m = {m: run(m, 1 if m <= 16 else 4) for m in rows}
    found["control_rows_differ_from_largest_m"] = [m for m in rows if not gemms.same_bits(by_m[m], by_m[rows[-1]][:m])]
    report[str(dtype)] = found

# The dispatch: one shape split, one with a per-M config, through SGLang's matmul_persistent.
split_shape, tuned_shape = gemms.Shape("float16", 96, 1024, True), gemms.Shape("float16", 64, 1024, False)
weights = {shape: (torch.randn(shape.n, shape.k) * 0.02).half() for shape in (split_shape, tuned_shape)}
split_bias = torch.randn(96).half()
launched = []
launch = split_k.launch
def recording(a, b, out_dtype, bias, splits, block_k, config=None, **how):
    launched.append(("split", a.shape[0], splits, config and list(config)))
    return launch(a, b, out_dtype, bias, splits, block_k, config=config, **how)
split_k.launch = recording

# split_tiles: a stand-in clock where one program per tile is faster from 32 rows of tile up, and a
# stand-in GPU where a tile of 5 stages changes the bits (it must be refused, and named).
def perturbed(a, b, out_dtype, bias, splits, block_k, config=None, **how):
    out = recording(a, b, out_dtype, bias, splits, block_k, config=config, **how)
    return out + 1 if config is not None and config.stages == 5 else out
split_k.launch = perturbed
tiles, differing = gemms.split_tiles(
    split_shape, weights[split_shape], split_bias, 2,
    {16: gemms.Config(16, 32, 64, 3, 4), 32: gemms.Config(32, 32, 64, 5, 4), 64: gemms.Config(64, 32, 64, 3, 4)},
    lambda config, a, b, bias: 1.0 if config is None else 2.0 if config.block_m < 32 else 0.5)
report["split_tiles"] = {"tiles": {top: list(c) for top, c in tiles.items()}, "differing": [list(c) for c in differing]}
split_k.launch = recording

patches.apply(patch_table)
gemms.activate(gemms.Table({tuned_shape: {16: gemms.Config(16, 64, 64, 3, 4)}}, {split_shape: 2},
                           {split_shape: {16: gemms.Config(32, 32, 64, 4, 4)}}))
served = {}
for m in (1, 5, 17, 300):
    a = torch.randn(m, 1024).half()
    del launched[:]
    out = kernels.matmul_persistent(a, weights[split_shape].t(), bias=split_bias)
    served[m] = {"launched": list(launched),
                 "split_bits": gemms.same_bits(out, launch(a, weights[split_shape].t(), a.dtype, split_bias, 2, 64))}
    del launched[:]
    kernels.matmul_persistent(a, weights[tuned_shape].t())
    served[m]["other_shape_launched"] = list(launched)
patches.remove()
a = torch.randn(5, 1024).half()
del launched[:]
after = kernels.matmul_persistent(a, weights[split_shape].t(), bias=split_bias)
report["dispatch"] = {"served": served, "after_remove_launched": list(launched),
                      "after_remove_stock_bits": gemms.same_bits(after, gemms.stock(a, weights[split_shape].t(), a.dtype, split_bias))}
json.dump(report, sys.stdout)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.float32"])
def test_each_split_is_batch_invariant_whichever_program_adds_the_ranges(interpreted, dtype):
    found = interpreted[dtype]
    assert found["one_range_is_stock"]
    for splits in ("2", "4"):
        assert found[splits]["rows_differ_from_largest_m"] == []
        assert found[splits]["rows_differ_from_alone"] == []
        assert found[splits]["in_program_differs"] == []
        assert found[splits]["tile_differs"] == []


def test_a_split_gives_other_bits_than_stock_and_a_split_by_m_is_caught(interpreted):
    """The checks above can see a difference: fp32 shows the regrouped sums in its last bits."""
    found = interpreted["torch.float32"]
    assert found["2"]["differs_from_stock"] and found["4"]["differs_from_stock"]
    assert found["control_rows_differ_from_largest_m"]


def test_a_split_shape_runs_its_split_at_every_m_its_tile_in_its_bucket_and_stock_after_remove(interpreted):
    dispatch = interpreted["dispatch"]
    for m, served in dispatch["served"].items():
        tile = [32, 32, 64, 4, 4] if int(m) <= 16 else None  # the table's one tiled bucket
        assert served["launched"] == [["split", int(m), 2, tile]] and served["split_bits"], m
        assert served["other_shape_launched"] == [], m  # a per-M config, or stock's above 256 rows
    assert dispatch["after_remove_launched"] == [] and dispatch["after_remove_stock_bits"]


def test_split_tiles_keep_a_faster_tile_of_the_split_bits_and_refuse_one_of_other_bits(interpreted):
    """Bucket 16's tile is slower than the default launch on the stand-in clock, 32's changes the bits on
    the stand-in GPU, 64's is kept, and 128 and 256 try stock's config (no per-M config given), kept too."""
    found = interpreted["split_tiles"]
    stock = list(gemms.STOCK["float16"])
    assert found == {"tiles": {"64": [64, 32, 64, 3, 4], "128": stock, "256": stock},
                     "differing": [[32, 32, 64, 5, 4]]}


def test_the_split_depends_on_the_shape_alone():
    """Qwen2.5-7B's GEMMs: the narrow ones split (qkv and o 4, down 8, o held to 4 by its 3,584 of K),
    the wide ones (gate_up, lm_head) not, as call1's probe measured them to gain nothing."""
    from sglang_chunk_align import split_k

    assert [split_k.splits_for(n, k) for n, k in ((4608, 3584), (3584, 3584), (3584, 18944), (37888, 3584),
                                                  (152064, 3584), (96, 256))] == [4, 4, 8, 1, 1, 1]


def test_fast_mode_splits_some_shapes_tunes_the_rest_and_says_so(monkeypatch, tmp_path, caplog):
    import torch

    from sglang.srt.layers.linear import ReplicatedLinear

    monkeypatch.setenv(FAST_GEMMS_ENV, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = torch.nn.Sequential(ReplicatedLinear(4096, 512, bias=True, params_dtype=torch.float16),
                                ReplicatedLinear(512, 16384, bias=False, params_dtype=torch.float16))
    split, wide = gemms.Shape("float16", 512, 4096, True), gemms.Shape("float16", 16384, 512, False)
    tuned = {16: gemms.Config(16, 64, 64, 3, 4), 256: gemms.Config(64, 64, 64, 3, 4)}
    tried = []

    def tile_split(shape, weight, bias, splits, configs):
        tried.append((shape, splits, configs))
        return {256: configs[256]}, [configs[16]]

    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        table = gemms.startup_table(model, None, tune_shape=lambda shape, weight, bias: (tuned, []),
                                    tile_split=tile_split)
    # The split shape's per-M configs are the tiles tried, not configs of stock's kernel.
    assert table.splits == {split: 8} and table.configs == {wide: tuned}
    assert tried == [(split, 8, tuned)] and table.split_tiles == {split: {256: tuned[256]}}
    assert (f"fast GEMMs ({FAST_GEMMS_ENV}=1) sum K as fixed ranges per shape, the same at every M, for 1 of the "
            "model's 2 Triton GEMM shapes (float16 512x4096 +bias: 8): batch-invariant, but not stock's bits" in caplog.text)
    assert ("tile config per M for 1 of 1 Triton GEMM shapes not split by fast mode (its 1 split shapes' configs "
            "are tiles it tries) (float16 16384x512)" in caplog.text)
    assert ("fast GEMMs run one program per tile, the shape's per-M tile, in the M buckets where that gave the "
            "split's bits on this GPU and was faster (float16 512x4096 +bias: M 129-256;" in caplog.text)
    assert (f"float16 512x4096 +bias: {tuned[16]} in one program per tile gave bits other than the split's, not used"
            in caplog.text)
    # A second runner (a draft model's) keeps the first one's splits, configs and tiles, checking none again.
    again = gemms.startup_table(torch.nn.Sequential(torch.nn.Linear(8, 8)), table)
    assert (again.splits, again.configs, again.split_tiles) == (table.splits, table.configs, table.split_tiles)
    # With the per-M configs off, nothing is tuned: the split shape tries stock's config, the others keep it.
    monkeypatch.setenv(GEMMS_ENV, "0")
    caplog.clear()
    del tried[:]
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        table = gemms.startup_table(model, None, tune_shape=lambda *shape: pytest.fail("tuned with the configs off"),
                                    tile_split=lambda *args: tried.append(args[3:]) or ({}, []))
    assert table.splits == {split: 8} and table.configs == {} and tried == [(8, {})]
    assert table.split_tiles == {split: {}}
    assert f"the other batch-invariant GEMMs keep stock's one config ({GEMMS_ENV}=0)" in caplog.text
    assert "(float16 512x4096 +bias: none;" in caplog.text


def test_a_split_shape_whose_tiles_cannot_be_checked_keeps_the_default_launch_and_says_why(monkeypatch, caplog):
    import torch

    from sglang.srt.layers.linear import ReplicatedLinear

    monkeypatch.setenv(FAST_GEMMS_ENV, "1")
    monkeypatch.setenv(GEMMS_ENV, "0")

    def failing(*args):
        raise RuntimeError("out of shared memory")

    model = torch.nn.Sequential(ReplicatedLinear(4096, 512, bias=True, params_dtype=torch.float16))
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        table = gemms.startup_table(model, None, tile_split=failing)
    assert table.splits == {gemms.Shape("float16", 512, 4096, True): 8} and table.split_tiles == {}
    assert ("GEMM float16 512x4096 +bias keeps fast mode's default launch: checking its tiles failed "
            "(RuntimeError: out of shared memory)" in caplog.text)


def test_a_scheduler_reports_split_sums_only_where_fast_mode_splits_a_gemm():
    """gemms.report_sums on Scheduler.get_init_info, whose dict SGLang serves in /server_info: stock's dict
    without a table or splits, the sums added with them (verify refuses a reference that sums otherwise)."""
    def stock_info():
        return {"status": "ready"}

    try:
        for table, expected in ((None, {"status": "ready"}), (gemms.Table({}), {"status": "ready"}),
                                (gemms.Table({}, {gemms.Shape("bfloat16", 4608, 3584, True): 4}),
                                 {"status": "ready", gemms.SUMS_KEY: gemms.SPLIT_SUMS})):
            gemms.activate(table)
            assert gemms.report_sums(stock_info, None, (), {}) == expected
    finally:
        gemms.activate(None)
