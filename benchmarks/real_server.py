"""The plugin inside real SGLang servers on a GPU: bit-exactness per configuration and the startup
refusals.

Every other figure in this repository comes from SGLang's scheduler driven on
CPU and batches replayed through fa2 by our own code. This script starts real
servers (`sglang serve`, or `python -m sglang.launch_server` on releases
without it) with SGLANG_PLUGINS=chunk_align, so what runs is SGLang's own
forward path: load_plugins() in every process, the live FlashInferAttnBackend,
CUDA graphs for decode, the overlap scheduler and the radix tree. Run it on
your own model, or on dummy weights from a folder holding only a model's
config.json (benchmarks/models/):

    python benchmarks/real_server.py --model-path Qwen/Qwen3-8B --out real_server.json
    python benchmarks/real_server.py --model-path benchmarks/models/granite-3.1-8b --dummy --out real_server.json

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
- rules-off: in the matrix, SGLANG_CHUNK_ALIGN_RULES=0 (upstream's length
  alignment alone) at chunk 256, checked the same way and reported as it is.

What serving costs, side by side with the alternatives, is benchmarks/serving.py's.

The JSON (--out) holds every server's command, its plugin startup line, the
verify report, and the versions of the stack; it is rewritten after each
server, so a run cut short keeps what it did.
"""

import argparse
import json
import os
import platform
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
from sglang_chunk_align.compat import installed_release

READY_TIMEOUT_S = 420
# SGLang loads every installed plugin while SGLANG_PLUGINS is unset: stock SGLang names none of them.
STOCK = {"SGLANG_PLUGINS": "none"}
PLUGIN_LINE = re.compile(r"sglang-chunk-align[^\n]*")
SPLIT_LINE = re.compile(r"sglang-chunk-align: split attention: prefill batch (\d+) split")
# What each refusal must say (the plugin's chunk_size_error, stock's check_truncation_align_fits_chunk).
REFUSALS = (
    ("plugin refuses chunk 100", {"SGLANG_PLUGINS": "chunk_align"}, 100, "Chunked prefill is aligned to 128 tokens"),
    ("plugin refuses chunk 200", {"SGLANG_PLUGINS": "chunk_align"}, 200, "not a multiple of"),
    ("stock refuses chunk 256", STOCK, 256, "Chunked prefill is aligned to 4096 tokens"),
)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dummy", action="store_true", help="--load-format dummy --skip-tokenizer-init (config.json only)")
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
    parser.add_argument("--port", type=int, default=31000, help="first port; each server takes the next")
    parser.add_argument("--deadline-s", type=float, default=3600, help="start no new server after this many seconds")
    parser.add_argument("--logs", default=None, help="folder for server logs (default: a temporary one)")
    parser.add_argument("--out", required=True)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more server arguments")
    args = parser.parse_args(argv)
    run = Run(args)
    try:
        for phase in args.phases.split(","):
            PHASES[phase](run)
    finally:
        run.stop()
        run.save()
    print(json.dumps(run.summary(), indent=2))
    return 0 if run.all_identical() else 1


class Run:
    """The servers of one run, their ports, logs and results; the JSON is rewritten after each."""

    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.next_port = args.port
        self.logs = args.logs or tempfile.mkdtemp(prefix="real_server_")
        os.makedirs(self.logs, exist_ok=True)
        self.config = _model_config(args.model_path)
        self.results = {"stack": stack(), "model": self.config, "servers": []}
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
            self.save()

    def save(self):
        with open(self.args.out + ".tmp", "w") as file:
            json.dump(self.results, file, indent=1)
        os.replace(self.args.out + ".tmp", self.args.out)

    def summary(self):
        rows = [_row(entry) for entry in self.results["servers"]]
        return {"stack": self.results["stack"], "servers": rows}

    def all_identical(self):
        return all(e.get("expect_identical") is False or e.get("ok", True) for e in self.results["servers"])


class Server:
    """One SGLang server process group, its log, and whether it came up."""

    def __init__(self, run, name, chunk, page, env=(), extra=(), backend="flashinfer", deterministic=True,
                 decode_graph_bs=8, max_total_tokens=None):
        self.run, self.name, self.port = run, name, run.port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = launcher() + [
            "--model-path", run.args.model_path, "--host", "127.0.0.1", "--port", str(self.port),
            "--attention-backend", backend, *(["--enable-deterministic-inference"] if deterministic else []),
            "--chunked-prefill-size", str(chunk), "--page-size", str(page),
            "--mem-fraction-static", str(run.args.mem_fraction_static),
            "--max-total-tokens", str(max_total_tokens or run.args.max_total_tokens),
            decode_graph_flag(), str(decode_graph_bs),
            *(["--load-format", "dummy", "--skip-tokenizer-init"] if run.args.dummy else []),
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
        *(["--input-ids", "--vocab-size", str(run.config["vocab_size"])] if run.args.dummy else []),
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
    if "rules-off" in run.args.phases.split(","):
        configs.append((256, pages[0], "off", False))
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


PHASES = {"matrix": phase_matrix, "refusals": phase_refusals, "rules-off": lambda run: None}  # rules-off runs in the matrix

if __name__ == "__main__":
    sys.exit(main())
