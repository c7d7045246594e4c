"""Split attention (issue 32): a prefill batch whose requests need different fa2 tiles runs as
one fa2 call per tile class, so no request waits to keep the others on their solo tiles.

fa2 plans one q-tile per call from the integer average of its requests' packed q
lengths (planning.py). A long chunk batched with short prompts moves some of
them onto a tile their solo prefill does not get, and the grid rules used to
keep such requests apart by deferring one of them. Measured on an H200
(benchmarks/logs/split_attention_h200/split_attention.json): one fa2 call per
group of planning.split_by_tile, each planned over its own requests only,
gives every member the rows of its solo prefill, also through SplitPrefill.

The split lives behind flashinfer's wrapper interface, so SGLang's code runs
unchanged. For such a batch, FlashInferAttnBackend.init_forward_metadata
plans SplitPrefill objects in place of its paged prefill wrappers
(plan_by_tile). SGLang plans them with the whole batch's arguments, as it
plans its own wrappers, after its own index translation; each plans one
flashinfer wrapper per group over the group's requests, cut from those
arguments, and at forward runs them in turn, gathering each group's q rows
and scattering their output back. SGLang's KV write runs once, before, as
stock. A batch of one class plans SGLang's own wrappers, as before.

Where the rules pad calls (Rules.pad_tiles, SGLANG_CHUNK_ALIGN_PAD_TILES=1,
issue 48), a group whose extends average too few packed rows for its class's
tile gets one more member of planning.call_pad's tokens, which lifts its
call onto that tile; a batch of one class is split into one padded call for
it. The padding member reads rows and KV the batch already has, and its
output is dropped.

torch is imported where a split is planned, never at plugin load (patches.py's
import-cost rule); every SGLang process that plans one has loaded it.
"""

import logging
import weakref

from .decisions import tile_groups
from .prefill_hooks import rules_in_force

logger = logging.getLogger("sglang_chunk_align")

_EXTEND = "EXTEND"  # the one forward mode split: plain prefill (no mixed decodes, speculative or dLLM modes)
_spares = weakref.WeakKeyDictionary()  # backend -> its extra wrappers, one list per group index
_splits = 0  # batches this process has split, for the log line at each power of ten


def serves(backend):
    """Whether this deterministic fa2 backend's prefill can be split: every paged prefill plan of
    its carries no per-batch extras that a group cannot take a slice of (multi-item scoring's
    pointers, cross-attention's custom mask), and reads the KV cache itself (not FP4
    dequantization's workspace, which is laid out for the whole batch)."""
    dispatch = getattr(backend, "dispatch_reason", None)
    return not (
        getattr(backend, "enable_mis", False)
        or getattr(dispatch, "name", None) == "CROSS_ATTENTION"
        or getattr(backend, "prefill_uses_dequant_workspace", False)
    )


def plan_by_tile(wrapped, backend, args, kwargs):
    """Wraps FlashInferAttnBackend.init_forward_metadata: an EXTEND batch that decisions.tile_groups
    splits is planned on SplitPrefill objects, which SGLang's forward_extend then runs."""
    rules = rules_in_force()
    if rules is None or not rules.split_attention or not backend.prefill_declaration.fa2:
        return wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["forward_batch"]
    if batch.forward_mode.name != _EXTEND:
        return wrapped(*args, **kwargs)
    split = tile_groups(rules, _ints(batch.extend_seq_lens_cpu, batch.extend_seq_lens),
                        _ints(batch.seq_lens_cpu, batch.seq_lens))
    if split is None:
        return wrapped(*args, **kwargs)
    _count(split)
    stock = backend.prefill_wrappers_paged
    groups = split.groups
    spares = _spare_wrappers(backend, len(groups))
    backend.prefill_wrappers_paged = [
        SplitPrefill([spares[g][w] for g in range(len(groups))], groups, split.pads) for w in range(len(stock))
    ]
    try:
        return wrapped(*args, **kwargs)
    finally:
        backend.prefill_wrappers_paged = stock


def _count(split):
    """Log the 1st, 10th, 100th... split batch at INFO (every one at DEBUG): a server's log shows
    that split attention runs, and about how often, without a line per batch."""
    global _splits
    _splits += 1
    level = logging.INFO if str(_splits).rstrip("0") == "1" else logging.DEBUG
    calls = "+".join(f"{len(g)}" + (f" (padded {pad})" if pad else "") for g, pad in zip(split.groups, split.pads))
    logger.log(level, "sglang-chunk-align: split attention: prefill batch %d split into fa2 calls of %s requests",
               _splits, calls)


def _ints(host, device):
    """A batch's per-request lengths as ints: from the host copy SGLang keeps (a list or a CPU
    tensor, as its metadata builder made it), or, where it kept none, from the device tensor."""
    lengths = device if host is None else host
    return lengths.tolist() if hasattr(lengths, "tolist") else list(lengths)


def _spare_wrappers(backend, count):
    """`count` lists of flashinfer prefill wrappers, one per stock wrapper (sliding-window models
    have two), made as SGLang makes its own, on its workspace, and kept for later batches.

    The groups run one after another on one stream, so they share the float workspace as
    SGLang's own wrappers do; each wrapper keeps its plan in its own index buffers."""
    spares = _spares.setdefault(backend, [])
    stock = backend.prefill_wrappers_paged
    while len(spares) < count:
        spares.append([type(w)(backend.workspace_buffer, "NHD", backend=backend.prefill_backend) for w in stock])
    return spares


class SplitPrefill:
    """Stands in for one paged prefill wrapper for one batch: plan() and forward() as flashinfer's,
    each run as one call per group of batch indices (`groups`) on that group's own `wrappers`,
    with a padding member of `pads[g]` tokens where that is not 0 (planning.call_pad)."""

    __slots__ = ("wrappers", "groups", "pads", "rows")

    def __init__(self, wrappers, groups, pads=None):
        self.wrappers = wrappers
        self.groups = groups
        self.pads = pads or (0,) * len(groups)
        self.rows = None  # per group, the q rows its call reads, its members' first (device index tensors)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, *args, **kwargs):
        """Plan each group's wrapper over its requests: their q rows and KV pages, cut out of the
        batch's, and every other argument as given. The index pointers go to flashinfer from the
        host, so each wrapper holds its own copy (SGLang's are views of buffers it reuses).

        A padding member only moves its call's tile: its q rows repeat the group's first row and
        its KV repeats the group's first KV entry, once per pad token, so that every row of it
        has KV to attend (causal). Its output rows are dropped. SGLang plans with page size 1,
        where a KV entry is a token's slot."""
        import torch

        qo, kv = qo_indptr.tolist(), paged_kv_indptr.tolist()  # flashinfer's plan reads them on the host too
        device = paged_kv_indices.device
        self.rows = []
        for wrapper, group, pad in zip(self.wrappers, self.groups, self.pads):
            members = torch.tensor(group, dtype=torch.long).to(device)
            kv_indices = with_pad(paged_kv_indices[_segments(kv, group).to(device)], pad)
            last_page_len = with_pad(paged_kv_last_page_len[members], min(pad, 1))  # one more member
            rows = with_pad(_segments(qo, group).to(device), pad)
            wrapper.plan(
                _indptr(qo, group, pad), _indptr(kv, group, pad), kv_indices, last_page_len, *args, **kwargs,
            )
            self.rows.append(rows)

    begin_forward = plan  # the name SGLang calls

    def forward(self, q, *args, **kwargs):
        """Each group's rows of `q` through its wrapper, scattered back into one output in batch
        order, a padding member's rows dropped. Rows past the batch's (a padded graph's) are left as
        stock leaves them: unwritten."""
        import torch

        out = None
        for wrapper, rows, pad in zip(self.wrappers, self.rows, self.pads):
            part = wrapper.forward(q[rows], *args, **kwargs)
            if out is None:
                out = torch.empty((q.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
            members = len(rows) - pad
            out[rows[:members]] = part[:members]
        return out


def with_pad(entries, pad):
    """A call's `entries` (q rows, KV slots or a per-member tensor) and its padding member's `pad` more:
    the call's first entry repeated, so that the member reads only what the batch already has."""
    import torch

    return torch.cat([entries, entries[:1].expand(pad)]) if pad else entries


def _indptr(indptr, group, pad=0):
    """The CSR index pointer (int32, host) of `group`'s segments of `indptr`, in group order, and a
    padding member's `pad` entries after them where `pad` is not 0."""
    import torch

    lengths = [indptr[i + 1] - indptr[i] for i in group] + ([pad] if pad else [])
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _segments(indptr, group):
    """The positions `group`'s segments of `indptr` cover, in group order (int64, host)."""
    import torch

    return torch.cat([torch.arange(indptr[i], indptr[i + 1]) for i in group])
