"""Probe (GPU): issue 25's premise (a). Does one fa2 call per tile class give every member its solo rows?

Split attention would run one forward step's attention as one fa2 prefill
call per solo tile (planning.split_by_tile), each planned over its own
requests only, instead of deferring requests that would move a batch member
off its solo tile. That is worth building only if a class-only call gives
each member the rows of its solo prefill: if anything besides the tile (the
call's other requests, its work partition) changed the bits, the split
would not be exact. So for every shape of benchmarks.workload.SHAPES and
every batch of `batches` (a long extend, a 40- and a 10-token extend, over
various cached prefixes), each member's rows are computed three ways:

- solo: its whole prompt alone, one call (how the kernel facts were measured);
- split: one call per group of split_by_tile, each planned over that group;
- mixed: the whole batch in one call, as stock runs it (the control);
- backend: the whole batch through the plugin's own split_attention.SplitPrefill, on
  flashinfer wrappers sharing one workspace, planned with the whole batch's
  arguments as SGLang plans its wrappers, split where decisions.tile_groups
  splits from what the backend sees (extend and KV lengths): the code servers run.
  Its calls are padded (issue 48, SGLANG_CHUNK_ALIGN_PAD_TILES=1): a class whose
  extends average too few rows for its tile gets a padding member, so the
  10-token final piece alone in its class is on its solo tile there, as the
  split leaves it off (the split is that member's control).

Every call is sglang_chunk_align/tools/fa2.py's PagedPrefill, planned as
SGLang's deterministic flashinfer backend plans it (through
replay_determinism.Fa2PagedPrefill, on replay_determinism.Content's seeded
Q/K/V). The premise holds where every member split_by_tile puts on its solo
tile is exact, and the control differs for some member the mixed call moves
off its tile (otherwise these batches do not show that the tile matters).

Run from the repository root (benchmarks/README.md, "Split attention"):
python3 -m benchmarks.probe_split_attention --json benchmarks/logs/split_attention_h200.json
"""

import argparse
import json
import sys
from typing import NamedTuple

from benchmarks.replay_determinism import Content, Fa2PagedPrefill, _max_abs, run_batches
from benchmarks.workload import SHAPES, RequestSpec
from sglang_chunk_align.kernel_facts import installed_facts
from sglang_chunk_align.decisions import tile_groups
from sglang_chunk_align.planning import Rules, split_by_tile
from sglang_chunk_align.split_attention import SplitPrefill
from sglang_chunk_align.tools import fa2

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE = "holds", "does NOT hold", "inconclusive"


class Batch(NamedTuple):
    name: str
    members: tuple  # (start, end, prompt_len) in tokens: one request's extend over `start` cached tokens


def batches(group):
    """The mixed batches for a GQA group. Lengths in tokens as the issue names them, and in packed
    rows (`rows(n)`: about n rows), so that members fall in different tile classes at every group
    (at group 8 a 10-token prompt is 80 rows: the 128-row class, like the long chunk). At head_dim
    128 and group 2 or more, every prompt below the 128-row class has at most 32 tokens of KV and
    may run on any tile; there the hazard is a short extend of a long prompt that short prompts
    thin out in the mixed call (the last batch)."""

    def rows(n):
        return max(1, n // group)

    def prompt(n):
        return (0, n, n)

    return (
        Batch("a long chunk, a 40-token and a 10-token prompt", ((0, 1024, 3000), prompt(40), prompt(10))),
        Batch("a long extend over 2048 cached, a 40-row and a 10-row prompt",
              ((2048, 3072, 3500), prompt(rows(40)), prompt(rows(10)))),
        Batch("a long extend, final pieces of 40 and 10 tokens over 128 and 256 cached, a 10-row prompt",
              ((1024, 2048, 2600), (128, 168, 168), (256, 266, 266), prompt(rows(10)))),
        Batch("a 10-token final piece over 1024 cached, alone in its class; a 40-row and a 10-row prompt",
              ((1024, 1034, 1034), prompt(rows(40)), prompt(rows(10)))),
        Batch("two chunks, three 40-row and four 10-row prompts",
              ((0, 512, 2000), (1024, 1536, 1600), *[prompt(rows(40))] * 3, *[prompt(rows(10))] * 4)),
        Batch("a 72-row final piece over 1024 cached, beside four 1-token prompts",
              ((1024, 1024 + rows(72), 1024 + rows(72)), *[prompt(1)] * 4)),
    )


def rules_at(shape, facts=None):
    """The rules the probe splits and pads by at a shape: the installed flashinfer's facts, or `facts`."""
    return Rules(group=shape.group, head_dim=shape.head_dim, facts=facts, split_attention=True, pad_tiles=True)


def predictions(rules, batch):
    """Per member, what the rules predict: its solo tile, whether its KV is exempt, and the tile of
    its split call and of the mixed call; plus the split's groups (indices into batch.members)."""
    members = [(end - start, end, prompt_len) for start, end, prompt_len in batch.members]
    split = split_by_tile(members, rules)
    split_tile = {i: rules.batch_tile([members[j][0] for j in g]) for g in split.groups for i in g}
    backend_tile = {i: rules.batch_tile([members[j][0] for j in g] + ([pad] if pad else []))
                    for g, pad in zip(split.groups, split.pads) for i in g}
    mixed_tile = rules.batch_tile([extend for extend, _, _ in members])
    return split.groups, [
        dict(start=start, end=end, prompt_len=prompt_len, solo_tile=rules.solo_tile(prompt_len),
             exempt=end <= rules.exempt_kv, split_tile=split_tile[i], backend_tile=backend_tile[i],
             mixed_tile=mixed_tile)
        for i, (start, end, prompt_len) in enumerate(batch.members)
    ]


def on_tile(member, call):
    """Whether the rules predict the member exact in `call` ("split", "backend" or "mixed")."""
    return member["exempt"] or member[f"{call}_tile"] == member["solo_tile"]


def run_backend(content, rules, extends, new_wrapper, plan_args, plan_kwargs, forward_args):
    """The batch of (rid, start, end) extends in one SplitPrefill, as the backend runs it: planned
    once with the whole batch's index arrays, then run once on the whole batch's q rows. Returns
    (out rows at the requests' positions, the groups it ran, their pads)."""
    import torch

    dev, offset = content.device, content.offset
    calls = tile_groups(rules, [e - s for _, s, e in extends], [e for _, _, e in extends])
    groups, pads = (calls.groups, calls.pads) if calls else ((tuple(range(len(extends))),), (0,))
    split = SplitPrefill([new_wrapper() for _ in groups], groups, pads)
    q_rows = torch.cat([torch.arange(offset[r] + s, offset[r] + e, device=dev) for r, s, e in extends])
    kv_indices = torch.cat([torch.arange(offset[r], offset[r] + e, device=dev) for r, _, e in extends])
    split.plan(fa2.indptr([e - s for _, s, e in extends], dev), fa2.indptr([e for _, _, e in extends], dev),
               kv_indices.to(torch.int32), torch.ones(len(extends), dtype=torch.int32, device=dev), *plan_args, **plan_kwargs)
    out = torch.zeros_like(content.q)
    out[q_rows] = split.forward(content.q[q_rows], (content.k_cache, content.v_cache), **forward_args)
    return out, [list(g) for g in groups], list(pads)


def measure(shape, rules, batch, kernel, device="cuda", backend=None):
    """The batch's members, predicted and measured: rows of the split, the mixed and (where
    `backend` is given: (new_wrapper, plan_args, plan_kwargs, forward_args) for run_backend) the backend's
    calls against each member's solo rows. `kernel` is called as run_batches calls it
    (Fa2PagedPrefill on the GPU; the tests pass a stand-in on the CPU)."""
    groups, members = predictions(rules, batch)
    requests = {rid: RequestSpec(rid, 0, m["prompt_len"], -1, 0, 0) for rid, m in enumerate(members)}
    content = Content(requests, [], shape, device)
    extends = [(rid, m["start"], m["end"]) for rid, m in enumerate(members)]
    solo = run_batches(content, kernel, [[(rid, 0, m["prompt_len"])] for rid, m in enumerate(members)],
                       fa2.PREFILL_SPLIT)
    outputs = {
        "split": run_batches(content, kernel, [[extends[i] for i in g] for g in groups], fa2.PREFILL_SPLIT),
        "mixed": run_batches(content, kernel, [extends], fa2.PREFILL_SPLIT),
    }
    backend_groups = backend_pads = None
    if backend is not None:
        outputs["backend"], backend_groups, backend_pads = run_backend(content, rules, extends, *backend)
    for rid, m in enumerate(members):
        rows = slice(content.offset[rid] + m["start"], content.offset[rid] + m["end"])
        for call, out in outputs.items():
            m[f"{call}_exact"] = bool((out[rows] == solo[rows]).all())
            m[f"{call}_max_abs"] = _max_abs(out[rows], solo[rows])
    return dict(shape=shape.name, batch=batch.name, groups=[list(g) for g in groups], backend_groups=backend_groups,
                backend_pads=backend_pads, members=members)


def verdict(results):
    """(HOLDS, DOES_NOT_HOLD or INCONCLUSIVE, reasons) over measure()'s results (a failed one has
    "error"): the premise fails on any member predicted exact in its split call that is not; it
    is shown only where the control differs for some member the mixed call moves off its tile."""
    members = [m for r in results if "error" not in r for m in r["members"]]
    reasons = [f"{r['shape']}, {r['batch']}: {r['error']}" for r in results if "error" in r]
    wrong = [m for m in members if on_tile(m, "split") and not m["split_exact"]]
    if wrong:
        return DOES_NOT_HOLD, [*reasons, f"{len(wrong)} member(s) on their solo tile in a class-only call differ"]
    unlike = [m for m in members if on_tile(m, "backend") and not m.get("backend_exact", True)]
    if unlike:
        return DOES_NOT_HOLD, [*reasons, f"{len(unlike)} member(s) on their solo tile differ in the backend's SplitPrefill"]
    if not any(not on_tile(m, "mixed") and not m["mixed_exact"] for m in members):
        return INCONCLUSIVE, [*reasons, "the control never differed: these batches do not show the tile matters"]
    if reasons:
        return INCONCLUSIVE, reasons
    through_backend = sum(on_tile(m, "backend") and "backend_exact" in m for m in members)
    padded = sum(on_tile(m, "backend") and not on_tile(m, "split") and "backend_exact" in m for m in members)
    return HOLDS, [f"{sum(on_tile(m, 'split') for m in members)} member(s) on their solo tile split are exact, "
                   f"{through_backend} on their solo tile through the backend's SplitPrefill ({padded} of them "
                   f"only in a padded call)"]


def format_member(m):
    def call(name):
        exact = "exact" if m[f"{name}_exact"] else f"differs (max abs {m[f'{name}_max_abs']:.3g})"
        return f"{name} tile {m[f'{name}_tile']} {exact}"

    exempt = ", KV exempt" if m["exempt"] else ""
    backend = ""
    if "backend_exact" in m:
        backend = f"; backend tile {m['backend_tile']} " + (
            "exact" if m["backend_exact"] else f"differs (max abs {m['backend_max_abs']:.3g})")
    return (f"  extend {m['start']}-{m['end']} of {m['prompt_len']}: solo tile {m['solo_tile']}{exempt}; "
            f"{call('split')}; {call('mixed')}{backend}")


def environment():
    import flashinfer
    import torch

    return dict(torch=torch.__version__, flashinfer=flashinfer.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name(), prefill_split=fa2.PREFILL_SPLIT)


def sglang_wrappers(shape, workspace):
    """run_backend's (new_wrapper, plan_args, plan_kwargs, forward_args) on the GPU: flashinfer wrappers made,
    planned and run as SGLang 0.5.23's deterministic backend makes, plans and runs its own
    (tools/fa2.py), all on one workspace."""
    import flashinfer
    import torch

    def new_wrapper():
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")

    plan_args = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, 1)
    plan_kwargs = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, non_blocking=True,
                       fixed_split_size=fa2.PREFILL_SPLIT)
    return new_wrapper, plan_args, plan_kwargs, dict(causal=True, sm_scale=shape.head_dim**-0.5)


def probe_parser(doc):
    """A GPU probe's argument parser: --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--json", help="write the JSON document here too")
    return parser


def has_gpu():
    """Whether a CUDA GPU is here; where not, said on stderr."""
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU and flashinfer", file=sys.stderr)
        return False
    return True


def probe_arguments(doc, argv):
    """A GPU probe's arguments (--json), or None where there is no CUDA GPU, said on stderr."""
    args = probe_parser(doc).parse_args(argv)
    return args if has_gpu() else None


def main(argv=None):
    args = probe_arguments(__doc__, argv)
    if args is None:
        return 2
    env = dict(environment(), kernel_facts=installed_facts().describe())  # fails here without flashinfer
    results = []
    for shape in SHAPES:
        rules = rules_at(shape)
        kernel = Fa2PagedPrefill(shape)
        backend = sglang_wrappers(shape, kernel.workspace)
        for batch in batches(shape.group):
            try:
                result = measure(shape, rules, batch, kernel, backend=backend)
            except Exception as error:  # a failed batch is reported, and the others still run
                result = dict(shape=shape.name, batch=batch.name, error=f"{type(error).__name__}: {error}")
            results.append(result)
            print(f"{shape.name}, {batch.name}: calls {result.get('groups', result.get('error'))}", flush=True)
            for m in result.get("members", ()):
                print(format_member(m), flush=True)
        del kernel  # its workspace, before the next shape allocates one
    outcome, reasons = verdict(results)
    doc = dict(environment=env, verdict=outcome, reasons=reasons, results=results)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"premise (a) {outcome}: {'; '.join(reasons)}", flush=True)
    return 0 if outcome == HOLDS else 1


if __name__ == "__main__":
    sys.exit(main())
