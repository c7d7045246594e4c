"""benchmarks/prefill_steps.py: SGLang's own scheduler over serving.py's rollouts and agents, counting prefill
steps and radix-hit tokens per setup (issue 48's yardstick against deterministic triton), and its record."""

import json
import pathlib

import pytest

from benchmarks import prefill_steps, serving
from benchmarks.workload import SchedulingConfig
from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks/logs/prefill_steps_cpu/prefill_steps.json").read_text())
QWEN = prefill_steps.SHAPES[1]
PLUGIN_256 = SchedulingConfig("plugin-256", 256, plugin=True)
# The record is SGLang 0.5.23's scheduler's; the driver runs the newest release's scheduler objects.
SCHEDULES = pytest.mark.skipif(
    not sglang_at_least(releases.NEWEST),
    reason=f"schedules with SGLang {releases.NEWEST}'s scheduler objects, not {installed_version()}'s",
)


@pytest.fixture(scope="module")
def qwen_rollouts():
    """Qwen2.5-7B's rollouts (GQA 7: a 128-token grid on flashinfer 0.7.2) under triton's scheduling and
    the plugin's at chunk 256 on each release's facts."""
    requests = prefill_steps.rollouts(prefill_steps.vocab_size(QWEN))
    return {release: prefill_steps.schedule(requests, PLUGIN_256 if release else prefill_steps.TRITON, QWEN, release)
            for release in (None, "0.7.2", "0.7.4")}


def test_the_rollouts_are_serving_pys_requests():
    vocab = prefill_steps.vocab_size(QWEN)
    assert [tokens for _, tokens in prefill_steps.rollouts(vocab)] == [p for p, _, _ in serving.rl_requests(0, vocab, 16, 8)]
    assert [spec.output_len for spec, _ in prefill_steps.rollouts(vocab)] == [n for _, n, _ in serving.rl_requests(0, vocab, 16, 8)]


def test_an_agents_next_turn_carries_its_answer_and_arrives_after_it():
    turns = prefill_steps.agent_turns(prefill_steps.vocab_size(QWEN), conversations=2, turns=2)
    (first, first_ids), (_, _), (second, second_ids), _ = turns
    answer = [prefill_steps.OUTPUT_BASE + first.rid] * serving.AGENT_ANSWER_TOKENS
    assert second_ids[:len(first_ids) + len(answer)] == first_ids + answer
    assert second.arrival_step - first.arrival_step == prefill_steps.TURN_GAP_STEPS


@SCHEDULES
def test_the_grid_costs_prefill_steps_on_flashinfer_072_and_not_on_074(qwen_rollouts):
    """At an odd group 0.7.2's grid cuts each sample's radix hit to 128 tokens: more steps than triton's.
    0.7.4's facts take starts anywhere: triton's steps, and its radix hits within 2%."""
    triton, old, new = (qwen_rollouts[release] for release in (None, "0.7.2", "0.7.4"))
    assert old["prefill_steps"] > 1.1 * triton["prefill_steps"]
    assert old["radix_hit_tokens"] < triton["radix_hit_tokens"]
    assert new["prefill_steps"] <= 1.02 * triton["prefill_steps"]
    assert new["radix_hit_tokens"] >= 0.98 * triton["radix_hit_tokens"]


@SCHEDULES
def test_the_record_is_what_the_scheduler_gives_now(qwen_rollouts):
    """A changed rule changes these counts: the record must then be run again."""
    rows = {(r["workload"], r["shape"], r["setup"], r["flashinfer_facts"]): r for r in RECORD["rows"]}
    for release, got in qwen_rollouts.items():
        row = rows[("rl", QWEN.name, "plugin-256" if release else "triton-256", release)]
        assert {key: row[key] for key in got} == got, release
    assert len(rows) == len(prefill_steps.WORKLOADS) * len(prefill_steps.SHAPES) * len(prefill_steps.SETUPS)


def test_benchmarks_readme_gives_the_records_ratios():
    text = (ROOT / "benchmarks/README.md").read_text()
    table = text[text.index("| chunk 256 | Granite rl / agents"):].split("\n\n")[0].splitlines()[2:]
    rows = {(r["workload"], r["shape"], r["setup"], r["flashinfer_facts"]): r for r in RECORD["rows"]}
    steps, hits = ("steps_to_triton", "{:.2f}x"), ("hits_to_triton", "{:.2f}")
    said = [(*steps, "plugin-256", "0.7.2"), (*steps, "plugin-256", "0.7.4"), (*hits, "plugin-256", "0.7.2"),
            (*hits, "plugin-256", "0.7.4"), (*steps, "plugin-256-pad", "0.7.4"), (*hits, "plugin-256-pad", "0.7.4")]
    assert len(table) == len(said)
    for line, (key, form, setup, release) in zip(table, said):
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        assert cells == [" / ".join(form.format(rows[(w, shape.name, setup, release)][key]) for w in ("rl", "agent"))
                         for shape in prefill_steps.SHAPES], line
    granite, _, llama = (
        [rows[("rl", shape.name, setup, release)]["prefill_steps"]
         for setup, release in (("plugin-256-pad", "0.7.4"), ("triton-256", None), ("plugin-256", "0.7.4"))]
        for shape in prefill_steps.SHAPES)
    flat = " ".join(text.split())
    assert (f"Llama-3.2-3B's rollouts schedule {llama[0]} steps against triton's {llama[1]} ({llama[2]} without pads), "
            f"Granite's triton's {granite[1]} ({granite[2]})") in flat and granite[0] == granite[1]


def test_the_serving_doc_gives_qwens_ratios_from_the_record():
    qwen = [r for r in RECORD["rows"] if r["shape"] == QWEN.name]
    ratio = {(r["workload"], r["setup"], r["flashinfer_facts"]): r["steps_to_triton"] for r in qwen}
    at_512 = [r["steps_to_triton"] for r in qwen if r["setup"] == "plugin-512"]
    assert ratio[("rl", "plugin-256", "0.7.2")] == pytest.approx(ratio[("agent", "plugin-256", "0.7.2")], abs=0.005)
    doc = " ".join((ROOT / "docs/serving.md").read_text().split())
    assert (f"{ratio[('rl', 'plugin-256', '0.7.2')]:.2f}x triton's steps at chunk 256 on flashinfer 0.7.2; with 0.7.4's "
            f"facts {ratio[('rl', 'plugin-256', '0.7.4')]:.2f}x on rollouts and {ratio[('agent', 'plugin-256', '0.7.4')]:.2f}x "
            f"on agents (each turn prefills its last answer again); {min(at_512):.2f}-{max(at_512):.2f}x at chunk 512") in doc
