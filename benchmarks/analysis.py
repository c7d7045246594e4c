"""Schedule statistics and predicted hazards: pure Python over a schedule document.

The hazard predictor is an independent oracle on purpose: it takes fa2's
kernel facts (the tile choice, the grid, partial-tile rows) as data from
sglang_chunk_align.kernel_facts, for the flashinfer the replay runs on, and
imports nothing of sglang_chunk_align.planning, so a wrong rule in the
plugin's planner cannot also hide in the prediction the replay checks.
"""

from sglang_chunk_align.kernel_facts import STRICTEST, installed_facts

from .scheduling import donor_runs
from .workload import ModelShape

GRID_TOKENS = STRICTEST.chunk_align  # the schedule statistic "starts off 128": the strictest grid


def schedule_stats(schedule, requests):
    entries = [tuple(e) for step in schedule["steps"] for e in step]
    extends_per_req = {}
    for rid, _, _ in entries:
        extends_per_req[rid] = extends_per_req.get(rid, 0) + 1
    return dict(
        prefill_steps=schedule["prefill_steps"],
        decode_steps=schedule["decode_steps"],
        extends=len(entries),
        fa2_calls=len(fa2_calls(schedule)),
        mean_batch=round(len(entries) / max(1, schedule["prefill_steps"]), 2),
        chunked_requests=sum(n > 1 for n in extends_per_req.values()),
        starts_off_128=sum(s % GRID_TOKENS != 0 for _, s, _ in entries),
        short_cuts=sum(e < requests[rid].prompt_len and e - s < schedule["chunk"] for rid, s, e in entries),
        radix_hit_tokens=schedule["radix_hit_tokens"],
        retracted=schedule["retracted"],
        aborted=len(schedule["aborted"]),
    )


def fa2_calls(schedule):
    """The schedule's fa2 prefill calls: its steps, split by tile class where the scheduler driver
    recorded split attention's calls (a schedule where no step split or was padded, or recorded
    before split attention, has steps alone)."""
    return schedule.get("calls", schedule["steps"])


def call_pads(schedule):
    """The tokens of each fa2 call's padding member, 0 for none (a schedule the scheduler driver
    recorded no pad in, or recorded before pads, has none)."""
    return schedule.get("pads", [0] * len(fa2_calls(schedule)))


def predict_hazards(schedule, requests, shape: ModelShape, facts=None):
    """rid -> sorted hazards: tile (batch tile != solo tile), off-grid (start off the solo q-tile
    grid), donor (a hazard in the rows that computed the KV it reuses), partial-tile (it reuses
    rows computed in a partial q-tile, which a longer prompt's solo prefill computes in a full one;
    the H200 probe found such rows differ, data-dependently).

    A hazard covers the rows of its extend whose causal KV is longer than the
    facts' short-KV length and that lie in the prompt (re-prefilled outputs are
    not compared). None when the configuration has no fixed split: its KV split
    follows the batch. `facts`: the kernel facts of the flashinfer replayed on
    (default: the installed one's); off-grid and partial-tile hazards only where
    they say starts and partial tiles matter.
    """
    if schedule["fixed_split"] is None:
        return None
    facts = facts or installed_facts()
    short_kv = facts.short_kv_tokens
    g, d = shape.group, shape.head_dim
    solo_tile = {rid: facts.cta_tile(r.prompt_len * g, d) for rid, r in requests.items()}
    spans = {rid: [] for rid in requests}  # rid -> [(first row, end row, hazards)]
    partial_tiles = {rid: [] for rid in requests}  # rid -> [(first row, end row)] of partial q-tiles
    for step, pad in zip(fa2_calls(schedule), call_pads(schedule)):  # a padding member counts as a request
        tile = facts.cta_tile((sum((e - s) * g for _, s, e in step) + pad * g) // (len(step) + bool(pad)), d)
        for rid, s, e in step:
            tile_start = e * g // tile * tile // g  # tokens; the start of the tile holding row e - 1
            if e * g % tile and tile_start < e and not facts.partial_tile_rows_equal:
                partial_tiles[rid].append((max(s, tile_start, short_kv), e))
            rows = (max(s, short_kv), min(e, requests[rid].prompt_len))
            found = {"tile"} if tile != solo_tile[rid] else set()
            if facts.grid_rows and s * g % min(facts.grid_rows, solo_tile[rid]):
                found.add("off-grid")
            if found and rows[0] < rows[1]:
                spans[rid].append((*rows, found))
    hazards = {rid: set().union(*(h for _, _, h in own)) for rid, own in spans.items()}
    for rid, runs in donor_runs(schedule).items():
        if any(lo < b and a < hi for donor, a, b in runs for lo, hi, _ in spans[donor]):
            hazards[rid].add("donor")
        if any(lo < b and a < hi for donor, a, b in runs for lo, hi in partial_tiles[donor]):
            hazards[rid].add("partial-tile")
    return {rid: sorted(h) for rid, h in hazards.items()}


def prediction_summary(hazards):
    if hazards is None:
        return dict(predicted_exact_pct=None)
    n = len(hazards)
    return dict(
        predicted_exact_pct=round(100 * sum(not h for h in hazards.values()) / n, 1),
        tile=sum("tile" in h for h in hazards.values()),
        off_grid=sum("off-grid" in h for h in hazards.values()),
        donor=sum("donor" in h for h in hazards.values()),
        partial_tile=sum("partial-tile" in h for h in hazards.values()),
    )
