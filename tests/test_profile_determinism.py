"""benchmarks/profile_determinism.py on CPU: its kernel categories on the names the H200 profile
recorded, the breakdown of a trace, and both scenarios against a stand-in for SGLang's /generate
and /start_profile (the profiled servers themselves need a GPU)."""

import gzip
import json
import os
import pathlib
import threading
from http.server import ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from benchmarks import profile_determinism as profile
from benchmarks import real_server, serving
from test_serving_benchmark import Streaming

RECORD = pathlib.Path(profile.__file__).parent / "logs" / "profile_h200_qwen2.5-7b" / "profile.json"

# Kernel names as the H200 profile recorded them (long template arguments cut short), and their category.
RECORDED_NAMES = {
    "matmul_kernel_persistent": "gemm",  # enable_batch_invariant_mode's Triton matmul
    "nvjet_sm90_tst_320x64_64x4_4x1_v_bz_TNT": "gemm",  # cuBLAS's
    "nvjet_sm90_tst_96x64_64x10_4x1_v_bz_splitK_TNN": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>": "gemm",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<true, flashinfer::KernelTraits<(flashinfer::MaskMode)0, 128u>>": "attention",
    "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16>": "attention",
    "void flashinfer::PrefillWithKVCacheKernel<flashinfer::CollectiveMainloop<RaggedParams::AdditionalParams, "
    "flashinfer::AttentionKernelTraits<true, 128, 128, 128, 128, 2, cutlass::bfloat16_t>>>": "attention",
    "_fwd_grouped_kernel_stage1": "attention",  # triton's decode attention
    "_fwd_kernel_unified": "attention",
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "norm",
    "_rms_norm_kernel": "norm",
    # The unfused deterministic RMSNorm (batch_invariant_ops' aten::rms_norm): pow, mean, rsqrt.
    "mean_kernel": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::pow_tensor_scalar_kernel_impl"
    "<float, float>(at::TensorIteratorBase&, float)::{lambda(float)#1}, std::array<char*, 2ul> >": "norm",
    "triton_red_fused__to_copy_add_argmax_clamp_div_log_neg_2": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>": "sampling",
    "void at::native::vectorized_elementwise_kernel<4, murmur_hash32_kernel>": "sampling",  # seeded sampling's hash
    "void sglang::act_and_mul_kernel<__nv_bfloat16, (sglang::ActivationKind)0, true>": "rest",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<at::native::BinaryFunctor<float, float, "
    "float, at::native::binary_internal::MulFunctor<float> > >": "rest",  # the norm's multiply, generic
    "Memcpy HtoD (Pinned -> Device)": "rest",
}


@pytest.mark.parametrize("kernel, expected", RECORDED_NAMES.items(), ids=lambda v: v[:40] if isinstance(v, str) else None)
def test_recorded_kernels_fall_in_their_category(kernel, expected):
    """The first match wins: flashinfer's templated attention is attention, not GEMM, a fused
    add-RMSNorm is a norm, and the unfused deterministic RMSNorm's own kernels count as norms."""
    assert profile.category(kernel) == expected


def test_the_breakdown_sums_each_category_per_step_in_ms():
    """Kernel totals are microseconds over the whole profile; the breakdown is ms per step, and its
    total is the categories' sum (nothing dropped, nothing counted twice)."""
    kernels = {"matmul_kernel_persistent": {"us": 6000.0, "count": 8}, "nvjet_sm90_tst_x": {"us": 2000.0, "count": 8},
               "_fwd_kernel_unified": {"us": 1200.0, "count": 8}, "mean_kernel": {"us": 400.0, "count": 8},
               "cunn_SoftMaxForward": {"us": 200.0, "count": 8}, "memcpy128": {"us": 80.0, "count": 8}}
    result = profile.breakdown(kernels, steps=4)
    assert result == {"attention": 0.3, "gemm": 2.0, "norm": 0.1, "sampling": 0.05, "rest": 0.02, "total": 2.47}
    assert result["total"] == pytest.approx(sum(v for k, v in result.items() if k != "total"), abs=1e-9)


def test_the_recorded_breakdowns_are_the_recorded_kernels_by_todays_categories():
    """The record's breakdowns are redrawn from its own kernels by CATEGORIES as they stand (as
    --reanalyze would), and each total is its categories' sum to the rounding."""
    results = json.loads(RECORD.read_text())
    assert [tuple(c) for c in results["categories"]] == list(profile.CATEGORIES)
    for entry in results["setups"]:
        for name, p in entry["scenarios"].items():
            assert p["breakdown_ms_per_step"] == profile.breakdown(p["kernels"], p["steps"]), (entry["setup"], name)
            parts = sum(v for k, v in p["breakdown_ms_per_step"].items() if k != "total")
            assert p["breakdown_ms_per_step"]["total"] == pytest.approx(parts, abs=0.003)


def write_trace(path, events):
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": events}, file)


def test_analyse_counts_gpu_kernels_and_copies_not_cpu_ops(tmp_path):
    """CPU ops overlap the kernels they launch: counting them would count the time twice. Copies
    and memsets are GPU time (in "rest"); the span runs from the first GPU event's start to the
    last one's end."""
    trace = tmp_path / "chunk-TP-0.trace.json.gz"
    write_trace(trace, [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50000},  # before and around all
        {"ph": "X", "cat": "kernel", "name": "matmul_kernel_persistent", "ts": 1000, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "matmul_kernel_persistent", "ts": 2000, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "_fwd_kernel_unified", "ts": 1400, "dur": 200},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 900, "dur": 100},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 990, "dur": 10},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "ts": 990, "id": 1},
        {"ph": "X", "cat": "kernel", "name": "mean_kernel", "ts": 4800, "dur": 200},
    ])
    result = profile.analyse(str(trace), steps=2)
    assert result["kernels"] == {"matmul_kernel_persistent": {"us": 600.0, "count": 2},
                                 "_fwd_kernel_unified": {"us": 200.0, "count": 1},
                                 "mean_kernel": {"us": 200.0, "count": 1},
                                 "Memcpy HtoD (Pinned -> Device)": {"us": 100.0, "count": 1}}
    assert result["gpu_span_ms_per_step"] == pytest.approx((5000 - 900) / 1000 / 2)
    assert result["breakdown_ms_per_step"] == {"attention": 0.1, "gemm": 0.3, "norm": 0.1, "sampling": 0.0,
                                               "rest": 0.05, "total": 0.55}
    assert result["trace"] == trace.name and result["steps"] == 2


# --- the scenarios against a stand-in server ---------------------------------------------------

TRACE = [{"ph": "X", "cat": "kernel", "name": "matmul_kernel_persistent", "ts": 0, "dur": 800},
         {"ph": "X", "cat": "kernel", "name": "_fwd_kernel_unified", "ts": 900, "dur": 100}]


class Profiling(Streaming):
    """Streaming's /generate, and SGLang's /start_profile: its body kept, and the trace written at
    once where SGLang writes it ({output_dir}/{profile_id}-TP-0.trace.json.gz). Every request is
    logged in order ("/start_profile", body) or ("/generate", input_ids); a request whose
    sampling_seed is in `fail_seeds` gets an HTTP 500, one in `cut_seeds` a reply that is not HTTP."""

    log = []
    fail_seeds = cut_seeds = ()

    def do_POST(self):
        if self.path.startswith("/start_profile"):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.log.append(("/start_profile", body))
            write_trace(os.path.join(body["output_dir"], f"{body['profile_id']}-TP-0.trace.json.gz"), TRACE)
            self.send_response(200)
            self.end_headers()
            return
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        self.log.append(("/generate", body["input_ids"]))
        if body["sampling_params"].get("sampling_seed") in self.fail_seeds:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "out of memory"}}')
            return
        if body["sampling_params"].get("sampling_seed") in self.cut_seeds:
            self.wfile.write(b"not an HTTP reply\r\n")  # the client raises http.client.BadStatusLine
            self.close_connection = True
            return
        self.rfile = _Replay(json.dumps(body).encode())  # Streaming reads the body again
        super().do_POST()


class _Replay:
    def __init__(self, data):
        self.data = data

    def read(self, n):
        return self.data[:n]


@pytest.fixture
def profiling():
    Profiling.log, Profiling.seen, Profiling.fail_seeds, Profiling.cut_seeds = [], [], (), ()
    http = ThreadingHTTPServer(("127.0.0.1", 0), Profiling)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{http.server_port}")
    http.shutdown()


def profile_run(tmp_path, steps=3, batch=4, context=40, chunk_tokens=16):
    args = SimpleNamespace(steps=steps, batch=batch, context=context, chunk_tokens=chunk_tokens)
    return SimpleNamespace(args=args, config={"vocab_size": 1000}, logs=str(tmp_path))


def test_chunk_profiles_steps_chunks_over_the_cached_prefix_and_one_more(profiling, tmp_path):
    """SGLang stops its profiler (and writes the trace) only when the step after the last profiled
    one starts: steps + 1 extending requests follow /start_profile, each the cached prefix and one
    new chunk. The profiler is asked for `steps` steps, GPU and CPU, no stacks."""
    run = profile_run(tmp_path)
    result = profile.chunk(run, profiling, "plugin-256-defaults")
    prefix = Profiling.log[0][1]
    start = Profiling.log.index(next(e for e in Profiling.log if e[0] == "/start_profile"))
    body, after = Profiling.log[start][1], Profiling.log[start + 1:]
    assert len(prefix) == 40 and start == 1 + 3 + 1  # the prefix, the timed pass (steps + 1), then the profile
    assert [path for path, _ in after] == ["/generate"] * (3 + 1)
    assert all(len(ids) == 40 + 16 and ids[:40] == prefix for _, ids in after)
    assert len({tuple(ids) for _, ids in Profiling.log[1:]} - {tuple(body)}) == 2 * (3 + 1)  # every chunk new
    assert (body["num_steps"], body["activities"], body["with_stack"]) == (3, ["CPU", "GPU"], False)
    assert body["output_dir"] == os.path.join(str(tmp_path), "trace-plugin-256-defaults-chunk")
    assert result["steps"] == 3 and result["breakdown_ms_per_step"]["gemm"] == pytest.approx(0.8 / 3, abs=0.001)
    assert result["cached_tokens"] == [(40 + 16) // 2]  # the stand-in's


def run_with_timeout(call, seconds=30):
    """`call`'s result or exception; a call still running after `seconds` fails the test (a hang)."""
    outcome = {}

    def target():
        try:
            outcome["result"] = call()
        except BaseException as error:  # noqa: BLE001 (handed back to the test)
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return outcome


def test_decode_profiles_the_batch_once_every_request_decodes(profiling, tmp_path):
    """The profile starts once the whole batch has its first token, for `steps` steps, and the trace
    it writes is analysed; each request samples with its own seed."""
    outcome = run_with_timeout(lambda: profile.decode(profile_run(tmp_path), profiling, "nondet-256"))
    result = outcome["result"]
    starts = [body for path, body in Profiling.log if path == "/start_profile"]
    assert len(starts) == 1 and starts[0]["num_steps"] == 3 and starts[0]["profile_id"] == "decode-1"
    assert [path for path, _ in Profiling.log].count("/generate") == 2 * 4
    assert sorted(p["sampling_seed"] for _, p in Profiling.seen) == [0, 1, 2, 3, 1000, 1001, 1002, 1003]
    assert result["steps"] == 3 and "itl_p50_s_unprofiled" in result and "kernels" in result


def test_a_failed_request_of_the_decode_batch_is_an_error_not_a_hang(profiling, tmp_path):
    """A request refused before its first token must still let the batch go on: the scenario ends
    with RequestFailed (the setup's error), not a wait for a first token that never comes. No
    profile is started for a batch that is already short."""
    Profiling.fail_seeds = (2,)
    outcome = run_with_timeout(lambda: profile._decode_batch(profile_run(tmp_path), profiling, seed=0,
                                                             profile_dir=str(tmp_path / "trace")))
    assert isinstance(outcome.get("error"), serving.RequestFailed), outcome
    assert "1 of 4 decoding requests failed" in str(outcome["error"]) and "HTTP 500" in str(outcome["error"])
    assert all(path == "/generate" for path, _ in Profiling.log)


def test_a_decode_request_answered_with_no_http_is_a_failed_request_of_the_batch(profiling, tmp_path):
    """A reply that is not HTTP raises http.client.BadStatusLine, which is no OSError: the batch
    reports it as a failed request, named, as it does an error reply."""
    Profiling.cut_seeds = (1,)
    outcome = run_with_timeout(lambda: profile._decode_batch(profile_run(tmp_path), profiling, seed=0,
                                                             profile_dir=None))
    assert isinstance(outcome.get("error"), serving.RequestFailed), outcome
    assert str(outcome["error"]) == "1 of 4 decoding requests failed: BadStatusLine: not an HTTP reply"


def test_reanalyze_redraws_the_breakdown_from_the_kernels_and_starts_nothing(tmp_path, monkeypatch):
    """--reanalyze: categories changed after a run are applied to its recorded kernels alone; no
    server starts, a scenario with an error is left as it is."""
    def refuse(*args, **kwargs):
        raise AssertionError("--reanalyze started something")

    monkeypatch.setattr(real_server, "Run", refuse)
    monkeypatch.setattr(real_server, "Server", refuse)
    kernels = {"mean_kernel": {"us": 400.0, "count": 8}, "matmul_kernel_persistent": {"us": 1600.0, "count": 8}}
    out = tmp_path / "profile.json"
    out.write_text(json.dumps({"categories": [["norm", "norm"]], "setups": [
        {"setup": "plugin-256-defaults", "scenarios": {
            "decode": {"steps": 2, "kernels": kernels, "breakdown_ms_per_step": {"rest": 1.0, "total": 1.0}},
            "chunk": {"error": "TimeoutError: no trace"}}},
        {"setup": "triton-256", "error": "did not start"}]}))
    assert profile.main(["--reanalyze", "--out", str(out)]) == 0  # no --model-path: it starts nothing
    results = json.loads(out.read_text())
    scenarios = results["setups"][0]["scenarios"]
    assert scenarios["decode"]["breakdown_ms_per_step"] == {"attention": 0.0, "gemm": 0.8, "norm": 0.2, "sampling": 0.0,
                                                            "rest": 0.0, "total": 1.0}
    assert scenarios["chunk"] == {"error": "TimeoutError: no trace"}
    assert [tuple(c) for c in results["categories"]] == list(profile.CATEGORIES)


def test_weights_that_cannot_be_written_are_a_usage_error(tmp_path, capsys):
    """--weights as serving.py takes them (--dummy among them); a random checkpoint for a folder without
    config.json is one line and exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit:
        profile.main(["--model-path", str(tmp_path), "--weights", "random", "--checkpoints", str(tmp_path / "w"),
                      "--out", str(tmp_path / "profile.json")])
    assert exit.value.code == 2 and f"error: {tmp_path} holds no config.json" in capsys.readouterr().err


def test_each_setup_starts_as_serving_starts_it_in_the_pool_of_max_total_tokens(tmp_path, monkeypatch):
    """The profiled servers are serving.py's setups, started by its start_setup, one at a time (each stopped
    before the next starts: an H100 cannot hold three); each gets --max-total-tokens, stock-4096's own pool
    included. One that does not come up is its setup's error, and the run's exit 1."""
    started, events = [], []

    class Down:
        def __init__(self, run, name, chunk, page, env, **options):
            self.name = name
            started.append((name, chunk, options["backend"], options["max_total_tokens"], options["decode_graph_bs"]))
            events.append(("start", name))

        def describe(self):
            return {"name": "described"}

        def wait_ready(self):
            return False

        def log(self):
            return "it did not start"

        def stop(self):
            events.append(("stop", self.name))

    monkeypatch.setattr(serving, "Server", Down)
    monkeypatch.setattr(real_server, "stack", lambda: {})
    out = tmp_path / "profile.json"
    assert profile.main(["--model-path", str(tmp_path), "--dummy", "--setups", "stock-4096,triton-256", "--graph-bs", "8",
                         "--logs", str(tmp_path), "--out", str(out)]) == 1
    assert started == [("stock-4096", 4096, "flashinfer", None, 8), ("triton-256", 256, "triton", None, 8)]
    assert events == [("start", "stock-4096"), ("stop", "stock-4096"), ("start", "triton-256"), ("stop", "triton-256")]
    assert [s["error"] for s in json.loads(out.read_text())["setups"]] == ["it did not start"] * 2
