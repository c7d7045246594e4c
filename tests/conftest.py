"""Fixtures for the whole suite; the stand-ins for what needs a GPU or a model live in
the package (sglang_chunk_align.standins), shared with doctor and the benchmark.

The suite runs against whichever supported release is installed (.ci/run runs
it on the releases named in sglang_chunk_align/releases.py); what a release
lacks is skipped with a reason. A test marked `needs_grid_rules` skips on
releases without the grid rules.
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


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_grid_rules: skip on SGLang releases without the grid rules")


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_grid_rules") and not sglang_at_least(releases.GRID_RULES):
        pytest.skip(f"the grid rules need SGLang {releases.GRID_RULES} or newer, not {installed_version()}")


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


def pytest_sessionfinish(session, exitstatus):
    """A run in which every test skipped checked nothing: fail it rather than pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if exitstatus == 0 and reporter is not None and not reporter.stats.get("passed"):
        reporter.write_line("no test passed (all skipped): failing the run", red=True)
        session.exitstatus = 1
