"""The in-process check: `verify`'s workloads and comparison against an `sglang.Engine`, without HTTP.

RL frameworks host SGLang in process (an `sglang.Engine` inside a Ray actor,
say), where `verify`, which talks to HTTP servers, cannot reach it.
`verify_engine` sends an Engine the same prompts in the same two passes (one
request at a time, then `concurrency` in flight, each after a cache flush)
and compares every request's input logprobs and greedy tokens, bit for bit,
with the reference's cold answers recorded in a file. One GPU is enough:
the reference records its answers once, and need not run while the Engine
under test does.

    # Once, on a reference Engine: stock SGLang (SGLANG_PLUGINS=none set before
    # it starts), chunked prefill off (chunked_prefill_size=-1):
    verify_engine(reference, record="reference.json", radix=False)
    # Then on the deployment's Engine (after reference.shutdown(), or in another process):
    report = verify_engine(engine, recorded="reference.json")
    assert report["ok"], report["problems"]

The report is `verify --json`'s. A recording run checks the reference
against itself (each request alone and cold), as `verify --baseline-cache FILE`
does for a server with no --reference; a recorded file can also come from
`verify --reference URL --baseline-cache FILE --input-ids --vocab-size N` with
the same seed, prompts and max_new_tokens (the prompts are token ids below the
model's vocab size). A request the file lacks is an error, and a follow-up
chat turn built on an answer that differed is reported as not recorded.

The Engine's event loop: `Engine.generate` runs `engine.loop` until each
answer arrives; here that loop runs in a thread of its own for the whole check,
so that requests are in flight together as on a server, and it is stopped
afterwards. Call it where you would call `engine.generate`, never from a
coroutine on that loop. Like verify, it flushes the Engine's cache: run it
where no rollout is in flight. Standard library only: it reaches the Engine
through `loop`, `async_generate` and its tokenizer manager (`flush_cache`, the
model config's vocab size), which every supported SGLang release has.
"""

import argparse
import asyncio
import concurrent.futures
import threading

from . import verify

# How long the loop runs on at the end for the requests given up on to end their cancellation.
CANCEL_WAIT_S = 10


def verify_engine(engine, *, recorded=None, record=None, radix=True, workload="all", prompts=verify.PROMPTS,
                  concurrency=verify.CONCURRENCY, seed=0, max_new_tokens=verify.MAX_NEW_TOKENS,
                  timeout=verify.TIMEOUT_S):
    """Check `engine` bit for bit; the report as a dict (its "ok" says whether every request was identical).

    recorded: a file of the reference's cold answers to check against (chunked vs unchunked);
    record: a file to record this Engine's own cold answers in, as the reference for later checks;
    neither: the Engine against its own cold, solo answers (concurrency and cache hits only).
    radix=False: the Engine runs without a radix cache (stock deterministic flashinfer, a reference),
    so chat turns need not hit it. Raises verify.ServerError where the Engine cannot answer or a file
    cannot be read, and ValueError for options that do not go together.
    """
    if recorded and record:
        raise ValueError("recorded= is the reference's answers to check against, record= writes this Engine's: "
                         "give one of them")
    if record:
        try:
            verify.file_to_write(record)  # refused now, not after every request was sent
        except argparse.ArgumentTypeError as error:
            raise ValueError(f"record={error}") from None
    if workload != "all" and workload not in verify.WORKLOADS:
        raise ValueError(f"workload {workload!r}: one of {', '.join(verify.WORKLOADS)} or 'all'")
    args = argparse.Namespace(
        reference=None, recorded=recorded, baseline_cache=record, no_radix=not radix, workload=workload,
        prompts=prompts, concurrency=concurrency, seed=seed, max_new_tokens=max_new_tokens,
    )
    with EngineServer(engine, timeout) as server:
        baseline = verify.Recorded(recorded) if recorded else server
        tokens = verify.TokenIds(engine.tokenizer_manager.model_config.vocab_size)
        return verify.check(server, baseline, tokens, args, verify.Progress(enabled=False))


class EngineServer:
    """An in-process Engine answering as verify.Server does: generate(), flush(), url; while entered,
    the Engine's event loop runs in a thread of its own, and each call waits at most `timeout` seconds."""

    def __init__(self, engine, timeout):
        self.engine = engine
        self.timeout = timeout
        self.url = f"sglang.Engine({engine.tokenizer_manager.model_path})"

    def __enter__(self):
        loop = self.engine.loop
        if loop.is_running():
            raise RuntimeError("verify_engine: the Engine's event loop is running already; call it where you would "
                               "call engine.generate, not from a coroutine on that loop")
        self.tasks = set()  # the calls' tasks still running, touched on the loop only
        self.thread = threading.Thread(target=loop.run_forever, name="verify_engine loop", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        """Stop the loop once the calls given up on have ended their cancellation (for CANCEL_WAIT_S at
        most): a task stopped mid-cancellation stays pending, and asyncio reports it at exit ("Task was
        destroyed but it is pending!")."""
        loop = self.engine.loop

        async def settle():
            if self.tasks:
                await asyncio.wait(self.tasks, timeout=CANCEL_WAIT_S)

        asyncio.run_coroutine_threadsafe(settle(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        self.thread.join()

    async def _tracked(self, coroutine):
        """`coroutine` in a task the exit waits for."""
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            return await coroutine
        finally:
            self.tasks.discard(task)

    def _await(self, what, coroutine):
        """The coroutine's result, run on the Engine's loop; a ServerError naming `what` where it raises or
        outlasts the timeout (then it is cancelled), so that no request is left waiting forever."""
        future = asyncio.run_coroutine_threadsafe(self._tracked(coroutine), self.engine.loop)
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise verify.ServerError(f"{self.url} {what}: no answer in {self.timeout:g} s") from None
        except Exception as error:  # the Engine's own refusal of a request, say; reported, not raised as is
            raise verify.ServerError(f"{self.url} {what}: {type(error).__name__}: {error}") from None

    def gemm_sums(self):
        """As verify.Server.gemm_sums: what the Engine's first scheduler reported at startup
        (gemms.report_sums), which SGLang 0.5.20 and newer keep in Engine._scheduler_init_result."""
        infos = getattr(getattr(self.engine, "_scheduler_init_result", None), "scheduler_infos", None) or [{}]
        return infos[0].get(verify.SUMS_KEY, verify.STOCK_SUMS)

    def generate(self, field, request, max_new_tokens):
        keywords = verify.generate_request(field, request, max_new_tokens)
        keywords["prompt" if field == "text" else field] = keywords.pop(field)  # Engine's name for text
        return verify.answer_from(f"{self.url} generate", self._await("generate", self.engine.async_generate(**keywords)))

    def flush(self):
        """Empty the radix cache. The scheduler refuses while requests run: retried, as verify
        retries a server's HTTP 400, for up to verify.FLUSH_WAIT_S or the request timeout, whichever
        is shorter (a server's flush waits at most half of it)."""
        wait_s = min(verify.FLUSH_WAIT_S, self.timeout)

        def attempt():
            result = self._await("flush_cache", self.engine.tokenizer_manager.flush_cache())
            return None if result.success else verify.ServerError(
                f"{self.url} flush_cache: refused for {wait_s:g} s: {result.message}")

        verify.retry_while_busy(attempt, wait_s)
