"""Kernel facts the chunk alignment rests on, and the rules derived from them.

Measured on an H200 with flashinfer 0.7.2 (tests/gpu): deterministic chunked
prefill reproduces unchunked prefill bit for bit only when every chunk starts
on fa2's q-tile grid and fa2 picks the CTA tile the request's solo prefill gets. The
split-KV tile (SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE) does not change
which boundaries are exact, so it plays no part here.

Pure functions only: no SGLang import, so the CLI and tests use them freely.
"""

import math

# fa2's q-tile grid in tokens: its CTA q-tile is 128 packed rows (64 at head_dim 256), i.e. 128/gqa_group tokens or fewer, so 128 tokens is on the grid for every GQA group and head_dim.
PREFILL_Q_TILE_TOKENS = 128


def combine_alignments(*alignments):
    """The least common multiple of the declared alignments, ignoring None."""
    declared = [a for a in alignments if a is not None]
    return math.lcm(*declared) if declared else None


def chunk_size_error(chunk, align, q_tile, attn_dp_size=1):
    """Why a per-rank chunked-prefill size cannot serve the alignment, or None.

    `align` is the scheduler's combined alignment (q-tile, DSA kpool, mamba
    grid); `q_tile` is what the attention backend declared. A chunk shorter
    than `align` would truncate every long prompt to nothing and leave it
    waiting forever. A chunk that is not a multiple of `q_tile` is refused
    too: SGLang cuts continuation chunks at the full chunk size, so from the
    second chunk on every start would leave the grid.
    """
    if align is None or chunk is None or chunk <= 0:
        return None
    dp_note = (
        f" (--chunked-prefill-size is split across {attn_dp_size} DP attention ranks)"
        if attn_dp_size > 1
        else ""
    )
    if chunk < align:
        return (
            f"Chunked prefill is aligned to {align} tokens, but each rank's chunked "
            f"prefill size is {chunk}{dp_note}; a prompt longer than {chunk} tokens "
            f"could never be scheduled. Raise --chunked-prefill-size to at least "
            f"{align * attn_dp_size}."
        )
    if q_tile is not None and chunk % q_tile:
        lower, upper = chunk // q_tile * q_tile, (chunk // q_tile + 1) * q_tile
        return (
            f"Chunked prefill is aligned to {q_tile} tokens (the deterministic "
            f"flashinfer prefill q-tile), but each rank's chunked prefill size is "
            f"{chunk}{dp_note}, not a multiple of {q_tile}: continuation chunks "
            f"would start off the grid and lose bit-exactness. Use "
            f"--chunked-prefill-size {lower * attn_dp_size} or "
            f"{upper * attn_dp_size}."
        )
    return None
