"""Probe (GPU): does a decode step give a position the row its prompt's solo prefill gives it?

publish_full_tiles (sglang_chunk_align/prefill_hooks.py) keeps generated
tokens' KV out of the radix tree: in a multi-layer model a position's KV in
later layers comes from its attention row, and a later prompt that contains
those tokens computes that row by prefill. This asks whether the rows differ,
planned as SGLang's deterministic flashinfer backend plans both
(sglang_chunk_align/tools/fa2.py): decode with BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)
and a fixed split of 2048 (SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE), prefill with fa2 and a
fixed split of 4096. For the last 16 positions of each prompt, one decode
step each (query row p over KV [0, p]) against row p of the solo prefill.
Recorded in logs/h200_probe_decode_rows.log.
Run from the repository root: python3 -m benchmarks.probe_decode_rows
"""

import torch

from benchmarks.replay_determinism import Content, Fa2PagedPrefill, run_batches
from benchmarks.workload import SHAPES, RequestSpec
from sglang_chunk_align.tools import fa2

PROMPTS = (1042, 2147, 4600)
STEPS = 16


def decode_rows(content, shape, rid, positions):
    workspace = torch.empty(fa2.DETERMINISTIC_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    decode = fa2.TensorCoreDecode(workspace, shape.num_qo_heads, shape.num_kv_heads, shape.head_dim)
    rows = []
    for p in positions:
        start = content.offset[rid]
        decode.plan(torch.arange(start, start + p + 1, dtype=torch.int32, device="cuda"), fa2.DECODE_SPLIT)
        q = content.q[start + p: start + p + 1]
        rows.append(decode.forward(q, content.k_cache, content.v_cache))
        torch.cuda.synchronize()
    return torch.cat(rows)


def main():
    for shape in SHAPES:
        for length in PROMPTS:
            requests = {0: RequestSpec(0, 0, length, -1, 0, 0)}
            content = Content(requests, [], shape, "cuda")
            prefill = run_batches(content, Fa2PagedPrefill(shape), [[(0, 0, length)]], fa2.PREFILL_SPLIT)
            positions = range(length - STEPS, length)
            decoded = decode_rows(content, shape, 0, positions)
            solo = prefill[content.offset[0] + length - STEPS: content.offset[0] + length]
            differing = (~(decoded == solo).flatten(1).all(1)).sum().item()
            print(f"{shape.name} prompt {length}: {differing} of {STEPS} decoded rows differ from the solo "
                  f"prefill's (max abs diff {(decoded.float() - solo.float()).abs().max().item():.3g})", flush=True)


if __name__ == "__main__":
    main()
