"""SGLang 0.5.12, the oldest supported release, as far as it imports on a CPU machine.

Its plugin system and attention backends import without a GPU, but its
scheduler does not (sgl_kernel needs libcuda.so.1), so the plugin cannot
resolve the patch points in the scheduler or in the modules that import it
(the engine). What must hold is that this
failure is loud and names the cause; test_release_wheels.py checks the patch
points themselves in the wheel. On GPU machines 0.5.12 imports normally.
"""

import json
import subprocess
import sys

import pytest

from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least

pytestmark = pytest.mark.skipif(
    installed_version() is None or sglang_at_least(releases.OLDEST_CPU_SCHEDULER),
    reason=f"only for SGLang {releases.OLDEST}, whose scheduler needs a GPU to import; this is {installed_version()}",
)


def test_attention_backends_and_plugin_system_import():
    import sglang.srt.layers.attention.flashinfer_backend  # noqa: F401
    from sglang.srt.plugins import load_plugins  # noqa: F401


def test_doctor_names_the_failing_patch_point_and_its_cause():
    result = subprocess.run(
        [sys.executable, "-m", "sglang_chunk_align.tools.cli", "doctor", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 1
    (problem,) = json.loads(result.stdout)["problems"]
    assert problem.startswith(f"SGLang {releases.OLDEST}: patch point sglang.srt.")
    assert "is missing or does not import" in problem
    assert "libcuda" in problem and "nothing was patched" in problem
