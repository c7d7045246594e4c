"""The grid decisions of one scheduling step, as functions of integers and the rules.

SGLang's PrefillAdder admits requests in its own terms: a chunk budget, KV
memory, the requests it admitted before. prefill_hooks.py's wrappers read
those values off the adder, ask one of these functions, and hand the answer
back to stock as one of stock's own answers. The decisions know nothing of
SGLang, so each reads as one path on every release, and tests/test_decisions.py
checks them over integers alone.

Lengths are in tokens; a request's extend starts at `start` (on the grid)
and its prompt ends at `prompt_len`. What the adder's state adds:
- `others`: requests were admitted before this one in the step;
- `chunk_in_batch`: one of them is an unfinished chunked request;
- `running`: requests are decoding, so KV memory will be freed.
"""

import logging

from .planning import KEEP, RIDE, WAIT, chunk_end, split_by_tile, tile_conflicts

logger = logging.getLogger("sglang_chunk_align")


def short_tail(may_ride, others, running):
    """How a cut treats a final piece too short for the full tile (planning.chunk_end): ride where
    the chunk budget alone cut a request that is alone in the batch (`may_ride`: the caller makes
    room); otherwise wait where other requests left the budget over or running requests will free
    KV memory; keep the short piece only where nothing will free any, because waiting there would
    be forever."""
    if may_ride:
        return RIDE
    return WAIT if others or running else KEEP


def admission_end(rules, start, extend, prompt_len, budget, others, chunk_in_batch, running):
    """Where a new request's chunked admission ends, which stock cut `extend` tokens after `start`
    with `budget` tokens of chunk budget left; `start` where the request waits.

    SGLang tracks one unfinished chunked request, so no second one joins its
    batch. A short final piece rides only when the chunk budget alone cut a
    request that is alone: stock has checked KV memory for the whole prompt.
    """
    if chunk_in_batch:
        return start
    tail = short_tail(not others and extend >= budget, others, running)
    return _grid_end(rules, start, extend, prompt_len, tail)


def riding_slack(rules, start, budget, prompt_len):
    """Tokens beyond the chunk budget `budget` (None: chunked prefill off) that a continuation's
    riding final piece takes, or 0. A continuation is alone in its batch (the scheduler continues
    its chunked request first, on a fresh adder), so its piece may ride.

    Only a final piece shorter than min_final rides, so chunk_end is asked only when
    less than that lies beyond the budget (most continuations skip it).
    """
    if budget is None:
        return 0
    beyond = prompt_len - start - budget
    if 0 < beyond < rules.min_final and chunk_end(start, budget, prompt_len, rules, RIDE) == prompt_len:
        return beyond
    return 0


def continuation_cut(rules, limit, remaining, tail):
    """A continuation's cut, from the `limit` stock's budget and KV memory allow it (its riding
    slack included) and the `remaining` tokens of its prompt: on the grid, `limit` where that
    finishes the prompt; None where the limit holds no grid cut, and the request waits. `tail`:
    short_tail for the adder as it was before stock cut (a continuation never rides here: its
    slack has made room)."""
    if limit >= remaining:
        return limit
    return _grid_end(rules, 0, limit, remaining, tail) or None


def ignore_eos_end(rules, start, budget, prompt_len, others, chunk_in_batch):
    """Where an ignore_eos request's chunk ends, which stock cuts at its chunk budget `budget`
    (0 < budget < prompt_len - start); `start` where it waits. Stock has checked KV memory for the
    whole prompt, so a short final piece rides where the request is alone and waits for the next
    step otherwise: never kept."""
    if chunk_in_batch:
        return start
    return _grid_end(rules, start, budget, prompt_len, short_tail(not others, others, False))


# deferral's reasons, which the benchmarks count apart: behind a parked chunk; for the tiles, the
# rules' without split attention, and what a call per tile class cannot fix.
BEHIND_A_PARKED_CHUNK = "behind a chunked request that waits this step"
ONE_TILE_PER_BATCH = "to keep batch members on their solo tiles"
OFF_TILE_IN_ITS_CALL = "so that no member runs off its solo tile in its tile class's fa2 call"
ALONE_FOR_PACKED_CHUNKS = "so that a kernel chunking the batch's packed tokens (Mamba2) sees each request alone"


def deferral(rules, parked, members, start, prompt_len):
    """Why a new request starting at `start` waits, or None where it may be admitted: behind a
    chunked request `parked` this step (requests behind it would take its KV memory), behind any
    member where a kernel chunks the batch's packed tokens (rules.packed_chunk: its chunks would
    start where the members before it end), or because some batch member would run off its solo
    tile. `members`: (extend_len, kv_len, prompt_len) of the requests admitted before it. Where
    the backend splits attention by tile class (rules.split_attention), only what splitting
    cannot fix counts (split_by_tile's off_tile); elsewhere every member must share the batch's
    one tile.

    Its extend is not known before admission, but it is at least
    min(remaining, min_tail) tokens; its call's tile only grows with it, and
    any conflict this bound misses is the candidate's own, which it catches.
    Its KV is taken as its whole prompt, so that the short-KV exemption
    never excuses it on the strength of that lower bound.
    """
    if parked:
        return BEHIND_A_PARKED_CHUNK
    if not members:
        return None
    if rules.packed_chunk:
        return ALONE_FOR_PACKED_CHUNKS
    batch = [*members, (min(prompt_len - start, rules.min_tail), prompt_len, prompt_len)]
    if rules.split_attention:
        return OFF_TILE_IN_ITS_CALL if split_by_tile(batch, rules).off_tile else None
    return ONE_TILE_PER_BATCH if tile_conflicts(batch, rules) else None


def tile_groups(rules, extend_lens, kv_lens):
    """The fa2 calls split attention runs a prefill batch as: split_by_tile's answer (groups of batch
    indices and their pads), or None where one unpadded call serves every member (the stock path).

    The backend sees each request's extend and KV end, not its prompt's length.
    Under the grid rules the KV end stands for it: an extend that ends before
    its prompt does is at least min_tail tokens long, so its KV end is in the
    full-tile class, as its prompt is; any other extend ends its prompt.
    """
    split = split_by_tile([(e, kv, kv) for e, kv in zip(extend_lens, kv_lens)], rules)
    return split if len(split.groups) > 1 or any(split.pads) else None


def _grid_end(rules, start, budget, prompt_len, tail):
    """chunk_end for an extend cut at `budget`, with `tail` (short_tail). A short piece kept is
    not bit-exact, and says so."""
    end = chunk_end(start, budget, prompt_len, rules, tail)
    if tail == KEEP and 0 < prompt_len - end < rules.min_final:
        logger.warning(
            "sglang-chunk-align: KV memory holds %d tokens, too few for the final %d of a prompt "
            "with no running request to free more: its %d-token final piece runs on a smaller fa2 "
            "tile than its solo prefill (not bit-exact). Give the KV cache more memory "
            "(--mem-fraction-static) to avoid this.",
            budget, prompt_len - start, prompt_len - end,
        )
    return end
