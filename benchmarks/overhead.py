"""What the plugin costs on CPU, with the real SGLang 0.5.23 wheel: the time per admission decision,
stock against the plugin, and what loading it adds to each SGLang process.

    python -m benchmarks.overhead [--rounds N] [--decisions N] [--runs N] [--spawn] [--json PATH] [--quick]

1. Admission decisions. SGLang's real PrefillAdder, tree, pools and policy,
   built by sglang_chunk_align.harness.scheduler_driver.SchedulerDriver, decide (a) a new request
   (`req.init_next_round_input(tree)` + `PrefillAdder.add_one_req`, which
   cover the plugin's match, solo-tile and grid-cut wrappers) and (b) a
   continuation (`PrefillAdder.add_chunked_req`). The two arms differ only in
   the plugin's hooks: stock SGLang with the split tile at 128
   (stock-split-128) against the plugin with its grid rules (plugin-256),
   both chunk 256 and truncation_align_size 128, radix cache off (the
   deterministic default). Each arm is set up by the scheduler's own startup
   check (scheduler_driver.sglang_config + truncation_align_size); the arms
   alternate in short rounds, ABBA, after one warm-up round. Every decision
   gets a fresh adder and request, built outside the timed region, with the
   garbage collector off while a round runs.
2. Load time. SGLang's own load_plugins() with SGLANG_PLUGINS=chunk_align
   against a name nothing installs, in processes that have imported only the
   detokenizer manager, the tokenizer manager or the scheduler. A 2-core
   machine spends ~20 CPU-seconds importing SGLang, so by default one
   `python -c` per module imports it (untimed; the three import in parallel,
   then measure one at a time) and forks one child per measurement, the arms
   alternating (ABBA). Each child is a process in which load_plugins() has
   never run; before the timer starts it copies every page it shares with its
   parent (MADV_POPULATE_WRITE): copy-on-write faults, which a fresh process
   never pays, added ~10 ms to the baseline and ~40 ms to chunk_align here.
   `--spawn` measures the slow, literal way: a fresh `python -c` per
   measurement. The plugin's bytecode is compiled first, as pip does when it
   installs a wheel: from an editable checkout under PYTHONDONTWRITEBYTECODE
   (set on this machine) every process would compile its source.

Timings are never asserted anywhere: tests/test_overhead_benchmark.py checks the plumbing.
"""

import argparse
import compileall
import gc
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from sglang_chunk_align.compat import installed_release

from sglang_chunk_align.harness.scheduler_driver import SchedulerDriver, sglang_config, truncation_align_size

from .scheduling import checkout_state
from .workload import CONFIGS, SHAPES, SMALL_WORKLOAD, RequestSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOCK = next(c for c in CONFIGS if c.name == "stock-split-128")
PLUGIN = next(c for c in CONFIGS if c.name == "plugin-256")
SHAPE = next(s for s in SHAPES if s.name == "g4-d128")
PROMPT, FIRST, OUTPUT = 1000, 64, 64  # tokens: a prompt longer than the chunk, a short batch member
LOAD_MODULES = {
    "detokenizer manager": "sglang.srt.managers.detokenizer_manager",
    "tokenizer manager": "sglang.srt.managers.tokenizer_manager",
    "scheduler": "sglang.srt.managers.scheduler",
}
# What loading may add (ms): SGLang loads plugins in every process, and one that never schedules
# (detokenizer, tokenizer manager) should pay almost nothing; a scheduler at most 50 ms beyond what
# SGLang imports there anyway.
LOAD_GOALS_MS = {"detokenizer manager": 20, "tokenizer manager": 20, "scheduler": 50}
LOAD_ARMS = {"chunk_align": "chunk_align", "baseline": "none_such"}  # arm -> SGLANG_PLUGINS
FULL = dict(rounds=40, decisions=300, runs=12)
QUICK = dict(rounds=2, decisions=20, runs=1)


# ---------------------------------------------------------------------------
# 1. Admission decisions
# ---------------------------------------------------------------------------

@contextmanager
def arm(cfg):
    """A SchedulerDriver under `cfg`, after the scheduler's startup check set the rules (or not)."""
    from sglang_chunk_align import prefill_hooks

    with sglang_config(cfg, radix=False) as server_args:
        align = truncation_align_size(server_args, SHAPE)
        rules = prefill_hooks.rules_in_force()
        if (rules is not None) != cfg.plugin:
            raise RuntimeError(f"{cfg.name}: grid rules {rules}, expected them {'on' if cfg.plugin else 'off'}")
        yield SchedulerDriver(SMALL_WORKLOAD, cfg, False, align), rules


def new_req(driver, prompt_len):
    return driver.make_req(RequestSpec(0, 0, prompt_len, -1, 0, OUTPUT), list(range(1000, 1000 + prompt_len)))


def time_new_request(driver, n):
    """A 1000-token request joins a batch that holds a 64-token one: every plugin wrapper on
    add_one_req's path works (solo tiles over a member, a grid cut of a chunked admission)."""
    times, outcomes = [], set()
    for _ in range(n):
        adder = driver.new_adder()
        first = new_req(driver, FIRST)
        first.init_next_round_input(driver.tree)
        adder.add_one_req(first, has_chunked_req=False, truncation_align_size=driver.align)
        req = new_req(driver, PROMPT)
        start = time.perf_counter_ns()
        req.init_next_round_input(driver.tree)
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=driver.align)
        times.append(time.perf_counter_ns() - start)
        outcomes.add(f"{result.name}, extend {req.extend_end - req.prefix_len} of {PROMPT}"
                     if req in adder.can_run_list else f"{result.name}, not admitted")
    return times, outcomes


def time_continuation(driver, n):
    """The 1000-token request after its first 256-token chunk ran, continued by a fresh adder each time."""
    driver.waiting = [new_req(driver, PROMPT)]
    driver.run_prefill(driver.get_new_batch_prefill())
    driver.merge_last_prefill()
    req = driver.chunked_req
    times, outcomes = [], set()
    for _ in range(n):
        adder = driver.new_adder()
        req.init_next_round_input()
        adder.chunked_req_limit = driver.policy.shortest_prefill_chunk_limit(
            req, driver.waiting, adder.rem_chunk_tokens or 0, 1
        )
        start = time.perf_counter_ns()
        left = adder.add_chunked_req(req)
        times.append(time.perf_counter_ns() - start)
        outcomes.add(f"extend {req.prefix_len}-{req.extend_end}, " + ("continues" if left is req else "finished"))
    return times, outcomes


DECISIONS = {"new request": time_new_request, "continuation": time_continuation}


def measure_decisions(rounds, decisions):
    """Per kind and arm: each round's decision times (ns), the outcomes and the rules each arm ran with."""
    raw = {kind: {"stock": [], "plugin": [], "outcomes": {}, "rules": {}} for kind in DECISIONS}
    for round_index in range(-1, rounds):  # round -1 warms up and is dropped
        order = (("stock", STOCK), ("plugin", PLUGIN))
        for name, cfg in order if round_index % 2 == 0 else order[::-1]:
            with arm(cfg) as (driver, rules):
                for kind, timer in DECISIONS.items():
                    gc.collect()
                    gc.disable()
                    try:
                        times, outcomes = timer(driver, decisions)
                    finally:
                        gc.enable()
                    if round_index >= 0:
                        raw[kind][name].append(times)
                        raw[kind]["outcomes"].setdefault(name, set()).update(outcomes)
                        raw[kind]["rules"].setdefault(name, set()).add(rules and rules.describe())
    for entry in raw.values():
        for field in ("outcomes", "rules"):
            entry[field] = {name: sorted(values, key=str) for name, values in entry[field].items()}
    return raw


def quartiles(values):
    if len(values) < 2:
        return values * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def summarize_decisions(raw):
    """Per kind: pooled medians, the ratio of each round's medians, and each arm's fastest round:
    other jobs only ever slow a round down, so the fastest rounds come nearest an idle machine."""
    summary = {}
    for kind, entry in raw.items():
        ratios = [statistics.median(p) / statistics.median(s) for s, p in zip(entry["stock"], entry["plugin"])]
        stock_us, plugin_us = (statistics.median(t for times in entry[name] for t in times) / 1000
                               for name in ("stock", "plugin"))
        low, median, high = quartiles(ratios)
        summary[kind] = dict(
            stock_us=stock_us, plugin_us=plugin_us, added_us=plugin_us - stock_us, rounds=len(ratios),
            ratio=median, ratio_iqr=[low, high], ratio_range=[min(ratios), max(ratios)],
            fastest_round_us=[min(statistics.median(times) for times in entry[name]) / 1000
                              for name in ("stock", "plugin")],
        )
    return summary


def gpu_step():
    """What one 256-token prefill step costs on an H200 (benchmarks/chunk_tradeoff_h200.json, g4-d128)."""
    with open(os.path.join(ROOT, "benchmarks", "chunk_tradeoff_h200.json")) as f:
        cells = [c for c in json.load(f)["cells"] if c["shape"] == SHAPE.name and c["chunk"] == 256]
    return dict(
        attn_ms_per_layer=[min(min(c["per_step_ms"]) for c in cells), max(c["longest_ms"] for c in cells)],
        plan_ms=statistics.median(c["plan_ms_per_call"] for c in cells),
        prompts=sorted(c["prompt"] for c in cells),
    )


# ---------------------------------------------------------------------------
# 2. Load time
# ---------------------------------------------------------------------------

# argv: module, fork (0/1), SGLANG_PLUGINS values in the order to measure them. Prints "ready" once
# the module is imported and waits for a line on stdin, so imports run in parallel and measurements alone.
LOAD_SCRIPT = r"""
import ctypes, importlib, json, os, sys, time
module, fork, arms = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
importlib.import_module(module)
from sglang.srt.plugins import load_plugins

def populate():
    # Copy, untimed, every private writable page a forked child shares with its parent (MADV_POPULATE_WRITE,
    # Linux 5.14+), so load_plugins() pays no copy-on-write fault a fresh process would not. MiB populated.
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    populated = 0
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        low, high = (int(x, 16) for x in span.split("-"))
        if perms.startswith("rw") and perms[3] == "p" and libc.madvise(low, high - low, 23) == 0:
            populated += high - low
    return populated >> 20

def measure(plugins, populated_mib=None):
    os.environ["SGLANG_PLUGINS"] = plugins
    start = time.perf_counter()
    load_plugins()
    seconds = time.perf_counter() - start
    patches = sys.modules.get("sglang_chunk_align.patches")
    print(json.dumps(dict(plugins=plugins, seconds=seconds, plugin_state=patches and patches.state(),
                          populated_mib=populated_mib)), flush=True)

print("ready", flush=True)
sys.stdin.readline()
if not fork:
    measure(*arms)
    sys.exit()
for plugins in arms:
    pid = os.fork()
    if pid == 0:
        measure(plugins, populate())
        os._exit(0)
    if os.waitpid(pid, 0)[1]:
        sys.exit(f"the child measuring SGLANG_PLUGINS={plugins} failed")
"""


def start_load_script(module, fork, plugin_values):
    process = subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, module, "1" if fork else "0", *plugin_values],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=(errors := tempfile.TemporaryFile("w+")),
    )
    process.module, process.errors = module, errors
    return process


def await_ready(process):
    """Wait until `process` has imported its module (or failed: finish_load_script says why)."""
    for line in process.stdout:
        if line.strip() == "ready":
            break
    return process


def finish_load_script(process):
    out, _ = process.communicate("go\n", timeout=900)
    if process.returncode:
        process.errors.seek(0)
        raise RuntimeError(f"load_plugins() after importing {process.module} failed:\n{process.errors.read()[-3000:]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def measure_load(runs, spawn=False, meanwhile=lambda: None):
    """Per imported module and arm: every run's result (seconds, the plugin's state after load_plugins()).

    `meanwhile` runs while the forking processes import SGLang, before any of them measures.
    """
    if not compileall.compile_dir(os.path.join(ROOT, "sglang_chunk_align"), quiet=1):
        raise RuntimeError("could not compile the plugin's bytecode")
    arms = list(LOAD_ARMS)
    order = [arms[(i + i // 2) % 2] for i in range(2 * runs)]  # ABBA ...: the arms interleave
    if spawn:  # one process at a time: each holds SGLang's memory
        meanwhile()
        results = {label: [r for name in order for r in finish_load_script(await_ready(
            start_load_script(module, False, [LOAD_ARMS[name]])))] for label, module in LOAD_MODULES.items()}
    else:
        processes = {label: start_load_script(module, True, [LOAD_ARMS[name] for name in order])
                     for label, module in LOAD_MODULES.items()}
        meanwhile()
        for process in processes.values():  # no process measures while another imports
            await_ready(process)
        results = {label: finish_load_script(process) for label, process in processes.items()}
    return {label: {name: [r for n, r in zip(order, results[label], strict=True) if n == name] for name in arms}
            for label in LOAD_MODULES}


def summarize_load(raw):
    summary = {}
    for label, arms in raw.items():
        cell = {}
        for name, results in arms.items():
            ms = [r["seconds"] * 1000 for r in results]
            cell[name] = dict(median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), runs=len(ms))
        cell["added_ms"] = cell["chunk_align"]["median_ms"] - cell["baseline"]["median_ms"]
        cell["goal_ms"] = LOAD_GOALS_MS[label]
        summary[label] = cell
    return summary


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def machine():
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    versions = {dist: installed_release(dist) for dist in ("sglang", "torch", "sglang-chunk-align")}
    return dict(cpu=model, cores=os.cpu_count(), python=platform.python_version(), **versions,
                checkout=checkout_state(), load_average_at_start=list(os.getloadavg()))


def report(doc):
    m, step = doc["machine"], doc["gpu_step"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores (1-min load average {m['load_average_at_start'][0]:.1f} at start, "
        f"{m['load_average_at_end'][0]:.1f} at end); "
        f"Python {m['python']}, SGLang {m['sglang']}, torch {m['torch']}, sglang-chunk-align {m['sglang-chunk-align']} "
        f"(commit {(m['checkout']['commit'] or 'unknown')[:7]}"
        f"{', plugin modified' if m['checkout']['plugin_modified'] else ''}); {m['wall_s']:.0f} s in all",
        "",
        f"Admission decisions ({doc['settings']['rounds']} rounds x {doc['settings']['decisions']} decisions per arm "
        f"and kind; stock = {STOCK.name}, plugin = {PLUGIN.name} with grid rules, {SHAPE.name}):",
        "",
        "| decision | stock µs | plugin µs | added µs | plugin/stock (median of rounds) | IQR | min-max | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratio_lines = []
    for kind, s in doc["decisions"]["summary"].items():
        outcome = "; ".join(doc["decisions"]["raw"][kind]["outcomes"]["plugin"])
        lines.append(
            f"| {kind} | {s['stock_us']:.1f} | {s['plugin_us']:.1f} | {s['added_us']:+.1f} | {s['ratio']:.3f} "
            f"| {s['ratio_iqr'][0]:.3f}-{s['ratio_iqr'][1]:.3f} | {s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f} "
            f"| {outcome} |"
        )
        ratio_lines.append(
            f"{kind}: ratio {s['ratio']:.3f} (IQR {s['ratio_iqr'][0]:.3f}-{s['ratio_iqr'][1]:.3f}, "
            f"min-max {s['ratio_range'][0]:.3f}-{s['ratio_range'][1]:.3f} over {s['rounds']} rounds; "
            f"{s['added_us']:+.1f} µs per decision; fastest rounds {s['fastest_round_us'][0]:.1f} µs stock, "
            f"{s['fastest_round_us'][1]:.1f} µs plugin)"
        )
    low, high = step["attn_ms_per_layer"]
    lines += [
        "",
        *ratio_lines,
        "",
        f"Against a GPU step: one 256-token prefill step on an H200 spends {low:.3f}-{high:.3f} ms in attention per "
        f"layer ({SHAPE.name}, shortest to longest step of {'/'.join(map(str, step['prompts']))}-token prompts; "
        f"x32 layers for an 8B model) and {step['plan_ms']:.2f} ms of CPU in plan(); a decision runs once per "
        f"request per step, not per layer.",
        "",
        f"load_plugins() ({doc['settings']['runs']} runs per cell, "
        f"{'a fresh python -c each' if doc['settings']['spawn'] else 'a forked child of a fresh python -c each'}; "
        f"the plugin's bytecode compiled first, as pip does when it installs it):",
        "",
        "| process has imported | baseline ms median (min-max) | chunk_align ms median (min-max) | added ms | goal |",
        "|---|---|---|---|---|",
    ]
    for label, cell in doc["load"]["summary"].items():
        base, plugin = cell["baseline"], cell["chunk_align"]
        lines.append(
            f"| {label} | {base['median_ms']:.1f} ({base['min_ms']:.1f}-{base['max_ms']:.1f}) "
            f"| {plugin['median_ms']:.1f} ({plugin['min_ms']:.1f}-{plugin['max_ms']:.1f}) "
            f"| {cell['added_ms']:+.1f} | ≤ {cell['goal_ms']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--rounds", type=int, help=f"decision rounds per arm (default {FULL['rounds']})")
    parser.add_argument("--decisions", type=int,
                        help=f"decisions per round, arm and kind (default {FULL['decisions']})")
    parser.add_argument("--runs", type=int, help=f"load_plugins() runs per module and arm (default {FULL['runs']})")
    parser.add_argument("--spawn", action="store_true", help="a fresh python -c per load run (slow)")
    parser.add_argument("--json", help="write every raw number here")
    args = parser.parse_args(argv)
    settings = {key: getattr(args, key) or (QUICK if args.quick else FULL)[key] for key in FULL}
    settings.update(spawn=args.spawn, quick=args.quick)
    started = time.time()
    doc = dict(machine=machine(), settings=settings, gpu_step=gpu_step())
    # Load time first, this process importing the scheduler alongside the measuring processes' imports.
    raw = measure_load(settings["runs"], args.spawn,
                       meanwhile=lambda: importlib.import_module(LOAD_MODULES["scheduler"]))
    doc["load"] = dict(summary=summarize_load(raw), raw=raw)
    raw = measure_decisions(settings["rounds"], settings["decisions"])
    doc["decisions"] = dict(summary=summarize_decisions(raw), raw=raw)
    doc["machine"]["load_average_at_end"] = list(os.getloadavg())
    doc["machine"]["wall_s"] = time.time() - started
    print(report(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
