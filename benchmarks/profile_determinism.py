"""Where determinism's cost goes: SGLang's own profiler on deterministic and non-deterministic servers.

Serving deterministically costs 1.35-2.8x (benchmarks/README.md), part of it in every decode
step. Which operations make that up, and is any of it the plugin's to remove? Each setup's server
(serving.py's setups: the plugin's defaults at chunk 256, non-deterministic flashinfer, triton)
runs two scenarios, each once unprofiled (timed from the client) and once under SGLang's
/start_profile for --steps forward steps:

- decode: --batch requests of --context random tokens each, sampled at temperature 1.0 with a
  sampling_seed each (as RL samples); once every one has its first token the batch is decoding,
  and the profile takes the next --steps steps, each one decode step of the whole batch;
- chunk: a --context-token prompt cached, then --steps prompts that extend it by one
  --chunk-tokens chunk each, one at a time: each step is one chunk over the cached tokens.

Each profile's trace (GPU kernels and CPU ops, no stacks) is kept. The breakdown sums every GPU
kernel's time per step into attention, GEMMs (enable_batch_invariant_mode replaces cuBLAS with
Triton's persistent matmul under determinism), norms, sampling and the rest, by kernel name
(CATEGORIES, the first match wins); the JSON also keeps every kernel's own total, so the
categories can be redrawn from the record alone (--reanalyze).

    python benchmarks/profile_determinism.py --model-path benchmarks/models/qwen2.5-7b --dummy \\
        --out profile.json --logs profile_logs
"""

import argparse
import glob
import gzip
import http.client
import json
import os
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import random_checkpoint, real_server, serving  # noqa: E402  (run as a script from the repository root)

# Kernel name -> category, the first match wins (case-insensitive). Attention comes first: fa2's and
# Triton's attention kernels are templated on GEMM-like tiles; norms before sampling, since a fused
# add-RMSNorm is a norm whatever else its name says. Under determinism RMSNorm runs unfused
# (batch_invariant_ops' aten::rms_norm: pow, mean_kernel, rsqrt, then multiplies, adds and dtype
# copies); the first three are its own, the generic elementwise ones stay in "rest", which the
# recorded kernels show. The plugin's own: fast mode's split_k_kernel and ordered_sum are GEMMs
# (split_k.py), its residual RMSNorm's add_and_square and scale a norm (norm_kernels.py).
CATEGORIES = (
    ("attention", r"BatchPrefill|BatchDecode|SinglePrefill|SingleDecode|MergeState|PersistentKernel|_fwd_|attention|attn"),
    ("gemm", r"gemm|matmul|nvjet|xmma|cutlass|cublas|mm_kernel|split_?k|ordered_sum"),
    ("norm", r"norm|mean_kernel|rsqrt|pow_tensor_scalar|add_and_square|^scale$"),
    # murmur_hash32 seeds deterministic sampling per request; uniform_and_transform draws stock's noise
    ("sampling", r"sampl|softmax|argmax|top_?k|top_?p|multinomial|gumbel|exponential|philox|penalt|murmur_hash|uniform"),
)
SCENARIOS = ("decode", "chunk")
PROFILE_WAIT_S = 120
PREFILL_WAIT_S = 600  # the whole batch's first tokens
# What a failed request raises: TimeoutError and a refused connection are OSErrors, a stream cut
# mid-reply or not HTTP an http.client.HTTPException (BadStatusLine), an error reply serving.RequestFailed.
REQUEST_ERRORS = (OSError, http.client.HTTPException, serving.RequestFailed)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="required unless --reanalyze")
    random_checkpoint.add_arguments(parser)
    parser.add_argument("--setups", default="plugin-256-defaults,nondet-256,triton-256",
                        help=f"comma-separated, of serving.py's {', '.join(serving.SETUPS)}")
    parser.add_argument("--batch", type=int, default=64, help="decode: requests decoding together")
    parser.add_argument("--context", type=int, default=2048, help="tokens of each decoding prompt, and of the cached prefix")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunk: new tokens per step over the cached prefix")
    parser.add_argument("--steps", type=int, default=8, help="forward steps per profile")
    parser.add_argument("--mem-fraction-static", type=float, default=0.9)
    parser.add_argument("--max-total-tokens", type=int, default=200000, help="each server's KV pool")
    parser.add_argument("--graph-bs", type=int, default=160)
    parser.add_argument("--port", type=int, default=33000)
    parser.add_argument("--logs", default=None, help="server logs and the traces")
    parser.add_argument("--reanalyze", action="store_true", help="redraw the breakdown of --out's kernels, start nothing")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not (args.reanalyze or args.model_path):
        parser.error("--model-path is required to profile (only --reanalyze starts nothing)")
    if args.reanalyze:
        with open(args.out) as file:
            results = json.load(file)
        for entry in results["setups"]:
            for profile in entry.get("scenarios", {}).values():
                if "kernels" in profile:
                    profile["breakdown_ms_per_step"] = breakdown(profile["kernels"], profile["steps"])
        results["categories"] = CATEGORIES
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)
        print(json.dumps(summary(results), indent=1))
        return 0
    args.extra, args.deadline_s = [], float("inf")
    run = real_server.start_run(parser, args, real_server.Run)
    run.results = {"stack": real_server.stack(), "model": run.config, "categories": CATEGORIES,
                   "workload": {k: getattr(args, k) for k in ("batch", "context", "chunk_tokens", "steps")}, "setups": []}
    try:
        for name in args.setups.split(","):
            run.record(profile_setup(run, name), "setups")
    finally:
        run.save()
    print(json.dumps(summary(run.results), indent=1))
    return 0 if all("error" not in s and all("error" not in p for p in s["scenarios"].values())
                    for s in run.results["setups"]) else 1


def profile_setup(run, name):
    """The setup's server alone on the GPU, started, profiled and stopped before the next one starts: three
    8B servers side by side do not fit an 80 GB H100 (gemms_h200/call1), and a neighbour starting up
    would share the GPU with the kernels being timed. Each gets --max-total-tokens, not its setup's own pool."""
    server = serving.start_setup(run, name)
    try:
        entry = serving.ready(name, server)
        if "error" in entry:
            return entry
        entry["scenarios"] = {}
        for scenario in SCENARIOS:
            try:
                entry["scenarios"][scenario] = SCENARIO_RUNS[scenario](run, server, name)
            except REQUEST_ERRORS as error:
                entry["scenarios"][scenario] = {"error": f"{type(error).__name__}: {error}"[:1000]}
        return entry
    finally:
        server.stop()


def decode(run, server, name):
    """The batch decoding: timed once from the client, then again under the profiler."""
    timed = _decode_batch(run, server, seed=0, profile_dir=None)
    profiled = _decode_batch(run, server, seed=1, profile_dir=os.path.join(run.logs, f"trace-{name}-decode"))
    return {**profiled, "itl_p50_s_unprofiled": timed["itl_p50_s"], "itl_p50_s_profiled": profiled["itl_p50_s"]}


def _decode_batch(run, server, seed, profile_dir):
    rng, vocab, args = random.Random(f"decode:{seed}"), run.config["vocab_size"], run.args
    first_tokens = threading.Semaphore(0)
    results = [None] * args.batch
    new_tokens = args.steps * 4 + 64  # every request still decodes well past the profiled steps

    def send(i, ids):
        told = threading.Event()

        def first():
            told.set()
            first_tokens.release()

        try:
            results[i] = serving.stream(server.url, ids, new_tokens, on_first_token=first,
                                        temperature=1.0, sampling_seed=1000 * seed + i)
        except REQUEST_ERRORS as error:
            results[i] = error
        finally:
            if not told.is_set():  # a failed request must not leave the batch waiting for its first token
                first_tokens.release()

    prompts = [serving.random_ids(rng, vocab, args.context) for _ in range(args.batch)]
    threads = [threading.Thread(target=send, args=(i, ids)) for i, ids in enumerate(prompts)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + PREFILL_WAIT_S
    for _ in range(args.batch):
        if not first_tokens.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the batch's prefills did not end in {PREFILL_WAIT_S} s")
    failed = [r for r in results if isinstance(r, Exception)]
    trace = start_profile(server, profile_dir, f"decode-{seed}", args.steps) if profile_dir and not failed else None
    for thread in threads:
        thread.join()
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:
        first = failed[0]
        raise serving.RequestFailed(
            f"{len(failed)} of {args.batch} decoding requests failed: {type(first).__name__}: {str(first).strip()}")
    gaps = sorted(g for r in results for g in r["gaps"])
    entry = {"itl_p50_s": round(statistics.median(gaps), 5)}
    return {**entry, **analyse(wait_for_trace(trace), args.steps)} if trace else entry


def chunk(run, server, name):
    """One chunk over a cached prefix per step: timed once from the client, then profiled."""
    rng, vocab, args = random.Random("chunk"), run.config["vocab_size"], run.args
    prefix = serving.random_ids(rng, vocab, args.context)
    serving.stream(server.url, prefix, 1)

    def extend(profile_dir=None):
        # One step more than profiled: SGLang stops its profiler when the step after the last arrives.
        suffixes = [serving.random_ids(rng, vocab, args.chunk_tokens) for _ in range(args.steps + 1)]
        trace = start_profile(server, profile_dir, "chunk", args.steps) if profile_dir else None
        answers = [serving.stream(server.url, prefix + s, 1) for s in suffixes]
        return answers, trace

    timed, _ = extend()
    profiled, trace = extend(os.path.join(run.logs, f"trace-{name}-chunk"))
    cached = sorted({a["cached_tokens"] for a in timed + profiled})
    return {"cached_tokens": cached, "ttft_p50_s_unprofiled": round(statistics.median(a["ttft"] for a in timed), 5),
            **analyse(wait_for_trace(trace), args.steps)}


SCENARIO_RUNS = {"decode": decode, "chunk": chunk}


def start_profile(server, output_dir, profile_id, steps):
    """SGLang's profiler for the next `steps` forward steps (it stops itself when the step after them
    starts, and writes the trace); returns the trace's path pattern."""
    os.makedirs(output_dir, exist_ok=True)
    body = {"output_dir": output_dir, "num_steps": steps, "activities": ["CPU", "GPU"],
            "with_stack": False, "record_shapes": False, "profile_id": profile_id}
    request = urllib.request.Request(server.url + "/start_profile", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
    return os.path.join(output_dir, f"{profile_id}-*.trace.json.gz")


def wait_for_trace(pattern):
    deadline = time.monotonic() + PROFILE_WAIT_S
    while time.monotonic() < deadline:
        found = glob.glob(pattern)
        if found and _complete(found[0]):
            return found[0]
        time.sleep(1)
    raise TimeoutError(f"no complete trace {pattern} after {PROFILE_WAIT_S} s")


def _complete(path):
    try:
        with gzip.open(path) as file:
            json.load(file)
        return True
    except (OSError, EOFError, ValueError):
        return False


def analyse(path, steps):
    """Every GPU kernel's total time and count in the trace, and their sum per category, per step."""
    with gzip.open(path) as file:
        events = json.load(file)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = defaultdict(lambda: [0.0, 0])
    for event in gpu:
        kernels[event["name"]][0] += event["dur"]
        kernels[event["name"]][1] += 1
    span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) if gpu else 0.0
    kernels = {k: {"us": round(us, 1), "count": n} for k, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])}
    return {"trace": os.path.basename(path), "steps": steps, "gpu_span_ms_per_step": round(span / 1000 / steps, 3),
            "breakdown_ms_per_step": breakdown(kernels, steps), "kernels": kernels}


def category(kernel):
    for name, pattern in CATEGORIES:
        if re.search(pattern, kernel, re.IGNORECASE):
            return name
    return "rest"


def breakdown(kernels, steps):
    """GPU time per step (ms) per category, and their total."""
    sums = dict.fromkeys([name for name, _ in CATEGORIES] + ["rest"], 0.0)
    for kernel, measured in kernels.items():
        sums[category(kernel)] += measured["us"]
    sums["total"] = sum(sums.values())
    return {k: round(v / 1000 / steps, 3) for k, v in sums.items()}


def summary(results):
    return {s["setup"]: {sc: {k: p.get(k) for k in ("breakdown_ms_per_step", "gpu_span_ms_per_step", "itl_p50_s_unprofiled",
                                                    "ttft_p50_s_unprofiled", "cached_tokens", "error")}
                         for sc, p in s.get("scenarios", {}).items()} or s.get("error", "")[-300:]
            for s in results["setups"]}


if __name__ == "__main__":
    sys.exit(main())
