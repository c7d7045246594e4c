"""Combining the chunk alignments the backends declare, and the startup refusal.

What the deterministic flashinfer backend declares comes from the kernel facts
of the installed flashinfer (kernel_facts.py): on 0.7.2 a chunk must start on
fa2's 128-row q-tile grid, on 0.7.4 anywhere. The split-KV tile
(SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE) does not change which boundaries
are exact, so it plays no part here.

Pure functions only: no SGLang import, so the CLI and tests use them freely.
"""

import math

from .kernel_facts import STRICTEST

# The strictest measured alignment (flashinfer 0.7.2's 128-row q-tile grid, 128 tokens at every
# GQA group and head_dim): safe on every release; the backend declares its release's own.
PREFILL_Q_TILE_TOKENS = STRICTEST.chunk_align


def combine_alignments(*alignments):
    """The least common multiple of the declared alignments, ignoring None."""
    declared = [a for a in alignments if a is not None]
    return math.lcm(*declared) if declared else None


def chunk_size_error(chunk, align, q_tile, attn_dp_size=1, min_piece=None, flag="--chunked-prefill-size"):
    """Why a per-rank chunked-prefill size cannot serve the alignment, or None.

    `align` is the scheduler's combined alignment (q-tile, DSA kpool, mamba
    grid); `q_tile` is what the attention backend declared. A chunk shorter
    than `align` would truncate every long prompt to nothing and leave it
    waiting forever. A chunk that is not a multiple of `q_tile` is refused
    too: SGLang cuts continuation chunks at the full chunk size, so from the
    second chunk on every start would leave the grid. Where the kernel needs
    no start alignment (q_tile 1), a chunk shorter than `min_piece` (the grid
    rules' shortest piece on the full fa2 tile) is refused: every piece but the
    last would run on a smaller tile than its solo prefill. `flag` is the option the user set the
    size with, named in the advice: the server's, or `plan`'s `--chunk`.
    """
    if align is None or chunk is None or chunk <= 0:
        return None
    dp_note = (
        f" ({flag} is split across {attn_dp_size} DP attention ranks)"
        if attn_dp_size > 1
        else ""
    )
    if chunk < align:
        return (
            f"Chunked prefill is aligned to {align} tokens, but each rank's chunked "
            f"prefill size is {chunk}{dp_note}; a prompt longer than {chunk} tokens "
            f"could never be scheduled. Raise {flag} to at least "
            f"{align * attn_dp_size}."
        )
    if min_piece is not None and chunk < min_piece:
        return (
            f"Chunked prefill pieces must get fa2's full q-tile, {min_piece} tokens or more for this "
            f"model, but each rank's chunked prefill size is {chunk}{dp_note}: every piece but a "
            f"prompt's last would run on a smaller tile and lose bit-exactness. Raise "
            f"{flag} to at least {min_piece * attn_dp_size}."
        )
    if q_tile is not None and chunk % q_tile:
        lower, upper = chunk // q_tile * q_tile, (chunk // q_tile + 1) * q_tile
        return (
            f"Chunked prefill is aligned to {q_tile} tokens (what the attention backend "
            f"declares: fa2's q-tile grid under deterministic flashinfer and, in a Mamba2 "
            f"hybrid, its scan's chunks), but each rank's chunked prefill size is "
            f"{chunk}{dp_note}, not a multiple of {q_tile}: continuation chunks "
            f"would start off the grid and lose bit-exactness. Use "
            f"{flag} {lower * attn_dp_size} or "
            f"{upper * attn_dp_size}."
        )
    return None
