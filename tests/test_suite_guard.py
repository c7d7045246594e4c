"""conftest.py fails a run in which every test skipped; discovering tests is not such a run."""

import os
import subprocess
import sys

import pytest
from conftest import RELEASE_INDEPENDENT

TESTS = os.path.dirname(__file__)
# Skipped at collection where there is no CUDA: collecting them reports a skip.
GPU_TESTS = os.path.join(TESTS, "gpu")


def _pytest(*args, pythonpath=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (pythonpath, os.environ.get("PYTHONPATH"))))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )


def test_collect_only_exits_0():
    result = _pytest("--collect-only", "-q", os.path.join(TESTS, "test_planning.py"), GPU_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all skipped" not in result.stdout


def test_a_k_that_deselects_everything_is_pytests_own_no_tests_exit():
    result = _pytest("-q", "-k", "no_test_has_this_name", os.path.join(TESTS, "test_planning.py"))
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout + result.stderr
    assert "all skipped" not in result.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_run_in_which_every_test_skipped_fails(tmp_path, workers):
    (tmp_path / "test_skipping.py").write_text("import pytest\n\ndef test_skips():\n    pytest.skip('nothing here')\n")
    result = _pytest("-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path), *workers, pythonpath=TESTS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no test passed (all skipped): failing the run" in result.stdout


# What SGLang pins, by import name and distribution name: a release-independent module reaches none.
_PINNED = {"sglang": "sglang", "torch": "torch", "flashinfer": "flashinfer-python", "triton": "triton",
           "transformers": "transformers"}
# sitecustomize.py for the run below: none of them imports, and none has a version.
_WITHOUT_SGLANG = f"""
import importlib.metadata, sys
for module in {sorted(_PINNED)!r}:
    sys.modules[module] = None
installed = importlib.metadata.distribution
def distribution(name):
    if name.lower().replace("_", "-") in {sorted(_PINNED.values())!r}:
        raise importlib.metadata.PackageNotFoundError(name)
    return installed(name)
importlib.metadata.distribution = distribution
"""


def test_release_independent_modules_pass_where_sglang_cannot_be_imported(tmp_path):
    """CI runs conftest.RELEASE_INDEPENDENT's modules on the newest release only, so each must
    pass, and skip nothing for want of a module, where SGLang and what it pins are not installed."""
    (tmp_path / "sitecustomize.py").write_text(_WITHOUT_SGLANG)
    this = f"{os.path.relpath(__file__, os.path.dirname(TESTS))}::{test_release_independent_modules_pass_where_sglang_cannot_be_imported.__name__}"
    modules = [os.path.join(TESTS, module) for module in RELEASE_INDEPENDENT]
    result = _pytest("-rs", "-m", "release_independent", "--deselect", this, *modules, pythonpath=str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skips if any(f"'{module}'" in line for module in _PINNED)], skips
