"""PrefillAdder and prefix-match wrappers: every chunk on the grid, on its solo tile.

A 128-token chunk alignment alone still lets SGLang start extends off the
grid (radix hits, memory-pressure and ignore_eos cuts), leave tiny final
chunks, and batch requests onto a smaller fa2 tile than their solo prefill.
These wrappers apply planning.py's rules inside SGLang's own admission
paths.

How the rules reach them is the one hand-off not visible at a call site:
SGLang builds a new PrefillAdder every step and Req calls match_kv_cache
itself, so no argument can carry the rules. The scheduler's startup check
(scheduler_hooks) calls activate() once per process with the Rules for its
live backend, and patches.remove() calls activate(None); rules_in_force() is
the one reader. While it answers None (no deterministic flashinfer
scheduler, or the rules switched off) every wrapper passes through.

Within a scheduling step the PrefillAdder wrappers share one explicit state
object, the adder's Step (step_of): the rules in force for that step, the
chunked request that waits this step, and the cut an ignore_eos admission
decided. Nothing else is kept on SGLang's objects.
"""

import logging
import sys
from dataclasses import replace

from .compat import req_extend_end, req_prefix_len
from .planning import KEEP, RIDE, WAIT, chunk_end, published_len, tile_conflicts, usable_prefix

logger = logging.getLogger("sglang_chunk_align")

_rules = None  # the Rules this process's scheduler activated, or None: read through rules_in_force()


def activate(rules):
    global _rules
    _rules = rules


def rules_in_force():
    """The Rules this process's scheduler activated at startup, or None."""
    return _rules


class Step:
    """The plugin's state for one scheduling step, kept on that step's PrefillAdder (one per step).

    A plain class with slots: the methods a dataclass generates cost every
    process that loads plugins time at import (~1 ms for PatchPoint's, commit 304b862).
    """

    __slots__ = ("rules", "parked", "ignore_eos_cut")

    def __init__(self, rules):
        self.rules = rules  # the Rules in force when the step began
        self.parked = None  # the chunked request that waits this step (continue_on_grid)
        # The cut length ignore_eos_on_grid decided, for floor_chunked_tokens to hand back (0.5.23+).
        self.ignore_eos_cut = None


_STEP = "_sglang_chunk_align_step"  # the PrefillAdder attribute that holds its Step


def step_of(adder):
    """The adder's Step, made at the first wrapper call of its step; None while no rules are in force."""
    step = adder.__dict__.get(_STEP)
    if step is None:
        rules = rules_in_force()
        if rules is not None:
            step = adder.__dict__[_STEP] = Step(rules)
    return step


class _NoGridCut(Exception):
    """The budget holds no grid-aligned cut, where stock offers no result that says "wait"
    (floor_chunked_tokens, req.set_extend_range): raised through stock's add_chunked_req and
    caught by continue_on_grid around it, before stock has charged anything."""


def match_on_grid(wrapped, instance, args, kwargs):
    """Wraps match_kv_cache: reuse a cached prefix only up to the grid, leaving min_tail to compute.

    A rounded hit is matched a second time with max_prefix_len: SGLang's
    match only caps a hit, and the second match splits the tree node at the
    rounded end, so req.last_node and the lock describe the prefix in use.
    """
    result = wrapped(*args, **kwargs)
    rules = rules_in_force()
    if rules is None:
        return result
    req = args[0]
    matched = req.prefix_len + req.host_hit_length
    if matched == 0:  # nothing to round (every request, while the radix cache is off)
        return result
    usable = usable_prefix(matched, len(req.full_untruncated_fill_ids), rules)
    if usable == matched:
        return result
    return wrapped(*args, **{**kwargs, "max_prefix_len": usable})


def admit_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder._select_prefill_admission: cut a chunked admission on the grid.

    A short final piece rides with a request's first extend only when the
    chunk budget alone cut it: add_one_req has checked KV memory for the
    whole prompt, and the admission is then a whole one (not chunked).
    """
    admission = wrapped(*args, **kwargs)
    step = step_of(instance)
    if step is None or not getattr(admission, "is_chunked", False):
        return admission
    if _unfinished_chunk_in_batch(instance):
        return _schedule_policy().AddReqResult.OTHER
    req = args[0] if args else kwargs["req"]
    start = admission.prefix_len
    prompt_len = len(req.full_untruncated_fill_ids)
    may_ride = not instance.can_run_list and admission.extend_len >= instance.rem_chunk_tokens
    end = _grid_cut(step, instance, start, admission.extend_len, prompt_len, may_ride)
    if end == start:
        return _schedule_policy().AddReqResult.OTHER
    if end == prompt_len:
        max_new_tokens = min(req.sampling_params.max_new_tokens, _schedule_policy().CLIP_MAX_NEW_TOKENS)
        return replace(admission, extend_len=end - start, is_chunked=False, max_new_tokens=max_new_tokens)
    if end - start == admission.extend_len:  # stock's cut is on the grid; replace() costs ~2 µs
        return admission
    return replace(admission, extend_len=end - start)


def cut_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.floor_chunked_tokens (0.5.23+), which rounds continuation cuts (and
    ignore_eos cuts, which ignore_eos_on_grid has put on the grid already).

    Their extend starts on the grid (every earlier cut was on it), so a cut
    length on the grid is a cut end on the grid. It never lengthens a cut:
    its callers decide "chunked" before they call it, so a final piece that
    rides along is given room by raising their budget (_stock_with_chunk_budget).
    An ignore_eos cut was decided before stock ran (ignore_eos_on_grid): it
    is handed back as decided, unless stock's own flooring moved it.
    """
    length = wrapped(*args, **kwargs)
    step = step_of(instance)
    if step is None:
        return length
    if step.ignore_eos_cut is not None and length == step.ignore_eos_cut:
        return length
    remaining = args[1] if len(args) > 1 else kwargs["remaining"]
    cut = _continuation_cut(step, instance, length, remaining)
    if cut is None:
        raise _NoGridCut  # stock's add_chunked_req has no "wait" answer from here
    return cut


def _continuation_cut(step, adder, length, remaining):
    """A continuation's cut `length` of `remaining` tokens, on the grid; None where the budget
    holds no grid cut, and the request must wait."""
    if length >= remaining:
        return length
    if _unfinished_chunk_in_batch(adder):
        return None
    return _grid_cut(step, adder, 0, length, remaining) or None


def continue_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req: the chunked request waits for budget, or its short
    final piece rides with this chunk.

    A waiting (parked) chunked request admits no new request behind it this
    step (keep_solo_tiles reads step.parked): they would take the KV memory it
    waits for, and SGLang tracks one chunked request only. It waits the way
    stock's own add_chunked_req does when nothing fits: it returns the request.
    """
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    try:
        return _stock_with_chunk_budget(wrapped, args, kwargs, instance, _ride_slack(step, instance, req))
    except _NoGridCut:
        step.parked = req
        return req


def continue_on_grid_by_budget(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req on 0.5.21-0.5.22, which have no floor_chunked_tokens:
    as continue_on_grid, with the cut taken where stock takes it from.

    Stock cuts a continuation at what the adder's memory budget fits
    (memory_budget.fit_chunk, which only add_chunked_req calls), so for this
    call that budget, the adder's own for this step, answers on the grid.
    Where it holds no grid cut the answer is fit_chunk's own "nothing fits"
    (None), on which stock returns the request to wait.
    """
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    budget, req = instance.memory_budget, args[0] if args else kwargs["req"]
    fit_chunk = budget.fit_chunk

    def fit_on_grid(*, extend_input_len, **limits):
        limit = fit_chunk(extend_input_len=extend_input_len, **limits)
        if limit is None:
            return None
        cut = _continuation_cut(step, instance, limit, extend_input_len)
        if cut is None:
            step.parked = req
        return cut

    return _continue_with_override(budget, "fit_chunk", fit_on_grid, wrapped, instance, args, kwargs)


def continue_on_grid_by_extend(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req on 0.5.20, which has no memory budget object either:
    stock clamps the continuation itself and hands its end to req.set_extend_range before
    charging the budget, so for this call that sets the end on the grid.
    """
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    set_extend_range = req.set_extend_range
    prompt_len = len(req.full_untruncated_fill_ids)

    def extend_on_grid(start, end):
        cut = _continuation_cut(step, instance, end - start, prompt_len - start)
        if cut is None:
            raise _NoGridCut  # stock has no "wait" answer once it sets the range
        set_extend_range(start, start + cut)

    return _continue_with_override(req, "set_extend_range", extend_on_grid, wrapped, instance, args, kwargs)


def _continue_with_override(owner, method, override, wrapped, instance, args, kwargs):
    """continue_on_grid with owner.<method> answered by `override` for the one stock call: an
    instance attribute over the class's method, removed again after it. The class itself is
    never touched. Stock takes no parameter for it. wrapt's transient_function_wrapper does the
    same, but the wrapt releases setup.cfg admits (2.1, for one) restore with setattr, which
    leaves the bound method behind as an instance attribute."""
    setattr(owner, method, override)
    try:
        return continue_on_grid(wrapped, instance, args, kwargs)
    finally:
        delattr(owner, method)


def ignore_eos_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req_ignore_eos: its chunk ends on the grid, or it waits.

    Stock cuts an ignore_eos chunk at the chunk budget (0.5.23 passes it
    through floor_chunked_tokens, older releases take it as it is), so for
    this call the budget is lowered to the grid cut, or raised where the short
    final piece rides along. Stock reports the rank prefillable to the prefill
    delayer before it cuts the chunk, so a request the grid leaves no cut for
    is deferred before stock runs at all, never after it has reported.
    The cut is decided here once; on 0.5.23+ stock passes the lowered budget
    through floor_chunked_tokens, which hands it back from the step (cut_on_grid).
    """
    step = step_of(instance)
    req = args[0] if args else kwargs["req"]
    budget = instance.rem_chunk_tokens
    start, prompt_len = req_prefix_len(req), len(req.full_untruncated_fill_ids)
    if step is None or budget is None or not 0 < budget < prompt_len - start:
        return wrapped(*args, **kwargs)
    if _unfinished_chunk_in_batch(instance):
        return _schedule_policy().AddReqResult.OTHER
    end = _grid_cut(step, instance, start, budget, prompt_len, may_ride=not instance.can_run_list, warn=False)
    if end == start:
        return _schedule_policy().AddReqResult.OTHER
    step.ignore_eos_cut = end - start
    try:
        result = _stock_with_chunk_budget(wrapped, args, kwargs, instance, end - start - budget)
    finally:
        step.ignore_eos_cut = None
    if instance.can_run_list and instance.can_run_list[-1] is req:
        return instance.budget_state()  # what stock returns after admitting, read off the real budget
    return result


def _stock_with_chunk_budget(wrapped, args, kwargs, adder, tokens):
    """Run stock with the chunk budget moved by `tokens`: raised by _ride_slack when a request's
    short final piece should ride along (the request alone in the batch, e.g. chunk 128 at
    group 1), so stock admits it whole; lowered to an ignore_eos request's grid cut.

    Stock offers no other route: its "last chunk" decision, its chunk limits
    and (before 0.5.23) the cut itself all read rem_chunk_tokens.
    What stock charges stays charged when the move is undone. A riding piece
    is still bounded by the KV memory stock has, and stock charges the whole
    extend, so the budget ends below zero and the batch closes. A plain
    function, not a context manager: one costs ~1.3 µs, on every continuation.
    """
    if not tokens:
        return wrapped(*args, **kwargs)
    adder.rem_chunk_tokens += tokens
    try:
        return wrapped(*args, **kwargs)
    finally:
        adder.rem_chunk_tokens -= tokens


def _ride_slack(step, adder, req):
    """Tokens beyond the chunk budget that `req`'s riding final piece needs, or 0.

    Only a piece shorter than min_tail rides, so chunk_end is asked only when
    less than that lies beyond the budget (most continuations skip it).
    """
    if adder.rem_chunk_tokens is None or adder.can_run_list:
        return 0
    start, prompt_len, budget = req_prefix_len(req), len(req.full_untruncated_fill_ids), adder.rem_chunk_tokens
    beyond = prompt_len - start - budget
    if 0 < beyond < step.rules.min_tail and chunk_end(start, budget, prompt_len, step.rules, RIDE) == prompt_len:
        return beyond
    return 0


def keep_solo_tiles(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req: defer a request that would move a member off its solo tile,
    and every request behind a chunked request parked this step (continue_on_grid).

    The candidate's extend is not known before admission, but it is at least
    min(remaining, min_tail) tokens; the batch tile only grows with it, and
    any conflict this bound misses is the candidate's own, which it catches.
    Its KV is taken as its whole prompt, so that the short-KV exemption
    never excuses it on the strength of that lower bound.
    """
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    if step.parked is not None:
        return _schedule_policy().AddReqResult.OTHER
    if not instance.can_run_list:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    prompt_len = len(req.full_untruncated_fill_ids)
    start = req_prefix_len(req) + req.host_hit_length
    extend = min(prompt_len - start, step.rules.min_tail)
    members = [_member(r) for r in instance.can_run_list] + [(extend, prompt_len, prompt_len)]
    if tile_conflicts(members, step.rules):
        logger.debug("sglang-chunk-align: deferring %s to keep batch members on their solo tiles", req.rid)
        return _schedule_policy().AddReqResult.OTHER
    return wrapped(*args, **kwargs)


def publish_full_tiles(wrapped, instance, args, kwargs):
    """Wraps UnifiedRadixCache.checkpoint: the tree takes a request's KV only as far as prefill
    reproduces it (planning.published_len: on flashinfer 0.7.2 up to the last q-tile step of
    its prompt).

    The rows after it were computed in a partial q-tile, and a longer
    prompt's solo prefill computes them in a full one: measured on an H200
    with 0.7.2, some differ; generated tokens' KV comes from decode steps,
    whose rows no prefill reproduces (tests/gpu/README.md, "Kernel facts"). Stock would
    publish both, and once in the tree they are served even to a request that
    recomputed that span itself, because an insert keeps the tree's first copy.
    release_kv_cache frees what the tree does not take, as for any checkpoint.
    """
    rules = rules_in_force()
    if rules is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    reproduced = published_len(kwargs["up_to"], len(req.origin_input_ids), rules)
    up_to = max(reproduced, req.kv.cache_protected_len)
    return wrapped(*args, **{**kwargs, "up_to": up_to})


def _grid_cut(step, adder, start, budget, prompt_len, may_ride=False, warn=True):
    """chunk_end for an extend the adder cuts at `budget`, with the short-tail handling the
    adder's state allows: ride where the chunk budget alone cut a request that is alone in the
    batch (its caller makes room); otherwise wait where other requests left the budget over or
    running requests will free KV memory; keep the short piece only where nothing will free any,
    because waiting there would be forever. That last case is not bit-exact, and says so.
    """
    if may_ride:
        short_tail = RIDE
    elif adder.can_run_list or _running_requests_hold_kv(adder):
        short_tail = WAIT
    else:
        short_tail = KEEP
    end = chunk_end(start, budget, prompt_len, step.rules, short_tail)
    if warn and short_tail == KEEP and 0 < prompt_len - end < step.rules.min_tail:
        logger.warning(
            "sglang-chunk-align: KV memory holds %d tokens, too few for the final %d of a prompt "
            "with no running request to free more: its %d-token final piece runs on a smaller fa2 "
            "tile than its solo prefill (not bit-exact). Give the KV cache more memory "
            "(--mem-fraction-static) to avoid this.",
            budget, prompt_len - start, prompt_len - end,
        )
    return end


def _running_requests_hold_kv(adder):
    """Decoding requests will finish and free KV memory; a piece that waits for it gets it."""
    return adder.running_batch is not None and bool(adder.running_batch.reqs)


def _unfinished_chunk_in_batch(adder):
    """SGLang tracks one unfinished chunked request. Stock fills the chunk
    budget with it; the grid rules can leave budget over, for whole requests only."""
    return any(req_extend_end(r) < len(r.full_untruncated_fill_ids) for r in adder.can_run_list)


def _member(req):
    end = req_extend_end(req)
    return end - req_prefix_len(req), end, len(req.full_untruncated_fill_ids)


def _schedule_policy():
    """SGLang's schedule_policy, which every PrefillAdder wrapper runs inside, so it is loaded:
    looking it up costs ~50 ns, an import statement in a function ~1 µs."""
    return sys.modules["sglang.srt.managers.schedule_policy"]
