"""Where an extend may start and end, and which batches keep fa2 on one tile.

fa2 picks one CTA q-tile per batch from the integer average of the packed q
lengths (tokens x GQA group): 128 rows above 64, 64 rows above 16, else 16.
A request's chunked prefill is bit-exact against its solo unchunked prefill
when every chunk starts on the q-tile grid and runs on the tile its solo
prefill gets. Measured on an H200 with flashinfer 0.7.2 (tests/gpu/README.md,
"Kernel facts"), in packed rows, so a known group g relaxes each rule g-fold:

- the grid is 128 packed rows: 128/gcd(128, g) tokens;
- reuse a cached prefix only up to the grid (and SGLang's page), leaving a
  piece of more than 64 packed rows to compute (a 1-token extend over 2000
  cached tokens gets a small tile);
- cut every chunk on the grid, memory-pressure and continuation cuts included;
- end a chunk one grid step early when the piece after it would be 64 packed
  rows or fewer; where the budget holds no earlier cut (chunk 128 at group 1),
  the short final piece rides along with the chunk before it instead, so that
  extend exceeds the budget by less than a minimum piece.

Every batch member must get its solo tile. At head_dim 128, a member whose
KV is at most KV_TOO_SHORT_TO_MATTER tokens gave the same result on any tile;
at head_dim 256 it did not (benchmarks/README.md), so only a known head_dim
below 256 earns that exemption. Where the live backend does not say its
geometry, Rules() assumes group 1 and an unknown head_dim: the coarsest grid,
safe for every model.

Pure functions: the scheduler hooks, the CLI `plan` command and the tests use
them alike.
"""

import math
from dataclasses import dataclass

from .alignment import PREFILL_Q_TILE_TOKENS

KV_TOO_SHORT_TO_MATTER = 32
# fa2 gives an extend of more than this many packed rows its full 128-row tile.
FULL_TILE_ABOVE_ROWS = 64

# How chunk_end treats a final piece too short for the full tile that no earlier cut can merge.
KEEP, WAIT, RIDE = "keep", "wait", "ride"

# The model shapes the kernel facts above were measured at, with flashinfer 0.7.2 on an H200
# (tests/gpu/README.md; groups 3, 5, 7 and head_dim 64 in a replay); head_dim 512 was not.
# Elsewhere the rules are the same arithmetic, but nothing checked that fa2 follows it there.
MEASURED_GROUPS = (1, 2, 3, 4, 5, 7, 8)
MEASURED_HEAD_DIMS = (64, 128, 256)
MEASURED_SHAPES = (
    f"GQA groups {', '.join(map(str, MEASURED_GROUPS))} and head_dim "
    f"{', '.join(map(str, MEASURED_HEAD_DIMS))} (flashinfer 0.7.2 on an H200)"
)


def shape_coverage(group, head_dim):
    """A warning when the kernel facts were not measured at this GQA group or head_dim, else None.

    An unknown head_dim (None) gets none: the rules then assume the strictest one (no short-KV
    exemption)."""
    unmeasured = [f"GQA group {group}"] if group not in MEASURED_GROUPS else []
    if head_dim is not None and head_dim not in MEASURED_HEAD_DIMS:
        unmeasured.append(f"head_dim {head_dim}")
    if not unmeasured:
        return None
    return (
        f"{' and '.join(unmeasured)}: not measured; the kernel facts cover {MEASURED_SHAPES}, "
        "so bit-exactness here is the rules' arithmetic, unchecked on a GPU"
    )


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
    group: int = 1  # packed rows per token: q heads per KV head as fa2 is planned (1: unknown)
    head_dim: int = None  # None: unknown, no short-KV exemption
    page_size: int = 1  # SGLang's KV page: a reused prefix ends on a page

    @property
    def grid(self):
        """Tokens; every extend starts on a multiple of it."""
        return math.lcm(q_tile_grid(self.group), self.page_size)

    @property
    def min_tail(self):
        """Tokens; the shortest extend that gets the full 128-row tile."""
        return FULL_TILE_ABOVE_ROWS // self.group + 1

    @property
    def exempt_kv(self):
        """Members whose KV is at most this many tokens may run on any tile."""
        return KV_TOO_SHORT_TO_MATTER if self.head_dim is not None and self.head_dim < 256 else 0

    def solo_tile(self, prompt_len):
        return cta_tile(prompt_len * self.group)

    def batch_tile(self, extend_lens):
        return cta_tile(sum(extend_lens) * self.group // len(extend_lens))

    def describe(self):
        """The grid in words, for the scheduler's log line and doctor."""
        return (
            f"{self.grid}-token grid, pieces over {self.min_tail - 1} tokens "
            f"(GQA group {self.group}, head_dim {self.head_dim or 'unknown'}, page {self.page_size})"
        )


def usable_prefix(cached, prompt_len, rules):
    """How much of a cached prefix to reuse: on the grid, leaving min_tail tokens to compute."""
    used = min(cached, prompt_len - 1) // rules.grid * rules.grid
    while used > 0 and prompt_len - used < rules.min_tail:
        used -= rules.grid
    return used


def chunk_end(start, budget, prompt_len, rules, short_tail=KEEP):
    """Where an extend starting at `start` (on the grid) with `budget` tokens ends.

    Returns `start` when no grid cut fits the budget: the request waits. A
    final piece shorter than min_tail that ending one grid step early cannot
    merge is handled by `short_tail`: KEEP leaves it (the budget is bound by
    memory), WAIT returns `start` (the budget is what other requests left
    over), RIDE returns `prompt_len` (the piece rides with this extend).
    """
    if prompt_len - start <= budget:
        return prompt_len
    end = (start + budget) // rules.grid * rules.grid
    if prompt_len - end < rules.min_tail:
        if end - rules.grid > start:
            end -= rules.grid
        elif short_tail == WAIT:
            return start
        elif short_tail == RIDE:
            return prompt_len
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
    (aligned=False) as SGLang's length alignment cuts them. `chunk` is at least
    the 128-token alignment (cli checks it), so every extend is non-empty; None
    is chunked prefill off (what the scheduler makes of a size <= 0): one piece
    from the reused prefix to the end."""
    if aligned:
        start = usable_prefix(cached, prompt_len, rules)
    else:
        start = min(cached, prompt_len - 1)
    chunks = []
    while start < prompt_len:
        if chunk is None:
            end = prompt_len
        elif aligned:
            end = chunk_end(start, chunk, prompt_len, rules, short_tail=RIDE)
        else:
            end = min(prompt_len, start + chunk // PREFILL_Q_TILE_TOKENS * PREFILL_Q_TILE_TOKENS)
        chunks.append(_describe(start, end, prompt_len, rules))
        start = end
    return chunks


def _describe(start, end, prompt_len, rules):
    tile = rules.batch_tile([end - start])
    hazards = []
    if start % q_tile_grid(rules.group):
        hazards.append("starts off the q-tile grid")
    if end > rules.exempt_kv and tile != rules.solo_tile(prompt_len):
        hazards.append(f"runs on the {tile}-row tile, solo prefill on {rules.solo_tile(prompt_len)}")
    return Chunk(start, end, tile, tuple(hazards))
