"""Split attention without a GPU: SplitPrefill against a stand-in fa2 wrapper whose rows depend on
the tile its call is planned with (as tests/kernel_oracle.py restates the kernel facts), and
plan_by_tile around SGLang's own FlashInferAttnBackend.init_forward_metadata.

The stand-in keeps what the premise probe measured on the GPU out of the test
(benchmarks/probe_split_attention.py does that, through this same class); what
is tested here is the plugin's part: which calls a batch is split into, that
each gets its group's requests, q rows and KV pages cut from the batch's own
plan, and that the rows come back in batch order.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_chunk_align import prefill_hooks, split_attention
from sglang_chunk_align.decisions import tile_groups
from sglang_chunk_align.harness import standins
from sglang_chunk_align.kernel_facts import FI072
from sglang_chunk_align.planning import Rules
from sglang_chunk_align.split_attention import SplitPrefill
from tests import kernel_oracle as oracle

GROUP, HEAD_DIM = 1, 128  # 32 q and 32 KV heads
HEADS = (32, 32, HEAD_DIM, 1)
RULES = Rules(group=GROUP, head_dim=HEAD_DIM, facts=FI072, split_attention=True)
# (extend, KV end) per request: a chunk and a 100-token prompt (the 128-row class), 40- and
# 50-token prompts (the 64-row class), and a 3-token prompt, whose KV is short enough for any tile.
BATCH = ((512, 1536), (100, 100), (40, 40), (50, 50), (3, 3))
GROUPS = ((0, 1, 4), (2, 3))
# Padded calls (issue 48): a 10-token final piece of a 1034-token prompt, alone in the 128-row class,
# beside a 40-token prompt; its call averages 10 rows unless a padding member lifts it over 64.
PAD_RULES = Rules(group=GROUP, head_dim=HEAD_DIM, facts=FI072, split_attention=True, pad_tiles=True)
PIECE = ((10, 1034), (40, 40))


def tile_term(tile, kv_len):
    """What the tile adds to a row in the stand-in: nothing where the KV is short enough for any tile."""
    return tile if kv_len > FI072.short_kv_tokens else 0


class TileWrapper:
    """A stand-in fa2 paged prefill wrapper: a row's output is its q row, plus the tile its call
    is planned with (tile_term), plus the sum of its request's KV pages. Like flashinfer's, it
    holds the index tensors it is planned with (SGLang's are views of buffers it reuses)."""

    made = 0

    def __init__(self, *args, **kwargs):
        TileWrapper.made += 1
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page,
             **kwargs):
        self.planned = (qo_indptr, kv_indptr, kv_indices, last_page_len, kwargs)
        lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        self.tile = oracle.tile(FI072, sum(lens) * (num_qo_heads // num_kv_heads) // len(lens), head_dim)
        self.head_dim = head_dim

    begin_forward = plan

    def forward(self, q, kv_cache, **kwargs):
        qo_indptr, kv_indptr, kv_indices, _, _ = self.planned
        out = q.clone()
        for i in range(len(qo_indptr) - 1):
            pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
            out[qo_indptr[i]:qo_indptr[i + 1]] += tile_term(self.tile, len(pages)) + kv_cache[pages].sum()
        return out


def csr(batch):
    """The whole batch's plan arguments as SGLang hands them to a wrapper: q rows, and the KV
    pages of request i at 1000 * i onwards."""
    qo = torch.tensor([0, *[e for e, _ in batch]]).cumsum(0).to(torch.int32)
    kv = torch.tensor([0, *[kv for _, kv in batch]]).cumsum(0).to(torch.int32)
    pages = torch.cat([torch.arange(1000 * i, 1000 * i + kv_len) for i, (_, kv_len) in enumerate(batch)])
    return qo, kv, pages.to(torch.int32), torch.ones(len(batch), dtype=torch.int32)


def solo_rows(batch, q, kv_cache):
    """Each request's rows on its solo tile (its KV end is its prompt's, or in the full-tile class)."""
    qo, kv, pages, _ = csr(batch)
    rows = []
    for i, (_, kv_len) in enumerate(batch):
        tile = oracle.solo_tile(FI072, GROUP, HEAD_DIM, kv_len)
        own = q[qo[i]:qo[i + 1]] + (tile_term(tile, kv_len) + kv_cache[pages[kv[i]:kv[i + 1]].long()].sum())
        rows.append(own)
    return torch.cat(rows)


def run(batch, groups, pads=None):
    q, kv_cache = torch.randn(sum(e for e, _ in batch), 2, 8), torch.rand(1000 * len(batch) + 1000, 3)  # pages past 1000
    qo, kv, pages, last = csr(batch)
    split = SplitPrefill([TileWrapper() for _ in groups], groups, pads)
    split.begin_forward(qo, kv, pages, last, *HEADS, q_data_type="bf16", fixed_split_size=4096)
    # SGLang reuses its index buffers: the next plan overwrites them before this batch runs.
    qo.zero_(), kv.zero_(), pages.zero_(), last.zero_()
    return split.forward(q, kv_cache, causal=True), solo_rows(batch, q, kv_cache), split


def split_of(batch, rules=RULES):
    return tile_groups(rules, [e for e, _ in batch], [kv for _, kv in batch])


def test_the_batch_splits_into_one_call_per_tile_class():
    assert (split_of(BATCH).groups, split_of(BATCH).pads) == (GROUPS, (0, 0))
    assert split_of(BATCH, PAD_RULES) == split_of(BATCH)  # every call on its tile already: no pads


def test_every_member_gets_its_solo_rows_in_batch_order_and_one_call_would_not():
    out, solo, split = run(BATCH, split_of(BATCH).groups)
    assert torch.equal(out, solo)
    one_call, solo, _ = run(BATCH, (tuple(range(len(BATCH))),))
    assert not torch.equal(one_call, solo)  # the control: the test can tell a call off the tile


def test_each_call_is_planned_over_its_own_requests_with_every_other_argument_as_given():
    groups = ((3, 0), (1, 4), (2,))  # any order: the rows still come back in batch order
    out, solo, split = run(BATCH, groups)
    qo, kv, pages, _ = csr(BATCH)
    first = split.wrappers[0].planned
    assert first[0].tolist() == [0, 50, 50 + 512] and first[1].tolist() == [0, 50, 50 + 1536]
    assert torch.equal(first[2], torch.cat([pages[kv[3]:kv[4]], pages[kv[0]:kv[1]]]))
    assert all(w.planned[4] == dict(q_data_type="bf16", fixed_split_size=4096) for w in split.wrappers)


def test_a_padded_call_gives_a_short_final_piece_its_solo_rows_and_an_unpadded_one_would_not():
    split = split_of(PIECE, PAD_RULES)
    assert split.groups == ((0,), (1,)) and split.pads == (120, 0)  # (10 + 120) // 2 = 65 rows, over 64; 119 give 64
    out, solo, _ = run(PIECE, split.groups, split.pads)
    assert torch.equal(out, solo)
    unpadded, solo, _ = run(PIECE, split.groups)
    assert not torch.equal(unpadded, solo)  # the control: the same calls without the pad
    assert split_of(PIECE).pads == (0, 0)  # the rules without pads leave it to the scheduler


def test_a_lone_piece_is_padded_in_a_call_of_its_own():
    """One class, one call: stock's path would plan it alone on a small tile, so it is split to be padded."""
    split = split_of(PIECE[:1], PAD_RULES)
    assert split.groups == ((0,),) and split.pads == (120,)
    out, solo, padded = run(PIECE[:1], split.groups, split.pads)
    assert torch.equal(out, solo)
    qo, kv, pages, last, _ = padded.wrappers[0].planned
    assert qo.tolist() == [0, 10, 130] and kv.tolist() == [0, 1034, 1154]
    assert torch.equal(pages[1034:], torch.zeros(120, dtype=torch.int32))  # the first KV entry, repeated
    assert last.tolist() == [1, 1] and torch.equal(padded.rows[0][10:], torch.zeros(120, dtype=torch.long))
    assert split_of(PIECE[:1]) is None  # without pads: stock's one call


def test_rows_past_the_batch_are_left_to_the_caller():
    """A padded graph's q is longer than the batch: its rows come back unwritten, as stock's kernel leaves them."""
    groups = GROUPS
    q, kv_cache = torch.randn(sum(e for e, _ in BATCH) + 5, 2, 8), torch.rand(5000, 3)
    split = SplitPrefill([TileWrapper() for _ in groups], groups)
    split.plan(*csr(BATCH), *HEADS)
    out = split.forward(q, kv_cache)
    assert out.shape == q.shape and torch.equal(out[:-5], solo_rows(BATCH, q[:-5], kv_cache))


# plan_by_tile around SGLang's own init_forward_metadata (a backend built without __init__).


def forward_batch(batch, mode="EXTEND", lists=True):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    extend, kv = [e for e, _ in batch], [k for _, k in batch]
    return SimpleNamespace(
        forward_mode=ForwardMode[mode], extend_seq_lens_cpu=extend if lists else torch.tensor(extend),
        extend_seq_lens=torch.tensor(extend), seq_lens_cpu=torch.tensor(kv), seq_lens=torch.tensor(kv),
        seq_lens_sum=sum(kv), extend_prefix_lens=torch.tensor([k - e for e, k in batch]),
        extend_prefix_lens_cpu=[k - e for e, k in batch], req_pool_indices=torch.arange(len(batch)),
        encoder_lens=None, cross_attention_custom_mask=None, kv_loc_plan=None, out_cache_loc=None,
    )


class Updater:
    """The indices updater's contract with the wrappers: plan each with the batch's whole CSR."""

    def update(self, req_pool_indices, seq_lens, seq_lens_cpu, seq_lens_sum, prefix_lens, prefill_wrappers, **kw):
        batch = list(zip((seq_lens - prefix_lens).tolist(), seq_lens.tolist()))
        for wrapper in prefill_wrappers:
            wrapper.begin_forward(*csr(batch), *HEADS)


def backend(**state):
    state = {
        **dict(use_sliding_window_kv_pool=False, is_multimodal=False, enable_mis=False, use_paged=False,
               prefill_uses_dequant_workspace=False, dispatch_reason=None, workspace_buffer=None,
               prefill_wrappers_paged=[TileWrapper()]),
        **state,
    }
    made = standins.flashinfer_backend(**state)
    made.indices_updater_prefill = Updater()  # after the declaration's geometry: the backend declares none
    return made


@pytest.fixture
def rules_in_force(plugin):
    """The plugin applied (backends declare, as plan_by_tile reads) and the split rules activated."""
    prefill_hooks.activate(RULES)


def plan(backend_, batch):
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    stock = FlashInferAttnBackend.init_forward_metadata
    split_attention.plan_by_tile(lambda fb: stock(backend_, fb), backend_, (batch,), {})
    return backend_.forward_metadata.prefill_wrappers


def test_sglangs_own_planning_of_a_mixed_batch_runs_on_split_calls(rules_in_force):
    made = backend()
    stock_wrappers = made.prefill_wrappers_paged
    wrappers = plan(made, forward_batch(BATCH, lists=False))
    assert [type(w) for w in wrappers] == [SplitPrefill] and wrappers[0].groups == GROUPS
    assert made.prefill_wrappers_paged is stock_wrappers  # put back for the next batch
    assert all(w.planned is not None for w in wrappers[0].wrappers)
    spares = TileWrapper.made
    plan(made, forward_batch(BATCH))
    assert TileWrapper.made == spares  # the spare wrappers are kept


@pytest.mark.parametrize("why", ["one class", "mixed decodes", "no rules", "split off", "not deterministic"])
def test_elsewhere_sglang_plans_its_own_wrappers(why, rules_in_force):
    batch, mode, state = BATCH, "EXTEND", {}
    if why == "one class":
        batch = ((512, 1536), (100, 100), (3, 3))
    elif why == "mixed decodes":
        mode = "MIXED"
    elif why == "no rules":
        prefill_hooks.activate(None)
    elif why == "split off":
        prefill_hooks.activate(Rules(group=GROUP, head_dim=HEAD_DIM, facts=FI072))
    else:
        state = dict(enable_deterministic=False)
    made = backend(**state)
    assert plan(made, forward_batch(batch, mode)) is made.prefill_wrappers_paged


@pytest.mark.parametrize("state, serves", [
    ({}, True),
    (dict(enable_mis=True), False),
    (dict(prefill_uses_dequant_workspace=True), False),
    ("CROSS_ATTENTION", False),
    ("SLIDING_WINDOW", True),
])
def test_backends_whose_plans_a_group_cannot_take_a_slice_of_are_not_split(state, serves):
    from sglang.srt.layers.attention.flashinfer_backend import WrapperDispatch

    if isinstance(state, str):
        state = dict(dispatch_reason=WrapperDispatch[state])
    assert split_attention.serves(backend(**state)) is serves
