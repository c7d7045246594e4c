"""CPU checks of the replay benchmark (benchmarks/) on the small CI workload.

The schedules come from SGLang's real PrefillAdder; the replay runs on CPU
with stand-in kernels: one that is exact by construction, and one that
follows the tile/grid rule the benchmark predicts with, so measured results
must equal the predictions row for row.
"""

import json
import os
from dataclasses import asdict

import pytest

from benchmarks import analysis, replay_determinism, scheduling, workload
from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least
from sglang_chunk_align.kernel_facts import installed_facts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    not sglang_at_least(releases.NEWEST),
    reason=f"the benchmark drives SGLang {releases.NEWEST}'s scheduler objects, not {installed_version()}'s",
)
torch = pytest.importorskip("torch")

TINY_SHAPES = (workload.ModelShape("g4-d8", 8, 2, 8), workload.ModelShape("g2-d256", 4, 2, 256))


STOCK_CONFIGS = [c for c in workload.CONFIGS if not c.plugin]
PLUGIN_CONFIGS = [c for c in workload.CONFIGS if c.plugin]


@pytest.fixture(scope="module")
def doc():
    """Stock SGLang's schedules (deterministic and not): these test the benchmark itself."""
    return scheduling.schedule_workload(workload.SMALL_WORKLOAD, STOCK_CONFIGS)


@pytest.fixture(scope="module")
def plugin_doc():
    """The plugin's schedules, per model shape and page size: these test what the plugin makes SGLang do."""
    return scheduling.schedule_workload(workload.SMALL_WORKLOAD, PLUGIN_CONFIGS, page_sizes=(1, 16))


@pytest.fixture(scope="module")
def chat_doc():
    """Multi-turn chat: every radix hit comes from an earlier turn of the same conversation."""
    return scheduling.schedule_workload(
        workload.SMALL_CHAT_WORKLOAD, PLUGIN_CONFIGS, radix_modes=(True,), page_sizes=(1, 16), name="small-chat"
    )


def by_name(doc, config, radix):
    (schedule,) = [s for s in doc["schedules"] if s["config"] == config and s["radix"] == radix]
    return schedule


def test_workload_is_fixed():
    first, groups = workload.make_workload(workload.FULL_WORKLOAD)
    assert (first, groups) == workload.make_workload(workload.FULL_WORKLOAD)
    assert len(first) >= 200
    assert {r.prompt_len for r in first} <= set(range(1, 8193))
    assert any(r.shared_len for r in first) and len({r.arrival_step for r in first}) == workload.FULL_WORKLOAD.n_waves
    assert workload.make_workload(workload.FULL_WORKLOAD, seed=1) != (first, groups)


def test_committed_schedules_match_the_generator():
    with open(os.path.join(ROOT, "benchmarks", "schedules.json")) as f:
        committed = json.load(f)
    requests, group_lens = workload.make_workload(workload.FULL_WORKLOAD)
    assert committed["requests"] == [asdict(r) for r in requests]
    assert committed["group_lens"] == group_lens
    assert committed["meta"]["seed"] == workload.WORKLOAD_SEED


def test_alignment_comes_from_the_scheduler(doc):
    aligns = {s["config"]: s["truncation_align_size"] for s in doc["schedules"]}
    assert aligns == {"stock-4096": 4096, "stock-split-128": 128, "nondeterministic": None}


def assert_whole_prompts_in_order(doc):
    """Every request prefills [0, prompt) exactly once, in order, within the chunk budget; with the
    grid rules a short final piece (64 packed rows or fewer) may ride along past it."""
    requests = scheduling.load_requests(doc)
    groups = {shape.name: shape.group for shape in workload.SHAPES}
    for schedule in doc["schedules"]:
        donors = scheduling.donor_runs(schedule)
        position = {rid: sum(b - a for _, a, b in donors.get(rid, [])) for rid in requests}
        riding = installed_facts().full_tile_above_rows() // groups[schedule["shape"]] if schedule["shape"] else 0
        for step in schedule["steps"]:
            assert sum(e - s for _, s, e in step) <= schedule["chunk"] + riding  # the chunk budget binds
            for rid, s, e in step:
                assert s == position[rid] < e, (schedule["config"], rid)
                position[rid] = e
        assert schedule["retracted"] == 0 and not schedule["aborted"]
        assert position == {rid: r.prompt_len for rid, r in requests.items()}, schedule["config"]


def test_every_request_prefills_its_whole_prompt_in_order(doc):
    assert_whole_prompts_in_order(doc)


def test_radix_off_keeps_aligned_configs_on_the_grid(doc):
    for config in ("stock-4096", "stock-split-128"):
        schedule = by_name(doc, config, radix=False)
        assert all(s % 128 == 0 for step in schedule["steps"] for _, s, _ in step), config
        assert schedule["radix_hit_tokens"] == 0 and not schedule["donors"]


def test_radix_hits_land_off_the_grid(doc):
    requests = scheduling.load_requests(doc)
    schedule = by_name(doc, "stock-4096", radix=True)
    assert analysis.schedule_stats(schedule, requests)["starts_off_128"] > 0
    hazards = analysis.predict_hazards(schedule, requests, workload.SHAPES[0])
    assert any("off-grid" in h for h in hazards.values())
    assert any("donor" in h for h in hazards.values())


def test_length_alignment_predicts_tile_hazards_solo_would_not_have(doc):
    requests = scheduling.load_requests(doc)
    schedule = by_name(doc, "stock-split-128", radix=True)
    hazards = analysis.predict_hazards(schedule, requests, workload.SHAPES[0])
    tiled = [rid for rid, h in hazards.items() if "tile" in h]
    assert tiled
    # Alone and unchunked, each of these requests would be one batch with its solo tile.
    solo = {"steps": [[(rid, 0, requests[rid].prompt_len)] for rid in tiled],
            "donors": {}, "fixed_split": schedule["fixed_split"]}
    assert not any(analysis.predict_hazards(solo, requests, workload.SHAPES[0]).values())
    assert analysis.predict_hazards(by_name(doc, "nondeterministic", True), requests, workload.SHAPES[0]) is None


def test_plugin_schedules_finish_every_prompt_on_the_grid(plugin_doc, chat_doc):
    assert {s["truncation_align_size"] for s in plugin_doc["schedules"]} == {128}
    assert_whole_prompts_in_order(plugin_doc)
    assert_whole_prompts_in_order(chat_doc)
    for schedule in plugin_doc["schedules"]:
        if not schedule["radix"]:
            assert schedule["radix_hit_tokens"] == 0 and not schedule["donors"]


def test_plugin_schedules_are_predicted_exact_on_every_shape_chunk_and_page(plugin_doc, chat_doc):
    """The benchmark's own hazard predictor (independent of planning.py) finds nothing to flag in any
    plugin schedule, chunk 128 included; length alignment alone it flags (the check is sensitive)."""
    shapes = {shape.name: shape for shape in workload.SHAPES}
    flagged = set()
    for doc in (plugin_doc, chat_doc):
        requests = scheduling.load_requests(doc)
        assert {(s["page_size"], s["shape"]) for s in doc["schedules"] if s["config"] == "plugin-128"} == {
            (page, shape) for page in (1, 16) for shape in shapes
        }
        for schedule in doc["schedules"]:
            for shape in [shapes[schedule["shape"]]] if schedule["shape"] else shapes.values():
                hazards = analysis.predict_hazards(schedule, requests, shape)
                if schedule["shape"]:
                    assert not any(hazards.values()), (doc["meta"]["name"], schedule["config"], shape.name, hazards)
                elif any(hazards.values()):
                    flagged.add((doc["meta"]["name"], shape.name))
    assert {name for name, _ in flagged} == {"mixed", "small-chat"}


def test_cost_report_compares_each_shape_with_length_alignment(plugin_doc):
    report = replay_determinism.cost_report(plugin_doc)
    assert report.count("| plugin-256 |") == 2 * len(workload.SHAPES)  # radix on, pages 1 and 16
    assert "vs upstream-128" in report and "given up vs stock-4096" in report


def test_budget_use_splits_unused_budget_at_cuts_from_the_rest():
    """Chunk 256: a 300-token prompt cut at 256 (the budget spent), then its 44-token rest with a
    100-token request (112 unused, no cut); then a 200-token prompt cut at 128 (128 unused at a cut)."""
    schedule = {"chunk": 256, "steps": [[(0, 0, 256)], [(0, 256, 300), (1, 0, 100)], [(2, 0, 128)], [(2, 128, 200)]]}
    assert replay_determinism._budget_use(schedule, {0: 300, 1: 100, 2: 200}) == (600, 128, 112 + 184)


def test_schedule_command_prints_the_report(capsys, tmp_path):
    out = tmp_path / "small.json"
    assert replay_determinism.main(["schedule", "--workload", "small", "--configs", "stock-4096", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 1 | on | stock-4096 |" in printed and "predicted exact % g4-d128" in printed
    assert [s["config"] for s in json.loads(out.read_text())["schedules"]] == ["stock-4096"] * 2


class ExactKernel:
    """Stand-in for fa2: each output row depends only on its own position's Q/K/V."""

    def __init__(self, shape, device):
        self.shape, self.plan_calls = shape, 0

    def rows(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices):
        """(row -> batch index, row -> position in its request)."""
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        batch = torch.repeat_interleave(torch.arange(len(qo_lens)), qo_lens)
        first = (kv_lens - qo_lens)[batch]
        position = first + torch.arange(len(batch)) - qo_indptr[:-1].long()[batch]
        slot = kv_indices.long()[kv_indptr[:-1].long()[batch] + position]
        group = self.shape.group
        k = k_cache[slot, 0].repeat_interleave(group, dim=1)
        v = v_cache[kv_indices.long()[kv_indptr[:-1].long()[batch]], 0].repeat_interleave(group, dim=1)
        return batch, position, q + k + v

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, fixed_split):
        self.plan_calls += 1
        return self.rows(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)[2]

    def take_timing(self):
        calls, self.plan_calls = self.plan_calls, 0
        return calls, 0.0, 0.0


class TileRuleKernel(ExactKernel):
    """Off by a tile-dependent amount: exact only where the benchmark predicts no hazard."""

    def __call__(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, fixed_split):
        batch, position, out = self.rows(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices)
        self.plan_calls += 1
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
        g = self.shape.group
        facts = installed_facts()
        tile = facts.cta_tile(int(qo_lens.sum()) * g // len(qo_lens), self.shape.head_dim)
        start = kv_lens - qo_lens
        skew = (tile / 64 + 4 * ((start * g) % tile != 0).float())[batch]
        skew = torch.where(position < facts.short_kv_tokens, 0.0, skew)  # rows with a short causal KV
        return out + skew[:, None, None].to(out.dtype)


def test_replay_plumbing_is_exact_with_an_exact_kernel(doc):
    rows = replay_determinism.replay(doc, TINY_SHAPES[:1], device="cpu", make_kernel=ExactKernel)
    assert len(rows) == len(doc["schedules"])
    for row in rows:
        assert row["exact_pct"] == 100.0 and row["rows_mismatched"] == 0, row
        assert row["plan_calls"] == row["prefill_steps"]


def test_replay_measures_what_the_tile_rule_predicts(doc):
    rows = replay_determinism.replay(doc, TINY_SHAPES, device="cpu", make_kernel=TileRuleKernel)
    checked = [r for r in rows if r["prediction_check"] is not None]
    assert len(checked) == 2 * 2 * len(TINY_SHAPES)  # stock-4096 and stock-split-128, radix off and on
    for row in checked:
        check = row["prediction_check"]
        assert check["clear_inexact"] == 0 and check["hazard_exact"] == 0, row
        assert row["exact_pct"] == row["predicted_exact_pct"], row
    assert any(r["inherited_rows_mismatched"] for r in checked if r["radix"])
    assert any(r["exact_pct"] < 100 for r in checked)


def test_flashinfer_074_facts_schedule_chunk_192_off_the_grid_and_every_request_clear():
    """Planned with flashinfer 0.7.4's facts (starts anywhere exact), SGLang's PrefillAdder runs
    chunk 192, which 0.7.2's facts refuse: radix hits and cuts leave the 128 grid, and the
    predictor finds no hazard with 0.7.4's facts while 0.7.2's flag the off-grid starts."""
    from sglang_chunk_align.kernel_facts import FI072, FI074, facts_in_force

    shape = workload.SHAPES[0]
    doc = scheduling.schedule_workload(
        workload.SMALL_WORKLOAD, workload.OFF_GRID_CHUNK_CONFIGS[:1], radix_modes=(True,), shapes=(shape,),
        flashinfer="0.7.4",
    )
    assert doc["meta"]["flashinfer_facts"] == "0.7.4"
    assert facts_in_force() is installed_facts()  # the installed release's facts are back
    [schedule] = doc["schedules"]
    assert (schedule["chunk"], schedule["truncation_align_size"]) == (192, 1)
    requests = scheduling.load_requests(doc)
    assert not any(analysis.predict_hazards(schedule, requests, shape, FI074).values())
    assert any("off-grid" in h for h in analysis.predict_hazards(schedule, requests, shape, FI072).values())


def test_split_attention_leaves_no_tile_deferral_and_the_cost_report_counts_them():
    """Issue 32 in the scheduler: the same workload with split attention off defers requests to keep
    each batch on one tile (and takes more steps for it); on, nothing waits for a tile. The driver
    counts the plugin's deferrals by reason, and the cost report shows them beside the budget."""
    from sglang_chunk_align.decisions import ONE_TILE_PER_BATCH

    shape = next(s for s in workload.SHAPES if s.name == "g2-d256")
    configs = [c for c in workload.NAMED_CONFIGS if c.name in ("upstream-128", "plugin-256", "plugin-256-no-split")]
    doc = scheduling.schedule_workload(workload.SMALL_WORKLOAD, configs, radix_modes=(True,), shapes=(shape,))
    split, deferring = by_name(doc, "plugin-256", True), by_name(doc, "plugin-256-no-split", True)
    assert split["deferrals"] == {} and deferring["deferrals"][ONE_TILE_PER_BATCH] > 0
    assert split["prefill_steps"] < deferring["prefill_steps"]
    assert len(split["calls"]) > len(split["steps"])  # some steps ran as more than one fa2 call
    rows = {line.split(" | ")[2]: line for line in replay_determinism.cost_report(doc).splitlines()[2:]}
    assert rows["plugin-256"].endswith("| 0 / 0 / 0 |")
    assert rows["plugin-256-no-split"].endswith(f"| {deferring['deferrals'][ONE_TILE_PER_BATCH]} / 0 / 0 |")


def test_the_replay_runs_split_attentions_calls_which_keep_every_member_on_its_solo_tile():
    """Replayed with a kernel off wherever a member leaves its solo tile, split attention's schedule
    is exact when each step runs as the driver recorded its fa2 calls, and not when the same steps
    run as one call each (what the backend would do without SplitPrefill)."""
    shape = workload.ModelShape("g1-d128", 1, 1, 128)  # the grid rules' shape, with one head
    configs = [c for c in workload.NAMED_CONFIGS if c.name == "plugin-256"]
    doc = scheduling.schedule_workload(workload.SMALL_WORKLOAD, configs, radix_modes=(True,),
                                       shapes=[s for s in workload.SHAPES if s.name == shape.name])
    [schedule] = doc["schedules"]
    [row] = replay_determinism.replay(doc, (shape,), device="cpu", make_kernel=TileRuleKernel)
    assert row["exact_pct"] == 100.0 and row["plan_calls"] == len(schedule["calls"]) > len(schedule["steps"])
    one_call_per_step = {**doc, "schedules": [{k: v for k, v in schedule.items() if k != "calls"}]}
    [row] = replay_determinism.replay(one_call_per_step, (shape,), device="cpu", make_kernel=TileRuleKernel)
    assert row["exact_pct"] < 100.0 and row["plan_calls"] == len(schedule["steps"])


def test_the_replay_runs_padded_calls_which_keep_radix_hits_whole_and_on_their_solo_tile():
    """Issue 48's padded calls in the scheduler: with pads the same workload keeps more of its radix
    hits (final pieces of any length), and the driver records each call's padding member. Replayed
    with a kernel off wherever a member leaves its solo tile, the schedule is exact, as predicted,
    when each call runs with its padding member, and not when the same calls run without it."""
    shape = workload.ModelShape("g1-d128", 1, 1, 128)
    configs = [c for c in workload.NAMED_CONFIGS if c.name in ("plugin-256", "plugin-256-pad")]
    doc = scheduling.schedule_workload(workload.SMALL_WORKLOAD, configs, radix_modes=(True,),
                                       shapes=[s for s in workload.SHAPES if s.name == shape.name])
    unpadded, padded = by_name(doc, "plugin-256", True), by_name(doc, "plugin-256-pad", True)
    assert "pads" not in unpadded and padded["radix_hit_tokens"] > unpadded["radix_hit_tokens"]
    assert len(padded["pads"]) == len(padded["calls"]) and any(padded["pads"])
    rows = replay_determinism.replay({**doc, "schedules": [padded]}, (shape,), device="cpu", make_kernel=TileRuleKernel)
    [row, control] = rows  # the replay's control: the same calls without their pads
    assert row["exact_pct"] == row["predicted_exact_pct"] == 100.0 and row["plan_calls"] == len(padded["calls"])
    assert control["config"] == "plugin-256-pad, pads dropped" and control["plan_calls"] == len(padded["calls"])
    assert control["exact_pct"] == control["predicted_exact_pct"] < 100.0 and control["tile"] > 0
