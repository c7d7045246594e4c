"""Probe (GPU): issue 32's premise (b). Is a decoding request's row the same in a decode step and
as a one-token extend inside a prefill batch (what --enable-mixed-chunk runs)?

Mixed chunks put decoding requests into a prefill batch as one-token extends,
so their attention runs in fa2's paged prefill (fixed split 4096) instead of
the decode step's tensor-core decode (fixed split 2048). The plugin may allow
mixed chunks under the grid rules only if a request's next token is the same
either way, whether its decode step runs eagerly or in SGLang's CUDA graphs.
For every shape of benchmarks.workload.SHAPES and each decoding request of
`KV_LENS` (its KV length, the new token's included), its new q row is
attended in these calls, as SGLang 0.5.23's deterministic flashinfer backend
plans them (tools/fa2.py):

- decode_alone: a decode step of the request alone, eager (fixed split 2048): the reference;
- decode_batch: one eager decode step of every request of KV_LENS;
- decode_graph: that step on a wrapper made for CUDA graphs, planned as
  SGLang plans graph decode under deterministic inference (no fixed split,
  split-KV disabled), captured in a CUDA graph and replayed;
- mixed: one fa2 prefill call of a 1024-token chunk of another request and
  every request's one-token extend (a mixed batch, as stock runs it);
- mixed_split: the one-token extends in their own fa2 call (split
  attention's class for them), and each alone (mixed_alone).

The premise holds where every mixed variant equals decode_alone for every
request, and decode_batch and decode_graph do too (otherwise decode itself is
not the reference to keep). Run from the repository root:
python3 -m benchmarks.probe_mixed_decode --json benchmarks/logs/mixed_decode_h200.json
"""

import json
import sys

from benchmarks.workload import SHAPES
from sglang_chunk_align.tools import fa2

KV_LENS = (1, 17, 100, 1000, 2047, 2049, 3000, 4097, 6000)
CHUNK = 1024  # the other request's prefill chunk in the mixed batch
HOLDS, DOES_NOT_HOLD = "holds", "does NOT hold"
MIXED_VARIANTS = ("mixed", "mixed_split", "mixed_alone")
DECODE_VARIANTS = ("decode_batch", "decode_graph")


def measure(shape, device="cuda"):
    """Per KV length, each variant's row against decode_alone's: exact, max abs difference."""
    import flashinfer
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(KV_LENS) + CHUNK

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    k, v = randn(total, 1, shape.num_kv_heads, shape.head_dim), randn(total, 1, shape.num_kv_heads, shape.head_dim)
    q = randn(len(KV_LENS), shape.num_qo_heads, shape.head_dim)  # each request's new token
    q_chunk = randn(CHUNK, shape.num_qo_heads, shape.head_dim)
    starts = [sum(KV_LENS[:i]) for i in range(len(KV_LENS))]
    pages = [torch.arange(s, s + n, dtype=torch.int32, device=device) for s, n in zip(starts, KV_LENS)]
    chunk_pages = torch.arange(total - CHUNK, total, dtype=torch.int32, device=device)
    workspace = torch.empty(fa2.DETERMINISTIC_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    dims = (shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
    heads = (*dims, 1)
    types = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    scale = shape.head_dim**-0.5

    def decode(members, graph=False):
        lens = [KV_LENS[i] for i in members]
        kv_indptr, indices = fa2.indptr(lens, device), torch.cat([pages[i] for i in members])
        if graph:
            return fa2.TensorCoreDecode.for_graph(workspace, *dims, kv_indptr, indices).replayed(q[members], k, v)
        wrapper = fa2.TensorCoreDecode(workspace, *dims)
        wrapper.plan_batch(kv_indptr, indices, **fa2.EAGER_DECODE_PLAN)
        return wrapper.forward(q[members], k, v)

    def extend(members, with_chunk):
        """One fa2 prefill call: the one-token extends of `members`, after the chunk where asked."""
        lens = ([CHUNK] if with_chunk else []) + [KV_LENS[i] for i in members]
        q_lens = ([CHUNK] if with_chunk else []) + [1] * len(members)
        indices = torch.cat(([chunk_pages] if with_chunk else []) + [pages[i] for i in members])
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        wrapper.plan(fa2.indptr(q_lens, device), fa2.indptr(lens, device), indices,
                     torch.ones(len(lens), dtype=torch.int32, device=device), *heads, **types,
                     fixed_split_size=fa2.PREFILL_SPLIT)
        q_in = torch.cat(([q_chunk] if with_chunk else []) + [q[members]])
        out = wrapper.forward(q_in, (k, v), causal=True, sm_scale=scale)
        return out[CHUNK:] if with_chunk else out

    everyone = list(range(len(KV_LENS)))
    reference = torch.cat([decode([i]) for i in everyone])
    rows = {
        "decode_batch": decode(everyone),
        "decode_graph": decode(everyone, graph=True),
        "mixed": extend(everyone, with_chunk=True),
        "mixed_split": extend(everyone, with_chunk=False),
        "mixed_alone": torch.cat([extend([i], with_chunk=False) for i in everyone]),
    }
    torch.cuda.synchronize()
    results = []
    for i, kv_len in enumerate(KV_LENS):
        entry = dict(kv_len=kv_len)
        for name, out in rows.items():
            diff = (out[i].float() - reference[i].float()).abs().max().item()
            entry[name] = dict(exact=bool((out[i] == reference[i]).all()), max_abs=diff)
        results.append(entry)
    return dict(shape=shape.name, rows=results)


def verdict(results):
    """(HOLDS or DOES_NOT_HOLD, reasons) over measure()'s results (a failed shape has "error")."""
    reasons = [f"{r['shape']}: {r['error']}" for r in results if "error" in r]
    rows = [row for r in results for row in r.get("rows", ())]
    if reasons or not rows:
        return DOES_NOT_HOLD, reasons or ["nothing was measured"]
    for names, what in ((DECODE_VARIANTS, "decode steps differ among themselves"),
                        (MIXED_VARIANTS, "one-token extends differ from the decode step")):
        for name in names:
            bad = [row["kv_len"] for row in rows if not row[name]["exact"]]
            if bad:
                reasons.append(f"{what}: {name} at KV lengths {sorted(set(bad))}")
    if reasons:
        return DOES_NOT_HOLD, reasons
    return HOLDS, [f"{len(rows)} decoding rows identical in every decode step and as one-token extends"]


def main(argv=None):
    from benchmarks.probe_split_attention import environment, probe_arguments

    args = probe_arguments(__doc__, argv)
    if args is None:
        return 2

    results = []
    for shape in SHAPES:
        try:
            result = measure(shape)
        except Exception as error:  # a failed shape is reported, and the others still run
            result = dict(shape=shape.name, error=f"{type(error).__name__}: {error}")
        results.append(result)
        for row in result.get("rows", ()):
            cells = ", ".join(
                f"{name} {'exact' if row[name]['exact'] else 'differs (%.3g)' % row[name]['max_abs']}"
                for name in (*DECODE_VARIANTS, *MIXED_VARIANTS)
            )
            print(f"{shape.name} KV {row['kv_len']}: {cells}", flush=True)
        if "error" in result:
            print(f"{shape.name}: {result['error']}", flush=True)
    outcome, reasons = verdict(results)
    doc = dict(environment=dict(environment(), decode_split=fa2.DECODE_SPLIT), verdict=outcome, reasons=reasons,
               kv_lens=KV_LENS, chunk=CHUNK, results=results)
    text = json.dumps(doc, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"premise (b) {outcome}: {'; '.join(reasons)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
