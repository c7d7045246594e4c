"""How long decoding requests may wait behind prefill chunks: DECODE_WAIT_S at most.

SGLang runs a waiting prefill before decode, every step. With small chunks a
long prompt becomes a queue of chunk steps, and every decoding request waits
for the whole queue: 3 s at chunk 256 on RL rollout groups (H200,
benchmarks/serving.py). SGLang's --prefill-decode-interval N bounds the wait
by counting steps, but it runs N decode steps after *every* prefill step, and
on RL rollouts, where every request arrives at once, that cost 1.5x the
rollout's wall time.

This bounds the wait in time instead: prefill steps run back to back until
decoding requests have waited DECODE_WAIT_S, then one decode step runs. A gap
between two tokens is then at most DECODE_WAIT_S plus one chunk step, and the
decode steps it adds are one per DECODE_WAIT_S of prefill, a few per rollout.

It only chooses which of stock's two steps runs next, as the interval does, so
every request's bits are what they would be anyway: prefill batches still pass
the grid rules, and deterministic decode does not depend on its batch.
Where the user set --prefill-decode-interval, SGLang's interval decides alone.

It is off by default (SGLANG_CHUNK_ALIGN_DECODE_WAIT=1 turns it on): measured
against its control, it costs more rollout throughput than the 3% a default
may cost (MEASURED).
"""

import time

DECODE_WAIT_S = 0.1
# Why the wait is not the default: benchmarks/serving.py's decode_wait_verdict, in
# benchmarks/logs/serving_h200_granite/serving.json (3 rounds each, medians).
MEASURED = ("on Granite-3.1-8B's shape (H200) it cost 3.8% of RL rollout throughput and 2.1% on agents, "
            "while it held the longest inter-token gap to 0.35 s (rollouts) and 0.15 s (agents), against "
            "3.8 s and 1.0 s without it")


class DecodeWait:
    """The wait of this scheduler's decoding requests. One per scheduler process, activated at
    startup and cleared by patches.remove(); the scheduler calls it once per step."""

    __slots__ = ("limit_s", "since")

    def __init__(self, limit_s):
        self.limit_s = limit_s
        self.since = None  # when the running batch last decoded, or began to wait

    def decode_first(self, last_step_was_extend, can_decode, now):
        """Whether this step must decode rather than prefill.

        Only a prefill step makes decoding requests wait: after a decode step, an
        idle step or with nothing to decode, the wait starts over. So a step this
        answers True for is followed by a decode or an idle step, never by another
        deferral: the scheduler cannot stall on it.
        """
        if not (can_decode and last_step_was_extend) or self.since is None:
            self.since = now
            return False
        return now - self.since >= self.limit_s


_wait = None  # the DecodeWait this process's scheduler activated, or None


def activate(wait):
    global _wait
    _wait = wait


def bound_decode_wait(wrapped, instance, args, kwargs):
    """Wraps Scheduler._should_defer_prefill(running_batch) (0.5.23): stock's answer (the
    --prefill-decode-interval) stands where the user set one, or where no wait is active."""
    if _wait is None or instance.prefill_decode_interval:
        return wrapped(*args, **kwargs)
    running_batch = kwargs.get("running_batch", args[0] if args else None)
    last = instance.last_batch
    return _wait.decode_first(
        last_step_was_extend=last is not None and last.forward_mode.is_extend(),
        can_decode=not running_batch.is_empty() and not running_batch.is_prefill_only,
        now=time.monotonic(),
    )
