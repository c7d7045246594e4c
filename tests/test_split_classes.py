"""planning.split_by_tile (issue 25: one fa2 call per tile class), over integers alone.

The check every test applies is written from the kernel rule itself, not from
tile_conflicts: a call planned over one group gets Rules.batch_tile of that
group's extends, and each member not exempt by its short KV must get its
Rules.solo_tile there, unless split_by_tile said it cannot (off_tile). A
padded call (issue 48: Rules.pad_tiles) counts its padding member's extend in
that average.
"""

from functools import partial

from hypothesis import given
from hypothesis import strategies as st

from sglang_chunk_align.kernel_facts import FI072, FI074
from sglang_chunk_align.planning import Rules, split_by_tile

Rules = partial(Rules, facts=FI072)  # noqa: F811  the rules of flashinfer 0.7.2, whatever is installed
ALL_RULES = [
    Rules(), Rules(group=4), Rules(group=8, head_dim=128), Rules(group=1, head_dim=128),
    Rules(group=2, head_dim=256), Rules(group=4, head_dim=512), Rules(group=4, head_dim=128, facts=FI074),
]
SOME_RULES = st.sampled_from(ALL_RULES)
LONG_CHUNK = (1024, 1024, 3000)  # (extend_len, kv_len, prompt_len): the first chunk of a long prompt


@st.composite
def member(draw):
    """(extend_len, kv_len, prompt_len): prompts short and long, extends a suffix of the KV."""
    prompt_len = draw(st.one_of(st.integers(1, 24), st.integers(1, 200), st.integers(1, 5000)))
    kv_len = draw(st.integers(1, prompt_len))
    return draw(st.integers(1, kv_len)), kv_len, prompt_len


BATCHES = st.lists(member(), min_size=1, max_size=12)


def missed(members, groups, rules, pads=None):
    """Indices whose call, planned over their group alone (and its padding member's `pads` tokens
    where not 0), does not run on their solo tile."""
    pads = pads or [0] * len(groups)
    return sorted(
        i
        for group, pad in zip(groups, pads)
        for i in group
        if members[i][1] > rules.exempt_kv
        and rules.batch_tile([members[j][0] for j in group] + ([pad] if pad else [])) != rules.solo_tile(members[i][2])
    )


def smaller(tile, than):
    """A tile smaller than another at some head_dim class and larger at none (a tuple of tiles
    where the head_dim is unknown)."""
    tile, than = (tile, than) if isinstance(tile, tuple) else ((tile,), (than,))
    return tile != than and all(a <= b for a, b in zip(tile, than))


def test_a_thin_batch_splits_into_one_call_per_class():
    """Group 1, head_dim 128: a 40-token prompt (64-row tile) beside a long chunk runs on the 128-row
    tile in one call; split, each class gets its own. The 10-token prompt's KV is short enough for
    any tile (exempt), so it joins the first call it moves nobody off."""
    rules = Rules(head_dim=128)
    members = [LONG_CHUNK, (40, 40, 40), (10, 10, 10)]
    assert missed(members, [range(3)], rules) == [1]  # the single mixed call, as stock runs it
    split = split_by_tile(members, rules)
    assert (split.groups, split.off_tile) == (((0, 2), (1,)), ())
    assert missed(members, split.groups, rules) == []
    # At head_dim 256 the tile is capped at 64 rows, so the chunk and the 40-token prompt share a
    # class; no KV is exempt there, so the 10-token prompt (16 rows) gets a call of its own.
    assert split_by_tile(members, Rules(head_dim=256)).groups == ((0, 1), (2,))


def test_a_short_final_piece_rides_its_class_or_is_named_off_tile():
    """A 10-token final piece of a 1034-token prompt (solo: 128 rows) gets the 128-row tile in a call
    with a long chunk of its class, but alone its call averages 10 rows: split attention cannot fix
    that, so it is named (the rules' early cut or ride must prevent it)."""
    rules = Rules(head_dim=128)
    piece = (10, 1034, 1034)
    with_chunk = split_by_tile([LONG_CHUNK, piece, (40, 40, 40)], rules)
    assert (with_chunk.groups, with_chunk.off_tile) == (((0, 1), (2,)), ())
    alone = split_by_tile([piece, (40, 40, 40)], rules)
    assert (alone.groups, alone.off_tile) == (((0,), (1,)), (0,))
    # At group 8 the same 10 tokens are 80 packed rows: the full tile, no split needed.
    assert split_by_tile([piece, (40, 40, 40)], Rules(group=8, head_dim=128)).off_tile == ()


def test_an_unknown_head_dim_compares_tiles_at_every_head_dim_class():
    """40 tokens are the 64-row tile at head_dim 128 but the 32-row one at 512, 30 tokens 64 and 16:
    different classes where the head_dim is unknown, one where it is 128."""
    members = [(40, 40, 40), (30, 30, 30)]
    assert [Rules().solo_tile(n) for n in (40, 30)] == [(64, 64, 32), (64, 64, 16)]
    assert split_by_tile(members, Rules()).groups == ((0,), (1,))
    assert split_by_tile(members, Rules(head_dim=128)).groups == ((0, 1),)


@given(rules=SOME_RULES, members=BATCHES)
def test_every_group_runs_its_members_on_their_solo_tile_unless_named(rules, members):
    split = split_by_tile(members, rules)
    assert sorted(i for group in split.groups for i in group) == list(range(len(members)))
    assert all(split.groups)
    assert missed(members, split.groups, rules) == list(split.off_tile)
    # one call per solo tile, and one more at most for exempt members no call could take
    classes = {rules.solo_tile(p) for _, kv, p in members if kv > rules.exempt_kv}
    assert len(split.groups) <= len(classes) + 1


@given(rules=SOME_RULES, members=BATCHES)
def test_a_member_is_off_tile_only_where_its_own_class_averages_too_little(rules, members):
    """Never a larger tile than its class (each extend is at most its prompt), and off only where the
    call of its class's members alone falls short."""
    split = split_by_tile(members, rules)
    for i in split.off_tile:
        tile = rules.solo_tile(members[i][2])
        own_class = [e for e, kv, p in members if kv > rules.exempt_kv and rules.solo_tile(p) == tile]
        assert smaller(rules.batch_tile(own_class), tile)


def classes_in_tokens(rules):
    """{solo tile: the prompt lengths up to 300 tokens that get it}, for prompts whose KV counts."""
    classes = {}
    for n in range(rules.exempt_kv + 1, 300):  # every threshold is at most 64 packed rows
        classes.setdefault(rules.solo_tile(n), []).append(n)
    return classes


# At head_dim 128 and group 4 or 8 every prompt below the largest tile has KV short enough to be exempt.
SPLITTABLE = [rules for rules in ALL_RULES if len(classes_in_tokens(rules)) >= 2]


@given(rules=st.sampled_from(SPLITTABLE), prompts=st.lists(st.integers(1, 3000), max_size=10), data=st.data())
def test_the_check_catches_two_classes_merged_into_one_call(rules, prompts, data):
    """Sensitivity: whole prompts, each class's call on its tile, and two of those calls merged into
    one: one class is off its tile, and the same check says so."""
    classes = classes_in_tokens(rules)
    first, second = data.draw(st.lists(st.sampled_from(sorted(classes, key=str)), min_size=2, max_size=2, unique=True))
    anchors = [data.draw(st.sampled_from(classes[first])), data.draw(st.sampled_from(classes[second]))]
    members = [(n, n, n) for n in [*anchors, *prompts]]
    split = split_by_tile(members, rules)
    assert split.off_tile == () and missed(members, split.groups, rules) == []
    merged = [g for g in split.groups if 0 in g or 1 in g]
    assert len(merged) == 2
    wrong = [g for g in split.groups if g not in merged] + [merged[0] + merged[1]]
    assert missed(members, wrong, rules) != []


# Padded calls (issue 48): split attention at a known head_dim, on both releases' facts.
PADDED = [Rules(group=g, head_dim=d, split_attention=True, pad_tiles=True, facts=facts)
          for g, d in ((1, 128), (3, 128), (4, 128), (7, 128), (2, 256), (4, 512)) for facts in (FI072, FI074)]


@given(rules=st.sampled_from(PADDED), members=BATCHES)
def test_a_padded_call_puts_every_member_on_its_solo_tile_with_the_fewest_tokens(rules, members):
    split = split_by_tile(members, rules)
    assert split.off_tile == () and missed(members, split.groups, rules, split.pads) == []
    for group, pad in zip(split.groups, split.pads):
        extends = [members[i][0] for i in group]
        if pad > 1:  # one token fewer leaves the call on a smaller tile
            assert rules.batch_tile([*extends, pad - 1]) != rules.batch_tile([*extends, pad])
        if pad == 0:
            assert missed(members, [group], rules) == []


def test_the_piece_alone_in_its_class_is_padded_onto_its_tile():
    """The short final piece that split attention alone leaves off its tile: the 10 tokens and a pad
    of 120 average 65 rows, the 128-row tile. Without the pad the same call misses it (the check's
    control)."""
    rules = Rules(head_dim=128, split_attention=True, pad_tiles=True)
    members = [(10, 1034, 1034), (40, 40, 40)]
    split = split_by_tile(members, rules)
    assert (split.groups, split.off_tile, split.pads) == (((0,), (1,)), (), (120, 0))
    assert missed(members, split.groups, rules) == [0]


def test_pads_need_split_attention_and_a_known_head_dim():
    """Elsewhere a final piece keeps the full-tile length (min_final is min_tail) and nothing is padded."""
    for rules in (Rules(head_dim=128, pad_tiles=True), Rules(split_attention=True, pad_tiles=True)):
        assert not rules.pad_tiles and rules.min_final == rules.min_tail == 65
        assert split_by_tile([(10, 1034, 1034)], rules).pads == (0,)
    padded = Rules(head_dim=128, split_attention=True, pad_tiles=True)
    assert (padded.min_tail, padded.min_final) == (65, 1)
