"""Mamba2's chunked scan on a GPU: does a request's output depend on where its extend starts, in its
prefill batch (batching) or in its prompt (chunked prefill)?

SGLang's Mamba2 mixer runs one mamba_chunk_scan_combined call per prefill batch over the batch's
packed tokens, cut into mamba_chunk_size chunks counted from the batch's first token
(Mamba2Metadata's chunk_indices/chunk_offsets split a chunk where a request starts inside it).
A request that starts at another offset than its solo prefill's has its scan cut elsewhere. This
probe calls SGLang's own kernel as the mixer does (one packed row, seq_idx, cu_seqlens, initial
states where a request continues, fp32 states) on random inputs of one model shape, and compares a
request's output rows and final state bit for bit with its solo, unchunked scan:

- batched: the request after another one of `--lead` tokens in one call (lead 100: a start inside
  a kernel chunk; 256: on one);
- chunked: the request's prompt cut at `--cut` tokens, the first piece's final state carried into
  the second as SGLang's ssm cache does (fp32), each piece alone in its call.

    python benchmarks/probe_mamba2_batching.py --out probe_mamba2.json

The plugin's rules for Mamba2 hybrids (chunk starts on the kernel chunk, one request per prefill
batch) rest on what this measures; benchmarks/README.md has the run.
"""

import argparse
import json
import sys

# Nemotron-H-8B's Mamba2 layer on one GPU (benchmarks/models/nemotron-h-8b): heads x head_dim,
# groups x state, and its kernel chunk.
SHAPE = {"nheads": 128, "headdim": 64, "ngroups": 8, "dstate": 128, "chunk": 256}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="700,1000,1537", help="prompt lengths of the request compared")
    parser.add_argument("--leads", default="100,256", help="tokens of the request before it in a batched call")
    parser.add_argument("--cuts", default="128,256,512", help="where a chunked prefill cuts its prompt")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    cases = []
    for seed in range(args.seeds):
        for length in map(int, args.lengths.split(",")):
            probe = Probe(seed, length + 4096)
            solo = probe.scan([(0, length)])[0]
            for lead in map(int, args.leads.split(",")):
                batched = probe.scan([(length, length + lead), (0, length)])[1]
                cases.append(compare("batched", seed, length, {"lead": lead}, solo, batched))
            for cut in map(int, args.cuts.split(",")):
                if cut < length:
                    first = probe.scan([(0, cut)])[0]
                    rest = probe.scan([(cut, length)], initial=[first.state])[0]
                    chunked = Scan(torch.cat([first.rows, rest.rows]), rest.state)
                    cases.append(compare("chunked", seed, length, {"cut": cut}, solo, chunked))
    report = {"shape": SHAPE, "versions": versions(), "cases": cases, "summary": summary(cases)}
    with open(args.out, "w") as file:
        json.dump(report, file, indent=1)
    print(json.dumps(report["summary"], indent=1))
    return 0


class Scan:
    """One request's output rows (tokens x heads x head_dim) and final ssm state."""

    def __init__(self, rows, state):
        self.rows, self.state = rows, state


class Probe:
    """Random inputs of one Mamba2 layer for `tokens` tokens (seeded), and SGLang's scan over spans of them."""

    def __init__(self, seed, tokens):
        import torch

        generator = torch.Generator(device="cuda").manual_seed(seed)
        h, p, g, n = SHAPE["nheads"], SHAPE["headdim"], SHAPE["ngroups"], SHAPE["dstate"]

        def rand(*shape, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(dtype)

        self.x, self.dt = rand(tokens, h, p), rand(tokens, h, scale=0.5)
        self.B, self.C = rand(tokens, g, n), rand(tokens, g, n)
        self.A = -torch.exp(rand(h, dtype=torch.float32) * 0.5)
        self.D, self.dt_bias = rand(h, dtype=torch.float32), rand(h, dtype=torch.float32) * 0.1

    def scan(self, spans, initial=None):
        """One call over the requests `spans` ((start, end) of the inputs, in batch order), as
        SGLang's mixer makes it; `initial`: the final states the requests continue from (None:
        none does). Returns a Scan per request."""
        import torch
        from sglang.kernels.ops.mamba.triton_ops import mamba_chunk_scan_combined
        from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

        pick = torch.cat([torch.arange(s, e, device="cuda") for s, e in spans])
        lengths = torch.tensor([e - s for s, e in spans], device="cuda")
        query_start_loc = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        tokens = int(lengths.sum())
        seq_idx = torch.repeat_interleave(torch.arange(len(spans), dtype=torch.int32, device="cuda"), lengths)[None]
        chunk_indices = chunk_offsets = initial_states = None
        if initial is not None:  # the mixer computes these only where some request has an initial state
            chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(
                query_start_loc, SHAPE["chunk"], tokens)
            initial_states = torch.stack(initial)
        out = torch.empty(1, tokens, SHAPE["nheads"], SHAPE["headdim"], dtype=torch.bfloat16, device="cuda")
        states = mamba_chunk_scan_combined(
            self.x[pick][None], self.dt[pick][None], self.A, self.B[pick][None], self.C[pick][None],
            chunk_size=SHAPE["chunk"], D=self.D, z=None, dt_bias=self.dt_bias, seq_idx=seq_idx,
            chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, cu_seqlens=query_start_loc,
            initial_states=initial_states, return_varlen_states=True, return_final_states=False,
            dt_softplus=True, dt_limit=(0.0, float("inf")), out=out, state_dtype=torch.float32,
        )
        torch.cuda.synchronize()
        bounds = query_start_loc.tolist()
        return [Scan(out[0, bounds[i]:bounds[i + 1]].clone(), states[i].clone()) for i in range(len(spans))]


def compare(kind, seed, length, where, solo, other):
    """Bit-for-bit: the rows and the final state of `other` against the solo, unchunked scan."""
    differing = (_bits(solo.rows) != _bits(other.rows)).flatten(1).any(dim=1).nonzero().flatten().tolist()
    return {
        "kind": kind, "seed": seed, "length": length, **where,
        "rows_identical": not differing, "state_identical": bool((_bits(solo.state) == _bits(other.state)).all()),
        "rows_differing": len(differing), "first_row_differing": differing[0] if differing else None,
        "max_abs_diff": float((solo.rows.float() - other.rows.float()).abs().max()),
    }


def _bits(tensor):
    """The tensor's bits as integers of its width (bf16 rows, fp32 states)."""
    import torch

    return tensor.contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def summary(cases):
    """Per kind and offset: how many cases were identical in rows and state, of how many."""
    rows = {}
    for case in cases:
        key = f"{case['kind']} " + (f"after {case['lead']} tokens" if case["kind"] == "batched" else f"cut at {case['cut']}")
        seen = rows.setdefault(key, {"identical": 0, "cases": 0, "max_abs_diff": 0.0})
        seen["cases"] += 1
        seen["identical"] += case["rows_identical"] and case["state_identical"]
        seen["max_abs_diff"] = max(seen["max_abs_diff"], case["max_abs_diff"])
    return rows


def versions():
    import torch
    import triton

    import sglang

    return {"sglang": sglang.__version__, "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name()}


if __name__ == "__main__":
    sys.exit(main())
