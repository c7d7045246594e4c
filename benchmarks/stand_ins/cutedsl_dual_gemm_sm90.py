"""Stands in for SGLang 0.5.23's sglang/kernels/ops/gemm/cutedsl_dual_gemm.py on the H200 (sm90),
where the CuTe DSL (nvidia-cutlass-dsl) that the real module imports at its top is not installed.
The real kernel is SM100-only: its can_use_dual_gemm returns False unless is_sm100_supported(), so
on sm90 the DualGemm of Qwen2, Qwen3 and Llama never runs, and this module gives the same answers.
Copy it over the installed module, on a machine without the CuTe DSL:

    cp benchmarks/stand_ins/cutedsl_dual_gemm_sm90.py "$(python3 -c "import sglang, os; print(os.path.dirname(sglang.__file__))")/kernels/ops/gemm/cutedsl_dual_gemm.py"

(benchmarks/logs/serving_h200_qwen2.5-7b/run.sh copies it so before its first server.)

Ran that way on 2026-12-02: a Qwen2.5-7B-shaped server and sglang.Engine started and served.
A record made with it says so. Never part of the product."""
from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self):
        return self is not self.UNQUANT

    @property
    def is_dynamic(self):
        return self in (self.DYNAMIC_PER_TENSOR, self.DYNAMIC_PER_TOKEN)

    @property
    def is_per_token(self):
        return self in (self.STATIC_PER_TOKEN, self.DYNAMIC_PER_TOKEN)


def can_use_dual_gemm(num_tokens, hidden_size, intermediate_size, quant_mode, *args, **kwargs):
    return False  # SM100 only, as the real predicate answers on sm90


def dual_gemm_swiglu(*args, **kwargs):
    raise RuntimeError("dual GEMM is SM100-only")


dual_gemm_swiglu_fp8 = dual_gemm_swiglu
