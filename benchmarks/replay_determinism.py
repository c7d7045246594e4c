"""Replay benchmark: what fraction of requests get bit-exact attention under a real scheduler.

Why: deterministic flashinfer prefill is only worth having if a request's
attention output does not depend on how the scheduler happened to cut and
co-batch it. The kernel probes (tests/gpu/evidence) test hand-picked chunkings;
this benchmark asks the question for a whole mixed workload: for every
request, is every attention row it computes bit-for-bit equal (torch.equal)
to the row it gets when prefilled alone and unchunked?

It runs in two phases because SGLang and the GPU live on different machines:

1. ``schedule`` (CPU, needs the SGLang wheel): benchmarks/scheduling.py
   schedules the seeded workload of benchmarks/workload.py with SGLang's own
   PrefillAdder and records every prefill batch. The same command prints
   schedule statistics and the hazards benchmarks/analysis.py predicts from
   fa2's tile rule; on a small workload this is the CPU-only mode CI runs.
2. ``replay`` (GPU, needs CUDA and flashinfer). Every recorded batch runs
   through flashinfer's fa2 paged prefill exactly as SGLang's deterministic
   backend plans it (page size 1, bf16, fixed split from
   SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, causal), with seeded Q/K/V that
   are identical in every configuration, and each request's rows are compared
   with its solo unchunked reference.

Radix-cache hits are followed through the tree: the cached KV a request
reuses was computed by another request (the "donor"), so a request counts as
exact only if its donors computed those positions exactly too.

Run it from the repository root: python -m benchmarks.replay_determinism --help
"""

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict

from sglang_chunk_align.decisions import BEHIND_A_PARKED_CHUNK, OFF_TILE_IN_ITS_CALL, ONE_TILE_PER_BATCH
from sglang_chunk_align.kernel_facts import facts_for
from sglang_chunk_align.split_attention import with_pad
from sglang_chunk_align.tools import fa2

from .analysis import call_pads, fa2_calls, predict_hazards, prediction_summary, schedule_stats
from .scheduling import donor_runs, load_requests, schedule_workload
from .workload import CONFIGS, NAMED_CONFIGS, SHAPES, UNCAPPED_KV_TOKENS, WORKLOAD_SEED, WORKLOADS, ModelShape, WorkloadSpec

# ---------------------------------------------------------------------------
# Phase 2: replay on the GPU
# ---------------------------------------------------------------------------

WORKSPACE_BYTES = 12 << 30  # an unchunked 8k prompt at split 128 keeps ~9 GiB of partials


class Fa2PagedPrefill:
    """flashinfer fa2 paged prefill, planned the way SGLang's deterministic flashinfer backend plans it."""

    def __init__(self, shape: ModelShape, device="cuda"):
        import torch

        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = fa2.PagedPrefill(self.workspace, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
        self.plan_calls, self.plan_s, self.events = 0, 0.0, []

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, fixed_split):
        import torch

        # plan() refills a pinned host buffer whose copy to the GPU the previous
        # step may not have made yet. SGLang reads each step's sampled tokens
        # before it plans the next, so the replay waits for the GPU here too.
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.prefill.plan(qo_indptr, kv_indptr, kv_indices, fixed_split)
        self.plan_s += time.perf_counter() - start
        self.plan_calls += 1
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        out = self.prefill.forward(q, k_cache, v_cache)
        end.record()
        self.events.append((begin, end))
        return out

    def take_timing(self):
        """(plan calls, plan ms, kernel ms) since the last call."""
        import torch

        torch.cuda.synchronize()
        kernel_ms = sum(b.elapsed_time(e) for b, e in self.events)
        timing = (self.plan_calls, self.plan_s * 1e3, kernel_ms)
        self.plan_calls, self.plan_s, self.events = 0, 0.0, []
        return timing


class Content:
    """Seeded Q/K/V for every request position, identical in every configuration.

    A position's values are a function of the tokens up to it: rows of a shared
    prefix come from the group's generator, a request's own rows from its own.
    Each request gets room for its prompt plus its outputs (a retracted request
    re-prefills both).
    """

    def __init__(self, requests, group_lens, shape: ModelShape, device):
        import torch

        self.device = device
        self.offset, total = {}, 0
        for rid in sorted(requests):
            self.offset[rid] = total
            total += requests[rid].prompt_len + requests[rid].output_len
        self.q = torch.empty(total, shape.num_qo_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
        self.k = torch.empty(total, shape.num_kv_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
        self.v = torch.empty_like(self.k)
        groups = [self._rows(shape, n, f"group/{g}") for g, n in enumerate(group_lens)]
        for rid, r in requests.items():
            start, length = self.offset[rid], r.prompt_len + r.output_len
            own = self._rows(shape, length - r.shared_len, f"request/{rid}")
            for i, buf in enumerate((self.q, self.k, self.v)):
                if r.shared_len:
                    buf[start : start + r.shared_len] = groups[r.group][i][: r.shared_len]
                buf[start + r.shared_len : start + length] = own[i]
        # Paged NHD layout, page size 1: page i is position row i.
        self.k_cache = self.k.view(total, 1, shape.num_kv_heads, shape.head_dim)
        self.v_cache = self.v.view(total, 1, shape.num_kv_heads, shape.head_dim)

    def _rows(self, shape, n, name):
        import torch

        gen = torch.Generator(device=self.device).manual_seed(_seed(f"{shape.name}/{name}"))
        heads = (shape.num_qo_heads, shape.num_kv_heads, shape.num_kv_heads)
        return [
            torch.randn(n, h, shape.head_dim, generator=gen, device=self.device).to(torch.bfloat16)
            for h in heads
        ]


def _seed(name):
    return int(hashlib.sha256(f"{WORKLOAD_SEED}/{name}".encode()).hexdigest()[:15], 16)


def run_batches(content: Content, kernel, batches, fixed_split, pads=None):
    """Run each batch of (rid, start, end) extends, with its padding member's tokens where `pads`
    gives them (0: none); out rows land at the request's positions. A padding member is laid out as
    SplitPrefill lays it out (split_attention.with_pad), and its output is dropped."""
    import torch

    out = torch.zeros_like(content.q)
    dev = content.device
    offset = content.offset
    for entries, pad in zip(batches, pads or [0] * len(batches)):
        q_rows = torch.cat([torch.arange(offset[r] + s, offset[r] + e, device=dev) for r, s, e in entries])
        kv_indices = torch.cat([torch.arange(offset[r], offset[r] + e, device=dev) for r, _, e in entries])
        lengths = [(e - s, e) for _, s, e in entries] + [(pad, pad)] * bool(pad)
        got = kernel(
            content.q[with_pad(q_rows, pad)], content.k_cache, content.v_cache,
            fa2.indptr([q for q, _ in lengths]), fa2.indptr([kv for _, kv in lengths]),
            with_pad(kv_indices, pad).to(torch.int32), fixed_split,
        )
        out[q_rows] = got[: len(q_rows)]
    return out


def compare(content: Content, out, ref, schedule, requests):
    """Per request: own rows vs its solo rows, and reused (radix) rows vs what their donor computed."""
    import torch

    computed = {rid: [] for rid in requests}
    for step in schedule["steps"]:
        for rid, s, e in step:
            if s < requests[rid].prompt_len:
                computed[rid].append((s, min(e, requests[rid].prompt_len)))
    donors = donor_runs(schedule)
    aborted = set(schedule["aborted"])
    per_request = {}
    for rid, r in requests.items():
        base = content.offset[rid]
        got, want = out[base : base + r.prompt_len], ref[base : base + r.prompt_len]
        own_rows = torch.zeros(r.prompt_len, dtype=torch.bool)
        for s, e in computed[rid]:
            own_rows[s:e] = True
        own_bad = own_rows & ~(got == want).flatten(1).all(1).cpu()
        covered = own_rows.clone()
        diff = _max_abs(got[own_bad.to(got.device)], want[own_bad.to(got.device)])
        inherited, inherited_bad = 0, 0
        for donor, a, b in donors.get(rid, []):
            theirs = out[content.offset[donor] + a : content.offset[donor] + b]
            mine = want[a:b]
            bad = ~(theirs == mine).flatten(1).all(1)
            inherited += b - a
            inherited_bad += int(bad.sum())
            diff = max(diff, _max_abs(theirs[bad], mine[bad]))
            covered[a:b] = True
        if rid not in aborted and not bool(covered.all()):
            raise RuntimeError(f"{schedule['config']}: request {rid} rows {int((~covered).sum())} never computed")
        per_request[rid] = dict(
            own_rows=int(own_rows.sum()), own_bad=int(own_bad.sum()),
            inherited_rows=inherited, inherited_bad=inherited_bad, max_abs=diff,
            exact=rid not in aborted and not bool(own_bad.any()) and inherited_bad == 0,
        )
    return per_request


def _max_abs(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def replay(doc, shapes=SHAPES, device="cuda", make_kernel=Fa2PagedPrefill):
    """Measure every schedule in `doc` on every model shape it was made for; a list of result rows.

    SGLang plans fa2 with page size 1 (token-level KV indices) whatever its
    KV page size, so a schedule made with page size 16 replays the same way.
    A schedule with padded calls is replayed a second time without its pads
    (config "..., pads dropped"): the control that shows its pads mattered.
    """
    requests = load_requests(doc)
    rows = []
    for shape in shapes:
        content = Content(requests, doc["group_lens"], shape, device)
        kernel = make_kernel(shape, device)
        solo = {}
        for schedule in with_pads_dropped(doc["schedules"]):
            if schedule["shape"] not in (None, shape.name):
                continue
            split = schedule["fixed_split"]
            if split not in solo:  # each request alone and unchunked, same fixed split
                alone = [[(rid, 0, r.prompt_len)] for rid, r in requests.items()]
                solo[split] = run_batches(content, kernel, alone, split)
                kernel.take_timing()
            out = run_batches(content, kernel, fa2_calls(schedule), split, call_pads(schedule))
            plan_calls, plan_ms, kernel_ms = kernel.take_timing()
            per_request = compare(content, out, solo[split], schedule, requests)
            del out
            hazards = predict_hazards(schedule, requests, shape)
            rows.append(dict(
                workload=doc["meta"]["name"], page_size=schedule["page_size"],
                shape=shape.name, config=schedule["config"], radix=schedule["radix"],
                exact_pct=round(100 * sum(p["exact"] for p in per_request.values()) / len(per_request), 1),
                rows_mismatched=sum(p["own_bad"] for p in per_request.values()),
                rows_computed=sum(p["own_rows"] for p in per_request.values()),
                inherited_rows_mismatched=sum(p["inherited_bad"] for p in per_request.values()),
                max_abs_diff=max(p["max_abs"] for p in per_request.values()),
                kernel_ms=round(kernel_ms, 2), plan_calls=plan_calls, plan_ms=round(plan_ms, 1),
                prefill_steps=schedule["prefill_steps"],
                **prediction_summary(hazards),
                prediction_check=_prediction_check(hazards, per_request),
                inexact_rids=sorted(rid for rid, p in per_request.items() if not p["exact"]),
            ))
            print(_format_row(rows[-1]), flush=True)
        del content, kernel, solo
    return rows


def with_pads_dropped(schedules):
    """Each schedule, followed, where it has padded calls, by the same calls without their pads."""
    for schedule in schedules:
        yield schedule
        if any(call_pads(schedule)):
            unpadded = {k: v for k, v in schedule.items() if k != "pads"}
            yield {**unpadded, "calls": fa2_calls(schedule), "config": f"{schedule['config']}, pads dropped"}


def _prediction_check(hazards, per_request):
    """How the tile-rule prediction fared: counts of (predicted hazard?, measured exact?)."""
    if hazards is None:
        return None
    counts = {"hazard_inexact": 0, "hazard_exact": 0, "clear_inexact": 0, "clear_exact": 0}
    for rid, p in per_request.items():
        counts[("hazard_" if hazards[rid] else "clear_") + ("exact" if p["exact"] else "inexact")] += 1
    return counts


# ---------------------------------------------------------------------------
# Reporting and command line
# ---------------------------------------------------------------------------


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("-" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def schedule_report(doc, shapes=SHAPES):
    """Schedule statistics and predicted hazards, one row per schedule (page, radix, configuration, shape)."""
    requests = load_requests(doc)
    # The kernel facts the schedule was planned with (documents before them were made with 0.7.2's).
    facts = facts_for(doc["meta"].get("flashinfer_facts", "0.7.2"))[0]
    header = ["page", "radix", "config", "shape", "chunk", "align", "split", "prefill steps", "decode steps",
              "mean batch", "chunked reqs", "starts off 128", "short cuts", "radix hit tokens", "retracted"]
    header += [f"predicted exact % {s.name} (tile/off-grid/donor/partial-tile)" for s in shapes]
    rows = []
    for schedule in doc["schedules"]:
        stats = schedule_stats(schedule, requests)
        row = [schedule["page_size"], "on" if schedule["radix"] else "off", schedule["config"], schedule["shape"],
               schedule["chunk"],
               schedule["truncation_align_size"], schedule["fixed_split"], stats["prefill_steps"],
               stats["decode_steps"], stats["mean_batch"], stats["chunked_requests"],
               stats["starts_off_128"], stats["short_cuts"], stats["radix_hit_tokens"], stats["retracted"]]
        for shape in shapes:
            p = prediction_summary(predict_hazards(schedule, requests, shape, facts))
            row.append("-" if schedule["shape"] not in (None, shape.name)
                       else "n/a" if p["predicted_exact_pct"] is None
                       else f"{p['predicted_exact_pct']} ({p['tile']}/{p['off_grid']}/{p['donor']}/{p['partial_tile']})")
        rows.append(row)
    return _table(header, rows)


def cost_report(doc, against="upstream-128", stock="stock-4096"):
    """What the grid rules cost, per (page, shape), radix on, for each plugin schedule whose chunk
    matches `against` (length alignment alone, same chunk): prefill steps against it and against
    stock SGLang, the cached tokens given up, and where the extra steps come from.

    Every step spends the chunk budget on extend tokens or leaves some unused, so
    (extra steps) x chunk = (tokens recomputed) + (extra budget unused where a request was cut)
    + (extra budget unused elsewhere). The first is radix hits rounded down to the grid; the
    second, cuts rounded down to the grid (a final piece that rides along spends more than the
    budget and counts negative); the third, budget left unused elsewhere: steps closed early by a
    deferral, or with nothing more to admit at that moment (the timeline the first two shifted).
    Each is shown in steps (tokens / chunk). The deferrals the scheduler driver counted, by
    reason, tell the two apart.
    """
    by_key = {(s["page_size"], s["radix"], s["config"], s["shape"]): s for s in doc["schedules"]}
    prompt_len = {r["rid"]: r["prompt_len"] for r in doc["requests"]}
    header = ["page", "shape", "config", "prefill steps", f"vs {against}", f"vs {stock}",
              "cached tokens reused", "given up", f"given up vs {stock}", "extra steps: recompute", "cut rounding",
              "unused elsewhere", "deferred: one tile per batch / off tile in its call / behind a chunk"]
    rows = []
    for (page, radix, config, shape), schedule in by_key.items():
        baseline = by_key.get((page, radix, against, None))
        if not radix or shape is None or baseline is None or schedule["chunk"] != baseline["chunk"]:
            continue
        chunk = schedule["chunk"]
        mine, theirs = _budget_use(schedule, prompt_len), _budget_use(baseline, prompt_len)
        stock_schedule = by_key.get((page, radix, stock, None))
        rows.append([
            page, shape, config, schedule["prefill_steps"],
            f"{schedule['prefill_steps'] / baseline['prefill_steps']:.3f}x",
            f"{schedule['prefill_steps'] / stock_schedule['prefill_steps']:.2f}x" if stock_schedule else "-",
            f"{schedule['radix_hit_tokens']} / {baseline['radix_hit_tokens']}",
            _given_up(schedule, baseline), _given_up(schedule, stock_schedule),
            *(f"{(a - b) / chunk:+.1f}" for a, b in zip(mine, theirs)), _deferred(schedule),
        ])
    return _table(header, rows)


def _deferred(schedule):
    """How often the plugin deferred a request, by decisions.deferral's reason, as the scheduler
    driver counted ("-": a schedule recorded before it counted)."""
    counts = schedule.get("deferrals")
    if counts is None:
        return "-"
    return " / ".join(str(counts.get(reason, 0))
                      for reason in (ONE_TILE_PER_BATCH, OFF_TILE_IN_ITS_CALL, BEHIND_A_PARKED_CHUNK))


def _given_up(schedule, baseline):
    if baseline is None:
        return "-"
    return f"{100 * (1 - schedule['radix_hit_tokens'] / max(1, baseline['radix_hit_tokens'])):.1f}%"


def _budget_use(schedule, prompt_len):
    """(extend tokens, budget unused in steps that cut a request, budget unused in other steps)."""
    chunk, tokens, unused_at_cuts, unused_elsewhere = schedule["chunk"], 0, 0, 0
    for step in schedule["steps"]:
        step_tokens = sum(e - s for _, s, e in step)
        tokens += step_tokens
        if any(e < prompt_len[rid] for rid, _, e in step):
            unused_at_cuts += chunk - step_tokens
        else:
            unused_elsewhere += chunk - step_tokens
    return tokens, unused_at_cuts, unused_elsewhere


RESULT_COLUMNS = ("workload", "page_size", "shape", "radix", "config", "exact_pct", "predicted_exact_pct", "rows_mismatched",
                  "inherited_rows_mismatched", "max_abs_diff", "kernel_ms", "plan_calls", "prefill_steps")


def _cells(row):
    cells = dict(row, radix="on" if row["radix"] else "off", max_abs_diff=f"{row['max_abs_diff']:.3g}")
    return [cells[c] for c in RESULT_COLUMNS]


def _format_row(row):
    return "  ".join(f"{c}={v}" for c, v in zip(RESULT_COLUMNS, _cells(row)))


def results_table(rows):
    return _table(RESULT_COLUMNS, [_cells(r) for r in rows])


def summary_table(rows):
    """One row per (workload, page, radix, configuration): exact % per shape as measured (and as
    predicted), and the requests the tile rule called clear that still came out inexact, per shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    groups = {}
    for r in rows:
        groups.setdefault((r["workload"], r["page_size"], r["radix"], r["config"]), {})[r["shape"]] = r
    header = ["workload", "page", "radix", "config", *(f"exact % {s} (predicted)" for s in shapes),
              "rows mismatched", "inherited rows mismatched", "clear but inexact", "max abs diff",
              f"prefill steps {' / '.join(shapes)}"]
    table = []
    for (workload, page, radix, config), by_shape in groups.items():
        cells = [by_shape.get(s) for s in shapes]
        table.append([
            workload, page, "on" if radix else "off", config,
            *("-" if r is None else f"{r['exact_pct']} ({r['predicted_exact_pct'] or '-'})" for r in cells),
            " / ".join("-" if r is None else str(r["rows_mismatched"]) for r in cells),
            " / ".join("-" if r is None else str(r["inherited_rows_mismatched"]) for r in cells),
            " / ".join("-" if r is None else str((r["prediction_check"] or {}).get("clear_inexact", "-"))
                       for r in cells),
            f"{max(r['max_abs_diff'] for r in cells if r is not None):.3g}",
            " / ".join("-" if r is None else str(r["prefill_steps"]) for r in cells),
        ])
    return _table(header, table)


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sched = sub.add_parser("schedule", help="CPU: schedule with SGLang's PrefillAdder, print stats and predicted hazards")
    sched.add_argument("--workload", choices=WORKLOADS, default="mixed", help="which workload (small: CI's)")
    sched.add_argument("--page-sizes", nargs="+", type=int, default=[1], help="SGLang KV page sizes")
    sched.add_argument("--radix", choices=["off", "on", "both"], default="both", help="radix cache off, on or both")
    sched.add_argument("--uncapped", action="store_true", help="no cap on KV memory")
    sched.add_argument("--out", help="write the schedule document (JSON) here")
    sched.add_argument("--configs", nargs="+", choices=[c.name for c in NAMED_CONFIGS],
                       default=[c.name for c in CONFIGS], help="schedule only these configurations")
    sched.add_argument("--flashinfer", metavar="VERSION",
                       help="plan with this flashinfer release's kernel facts (default: the installed one's)")
    rep = sub.add_parser("replay", help="GPU: replay a schedule document through flashinfer fa2")
    rep.add_argument("--schedules", nargs="+", required=True, help="schedule documents (JSON)")
    rep.add_argument("--json", help="write the results (JSON) here")
    rep.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    show = sub.add_parser("report", help="print the tables of a results document (JSON)")
    show.add_argument("--results", required=True)
    cost = sub.add_parser("cost", help="print the cost tables of schedule documents (JSON)")
    cost.add_argument("--schedules", nargs="+", required=True)
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args)


def _cost(args):
    for path in args.schedules:
        with open(path) as f:
            doc = json.load(f)
        print(f"{doc['meta']['name']}:\n{cost_report(doc)}\n")
    return 0


def _report(args):
    with open(args.results) as f:
        results = json.load(f)
    print(f"{results['meta']}\n\n{summary_table(results['rows'])}\n\n{results_table(results['rows'])}")
    return 0


def _schedule(args):
    spec = WORKLOADS[args.workload]
    if args.uncapped:
        spec = WorkloadSpec(**{**asdict(spec), "kv_tokens": UNCAPPED_KV_TOKENS})
    start = time.perf_counter()
    configs = [c for c in NAMED_CONFIGS if c.name in args.configs]
    radix_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.radix]
    doc = schedule_workload(spec, configs, radix_modes, args.page_sizes, name=args.workload,
                            flashinfer=args.flashinfer)
    print(f"{schedule_report(doc)}\n\n{cost_report(doc)}\n\nkernel facts of flashinfer {doc['meta']['flashinfer_facts']}")
    print(f"\nscheduled {len(doc['requests'])} requests x {len(doc['schedules'])} schedules "
          f"in {time.perf_counter() - start:.1f} s (SGLang {doc['meta']['sglang']})")
    if args.out:
        _write_json(args.out, doc)
    return 0


def _replay(args):
    import torch

    try:
        import flashinfer
    except ImportError:
        flashinfer = None
    if flashinfer is None or not torch.cuda.is_available():
        print("replay needs CUDA and flashinfer; `schedule` is the CPU-only mode", file=sys.stderr)
        return 2
    start, rows = time.perf_counter(), []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, flashinfer=flashinfer.__version__,
                schedules={})
    for path in args.schedules:
        with open(path) as f:
            doc = json.load(f)
        meta["schedules"][doc["meta"]["name"]] = doc["meta"]
        for shape in SHAPES:
            if shape.name in args.shapes:
                rows += replay(doc, [shape])
                meta["replay_s"] = round(time.perf_counter() - start, 1)
                if args.json:  # after each shape, so a run cut short keeps what it measured
                    _write_json(args.json, dict(meta=meta, rows=rows))
    print(f"\n{meta}\n\n{summary_table(rows)}\n\n{results_table(rows)}")
    return 0


COMMANDS = {"schedule": _schedule, "replay": _replay, "report": _report, "cost": _cost}


if __name__ == "__main__":
    sys.exit(main())
