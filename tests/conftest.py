"""Fixtures for the whole suite; the stand-ins for what needs a GPU or a model live in
the package (sglang_chunk_align.standins), shared with doctor and the benchmark.

The suite runs against whichever supported release is installed (.ci/run runs
it on the releases named in sglang_chunk_align/releases.py); what a release
lacks is skipped with a reason. A test marked `needs_grid_rules` skips on
releases without the grid rules, one marked `needs_radix_opt_in` on releases
where they do not reach radix hits and the tree.
"""

import os
import subprocess
import sys

import pytest

import sglang_chunk_align
from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least

# Nothing here may reach a model hub: SGLang's argument hooks look up model names.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if sglang_at_least(releases.GRID_RULES) and not sglang_at_least(releases.UNIFIED_PREFIX_CACHE):
    # The grid-rule tests build batches; these releases write a batch's KV indices with a
    # Triton kernel even without a GPU (support_triton reads only the backend name), which
    # Triton's interpreter runs on CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# marker -> (the first release it runs on, what that release brings)
RELEASE_MARKERS = {
    "needs_grid_rules": (releases.GRID_RULES, "the grid rules"),
    "needs_radix_opt_in": (
        releases.RADIX_OPT_IN, "the radix opt-in, where the grid rules reach radix hits and the tree"
    ),
}


def pytest_configure(config):
    for marker, (_, what) in RELEASE_MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: skip on SGLang releases without {what}")


def pytest_runtest_setup(item):
    for marker, (release, what) in RELEASE_MARKERS.items():
        if item.get_closest_marker(marker) and not sglang_at_least(release):
            pytest.skip(f"needs SGLang {release} or newer ({what}), not {installed_version()}")


@pytest.fixture(autouse=True)
def stock_after_each_test():
    yield
    sglang_chunk_align.remove()


@pytest.fixture
def plugin():
    sglang_chunk_align.apply()
    yield
    sglang_chunk_align.remove()


def _run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


@pytest.fixture
def fresh_python():
    """Run code in a fresh interpreter with extra environment: fresh_python(code, **env) -> CompletedProcess."""
    return _run_python


@pytest.fixture
def reported_once():
    """reported_once(stderr, problem, remedy) checks how a failed load reads: SGLang's loader logs
    what load() raises, with a traceback, so load() raises nothing and the problem is one ERROR
    line, with its remedy."""

    def check(stderr, problem, remedy):
        assert stderr.count("sglang-chunk-align FAILED: ") == 1, stderr[-3000:]
        failed = next(line for line in stderr.splitlines() if "sglang-chunk-align FAILED: " in line)
        assert problem in failed and remedy in failed, failed
        assert "Failed to execute general plugin" not in stderr and "ChunkAlignError" not in stderr, stderr[-3000:]

    return check


def pytest_sessionfinish(session, exitstatus):
    """A run in which every test skipped checked nothing: fail it rather than pass, so CI cannot
    pass vacuously. Only a run that ran tests counts: `--collect-only` (how editors and CI tools
    discover tests) runs none, and a `-k` that deselects everything is pytest's own exit 5."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    ran_tests = not session.config.option.collectonly
    if exitstatus == 0 and ran_tests and reporter is not None and not reporter.stats.get("passed"):
        reporter.write_line("no test passed (all skipped): failing the run", red=True)
        session.exitstatus = 1
