"""Probe (GPU): issue 47's fast mode, measured before it is built. Does a split-K with the split fixed
for every M stay batch-invariant, and does it beat the plugin's bit-compatible configs at decode sizes?

At decode sizes a GEMM streams its weight; with few output tiles, few SMs stream it. The
bit-compatible configs (gemms.py) add tiles by narrowing them, down to 32 columns. A split-K adds
them along K instead: SPLITS programs per tile, each summing its own fixed K range in stock's
BLOCK_K loop into an fp32 partial, then one pass adding the partials in a fixed order (split 0,
then 1, ...) and the bias. The split count is fixed per GEMM shape, never by M, so each output's
sum is one order at every batch size: batch-invariant by construction, with other bits than
stock's (stock has one K range). SPLITS 1 is stock's own sum, so its bits must equal stock's.

For each GEMM of Qwen2.5-7B's shape (benchmarks/gemm_configs.model_gemms), bf16, at each split of
SPLITS with the tile config of each M's bucket (16 rows below 17, else 64; 64 columns):

- batch invariance: each M's rows against the rows of the largest M, and each row of M against
  that row alone (M = 1);
- bits against stock's kernel (expected to match at SPLITS 1 only);
- the control that must fail: the split chosen by M (1 below 17 rows, else 4), whose rows differ
  from the same rows at another M wherever the split changes the sum;
- time (triton.testing.do_bench median) at each M of TIMED_ROWS, beside stock's config, the
  plugin's tuned config (gemms.tune) and cuBLAS.

GEMM path: SGLang's Triton kernel (DeepGEMM does not load on the H200 machine's torch 2.11).
Run from the repository root on a GPU:
python3 -m benchmarks.probe_split_k --json benchmarks/logs/gemms_h200/probe_split_k.json
On a CPU: TRITON_INTERPRET=1 python3 -m benchmarks.probe_split_k --stand-in (tiny shapes, the
checks only).
"""

import json
import sys

import triton
import triton.language as tl

from benchmarks.gemm_configs import bench_for, model_gemms, probe_parser, timed_at, until_interrupted, write_json
from sglang_chunk_align import gemms

SPLITS = (1, 2, 4, 8)
ROWS = (1, 3, 16, 17, 64, 200, 256, 1000)
TIMED_ROWS = (1, 8, 16, 32, 64)
STAND_IN_ROWS = (1, 3, 16, 17, 40)
BLOCK_N = 64
SUM_BLOCK = 1024
# Under the interpreter a split sums its partial as the kernel's one K loop would, block by block, so
# only a split of several BLOCK_K blocks regroups the sum (K of 16 and 17 blocks of fp32's 32); and
# fp32 outputs keep the last bits that a 16-bit output would mostly round away in so few rows.
STAND_IN_GEMMS = (("qkv", gemms.Shape("float32", 96, 512, True)), ("down", gemms.Shape("float32", 40, 520, False)))


@triton.jit
def split_k_partials(a_ptr, b_ptr, p_ptr, M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk, stride_bn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (tile, split): the tile's sum over K in [split * K_PER_SPLIT, + K_PER_SPLIT), stock's
    BLOCK_K loop, into the split's fp32 partial."""
    tile, split = tl.program_id(0), tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = tl.where(offs_m < M, offs_m, 0), tl.where(offs_n < N, offs_n, 0)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, K_PER_SPLIT, BLOCK_K):
        offs_k = split * K_PER_SPLIT + step + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak, mask=offs_k[None, :] < K,
                    other=0.0)
        b = tl.load(b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn, mask=offs_k[:, None] < K,
                    other=0.0)
        accumulator = tl.dot(a, b, accumulator)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(p_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :], accumulator, mask=mask)


@triton.jit
def ordered_sum(p_ptr, bias_ptr, c_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Each output: partial 0, plus partial 1, ... in that order, plus the bias, then its dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLITS):
        total += tl.load(p_ptr + split * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


def split_k(a, b, bias, splits, block_m):
    """a @ b (+ bias) in `splits` fixed K ranges of stock's BLOCK_K."""
    import torch

    (m, k), n = a.shape, b.shape[1]
    block_k = gemms.STOCK[gemms.dtype_name(a.dtype)].block_k
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    partials = torch.empty((splits, m, n), device=a.device, dtype=torch.float32)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, BLOCK_N)
    split_k_partials[(tiles, splits)](a, b, partials, m, n, k, k_per_split, a.stride(0), a.stride(1), b.stride(0),
                                      b.stride(1), BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    ordered_sum[(triton.cdiv(m * n, SUM_BLOCK),)](partials, bias, c, m, n, SPLITS=splits,
                                                  HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return c


def block_m_for(m):
    return 16 if m <= 16 else 64


def split_by_m(m):
    """The control: a split that changes with the batch, as a non-invariant split-K chooses it."""
    return 1 if m <= 16 else 4


def check(tensors, rows):
    """Batch invariance and bits against stock, per split; and the control. `tensors`: bench.tensors."""
    a, weight, bias = tensors
    b, largest = weight.t(), rows[-1]
    stock = {m: gemms.stock(a[:m], b, a.dtype, bias) for m in rows}

    def run(m, splits):
        return split_k(a[:m], b, bias, splits, block_m_for(m))

    found = {}
    for splits in SPLITS:
        out = {m: run(m, splits) for m in rows}
        alone = [split_k(a[i:i + 1], b, bias, splits, block_m_for(1)) for i in range(3)]
        found[splits] = {
            "rows_differ_from_largest_m": [m for m in rows if not gemms.same_bits(out[m], out[largest][:m])],
            "rows_differ_from_alone": [m for m in rows if not all(
                gemms.same_bits(out[m][i:i + 1], alone[i]) for i in range(min(m, 3)))],
            "differs_from_stock_at": [m for m in rows if not gemms.same_bits(out[m], stock[m])],
        }
    control = {m: split_k(a[:m], b, bias, split_by_m(m), block_m_for(m)) for m in rows}
    found["control_rows_differ_from_largest_m"] = [
        m for m in rows if not gemms.same_bits(control[m], control[largest][:m])]
    return found


def timing(bench, shape, tensors, rows):
    """Per M: gemm_configs.timed_at's seconds (stock's config, the tuned one, cuBLAS), and each split's."""
    a, weight, bias = tensors
    tuned, _ = gemms.tune(shape, weight, bias, bench.clock)
    return {m: {**timed_at(bench, tensors, tuned, m),
                **{f"split_{s}_s": bench.seconds(lambda: split_k(a[:m], weight.t(), bias, s, block_m_for(m)))
                   for s in SPLITS}}
            for m in rows}


def verdict(shapes):
    invariant = all(not s["check"][splits]["rows_differ_from_largest_m"] and not s["check"][splits]["rows_differ_from_alone"]
                    for s in shapes for splits in SPLITS)
    one_split_is_stock = all(not s["check"][1]["differs_from_stock_at"] for s in shapes)
    control_seen = any(s["check"]["control_rows_differ_from_largest_m"] for s in shapes)
    return {"batch_invariant_at_every_split": invariant, "one_split_gives_stock_bits": one_split_is_stock,
            "control_seen": control_seen}


def main(argv=None):
    parser = probe_parser(__doc__)
    args = parser.parse_args(argv)
    bench = bench_for(parser, args)
    if bench is None:
        return 2
    rows, timed_rows = (STAND_IN_ROWS, STAND_IN_ROWS[:2]) if args.stand_in else (ROWS, TIMED_ROWS)
    found = STAND_IN_GEMMS if args.stand_in else [(layer, shape) for layer, shape, _ in model_gemms("qwen2.5-7b", "bfloat16")]
    shapes = []

    def measure():
        for layer, shape in found:
            print(f"{layer} {shape.key}", file=sys.stderr, flush=True)
            tensors = bench.tensors(shape)
            shapes.append({"layer": layer, "shape": shape._asdict(), "check": check(tensors, rows),
                           "timed": timing(bench, shape, tensors, timed_rows)})

    complete = until_interrupted(measure)
    doc = {"complete": complete, "environment": {"gpu": "CPU (Triton interpreter, stand-in)" if args.stand_in
                           else bench.torch.cuda.get_device_name(), "triton": triton.__version__,
                           "gemm_path": "SGLang's batch-invariant Triton kernel (DeepGEMM not loaded)"},
           "splits": SPLITS, "rows": rows, "shapes": shapes, "verdict": verdict(shapes)}
    print(json.dumps(doc["verdict"]))
    for s in shapes:
        for m, t in s["timed"].items():
            print(f"{s['layer']:>8} M={m:>3}: " + ", ".join(
                f"{key[:-2]} {t[key] / t['cublas_s']:.2f}x" for key in t if key.endswith("_s") and key != "cublas_s") + " cuBLAS")
    write_json(args.json, doc)
    v = doc["verdict"]
    return 0 if complete and v["batch_invariant_at_every_split"] and v["one_split_gives_stock_bits"] and v["control_seen"] else 1


if __name__ == "__main__":
    sys.exit(main())
