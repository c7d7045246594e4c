"""Serving side by side: the plugin against what a deterministic user would run instead.

What an operator asks before turning the plugin on: on my workloads, how fast is
it next to stock deterministic flashinfer (chunks of 4096, radix cache forced
off), next to deterministic triton (the radix-cache alternative stock SGLang
offers on every GPU), and how far from non-deterministic serving? Every setup
runs alone on the GPU, one after another in one run, on the same workloads:

- rl: RL rollout groups, --groups prompts x --samples samples each (16 x 8),
  prompts of 1,000-3,000 tokens, 128-512 new tokens per group, all sent at once,
  sampled as RL samples: temperature 1.0 and a sampling_seed of its own per
  sample, so a group's samples differ (the benchmark counts the groups whose
  samples all came back alike, and fails the run on any);
- agent: multi-turn agents, each turn appending the previous answer and a tool
  output (800-1,500 tokens) to the history, --turns turns (8), past 8k tokens;
- interactive: 32 requests decoding 1,024 tokens while prompts of 8k-32k tokens
  keep arriving, one a second (the case small chunks are for);
- streamed: the earlier cost workload (8 requests decoding while 6 prompts of
  6,144 tokens arrive every 0.4 s).

The decode wait's two setups (--repeat-setups: the plugin at 256 with it and
without it) run their workloads --repeats times on one server, the cache
flushed between rounds; the JSON's "decode_wait" compares them (decode_wait_verdict).

Each setup is then checked by `sglang-chunk-align verify` against its own
backend's unchunked reference (stock, radix off, each prompt alone and cold),
so that a fast but inexact setup cannot look good: only the non-deterministic
ceiling is not checked. Then single prompts of growing length show where each
setup stops serving long prompts (the fa2 workspace: a 32k-token unchunked
prefill needs more than SGLang's 2 GiB). Those run last on a server because
a failure there takes the server down.

While one setup is verified and probed the next one starts: a server's start
never overlaps another's timed workloads. Non-deterministic flashinfer's kernels,
which no deterministic server compiles, are compiled while the references record
their answers (compiled_beside_references).

    python benchmarks/serving.py --model-path benchmarks/models/granite-3.1-8b --weights random --out serving.json

--weights picks the weights (benchmarks/random_checkpoint.py): the checkpoint
at --model-path, SGLang's dummy weights (--weights dummy, or --dummy), or a
well-scaled random checkpoint written once from its config.json (--weights
random), which servers load as a real one; the JSON's "weights" says which ran.

The JSON holds each setup's command, plugin startup line, metrics, verify report
and long-prompt results, the ratios to stock deterministic flashinfer and to
deterministic triton computed from this run, and the stack; it is rewritten
after each setup, so a run cut short keeps what it did.
"""

import argparse
import hashlib
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import random_checkpoint, real_server  # noqa: E402  (run as a script from the repository root)
from benchmarks.real_server import STOCK, Server  # noqa: E402
from sglang_chunk_align.tools import verify  # noqa: E402

# The plugin as a user gets it: selected, every SGLANG_CHUNK_ALIGN_* switch at its default.
PLUGIN = {"SGLANG_PLUGINS": "chunk_align"}
# The decode wait said outright on both sides of decode_wait_verdict's pair, whatever the default is.
WAIT_ON, WAIT_OFF = ({**PLUGIN, "SGLANG_CHUNK_ALIGN_DECODE_WAIT": flag} for flag in ("1", "0"))
# Fast GEMMs (docs/gemms.md): not stock's bits, so their reference runs them too.
FAST_GEMMS = {**PLUGIN, "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"}
# Each reference, unchunked with the radix cache off: (backend, environment, more arguments). The fast
# one loads the plugin, which refuses an unchunked prefill that could outgrow fa2's deterministic
# workspace: 24,576 tokens of context fit Qwen2.5-7B's shape ("sglang-chunk-align plan" gives a model's).
REFERENCES = {
    "flashinfer": ("flashinfer", STOCK, ()),
    "triton": ("triton", STOCK, ()),
    "flashinfer-fast": ("flashinfer", FAST_GEMMS, ("--context-length", "24576")),
}


class Setup:
    """One server configuration: how it starts, and which reference checks it (None: unchecked)."""

    def __init__(self, label, chunk, env, backend="flashinfer", deterministic=True, reference="flashinfer",
                 radix=True, extra=(), long_prompts=False, max_total_tokens=None, expect_identical=True):
        self.label, self.chunk, self.env, self.backend = label, chunk, env, backend
        self.expect_identical = expect_identical  # False: a control, which verify must find inexact
        self.deterministic, self.reference, self.radix = deterministic, reference, radix
        self.extra, self.long_prompts = list(extra), long_prompts
        # A KV pool of its own (None: --max-total-tokens) needs the GPU alone: no other server starts beside it.
        self.max_total_tokens = max_total_tokens


# In order of importance: a run cut short by --deadline-s keeps the first ones. Stock deterministic
# flashinfer cannot share a prompt between requests (no radix cache), so it gets a KV pool as large as
# the GPU alone gives it; the radix setups never fill --max-total-tokens on these workloads.
SETUPS = {
    "stock-4096": Setup("stock deterministic flashinfer, chunk 4096 (radix cache forced off)", 4096, STOCK,
                        radix=False, long_prompts=True, max_total_tokens=600000),
    "plugin-256": Setup("plugin, chunk 256, radix cache, decode wait on", 256, WAIT_ON, long_prompts=True),
    "triton-256": Setup("stock deterministic triton, chunk 256, radix cache", 256, STOCK, backend="triton",
                        reference="triton"),
    "nondet-256": Setup("non-deterministic flashinfer, chunk 256, radix cache (the ceiling)", 256, STOCK,
                        deterministic=False, reference=None),
    # verify's sensitivity: chunked prefill without the fixed split differs from the unchunked reference
    # wherever the model lets attention's last bits reach the logprobs; a pass here says it does not.
    "nondet-256-control": Setup("control: non-deterministic flashinfer, chunk 256, radix cache, checked against "
                                "the deterministic unchunked reference (verify should find it inexact)", 256, STOCK,
                                deterministic=False, expect_identical=False),
    "plugin-1024": Setup("plugin, chunk 1024, radix cache, decode wait on", 1024, WAIT_ON, long_prompts=True),
    # Issue 48's larger chunks, each with the decode wait off (the defaults) and on.
    "plugin-512-defaults": Setup("plugin, chunk 512, radix cache, the plugin's defaults", 512, PLUGIN),
    "plugin-512": Setup("plugin, chunk 512, radix cache, decode wait on", 512, WAIT_ON),
    "plugin-1024-defaults": Setup("plugin, chunk 1024, radix cache, the plugin's defaults", 1024, PLUGIN),
    # The plugin as a user turns it on: SGLANG_PLUGINS=chunk_align and no switch (the decode wait off).
    "plugin-256-defaults": Setup("plugin, chunk 256, radix cache, the plugin's defaults", 256, PLUGIN,
                                 long_prompts=True),
    # Issue 48's padded calls: radix hits kept whole, a short final piece's split call padded onto its tile.
    "plugin-256-pad": Setup("plugin, chunk 256, radix cache, the plugin's defaults and padded calls", 256,
                            {**PLUGIN, "SGLANG_CHUNK_ALIGN_PAD_TILES": "1"}),
    "plugin-256-no-wait": Setup("plugin, chunk 256, radix cache, decode wait off (stock's prefill-first order)",
                                256, WAIT_OFF),
    "plugin-256-interval-1": Setup("plugin, chunk 256, radix cache, --prefill-decode-interval 1", 256, PLUGIN,
                                   extra=["--prefill-decode-interval", "1"]),
    # The plugin before split attention (issue 32): requests wait to keep each batch on one fa2 tile.
    "plugin-256-no-split": Setup("plugin, chunk 256, radix cache, split attention off (requests wait to keep "
                                 "each batch on one tile, as before issue 32)", 256,
                                 {**PLUGIN, "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION": "0"}),
    "plugin-256-fast": Setup("plugin, chunk 256, radix cache, the plugin's defaults and fast GEMMs (split-K fixed per "
                             "shape)", 256, FAST_GEMMS, reference="flashinfer-fast"),
    # The plugin as it was before issue 47: stock's one GEMM config and stock's eleven-kernel norms.
    "plugin-256-stock-ops": Setup("plugin, chunk 256, radix cache, the plugin's defaults but stock's GEMM config and "
                                  "RMSNorm", 256, {**PLUGIN, "SGLANG_CHUNK_ALIGN_GEMMS": "0",
                                                   "SGLANG_CHUNK_ALIGN_NORMS": "0"}),
    # Batch-invariant GEMMs with a tile config per M (docs/gemms.md): stock's bits, so stock's reference checks them.
    "plugin-256-gemms": Setup("plugin, chunk 256, radix cache, the plugin's defaults and GEMM configs per M", 256,
                              {**PLUGIN, "SGLANG_CHUNK_ALIGN_GEMMS": "1"}),
    "triton-256-gemms": Setup("stock deterministic triton, chunk 256, radix cache, the plugin's GEMM configs per M",
                              256, {**PLUGIN, "SGLANG_CHUNK_ALIGN_GEMMS": "1"}, backend="triton", reference="triton"),
}
BASELINES = ("stock-4096", "triton-256", "plugin-256-no-split")  # the ratios' denominators
# Lengths probed alone after the checks: around where a chunk's fa2 split partials outgrow the workspace.
LONG_PROMPTS = {"reference": (16384, 20480, 24576, 32768), "setup": (32768, 65536, 126976, 131000)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    random_checkpoint.add_arguments(parser)
    parser.add_argument("--setups", default=",".join(n for n in SETUPS if SETUPS[n].expect_identical),
                        help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--workloads", default="rl,agent,interactive,streamed")
    parser.add_argument("--groups", type=int, default=16, help="rl: prompts")
    parser.add_argument("--samples", type=int, default=8, help="rl: samples per prompt")
    parser.add_argument("--conversations", type=int, default=8, help="agent: conversations at once")
    parser.add_argument("--turns", type=int, default=8, help="agent: turns per conversation")
    parser.add_argument("--prompts", type=int, default=12, help="verify --prompts (requests per workload)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the workloads for --repeat-setups")
    parser.add_argument("--repeat-setups", default="plugin-256,plugin-256-no-wait",
                        help="setups whose workloads run --repeats times (the decode wait against its control)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.9,
                        help="SGLang 0.5.23 counts other servers' memory against it: the pools are set by tokens")
    parser.add_argument("--max-total-tokens", type=int, default=250000,
                        help="each timed server's KV pool, unless its setup has its own")
    parser.add_argument("--graph-bs", type=int, default=160, help="largest decode batch with a CUDA graph")
    parser.add_argument("--port", type=int, default=32000)
    parser.add_argument("--deadline-s", type=float, default=3600, help="start no new setup after this many seconds")
    parser.add_argument("--logs", default=None)
    parser.add_argument("--no-verify", action="store_true", help="time only: no references, no verify (say so)")
    parser.add_argument("--skip-long-prompts", action="store_true",
                        help="no single long prompts after the checks (the workloads and verify alone)")
    parser.add_argument("--baselines", metavar="DIR",
                        help="reuse the references' recorded answers (baseline-REFERENCE.json) from an earlier run's --logs")
    parser.add_argument("--verify-only", action="store_true",
                        help="with --baselines: start every setup at once, each with a --max-total-tokens pool, and "
                             "verify each against its reference's recorded answers; nothing timed")
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more server arguments")
    args = parser.parse_args(argv)
    if args.verify_only and not args.baselines:
        parser.error("--verify-only checks setups against recorded references: give --baselines DIR")
    run = real_server.start_run(parser, args, ServingRun)
    try:
        references = {SETUPS[name].reference for name in args.setups.split(",")} - {None}
        if args.no_verify:
            references = set()
        if args.baselines:
            run.baselines = {r: (None, os.path.join(args.baselines, f"baseline-{r}.json")) for r in references}
        else:
            run.record_references(references, compiled_beside_references(args.setups.split(",")))
        (run.verify_setups if args.verify_only else run.time_setups)(args.setups.split(","))
    finally:
        run.stop()
        run.ratios()
        run.results["decode_wait"] = decode_wait_verdict(run.results["setups"])
        run.results["outputs_compared"] = outputs_compared(run.results["setups"])
        run.save()
    print(json.dumps(run.summary(), indent=1))
    agree = all(c["agree"] for c in run.results["outputs_compared"].values())
    return 0 if agree and all(verified_as_expected(s) and not alike_groups(s) for s in run.results["setups"]) else 1


def verified_as_expected(entry):
    """Verify did not answer the opposite of what the setup expects: inexact for a setup, identical for a
    control. Not checked (None) is neither."""
    opposite = not SETUPS[entry["setup"]].expect_identical
    return entry.get("verify_ok") is not opposite


# Tokens of KV a reference holds: small, so that references (and compile_kernels' server) fit on one GPU at once.
REFERENCE_POOL_TOKENS = 40000


def start_setup(run, name, max_total_tokens=None, server_name=None):
    """The server of the setup named `name` (SETUPS), page size 1, CUDA graphs up to --graph-bs, its KV
    pool `max_total_tokens` (None: --max-total-tokens): what this benchmark and profile_determinism start.
    `server_name` (default `name`) names its log."""
    setup = SETUPS[name]
    return Server(run, server_name or name, setup.chunk, 1, setup.env, extra=setup.extra, backend=setup.backend,
                  deterministic=setup.deterministic, decode_graph_bs=run.args.graph_bs, max_total_tokens=max_total_tokens)


def compiled_beside_references(names):
    """The setups whose kernels a server compiles beside the references: non-deterministic flashinfer's. The
    first such server on a fresh machine spends its first prefill CUDA graph compiling what no deterministic
    server compiled, once per machine: 107 s of call8's control (its plugin servers' captures took 4 s),
    99 s of call5's first non-deterministic server and 3 s of its second (gemms_h200's records)."""
    return [name for name in names if not SETUPS[name].deterministic and SETUPS[name].backend == "flashinfer"]


def ready(name, server):
    """The setup's entry once its server is up: its command and plugin lines, or the error."""
    entry = {"setup": name, "label": SETUPS[name].label, **server.describe()}
    if not server.wait_ready():
        entry["error"] = server.log()[-3000:]
    else:
        entry["plugin_lines"] = server.plugin_lines()
    return entry


class ServingRun(real_server.Run):
    """real_server.Run's servers, logs and JSON, with this benchmark's results."""

    def __init__(self, args):
        args.extra = args.extra or []
        super().__init__(args)
        self.results = {"stack": real_server.stack(), "model": self.config, "weights": self.results["weights"],
                        "references": [], "setups": []}
        self.baselines = {}  # reference backend -> (its Server, its baseline cache file)
        self.setup_servers = []  # every setup's Server, stopped at the end whatever happened

    def record_references(self, names, compile_for=()):
        """Each named reference (REFERENCES: unchunked, radix off), its cold answers recorded by verifying
        it against itself; then the prompt lengths stock flashinfer's serves, last, since a failure ends it.
        Beside them, a server of each setup in `compile_for` (compiled_beside_references) with the
        references' KV pool, stopped once up: the setup's own server then starts on compiled kernels,
        instead of compiling them in device time of its own (`kernels_compiled`: seconds to up, or False)."""

        def start(name):
            backend, env, extra = REFERENCES[name]
            server = Server(self, f"reference-{name}", -1, 1, env, extra=["--disable-radix-cache", *extra],
                            backend=backend, max_total_tokens=REFERENCE_POOL_TOKENS)
            if not server.wait_ready():  # its process may still run: a start past READY_TIMEOUT_S
                server.stop()
                self.record({"reference": name, "error": server.log()[-3000:]}, "references")
                return
            cache = os.path.join(self.logs, f"baseline-{name}.json")
            entry = real_server.verify(self, server, server, cache, radix=False)
            probe = name == "flashinfer" and not self.args.skip_long_prompts
            entry["long_prompts"] = long_prompts(server, LONG_PROMPTS["reference"], self) if probe else []
            self.record({"reference": name, **entry}, "references")
            self.baselines[name] = server, cache

        def compile_kernels(name):
            started, server = time.monotonic(), start_setup(self, name, REFERENCE_POOL_TOKENS,
                                                         server_name=f"kernels-{name}")
            try:
                up = server.wait_ready()
            finally:
                server.stop()
            with self.lock:
                self.results.setdefault("kernels_compiled", {})[name] = up and round(time.monotonic() - started, 1)

        with ThreadPoolExecutor((len(names) + len(compile_for)) or 1) as pool:
            jobs = [pool.submit(start, n) for n in sorted(names)] + [pool.submit(compile_kernels, n) for n in compile_for]
            for job in jobs:
                job.result()
        for server, _ in self.baselines.values():
            server.stop()

    def time_setups(self, names):
        """Each setup timed alone; its checks overlap the next setup's start (unless either needs the
        GPU alone), never the next one's timing."""
        try:
            self._time_in_turn(names)
        finally:  # interrupted (the device call's limit): no server outlives the run
            for started in self.setup_servers:
                started.stop()

    def _time_in_turn(self, names):
        server, checking = None, None
        for index, name in enumerate(names):
            if server is None:
                if checking is not None:
                    checking.join()
                server = self._start(name)
            elif checking is not None:
                checking.join()
            if self.time_left() < 60:
                self.record({"setup": name, "error": "deadline: not run"}, "setups")
                server.stop()
                return
            entry = self._time(name, server)
            checking = threading.Thread(target=self._check, args=(name, server, entry))
            checking.start()
            following = names[index + 1] if index + 1 < len(names) else None
            beside = following and not (SETUPS[name].max_total_tokens or SETUPS[following].max_total_tokens)
            server = self._start(following) if beside else None
        if checking is not None:
            checking.join()

    def verify_setups(self, names):
        """--verify-only: every setup's server at once, each with the --max-total-tokens pool (so one GPU
        holds them side by side; the setup's own pool is for timing it alone), each verified against its
        reference's recorded answers. What a timed run's checks could not do is done so, by the same commands."""

        def check(name):
            server = self._start(name, pool=self.args.max_total_tokens)
            entry = ready(name, server)
            if "error" in entry:
                server.stop()
                self.record(entry, "setups")
            else:
                self._check(name, server, entry, long=False)

        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(check, names))

    def _start(self, name, pool=None):
        server = start_setup(self, name, pool or SETUPS[name].max_total_tokens)
        self.setup_servers.append(server)
        return server

    def _time(self, name, server):
        entry = ready(name, server)
        if "error" in entry:
            return entry
        try:
            warm_up(server, self)
            entry["workloads"] = self._round(server)
            if name in self.args.repeat_setups.split(","):
                entry["repeats"] = []
                for _ in range(self.args.repeats - 1):
                    verify.Server(server.url, timeout=60).flush()  # the next round's prompts arrive cold again
                    entry["repeats"].append(self._round(server))
        except (RequestFailed, OSError, http.client.HTTPException, verify.ServerError) as error:
            # The run goes on to the next setup; this one has no figures, and is not checked.
            entry.pop("workloads", None)
            entry["error"] = f"{type(error).__name__}: {error}\n{server.log()[-2000:]}"
        return entry

    def _round(self, server):
        """Every workload once, each on the same requests (seed 0) as every other setup's, with the prefill
        steps its server logged meanwhile (real_server.prefill_steps)."""
        results = {}
        for w in self.args.workloads.split(","):
            logged = len(server.log())
            results[w] = WORKLOADS[w](server, self, seed=0)
            results[w]["prefill"] = real_server.prefill_steps(server.log()[logged:])
        return results

    def _check(self, name, server, entry, long=True):
        setup = SETUPS[name]
        try:
            if "error" not in entry and setup.reference is not None and setup.reference not in self.baselines:
                entry["verify_ok"] = "not run (--no-verify)"
            elif "error" not in entry and setup.reference is not None:
                _, cache = self.baselines[setup.reference]
                check = real_server.verify(self, server, None, cache, radix=setup.radix)  # its recorded answers
                entry["verify_ok"], entry["verify"] = check["ok"], check["verify"]
                entry["verify_command"] = check["verify_command"]
            if "error" not in entry and setup.long_prompts and long and not self.args.skip_long_prompts:
                entry["long_prompts"] = long_prompts(server, LONG_PROMPTS["setup"], self)
            entry["split_batches_at_least"] = server.split_batches()
        finally:
            server.stop()
            self.record(entry, "setups")

    def stop(self):
        for server, _ in self.baselines.values():
            if server is not None:
                server.stop()

    def ratios(self):
        """Each setup's throughput and latencies over each baseline's, from this run."""
        by_name = {s["setup"]: s for s in self.results["setups"] if "workloads" in s}
        for entry in by_name.values():
            entry["ratios"] = {}
            for base_name in BASELINES:
                base = by_name.get(base_name)
                if base is None:
                    continue
                entry["ratios"][f"to {base_name}"] = {
                    w: {k: round(m[k] / base["workloads"][w][k], 3) for k in RATIO_KEYS if base["workloads"][w].get(k)}
                    for w, m in entry["workloads"].items() if w in base["workloads"]
                }

    def summary(self):
        rows = []
        for s in self.results["setups"]:
            row = {"setup": s["setup"], "verify_ok": s.get("verify_ok"), "error": s.get("error", "")[-300:],
                   "groups_with_alike_samples": alike_groups(s)}
            for w, m in s.get("workloads", {}).items():
                row[w] = {k: m[k] for k in ("wall_s", "output_tok_s", "ttft_p50_s", "itl_p99_s", "itl_max_s")}
            row["long_prompts"] = {p["tokens"]: p["outcome"] for p in s.get("long_prompts", [])}
            rows.append(row)
        refs = [{"reference": r["reference"], "ok": r.get("ok"),
                 "long_prompts": {p["tokens"]: p["outcome"] for p in r.get("long_prompts", [])}}
                for r in self.results["references"]]
        return {"stack": self.results["stack"], "references": refs, "setups": rows,
                "decode_wait": self.results.get("decode_wait"),
                "outputs_compared": self.results.get("outputs_compared")}


def outputs_compared(setups):
    """Each exact setup's outputs against the first timed setup checked by the same reference.

    Setups that all claim the reference's answers (each request as if prefilled alone, unchunked)
    must return the same tokens for the same requests, greedy agents and rollouts seeded per sample
    alike, however differently their batches formed: a check on the timed workloads themselves,
    beside verify's. Controls and unchecked setups are left out.
    """
    first, compared = {}, {}
    for entry in setups:
        setup = SETUPS[entry["setup"]]
        if "workloads" not in entry or setup.reference is None or not setup.expect_identical:
            continue
        base = first.setdefault(setup.reference, entry)
        if base is entry:
            continue
        counts = {w: (sum(a == b for a, b in zip(m["outputs"], base["workloads"][w]["outputs"])), len(m["outputs"]))
                  for w, m in entry["workloads"].items() if w in base["workloads"]}
        compared[entry["setup"]] = {
            "against": base["setup"], "agree": all(same == total for same, total in counts.values()),
            **{w: f"{same}/{total} requests identical" for w, (same, total) in counts.items()},
        }
    return compared


def output_digest(output_ids):
    """A request's output tokens as 12 hex digits, what outputs_compared compares."""
    return hashlib.sha256(json.dumps(output_ids).encode()).hexdigest()[:12]


# The decode wait stays the default only if it costs at most this much throughput against its control
# on every workload, while it holds the longest inter-token gap to GAP_BOUND_S (issue 31's goals).
DECODE_WAIT_MAX_COST, GAP_BOUND_S = 0.03, 0.3


def decode_wait_verdict(setups):
    """The decode wait (plugin-256) against its control (plugin-256-no-wait), over every round of
    each: per workload the median throughput's cost and each side's range, and the longest gap.
    None until both setups have workloads."""
    rounds = {s["setup"]: [s["workloads"]] + s.get("repeats", []) for s in setups if s.get("workloads")}
    wait, control = rounds.get("plugin-256"), rounds.get("plugin-256-no-wait")
    if not (wait and control):
        return None
    workloads = {}
    for w in wait[0]:
        if w not in control[0]:
            continue
        on, off = ([r[w]["output_tok_s"] for r in side] for side in (wait, control))
        workloads[w] = {
            "rounds": [len(on), len(off)],
            "output_tok_s_wait": sorted(on), "output_tok_s_control": sorted(off),
            "cost": round(1 - statistics.median(on) / statistics.median(off), 4),
            "itl_max_s_wait": max(r[w]["itl_max_s"] for r in wait),
            "itl_max_s_control": max(r[w]["itl_max_s"] for r in control),
        }
    keep = all(m["cost"] <= DECODE_WAIT_MAX_COST and m["itl_max_s_wait"] <= GAP_BOUND_S for m in workloads.values())
    return {"workloads": workloads, "keep_default": keep,
            "rule": f"keep the wait on by default iff on every workload its median throughput costs at most "
                    f"{DECODE_WAIT_MAX_COST:.0%} against the control's and its longest gap is at most {GAP_BOUND_S} s"}


RATIO_KEYS = ("wall_s", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "itl_max_s")


# ---------------------------------------------------------------------------
# Workloads: each sends its requests on a schedule and measures what clients see.
# ---------------------------------------------------------------------------


def random_ids(rng, vocab, count):
    return [rng.randrange(vocab) for _ in range(count)]


def run_requests(server, plan):
    """plan: (start offset s, input_ids, max_new_tokens[, sampling params]) per request, all streamed
    at once. Returns the wall time and each request's stream result."""
    results = [None] * len(plan)
    start = time.monotonic()

    def send(i):
        at, ids, tokens, *sampling = plan[i]
        time.sleep(max(0.0, start + at - time.monotonic()))
        try:
            results[i] = stream(server.url, ids, tokens, **(sampling[0] if sampling else {}))
        except (RequestFailed, OSError, http.client.HTTPException) as error:
            results[i] = error

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(plan))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [r for r in results if not isinstance(r, dict)]
    if failed:  # a workload with a request missing measures something else: the setup's error, not a figure
        raise RequestFailed(f"{len(failed)} of {len(plan)} requests failed, the first: {failed[0]!r}"[:500])
    return time.monotonic() - start, results


def metrics(wall, results, gap_requests=None):
    """Wall time, output tokens/s, time to first token and inter-token gaps (of `gap_requests`, by
    index, or all), cached prompt tokens."""
    gap_requests = range(len(results)) if gap_requests is None else gap_requests
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for i in gap_requests for g in results[i]["gaps"])
    out = sum(len(r["output_ids"]) for r in results)
    return {
        "requests": len(results), "wall_s": round(wall, 3), "output_tokens": out,
        "output_tok_s": round(out / wall, 1),
        "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p99_s": round(_percentile(ttft, 99), 4),
        "itl_p50_s": round(_percentile(gaps, 50), 4), "itl_p99_s": round(_percentile(gaps, 99), 4),
        "itl_max_s": round(gaps[-1], 4),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "outputs": [output_digest(r["output_ids"]) for r in results],
    }


def rl(server, run, seed):
    """--groups prompts x --samples samples, all at once, as a rollout step sends them: sampled at
    temperature 1.0, each sample with its own sampling_seed (deterministic SGLang seeds every request
    alike without one, and a group's samples would all be the same rollout)."""
    plan = rl_requests(seed, run.config["vocab_size"], run.args.groups, run.args.samples)
    wall, results = run_requests(server, [(0.0, *request) for request in plan])
    groups = [results[g:g + run.args.samples] for g in range(0, len(results), run.args.samples)]
    return {**metrics(wall, results),
            "distinct_samples_per_group": [len({tuple(r["output_ids"]) for r in group}) for group in groups],
            "workload": f"{run.args.groups} prompts of 1000-3000 tokens x {run.args.samples} samples, "
                        "128-512 new tokens per prompt, all sent at once; temperature 1.0, a sampling_seed per sample"}


def rl_requests(seed, vocab, groups, samples):
    """The rollouts' requests, groups in order: (prompt ids, new tokens, sampling params) per sample.
    benchmarks/prefill_steps.py schedules the same ones on CPU."""
    rng, plan = random.Random(f"rl:{seed}"), []
    for _ in range(groups):
        prompt, tokens = random_ids(rng, vocab, rng.randint(1000, 3000)), rng.randint(128, 512)
        plan += [(prompt, tokens, {"temperature": 1.0, "sampling_seed": len(plan) + sample}) for sample in range(samples)]
    return plan


def alike_groups(entry):
    """How many rollout groups of a setup (every round) came back with all their samples alike: a
    rollout that does not sample as RL samples, so its figures do not stand for RL."""
    rounds = [entry.get("workloads", {})] + entry.get("repeats", [])
    return sum(1 for r in rounds for n in r.get("rl", {}).get("distinct_samples_per_group", ()) if n == 1)


def agent(server, run, seed):
    """Conversations side by side, turns in order: each turn's prompt is the last prompt, its answer
    and a tool output."""
    starts, tools = agent_parts(seed, run.config["vocab_size"], run.args.conversations, run.args.turns)
    results = [[] for _ in starts]

    def converse(c):
        prompt = starts[c]
        for turn in range(run.args.turns):
            result = stream(server.url, prompt, AGENT_ANSWER_TOKENS)
            results[c].append(result)
            prompt = prompt + result["output_ids"] + tools[c][turn]

    begin = time.monotonic()
    with ThreadPoolExecutor(len(starts)) as pool:
        list(pool.map(converse, range(len(starts))))
    flat = [r for turns in results for r in turns]
    return {**metrics(time.monotonic() - begin, flat),
            "longest_prompt_tokens": max(r["prompt_tokens"] for r in flat),
            "workload": f"{run.args.conversations} conversations x {run.args.turns} turns after a shared "
                        "1500-token system prompt; each turn appends the answer (128 tokens) and a tool "
                        "output of 800-1500 tokens"}


AGENT_ANSWER_TOKENS = 128


def agent_parts(seed, vocab, conversations, turns):
    """The agents' first prompts (a shared 1500-token system prompt, then 300-700 tokens each) and each
    turn's tool output (800-1500 tokens). benchmarks/prefill_steps.py schedules the same ones on CPU."""
    rng = random.Random(f"agent:{seed}")
    system = random_ids(rng, vocab, 1500)
    starts = [system + random_ids(rng, vocab, rng.randint(300, 700)) for _ in range(conversations)]
    tools = [[random_ids(rng, vocab, rng.randint(800, 1500)) for _ in range(turns)] for _ in starts]
    return starts, tools


INTERACTIVE_DECODERS, INTERACTIVE_TOKENS = 32, 1024
INTERACTIVE_LONG = (8192, 16384, 32768, 12288, 24576, 8192, 32768, 16384, 24576, 12288)


def interactive(server, run, seed):
    """Requests decoding while long prompts keep arriving: the gaps the decoding requests see."""
    rng, vocab = random.Random(f"interactive:{seed}"), run.config["vocab_size"]
    plan = [(0.02 * i, random_ids(rng, vocab, 1024), INTERACTIVE_TOKENS) for i in range(INTERACTIVE_DECODERS)]
    plan += [(1.0 + i, random_ids(rng, vocab, n), 16) for i, n in enumerate(INTERACTIVE_LONG)]
    wall, results = run_requests(server, plan)
    long_ttft = sorted(r["ttft"] for r in results[INTERACTIVE_DECODERS:])
    return {**metrics(wall, results, range(INTERACTIVE_DECODERS)),
            "long_ttft_p50_s": round(statistics.median(long_ttft), 4), "long_ttft_max_s": round(long_ttft[-1], 4),
            "workload": f"{INTERACTIVE_DECODERS} requests of 1024 tokens decoding {INTERACTIVE_TOKENS} from t=0; "
                        f"prompts of {', '.join(map(str, INTERACTIVE_LONG))} tokens (16 new) arriving one a second "
                        "from t=1 s; gaps are the decoding requests'"}


def streamed(server, run, seed):
    """The earlier cost workload (real_server.py's, before this benchmark)."""
    rng, vocab = random.Random(f"streamed:{seed}"), run.config["vocab_size"]
    plan = [(0.0, random_ids(rng, vocab, 256), 192) for _ in range(8)]
    plan += [(0.5 + 0.4 * i, random_ids(rng, vocab, 6144), 8) for i in range(6)]
    wall, results = run_requests(server, plan)
    return {**metrics(wall, results, range(8)),
            "workload": "8 requests of 256 tokens decoding 192; 6 prompts of 6144 tokens arriving every 0.4 s from 0.5 s"}


WORKLOADS = {"rl": rl, "agent": agent, "interactive": interactive, "streamed": streamed}


def warm_up(server, run):
    """Every shape and sampling mode the workloads use once, unmeasured: a rollout group, sampled as
    rl samples (one sample alone, then four at once), a second agent turn, a long prompt.

    SGLang's seeded sampler (multinomial_with_seed) is torch.compile'd: it compiles at its first
    sampled batch, and again at its first batch of several rows (torch specializes a batch of one).
    A greedy warm-up left that to the first timed rollouts on a fresh machine: call7's defaults, timed
    first, stalled 4 s and 3 s there (time to first token 8.08 s; 2.05 s when call6 timed them
    second), so the setup each earlier run timed first lost rollout throughput (docs/serving.md)."""
    rng, vocab = random.Random("warm-up"), run.config["vocab_size"]
    prompt = random_ids(rng, vocab, 2000)
    sampled = [{"temperature": 1.0, "sampling_seed": seed} for seed in range(4)]
    stream(server.url, prompt, 8, **sampled[0])
    run_requests(server, [(0.0, prompt, 32, params) for params in sampled]
                 + [(0.0, random_ids(rng, vocab, 16384), 8)])
    first = stream(server.url, prompt, 16)
    stream(server.url, prompt + first["output_ids"] + random_ids(rng, vocab, 1000), 16)


def long_prompts(server, lengths, run):
    """One prompt at a time, growing: served, refused with an error (HTTP status and message), or the
    server gone. Stops at the first failure."""
    rng, vocab = random.Random("long"), run.config["vocab_size"]
    outcomes = []
    for tokens in lengths:
        began = time.monotonic()
        try:
            result = stream(server.url, random_ids(rng, vocab, tokens), 4, timeout=300)
            outcome = "served"
            detail = f"ttft {result['ttft']:.2f} s"
        except RequestFailed as error:
            outcome, detail = "refused", str(error)[:500]
        except (OSError, http.client.HTTPException) as error:
            outcome, detail = "server gone", f"{type(error).__name__}: {error}"[:500]
        alive = server.wait_ready(timeout=10)
        outcomes.append({"tokens": tokens, "outcome": outcome if alive or outcome != "served" else "served, then gone",
                         "detail": detail, "server_alive_after": alive, "seconds": round(time.monotonic() - began, 2)})
        if outcome != "served" or not alive:
            tail = [line for line in server.log().splitlines() if "Error" in line or "error" in line][-5:]
            outcomes[-1]["log_errors"] = tail
            break
    return outcomes


class RequestFailed(Exception):
    """The server answered the request with an error."""


def stream(url, input_ids, max_new_tokens, timeout=900, on_first_token=None, **sampling):
    """One streamed /generate (greedy unless `sampling` says otherwise; ignore_eos): time to first
    token, gaps between later tokens, the output ids, and the prompt's cached tokens.
    on_first_token is called once the first token is in (a caller waiting for a batch to decode)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **sampling}
    body = {"input_ids": input_ids, "stream": True, "sampling_params": params}
    host, port = url.split("//")[1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    sent = time.monotonic()
    connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RequestFailed(f"HTTP {response.status}: {response.read()[:400]!r}")
    times, seen, last = [], 0, None
    for line in response:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        last = json.loads(line[5:])
        if "error" in last:
            raise RequestFailed(str(last["error"])[:400])
        tokens = last["meta_info"]["completion_tokens"]
        now = time.monotonic()
        if on_first_token is not None and seen == 0 and tokens > 0:
            on_first_token()
        times += [now] * (tokens - seen)
        seen = tokens
    connection.close()
    if last is None or seen != max_new_tokens or len(last.get("output_ids", ())) != seen:
        raise RequestFailed(f"stream ended after {seen} of {max_new_tokens} tokens: {str(last)[:300]}")
    return {"ttft": times[0] - sent, "gaps": [b - a for a, b in zip(times, times[1:]) if b > a],
            "output_ids": last["output_ids"], "prompt_tokens": last["meta_info"]["prompt_tokens"],
            "cached_tokens": last["meta_info"].get("cached_tokens", 0)}


_percentile = real_server._percentile

if __name__ == "__main__":
    sys.exit(main())
