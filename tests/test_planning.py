"""The pure planner behind the grid rules (the `plan` command is tested in test_cli.py)."""

from functools import partial

from hypothesis import example, given
from hypothesis import strategies as st

from sglang_chunk_align.alignment import chunk_size_error
from sglang_chunk_align.backends import Declaration
from sglang_chunk_align.kernel_facts import FI072, FI074
from sglang_chunk_align.planning import (
    KEEP, RIDE, WAIT, Rules, chunk_end, plan, published_len, q_tile_grid, tile_conflicts, usable_prefix,
)
from tests import kernel_oracle as oracle

# flashinfer 0.7.2's facts, whatever flashinfer is installed: the rules these tests pin.
Rules = partial(Rules, facts=FI072)  # noqa: F811
RULES = Rules()


def test_cta_tile_follows_fa2_thresholds_per_head_dim():
    rows = (1, 16, 17, 32, 33, 64, 65, 4096)
    assert [FI072.cta_tile(n, 128) for n in rows] == [16, 16, 64, 64, 64, 64, 128, 128]
    assert [FI072.cta_tile(n, 256) for n in rows] == [16, 16, 64, 64, 64, 64, 64, 64]
    assert [FI072.cta_tile(n, 512) for n in rows] == [16, 16, 16, 16, 32, 32, 32, 32]
    # unknown head_dim: every class's tile, so 17 and 33 rows (the same tile at 128) differ at 512
    assert FI072.cta_tile(17) != FI072.cta_tile(33) and FI072.cta_tile(65) == (128, 64, 32)


def test_q_tile_grid_per_group():
    assert [q_tile_grid(128, g) for g in (1, 2, 4, 5, 8)] == [128, 64, 32, 128, 16]


def test_cached_prefix_is_rounded_down_to_the_grid():
    assert usable_prefix(1000, 2500, RULES) == 896
    assert usable_prefix(1024, 2500, RULES) == 1024


def test_cached_prefix_leaves_a_tail_with_the_full_tile():
    assert usable_prefix(2000, 2001, RULES) == 1920  # stock would extend 1 token
    assert usable_prefix(2000, 2000 + 64, RULES) == 1920
    assert usable_prefix(150, 180, RULES) == 0


def test_short_tail_is_merged_into_the_previous_chunk():
    assert [c.end for c in plan(1040, 0, 256, RULES)] == [256, 512, 768, 896, 1040]
    assert [c.end for c in plan(1040, 0, 256, RULES, aligned=False)][-2:] == [1024, 1040]


def test_rules_are_counted_in_packed_rows():
    assert [(Rules(group=g).grid, Rules(group=g).min_tail) for g in (1, 2, 4, 8, 16)] == [
        (128, 65), (64, 33), (32, 17), (16, 9), (8, 5),
    ]
    assert Rules(group=3).grid == 128 and Rules(group=3).min_tail == 22  # 22 x 3 = 66 rows > 64


def test_a_known_group_relaxes_the_prefix_rounding():
    assert usable_prefix(1000, 2500, Rules(group=4)) == 992  # 1000 rounded to the 32-token grid
    assert usable_prefix(2000, 2010, Rules(group=4)) == 1984  # leaves 26 tokens = 104 rows
    assert usable_prefix(2000, 2010, RULES) == 1920  # group unknown: 128 grid, 65 tokens


def test_reused_prefix_sits_on_the_grid_and_the_page():
    rules = Rules(group=8, page_size=64)
    assert rules.grid == 64 and usable_prefix(1000, 2500, rules) == 960
    assert Rules(group=4, page_size=16).grid == 32


def test_chunk_128_lets_the_short_final_piece_ride_along():
    last = plan(1040, 0, 128, RULES)[-1]
    assert (last.start, last.end, last.tile, last.hazards) == (896, 1040, 128, ())
    assert chunk_end(896, 128, 1040, RULES, short_tail=KEEP) == 1024  # a memory-bound budget keeps the piece
    assert chunk_end(896, 128, 1040, RULES, short_tail=WAIT) == 896  # a leftover budget waits for room
    assert chunk_end(896, 128, 1040, RULES, short_tail=RIDE) == 1040
    assert chunk_end(896, 128, 1040, Rules(group=4), short_tail=RIDE) == 992  # a finer grid merges instead


def test_memory_pressure_cut_below_the_grid_waits():
    assert chunk_end(256, 8, 2000, RULES) == 256
    assert chunk_end(256, 200, 2000, RULES) == 384


def test_upstream_length_alignment_starts_off_the_grid_after_a_radix_hit():
    chunks = plan(2500, 1000, 256, RULES, aligned=False)
    assert all("starts off the q-tile grid" in c.hazards for c in chunks)
    assert not any(c.hazards for c in plan(2500, 1000, 256, RULES))


def test_tile_conflicts_in_thin_batches():
    long_chunk = (256, 2000, 3000)
    assert tile_conflicts([long_chunk] + [(1, 900, 900)] * 15, Rules(group=4)) == []
    assert tile_conflicts([long_chunk] + [(1, 900, 900)] * 31, Rules(group=4))  # measured: 31 fail
    assert tile_conflicts([long_chunk, (50, 50, 50)], RULES) == [(50, 50, 50)]
    assert tile_conflicts([long_chunk, (20, 20, 20)], Rules(head_dim=128)) == []  # KV too short to matter
    assert tile_conflicts([long_chunk, (20, 20, 20)], RULES) == [(20, 20, 20)]  # unknown head_dim
    # head_dim 256: fa2's tile is 64 rows above 16, so a 20-token prompt and a long chunk share it;
    # a batch averaging 16 rows or fewer moves it to the 16-row tile, and short KV does not help there
    assert tile_conflicts([long_chunk, (20, 20, 20)], Rules(head_dim=256)) == []
    thin = [long_chunk] + [(20, 20, 20)] + [(1, 300, 300)] * 30
    assert (20, 20, 20) in tile_conflicts(thin, Rules(head_dim=256))
    assert (20, 20, 20) not in tile_conflicts(thin, Rules(head_dim=128))


@given(
    prompt_len=st.integers(1, 20000),
    cached=st.integers(0, 20000),
    chunk=st.sampled_from([128, 192, 256, 320, 384, 512, 1024, 4096]),
    group=st.sampled_from([1, 2, 4, 8]),
    facts=st.sampled_from([FI072, FI074]),
    head_dim=st.sampled_from([None, 128, 256, 512]),
    packed_chunk=st.sampled_from([None, None, 256]),
)
@example(prompt_len=576, cached=0, chunk=512, group=1, facts=FI072, head_dim=None, packed_chunk=None)  # 512 would leave 64
@example(prompt_len=1040, cached=0, chunk=128, group=1, facts=FI072, head_dim=128, packed_chunk=None)  # 16 left: it rides
@example(prompt_len=2001, cached=2000, chunk=256, group=4, facts=FI072, head_dim=256, packed_chunk=None)  # 1 token left
@example(prompt_len=1040, cached=0, chunk=256, group=4, facts=FI072, head_dim=128, packed_chunk=256)  # 32-token grid alone: 1024
def test_every_plan_starts_on_the_grid_and_keeps_the_solo_tile(prompt_len, cached, chunk, group, facts, head_dim,
                                                               packed_chunk):
    """Mamba2's packed chunks (packed_chunk) join the grid: every piece starts on their multiples."""
    rules = Rules(group=group, head_dim=head_dim, facts=facts, packed_chunk=packed_chunk)
    align = Declaration(fa2=(None,), packed_chunk=packed_chunk).align(facts)
    if chunk_size_error(chunk, align, align, min_piece=rules.min_tail):
        assert chunk % align
        return
    chunks = plan(prompt_len, cached, chunk, rules)
    assert all(c.start % (packed_chunk or 1) == 0 for c in chunks)
    assert chunks[-1].end == prompt_len and all(c.end > c.start for c in chunks)
    for c in chunks:  # judged by kernel_oracle, not by the rules' own lengths
        assert not oracle.call_problems(facts, group, head_dim, [(c.start, c.end, prompt_len)]), c
    assert all(c.end - c.start < chunk + rules.min_tail for c in chunks)
    assert all(c.end - c.start <= chunk for c in chunks[:-1])
    assert not any(c.hazards for c in chunks)
    reusable = min(cached, prompt_len - 1)
    assert chunks[0].start <= reusable and reusable - chunks[0].start < rules.grid + rules.min_tail


def test_one_fact_changes_the_rules():
    """Starts off the grid exact (grid None): a chunk of 192 is accepted, a radix hit is not
    rounded (only min_tail is left to compute), and the backend declares 1."""
    anywhere = Rules(group=4, facts=FI072._replace(grid_rows=None))
    assert chunk_size_error(192, 128, 128) and not chunk_size_error(192, 1, 1, min_piece=anywhere.min_tail)
    assert (anywhere.grid, Rules(group=4).grid) == (1, 32)
    assert (usable_prefix(1000, 2500, anywhere), usable_prefix(1000, 2500, Rules(group=4))) == (1000, 992)
    assert usable_prefix(2000, 2010, anywhere) == 2010 - anywhere.min_tail == 1993
    assert [c.end for c in plan(1040, 0, 256, anywhere)][-2:] == [1023, 1040]  # the tail still gets its tile
    assert FI074.chunk_align == 1 and FI072.chunk_align == 128


def test_a_chunk_too_short_for_the_full_tile_is_refused_where_starts_do_not_matter():
    rules = Rules(group=1, facts=FI074)
    assert "at least 65" in chunk_size_error(64, 1, 1, min_piece=rules.min_tail)
    assert chunk_size_error(65, 1, 1, min_piece=rules.min_tail) is None
    assert chunk_end(0, 40, 2000, rules) == 0  # a memory-bound piece of 40 tokens would get the 64-row tile


def test_the_tree_takes_what_prefill_reproduces():
    prompt, up_to = 2000, 2100  # 100 generated tokens after a 2000-token prompt
    assert published_len(up_to, prompt, RULES) == 1920  # 0.7.2: partial-tile rows and decoded rows out
    assert published_len(up_to, prompt, Rules(facts=FI074)) == 2000  # 0.7.4: partial-tile rows reproduce
    equal_rows = FI074._replace(decoded_rows_equal=True)
    assert published_len(up_to, prompt, Rules(facts=equal_rows)) == 2100
    assert published_len(up_to, prompt, Rules(group=4, page_size=64, facts=FI072)) == 1984  # lcm(32, 64)


def test_the_grid_says_what_it_costs_where_another_measured_release_starts_chunks_anywhere():
    """0.7.2's start grid rounds radix hits and cuts down (128 tokens at odd groups): its description names
    0.7.4 and the command that installs it. Not where the page or a Mamba2 scan's chunks make the same grid,
    and not on 0.7.4."""
    remedy = "flashinfer 0.7.4 starts chunks anywhere: pip install 'flashinfer-python[cu13]==0.7.4'"
    assert FI072.grid_remedy() == remedy and FI074.grid_remedy() is None
    for rules in (Rules(group=7), Rules(group=4, page_size=16), Rules(group=7, packed_chunk=64)):
        assert rules.describe().endswith(f"), to which radix hits and chunk cuts round down ({remedy})"), rules
    for rules in (Rules(group=8, page_size=16), Rules(group=1, packed_chunk=256), Rules(group=7, facts=FI074)):
        assert "round down" not in rules.describe(), rules
