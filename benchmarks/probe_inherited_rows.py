"""Probe (GPU): which reused rows are inexact for the GQA-1 chat requests the replay flags.

For the chat workload's plugin-256 schedule at g1-d128 (page 1), prints each
inexact reused row: the request, the donor that computed it, the position,
the donor's prompt length and the steps in which the donor computed it.
logs/h200_probe_inherited_rows.log is its output on the schedules of commit
3b0cf98, before the radix tree stopped taking partial-tile rows
(prefill_hooks.publish_full_tiles); on today's schedules the replay finds no
inexact reused row, so it prints nothing.
Run from the repository root: python3 -m benchmarks.probe_inherited_rows
"""

import json
import os

from benchmarks.replay_determinism import Content, Fa2PagedPrefill, run_batches
from benchmarks.scheduling import donor_runs, load_requests
from benchmarks.workload import SHAPES
from sglang_chunk_align.tools import fa2

SCHEDULES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedules_chat.json")


def main():
    with open(SCHEDULES) as f:
        doc = json.load(f)
    shape = next(s for s in SHAPES if s.name == "g1-d128")
    schedule = next(s for s in doc["schedules"] if s["config"] == "plugin-256" and s["shape"] == shape.name
                    and s["page_size"] == 1)
    requests = load_requests(doc)
    content = Content(requests, doc["group_lens"], shape, "cuda")
    kernel = Fa2PagedPrefill(shape)
    solo = run_batches(content, kernel, [[(rid, 0, r.prompt_len)] for rid, r in requests.items()], fa2.PREFILL_SPLIT)
    out = run_batches(content, kernel, schedule["steps"], fa2.PREFILL_SPLIT)
    for rid, runs in sorted(donor_runs(schedule).items()):
        for donor, a, b in runs:
            theirs = out[content.offset[donor] + a: content.offset[donor] + b]
            mine = solo[content.offset[rid] + a: content.offset[rid] + b]
            donor_solo = solo[content.offset[donor] + a: content.offset[donor] + b]
            for i in (~(theirs == mine).flatten(1).all(1)).nonzero().flatten().tolist():
                pos = a + i
                steps = [(n, step) for n, step in enumerate(schedule["steps"]) for e in step
                         if e[0] == donor and e[1] <= pos < e[2]]
                print(f"request {rid} (prompt {requests[rid].prompt_len}) row {pos} from donor {donor} "
                      f"(prompt {requests[donor].prompt_len}, shared {requests[donor].shared_len}); "
                      f"donor exact vs its own solo: {bool((theirs[i] == donor_solo[i]).all())}; "
                      f"donor solo == requester solo: {bool((donor_solo[i] == mine[i]).all())}; computed in {steps}")


if __name__ == "__main__":
    main()
