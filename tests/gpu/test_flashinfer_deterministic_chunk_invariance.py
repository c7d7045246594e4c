"""Pin the kernel fact the plugin rests on: flashinfer fa2 paged prefill is
chunk-invariant bit for bit when chunk boundaries sit on the q-tile grid.

flashinfer's ``BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
backend="fa2")`` is called the way SGLang's deterministic
``FlashInferAttnBackend`` calls it: bf16, paged KV with page size 1 held as
separate K and V buffers, ``plan(..., fixed_split_size=S)`` with S =
``SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE`` (SGLang's default 4096, and
1024), then ``forward(q, (k, v), causal=True, sm_scale=head_dim**-0.5)``.
A chunk covers query rows [s, e) and attends over KV [0, e).

Both directions are pinned:
- on the grid (every boundary a multiple of PREFILL_Q_TILE_TOKENS), the
  chunked output equals the unchunked output bit for bit (torch.equal);
- off the grid (boundaries every 100, 129 or 1000 tokens), it does not, which
  shows the comparison is sensitive and cannot pass vacuously; the one shape
  where 1000 lies on fa2's own, finer tile grid (group 8 at head_dim 256: an
  8-token grid) is exact instead, and is pinned as such;
- the unchunked reference itself is reproducible.

Needs a CUDA GPU (sm80+) and ``pip install flashinfer-python``; without them
the whole module is skipped with the reason. See tests/gpu/README.md.
"""

import pytest

from sglang_chunk_align.alignment import PREFILL_Q_TILE_TOKENS

torch = pytest.importorskip(
    "torch", reason="torch is not installed: this kernel test needs torch with CUDA and flashinfer"
)
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA device: this test runs flashinfer's fa2 prefill kernel on a GPU",
        allow_module_level=True,
    )
if torch.cuda.get_device_capability() < (8, 0):
    pytest.skip(
        "flashinfer's fa2 prefill needs an sm80+ GPU, found sm%d%d" % torch.cuda.get_device_capability(),
        allow_module_level=True,
    )
flashinfer = pytest.importorskip(
    "flashinfer",
    reason="flashinfer is not installed (pip install flashinfer-python): this test pins its fa2 prefill kernel",
)

T = PREFILL_Q_TILE_TOKENS
# Attention shapes (q heads / kv heads): 32/32, 32/16, 32/8 and 64/8.
GQA_GROUPS = (1, 2, 4, 8)
HEAD_DIMS = (128, 256)
# SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE: SGLang's default 4096, and a smaller one.
SPLIT_SIZES = (4096, 1024)
# Both lengths span several chunks and leave every on-grid chunking a final
# chunk of at least 68 tokens (see _check_on_grid); 4600 > 4096 makes the
# default split actually split the KV (2500 splits it only at 1024).
PROMPT_LENS = (2500, 4600)
OFF_GRID_PROMPT_LEN = 4600
# One float workspace for the whole module. It must hold fa2's split-KV
# partials; the largest case here (4600 tokens, 64 q heads, head_dim 256,
# split 1024) needs at most 1.45 GiB (see _split_partials_bytes).
WORKSPACE_BYTES = 2 << 30
SEED = 20261129

# Chunkings: each a tuple of boundaries strictly inside (0, L); cut at L.
ON_GRID = {
    "uniform128": ("uniform", 1 * T),
    "uniform256": ("uniform", 2 * T),
    "uniform512": ("uniform", 4 * T),
    "irregular": ("bounds", tuple(m * T for m in (2, 3, 8, 9, 16, 17, 24, 32, 33))),
}
OFF_GRID = {
    "uniform100": ("uniform", 100),
    "uniform129": ("uniform", 129),
    "uniform1000": ("uniform", 1000),
}


def _boundaries(chunking, prompt_len):
    kind, arg = chunking
    if kind == "uniform":
        inner = range(arg, prompt_len, arg)
    else:
        inner = [b for b in arg if 0 < b < prompt_len]
    return [0, *inner, prompt_len]


def _check_on_grid(bounds, group):
    """Preconditions: every chunk starts on the grid, and no chunk is so short
    that fa2 picks a smaller CTA q-tile (packed length tokens*group <= 64),
    a different effect that this test does not pin."""
    assert all(b % T == 0 for b in bounds[:-1]), bounds
    for s, e in zip(bounds, bounds[1:]):
        assert (e - s) * group > 64, f"chunk [{s}, {e}) too short at group {group}"


def _fa2_q_tile_tokens(group, head_dim):
    """Tokens per fa2 CTA q-tile for a chunk longer than 64 packed rows.

    flashinfer's FA2DetermineCtaTileQ (include/flashinfer/utils.cuh) picks 128
    packed rows below head_dim 256 and 64 at head_dim 256; a packed row is one
    (token, q head of the group) pair, so a tile spans cta_tile_q // group tokens.
    """
    cta_tile_q = 128 if head_dim < 256 else 64
    return max(1, cta_tile_q // group)


def _on_fa2_grid(bounds, group, head_dim):
    tile = _fa2_q_tile_tokens(group, head_dim)
    return all(b % tile == 0 for b in bounds[:-1])


def _split_partials_bytes(prompt_len, num_qo_heads, head_dim, split):
    """Upper bound on the float workspace fa2 reserves for split-KV partials
    (tmp_v, tmp_s): num_qo_heads * rows * (head_dim + 1) fp32, with
    rows <= (qo_len + 128) * ceil(kv_len / split)."""
    n_kv_chunks = -(-prompt_len // split)
    if n_kv_chunks <= 1:
        return 0
    return num_qo_heads * (prompt_len + 128) * n_kv_chunks * (head_dim + 1) * 4


class _Case:
    """Seeded random q and a paged KV pool (page size 1, separate K and V
    buffers, slots permuted as a KV pool hands them out; slot 0 is padding)."""

    def __init__(self, group, head_dim, split, prompt_len):
        self.group, self.head_dim, self.split, self.prompt_len = group, head_dim, split, prompt_len
        self.num_kv_heads = max(8, 32 // group)
        self.num_qo_heads = self.num_kv_heads * group
        need = _split_partials_bytes(prompt_len, self.num_qo_heads, head_dim, split)
        assert need + (64 << 20) <= WORKSPACE_BYTES, f"workspace too small: {need} B of split partials"
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev)
        gen.manual_seed(SEED + 1000 * group + head_dim + split + prompt_len)
        pool = prompt_len + 64

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)

        self.q = randn(prompt_len, self.num_qo_heads, head_dim)
        self.k_buf = randn(pool, self.num_kv_heads, head_dim)
        self.v_buf = randn(pool, self.num_kv_heads, head_dim)
        for t in (self.q, self.k_buf, self.v_buf):
            assert t.float().std().item() > 0.5, "inputs must be random, not constant"
        perm = torch.randperm(pool - 1, generator=gen, device=dev) + 1
        self.kv_indices = perm[:prompt_len].to(torch.int32).contiguous()

    def prefill(self, wrapper, start, end):
        """Query rows [start, end) over KV [0, end), as one extend request."""
        dev = self.q.device
        wrapper.plan(
            torch.tensor([0, end - start], dtype=torch.int32, device=dev),
            torch.tensor([0, end], dtype=torch.int32, device=dev),
            self.kv_indices[:end],
            torch.ones(1, dtype=torch.int32, device=dev),
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            fixed_split_size=self.split,
        )
        return wrapper.forward(
            self.q[start:end],
            (self.k_buf, self.v_buf),
            causal=True,
            sm_scale=self.head_dim**-0.5,
        )

    def chunked(self, wrapper, bounds):
        out = torch.cat([self.prefill(wrapper, s, e) for s, e in zip(bounds, bounds[1:])])
        torch.cuda.synchronize()
        return out

    def unchunked(self, wrapper):
        return self.chunked(wrapper, [0, self.prompt_len])


def _diff(a, b):
    bad = (a != b).flatten(1).any(dim=1)
    rows = bad.nonzero().flatten()
    first = rows[0].item() if rows.numel() else None
    return int(bad.sum().item()), first, (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def workspace():
    buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    yield buf
    del buf
    torch.cuda.empty_cache()


@pytest.fixture
def wrapper(workspace):
    """One wrapper per test, reused for every plan/forward in it (as SGLang does)."""
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")


_config_ids = [f"g{g}-d{d}-split{s}" for d in HEAD_DIMS for s in SPLIT_SIZES for g in GQA_GROUPS]
_config = pytest.mark.parametrize(
    "group,head_dim,split",
    [(g, d, s) for d in HEAD_DIMS for s in SPLIT_SIZES for g in GQA_GROUPS],
    ids=_config_ids,
)


def test_grid_constant_is_on_every_fa2_q_tile_grid():
    # PREFILL_Q_TILE_TOKENS must be a multiple of fa2's q-tile (in tokens) for
    # every shape, and is the tightest such grid: 128 tokens, the tile of
    # group 1 below head_dim 256.
    tiles = [_fa2_q_tile_tokens(g, d) for g in GQA_GROUPS for d in HEAD_DIMS]
    assert all(T % tile == 0 for tile in tiles), tiles
    assert T == max(tiles)


@_config
@pytest.mark.parametrize("prompt_len", PROMPT_LENS, ids=lambda n: f"L{n}")
def test_unchunked_reference_is_reproducible(wrapper, group, head_dim, split, prompt_len):
    case = _Case(group, head_dim, split, prompt_len)
    first = case.unchunked(wrapper)
    second = case.unchunked(wrapper)
    assert torch.isfinite(first.float()).all()
    assert torch.equal(first, second), _diff(first, second)


@_config
@pytest.mark.parametrize("prompt_len", PROMPT_LENS, ids=lambda n: f"L{n}")
@pytest.mark.parametrize("chunking", list(ON_GRID), ids=str)
def test_on_grid_chunks_match_unchunked_exactly(wrapper, group, head_dim, split, prompt_len, chunking):
    case = _Case(group, head_dim, split, prompt_len)
    bounds = _boundaries(ON_GRID[chunking], prompt_len)
    _check_on_grid(bounds, group)
    assert len(bounds) >= 4, "the prompt must span several chunks"
    ref = case.unchunked(wrapper)
    out = case.chunked(wrapper, bounds)
    n_bad, first_bad, max_abs = _diff(out, ref)
    assert torch.equal(out, ref), (
        f"on-grid chunking {bounds} differs from unchunked prefill: "
        f"{n_bad} rows differ, first row {first_bad}, max abs {max_abs}"
    )


_OFF_GRID_CASES = [
    pytest.param(c, g, d, s, id=f"{c}-g{g}-d{d}-split{s}")
    for c in OFF_GRID
    for d in HEAD_DIMS
    for s in SPLIT_SIZES
    for g in GQA_GROUPS
]


def _off_fa2_grid(param):
    chunking, group, head_dim, _ = param.values
    return not _on_fa2_grid(_boundaries(OFF_GRID[chunking], OFF_GRID_PROMPT_LEN), group, head_dim)


# Off PREFILL_Q_TILE_TOKENS's grid and off fa2's own tile grid: must differ.
OFF_FA2_GRID = [p for p in _OFF_GRID_CASES if _off_fa2_grid(p)]
# Off PREFILL_Q_TILE_TOKENS's grid but on fa2's finer grid for that shape
# (only uniform1000 at group 8, head_dim 256: 1000 = 125 * 8): exact.
ON_FA2_FINER_GRID = [p for p in _OFF_GRID_CASES if not _off_fa2_grid(p)]
assert {p.values[0] for p in OFF_FA2_GRID} == set(OFF_GRID), "every off-grid chunking is tested"


@pytest.mark.parametrize("chunking,group,head_dim,split", OFF_FA2_GRID)
def test_off_grid_chunks_do_not_match(wrapper, group, head_dim, split, chunking):
    case = _Case(group, head_dim, split, OFF_GRID_PROMPT_LEN)
    bounds = _boundaries(OFF_GRID[chunking], OFF_GRID_PROMPT_LEN)
    assert any(b % T for b in bounds[:-1]), "an off-grid case needs a boundary off the grid"
    assert not _on_fa2_grid(bounds, group, head_dim)
    ref = case.unchunked(wrapper)
    out = case.chunked(wrapper, bounds)
    n_bad, first_bad, max_abs = _diff(out, ref)
    print(f"\n[off-grid] g{group} d{head_dim} split{split} {chunking}: "
          f"{n_bad} rows differ, first row {first_bad}, max abs {max_abs:.3g}")
    assert not torch.equal(out, ref), (
        f"off-grid chunking {chunking} matched bit for bit: the comparison is not sensitive"
    )


@pytest.mark.parametrize("chunking,group,head_dim,split", ON_FA2_FINER_GRID)
def test_fa2_finer_grid_is_exact_too(wrapper, group, head_dim, split, chunking):
    """Why uniform1000 is not an off-grid case at group 8, head_dim 256: fa2's
    tile there spans 64 packed rows = 8 tokens, and 1000 is a multiple of 8.
    PREFILL_Q_TILE_TOKENS is the one grid that serves every shape; this pins
    that the kernel's exactness follows its own tile, as the plugin assumes."""
    case = _Case(group, head_dim, split, OFF_GRID_PROMPT_LEN)
    bounds = _boundaries(OFF_GRID[chunking], OFF_GRID_PROMPT_LEN)
    assert any(b % T for b in bounds[:-1]) and _on_fa2_grid(bounds, group, head_dim)
    ref = case.unchunked(wrapper)
    out = case.chunked(wrapper, bounds)
    n_bad, first_bad, max_abs = _diff(out, ref)
    assert torch.equal(out, ref), (
        f"{chunking} is on fa2's {_fa2_q_tile_tokens(group, head_dim)}-token tile grid here "
        f"but differs: {n_bad} rows, first row {first_bad}, max abs {max_abs}"
    )
