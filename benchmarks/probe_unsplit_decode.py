"""Probe (GPU): issue 46. Does eager decode planned as the CUDA graphs plan it (unsplit_decode.py's
UNSPLIT) give a request the bits a CUDA graph gives it, and what does that cost?

Stock SGLang 0.5.23 plans deterministic flashinfer decode with a fixed KV
split of 2048 when the step runs eagerly (a batch over
--cuda-graph-max-bs-decode, or --disable-cuda-graph) and with split-KV
disabled in its CUDA graphs, so past 2048 tokens of KV a request's row
depends on whether its step ran in a graph. For each shape of SHAPES and each
KV length of the request under test (KV_LENS), its row in each variant is
compared bit for bit with the reference, its row from a CUDA-graph decode step
of the request alone (what it gets alone in a server with graphs):

- eager_stock: eager decode planned as stock plans it (fa2.EAGER_DECODE_PLAN), at BATCHES;
- eager_fix: eager decode planned with UNSPLIT, the plugin's plan, at BATCHES;
- graph: a CUDA-graph decode step (fa2.GRAPH_DECODE_PLAN, captured and replayed) at GRAPH_BATCH.

In a batch of B the request under test comes first and the other B - 1
requests' KV lengths cycle through KV_LENS after its own, so every batch
mixes short and long KV; requests of one length read the same KV pages (as a
shared radix prefix is read) and each has its own query. Then the cost: the
median time of one decode call (CUDA events, the L2 cache flushed before
each) eager with stock's plan and with UNSPLIT, every request of the batch at
one KV length of TIMED_KV_LENS, each on its own pages, at TIMED_BATCHES.

verdict(): the fix holds where every eager_fix and graph row is exact;
stock is shown inexact where an eager_stock row past the split differs;
rows at KV lengths within the split must be exact in every variant, else the
probe itself is suspect. Run from the repository root, flashinfer installed:
python3 -m benchmarks.probe_unsplit_decode --json benchmarks/logs/unsplit_decode_h200/unsplit_decode.json
(--dry-run prints the plan without a GPU).
"""

import json
import os
import statistics
import sys

from benchmarks.probe_split_attention import environment, has_gpu, probe_parser
from benchmarks.workload import ModelShape
from sglang_chunk_align.tools import fa2
from sglang_chunk_align.unsplit_decode import UNSPLIT

# Attention shapes of benchmarks/models' configs (the test checks them against config.json).
SHAPES = (
    ModelShape("qwen2.5-7b", 28, 4, 128),
    ModelShape("llama-3.1-8b", 32, 8, 128),
    ModelShape("gemma-2b", 8, 1, 256),
)
KV_LENS = (1000, 2049, 3000, 4097, 8192, 16384, 32768)  # 1000: within the split, a control
BATCHES = (1, 8, 64)
GRAPH_BATCH = 8
EAGER_PLANS = {"eager_stock": fa2.EAGER_DECODE_PLAN, "eager_fix": UNSPLIT}
VARIANTS = (*EAGER_PLANS, "graph")
TIMED_KV_LENS = (4096, 32768)
TIMED_BATCHES = (1, 8, 64, 256)
WARMUP, TIMED_CALLS = 3, 20
L2_FLUSH_BYTES = 256 << 20  # written before each timed call: more than the H200's 60 MB of L2
HOLDS, DOES_NOT_HOLD = "holds", "does NOT hold"


def batch_lens(kv_len, batch):
    """KV lengths of a decode batch of `batch` requests: the request under test first, then
    KV_LENS cycled from the length after its own."""
    first = KV_LENS.index(kv_len)
    return [KV_LENS[(first + i) % len(KV_LENS)] for i in range(batch)]


def cells_planned():
    """(kv_len, variant, batch) of every row measured, in order."""
    return [(kv_len, variant, batch) for kv_len in KV_LENS for variant in VARIANTS
            for batch in ((GRAPH_BATCH,) if variant == "graph" else BATCHES)]


def planned(variant, workspace, shape, kv_indptr, kv_indices):
    """A tensor-core decode wrapper over the batch (kv_indptr, kv_indices), made and planned as
    `variant` runs it: eager with its EAGER_PLANS plan, or made for CUDA graphs with theirs."""
    dims = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
    if variant == "graph":
        return fa2.TensorCoreDecode.for_graph(workspace, *dims, kv_indptr, kv_indices)
    decode = fa2.TensorCoreDecode(workspace, *dims)
    decode.plan_batch(kv_indptr, kv_indices, **EAGER_PLANS[variant])
    return decode


def _randn(torch, gen, *size):
    return torch.randn(*size, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)


def _workspace(torch):
    return torch.empty(fa2.DETERMINISTIC_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def measure(shape):
    """Every row of cells_planned(): exact (bitwise equal to the reference) and its max abs difference."""
    import torch

    workspace = _workspace(torch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = [_randn(torch, gen, sum(KV_LENS), 1, shape.num_kv_heads, shape.head_dim) for _ in range(2)]
    starts = [sum(KV_LENS[:i]) for i in range(len(KV_LENS))]
    pages = {n: torch.arange(s, s + n, dtype=torch.int32, device="cuda") for s, n in zip(starts, KV_LENS)}
    q_tested = _randn(torch, gen, len(KV_LENS), shape.num_qo_heads, shape.head_dim)
    q_others = _randn(torch, gen, max(BATCHES), shape.num_qo_heads, shape.head_dim)

    def row(kv_len, variant, batch):
        lens = batch_lens(kv_len, batch)
        indices = torch.cat([pages[n] for n in lens])
        decode = planned(variant, workspace, shape, fa2.indptr(lens, "cuda"), indices)
        q = torch.cat([q_tested[KV_LENS.index(kv_len)][None], q_others[1:batch]])
        out = decode.replayed(q, *kv) if variant == "graph" else decode.forward(q, *kv)
        return out[0]

    cells = []
    for kv_len in KV_LENS:
        reference = row(kv_len, "graph", 1)
        for _, variant, batch in (c for c in cells_planned() if c[0] == kv_len):
            got = row(kv_len, variant, batch)
            cells.append(dict(kv_len=kv_len, variant=variant, batch=batch, exact=bool(torch.equal(got, reference)),
                              max_abs=(got.float() - reference.float()).abs().max().item()))
    return cells


def time_calls(shape):
    """Median ms of one eager decode call with each EAGER_PLANS plan, per (KV length, batch) of
    TIMED_KV_LENS x TIMED_BATCHES, every request at that KV length on its own pages."""
    import torch

    workspace = _workspace(torch)
    tokens = max(TIMED_KV_LENS) * max(TIMED_BATCHES)
    kv = [torch.empty(tokens, 1, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device="cuda")
          for _ in range(2)]
    for part in (p for cache in kv for p in cache.split(1 << 20)):  # each part under 2**31 elements
        part.normal_()
    q = torch.randn(max(TIMED_BATCHES), shape.num_qo_heads, shape.head_dim, device="cuda").to(torch.bfloat16)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    timings = []
    for kv_len in TIMED_KV_LENS:
        for batch in TIMED_BATCHES:
            indices = torch.arange(batch * kv_len, dtype=torch.int32, device="cuda")
            entry = dict(shape=shape.name, kv_len=kv_len, batch=batch)
            for variant in EAGER_PLANS:
                decode = planned(variant, workspace, shape, fa2.indptr([kv_len] * batch, "cuda"), indices)
                times = []
                for i in range(WARMUP + TIMED_CALLS):
                    flush.zero_()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    decode.forward(q[:batch], *kv)
                    end.record()
                    end.synchronize()
                    if i >= WARMUP:
                        times.append(start.elapsed_time(end))
                entry[f"{variant}_ms"] = statistics.median(times)
            entry["fix_over_stock"] = entry["eager_fix_ms"] / entry["eager_stock_ms"]
            timings.append(entry)
    return timings


def verdict(results):
    """dict(fix=HOLDS or DOES_NOT_HOLD, stock_inexact, suspect, reasons) over the shapes' results
    (each with "cells", or "cells_error" where its measurement failed)."""
    reasons = [f"{r['shape']}: {r['cells_error']}" for r in results if "cells_error" in r]
    cells = [dict(c, shape=r["shape"]) for r in results for c in r.get("cells", ())]

    def where(selected):
        """Per shape and variant: the KV lengths and batch sizes of the rows `selected`, and their largest difference."""
        said = {}
        for c in selected:
            kv_lens, batches, diff = said.get((c["shape"], c["variant"]), (set(), set(), 0.0))
            said[c["shape"], c["variant"]] = kv_lens | {c["kv_len"]}, batches | {c["batch"]}, max(diff, c["max_abs"])
        return "; ".join(f"{shape} {variant} at KV {sorted(kv_lens)}, batches {sorted(batches)} (max abs {diff:.3g})"
                         for (shape, variant), (kv_lens, batches, diff) in said.items())

    controls = [c for c in cells if c["kv_len"] <= fa2.DECODE_SPLIT and not c["exact"]]
    fix_bad = [c for c in cells if c["variant"] != "eager_stock" and not c["exact"]]
    stock_bad = [c for c in cells if c["variant"] == "eager_stock" and c["kv_len"] > fa2.DECODE_SPLIT
                 and not c["exact"]]
    if not cells:
        reasons.append("nothing was measured")
    if controls:
        reasons.append(f"probe suspect: rows within the {fa2.DECODE_SPLIT} split differ: {where(controls)}")
    if fix_bad:
        reasons.append(f"differs from the graph reference: {where(fix_bad)}")
    holds = not reasons
    if holds:
        reasons.append(f"every eager_fix and graph row of {len({c['shape'] for c in cells})} shapes exact")
    reasons.append(f"stock's eager split differs in {len(stock_bad)} of "
                   f"{sum(c['variant'] == 'eager_stock' and c['kv_len'] > fa2.DECODE_SPLIT for c in cells)} rows "
                   f"past {fa2.DECODE_SPLIT}" if cells else "stock not measured")
    return dict(fix=HOLDS if holds else DOES_NOT_HOLD, stock_inexact=bool(stock_bad), suspect=bool(controls),
                reasons=reasons)


def summary(doc):
    """The human summary of a probe's JSON document."""
    lines = []
    for result in doc["results"]:
        lines += [f"{result['shape']} {key}: {result[key]}" for key in ("cells_error", "timings_error") if key in result]
        for kv_len in KV_LENS:
            cells = [c for c in result.get("cells", ()) if c["kv_len"] == kv_len]
            if cells:
                lines.append(f"{result['shape']} KV {kv_len}: " + ", ".join(
                    f"{c['variant']}@{c['batch']} " + ("exact" if c["exact"] else f"differs ({c['max_abs']:.3g})")
                    for c in cells))
    for t in doc["timings"]:
        lines.append(f"{t['shape']} KV {t['kv_len']} batch {t['batch']}: stock {t['eager_stock_ms']:.4f} ms, "
                     f"fix {t['eager_fix_ms']:.4f} ms, fix/stock {t['fix_over_stock']:.2f}")
    v = doc["verdict"]
    lines.append(f"fix {v['fix']}; stock shown inexact: {'yes' if v['stock_inexact'] else 'no'}"
                 f"{'; PROBE SUSPECT' if v['suspect'] else ''}: " + "; ".join(v["reasons"]))
    return "\n".join(lines)


def dry_run(shapes):
    """The plan, without torch or flashinfer: what runs, how many calls, how much KV each shape holds."""
    rows, timed = len(cells_planned()) + len(KV_LENS), len(TIMED_KV_LENS) * len(TIMED_BATCHES) * len(EAGER_PLANS)
    lines = [f"KV lengths {list(KV_LENS)}; eager batches {list(BATCHES)}, graph batch {GRAPH_BATCH}; "
             f"reference: graph decode at batch 1",
             f"plans: eager_stock {EAGER_PLANS['eager_stock']}, eager_fix {EAGER_PLANS['eager_fix']}, "
             f"graph {fa2.GRAPH_DECODE_PLAN}",
             f"timed: KV {list(TIMED_KV_LENS)} x batches {list(TIMED_BATCHES)} x {len(EAGER_PLANS)} plans, "
             f"{WARMUP} + {TIMED_CALLS} calls each"]
    for shape in shapes:
        kv_bytes = 2 * max(TIMED_KV_LENS) * max(TIMED_BATCHES) * shape.num_kv_heads * shape.head_dim * 2
        lines.append(f"{shape.name} ({shape.num_qo_heads} q heads, {shape.num_kv_heads} KV heads, head_dim "
                     f"{shape.head_dim}): {rows} decode rows ({len(KV_LENS) * 2} CUDA graphs), {timed} timings "
                     f"({timed * (WARMUP + TIMED_CALLS)} calls); timed KV {kv_bytes / 2**30:.1f} GiB")
    return "\n".join(lines)


def arguments(argv):
    parser = probe_parser(__doc__)
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES],
                        help="the shapes to probe (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = parser.parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"argument --json: no folder {os.path.dirname(os.path.abspath(args.json))!r} to write {args.json!r} in")
    return args


def main(argv=None):
    args = arguments(argv)
    shapes = [s for s in SHAPES if s.name in args.shapes]
    if args.dry_run:
        print(dry_run(shapes))
        return 0
    if not has_gpu():
        return 2
    import torch

    results, timings = [], []
    for shape in shapes:
        result = dict(shape=shape.name, heads=[shape.num_qo_heads, shape.num_kv_heads, shape.head_dim])
        try:
            result["cells"] = measure(shape)
        except Exception as error:  # reported; the timings and the other shapes still run
            result["cells_error"] = f"{type(error).__name__}: {error}"
        try:
            timings += time_calls(shape)
        except Exception as error:
            result["timings_error"] = f"{type(error).__name__}: {error}"
        torch.cuda.empty_cache()  # one shape's KV is gone before the next's
        results.append(result)
        print(f"{shape.name}: {'; '.join(result.get(k, 'ok') for k in ('cells_error', 'timings_error'))}", flush=True)
    doc = dict(environment=dict(environment(), decode_split=fa2.DECODE_SPLIT), kv_lens=KV_LENS, batches=BATCHES,
               graph_batch=GRAPH_BATCH, plans=dict(EAGER_PLANS, graph=fa2.GRAPH_DECODE_PLAN), results=results,
               timings=timings)
    doc["verdict"] = verdict(results)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
    print(summary(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
