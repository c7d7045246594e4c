"""PrefillAdder and prefix-match wrappers: every chunk on the grid, on its solo tile.

A 128-token chunk alignment alone still lets SGLang start extends off the
grid (radix hits, memory-pressure and ignore_eos cuts), leave tiny final
chunks, and batch requests onto a smaller fa2 tile than their solo prefill.
These wrappers apply planning.py's rules inside SGLang's own admission
paths.

How the rules reach them is the one hand-off not visible at a call site:
SGLang builds a new PrefillAdder every step and Req calls match_kv_cache
itself, so no argument can carry the rules. The scheduler's startup check
(scheduler_hooks._check_chunk) calls activate() once per process with the
Rules for its live backend, and patches.remove() calls activate(None).
Only the wrappers below read `rules_in_force`; while it is None (no deterministic
flashinfer scheduler, or the rules switched off) every wrapper passes through.
"""

import logging
from dataclasses import replace

from .planning import chunk_end, tile_conflicts, usable_prefix

logger = logging.getLogger("sglang_chunk_align")

rules_in_force = None  # the Rules this process's scheduler activated, or None


def activate(rules):
    global rules_in_force
    rules_in_force = rules


class _NoGridCut(Exception):
    """The budget holds no grid-aligned cut: the request waits for a later step."""


def match_on_grid(wrapped, instance, args, kwargs):
    """Wraps match_kv_cache: reuse a cached prefix only up to the grid, leaving min_tail to compute."""
    result = wrapped(*args, **kwargs)
    if rules_in_force is None:
        return result
    req = args[0]
    matched = req.prefix_len + req.host_hit_length
    usable = usable_prefix(matched, len(req.full_untruncated_fill_ids), rules_in_force)
    if usable == matched:
        return result
    return wrapped(*args, **{**kwargs, "max_prefix_len": usable})


def admit_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder._select_prefill_admission: cut a chunked admission on the grid."""
    admission = wrapped(*args, **kwargs)
    if rules_in_force is None or not getattr(admission, "is_chunked", False):
        return admission
    if _unfinished_chunk_in_batch(instance):
        return _add_req_result().OTHER
    req = args[0] if args else kwargs["req"]
    start = admission.prefix_len
    prompt_len = len(req.full_untruncated_fill_ids)
    end = chunk_end(start, admission.extend_len, prompt_len, rules_in_force, wait_for_room=bool(instance.can_run_list))
    if end == start:
        return _add_req_result().OTHER
    return replace(admission, extend_len=end - start)


def cut_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.floor_chunked_tokens, which cuts continuation and ignore_eos chunks.

    Their extend starts on the grid (every earlier cut was on it), so a cut
    length on the grid is a cut end on the grid.
    """
    length = wrapped(*args, **kwargs)
    remaining = args[1] if len(args) > 1 else kwargs["remaining"]
    if rules_in_force is None or length >= remaining:
        return length
    if _unfinished_chunk_in_batch(instance):
        raise _NoGridCut
    length = chunk_end(0, length, remaining, rules_in_force, wait_for_room=bool(instance.can_run_list))
    if length == 0:
        raise _NoGridCut
    return length


def park_without_grid_cut(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req: the chunked request waits for budget."""
    try:
        return wrapped(*args, **kwargs)
    except _NoGridCut:
        return args[0] if args else kwargs["req"]


def defer_without_grid_cut(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req_ignore_eos: the request waits for budget."""
    try:
        return wrapped(*args, **kwargs)
    except _NoGridCut:
        return _add_req_result().OTHER


def keep_solo_tiles(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req: defer a request that would move a member off its solo tile.

    The candidate's extend is not known before admission, but it is at least
    min(remaining, min_tail) tokens; the batch tile only grows with it, and
    any conflict this bound misses is the candidate's own, which it catches.
    """
    if rules_in_force is None or not instance.can_run_list:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    prompt_len = len(req.full_untruncated_fill_ids)
    start = req.prefix_len + req.host_hit_length
    extend = min(prompt_len - start, rules_in_force.min_tail)
    members = [_member(r) for r in instance.can_run_list] + [(extend, start + extend, prompt_len)]
    if tile_conflicts(members, rules_in_force):
        logger.debug("sglang-chunk-align: deferring %s to keep batch members on their solo tiles", req.rid)
        return _add_req_result().OTHER
    return wrapped(*args, **kwargs)


def _unfinished_chunk_in_batch(adder):
    """SGLang tracks one unfinished chunked request. Stock fills the chunk
    budget with it; the grid rules can leave budget over, for whole requests only."""
    return any(r.extend_end < len(r.full_untruncated_fill_ids) for r in adder.can_run_list)


def _member(req):
    return req.extend_end - req.prefix_len, req.extend_end, len(req.full_untruncated_fill_ids)


def _add_req_result():
    from sglang.srt.managers.schedule_policy import AddReqResult

    return AddReqResult
