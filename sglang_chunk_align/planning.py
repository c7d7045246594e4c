"""Where an extend may start and end, and which batches keep fa2 on one tile.

fa2 picks one CTA q-tile per batch from the integer average of the packed q
lengths (tokens x GQA group). A request's chunked prefill is bit-exact
against its solo unchunked prefill when every chunk runs on the tile its solo
prefill gets and, on flashinfer releases where starts matter (0.7.2: 128 packed
rows), starts on the q-tile grid. Those kernel facts come from
kernel_facts.py, per flashinfer release (Rules.facts: the scheduler passes the
ones in force, the default). Counted in packed rows, a known group g relaxes
each rule g-fold:

- the grid: 128 packed rows are 128/gcd(128, g) tokens, joined with SGLang's
  KV page and, in a Mamba2 hybrid, its scan's chunk; where starts do not
  matter (0.7.4) it is the page (and that chunk) alone;
- reuse a cached prefix only up to the grid, leaving a piece that gets the
  full tile to compute (a 1-token extend over 2000 cached tokens gets a small
  tile), or any piece where split attention pads its call onto its tile
  (Rules.pad_tiles, call_pad);
- cut every chunk on the grid, memory-pressure and continuation cuts included,
  and never cut a piece too short for the full tile before the prompt's end:
  where the piece after a cut would be too short, end the chunk earlier; where
  the budget holds no earlier cut (chunk 128 at group 1), the short final
  piece rides along with the chunk before it instead, so that extend exceeds
  the budget by less than a minimum piece;
- the radix tree takes only what prefill reproduces (published_len): not
  the rows of a partial final q-tile where those can differ, nor generated
  tokens' KV where decoded rows differ.

Every batch member must get its solo tile. A member whose KV is at most the
facts' short-KV length gave the same result on any tile at a known head_dim
below 256 (not at 256; benchmarks/README.md). Where the live backend does not
say its geometry, Rules() assumes group 1 and an unknown head_dim: the
coarsest grid, and tiles compared at every head_dim, safe for every model.

Pure functions: the scheduler hooks, the CLI `plan` command and the tests use
them alike.
"""

import math
from typing import NamedTuple

from .compat import PAD_TILES_ENV, SPLIT_ATTENTION_ENV, switch
from .kernel_facts import facts_in_force

# How chunk_end treats a final piece too short for the full tile that no earlier cut can merge.
KEEP, WAIT, RIDE = "keep", "wait", "ride"


def q_tile_grid(rows, group):
    """`rows` packed rows in tokens for a GQA group: 128 rows hold 128/gcd(128, group) tokens."""
    return rows // math.gcd(rows, group)


class Rules:
    """One process's rules, fixed at startup. The lengths derived from the kernel facts are
    computed once, here: the admission hooks read them several times per decision, and min_tail
    alone re-derived costs a continuation decision ~25 µs. A slots class, not a dataclass: this
    module loads in every SGLang process (patches.py says why)."""

    __slots__ = ("group", "head_dim", "page_size", "facts", "split_attention", "packed_chunk", "pad_tiles", "grid",
                 "min_tail", "min_final", "exempt_kv", "tile_grid")

    def __init__(self, group=1, head_dim=None, page_size=1, facts=None, split_attention=False, packed_chunk=None,
                 pad_tiles=False):
        self.group = group  # packed rows per token: q heads per KV head as fa2 is planned (1: unknown)
        self.head_dim = head_dim  # None: unknown, tiles compared at every head_dim, no short-KV exemption
        self.page_size = page_size  # SGLang's KV page: a reused prefix ends on a page
        self.facts = facts = facts_in_force() if facts is None else facts  # kernel_facts.KernelFacts
        # Whether the backend runs a batch as one fa2 call per tile class (split_attention.py), so
        # that members of different classes may share a batch.
        self.split_attention = split_attention
        # Tokens by which a linear-attention kernel (Mamba2) chunks a prefill batch's packed tokens, or
        # None (backends.Declaration.packed_chunk). Its chunks run from the batch's first token: a
        # request's fall where its solo prefill's do only where it starts its batch, alone, on a
        # multiple of it.
        self.packed_chunk = packed_chunk
        # Whether a split call whose extends average too few packed rows for its class's tile gets a
        # padding member that lifts it there (split_by_tile's pads), so that a piece of any length
        # runs on its solo tile: split attention at a known head_dim, where the tiles are one class's.
        self.pad_tiles = pad_tiles = bool(pad_tiles and split_attention and head_dim is not None)
        rows = facts.grid_rows
        # Tokens; every extend starts on a multiple of it.
        self.grid = math.lcm(q_tile_grid(rows, group) if rows else 1, page_size, packed_chunk or 1)
        # Tokens; the shortest extend that gets the full tile: every cut before a prompt's end is at
        # least this long, so the KV end the backend sees is in its prompt's tile class.
        self.min_tail = facts.full_tile_above_rows(head_dim) // group + 1
        # Tokens; the shortest final piece (one that ends its prompt, so its KV end is the prompt's):
        # any, where its call is padded onto its tile.
        self.min_final = 1 if pad_tiles else self.min_tail
        # Members whose KV is at most this many tokens may run on any tile.
        self.exempt_kv = facts.exempt_kv(head_dim)
        # Tokens; what fa2's largest q-tile (128 rows) spans, joined with the page: a prompt's
        # rows after its last multiple of it were computed in a partial q-tile.
        self.tile_grid = math.lcm(q_tile_grid(facts.cta_tile(1 << 30, 0), group), page_size)

    def _given(self):
        return (self.group, self.head_dim, self.page_size, self.facts, self.split_attention, self.packed_chunk,
                self.pad_tiles)

    def __eq__(self, other):  # rules are equal where they were given the same; the rest derives
        return type(other) is Rules and self._given() == other._given()

    def __hash__(self):
        return hash(self._given())

    def __repr__(self):
        return ("Rules(group={}, head_dim={}, page_size={}, facts={!r}, split_attention={}, packed_chunk={}, "
                "pad_tiles={})".format(*self._given()))

    def _pieces(self):
        pieces = f"pieces over {self.min_tail - 1} tokens"
        return f"{pieces} before a prompt's end, final pieces of any length (calls padded to their tiles)" \
            if self.pad_tiles else pieces

    def solo_tile(self, prompt_len):
        return self.facts.cta_tile(prompt_len * self.group, self.head_dim)

    def batch_tile(self, extend_lens):
        return self.facts.cta_tile(sum(extend_lens) * self.group // len(extend_lens), self.head_dim)

    def describe(self):
        """The grid in words, for the scheduler's log line, with what it costs where a chunk start off it
        is exact on another measured release (KernelFacts.grid_remedy)."""
        packed = (f", {self.packed_chunk}-token linear-attention kernel chunks: one request per prefill batch"
                  if self.packed_chunk else "")
        anywhere = math.lcm(self.page_size, self.packed_chunk or 1)  # the grid where starts do not matter
        remedy = self.facts.grid_remedy() if self.grid > anywhere else None
        return (
            f"{self.grid}-token grid, {self._pieces()} "
            f"(GQA group {self.group}, head_dim {self.head_dim or 'unknown'}, page {self.page_size}{packed}; "
            f"{self.facts.describe()})" + (f", to which radix hits and chunk cuts round down ({remedy})" if remedy else "")
        )


def usable_prefix(cached, prompt_len, rules):
    """How much of a cached prefix to reuse: on the grid, leaving a final piece (min_final) to compute."""
    return max(0, min(cached, prompt_len - rules.min_final) // rules.grid * rules.grid)


def published_len(up_to, prompt_len, rules):
    """How much of a request's KV (`up_to` tokens) the radix tree may take: what prefill reproduces.

    Rows of a prompt's partial final q-tile can differ from a longer prompt's
    solo prefill, where that tile is full, and decoded rows from prefill rows
    (flashinfer 0.7.2, tests/gpu/README.md, "Kernel facts"); each is kept out
    where the facts say so.
    """
    if not rules.facts.decoded_rows_equal:
        up_to = min(up_to, prompt_len)
    if not rules.facts.partial_tile_rows_equal:
        up_to = up_to // rules.tile_grid * rules.tile_grid
    return up_to


def chunk_end(start, budget, prompt_len, rules, short_tail=KEEP):
    """Where an extend starting at `start` (on the grid) with `budget` tokens ends.

    Returns `start` when no grid cut leaving a piece of at least min_tail fits
    the budget: the request waits. A final piece shorter than min_final that no
    earlier cut can merge is handled by `short_tail`: KEEP leaves it (the budget is bound by
    memory), WAIT returns `start` (the budget is what other requests left
    over), RIDE returns `prompt_len` (the piece rides with this extend).
    """
    if prompt_len - start <= budget:
        return prompt_len
    end = (start + budget) // rules.grid * rules.grid
    if prompt_len - end < rules.min_final:
        earlier = (prompt_len - rules.min_final) // rules.grid * rules.grid
        if earlier - start >= rules.min_tail:
            end = earlier
        elif short_tail == WAIT:
            return start
        elif short_tail == RIDE:
            return prompt_len
    return end if end - start >= rules.min_tail else start


def tile_conflicts(members, rules):
    """Members (extend_len, kv_len, prompt_len) whose batch tile differs from their solo tile."""
    tile = rules.batch_tile([extend for extend, _, _ in members])
    return [
        member
        for member in members
        if member[1] > rules.exempt_kv and rules.solo_tile(member[2]) != tile
    ]


class TileSplit(NamedTuple):
    """split_by_tile's answer."""

    groups: tuple  # tuples of batch indices, one per fa2 call, partitioning the batch
    # The indices whose group's call still misses their solo tile: what splitting cannot fix, so
    # the rules must still keep them out.
    off_tile: tuple
    # Per group, the tokens of the padding member its call gets (call_pad; 0: none).
    pads: tuple


def call_pad(extends, tile, rules):
    """Tokens of a padding member that lift a call of `extends` onto `tile`, its class's solo tile:
    0 where the call gets it already; None where no pad can (Rules.pad_tiles off, or `tile` the
    smallest, which a call of its class never averages above).

    The pad is the fewest tokens whose packed rows bring the call's integer average over the
    tile's threshold. It never overshoots into a larger tile: a tile's rows span at least 48
    packed rows, and one token adds at most the GQA group to the average."""
    if rules.batch_tile(extends) == tile:
        return 0
    above = rules.facts.rows_above(tile, rules.head_dim) if rules.pad_tiles else None
    if above is None:
        return None
    members = len(extends) + 1  # the pad is one more
    pad = max(1, -(-(above + 1) * members // rules.group) - sum(extends))
    return pad if rules.batch_tile([*extends, pad]) == tile else None


def split_by_tile(members, rules):
    """Members (extend_len, kv_len, prompt_len) split into fa2 calls, one per solo tile (issue 25).

    Each call is planned over its own group only, so its tile comes from its
    group's integer average packed extend length. Splitting by solo tile fixes
    what the rules now defer (decisions.deferral): thin batches, where other
    classes' extends move a member off its tile. It also fixes a short extend
    of a long prompt (a short final piece) that shares its call with longer
    extends of its class. A class whose own extends average too little for its
    tile, such as a short final piece of a long prompt alone in the 128-row
    class, gets a padding member where the rules pad (call_pad, issue 48);
    elsewhere that member is in off_tile, and stays the rules' to prevent
    (chunk_end ends early or lets it ride; usable_prefix leaves a full piece).
    A call never gets a larger tile than its class: each extend is at most its
    prompt, and the tile grows with the average.

    A member whose KV is at most rules.exempt_kv may run on any tile; it joins
    the first group it moves no member off, or else a call of such members.
    """
    classes = {}
    exempt = []
    for i, (_, kv_len, prompt_len) in enumerate(members):
        if kv_len > rules.exempt_kv:
            classes.setdefault(rules.solo_tile(prompt_len), []).append(i)
        else:
            exempt.append(i)
    calls = list(classes.items())  # (the class's solo tile, its members)

    def off_tile(group):
        conflicts = tile_conflicts([members[i] for i in group], rules)
        return [i for i in group if members[i] in conflicts]

    for i in exempt:
        home = next(((t, g) for t, g in calls if len(off_tile([*g, i])) <= len(off_tile(g))), None)
        if home is None:
            home = (None, [])
            calls.append(home)
        home[1].append(i)
    # Pads only where a call is off its class's tile (the groups are the unpadded split's).
    pads = [0 if tile is None else call_pad([members[i][0] for i in group], tile, rules) for tile, group in calls]
    return TileSplit(tuple(tuple(sorted(g)) for _, g in calls),
                     tuple(sorted(i for (_, g), pad in zip(calls, pads) if pad is None for i in off_tile(g))),
                     tuple(pad or 0 for pad in pads))


def switched_rules(can_split=True, **given):
    """Rules with split attention (where the backend `can_split` its prefill too) and padded calls
    as their switches give them: the scheduler's rules and `plan`'s read the switches here alone."""
    return Rules(**given, split_attention=can_split and switch(SPLIT_ATTENTION_ENV), pad_tiles=switch(PAD_TILES_ENV))


class Chunk(NamedTuple):
    start: int
    end: int
    tile: int
    hazards: tuple
    pad: int  # the tokens of the padding member its call gets (call_pad; 0: none)


def plan(prompt_len, cached, chunk, rules, aligned=True):
    """The chunks of one request prefilled alone: with the plugin's rules, or
    (aligned=False) as SGLang's length alignment cuts them, to the alignment the
    backend declares. `chunk` is one the scheduler accepts (cli checks it), so
    every extend is non-empty; None is chunked prefill off (what the scheduler
    makes of a size <= 0): one piece from the reused prefix to the end."""
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
            align = rules.facts.chunk_align
            end = min(prompt_len, start + chunk // align * align)
        chunks.append(_describe(start, end, prompt_len, rules, padded=aligned))
        start = end
    return chunks


def _describe(start, end, prompt_len, rules, padded):
    """A chunk with its tile (at head_dim 128 where the head_dim is unknown) and its hazards. Where
    the rules run (`padded`) and pad calls, the backend pads the chunk's call onto the class of its
    KV end (decisions.tile_groups), as here."""
    tile, solo, kv_class = rules.batch_tile([end - start]), rules.solo_tile(prompt_len), rules.solo_tile(end)
    pad = (padded and end > rules.exempt_kv and call_pad([end - start], kv_class, rules)) or 0
    if pad:
        tile = kv_class
    hazards = []
    rows = rules.facts.grid_rows
    if rows and start % q_tile_grid(rows, rules.group):
        hazards.append("starts off the q-tile grid")
    if end > rules.exempt_kv and tile != solo:
        hazards.append(f"runs on the {_rows(tile)}-row tile, solo prefill on {_rows(solo)}")
    return Chunk(start, end, _rows(tile), tuple(hazards), pad)


def _rows(tile):
    """A tile in rows; the head_dim-128 one of the tiles an unknown head_dim compares."""
    return tile[0] if isinstance(tile, tuple) else tile
