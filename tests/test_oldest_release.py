"""SGLang 0.5.12, the oldest supported release, as far as it imports on a CPU machine.

Its plugin system and attention backends import without a GPU, but its
scheduler does not (sgl_kernel needs libcuda.so.1), so the plugin cannot
resolve its scheduler patch points there. What must hold is that this
failure is loud and names the cause; test_release_wheels.py checks the patch
points themselves in the wheel. On GPU machines 0.5.12 imports normally.
"""

import json
import subprocess
import sys

import pytest
from conftest import SGLANG, sglang_at_least

pytestmark = pytest.mark.skipif(
    SGLANG is None or sglang_at_least("0.5.13"),
    reason=f"only for SGLang 0.5.12, whose scheduler needs a GPU to import; this is {SGLANG}",
)


def test_attention_backends_and_plugin_system_import():
    import sglang.srt.layers.attention.flashinfer_backend  # noqa: F401
    from sglang.srt.plugins import load_plugins  # noqa: F401


def test_doctor_names_the_scheduler_import_failure():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_chunk_align.cli", "doctor", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 1
    (problem,) = json.loads(result.stdout)["problems"]
    assert problem.startswith("SGLang 0.5.12: patch point sglang.srt.managers.scheduler.")
    assert "libcuda" in problem and "nothing was patched" in problem
