"""On this GPU, SGLang's batch-invariant GEMM kernel with every config the plugin may tune gives stock's
bits (gemms.py), at every M, for two of Qwen2.5-7B's GEMMs (qkv with its bias, and down) in bf16 and
fp16. Two controls must differ. On every shape, stock's kernel and config summing K in reverse order
(the same products, another order of each sum, through the comparison the configs pass). And cuBLAS,
on some shape: its bits differ from stock's, or its rows from its own at the largest M. It need not
on every shape: on an H100 (gemms_h200/call1) it gave stock's bits at every M on qkv with its bias.
Half of stock's BLOCK_K is no control on Hopper: on call2's H100 it gave stock's bits on all four
shapes (the MMA adds each 16-wide slice of K in order, whatever BLOCK_K is). The tuner itself, run on
the GPU, must admit a config of stock's bits for every bucket it reports. Fast mode (split_k.py) must be
batch-invariant, its control a split chosen by M, and give the same rows in every tile it may use.

Needs a CUDA GPU and SGLang 0.5.20 or newer; without them the module is skipped with the reason.
The full sweep over the supported model families, with timings, is benchmarks/gemm_configs.py.
"""

import pytest

from sglang_chunk_align import gemms, releases
from sglang_chunk_align.compat import installed_version, sglang_at_least


def _why_not():
    if not sglang_at_least(releases.GEMM_CONFIGS):
        return f"the GEMM configs need SGLang {releases.GEMM_CONFIGS} or newer, not {installed_version()}"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: SGLang's batch-invariant GEMM kernel is compiled for it"
    return None


REASON = _why_not()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

ROWS = (1, 3, 16, 33, 64, 200, 256, 1000, 4096)
SHAPES = [gemms.Shape(dtype, n, k, bias) for dtype in ("bfloat16", "float16")
          for n, k, bias in ((4608, 3584, True), (3584, 18944, False))]


def _operands(shape):
    """A's rows, the weight and bias (normal(0, 0.02), as a checkpoint's), and stock's output at each M."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    weight = (torch.randn(shape.n, shape.k, generator=generator, device="cuda") * 0.02).to(dtype)
    bias = (torch.randn(shape.n, generator=generator, device="cuda") * 0.02).to(dtype) if shape.bias else None
    a = torch.randn(ROWS[-1], shape.k, generator=generator, device="cuda").to(dtype)
    stock = {m: gemms.stock(a[:m], weight.t(), a.dtype, bias) for m in ROWS}
    return shape, a, weight, bias, stock


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: shape.key)
def gemm(request):
    return _operands(request.param)


def test_every_tunable_config_gives_stock_bits_at_every_m(gemm):
    shape, a, weight, bias, stock = gemm
    configs = sorted({c for top in gemms.BUCKETS for c in gemms.candidates(shape.dtype, top)})
    differing = [(config, m) for config in configs for m in ROWS
                 if not gemms.same_bits(gemms.launch(a[:m], weight.t(), a.dtype, bias, config), stock[m])]
    assert not differing


def test_stock_is_batch_invariant_and_k_summed_in_reverse_is_not(gemm):
    shape, a, weight, bias, stock = gemm
    largest = ROWS[-1]
    assert all(gemms.same_bits(stock[m], stock[largest][:m]) for m in ROWS)
    reversed_a, reversed_weight = a.flip(1).contiguous(), weight.flip(1)
    config = gemms.STOCK[shape.dtype]
    control_differs = [m for m in ROWS if not gemms.same_bits(
        gemms.launch(reversed_a[:m], reversed_weight.t(), a.dtype, bias, config), stock[m])]
    assert control_differs, "K summed in reverse gave stock's bits at every M: this check could not see a difference"


def test_cublas_the_control_differs_from_stock_on_some_shape():
    import torch

    largest = ROWS[-1]
    seen = {}
    for shape in SHAPES:
        _, a, weight, bias, stock = _operands(shape)
        cublas = {m: torch.nn.functional.linear(a[:m], weight, bias) for m in ROWS}
        seen[shape.key] = [m for m in ROWS if not gemms.same_bits(cublas[m], stock[m])
                           or not gemms.same_bits(cublas[m], cublas[largest][:m])]
    print("cuBLAS differs from stock at M:", seen)
    assert any(seen.values()), f"cuBLAS gave stock's bits on every shape at every M: {seen}"


def test_fast_mode_is_batch_invariant_and_a_split_chosen_by_m_is_not(gemm):
    """Fast mode (split_k.py), its split fixed by the shape (qkv 4, down 8): each M's rows equal the
    largest M's and each row alone, whichever program adds the ranges. The control, a split chosen by
    M (1 up to 16 rows), must differ from the largest M's rows somewhere."""
    from sglang_chunk_align import split_k

    shape, a, weight, bias, stock = gemm
    splits, block_k, largest = split_k.splits_for(shape.n, shape.k), gemms.STOCK[shape.dtype].block_k, ROWS[-1]
    assert splits > 1

    def run(rows, count, **how):
        return split_k.launch(rows, weight.t(), a.dtype, bias, count, block_k, **how)

    full = run(a, splits)
    assert [m for m in ROWS if not gemms.same_bits(run(a[:m], splits), full[:m])] == []
    assert [i for i in range(4) if not gemms.same_bits(run(a[i:i + 1], splits), full[i:i + 1])] == []
    assert [m for m in ROWS if not gemms.same_bits(run(a[:m], splits, in_program=True),
                                                    run(a[:m], splits, in_program=False))] == []
    assert not gemms.same_bits(full, stock[largest]), "fast mode gave stock's bits: not a split"
    by_m = [m for m in ROWS if not gemms.same_bits(run(a[:m], 1 if m <= 16 else splits), full[:m])]
    assert by_m, "a split chosen by M gave the fixed split's rows at every M: this check could not see a difference"


def test_fast_mode_in_every_tile_it_may_use_gives_the_split_bits(gemm):
    """At M up to 256, fast mode may run a split shape as one program per tile, the tile one of the
    tuner's candidates or stock's config (gemms.split_tiles, which checks it at its probe rows at
    startup): each, at every such M of ROWS, must give the default launch's rows."""
    from sglang_chunk_align import split_k

    shape, a, weight, bias, stock = gemm
    splits, block_k = split_k.splits_for(shape.n, shape.k), gemms.STOCK[shape.dtype].block_k
    full = split_k.launch(a, weight.t(), a.dtype, bias, splits, block_k)
    tiles = sorted({c for top in gemms.BUCKETS for c in gemms.candidates(shape.dtype, top)} | {gemms.STOCK[shape.dtype]})
    differing = [(tile, m) for tile in tiles for m in ROWS if m <= gemms.BUCKETS[-1] and not gemms.same_bits(
        split_k.launch(a[:m], weight.t(), a.dtype, bias, splits, block_k, config=tile), full[:m])]
    assert not differing


def test_the_tuner_admits_only_stock_bits_on_this_gpu(gemm):
    shape, a, weight, bias, stock = gemm
    tuned, differing = gemms.tune(shape, weight, bias, gemms.gpu_clock)
    assert not differing
    for m in ROWS:
        config = tuned.get(gemms.bucket(m))
        if config is not None:
            assert gemms.same_bits(gemms.launch(a[:m], weight.t(), a.dtype, bias, config), stock[m])


def test_sglang_linear_layers_run_the_tuned_configs_with_stock_bits(monkeypatch):
    """The plugin's path end to end on this GPU: its startup hook tunes a real SGLang linear layer
    under SGLang's batch-invariant mode, and F.linear (aten::addmm, SGLang's registered kernel)
    then runs the bucket's config (stock's where none was faster), with stock's bits, at decode sizes."""
    import torch

    from sglang.srt.batch_invariant_ops import set_batch_invariant_mode
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang_chunk_align import patch_table, patches
    from sglang_chunk_align.compat import GEMMS_ENV

    monkeypatch.setenv(GEMMS_ENV, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/sglang-chunk-align-gpu-test-cache")
    layer = ReplicatedLinear(3584, 4608, bias=True, params_dtype=torch.bfloat16).cuda()
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias, std=0.02)
    runner = type("Runner", (), {"model": torch.nn.Sequential(layer)})()
    patches.apply(patch_table)
    try:
        with set_batch_invariant_mode(True):
            gemms.tune_at_startup(lambda: None, runner, (), {})
            shape = gemms.Shape("bfloat16", 4608, 3584, True)
            assert shape in gemms._table.configs
            for m in (1, 16, 64):
                a = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
                served = torch.nn.functional.linear(a, layer.weight, layer.bias)
                assert gemms.same_bits(served, gemms.stock(a, layer.weight.t(), a.dtype, layer.bias))
    finally:
        patches.remove()
