"""PrefillAdder and prefix-match wrappers: every chunk on the grid, on its solo tile.

A 128-token chunk alignment alone still lets SGLang start extends off the
grid (radix hits, memory-pressure and ignore_eos cuts), leave tiny final
chunks, and batch requests onto a smaller fa2 tile than their solo prefill.
These wrappers are adapters: each reads SGLang's values, asks one decision
(decisions.py, planning.py) and hands the answer back to stock as one of
stock's own answers, where stock takes it from a function: the memory
budget's available_chunk_tokens and fit_chunk (0.5.21+; fit_chunk's None is
stock's own "wait"), floor_chunked_tokens (0.5.23+); or, where stock reads
rem_chunk_tokens itself, the chunk budget moved for the one stock call
(_stock_with_chunk_budget). Nothing is raised through SGLang's frames, and no
method is overridden on an instance.

How the rules reach them is the one hand-off not visible at a call site:
SGLang builds a new PrefillAdder every step and Req calls match_kv_cache
itself, so no argument can carry the rules. The scheduler's startup check
(scheduler_hooks) calls activate() once per process with the Rules for its
live backend, and patches.remove() calls activate(None) (patch_table.reset);
rules_in_force() is the one reader. While it answers None (no deterministic
flashinfer scheduler, or the rules switched off) every wrapper passes through.

What one wrapper decides for a later call of the same step lives in the
step's one Step (step_of). The one observer point is counting_deferrals: the
harness counts keep_solo_tiles' deferrals there, never by replacing a name here.
"""

import logging
import sys
from contextlib import contextmanager
from dataclasses import replace

from .compat import req_extend_end, req_prefix_len
from .decisions import admission_end, continuation_cut, deferral, ignore_eos_end, riding_slack, short_tail
from .planning import published_len, usable_prefix

logger = logging.getLogger("sglang_chunk_align")

_rules = None  # the Rules this process's scheduler activated, or None: read through rules_in_force()
_step = None  # the Step of the PrefillAdder scheduling now, or None: read through step_of()
_deferrals = None  # reason -> times keep_solo_tiles deferred for it, while counting_deferrals counts; else None


def activate(rules):
    global _rules, _step
    _rules, _step = rules, None


def rules_in_force():
    """The Rules this process's scheduler activated at startup, or None."""
    return _rules


@contextmanager
def counting_deferrals(counts):
    """Within this block, count in `counts` (reason -> times) each deferral keep_solo_tiles makes
    (decisions.deferral's reason): the scheduler driver's count, by reason. Outside one, a
    deferral costs one comparison more."""
    global _deferrals
    outer, _deferrals = _deferrals, counts
    try:
        yield
    finally:
        _deferrals = outer


class Step:
    """The plugin's state for one PrefillAdder's scheduling step: what a wrapper decided for a
    later call of the same step to answer with.

    Its lifetime is one adder's. SGLang makes a PrefillAdder per scheduling
    step, one at a time (each scheduler is a process of its own); the Step is
    made at the first wrapper call on an adder, held in this module alone
    (_step) and replaced at the first call on the next adder, or dropped by
    activate(); holding its adder until then keeps the requests of the last
    batch alive at most until the next step. Fields that answer a stock call
    made inside a wrapped one are set only for that call.

    A plain class with slots (patches.py's import-cost rule).
    """

    __slots__ = ("adder", "rules", "ride_slack", "continuation_tail", "parked", "ignore_eos_cut")

    def __init__(self, adder, rules):
        self.adder = adder  # whose step this is
        self.rules = rules  # the Rules in force when the step began
        # While stock's add_chunked_req runs (continue_on_grid): the riding slack its memory budget's
        # available_chunk_tokens adds (ride_on_budget), and how fit_chunk's cut (fit_on_grid) treats a
        # short final piece (decisions.short_tail); 0 and None outside that call.
        self.ride_slack = 0
        self.continuation_tail = None
        self.parked = False  # the chunked request waits this step for a grid cut (keep_solo_tiles reads it)
        # While stock's add_one_req_ignore_eos runs (0.5.23+): the cut floor_chunked_tokens hands back.
        self.ignore_eos_cut = None


def step_of(adder):
    """The adder's Step, made at the first wrapper call of its step; None while no rules are in force."""
    global _step
    step = _step
    if step is not None and step.adder is adder:
        return step
    if _rules is None:
        return None
    step = _step = Step(adder, _rules)
    return step


def match_on_grid(wrapped, instance, args, kwargs):
    """Wraps match_kv_cache: reuse a cached prefix only up to the grid, leaving a final piece to compute.

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
    """Wraps PrefillAdder._select_prefill_admission: a chunked admission ends where
    decisions.admission_end says, as stock's own admission (OTHER where the request waits)."""
    admission = wrapped(*args, **kwargs)
    step = step_of(instance)
    if step is None or not getattr(admission, "is_chunked", False):
        return admission
    req = args[0] if args else kwargs["req"]
    start, prompt_len = admission.prefix_len, len(req.full_untruncated_fill_ids)
    end = admission_end(
        step.rules, start, admission.extend_len, prompt_len, instance.rem_chunk_tokens,
        bool(instance.can_run_list), _unfinished_chunk_in_batch(instance), _running(instance),
    )
    if end == start:
        return _schedule_policy().AddReqResult.OTHER
    if end == prompt_len:
        max_new_tokens = min(req.sampling_params.max_new_tokens, _schedule_policy().CLIP_MAX_NEW_TOKENS)
        return replace(admission, extend_len=end - start, is_chunked=False, max_new_tokens=max_new_tokens)
    if end - start == admission.extend_len:  # stock's cut is on the grid; replace() costs ~2 µs
        return admission
    return replace(admission, extend_len=end - start)


def continue_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req (0.5.21+): a continuation is cut where
    decisions.continuation_cut says, through its memory budget's answers.

    Stock takes the continuation's chunk from the adder's memory budget:
    available_chunk_tokens(rem_chunk_tokens), which ride_on_budget raises by
    the riding slack decided here (so stock checks KV memory for the whole
    piece), then fit_chunk, whose None makes stock return the request to wait
    (fit_on_grid cuts there). Only add_chunked_req calls them, once each
    (tests/test_release_wheels.py checks each release's source), so the step
    holds what they answer with for this call alone.
    """
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    step.ride_slack, step.continuation_tail = _before_continuation(step.rules, instance, req)
    try:
        return wrapped(*args, **kwargs)
    finally:
        step.ride_slack, step.continuation_tail = 0, None


def ride_on_budget(wrapped, instance, args, kwargs):
    """Wraps the memory budget's available_chunk_tokens (0.5.21+): the chunk a continuation may
    take, with its riding final piece's slack (Step.ride_slack) added to the chunk budget."""
    step = _step
    if step is None or not step.ride_slack:
        return wrapped(*args, **kwargs)
    chunk_limit = args[0] if args else kwargs["chunk_limit"]
    return wrapped(chunk_limit + step.ride_slack)


def fit_on_grid(wrapped, instance, args, kwargs):
    """Wraps the memory budget's fit_chunk (0.5.21+), the last answer on a continuation's chunk
    that can say "wait" (None): decisions.continuation_cut of stock's answer. A request that
    waits so is parked (keep_solo_tiles)."""
    limit = wrapped(*args, **kwargs)
    step = _step
    if step is None or step.continuation_tail is None or limit is None:
        return limit
    cut = continuation_cut(step.rules, limit, kwargs["extend_input_len"], step.continuation_tail)
    step.parked = cut is None
    return cut


def continue_on_grid_by_clamp(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_chunked_req on 0.5.20, which has no memory budget object: the same
    decisions as continue_on_grid, over the clamp stock makes with its chunk budget raised by the
    riding slack (_stock_clamp, read before stock runs); stock then runs with its chunk budget
    moved to the cut.

    0.5.20 hands the cut to req.set_extend_range only: no function of it can
    answer "wait", so a continuation with no grid cut waits here, without
    calling stock. Stock's own wait (hybrid SWA with no room) returns the
    request as well; both come before stock reports to the prefill delayer,
    which then counts the rank not prefillable.
    """
    step = step_of(instance)
    req = args[0] if args else kwargs["req"]
    if step is None or instance.dllm_config is not None:  # dLLM chunks come from rem_dllm_tokens
        return wrapped(*args, **kwargs)
    slack, tail = _before_continuation(step.rules, instance, req)
    budget = instance.rem_chunk_tokens
    limit = _stock_clamp(instance, budget + slack)
    if limit is None:  # stock's own wait
        return wrapped(*args, **kwargs)
    remaining = len(req.full_untruncated_fill_ids) - req_prefix_len(req)
    stock_cut = min(limit, remaining)  # stock's, its chunk budget raised by the slack
    cut = continuation_cut(step.rules, stock_cut, remaining, tail)
    if cut is None:
        step.parked = True
        return req
    return _stock_with_chunk_budget(wrapped, args, kwargs, instance, slack if cut == stock_cut else cut - budget)


def _before_continuation(rules, adder, req):
    """What a continuation's cut depends on besides its chunk, read off the adder before stock cuts
    it: (its riding slack, how a short final piece is handled: decisions.short_tail)."""
    slack = riding_slack(rules, req_prefix_len(req), adder.rem_chunk_tokens, len(req.full_untruncated_fill_ids))
    return slack, short_tail(False, bool(adder.can_run_list), _running(adder))


def _stock_clamp(adder, chunk_budget):
    """The chunk 0.5.20's add_chunked_req gives a continuation with `chunk_budget` as its
    rem_chunk_tokens, read as it reads it (budget, KV memory, the SWA pool), or None where stock
    returns the request to wait: what 0.5.21+ asks its memory budget (available_chunk_tokens).

    A restatement of those stock lines, which hand their answer to no
    function; tests/test_release_wheels.py checks 0.5.20's source has them.
    """
    limit = min(chunk_budget, int(adder.rem_total_tokens))
    if adder.is_hybrid_swa and not adder._swa_req_ring:
        limit = min(limit, int(adder.rem_swa_tokens) - adder.page_size)
    if limit > 0:
        return limit
    return None if adder.is_hybrid_swa else chunk_budget


def ignore_eos_on_grid(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req_ignore_eos on 0.5.23+: its chunk ends where
    decisions.ignore_eos_end says, or it waits. Stock passes the chunk budget through
    floor_chunked_tokens, which hands back the cut decided here (hand_back_ignore_eos_cut)."""
    return _ignore_eos_on_grid(wrapped, instance, args, kwargs, floor_hands_back=True)


def ignore_eos_on_grid_by_chunk_budget(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req_ignore_eos before 0.5.23, which cuts at rem_chunk_tokens
    itself (0.5.22 writes req.extend_end from it; 0.5.20-0.5.21 pass it to Req.set_extend_range,
    which every admission and mixed-in decode calls, and whose Req knows no step): the budget is
    moved to the cut for the stock call."""
    return _ignore_eos_on_grid(wrapped, instance, args, kwargs, floor_hands_back=False)


def _ignore_eos_on_grid(wrapped, instance, args, kwargs, floor_hands_back):
    """An ignore_eos chunk ends on the grid, or the request waits.

    Stock cuts only where the chunk budget is below what is left of the
    prompt, and reports the rank prefillable to the prefill delayer before
    it cuts, so a request the grid leaves no cut for is deferred before
    stock runs at all, never after it has reported. A cut beyond the budget
    (the short final piece rides along) raises the budget for the call:
    stock's "last chunk" test reads rem_chunk_tokens itself. A cut below it
    lowers the budget where floor_chunked_tokens cannot hand it back.
    """
    step = step_of(instance)
    req = args[0] if args else kwargs["req"]
    budget = instance.rem_chunk_tokens
    start, prompt_len = req_prefix_len(req), len(req.full_untruncated_fill_ids)
    if step is None or budget is None or not 0 < budget < prompt_len - start:
        return wrapped(*args, **kwargs)
    end = ignore_eos_end(
        step.rules, start, budget, prompt_len, bool(instance.can_run_list), _unfinished_chunk_in_batch(instance)
    )
    if end == start:
        return _schedule_policy().AddReqResult.OTHER
    cut = end - start
    if cut > budget or not floor_hands_back:
        result = _stock_with_chunk_budget(wrapped, args, kwargs, instance, cut - budget)
        if cut < budget and instance.can_run_list and instance.can_run_list[-1] is req:
            return instance.budget_state()  # what stock returns after admitting, read off the real budget
        return result
    step.ignore_eos_cut = cut
    try:
        return wrapped(*args, **kwargs)
    finally:
        step.ignore_eos_cut = None


def hand_back_ignore_eos_cut(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.floor_chunked_tokens (0.5.23+): an ignore_eos chunk is cut where
    ignore_eos_on_grid decided (Step.ignore_eos_cut), through stock's own flooring.

    Continuation cuts pass through: fit_on_grid has put them on the grid.
    Stock moves a cut here only under DCP with the mamba extra buffer, down
    onto the mamba kernel grid: a grid cut stays on the grid there where one
    grid divides the other.
    """
    step = _step
    if step is None or step.ignore_eos_cut is None:
        return wrapped(*args, **kwargs)
    return wrapped(step.ignore_eos_cut, args[1] if len(args) > 1 else kwargs["remaining"])


def _stock_with_chunk_budget(wrapped, args, kwargs, adder, tokens):
    """Run stock with the chunk budget moved by `tokens`, where stock reads rem_chunk_tokens itself
    and no function of it carries the answer: raised where a request's short final piece rides
    along (the request alone in the batch, e.g. chunk 128 at group 1), for an ignore_eos
    request's "last chunk" test and for a 0.5.20 continuation's clamp; lowered to a cut decided
    before stock (ignore_eos before 0.5.23, a 0.5.20 continuation).

    What stock charges stays charged when the move is undone. A riding piece
    is still bounded by the KV memory stock has, and stock charges the whole
    extend, so the budget ends below zero and the batch closes. A plain
    function, not a context manager: one costs ~1.3 µs.
    """
    if not tokens:
        return wrapped(*args, **kwargs)
    adder.rem_chunk_tokens += tokens
    try:
        return wrapped(*args, **kwargs)
    finally:
        adder.rem_chunk_tokens -= tokens


def keep_solo_tiles(wrapped, instance, args, kwargs):
    """Wraps PrefillAdder.add_one_req: a new request waits where decisions.deferral says (behind a
    chunked request parked this step, or to keep batch members on their solo tiles)."""
    step = step_of(instance)
    if step is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]
    start = req_prefix_len(req) + req.host_hit_length
    members = [_member(r) for r in instance.can_run_list]
    reason = deferral(step.rules, step.parked, members, start, len(req.full_untruncated_fill_ids))
    if reason is None:
        return wrapped(*args, **kwargs)
    if _deferrals is not None:
        _deferrals[reason] = _deferrals.get(reason, 0) + 1
    logger.debug("sglang-chunk-align: deferring %s %s", req.rid, reason)
    return _schedule_policy().AddReqResult.OTHER


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


def _running(adder):
    """Decoding requests will finish and free KV memory; a piece that waits for it gets it."""
    return adder.running_batch is not None and bool(adder.running_batch.reqs)


def _unfinished_chunk_in_batch(adder):
    """Whether the batch holds SGLang's one unfinished chunked request."""
    return any(req_extend_end(r) < len(r.full_untruncated_fill_ids) for r in adder.can_run_list)


def _member(req):
    end = req_extend_end(req)
    return end - req_prefix_len(req), end, len(req.full_untruncated_fill_ids)


def _schedule_policy():
    """SGLang's schedule_policy, which every PrefillAdder wrapper runs inside, so it is loaded:
    looking it up costs ~50 ns, an import statement in a function ~1 µs."""
    return sys.modules["sglang.srt.managers.schedule_policy"]
