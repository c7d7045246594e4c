"""The overhead benchmark's plumbing (benchmarks/overhead.py) in --quick mode; never its timings."""

import statistics

import pytest

from benchmarks import overhead
from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least

pytestmark = pytest.mark.skipif(
    not sglang_at_least(releases.NEWEST),
    reason=f"the benchmark drives SGLang {releases.NEWEST}'s PrefillAdder and plugin loader, "
    f"not {installed_version()}'s",
)


def test_quick_run_measures_both_arms_of_every_cell(tmp_path, capsys):
    doc = overhead.main(["--quick", "--json", str(tmp_path / "overhead.json")])
    out = capsys.readouterr().out
    assert (tmp_path / "overhead.json").exists()

    for kind in overhead.DECISIONS:
        raw = doc["decisions"]["raw"][kind]
        rounds = overhead.QUICK["rounds"]
        for arm in ("stock", "plugin"):
            assert len(raw[arm]) == rounds and all(len(times) == overhead.QUICK["decisions"] for times in raw[arm])
        # Stock really ran stock; the plugin ran with the grid rules its startup check activated.
        assert raw["rules"]["stock"] == [None]
        assert len(raw["rules"]["plugin"]) == 1 and "grid" in raw["rules"]["plugin"][0]
        # Both arms decided the same thing, so the timings compare like with like.
        assert raw["outcomes"]["stock"] == raw["outcomes"]["plugin"]
        summary = doc["decisions"]["summary"][kind]
        assert f"{kind}: ratio {summary['ratio']:.3f} (" in out
        fastest = [min(statistics.median(times) for times in raw[arm]) / 1000 for arm in ("stock", "plugin")]
        assert summary["fastest_round_us"] == fastest
        assert f"fastest rounds {fastest[0]:.1f} µs stock, {fastest[1]:.1f} µs plugin)" in out

    for label in overhead.LOAD_MODULES:
        cell = doc["load"]["raw"][label]
        assert len(cell["chunk_align"]) == len(cell["baseline"]) == overhead.QUICK["runs"]
        assert {r["plugin_state"] for r in cell["chunk_align"]} == {"applied"}
        assert {r["plugin_state"] for r in cell["baseline"]} == {None}
        assert f"| {label} |" in out
