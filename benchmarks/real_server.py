"""The plugin inside real SGLang servers on a GPU: bit-exactness per configuration and the startup
refusals.

Every other figure in this repository comes from SGLang's scheduler driven on
CPU and batches replayed through fa2 by our own code. This script starts real
servers (`sglang serve`, or `python -m sglang.launch_server` on releases
without it) with SGLANG_PLUGINS=chunk_align, so what runs is SGLang's own
forward path: load_plugins() in every process, the live FlashInferAttnBackend,
CUDA graphs for decode, the overlap scheduler and the radix tree. Run it on
your own model, or on weights made for a folder holding only a model's
config.json (benchmarks/models/): `--weights random` writes a well-scaled
random checkpoint for it (benchmarks/random_checkpoint.py), where a last-bit
difference in attention shows in the logprobs; `--weights dummy` serves
SGLang's dummy weights (uniform in ±1e-3, norms included), which hide most:

    python -m benchmarks.real_server --model-path Qwen/Qwen3-8B --out real_server.json
    python -m benchmarks.real_server --model-path benchmarks/models/qwen2.5-7b --weights random --out real_server.json

(SGLang 0.5.23 builds Qwen3's and Llama's MLP with the CuTe DSL installed:
benchmarks/models/qwen3-8b needs nvidia-cutlass-dsl, as a normal install has.)

Phases (--phases, all by default):

- matrix: a stock, unchunked reference server per page size (radix off, each
  prompt answered alone and cold), then the plugin at every --chunks x
  --pages x radix off/on, --parallel servers at a time on the one GPU, each
  checked with `sglang-chunk-align verify` against its reference. The
  reference's cold answers are recorded once (verify --baseline-cache), so the
  servers share it without ever batching with each other there. With
  --one-model-at-a-time the reference stops once they are recorded and the
  plugin servers are checked against the recorded answers alone (verify
  --recorded): for a model the GPU cannot hold twice;
- refusals: the plugin refusing chunks 100 and 200 at startup, and stock
  SGLang (no plugin) refusing 256;
- rules-off: in the matrix, the control: SGLANG_CHUNK_ALIGN_RULES=0
  (upstream's length alignment alone) at every chunk of --chunks, checked the
  same way; it must be found inexact. Each plugin server's verdict (the
  JSON's "verdicts") is "exact" only where the control at its chunk failed
  requests in the same run, and "could not see" where the control passed: a
  check that passes its control proves little;
- large-batch: decode batches larger than the CUDA graphs' (issue 46's
  eager-decode hole): --large-batch-requests prompts of about 3,000 tokens,
  each sent alone and then all at once, to the plugin with a decode graph of
  8 (the batch outgrows it), to the same without the unsplit decode plan
  (SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE=0, the control, which must differ), and
  to the plugin with --disable-cuda-graph; every request's generated tokens
  and their logprobs compared with its answer alone, and the all-at-once
  pass's output tokens per second.

What serving costs, side by side with the alternatives, is benchmarks/serving.py's.

The JSON (--out) holds every server's command, its plugin startup line, the
verify report, and the versions of the stack; it is rewritten after each
server, so a run cut short keeps what it did.
"""

import argparse
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from benchmarks import random_checkpoint
from sglang_chunk_align.compat import installed_release
from sglang_chunk_align.tools import verify as verify_tool

READY_TIMEOUT_S = 420
# SGLang loads every installed plugin while SGLANG_PLUGINS is unset: stock SGLang names none of them.
STOCK = {"SGLANG_PLUGINS": "none"}
PLUGIN_LINE = re.compile(r"sglang-chunk-align[^\n]*")
SPLIT_LINE = re.compile(r"sglang-chunk-align: split attention: prefill batch (\d+) split")
# SGLang's line per prefill step (scheduler_components/metrics_reporter.py): new tokens, radix-hit tokens of
# the requests it begins, and whether a prefill CUDA graph replayed it.
PREFILL_LINE = re.compile(r"Prefill batch(?: \[\d+\])?, #new-seq: \d+, #new-token: (\d+), #cached-token: (\d+),"
                          r".*?cuda graph: (True|False)")
# What each refusal must say (the plugin's chunk_size_error, stock's check_truncation_align_fits_chunk).
REFUSALS = (
    ("plugin refuses chunk 100", {"SGLANG_PLUGINS": "chunk_align"}, 100, "Chunked prefill is aligned to 128 tokens"),
    ("plugin refuses chunk 200", {"SGLANG_PLUGINS": "chunk_align"}, 200, "not a multiple of"),
    ("stock refuses chunk 256", STOCK, 256, "Chunked prefill is aligned to 4096 tokens"),
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    random_checkpoint.add_arguments(parser)
    parser.add_argument("--phases", default="matrix,refusals,rules-off")
    parser.add_argument("--chunks", default="128,256,1024")
    parser.add_argument("--pages", default="1,16")
    parser.add_argument("--radix", default="off,on", help="off, on, default (the plugin decides): comma-separated")
    parser.add_argument("--prompts", type=int, default=32, help="verify --prompts (requests per workload)")
    parser.add_argument("--parallel", type=int, default=3, help="plugin servers at a time in the matrix")
    parser.add_argument("--one-model-at-a-time", action="store_true",
                        help="stop each reference once its answers are recorded and check against those alone, "
                             "so the GPU never holds the model twice (with --parallel 1; for models it cannot)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8,
                        help="per server; SGLang 0.5.23 counts the memory other servers hold against it")
    parser.add_argument("--max-total-tokens", type=int, default=65536,
                        help="each server's KV pool, fixed so that servers sharing the GPU leave each other room")
    parser.add_argument("--large-batch-requests", type=int, default=64, help="large-batch: prompts sent at once")
    parser.add_argument("--large-batch-new-tokens", type=int, default=64, help="large-batch: tokens each generates")
    parser.add_argument("--port", type=int, default=31000, help="first port; each server takes the next")
    parser.add_argument("--deadline-s", type=float, default=3600, help="start no new server after this many seconds")
    parser.add_argument("--logs", default=None, help="folder for server logs (default: a temporary one)")
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more server arguments")
    args = parser.parse_args(argv)
    run = start_run(parser, args)
    try:
        for phase in args.phases.split(","):
            PHASES[phase](run)
    finally:
        run.stop()
        run.save()
    print(json.dumps(run.summary(), indent=2))
    return 0 if run.all_identical() else 1


def start_run(parser, args, run_class=None):
    """run_class(args) (Run by default), or a usage error, one line and exit 2, where --weights
    cannot give its weights (a random checkpoint for a folder without config.json, say)."""
    try:
        return (run_class or Run)(args)
    except random_checkpoint.CheckpointError as error:
        parser.error(str(error))


class Run:
    """The servers of one run, their ports, logs and results; the JSON is rewritten after each."""

    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.next_port = args.port
        self.logs = args.logs or tempfile.mkdtemp(prefix="real_server_")
        os.makedirs(self.logs, exist_ok=True)
        self.config = _model_config(args.model_path)
        self.model_path, self.weight_args, weights = random_checkpoint.server_weights(
            args.model_path, args.weights, args.checkpoints, args.weights_seed)
        self.input_ids = random_checkpoint.needs_input_ids(args.weights)
        self.results = {"stack": stack(), "model": self.config, "weights": weights, "servers": [], "verdicts": [],
                        "large_batch": []}
        self.lock = threading.Lock()
        self.references = {}  # page size -> (reference Server, its baseline cache file)

    def reference(self, page):
        """A stock, unchunked server with the radix cache off for `page`, started once, and the file
        of its cold answers (recorded by verifying it against itself)."""
        with self.lock:
            if page in self.references:
                return self.references[page]
        server = Server(self, f"reference-page{page}", -1, page, STOCK, extra=["--disable-radix-cache"])
        if not server.wait_ready():
            self.record({**server.describe(), "ok": False, "error": server.log()[-3000:]})
            raise SystemExit(f"the reference server for page {page} did not start: see {server.log_path}")
        cache = os.path.join(self.logs, f"baseline-page{page}.json")
        entry = verify(self, server, server, cache, radix=False)
        self.record({**entry, "role": "reference: stock, unchunked, radix off, checked against itself"})
        if self.args.one_model_at_a_time:
            server.stop()
            server = None  # the plugin servers are checked against its recorded answers alone
        self.references[page] = server, cache
        return server, cache

    def stop(self):
        for server, _ in self.references.values():
            if server is not None:
                server.stop()

    def time_left(self):
        return self.args.deadline_s - (time.monotonic() - self.started)

    def port(self):
        """The next port nothing listens on: a server left over from an earlier run would answer
        /health for the new one."""
        with self.lock:
            self.next_port += 1
            while _listening(self.next_port):
                self.next_port += 1
            return self.next_port

    def record(self, entry, key="servers"):
        with self.lock:
            self.results[key].append(entry)
            if key == "servers":  # the verdicts follow the servers (a subclass's results may hold none)
                self.results["verdicts"] = verdicts(self.results["servers"])
            self.save()

    def save(self):
        with open(self.args.out + ".tmp", "w") as file:
            json.dump(self.results, file, indent=1)
        os.replace(self.args.out + ".tmp", self.args.out)

    def summary(self):
        rows = [_row(entry) for entry in self.results["servers"]]
        return {"stack": self.results["stack"], "weights": self.results["weights"], "servers": rows,
                "verdicts": self.results["verdicts"], "large_batch": [_large_batch_row(e) for e in self.results["large_batch"]]}

    def all_identical(self):
        return all(e.get("expect_identical") is False or e.get("ok", True) for e in self.results["servers"])


class Server:
    """One SGLang server process group, its log, and whether it came up."""

    def __init__(self, run, name, chunk, page, env=(), extra=(), backend="flashinfer", deterministic=True,
                 decode_graph_bs=8, max_total_tokens=None):
        self.run, self.name, self.port = run, name, run.port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = launcher() + [
            "--model-path", run.model_path, "--host", "127.0.0.1", "--port", str(self.port),
            "--attention-backend", backend, *(["--enable-deterministic-inference"] if deterministic else []),
            "--chunked-prefill-size", str(chunk), "--page-size", str(page),
            "--mem-fraction-static", str(run.args.mem_fraction_static),
            "--max-total-tokens", str(max_total_tokens or run.args.max_total_tokens),
            *([decode_graph_flag(), str(decode_graph_bs)] if decode_graph_bs else ["--disable-cuda-graph"]),
            *run.weight_args,
            *extra, *[a for a in run.args.extra if a != "--"],
        ]
        # The setup's own switches alone: none of the plugin's leaks in from the shell that runs this.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_CHUNK_ALIGN_")}
        self.env = {**inherited, "HF_HUB_OFFLINE": "1", **dict(env)}
        self.log_path = os.path.join(run.logs, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout=READY_TIMEOUT_S):
        """True once /health answers 200; False if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(1)
        return False

    def log(self):
        with open(self.log_path, errors="replace") as file:
            return file.read()

    def plugin_lines(self):
        return sorted(set(PLUGIN_LINE.findall(self.log())))

    def split_batches(self):
        """How many prefill batches split attention split, at least: the plugin logs the 1st, 10th,
        100th... at INFO (0: none logged)."""
        return max((int(n) for n in SPLIT_LINE.findall(self.log())), default=0)

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def describe(self):
        return {"name": self.name, "command": " ".join(self.command),
                "env": {k: v for k, v in self.env.items() if k.startswith(("SGLANG_PLUGINS", "SGLANG_CHUNK_ALIGN"))},
                "plugin_lines": self.plugin_lines(), "split_batches_at_least": self.split_batches()}


def prefill_steps(log_text):
    """What a server logged of its prefill steps in `log_text`: the steps, their new and radix-hit tokens, and
    how many replayed a prefill CUDA graph. Issue 48 weighs setups by these: a grid that rounds radix hits
    down shows as more steps and fewer cached tokens than triton's."""
    steps = PREFILL_LINE.findall(log_text)
    return {"steps": len(steps), "new_tokens": sum(int(new) for new, _, _ in steps),
            "cached_tokens": sum(int(cached) for _, cached, _ in steps),
            "graph_steps": sum(graph == "True" for _, _, graph in steps)}


def _listening(port):
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def decode_graph_flag():
    """The flag for the largest decode batch with a CUDA graph (a short capture), by the release's
    own argument parser: 0.5.22 split --cuda-graph-max-bs into decode and prefill flags, and
    0.5.23 refuses the old name as ambiguous."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    old = "--cuda-graph-max-bs"
    return old if old in parser._option_string_actions else "--cuda-graph-max-bs-decode"


def launcher():
    """`sglang serve` where this release has it (0.5.23 recommends it), else launch_server."""
    from importlib import util

    if util.find_spec("sglang.cli.serve") is None:
        return [sys.executable, "-m", "sglang.launch_server"]
    return [sys.executable, "-c", "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; main()", "serve"]


def verify(run, server, reference, cache, radix, expect_identical=True):
    """`sglang-chunk-align verify --json` of `server` against `reference`, with the shared baseline cache;
    against the reference's answers recorded in `cache` alone where `reference` is None."""
    against = (["--recorded", cache] if reference is None else
               ["--baseline-cache", cache, *(["--reference", reference.url] if reference is not server else [])])
    command = [
        sys.executable, "-m", "sglang_chunk_align.tools.cli", "verify", "--server", server.url, "--json",
        "--prompts", str(run.args.prompts), *against,
        *(["--input-ids", "--vocab-size", str(run.config["vocab_size"])] if run.input_ids else []),
        *([] if radix else ["--no-radix"]),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {"ok": False, "problems": [f"verify exited {done.returncode}: {done.stderr.strip()[-500:]}"]}
    return {**server.describe(), "verify_command": " ".join(command), "verify_exit": done.returncode,
            "ok": report.get("ok"), "expect_identical": expect_identical, "verify": report}


def phase_matrix(run):
    """The plugin at every chunk x page x radix (and the rules off at 256, if asked), --parallel at a time."""
    pages = [int(p) for p in run.args.pages.split(",")]
    configs = [
        (chunk, page, radix, True)
        for page in pages
        for radix in run.args.radix.split(",")
        for chunk in (int(c) for c in run.args.chunks.split(","))
    ]
    if "rules-off" in run.args.phases.split(","):  # the control, at every chunk
        configs += [(int(chunk), pages[0], "off", False) for chunk in run.args.chunks.split(",")]
    with ThreadPoolExecutor(len(pages)) as pool:  # the references start side by side
        list(pool.map(run.reference, pages))
    for wave in range(0, len(configs), run.args.parallel):
        if run.time_left() < 60:
            run.record({"name": "matrix cut short", "ok": None, "expect_identical": False,
                        "skipped": [list(c) for c in configs[wave:]]})
            break
        threads = [threading.Thread(target=_check_plugin, args=(run, *config))
                   for config in configs[wave:wave + run.args.parallel]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def _check_plugin(run, chunk, page, radix, rules):
    """radix "on" or "off": the plugin's switch set so and the server flag to match; "default":
    neither, so the plugin decides (off with a mamba prefix cache) and its startup line says why."""
    reference, cache = run.reference(page)
    env = {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_RULES": "1" if rules else "0",
           **({} if radix == "default" else {"SGLANG_CHUNK_ALIGN_RADIX_CACHE": "1" if radix == "on" else "0"})}
    name = f"plugin-chunk{chunk}-page{page}-radix{radix}" + ("" if rules else "-rules0")
    server = Server(run, name, chunk, page, env, extra=["--disable-radix-cache"] if radix == "off" else [])
    try:
        if not server.wait_ready():
            run.record({**server.describe(), "ok": False, "error": server.log()[-3000:]})
            return
        entry = verify(run, server, reference, cache, radix == "on", expect_identical=rules)
        run.record({**entry, "chunk": chunk, "page": page, "radix": radix, "rules": rules})
    finally:
        server.stop()


def phase_refusals(run):
    servers = [(name, text, Server(run, name.replace(" ", "-"), chunk, 1, env))
               for name, env, chunk, text in REFUSALS]
    for name, text, server in servers:
        came_up = server.wait_ready()
        server.stop()
        log = server.log()
        said = [line for line in log.splitlines() if text in line]
        run.record({**server.describe(), "refusal": name, "expected": text, "started": came_up,
                    "ok": not came_up and bool(said), "said": said[-1:] })


# large-batch's setups: (name, the plugin's switches, the decode graphs' largest batch (0: --disable-cuda-graph),
# whether every request must decode as it did alone).
LARGE_BATCH_SETUPS = (
    ("unsplit", {}, 8, True),
    ("split-control", {"SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE": "0"}, 8, False),
    ("unsplit-no-graphs", {}, 0, True),
)
LARGE_BATCH_PROMPT = (3000, 3555)  # tokens: every request's KV past the 2048 split the eager plan had
DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?cuda graph: (True|False), gen throughput \(token/s\): ([0-9.]+)")


def phase_large_batch(run, start_server=None):
    """Issue 46's eager-decode check: every request alone, then all at once, per setup; the servers
    start one after another and stay up, their alone passes run side by side, their all-at-once
    passes one after another (so each one's tokens per second is its own). `start_server`: what
    starts one (Server's signature; the tests' fake SGLang answers on CPU)."""
    rng = random.Random(f"large-batch:{run.args.large_batch_requests}")
    ids = verify_tool.TokenIds(run.config.get("vocab_size") or 32000)
    prompts = [ids.units(rng, rng.randint(*LARGE_BATCH_PROMPT)) for _ in range(run.args.large_batch_requests)]
    room = run.args.large_batch_requests * (LARGE_BATCH_PROMPT[1] + run.args.large_batch_new_tokens) + 4096
    setups = []
    for name, switches, graph_bs, expect in LARGE_BATCH_SETUPS:
        if run.time_left() < 180:
            run.record({"name": f"large-batch-{name}", "skipped": "deadline"}, "large_batch")
            continue
        server = (start_server or Server)(run, f"large-batch-{name}", 256, 1, {"SGLANG_PLUGINS": "chunk_align", **switches},
                        extra=["--decode-log-interval", "4"], decode_graph_bs=graph_bs, max_total_tokens=room)
        if server.wait_ready():
            setups.append((server, graph_bs, expect))
        else:
            run.record({**server.describe(), "ok": False, "error": server.log()[-3000:]}, "large_batch")
            server.stop()
    try:
        with ThreadPoolExecutor(max(1, len(setups))) as pool:
            alone = list(pool.map(lambda setup: _one_at_a_time(run, setup[0], prompts), setups))
        graphs_alone = next((a for a, (_, bs, _) in zip(alone, setups) if bs), None)
        for (server, graph_bs, expect), answers in zip(setups, alone):
            run.record(_all_at_once(run, server, prompts, answers, graph_bs, expect, graphs_alone), "large_batch")
    finally:
        for server, _, _ in setups:
            server.stop()


def _generate(run, client, prompt):
    """One greedy request's answer: its generated tokens and their logprobs (the prompt's last one's too)."""
    request = verify_tool.Request(prompt, len(prompt) - 1)
    return client.generate("input_ids", request, run.args.large_batch_new_tokens)


def _one_at_a_time(run, server, prompts):
    client = verify_tool.Server(server.url, verify_tool.TIMEOUT_S)
    client.flush()
    return [_generate(run, client, prompt) for prompt in prompts]


def _all_at_once(run, server, prompts, alone, graph_bs, expect, graphs_alone):
    """The all-at-once pass of one setup, compared request by request with its answers alone."""
    client = verify_tool.Server(server.url, verify_tool.TIMEOUT_S)
    client.flush()
    log_start = len(server.log())
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda prompt: _generate(run, client, prompt), prompts))
    seconds = time.monotonic() - started
    decode = [(int(n), graph == "True", float(tps)) for n, graph, tps in DECODE_LINE.findall(server.log()[log_start:])]
    eager = [tps for n, graph, tps in decode if not graph and n > max(graph_bs, 1)]
    differences = [verify_tool.first_difference(a, t) for a, t in zip(alone, together)]
    same = [d is None for d in differences]
    entry = {
        **server.describe(), "decode_graph_max_bs": graph_bs or None, "expect_identical": expect,
        "requests": len(prompts), "identical": sum(same), "ok": all(same) if expect else not all(same),
        "differing": [i for i, s in enumerate(same) if not s], "first_differences": differences,
        "seconds_all_at_once": round(seconds, 2),
        "output_tokens_per_s": round(sum(len(t.output) for t in together) / seconds, 1),
        "eager_decode_steps_logged": len(eager), "largest_decode_batch": max((n for n, _, _ in decode), default=0),
        "eager_gen_throughput_median": _percentile(sorted(eager), 50) if eager else None,
        "prompt_tokens": [len(p) for p in prompts],
    }
    if graphs_alone is not None and graph_bs == 0:  # eager alone against the graphs' server alone
        entry["alone_identical_to_graphs"] = sum(verify_tool.first_difference(a, g) is None
                                                 for a, g in zip(alone, graphs_alone))
    return entry


def _large_batch_row(entry):
    keys = ("name", "ok", "expect_identical", "identical", "requests", "decode_graph_max_bs", "largest_decode_batch",
            "eager_decode_steps_logged", "eager_gen_throughput_median", "output_tokens_per_s", "alone_identical_to_graphs",
            "skipped")
    return {k: entry[k] for k in keys if k in entry}


def failed_fraction(entry):
    """The fraction of a verify report's requests, over every workload and pass, that were not identical."""
    passes = [p for w in (entry.get("verify") or {}).get("workloads", {}).values() for p in w["passes"].values()]
    total = sum(p["requests"] for p in passes)
    return (total - sum(p["identical"] for p in passes)) / total if total else None


def verdicts(servers):
    """Each plugin server's verdict beside its control (the rules off at its chunk and page, same run):
    "exact" where it was identical and the control failed requests, "could not see" where the control
    passed or did not run, "inexact" where the plugin itself differed, "cut short" where a time limit
    interrupted its verify before any request differed (the workloads compared are in its entry)."""
    controls = {(e.get("chunk"), e.get("page")): e for e in servers if e.get("rules") is False}
    rows = []
    for entry in servers:
        if entry.get("rules") is not True:
            continue
        control = controls.get((entry["chunk"], entry["page"]))
        fraction = failed_fraction(control) if control else None
        cut_short = "interrupted" in (entry.get("verify") or {}) and not failed_fraction(entry)
        verdict = ("cut short" if cut_short else "inexact" if not entry.get("ok") else
                   "exact" if fraction else "could not see")
        rows.append({"server": entry["name"], "verdict": verdict, "plugin_failed_fraction": failed_fraction(entry),
                     "control": control["name"] if control else None, "control_failed_fraction": fraction})
    return rows


def _percentile(values, q):
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def _row(entry):
    """One line of the summary table per server."""
    report = entry.get("verify") or {}
    passes = {f"{w}/{p}": f"{r['identical']}/{r['requests']} identical, cached {r['cached_tokens_total']}"
              for w, workload in report.get("workloads", {}).items() for p, r in workload["passes"].items()}
    return {"name": entry.get("name"), "ok": entry.get("ok"), **passes,
            **({"problems": report["problems"]} if report.get("problems") else {}),
            **({"said": entry["said"]} if "said" in entry else {})}


def _model_config(path):
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        return {"model_path": path}
    with open(config_file) as file:
        config = json.load(file)
    keep = ("architectures", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers", "vocab_size")
    return {"model_path": path, **{k: config.get(k) for k in keep}}


def stack():
    """What ran: the packages, the GPU and its driver."""
    dists = ("sglang", "sglang-kernel", "flashinfer-python", "torch", "sglang-chunk-align", "transformers")
    versions = {dist: installed_release(dist) for dist in dists}
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        gpu = None
    return {**versions, "python": platform.python_version(), "gpu": gpu}


PHASES = {"matrix": phase_matrix, "refusals": phase_refusals, "large-batch": phase_large_batch,
          "rules-off": lambda run: None}  # rules-off runs in the matrix

if __name__ == "__main__":
    sys.exit(main())
