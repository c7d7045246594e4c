"""conftest.py fails a run in which every test skipped; discovering tests is not such a run."""

import os
import subprocess
import sys

import pytest

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


def test_a_run_in_which_every_test_skipped_fails(tmp_path):
    (tmp_path / "test_skipping.py").write_text("import pytest\n\ndef test_skips():\n    pytest.skip('nothing here')\n")
    result = _pytest("-p", "conftest", "--rootdir", str(tmp_path), str(tmp_path), pythonpath=TESTS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no test passed (all skipped): failing the run" in result.stdout
