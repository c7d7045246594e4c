"""The padded-calls schedule documents (issue 48) and what benchmarks/README.md says of them: each
table cell is the cost report's, read from the committed documents, and every padded schedule
records its pads and is predicted exact with the kernel facts it was scheduled with."""

import json
import pathlib

import pytest

from benchmarks import analysis, replay_determinism, scheduling, workload
from sglang_chunk_align.kernel_facts import release_facts

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = " ".join((ROOT / "benchmarks/README.md").read_text().split())
SHAPES = ("g4-d128", "g8-d128", "g2-d256", "g1-d128")
COLUMNS = (("fi074", "pad"), ("fi074", "chat_pad"), ("fi072", "pad"), ("fi072", "chat_pad"))  # as the table's


def document(facts, name):
    return json.loads((ROOT / f"benchmarks/schedules_{name}_{facts}.json").read_text())


def cost_cells(doc):
    """(shape, config) -> "steps vs upstream-128, cached tokens given up", as the cost report prints them."""
    lines = replay_determinism.cost_report(doc).splitlines()[2:]
    cells = {}
    for line in lines:
        _, shape, config, _, ratio, _, _, given_up, *_ = line.split(" | ")
        cells[shape, config] = f"{ratio}, {given_up}"
    return cells


def pad_rows():
    """The README table's rows: per shape, each column's cell without pads / with pads."""
    cells = [cost_cells(document(*column)) for column in COLUMNS]
    return ["| " + " | ".join([shape, *(f"{c[shape, 'plugin-256']} / {c[shape, 'plugin-256-pad']}" for c in cells)])
            + " |" for shape in SHAPES]


def test_the_readme_table_is_the_cost_report_of_the_committed_documents():
    for row in pad_rows():
        assert row in README, row


@pytest.mark.parametrize("column", COLUMNS)
def test_the_padded_schedules_record_pads_and_are_predicted_exact(column):
    doc = document(*column)
    facts = release_facts(doc["meta"]["flashinfer_facts"])
    assert facts.flashinfer == {"fi074": "0.7.4", "fi072": "0.7.2"}[column[0]]
    assert doc["meta"]["checkout"] == {"commit": "779fd3e87991ba30d1231a5f34454a2dfbe20ad8", "plugin_modified": False}
    requests = scheduling.load_requests(doc)
    shapes = {shape.name: shape for shape in workload.SHAPES}
    padded = [s for s in doc["schedules"] if s["config"] == "plugin-256-pad"]
    assert sorted(s["shape"] for s in padded) == sorted(SHAPES) and any(any(s.get("pads", ())) for s in padded)
    for schedule in (s for s in doc["schedules"] if s["plugin"] and s["config"] != "upstream-128"):
        hazards = analysis.predict_hazards(schedule, requests, shapes[schedule["shape"]], facts)
        assert not any(hazards.values()), (schedule["config"], schedule["shape"])
