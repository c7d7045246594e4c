"""On this GPU, SGLang's batch-invariant GEMM kernel with every config the plugin may tune gives stock's
bits (gemms.py), at every M, for two of Qwen2.5-7B's GEMMs (qkv with its bias, and down) in bf16 and
fp16; and cuBLAS, the control, does not: its bits differ from stock's, or its rows from its own at
the largest M, somewhere. The tuner itself, run on the GPU, must admit a config of stock's bits for
every bucket it reports.

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


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: shape.key)
def gemm(request):
    import torch

    shape = request.param
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, shape.dtype)
    weight = (torch.randn(shape.n, shape.k, generator=generator, device="cuda") * 0.02).to(dtype)
    bias = (torch.randn(shape.n, generator=generator, device="cuda") * 0.02).to(dtype) if shape.bias else None
    a = torch.randn(ROWS[-1], shape.k, generator=generator, device="cuda").to(dtype)
    stock = {m: gemms.stock(a[:m], weight.t(), a.dtype, bias) for m in ROWS}
    return shape, a, weight, bias, stock


def test_every_tunable_config_gives_stock_bits_at_every_m(gemm):
    shape, a, weight, bias, stock = gemm
    configs = sorted({c for top in gemms.BUCKETS for c in gemms.candidates(shape.dtype, top)})
    differing = [(config, m) for config in configs for m in ROWS
                 if not gemms.same_bits(gemms.launch(a[:m], weight.t(), a.dtype, bias, config), stock[m])]
    assert not differing


def test_stock_is_batch_invariant_and_the_cublas_control_is_not(gemm):
    import torch

    shape, a, weight, bias, stock = gemm
    largest = ROWS[-1]
    assert all(gemms.same_bits(stock[m], stock[largest][:m]) for m in ROWS)
    cublas = {m: torch.nn.functional.linear(a[:m], weight, bias) for m in ROWS}
    control_differs = [m for m in ROWS if not gemms.same_bits(cublas[m], stock[m])
                       or not gemms.same_bits(cublas[m], cublas[largest][:m])]
    assert control_differs, "cuBLAS gave stock's bits at every M: this check could not see a difference"


def test_the_tuner_admits_only_stock_bits_on_this_gpu(gemm):
    shape, a, weight, bias, stock = gemm
    tuned, differing = gemms.tune(shape, weight, bias, gemms._gpu_seconds)
    assert not differing
    for m in ROWS:
        config = tuned.get(gemms.bucket(m))
        if config is not None:
            assert gemms.same_bits(gemms.launch(a[:m], weight.t(), a.dtype, bias, config), stock[m])
