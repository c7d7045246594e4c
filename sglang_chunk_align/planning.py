"""Where an extend may start and end, and which batches keep fa2 on one tile.

fa2 picks one CTA q-tile per batch from the integer average of the packed q
lengths (tokens x GQA group): 128 rows above 64, 64 rows above 16, else 16.
A request's chunked prefill is bit-exact against its solo unchunked prefill
when every chunk starts on the q-tile grid and runs on the tile its solo
prefill gets. Measured on an H200 with flashinfer 0.7.2 (tests/gpu/README.md,
"Kernel facts"): three rules close the holes a length alignment leaves:

- reuse a cached prefix only up to the grid, leaving at least `min_tail`
  tokens to compute (a 1-token extend over 2000 cached tokens gets a small tile);
- cut every chunk on the grid, memory-pressure and continuation cuts included;
- end a chunk one grid step early when the tail after it would be shorter
  than `min_tail` (possible only with a budget of two grid steps or more).

Every batch member must get its solo tile. At head_dim 128, a member whose
KV is at most KV_TOO_SHORT_TO_MATTER tokens gave the same result on any tile;
at head_dim 256 it did not (benchmarks/README.md), so only a known head_dim
below 256 earns that exemption.

Pure functions: the scheduler hooks, the CLI `plan` command and the tests use
them alike.
"""

import math
from dataclasses import dataclass

from .alignment import PREFILL_Q_TILE_TOKENS

KV_TOO_SHORT_TO_MATTER = 32


def q_tile_grid(group):
    """fa2's q-tile grid in tokens: 128 packed rows hold 128/group tokens."""
    return PREFILL_Q_TILE_TOKENS // math.gcd(PREFILL_Q_TILE_TOKENS, group)


def cta_tile(packed_rows):
    """The CTA q-tile fa2 picks for a batch whose average packed q length is `packed_rows`.

    This is FA2DetermineCtaTileQ for head_dim < 256 on sm80+. At head_dim 256
    fa2 caps the tile at 64 rows; rules that keep the 128-row choices equal
    keep those equal too, so they hold there, only more strictly than needed.
    """
    return 128 if packed_rows > 64 else 64 if packed_rows > 16 else 16


@dataclass(frozen=True)
class Rules:
    grid: int = PREFILL_Q_TILE_TOKENS  # tokens; chunks start on multiples of it
    min_tail: int = 65  # tokens; an extend this long gets the 128-row tile
    group: int = 1  # GQA group: q heads per KV head
    head_dim: int = None  # None: unknown, no short-KV exemption

    @property
    def exempt_kv(self):
        """Members whose KV is at most this many tokens may run on any tile."""
        return KV_TOO_SHORT_TO_MATTER if self.head_dim is not None and self.head_dim < 256 else 0

    def solo_tile(self, prompt_len):
        return cta_tile(prompt_len * self.group)

    def batch_tile(self, extend_lens):
        return cta_tile(sum(extend_lens) * self.group // len(extend_lens))


def usable_prefix(cached, prompt_len, rules):
    """How much of a cached prefix to reuse: on the grid, leaving min_tail tokens to compute."""
    used = min(cached, prompt_len - 1) // rules.grid * rules.grid
    while used > 0 and prompt_len - used < rules.min_tail:
        used -= rules.grid
    return used


def chunk_end(start, budget, prompt_len, rules, wait_for_room=False):
    """Where an extend starting at `start` (on the grid) with `budget` tokens ends.

    Returns `start` when no grid cut fits the budget: the request waits. A
    tail too short for the full tile that this budget cannot merge is
    unavoidable when the budget is a whole chunk; when `wait_for_room` (the
    budget is what other requests left over), the request waits instead.
    """
    if prompt_len - start <= budget:
        return prompt_len
    end = (start + budget) // rules.grid * rules.grid
    if prompt_len - end < rules.min_tail:
        if end - rules.grid > start:
            end -= rules.grid
        elif wait_for_room:
            return start
    return max(end, start)


def tile_conflicts(members, rules):
    """Members (extend_len, kv_len, prompt_len) whose batch tile differs from their solo tile."""
    tile = rules.batch_tile([extend for extend, _, _ in members])
    return [
        member
        for member in members
        if member[1] > rules.exempt_kv and rules.solo_tile(member[2]) != tile
    ]


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    tile: int
    hazards: tuple


def plan(prompt_len, cached, chunk, rules, aligned=True):
    """The chunks of one request prefilled alone: with the plugin's rules, or
    (aligned=False) as SGLang's length alignment cuts them."""
    if aligned:
        start = usable_prefix(cached, prompt_len, rules)
    else:
        start = min(cached, prompt_len - 1)
    chunks = []
    while start < prompt_len:
        if aligned:
            end = chunk_end(start, chunk, prompt_len, rules)
        else:
            end = min(prompt_len, start + chunk // rules.grid * rules.grid)
        chunks.append(_describe(start, end, prompt_len, rules))
        if end == start:
            break
        start = end
    return chunks


def _describe(start, end, prompt_len, rules):
    tile = rules.batch_tile([end - start]) if end > start else None
    hazards = []
    if end == start:
        hazards.append("no grid cut fits the budget")
    if start % q_tile_grid(rules.group):
        hazards.append("starts off the q-tile grid")
    if tile is not None and end > rules.exempt_kv and tile != rules.solo_tile(prompt_len):
        hazards.append(f"runs on the {tile}-row tile, solo prefill on {rules.solo_tile(prompt_len)}")
    return Chunk(start, end, tile, tuple(hazards))
