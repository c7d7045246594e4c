"""RMSNorm with a residual as three kernels, stock's arithmetic in stock's order: stock's bits (issue 47).

Under --enable-deterministic-inference, SGLang's RMSNorm.forward_cuda sends every norm that adds a
residual (two per decoder layer) to forward_native, which runs it as eleven PyTorch kernels: fp32
copies of x and the residual, their sum, the new residual's cast, the square, SGLang's batch-invariant
mean (its Triton mean_kernel, one program per row), the epsilon, rsqrt, two products and the output's
cast. On call2's H100 they took about 1.3 ms of an 11.8 ms decode step at batch 64 on Qwen2.5-7B's
shape (benchmarks/logs/gemms_h200/call2/profile.json): each is a launch and a pass over fp32 rows.

Here the elementwise steps before the mean are one kernel, the mean is the same torch call (so the
same SGLang kernel on the same squares), and the steps after it one more. Every value is the one
stock computes, each an IEEE fp32 add or product with no fused multiply-add between them, rsqrt
the same approximate instruction (CUDA's rsqrtf and Triton's both), casts rounded to nearest even:
so the bits should be stock's. The compiler does not promise it, so tests/gpu/test_norm_bits.py
checks it on the GPU, and verify against a stock reference checks it end to end.

Used only under SGLang's batch-invariant mode (there torch's mean is SGLang's kernel), on CUDA, for
norms whose options forward_native would honour otherwise (fp32 residual, a variance size, a cast
before the weight): those keep stock's path. SGLANG_CHUNK_ALIGN_NORMS=0 keeps it everywhere.
"""

import logging
import os
from contextlib import contextmanager

logger = logging.getLogger("sglang_chunk_align")

# Where the kernels run: CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1, read by Triton
# when it defines them), where tests/test_norms.py runs them on CPU tensors, stock's mean being torch's there.
KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
_state = {}  # "on": the switch as read at the first norm since the plugin was armed (reset() forgets it)
_fused_shapes = None  # counting_fused's list, inside its block


def fuse_residual_norm(wrapped, instance, args, kwargs):
    """Wraps RMSNorm.forward_native: a norm that adds a residual, under batch-invariant mode, runs
    as add_rms_norm; any other call runs stock's."""
    x, residual, post_residual_addition = _bind(*args, **kwargs)
    if not (_fusable(instance, x, residual, post_residual_addition) and _switched_on()):
        return wrapped(*args, **kwargs)
    from .norm_kernels import add_rms_norm  # Triton, which a process that loads plugins should not pay for

    if _fused_shapes is not None:
        _fused_shapes.append(tuple(x.shape))
    return add_rms_norm(x, residual, instance.weight, instance.variance_epsilon)


@contextmanager
def counting_fused(shapes):
    """Within this block, append to `shapes` the shape of each norm run as add_rms_norm: which norms
    fused, for the tests. Outside one, a fused norm costs one comparison more."""
    global _fused_shapes
    outer, _fused_shapes = _fused_shapes, shapes
    try:
        yield
    finally:
        _fused_shapes = outer


def _bind(x, residual=None, post_residual_addition=None, *more, **named):
    return x, residual, post_residual_addition


def _fusable(norm, x, residual, post_residual_addition):
    """Whether stock's forward_native would compute exactly what add_rms_norm does for this call."""
    import torch

    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    return (
        residual is not None and post_residual_addition is None
        and not (norm.cast_x_before_out_mul or norm.fp32_residual)
        and norm.override_orig_dtype is None and norm.variance_size_override is None
        and x.device.type == KERNEL_DEVICE and x.dtype in (torch.bfloat16, torch.float16) and x.numel() > 0
        and residual.dtype == x.dtype and residual.shape == x.shape and x.shape[-1] == norm.hidden_size
        and is_batch_invariant_mode_enabled() and not torch.compiler.is_compiling()
    )


def _switched_on():
    """The switch, read once (its startup line then says what runs)."""
    if "on" not in _state:
        from .compat import NORMS_ENV, switch

        _state["on"] = switch(NORMS_ENV)
        logger.info(
            "sglang-chunk-align: RMSNorms that add a residual run as three kernels in stock's arithmetic, "
            "for stock's bits (%s=0 keeps stock's eleven)" if _state["on"] else
            "sglang-chunk-align: RMSNorms that add a residual keep stock's eleven kernels (%s=0)", NORMS_ENV)
    return _state["on"]


def reset():
    """Forget the switch (patches.remove()): the next armed process reads it again."""
    _state.clear()
