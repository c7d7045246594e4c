"""Fast GEMMs (issue 47's fast mode): a split-K whose split is fixed per GEMM shape, never by M.

At decode sizes a GEMM streams its weight, and with few output tiles few SMs stream it: Qwen2.5-7B's
down projection has 56 tiles of 64 columns for an H100's 132 SMs. Splitting K into SPLITS fixed
ranges gives each tile SPLITS programs. Each range is summed from zero in stock's BLOCK_K steps into
an fp32 partial, and the partials are added from zero in a fixed order (range 0, then 1, ...), then
the bias. The split depends on the shape alone (splits_for), so every output is the same sum in the
same order at every M: batch-invariant by construction. Its bits are not stock's (stock sums K as one
range), so a server in fast mode must be checked against a reference that runs it too.

Where M gives enough tiles on its own (prefill), one program adds its tile's ranges itself in the
same order, with no partials in memory: the same arithmetic, so the same bits, as the tests check.
Up to 256 rows a bucket may run so with the shape's per-M tile (gemms.split_tiles), where that gave
the same bits on this GPU at startup and was faster: at a prefill chunk's M the partials cost more
than the extra programs give.
On call1's H100 (benchmarks/logs/gemms_h200/call1/probe_split_k.json) 4 or 8 splits brought
Qwen2.5-7B's qkv, o and down to 1.03-1.35x cuBLAS at M 1-64, and wide GEMMs (gate_up, lm_head)
gained nothing: splits_for gives them 1, so they keep the per-M configs and stock's bits.

Imported only where fast mode is on (gemms.startup_table), and by its tests and probe: it compiles
Triton kernels, which a process that loads plugins should not pay for.
"""

import triton
import triton.language as tl

SPLITS = (1, 2, 4, 8)
TILE_COLUMNS = 64  # the columns of a decode-size tile, which splits_for counts
TILES_WANTED = 256  # about two programs per SM of an H100 or H200 (132 SMs)
MIN_K_PER_SPLIT = 512  # shorter ranges add more partial traffic than they save
SUM_BLOCK = 1024


def splits_for(n, k):
    """K's ranges for a GEMM of N columns over K: the fewest of SPLITS that give TILES_WANTED
    programs at decode sizes, keeping each range at least MIN_K_PER_SPLIT long. A function of
    the shape alone, never of M or of this GPU: the bits must not depend on either."""
    tiles = triton.cdiv(n, TILE_COLUMNS)
    wanted = next((s for s in SPLITS if tiles * s >= TILES_WANTED), SPLITS[-1])
    return max([s for s in SPLITS if s <= wanted and k // s >= MIN_K_PER_SPLIT] or [1])


def tile_for(m):
    """(BLOCK_M, BLOCK_N, warps) for M rows: tiles of about the batch's rows, 64 columns up to 256
    rows. The tile picks which outputs a program computes, never an output's sum."""
    if m > 256:
        return 128, 128, 8
    return next(rows for rows in (16, 32, 64) if m <= rows or rows == 64), TILE_COLUMNS, 4


@triton.jit
def split_k_kernel(a_ptr, b_ptr, out_ptr, bias_ptr, M, N, K, K_PER_SPLIT, stride_am, stride_ak, stride_bk,
                   stride_bn, SPLITS_PER_PROGRAM: tl.constexpr, FINAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (tile, group): K ranges group * SPLITS_PER_PROGRAM onward, each summed from zero in
    BLOCK_K steps, added in order to a total from zero. FINAL (every range in this program): the
    total plus the bias, in the output's dtype; else the group's fp32 partial, for ordered_sum."""
    tile, group = tl.program_id(0), tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = tl.where(offs_m < M, offs_m, 0), tl.where(offs_n < N, offs_n, 0)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(SPLITS_PER_PROGRAM):
        start = (group * SPLITS_PER_PROGRAM + j) * K_PER_SPLIT
        partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, K_PER_SPLIT, BLOCK_K):
            offs_k = start + step + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=offs_k[None, :] < K, other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=offs_k[:, None] < K, other=0.0)
            partial = tl.dot(a, b, partial)
        total += partial
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if FINAL:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + group * M * N + offs_m[:, None] * N + offs_n[None, :], total, mask=mask)


@triton.jit
def ordered_sum(p_ptr, bias_ptr, c_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Each output: from zero, partial 0, then 1, ... in that order, then the bias, in its dtype: the
    arithmetic of a FINAL program of split_k_kernel."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(p_ptr + split * M * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, total.to(c_ptr.dtype.element_ty), mask=mask)


def launch(a, b, out_dtype, bias, splits, block_k, in_program=None, config=None):
    """a @ b (+ bias) as `splits` fixed K ranges of `block_k` steps, in `out_dtype`. `in_program`:
    whether each program adds its tile's ranges itself (None: where M alone gives TILES_WANTED
    tiles); the bits are the same either way. `config` (a gemms.Config): its tile, warps and stages,
    each program adding its tile's ranges itself (gemms.split_tiles checks the bits on this GPU)."""
    import torch

    (m, k), n = a.shape, b.shape[1]
    if config is None:
        (block_m, block_n, warps), stages = tile_for(m), 3
    else:
        block_m, block_n, warps, stages, in_program = config.block_m, config.block_n, config.warps, config.stages, True
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if in_program is None:
        in_program = splits == 1 or tiles >= TILES_WANTED
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    c = torch.empty((m, n), device=a.device, dtype=out_dtype)
    groups = 1 if in_program else splits
    target = c if in_program else torch.empty((splits, m, n), device=a.device, dtype=torch.float32)
    split_k_kernel[(tiles, groups)](a, b, target, bias, m, n, k, k_per_split, a.stride(0), a.stride(1), b.stride(0),
                                    b.stride(1), SPLITS_PER_PROGRAM=splits // groups, FINAL=in_program,
                                    HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                    num_warps=warps, num_stages=stages)
    if not in_program:
        ordered_sum[(triton.cdiv(m * n, SUM_BLOCK),)](target, bias, c, m, n, SPLITS=splits,
                                                      HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return c
