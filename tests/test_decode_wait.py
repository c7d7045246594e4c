"""decode_wait.py: decoding requests wait at most DECODE_WAIT_S behind prefill chunks.

The decision is checked against a model of what it promises, over generated step
sequences; the wrapper on SGLang's own Scheduler._should_defer_prefill is
checked differentially against stock where it must step aside (the user's
--prefill-decode-interval, or no wait active); the startup decision by its
switch and the release.
"""

from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import sglang_chunk_align
from sglang_chunk_align import decode_wait, releases, scheduler_hooks
from sglang_chunk_align.compat import DECODE_WAIT_ENV, sglang_at_least
from sglang_chunk_align.decode_wait import DecodeWait

needs_decode_wait = pytest.mark.skipif(
    not sglang_at_least(releases.DECODE_WAIT),
    reason=f"Scheduler._should_defer_prefill sees the running batch from SGLang {releases.DECODE_WAIT}",
)
LIMIT = 0.1
LIMIT_MS = 100
# One scheduling step: (its duration in ms, a prefill is waiting, the running batch can decode);
# mostly both, so that queues of chunk steps behind a decoding batch outlast the limit.
MOSTLY = st.sampled_from([True] * 7 + [False])
STEPS = st.lists(st.tuples(st.integers(0, 50), MOSTLY, MOSTLY), min_size=20, max_size=80)


def schedule(steps):
    """Steps as Scheduler.get_next_batch_to_run takes them, with the wait asked first each step
    (whole milliseconds, so the clock is exact): [(start ms, duration, kind, decode_first's
    answer, can decode)], kind "decode", "prefill" or "idle"."""
    wait, now, last, run = DecodeWait(LIMIT_MS), 0, None, []
    for duration, prefill_waiting, can_decode in steps:
        first = wait.decode_first(last == "prefill", can_decode, now)
        last = "decode" if first or (can_decode and not prefill_waiting) else "prefill" if prefill_waiting else "idle"
        run.append((now, duration, last, first, can_decode))
        now += duration
    return run


@example([(30, True, True)] * 12)  # a queue of chunk steps behind a decoding batch
@given(STEPS)
def test_decoding_requests_wait_at_most_the_limit_and_one_step(steps):
    """The module's promises, seen from outside: while the running batch can decode, no more than
    the limit and one step pass between two decode steps; a step is put before prefill only where
    something can decode, never twice in a row (the scheduler cannot stall), and at most once per
    limit of prefill time."""
    run = schedule(steps)
    longest = max((duration for _, duration, _, _, _ in run), default=0)
    waiting_from = None  # since when the running batch has waited for a decode step
    for (start, duration, kind, first, can_decode), before in zip(run, [None, *run]):
        if first:
            assert can_decode and before is not None and not before[3]
        if not can_decode:
            waiting_from = None
            continue
        waiting_from = start if waiting_from is None else waiting_from
        assert start - waiting_from <= LIMIT_MS + longest, (start, waiting_from)
        if kind == "decode":
            waiting_from = start + duration
    prefill_ms = sum(duration for _, duration, kind, _, _ in run if kind == "prefill")
    assert sum(first for *_, first, _ in run) * LIMIT_MS <= prefill_ms


def test_a_queue_of_chunks_is_broken_by_one_decode_each_limit():
    """Chunk steps of 30 ms behind a decoding batch: a decode every fourth step (after 0.12 s)."""
    wait, now, order, last_was_extend = DecodeWait(LIMIT), 0.0, [], False
    for _ in range(12):
        decode = wait.decode_first(last_was_extend, True, now)
        order.append("D" if decode else "P")
        last_was_extend = not decode
        now += 0.03
    assert "".join(order) == "PPPPDPPPPDPP"


def bare_scheduler(interval=0, remaining=0, last_forward=None):
    """SGLang's own Scheduler, with only what _should_defer_prefill reads (it needs no GPU)."""
    from sglang.srt.managers.scheduler import Scheduler

    scheduler = object.__new__(Scheduler)
    scheduler.prefill_decode_interval = interval
    scheduler._prefill_decode_interval_remaining = remaining
    scheduler.prefill_decode_interval_min_bs = 0
    scheduler.last_batch = None if last_forward is None else SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: last_forward == "extend"))
    return scheduler


def running(size):
    return SimpleNamespace(is_empty=lambda: size == 0, is_prefill_only=False, batch_size=lambda: size)


@needs_decode_wait
@pytest.mark.parametrize("remaining", [0, 2])
@pytest.mark.parametrize("active", [False, True])
def test_stock_decides_where_the_user_set_an_interval_or_no_wait_is_active(remaining, active):
    """--prefill-decode-interval set, or no wait activated (unarmed, switch off): stock's answer,
    and stock's count of remaining decode rounds, exactly."""
    from sglang.srt.managers.scheduler import Scheduler

    interval = 2 if active else 0
    stock = bare_scheduler(interval, remaining, "extend")
    expected = Scheduler._should_defer_prefill(stock, running(4))
    sglang_chunk_align.apply()
    decode_wait.activate(DecodeWait(0.0) if active else None)
    patched = bare_scheduler(interval, remaining, "extend")
    assert patched._should_defer_prefill(running(4)) is expected
    assert patched._prefill_decode_interval_remaining == stock._prefill_decode_interval_remaining


@needs_decode_wait
def test_the_patched_scheduler_decodes_after_the_limit_and_stock_never_does():
    """The same three prefill steps behind a decoding batch: stock always prefills; with the wait,
    the step after the limit decodes, and nothing decodes with no running request."""
    from sglang.srt.managers.scheduler import Scheduler

    clock = iter([0.0, 0.05, 0.11, 0.2])
    stock = [Scheduler._should_defer_prefill(bare_scheduler(0, 0, "extend"), running(8)) for _ in range(3)]
    sglang_chunk_align.apply()
    decode_wait.activate(DecodeWait(LIMIT))
    scheduler = bare_scheduler(0, 0, "extend")
    with mock.patch.object(decode_wait.time, "monotonic", lambda: next(clock)):
        patched = [scheduler._should_defer_prefill(running(8)) for _ in range(3)]
        assert scheduler._should_defer_prefill(running(0)) is False
    assert stock == [False] * 3 and patched == [False, False, True]


@needs_decode_wait
def test_remove_clears_the_wait_and_restores_stock():
    from sglang.srt.managers.scheduler import Scheduler

    original = Scheduler.__dict__["_should_defer_prefill"]
    sglang_chunk_align.apply()
    decode_wait.activate(DecodeWait(LIMIT))
    sglang_chunk_align.remove()
    assert decode_wait._wait is None and Scheduler.__dict__["_should_defer_prefill"] is original


@pytest.mark.parametrize(
    "switch, interval, mlp_sync, active, words",
    [
        (None, 0, False, False, f"stock's order; {DECODE_WAIT_ENV}=1 bounds the wait"),  # the default: off
        ("1", 0, False, True, "decode waits at most 100 ms behind prefill chunks"),
        ("0", 0, False, False, f"stock's order; {DECODE_WAIT_ENV}=1 bounds the wait"),
        ("1", 3, False, False, "--prefill-decode-interval 3"),
        ("1", 0, True, False, "DP attention"),
    ],
)
def test_the_startup_decision_and_its_words(monkeypatch, switch, interval, mlp_sync, active, words):
    if switch is None:
        monkeypatch.delenv(DECODE_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(DECODE_WAIT_ENV, switch)
    scheduler = SimpleNamespace(prefill_decode_interval=interval, require_mlp_sync=mlp_sync)
    wait, note = scheduler_hooks._decode_wait(scheduler)
    if not sglang_at_least(releases.DECODE_WAIT) and switch == "1" and not interval:
        assert wait is None and f"needs SGLang {releases.DECODE_WAIT}" in note
        return
    assert (wait is not None) is active and words in note
    if active:
        assert wait.limit_s == decode_wait.DECODE_WAIT_S
