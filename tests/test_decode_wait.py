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
from hypothesis import given
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
# One scheduling step: (seconds since the last call, the last step was a prefill, something can decode).
STEPS = st.lists(st.tuples(st.floats(0, 0.3), st.booleans(), st.booleans()), max_size=60)


@given(STEPS)
def test_decode_runs_once_decoding_requests_waited_the_limit_behind_prefill(steps):
    """The promise, step by step: decode first exactly when decoding requests have waited the limit
    behind back-to-back prefill steps; never right after a decode or idle step, so a deferral is
    never followed by another."""
    wait, now, waiting_since = DecodeWait(LIMIT), 0.0, None
    for elapsed, last_was_extend, can_decode in steps:
        now += elapsed
        waiting = can_decode and last_was_extend and waiting_since is not None
        assert wait.decode_first(last_was_extend, can_decode, now) is (waiting and now - waiting_since >= LIMIT)
        waiting_since = waiting_since if waiting else now


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
