"""Probe (GPU): do two solo prefills that share a prefix give the same rows on it?

Asked of the GQA-1 chat requests that were inexact only in rows reused from
other requests (benchmarks/README.md, "What the numbers say"); the answer,
recorded in logs/h200_probe_shared_rows.log, is yes at every shape tried.
Run from the repository root: python3 -m benchmarks.probe_shared_rows
"""
from benchmarks.replay_determinism import Fa2PagedPrefill, Content, run_batches
from benchmarks.workload import RequestSpec, ModelShape
from sglang_chunk_align.tools import fa2


def main():
    pairs = [(1042, 2147), (1042, 1100), (1042, 1152), (1042, 1153), (2063, 2147), (1000, 2000), (1024, 2147), (1040, 2147), (1041, 2147), (1100, 2147)]
    for shape in (ModelShape("g1-d128", 32, 32, 128), ModelShape("g4-d128", 32, 8, 128), ModelShape("g2-d256", 16, 8, 256)):
        for short, long in pairs:
            reqs = {0: RequestSpec(0, 0, short, 0, short - 1, 0), 1: RequestSpec(1, 0, long, 0, long - 1, 0)}
            content = Content(reqs, [long], shape, "cuda")
            kernel = Fa2PagedPrefill(shape)
            out = run_batches(content, kernel, [[(0, 0, short)], [(1, 0, long)]], fa2.PREFILL_SPLIT)
            a = out[content.offset[0]: content.offset[0] + short - 1]
            b = out[content.offset[1]: content.offset[1] + short - 1]
            bad = (~(a == b).flatten(1).all(1)).nonzero().flatten().tolist()
            print(shape.name, short, long, "rows differing:", len(bad), bad[:10], flush=True)


if __name__ == "__main__":
    main()
