"""What each attention backend declares for its prefill: one Declaration, its `prefill_declaration`.

The scheduler asks the live backend instead of matching backend names, so the
answer must come from the backend's own state: a FlashInferAttnBackend
declares fa2's q-tile grid exactly when its deterministic fa2 paged prefill
with a fixed split-KV size runs, and a wrapper forwards what the children that
run its prefill (EXTEND) declare. Everything the scheduler and `doctor` read
is in that one object: the alignment, the q-tile geometry, which fa2 grid (if
any) it is for, and where the geometry was read. `prefill_chunk_align`, the
name the design proposes upstream, is derived from it (prefill_chunk_align).
patch_table.py declares both per class.

A declaration reads no kernel facts: only its alignment depends on the
flashinfer release (align(facts)), and only where it is for fa2's grid, so a
server that runs no fa2 never reads the installed release's facts.
"""

import os
from typing import NamedTuple

from .alignment import combine_alignments
from .compat import ChunkAlignError
from .kernel_facts import facts_in_force
from .workspace import Planned

# Stock SGLang before 0.5.22 aligned deterministic triton prefill to this (default 4096).
TRITON_ALIGN_ENV = "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE"


class QTileGeometry(NamedTuple):
    """How fa2's prefill is planned on this rank: q heads per KV head, and head_dim (a NamedTuple:
    patches.py's import-cost rule)."""

    group: int
    head_dim: int


class Declaration:
    """What one backend declares for its prefill.

    A plain class, as workspace.Planned (patches.py's import-cost rule).
    """

    __slots__ = ("fa2", "kept_align", "packed_chunk", "geometry", "source")

    def __init__(self, fa2=(), kept_align=None, packed_chunk=None, geometry=None, source=None):
        # The deterministic FlashInferAttnBackends whose fa2 q-tile grid this declares: the backend
        # itself, or those its forwarded children run. Only where there is one is the plugin armed.
        self.fa2 = fa2
        # Tokens declared apart from fa2's grid: the alignment stock kept for deterministic triton
        # before 0.5.22 (triton_declaration), where SGLang runs as stock; else None.
        self.kept_align = kept_align
        # Tokens by which a linear-attention kernel chunks a prefill batch's packed tokens (Mamba2's
        # chunked scan), or None. Counted only beside fa2's grid, where the plugin is armed: chunk
        # starts join it, so that a request's kernel chunks fall where its solo prefill's do.
        self.packed_chunk = packed_chunk
        self.geometry = geometry  # QTileGeometry fa2's prefill is planned with, or None: unknown
        self.source = source  # where the geometry was read, for the scheduler's startup line

    def align(self, facts):
        """Tokens (or None): the chunk starts this backend needs, with fa2's grid counted by the
        kernel facts `facts` (kernel_facts.KernelFacts; unread, and may be None, without fa2)."""
        return combine_alignments(self.kept_align, *((facts.chunk_align, self.packed_chunk) if self.fa2 else ()))

    @property
    def aligned(self):
        """Whether it declares any alignment (which facts do not change: fa2's grid is at least 1)."""
        return bool(self.fa2) or self.kept_align is not None


NOTHING = Declaration()  # no alignment, no geometry: AttentionBackend's default


def declares_nothing(backend):
    """A backend whose prefill needs no chunk alignment."""
    return NOTHING


def flashinfer_declaration(backend):
    """fa2's grid, when deterministic fa2 paged prefill with a fixed split runs; else nothing.

    The geometry comes from the heads and head_dim the prefill is planned with,
    per attention-TP rank: SGLang plans with the maximum q heads over layers
    (indices_updater_prefill), which is what fa2 packs rows with. None where
    the backend does not say.
    """
    runs_fixed_split_fa2 = (
        getattr(backend, "enable_deterministic", False)
        # Set from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE under deterministic inference only.
        and getattr(backend, "prefill_split_tile_size", None) is not None
        and getattr(backend, "prefill_backend", None) == "fa2"
        and not getattr(backend, "skip_prefill", False)
    )
    if not runs_fixed_split_fa2:
        return NOTHING
    planned = getattr(backend, "indices_updater_prefill", None)
    heads, kv_heads = getattr(planned, "num_qo_heads", None), getattr(planned, "num_kv_heads", None)
    head_dim = getattr(planned, "head_dim", None)
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads, head_dim)) or heads % kv_heads:
        return Declaration(fa2=(backend,))
    return Declaration(
        fa2=(backend,), geometry=QTileGeometry(heads // kv_heads, head_dim),
        source=f"{type(backend).__name__}.indices_updater_prefill: {heads} q / {kv_heads} KV heads, head_dim {head_dim}",
    )


def triton_declaration(backend):
    """What stock SGLang before 0.5.22 aligned deterministic triton prefill to: not fa2's grid."""
    if not getattr(backend, "enable_deterministic", False):
        return NOTHING
    raw = os.environ.get(TRITON_ALIGN_ENV, "4096")
    if not raw.isdigit() or int(raw) < 1:
        raise ChunkAlignError(f"{TRITON_ALIGN_ENV}={raw!r} is not valid: use a positive number of tokens.")
    return Declaration(kept_align=int(raw))


def mamba2_declaration(backend):
    """Mamba2's chunked scan cuts a prefill batch's packed tokens into chunks of mamba_chunk_size
    counted from the batch's first token, not each request's (Mamba2Metadata's chunk_indices and
    chunk_offsets). A request's results therefore follow where its extend starts in its batch and
    in its prompt; fa2's grid rules join this chunk (planning.Rules.packed_chunk)."""
    chunk = getattr(backend, "mamba_chunk_size", None)
    return Declaration(packed_chunk=chunk) if isinstance(chunk, int) and chunk > 1 else NOTHING


class Forward:
    """A wrapper's `prefill_declaration`: what the named children that run its prefill declare,
    combined. Read on the class it is itself, so `doctor` sees which children to build."""

    __slots__ = ("children",)

    def __init__(self, *children):
        self.children = children  # attribute names of the child backends

    def __get__(self, backend, owner=None):
        return self if backend is None else self.declare(backend)

    def declare(self, backend):
        """The alignments combined by LCM; fa2's grid wherever a child runs it; the geometry only
        where every aligned child declares the same one (else the conservative rules apply)."""
        declared = [getattr(getattr(backend, child), "prefill_declaration", NOTHING) for child in self.children]
        aligned = [d for d in declared if d.aligned]
        agreed = aligned[0] if len({d.geometry for d in aligned}) == 1 else NOTHING
        return Declaration(
            fa2=tuple(fa2 for d in declared for fa2 in d.fa2),
            kept_align=combine_alignments(*(d.kept_align for d in declared)),
            packed_chunk=combine_alignments(*(d.packed_chunk for d in declared)),
            geometry=agreed.geometry, source=agreed.source,
        )


def facts_needed(declared):
    """The kernel facts a declaration's alignment is counted with: those in force
    (kernel_facts.facts_in_force) where it is for fa2's grid; None elsewhere, where nothing
    reads them, so a server that runs no fa2 never reads or warns of the installed release's."""
    return facts_in_force() if declared.fa2 else None


def prefill_chunk_align(backend):
    """Every declaring backend's `prefill_chunk_align` property: its declaration's alignment."""
    declared = backend.prefill_declaration
    return declared.align(facts_needed(declared))


def planned_prefill(backend):
    """How a deterministic FlashInferAttnBackend plans fa2 prefill (workspace.Planned), or None where
    it does not say: the heads and head_dim it plans with, its fixed split and its workspace."""
    planned = getattr(backend, "indices_updater_prefill", None)
    sizes = [getattr(planned, name, None) for name in ("num_qo_heads", "num_kv_heads", "head_dim")]
    split, buffer = getattr(backend, "prefill_split_tile_size", None), getattr(backend, "workspace_buffer", None)
    if not all(isinstance(n, int) and n > 0 for n in (*sizes, split)) or buffer is None:
        return None
    return Planned(*sizes, split, buffer.numel() * buffer.element_size())
