"""On this GPU, an RMSNorm that adds a residual gives stock's bits through the plugin's three kernels
(norms.py), under SGLang's batch-invariant mode, at every M, for the hidden sizes of the model families
we support, bf16 and fp16: the norm's output and the new residual, through the patched SGLang layer.
The control must differ: stock's arithmetic with each row's sum of squares in reverse order, through the
same comparison. Stock's rows at each M are its rows at the largest M (batch invariance), so the
plugin's are too.

Needs a CUDA GPU; without one the module is skipped with the reason.
"""

import copy

import pytest

from sglang_chunk_align import norms, patch_table, patches
from sglang_chunk_align.compat import installed_version
from sglang_chunk_align.gemms import same_bits


def _why_not():
    if installed_version() is None:
        return "needs SGLang: its RMSNorm and batch-invariant mean are what the kernels restate"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: the kernels and SGLang's batch-invariant mean run there"
    return None


REASON = _why_not()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

ROWS = (1, 3, 16, 33, 64, 200, 256, 1000, 4096)
# Qwen2.5-7B, Llama-3.1-8B, Qwen3-1.7B and Llama-3.2-1B (2,048), Qwen3-14B (5,120), Qwen2.5-1.5B (1,536).
COLUMNS = (3584, 4096, 2048, 5120, 1536)


@pytest.fixture(scope="module", params=[(dtype, columns) for dtype in ("bfloat16", "float16") for columns in COLUMNS],
                ids=lambda case: f"{case[0]}-{case[1]}")
def case(request):
    """The layer, its inputs (a residual stream's scale), and stock's answers at each M."""
    import torch

    from sglang.srt.batch_invariant_ops import set_batch_invariant_mode
    from sglang.srt.layers.layernorm import RMSNorm

    dtype, columns = getattr(torch, request.param[0]), request.param[1]
    generator = torch.Generator(device="cuda").manual_seed(columns)
    norm = RMSNorm(columns, eps=1e-6).to(device="cuda", dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(columns, generator=generator, device="cuda")).to(dtype)
    x = torch.randn(ROWS[-1], columns, generator=generator, device="cuda").to(dtype)
    residual = (4 * torch.randn(ROWS[-1], columns, generator=generator, device="cuda")).to(dtype)
    with set_batch_invariant_mode(True):
        stock = {m: norm.forward_native(x[:m], residual[:m]) for m in ROWS}
    return norm, x, residual, stock


def test_the_fused_norm_gives_stock_bits_at_every_m(case):
    from sglang.srt.batch_invariant_ops import set_batch_invariant_mode

    norm, x, residual, stock = case
    fused = []
    patches.apply(patch_table)
    try:
        with set_batch_invariant_mode(True), norms.counting_fused(fused):
            plugin = {m: norm.forward_native(x[:m], residual[:m]) for m in ROWS}
    finally:
        patches.remove()
    assert [shape[0] for shape in fused] == list(ROWS), "the patched layer did not run the fused kernels"
    assert [m for m in ROWS if not same_bits(plugin[m][1], stock[m][1])] == [], "new residual"
    assert [m for m in ROWS if not same_bits(plugin[m][0], stock[m][0])] == [], "output"


def test_stock_is_batch_invariant_and_a_reversed_sum_is_not_stock(case):
    from sglang.srt.batch_invariant_ops import set_batch_invariant_mode

    norm, x, residual, stock = case
    largest = ROWS[-1]
    assert all(same_bits(stock[m][0], stock[largest][0][:m]) for m in ROWS)
    reversed_norm = copy.deepcopy(norm)
    reversed_norm.weight.data = norm.weight.data.flip(0)
    with set_batch_invariant_mode(True):
        reversed_sum = reversed_norm.forward_native(x.flip(-1), residual.flip(-1))[0].flip(-1)
    assert [m for m in ROWS if not same_bits(reversed_sum[:m], stock[m][0])], "a reversed sum gave stock's bits at every M: this check could not see a difference"
