"""What each attention backend declares as `prefill_chunk_align`.

The scheduler asks the live backend instead of matching backend names, so the
answer must come from the backend's own state: a FlashInferAttnBackend
declares the fa2 q-tile exactly when its deterministic fa2 paged prefill with
a fixed split-KV size runs, and a wrapper forwards what the child that runs
its prefill (EXTEND) declares. patches.py installs these as properties.
"""

import os

from .alignment import PREFILL_Q_TILE_TOKENS, combine_alignments
from .compat import ChunkAlignError

# Stock SGLang before 0.5.22 aligned deterministic triton prefill to this (default 4096).
TRITON_ALIGN_ENV = "SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE"


def flashinfer_prefill_chunk_align(backend):
    """The fa2 q-tile when deterministic fa2 paged prefill runs, else None."""
    runs_fixed_split_fa2 = (
        getattr(backend, "enable_deterministic", False)
        # Set from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE under deterministic inference only.
        and getattr(backend, "prefill_split_tile_size", None) is not None
        and getattr(backend, "prefill_backend", None) == "fa2"
        and not getattr(backend, "skip_prefill", False)
    )
    return PREFILL_Q_TILE_TOKENS if runs_fixed_split_fa2 else None


def triton_prefill_chunk_align(backend):
    """What stock SGLang before 0.5.22 aligned deterministic triton prefill to."""
    if not getattr(backend, "enable_deterministic", False):
        return None
    raw = os.environ.get(TRITON_ALIGN_ENV, "4096")
    if not raw.isdigit() or int(raw) < 1:
        raise ChunkAlignError(f"{TRITON_ALIGN_ENV}={raw!r} is not valid: use a positive number of tokens.")
    return int(raw)


def forward_to(*children):
    """A property getter that combines what the named child backends declare."""

    def prefill_chunk_align(self):
        return combine_alignments(
            *(getattr(getattr(self, child), "prefill_chunk_align", None) for child in children)
        )

    prefill_chunk_align.__doc__ = f"Forwarded from {' and '.join(children)}."
    prefill_chunk_align.children = children
    return prefill_chunk_align


def backend_alignment(backend):
    """(alignment, description) of a live backend, for logs and doctor."""
    align = getattr(backend, "prefill_chunk_align", None)
    return align, f"{type(backend).__name__}.prefill_chunk_align = {align}"
