"""`verify_engine`: verify's check of an in-process sglang.Engine, without HTTP.

The Engine is stood in for by test_verify's model of SGLang (logprobs and greedy
tokens a pure function of the ids, a prefix cache, flushes refused while busy,
the faults) behind the Engine's own surface: an event loop, `async_generate`
and a tokenizer manager with `flush_cache` and the model config. That surface is
checked against the installed SGLang wheel below, so a release that renames it
fails here, not on a GPU.
"""

import asyncio
import gc
import inspect
import math
import os
import pathlib
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from conftest import sigint_at_default
from test_verify import FAST, IDS, VOCAB, StandIn, run_verify

from sglang_chunk_align import releases
from sglang_chunk_align.compat import sglang_at_least
from sglang_chunk_align.tools import verify
from sglang_chunk_align.tools.in_process import verify_engine

SMALL = dict(prompts=8, max_new_tokens=4, concurrency=4)


class EngineStandIn:
    """What verify_engine uses of sglang.Engine, answering from a StandIn's model (no socket is served)."""

    def __init__(self, **faults):
        self.model = StandIn(skip_tokenizer_init=True, **faults)
        self.model.server_close()
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = SimpleNamespace(
            model_path="stand-in", model_config=SimpleNamespace(vocab_size=VOCAB), flush_cache=self._flush_cache
        )
        self.loops_seen = set()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None):
        self.loops_seen.add(asyncio.get_running_loop())
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "logprob_start_len": logprob_start_len}
        assert prompt is None and return_logprob
        self.model.bodies.append(body)
        status, reply = await asyncio.to_thread(self.model.generate, body)  # in flight together, as in SGLang
        if status != 200:
            raise ValueError(reply["error"]["message"])
        meta = reply["meta_info"]
        for entries in (meta["input_token_logprobs"][1:], meta["output_token_logprobs"]):  # floats, as in process
            for entry in entries:
                entry[0] = math.nan if entry[0] is None else entry[0]
        return reply

    async def _flush_cache(self):
        status, message = self.model.flush()
        return SimpleNamespace(success=status == 200, message=message)


def record_and_check(tmp_path, reference=None, engine=None, **options):
    """The reference's answers recorded, then `engine` checked against them: (reference, engine, report)."""
    reference, engine = reference or EngineStandIn(radix=False), engine or EngineStandIn()
    file = str(tmp_path / "reference.json")
    recording = verify_engine(reference, record=file, radix=False, **SMALL)
    assert recording["ok"] and recording["baseline"] == "server", recording
    return reference, engine, verify_engine(engine, recorded=file, **SMALL, **options)


def failures(report):
    return {name: {label: len(p["failures"]) for label, p in w["passes"].items()} for name, w in report["workloads"].items()}


def test_an_exact_engine_passes_against_the_recorded_reference_with_radix_hits(tmp_path):
    reference, engine, report = record_and_check(tmp_path)
    assert report["ok"] and not report["problems"], report
    assert report["chunked_vs_unchunked_checked"] and report["baseline"] == "recorded"
    assert report["server"] == "sglang.Engine(stand-in)" and report["input"] == "input_ids"
    assert set(report["workloads"]) == set(verify.WORKLOADS)
    assert report["workloads"]["chat"]["passes"]["concurrent"]["requests_with_hit"] > 0
    # The recorded reference was asked nothing; the Engine got both passes, on its own loop, left stopped.
    assert reference.model.bodies and len(engine.model.bodies) == 2 * sum(
        w["requests"] for w in report["workloads"].values())
    assert engine.loops_seen == {engine.loop} and not engine.loop.is_running()


def test_the_concurrent_pass_has_requests_in_flight_together():
    """Requests that overlapped another get wrong KV: the concurrent pass fails each of them, and the
    sequential pass none. How many overlap is the machine's timing (a loaded CI machine may start a
    request after the others ended), so the test counts them as the stand-in saw them."""
    overlapped = []

    def perturb(request):
        if request.overlapped:
            overlapped.append(request)
            return "input", 1
        return None

    engine = EngineStandIn(delay=0.05, perturb=perturb)
    report = verify_engine(engine, workload="mixed", **SMALL)
    assert len(overlapped) >= 2  # two requests at least were in flight together
    assert failures(report) == {"mixed": {"sequential": 0, "concurrent": len(overlapped)}}
    assert not report["ok"]


@pytest.mark.parametrize("fault", [
    lambda r: ("input", len(r.tokens) - 1) if r.cached else None,  # the last prompt token after a radix hit
    lambda r: ("output", 3) if len(r.tokens) > 2048 else None,  # one output logprob of a long prompt, one ULP
    lambda r: ("output_id", 0) if len(r.tokens) > 2048 else None,
])
def test_each_difference_fails_the_engine(tmp_path, fault):
    _, _, report = record_and_check(tmp_path, engine=EngineStandIn(perturb=fault))
    assert not report["ok"] and any(sum(passes.values()) for passes in failures(report).values()), report


def test_a_nan_logprob_in_process_is_a_problem_not_a_pass():
    engine = EngineStandIn(perturb=lambda r: ("null", 2) if len(r.tokens) > 100 else None)
    report = verify_engine(engine, workload="mixed", **SMALL)
    assert not report["ok"] and any("came back null" in p for p in report["problems"])


def test_a_request_the_engine_refuses_or_never_answers_is_a_clear_error():
    refusing = EngineStandIn(perturb=lambda r: ("abort", 0))
    with pytest.raises(verify.ServerError, match=r"sglang.Engine\(stand-in\) generate: request aborted: aborted by the test"):
        verify_engine(refusing, workload="mixed", **SMALL)
    slow = EngineStandIn(delay=1.0)
    with pytest.raises(verify.ServerError, match=r"sglang.Engine\(stand-in\) generate: no answer in 0.2 s"):
        verify_engine(slow, workload="mixed", timeout=0.2, **SMALL)
    assert not slow.loop.is_running()  # the loop thread was stopped, the Engine usable again


class HungEngine(EngineStandIn):
    """An Engine whose requests never answer; a cancelled one aborts in the scheduler before it ends, which
    takes its loop more than a step (as SGLang's abort can)."""

    asked = aborted = 0

    async def async_generate(self, **request):
        self.asked += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            self.aborted += 1
            raise


def test_a_request_given_up_on_ends_before_the_loop_stops_so_no_task_is_left_pending(caplog):
    """A task left pending on the stopped loop is reported at exit (when it is collected) as "Task was
    destroyed but it is pending!": the loop runs on until the cancelled request has ended."""
    engine = HungEngine()
    with pytest.raises(verify.ServerError, match=r"generate: no answer in 0.2 s"):
        verify_engine(engine, workload="mixed", timeout=0.2, **SMALL)
    assert engine.aborted == engine.asked > 0 and not asyncio.all_tasks(engine.loop) and not engine.loop.is_running()
    del engine
    gc.collect()
    assert "Task was destroyed but it is pending" not in caplog.text


def test_flushes_are_retried_while_busy_and_a_flush_that_never_succeeds_stops_the_check():
    assert verify_engine(EngineStandIn(busy_flushes=3), workload="mixed", **SMALL)["ok"]
    with pytest.raises(verify.ServerError, match=r"flush_cache: refused for 0.3 s: Cache not flushed"):
        verify_engine(EngineStandIn(busy_flushes=10**6), workload="mixed", timeout=0.3, **SMALL)


def test_without_a_radix_hit_chat_fails_unless_the_engine_runs_without_a_cache():
    report = verify_engine(EngineStandIn(radix=False), workload="chat", **SMALL)
    assert not report["ok"] and any("radix cache was never hit" in p for p in report["problems"])
    assert verify_engine(EngineStandIn(radix=False), workload="chat", radix=False, **SMALL)["ok"]


def test_a_reference_recorded_by_the_command_over_http_serves_the_engine_check(tmp_path, capsys):
    """verify --baseline-cache over HTTP and verify_engine write and read the same file."""
    servers = [StandIn(skip_tokenizer_init=True), StandIn(radix=False, skip_tokenizer_init=True)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    file = str(tmp_path / "reference.json")
    try:
        code, _, _ = run_verify(capsys, "--server", servers[0].url, "--reference", servers[1].url,
                                "--baseline-cache", file, *FAST, *IDS)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert code == 0
    report = verify_engine(EngineStandIn(), recorded=file, **SMALL)
    assert report["ok"], report
    with pytest.raises(verify.NotRecorded, match="holds no answer for a request"):
        verify_engine(EngineStandIn(), recorded=file, workload="mixed", seed=1, **SMALL)


def test_options_that_cannot_work_are_refused_before_anything_is_sent(tmp_path):
    engine = EngineStandIn()
    with pytest.raises(ValueError, match="give one of them"):
        verify_engine(engine, recorded="a.json", record="b.json")
    with pytest.raises(ValueError, match="record=.*there is no directory"):
        verify_engine(engine, record=str(tmp_path / "missing" / "reference.json"))
    with pytest.raises(ValueError, match="workload 'rollouts'"):
        verify_engine(engine, workload="rollouts")
    with pytest.raises(verify.ServerError, match="--recorded .*No such file"):
        verify_engine(engine, recorded=str(tmp_path / "absent.json"))
    assert not engine.model.bodies and not engine.model.flushes


def test_called_from_a_coroutine_on_the_engines_loop_it_says_so():
    engine = EngineStandIn()

    async def inside():
        verify_engine(engine, workload="mixed", **SMALL)

    with pytest.raises(RuntimeError, match="not from a coroutine on that loop"):
        engine.loop.run_until_complete(inside())
    assert not engine.model.bodies


# ---------------------------------------------------------------------------
# The surface of the installed SGLang that the stand-in copies.
# ---------------------------------------------------------------------------


def test_the_installed_engine_has_what_verify_engine_uses():
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.io_struct import FlushCacheReqOutput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    keywords = set(inspect.signature(Engine.async_generate).parameters)
    assert {"prompt", *verify.generate_request("input_ids", verify.Request([1], 0), 1)} <= keywords
    assert inspect.iscoroutinefunction(Engine.async_generate)
    assert "self.loop = " in inspect.getsource(Engine.__init__)
    assert inspect.iscoroutinefunction(TokenizerManager.flush_cache)
    assert {"success", "message"} <= set(inspect.signature(FlushCacheReqOutput).parameters)
    manager = inspect.getsource(TokenizerManager)
    assert "self.model_config = " in manager and "self.model_path = " in manager
    if sglang_at_least(releases.GEMM_CONFIGS):  # where fast GEMMs report their sums (gemms.report_sums)
        assert "self._scheduler_init_result = scheduler_init_result" in inspect.getsource(Engine.__init__)


def test_an_engine_in_fast_mode_is_refused_against_answers_of_stock_sums(tmp_path):
    """The Engine's first scheduler reports its sums at startup (gemms.report_sums); a stock reference's
    answers are refused before the Engine is asked anything, and a fast reference's accepted."""
    from sglang_chunk_align import gemms

    fast = {gemms.SUMS_KEY: gemms.SPLIT_SUMS}
    reference, engine = EngineStandIn(radix=False), EngineStandIn()
    engine._scheduler_init_result = SimpleNamespace(scheduler_infos=[fast])
    file = str(tmp_path / "reference.json")
    assert verify_engine(reference, record=file, radix=False, **SMALL)["ok"]
    with pytest.raises(verify.ServerError, match="their GEMMs sum K differently"):
        verify_engine(engine, recorded=file, **SMALL)
    assert engine.model.bodies == []
    reference._scheduler_init_result = SimpleNamespace(scheduler_infos=[fast])
    assert verify_engine(reference, record=str(tmp_path / "fast.json"), radix=False, **SMALL)["ok"]
    assert verify_engine(engine, recorded=str(tmp_path / "fast.json"), **SMALL)["ok"]


CTRL_C_MID_CHECK = """
import os, signal, sys
from test_in_process import SMALL, EngineStandIn
from sglang_chunk_align.tools.in_process import verify_engine

def ctrl_c_at_the_20th_request(request):
    if len(engine.model.bodies) == 20:
        os.kill(os.getpid(), signal.SIGINT)

engine = EngineStandIn(perturb=ctrl_c_at_the_20th_request)
try:
    report = verify_engine(engine, **SMALL)
except KeyboardInterrupt:
    sys.exit("KeyboardInterrupt")
print(report.get("interrupted"))
"""


def test_ctrl_c_stops_verify_engine_rather_than_becoming_a_report():
    """The command prints what an interrupted verify compared; a library call lets Ctrl-C stop the caller
    (a real SIGINT, in a process of its own, mid-check)."""
    tests = pathlib.Path(__file__).resolve().parent
    path = os.pathsep.join(filter(None, [str(tests), str(tests.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CTRL_C_MID_CHECK], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": path}, preexec_fn=sigint_at_default)
    assert (done.returncode, done.stderr.strip().splitlines()[-1:], done.stdout) == (1, ["KeyboardInterrupt"], "")
