"""What fa2 does with a schedule, restated from kernel_facts.py's table alone: the oracle the
property tests judge the grid rules by.

The rules (planning.Rules, decisions.py) derive a grid, a shortest piece and tile conflicts from
the kernel facts. A property test that takes those from the code under test shares its mistakes
(an off-by-one in Rules.min_tail passes a test that checks pieces against rules.min_tail). These
functions read only KernelFacts' raw fields, each as its comment in kernel_facts.py says:

- tile_classes: fa2 plans one CTA q-tile per call from the integer average of its members' packed
  q lengths (tokens x GQA group). Its head_dim picks the class with the largest head_dim bound at
  most its own (the cap: no 128-row tile at head_dim 256); the tile is the first whose row
  threshold that average exceeds, else the class's smallest.
- grid_rows: a request's solo (unchunked) prefill lays its 128-row q-tiles from row 0, and a chunk
  reproduces its rows only where it starts where one of them starts; None: anywhere.
- short_kv_tokens, short_kv_below_head_dim: a member with at most that much KV gets the same rows
  on any tile, at a head_dim below the bound.

A request is exact when each of its chunks starts so and its call gets the tile of the request's
whole prompt alone (its solo tile). Group, head_dim and page are the tests' inputs, as they are
Rules'. Where a test's rules do not know the head_dim, the oracle asks at each of HEAD_DIMS.
"""

import math

HEAD_DIMS = (64, 128, 256, 512)  # the head_dims an unknown model may have: every class, each side of the cap


def head_dims(head_dim):
    return HEAD_DIMS if head_dim is None else (head_dim,)


def tile(facts, packed_rows, head_dim):
    """The q-tile (rows) fa2 gives a call whose integer average packed q length is `packed_rows`."""
    _, thresholds, smallest = max(c for c in facts.tile_classes if c[0] <= head_dim)
    for above, rows in thresholds:
        if packed_rows > above:
            return rows
    return smallest


def solo_tile(facts, group, head_dim, prompt_len):
    return tile(facts, prompt_len * group, head_dim)


def gets_largest_tile(facts, group, head_dim, prompt_len):
    """Whether a prompt's solo prefill gets its class's largest tile (at each of HEAD_DIMS where
    the head_dim is None). The rules hold every prompt to that tile's shortest piece; a shorter
    prompt's pieces may be exact on a smaller one, so the rules are stricter than they need be there."""
    return all(solo_tile(facts, group, d, prompt_len) == tile(facts, 1 << 30, d) for d in head_dims(head_dim))


def on_tile_start(facts, group, start):
    """Whether an extend starting at token `start` starts where a 128-row tile of the solo prefill does."""
    return facts.grid_rows is None or start * group % facts.grid_rows == 0


def start_step(facts, group, page_size):
    """Tokens between the starts on_tile_start allows that also lie on a page: where a test's
    requests may begin."""
    rows = facts.grid_rows or 1
    return math.lcm(rows // math.gcd(rows, group), page_size)


def call_problems(facts, group, head_dim, members, pad=0):
    """Why members (start, end, prompt_len) of one fa2 call, with a padding member of `pad` tokens
    where not 0, are not exact (at `head_dim`, or at each of HEAD_DIMS where None), one line each;
    [] where every one is."""
    problems = [
        f"{start}..{end} of {prompt_len}: starts off the {facts.grid_rows}-row tiles"
        for start, end, prompt_len in members if not on_tile_start(facts, group, start)
    ]
    extends = [end - start for start, end, _ in members] + ([pad] if pad else [])
    for d in head_dims(head_dim):
        call = tile(facts, sum(extends) * group // len(extends), d)
        for start, end, prompt_len in members:
            solo = solo_tile(facts, group, d, prompt_len)
            any_tile = end <= facts.short_kv_tokens and d < facts.short_kv_below_head_dim
            if call != solo and not any_tile:
                problems.append(f"{start}..{end} of {prompt_len}: the {call}-row tile at head_dim {d}, solo {solo}")
    return problems


def rest_problems(facts, group, head_dim, end, prompt_len):
    """Why the rest of a prompt cut at `end` can no longer be prefilled exactly by calls of its
    own: its next chunk starts at `end`, and its final piece, at most the rest, must get the solo
    tile alone; [] where it can (or nothing is left)."""
    if end == prompt_len:
        return []
    return call_problems(facts, group, head_dim, [(end, prompt_len, prompt_len)])


def chunk_problems(facts, group, head_dim, start, end, prompt_len):
    """Why a request's chunk start..end, in a call of its own, is not exact or leaves a rest that
    cannot be; [] where neither (an empty chunk, the request waiting, has none)."""
    if end == start:
        return []
    return call_problems(facts, group, head_dim, [(start, end, prompt_len)]) + rest_problems(
        facts, group, head_dim, end, prompt_len
    )


def can_progress(facts, group, head_dim, page_size, start, budget, prompt_len):
    """Whether some chunk from `start` within `budget` tokens, ending on a page or at the prompt's
    end, is exact in a call of its own and leaves a rest that can be: where one is, a request alone
    that the chunk budget cut must not wait."""
    ends = range(start + page_size - start % page_size, min(start + budget, prompt_len) + 1, page_size)
    return any(
        not chunk_problems(facts, group, head_dim, start, end, prompt_len)
        for end in (*ends, prompt_len) if start < end <= start + budget
    )
