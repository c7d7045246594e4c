"""Whether fa2's split partials fit SGLang's deterministic workspace, decided at startup.

With a fixed split size, one prefill step of q query tokens over a KV of E
tokens keeps an fp32 partial output and its LSE per (query row, split of the
KV): q x ceil(E/split) x heads x (head_dim + 1) x 4 bytes. SGLang fixes the
deterministic workspace at 2 GiB, and flashinfer's plan() raises when the
partials outgrow it; the scheduler then fails mid-request. On the H200 an
unchunked prefill of 20,480 tokens (Granite-3.1-8B's shape) was served and one
of 24,576 was not, as this formula says (benchmarks/README.md).

A chunk of C tokens reaches its largest partials when it is a request's last C
tokens at the longest prompt the server admits (a long prompt's final chunk,
or a short extend on a long cached prefix). So the plugin refuses at startup a
chunk size and context length whose worst step cannot fit, and names the
largest chunk and context that do, rather than fail a request later. A prefill
batch of several requests, each over its own long cached prefix, adds their
tiles' rounding on top: the check covers one request's step exactly.
"""

from .alignment import PREFILL_Q_TILE_TOKENS


def _ceil_div(a, b):
    return -(-a // b)


def _align16(n):
    return _ceil_div(n, 16) * 16


def partial_bytes(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, split, cta_tile):
    """Float-workspace bytes one fa2 paged-prefill plan reserves (tmp_v + tmp_s), 0 if the KV is not split.

    Mirrors PrefillSplitQOKVIndptr and PrefillPlan in flashinfer 0.7.2's
    include/flashinfer/attention/scheduler.cuh for one request, no CUDA graph, a
    fixed split size; `cta_tile(packed_rows, head_dim)` is the kernel facts' tile.
    """
    group = num_qo_heads // num_kv_heads
    packed = qo_len * group
    num_chunks = _ceil_div(max(kv_len, 1), split)
    if num_chunks <= 1:
        return 0
    tile = cta_tile(packed, head_dim)
    rows = _ceil_div(_ceil_div(packed, tile) * num_chunks * tile, group)
    return _align16(num_qo_heads * rows * head_dim * 4) + _align16(num_qo_heads * rows * 4)


class Planned:
    """How the live deterministic backend plans fa2 prefill on this rank (backends.py reads it)."""

    __slots__ = ("num_qo_heads", "num_kv_heads", "head_dim", "split", "workspace_bytes")

    def __init__(self, num_qo_heads, num_kv_heads, head_dim, split, workspace_bytes):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.split, self.workspace_bytes = split, workspace_bytes

    def worst_step_bytes(self, chunk, max_prompt, cta_tile):
        """The partials of a chunk's worst step: its last `chunk` tokens at `max_prompt`."""
        return partial_bytes(min(chunk, max_prompt), max_prompt, self.num_qo_heads, self.num_kv_heads,
                             self.head_dim, self.split, cta_tile)

    def refusal(self, chunk, max_prompt, cta_tile):
        """Why prompts up to `max_prompt` tokens, prefilled in chunks of `chunk` (None: unchunked),
        could outgrow the workspace, with the largest chunk and context that fit; None if they fit."""
        step = max_prompt if chunk is None else chunk
        need = self.worst_step_bytes(step, max_prompt, cta_tile)
        if need <= self.workspace_bytes:
            return None
        fits = lambda c, n: self.worst_step_bytes(c, n, cta_tile) <= self.workspace_bytes  # noqa: E731
        context = _largest(lambda n: fits(step, n), max_prompt)
        largest_chunk = _largest(lambda c: fits(c, max_prompt), step)
        chunked = "unchunked prefill" if chunk is None else f"chunks of {chunk} tokens"
        return (
            f"sglang-chunk-align: with {chunked}, a prompt of {max_prompt} tokens (the longest this server "
            f"admits) needs {need / 2**30:.2f} GiB of fa2 split partials (split {self.split}, "
            f"{self.num_qo_heads} q heads, head_dim {self.head_dim}), more than the "
            f"{self.workspace_bytes / 2**30:.2f} GiB deterministic workspace: flashinfer's plan() would fail "
            f"mid-request. Use --context-length {context} or less, or --chunked-prefill-size "
            f"{largest_chunk // PREFILL_Q_TILE_TOKENS * PREFILL_Q_TILE_TOKENS} or less."
        )


def _largest(fits, upper):
    """The largest n in [1, upper] with fits(n) (monotone: true up to a point), or 0."""
    low, high = 0, upper
    while low < high:
        middle = _ceil_div(low + high, 2)
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
