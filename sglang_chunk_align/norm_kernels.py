"""norms.py's kernels: RMSNorm with a residual as forward_native computes it, in three launches.

Imported on the first norm norms.py fuses, and by its tests: it compiles Triton kernels, which a
process that loads plugins should not pay for.
"""

import triton
import triton.language as tl

BLOCK = 1024  # elements a program of either kernel handles


def add_rms_norm(x, residual, weight, eps):
    """(out, new residual), as RMSNorm.forward_native computes them for x and residual of x's dtype:
    v = x + residual in fp32; the new residual v in x's dtype; v * rsqrt(mean(v * v) + eps) * weight
    in x's dtype."""
    import torch

    x, residual = x.contiguous(), residual.contiguous()
    total = x.numel()
    grid = (triton.cdiv(total, BLOCK),)
    new_residual = torch.empty_like(x)
    squares = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    add_and_square[grid](x, residual, new_residual, squares, total, BLOCK=BLOCK)
    variance = squares.mean(dim=-1, keepdim=True)  # stock's call: under batch-invariant mode, SGLang's mean
    out = torch.empty_like(x)
    scale[grid](x, residual, variance, weight.contiguous(), out, total, x.shape[-1], eps, BLOCK=BLOCK)
    return out, new_residual


@triton.jit
def add_and_square(x_ptr, r_ptr, sum_ptr, squares_ptr, total, BLOCK: tl.constexpr):
    """v = x + residual in fp32: v in the new residual's dtype, and v * v."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) + tl.load(r_ptr + offs, mask=mask).to(tl.float32)
    tl.store(sum_ptr + offs, v.to(sum_ptr.dtype.element_ty), mask=mask)
    tl.store(squares_ptr + offs, v * v, mask=mask)


@triton.jit
def scale(x_ptr, r_ptr, variance_ptr, weight_ptr, out_ptr, total, columns, eps, BLOCK: tl.constexpr):
    """(v * rsqrt(variance + eps)) * weight in fp32, v recomputed as add_and_square did, then in the
    output's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) + tl.load(r_ptr + offs, mask=mask).to(tl.float32)
    rstd = tl.math.rsqrt(tl.load(variance_ptr + offs // columns, mask=mask, other=1.0) + eps)
    weight = tl.load(weight_ptr + offs % columns, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, ((v * rstd) * weight).to(out_ptr.dtype.element_ty), mask=mask)
