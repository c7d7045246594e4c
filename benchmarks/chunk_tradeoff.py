"""Chunk-size trade-off: what small chunked-prefill sizes cost, and what they buy.

Why: the plugin makes deterministic flashinfer prefill bit-exact at small
chunk sizes (multiples of 128 tokens). A smaller chunk shortens the longest
prefill step, which is what a decode running alongside waits behind, but it
adds steps (one plan() each) and re-reads the KV prefix once per chunk. This
benchmark measures both sides for one prompt prefilled alone, so the choice
of chunk size can be made from numbers.

Every step runs flashinfer's fa2 paged prefill planned exactly as SGLang's
deterministic flashinfer backend plans it, through the plan/forward call the
probe and the replay run (sglang_chunk_align/tools/fa2.py: page size 1, bf16,
``fixed_split_size`` from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, default
4096, causal). Chunk i covers query rows [s, e) over KV [0, e)
and is planned and run as its own step, after a torch.cuda.synchronize().

Per (shape, prompt, chunk) cell, ``measure`` records:

- total prefill attention time: the sum of the CUDA-event times of every
  step's forward (attention kernel, plus the merge kernel when the KV is
  split), median over the timed repetitions after a warm-up. A short GPU spin
  (torch.cuda._sleep) is queued before each step's first event, so the events
  time the kernels, not the CPU's launch of them;
- the longest single step (max per-step forward time), median over repetitions;
- plan calls (steps) and the total plan() CPU time;
- whether the chunked output equals the unchunked one (torch.equal);
- whether plan/forward succeed with SGLang's fixed 2 GiB deterministic
  workspace (run once; the exception message if not), and the partial-output
  bytes flashinfer 0.7.2's scheduler reserves in the float workspace
  (computed from scheduler.cuh's formula). Timings use a large workspace so
  every cell has numbers.

Two subcommands; run from the repository root:

    python -m benchmarks.chunk_tradeoff measure --out chunk_tradeoff_h200.json   # GPU
    python -m benchmarks.chunk_tradeoff plot --json benchmarks/chunk_tradeoff_h200.json \
        --png benchmarks/chunk_tradeoff_h200.png                                 # CPU

``measure`` imports only torch, flashinfer, the standard library and the plugin's fa2 and
kernel-facts modules (which import nothing else).
"""

import argparse
import json
import platform
import statistics
import sys
import time

from sglang_chunk_align.tools import fa2
from sglang_chunk_align import workspace
from sglang_chunk_align.kernel_facts import FI072

SHAPES = {  # name: (num_qo_heads, num_kv_heads, head_dim)
    "g4-d128": (32, 8, 128),  # Llama-3-8B-like
    "g1-d128": (32, 32, 128),
}
PROMPTS = (4096, 16384, 32768)
CHUNKS = (128, 256, 512, 1024, 2048, 4096, None)  # None: unchunked (one step)
# Largest step of chunked prefill (qo rows [E - chunk, E), KV [0, E)) at SGLang's
# usual chunked_prefill_size values, planned only, to map where 2 GiB stops sufficing.
FRONTIER = (
    (20480, None), (24576, None),
    (8192, 61440), (8192, 65536),
    (16384, 28672), (16384, 32768),
)


def steps_of(prompt, chunk):
    """(start, end) of every step: query rows [start, end) over KV [0, end)."""
    chunk = chunk or prompt
    return [(s, min(s + chunk, prompt)) for s in range(0, prompt, chunk)]


def partial_bytes(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, split):
    """Float-workspace bytes one fa2 paged-prefill plan reserves, by flashinfer 0.7.2's tiles."""
    return workspace.partial_bytes(qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, split, FI072.cta_tile)


# ---------------------------------------------------------------------------
# measure (GPU)
# ---------------------------------------------------------------------------


class Fa2Steps:
    """One wrapper on one workspace; plans and runs steps the way SGLang's deterministic backend does."""

    def __init__(self, workspace, shape, split, k_cache, v_cache, kv_indices):
        self.prefill = fa2.PagedPrefill(workspace, *shape)
        self.split = split
        self.k_cache, self.v_cache, self.kv_indices = k_cache, v_cache, kv_indices
        self.spin_cycles = 1_000_000  # ~0.5 ms at the H200's ~2 GHz

    def plan(self, start, end):
        """One step of the prompt alone: query rows [start, end) over KV [0, end)."""
        self.prefill.plan(fa2.indptr([end - start]), fa2.indptr([end]), self.kv_indices[:end], self.split)

    def forward(self, q):
        return self.prefill.forward(q, self.k_cache, self.v_cache)

    def run(self, q_all, out, steps):
        """Plan and run every step; per-step (plan seconds, begin event, end event)."""
        import torch

        record = []
        for start, end in steps:
            # plan() refills a pinned host buffer; SGLang reads each step's
            # sampled tokens before planning the next, so wait for the GPU.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.plan(start, end)
            plan_s = time.perf_counter() - t0
            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the GPU busy while the CPU launches forward, so that the
            # events time the kernels and not the launch overhead.
            torch.cuda._sleep(self.spin_cycles)
            begin.record()
            o = self.forward(q_all[start:end])
            finish.record()
            out[start:end] = o
            record.append((plan_s, begin, finish))
        torch.cuda.synchronize()
        return [(p, b.elapsed_time(f)) for p, b, f in record]  # (plan s, forward ms)


def _short(exc):
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 600 else text[:600] + " ..."


def probe_workspace(make_small, q, out, steps):
    """Run every step once on the small workspace; (ok, failure record). A failure rebuilds the wrapper."""
    import torch

    small = make_small()
    for i, (start, end) in enumerate(steps):
        phase = "plan"
        try:
            torch.cuda.synchronize()
            small.plan(start, end)
            phase = "forward"
            out[start:end] = small.forward(q[start:end])
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - the message is the finding
            torch.cuda.synchronize()
            return False, dict(step=i, start=start, end=end, phase=phase, error=_short(exc))
    return True, None


def measure_shape(name, shape, args, small_ws, big_ws):
    import torch

    num_qo_heads, num_kv_heads, head_dim = shape
    dev = "cuda"
    n = max(args.prompts)
    gen = torch.Generator(device=dev).manual_seed(20261129)
    q = torch.randn(n, num_qo_heads, head_dim, generator=gen, device=dev).to(torch.bfloat16)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=dev).to(torch.bfloat16)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen, device=dev).to(torch.bfloat16)
    k_cache, v_cache = k.view(n, 1, num_kv_heads, head_dim), v.view(n, 1, num_kv_heads, head_dim)
    kv_indices = torch.arange(n, dtype=torch.int32, device=dev)  # page i holds position i
    big = Fa2Steps(big_ws, shape, args.split, k_cache, v_cache, kv_indices)

    def make_small():
        return Fa2Steps(small_ws, shape, args.split, k_cache, v_cache, kv_indices)

    cells = []
    for prompt in args.prompts:
        ref = None
        for chunk in [None] + [c for c in args.chunks if c is not None]:  # unchunked first: the reference
            steps = steps_of(prompt, chunk)
            out = torch.zeros(prompt, num_qo_heads, head_dim, dtype=torch.bfloat16, device=dev)
            ws_ok, ws_fail = probe_workspace(make_small, q, out, steps)
            for _ in range(args.warmup):
                big.run(q, out, steps)
            reps = [big.run(q, out, steps) for _ in range(args.reps)]
            if ref is None:
                ref = out.clone()
            same = (out == ref).flatten(1).all(1)
            totals = [sum(ms for _, ms in r) for r in reps]
            longest = [max(ms for _, ms in r) for r in reps]
            plans = [1e3 * sum(p for p, _ in r) for r in reps]
            per_step = [statistics.median(r[i][1] for r in reps) for i in range(len(steps))]
            need = max(partial_bytes(e - s, e, num_qo_heads, num_kv_heads, head_dim, args.split) for s, e in steps)
            cell = dict(
                shape=name, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                prompt=prompt, chunk=chunk, steps=len(steps), plan_calls=len(steps),
                total_ms=round(statistics.median(totals), 4), total_ms_reps=[round(x, 4) for x in totals],
                longest_ms=round(statistics.median(longest), 4), longest_ms_reps=[round(x, 4) for x in longest],
                longest_step=max(range(len(steps)), key=per_step.__getitem__),
                plan_ms=round(statistics.median(plans), 3), plan_ms_reps=[round(x, 3) for x in plans],
                plan_ms_per_call=round(statistics.median(plans) / len(steps), 4),
                per_step_ms=[round(x, 4) for x in per_step],
                exact_vs_unchunked=bool(same.all()), rows_mismatched=int((~same).sum()),
                partials_bytes=need, ws2g_ok=ws_ok, ws2g_failure=ws_fail,
            )
            cells.append(cell)
            print(_cell_line(cell), flush=True)
            del out
    del q, k, v, big
    torch.cuda.empty_cache()
    return cells


def probe_frontier(shape, args, small_ws):
    """Plan only the largest step of a chunked prefill on the 2 GiB workspace."""
    import torch

    num_qo_heads, num_kv_heads, head_dim = shape
    rows = []
    for chunk, context in FRONTIER:
        context = context or chunk
        kv_indices = torch.arange(context, dtype=torch.int32, device="cuda")
        small = Fa2Steps(small_ws, shape, args.split, None, None, kv_indices)
        torch.cuda.synchronize()
        try:
            small.plan(context - chunk, context)
            ok, err = True, None
        except Exception as exc:  # noqa: BLE001
            ok, err = False, _short(exc)
        need = partial_bytes(chunk, context, num_qo_heads, num_kv_heads, head_dim, args.split)
        rows.append(dict(chunk=chunk, context=context, partials_bytes=need, ws2g_plan_ok=ok, error=err))
        print(f"  frontier: last step of chunk {chunk} at context {context}: predicted "
              f"{need / 2**30:.3f} GiB, plan on 2 GiB {'ok' if ok else 'FAILS: ' + err}", flush=True)
    return rows


def _cell_line(c):
    chunk = c["chunk"] or "none"
    ws = "ok" if c["ws2g_ok"] else f"FAILS at step {c['ws2g_failure']['step']} ({c['ws2g_failure']['phase']})"
    return (f"{c['shape']} prompt={c['prompt']} chunk={chunk} steps={c['steps']} total={c['total_ms']:.3f}ms "
            f"longest={c['longest_ms']:.3f}ms plan={c['plan_ms']:.2f}ms exact={c['exact_vs_unchunked']} "
            f"partials={c['partials_bytes'] / 2**30:.3f}GiB 2GiB-workspace={ws}")


def measure(args):
    import torch

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    if flashinfer is None or not torch.cuda.is_available():
        print("measure needs CUDA and flashinfer; `plot` is the CPU-only mode", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    small_ws = torch.empty(args.small_workspace, dtype=torch.uint8, device="cuda")
    big_ws = torch.empty(args.big_workspace, dtype=torch.uint8, device="cuda")
    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
        flashinfer=flashinfer.__version__, python=platform.python_version(),
        split=args.split, reps=args.reps, warmup=args.warmup, page_size=1, dtype="bfloat16",
        small_workspace_bytes=args.small_workspace, big_workspace_bytes=args.big_workspace,
        prompts=args.prompts, chunks=args.chunks, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    )
    doc = dict(meta=meta, cells=[], frontier={})
    for name in args.shapes:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipping {name}: past the {args.budget_s} s budget", flush=True)
            continue
        shape = SHAPES[name]
        t0 = time.perf_counter()
        # Warm-up: the first fa2 use JIT-compiles the module for this head_dim.
        n = 256
        warm_q = torch.randn(n, shape[0], shape[2], device="cuda").to(torch.bfloat16)
        warm_kv = torch.randn(n, 1, shape[1], shape[2], device="cuda").to(torch.bfloat16)
        warm = Fa2Steps(big_ws, shape, args.split, warm_kv, warm_kv, torch.arange(n, dtype=torch.int32, device="cuda"))
        warm.plan(0, n)
        warm.forward(warm_q)
        torch.cuda.synchronize()
        meta.setdefault("first_use_s", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"{name} {shape}: first fa2 use (JIT or cache load) {meta['first_use_s'][name]} s", flush=True)
        doc["frontier"][name] = probe_frontier(shape, args, small_ws)
        doc["cells"] += measure_shape(name, shape, args, small_ws, big_ws)
        meta["measure_s"] = round(time.perf_counter() - t_start, 1)
        if args.out:  # after each shape, so a run cut short keeps what it measured
            _write_json(args.out, doc)
    print(f"\n{json.dumps(meta)}\n\n{table(doc)}")
    return 0


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------
# report / plot (CPU)
# ---------------------------------------------------------------------------


def _by_key(cells):
    return {(c["shape"], c["prompt"], c["chunk"]): c for c in cells}


def table(doc):
    """Markdown table, one row per cell; ratios against the same run's unchunked cell."""
    cells = doc["cells"]
    ref = _by_key(cells)
    header = ["shape", "prompt", "chunk", "steps (plan calls)", "total attn ms", "vs unchunked",
              "longest step ms", "longest step shorter by", "plan CPU ms total", "bit-exact vs unchunked",
              "partials GiB", "2 GiB workspace"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for c in cells:
        full = ref[(c["shape"], c["prompt"], None)]
        ws = "ok" if c["ws2g_ok"] else f"**fails** ({c['ws2g_failure']['phase']}, step {c['ws2g_failure']['step']})"
        lines.append("| " + " | ".join([
            c["shape"], str(c["prompt"]), str(c["chunk"] or "unchunked"), str(c["steps"]),
            f"{c['total_ms']:.2f}", f"{c['total_ms'] / full['total_ms']:.2f}×",
            f"{c['longest_ms']:.3f}", f"{full['longest_ms'] / c['longest_ms']:.1f}×",
            f"{c['plan_ms']:.1f}", "yes" if c["exact_vs_unchunked"] else f"no ({c['rows_mismatched']} rows)",
            f"{c['partials_bytes'] / 2**30:.2f}", ws,
        ]) + " |")
    return "\n".join(lines)


def frontier_table(doc):
    lines = ["| shape | chunk | context | partials GiB | plan on 2 GiB |", "|---|---|---|---|---|"]
    for shape, rows in doc.get("frontier", {}).items():
        for r in rows:
            ok = "ok" if r["ws2g_plan_ok"] else "**fails**"
            lines.append(f"| {shape} | {r['chunk']} | {r['context']} | {r['partials_bytes'] / 2**30:.2f} | {ok} |")
    return "\n".join(lines)


def plot(doc, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["cells"]
    shapes = list(dict.fromkeys(c["shape"] for c in cells))
    prompts = sorted({c["prompt"] for c in cells})
    chunks = sorted({c["chunk"] for c in cells if c["chunk"]})
    ref = _by_key(cells)
    panels = [("total_ms", "total prefill attention time (ms)"),
              ("longest_ms", "longest single step (ms)"),
              ("plan_ms", "total plan() CPU time (ms)")]
    fig, axes = plt.subplots(len(shapes), len(panels), figsize=(5.2 * len(panels), 4.3 * len(shapes)),
                             squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, shape in enumerate(shapes):
        nq, nkv, hd = next((c["num_qo_heads"], c["num_kv_heads"], c["head_dim"]) for c in cells if c["shape"] == shape)
        for col, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for i, prompt in enumerate(prompts):
                xs = [c for c in chunks if (shape, prompt, c) in ref]
                ys = [ref[(shape, prompt, c)][key] for c in xs]
                color = colors[i % len(colors)]
                ax.plot(xs, ys, "o-", color=color, label=f"{prompt // 1024}k prompt, chunked")
                if (shape, prompt, None) in ref:
                    ax.axhline(ref[(shape, prompt, None)][key], color=color, ls="--", lw=1,
                               label=f"{prompt // 1024}k unchunked")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(chunks)
            ax.set_xticklabels([str(c) for c in chunks])
            ax.set_xlabel("chunk size (tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"{label.split(' (')[0]}\n{shape}: {nq} q / {nkv} kv heads, head_dim {hd}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
    m = doc["meta"]
    fig.suptitle(f"fa2 paged prefill, deterministic plan (split {m['split']}, page 1, bf16), one layer, prompt alone"
                 f" — {m['gpu']}, flashinfer {m['flashinfer']}, torch {m['torch']}", fontsize=11)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, bbox_to_anchor=(0.5, 0.965),
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mes = sub.add_parser("measure", help="GPU: time chunked fa2 prefill, probe the 2 GiB workspace, write JSON")
    mes.add_argument("--out", help="write the results (JSON) here")
    mes.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    mes.add_argument("--prompts", nargs="+", type=int, default=list(PROMPTS))
    mes.add_argument("--chunks", nargs="+", type=int, default=[c for c in CHUNKS if c],
                     help="chunk sizes (unchunked is always measured, as the reference)")
    mes.add_argument("--split", type=int, default=fa2.PREFILL_SPLIT, help="fixed_split_size (SGLang's default prefill split tile)")
    mes.add_argument("--reps", type=int, default=7, help="timed repetitions (median reported)")
    mes.add_argument("--warmup", type=int, default=1)
    mes.add_argument("--small-workspace", type=int, default=fa2.DETERMINISTIC_WORKSPACE_BYTES,
                     help="bytes; SGLang's deterministic flashinfer workspace")
    mes.add_argument("--big-workspace", type=int, default=16 << 30, help="bytes; the workspace the timings use")
    mes.add_argument("--budget-s", type=float, default=300, help="start no new shape after this many seconds")
    plo = sub.add_parser("plot", help="CPU: read the JSON, write the PNG, print markdown tables")
    plo.add_argument("--json", required=True)
    plo.add_argument("--png", help="write the figure here")
    args = parser.parse_args(argv)

    if args.command == "measure":
        if args.reps < 3:
            parser.error("--reps must be at least 3")
        return measure(args)
    with open(args.json) as f:
        doc = json.load(f)
    if args.png:
        plot(doc, args.png)
    print(f"{json.dumps(doc['meta'])}\n\n{table(doc)}\n\n{frontier_table(doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
