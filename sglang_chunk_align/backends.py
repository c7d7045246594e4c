"""What each attention backend declares as `prefill_chunk_align` and `prefill_q_tile_geometry`.

The scheduler asks the live backend instead of matching backend names, so the
answer must come from the backend's own state: a FlashInferAttnBackend
declares the fa2 q-tile exactly when its deterministic fa2 paged prefill with
a fixed split-KV size runs, and a wrapper forwards what the child that runs
its prefill (EXTEND) declares. The geometry is what fa2's prefill is planned
with (its packed rows per token and head_dim), so the grid rules can be
counted in packed rows; None where it is unknown. patch_table.py declares these
as properties.
"""

import os
from dataclasses import dataclass, field

from .alignment import combine_alignments
from .compat import ChunkAlignError
from .kernel_facts import facts_in_force
from .workspace import Planned

# Stock SGLang before 0.5.22 aligned deterministic triton prefill to this (default 4096).
TRITON_ALIGN_ENV = "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE"


def flashinfer_prefill_chunk_align(backend):
    """What the flashinfer in force's fa2 needs chunk starts on (kernel_facts.facts_in_force: 128 on
    0.7.2, 1 on 0.7.4) when deterministic fa2 paged prefill runs, else None."""
    runs_fixed_split_fa2 = (
        getattr(backend, "enable_deterministic", False)
        # Set from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE under deterministic inference only.
        and getattr(backend, "prefill_split_tile_size", None) is not None
        and getattr(backend, "prefill_backend", None) == "fa2"
        and not getattr(backend, "skip_prefill", False)
    )
    return facts_in_force().chunk_align if runs_fixed_split_fa2 else None


@dataclass(frozen=True)
class QTileGeometry:
    """How fa2's prefill is planned on this rank: q heads per KV head, and head_dim."""

    group: int
    head_dim: int
    source: str = field(compare=False)  # where it was read, for the scheduler's log line


def flashinfer_q_tile_geometry(backend):
    """From the heads and head_dim the prefill is planned with, per attention-TP rank.

    SGLang plans with the maximum q heads over layers (indices_updater_prefill),
    which is what fa2 packs rows with. None when the backend declares no
    alignment, or does not say.
    """
    if backend.prefill_chunk_align is None:
        return None
    planned = getattr(backend, "indices_updater_prefill", None)
    heads, kv_heads = getattr(planned, "num_qo_heads", None), getattr(planned, "num_kv_heads", None)
    head_dim = getattr(planned, "head_dim", None)
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads, head_dim)) or heads % kv_heads:
        return None
    return QTileGeometry(
        heads // kv_heads, head_dim,
        f"{type(backend).__name__}.indices_updater_prefill: {heads} q / {kv_heads} KV heads, head_dim {head_dim}",
    )


def triton_prefill_chunk_align(backend):
    """What stock SGLang before 0.5.22 aligned deterministic triton prefill to."""
    if not getattr(backend, "enable_deterministic", False):
        return None
    raw = os.environ.get(TRITON_ALIGN_ENV, "4096")
    if not raw.isdigit() or int(raw) < 1:
        raise ChunkAlignError(f"{TRITON_ALIGN_ENV}={raw!r} is not valid: use a positive number of tokens.")
    return int(raw)


def runs_fa2_grid(backend):
    """Whether `backend` declares its prefill_chunk_align for fa2's q-tile grid: it is a
    deterministic FlashInferAttnBackend, or a wrapper forwarding to one (forward_to's children).

    Only then is the plugin armed. Deterministic triton declares stock's own
    alignment on the releases that had one (triton_prefill_chunk_align), and
    there SGLang runs as stock: no startup check, no grid rules.
    """
    return any(True for _ in fa2_backends(backend))


def fa2_backends(backend):
    """The deterministic FlashInferAttnBackends whose fa2 grid `backend` declares: itself, or
    those its forwarded children (forward_to) run."""
    getter = getattr(getattr(type(backend), "prefill_chunk_align", None), "fget", None)
    if getter is flashinfer_prefill_chunk_align:
        if backend.prefill_chunk_align is not None:
            yield backend
        return
    for child in getattr(getter, "children", ()):
        yield from fa2_backends(getattr(backend, child))


def planned_prefill(backend):
    """How a deterministic FlashInferAttnBackend plans fa2 prefill (workspace.Planned), or None where
    it does not say: the heads and head_dim it plans with, its fixed split and its workspace."""
    planned = getattr(backend, "indices_updater_prefill", None)
    sizes = [getattr(planned, name, None) for name in ("num_qo_heads", "num_kv_heads", "head_dim")]
    split, buffer = getattr(backend, "prefill_split_tile_size", None), getattr(backend, "workspace_buffer", None)
    if not all(isinstance(n, int) and n > 0 for n in (*sizes, split)) or buffer is None:
        return None
    return Planned(*sizes, split, buffer.numel() * buffer.element_size())


def forward_to(*children):
    """A property getter that combines what the named child backends declare."""

    def prefill_chunk_align(self):
        return combine_alignments(
            *(getattr(getattr(self, child), "prefill_chunk_align", None) for child in children)
        )

    prefill_chunk_align.__doc__ = f"Forwarded from {' and '.join(children)}."
    prefill_chunk_align.children = children  # runs_fa2_grid follows them
    return prefill_chunk_align


def forward_geometry_to(*children):
    """A property getter for the geometry of the children that declare an alignment: known only
    where they all declare the same one (else the conservative rules apply)."""

    def prefill_q_tile_geometry(self):
        aligned = [getattr(self, c) for c in children if getattr(getattr(self, c), "prefill_chunk_align", None)]
        declared = {getattr(child, "prefill_q_tile_geometry", None) for child in aligned}
        return declared.pop() if len(declared) == 1 else None

    prefill_q_tile_geometry.__doc__ = f"Forwarded from {' and '.join(children)}."
    return prefill_q_tile_geometry

