"""Schedule statistics and predicted hazards: pure Python over a schedule document.

The hazard predictor is an independent oracle on purpose: it restates fa2's
tile choice (flashinfer 0.7.2's FA2DetermineCtaTileQ) from the kernel, and
imports nothing of sglang_chunk_align.planning, so a wrong rule in the
plugin's planner cannot also hide in the prediction the replay checks.
"""

from .scheduling import donor_runs
from .workload import ModelShape

GRID_TOKENS = 128  # fa2's 128-row q-tile is 128 tokens or fewer for every GQA group
SHORT_KV_TOKENS = 32  # rows whose causal KV is this short matched their solo rows in every probe


def schedule_stats(schedule, requests):
    entries = [tuple(e) for step in schedule["steps"] for e in step]
    extends_per_req = {}
    for rid, _, _ in entries:
        extends_per_req[rid] = extends_per_req.get(rid, 0) + 1
    return dict(
        prefill_steps=schedule["prefill_steps"],
        decode_steps=schedule["decode_steps"],
        extends=len(entries),
        mean_batch=round(len(entries) / max(1, schedule["prefill_steps"]), 2),
        chunked_requests=sum(n > 1 for n in extends_per_req.values()),
        starts_off_128=sum(s % GRID_TOKENS != 0 for _, s, _ in entries),
        short_cuts=sum(e < requests[rid].prompt_len and e - s < schedule["chunk"] for rid, s, e in entries),
        radix_hit_tokens=schedule["radix_hit_tokens"],
        retracted=schedule["retracted"],
        aborted=len(schedule["aborted"]),
    )


def cta_tile_q(avg_packed_qo_len, head_dim):
    """flashinfer 0.7.2 FA2DetermineCtaTileQ for head_dim < 512 on sm80+."""
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16


def predict_hazards(schedule, requests, shape: ModelShape):
    """rid -> sorted hazards: tile (batch tile != solo tile), off-grid (start off the solo q-tile
    grid), donor (a hazard in the rows that computed the KV it reuses), partial-tile (it reuses
    rows computed in a partial q-tile, which a longer prompt's solo prefill computes in a full one;
    the H200 probe found such rows differ, data-dependently).

    A hazard covers the rows of its extend whose causal KV is longer than
    SHORT_KV_TOKENS and that lie in the prompt (re-prefilled outputs are not
    compared). None when the configuration has no fixed split: its KV split
    follows the batch.
    """
    if schedule["fixed_split"] is None:
        return None
    g, d = shape.group, shape.head_dim
    solo_tile = {rid: cta_tile_q(r.prompt_len * g, d) for rid, r in requests.items()}
    spans = {rid: [] for rid in requests}  # rid -> [(first row, end row, hazards)]
    partial_tiles = {rid: [] for rid in requests}  # rid -> [(first row, end row)] of partial q-tiles
    for step in schedule["steps"]:
        tile = cta_tile_q(sum((e - s) * g for _, s, e in step) // len(step), d)
        for rid, s, e in step:
            tile_start = e * g // tile * tile // g  # tokens; the start of the tile holding row e - 1
            if e * g % tile and tile_start < e:
                partial_tiles[rid].append((max(s, tile_start, SHORT_KV_TOKENS), e))
            rows = (max(s, SHORT_KV_TOKENS), min(e, requests[rid].prompt_len))
            found = {"tile"} if tile != solo_tile[rid] else set()
            if s * g % solo_tile[rid]:
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
