"""benchmarks/logs/gpu_steps.sh's `step` stops what its command left running, and only that.

A GPU plan runs its steps one after another on a machine held by the minute: a server a step left
behind holds the GPU's memory through the next step, and a kill by command-line pattern also hits
processes that are not the step's (the calling shell among them, where the pattern is in its text).
Here a step leaves a process in a session of its own, as real_server.py starts servers, beside a
bystander whose command line reads like an SGLang server's."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = Path(__file__).resolve().parents[1] / "benchmarks" / "logs" / "gpu_steps.sh"
pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")

# The step's command: starts `sleep` in a new session, as real_server.py starts servers, writes its pid, exits.
LEAVES_A_SERVER = (
    "import subprocess, sys; "
    "p = subprocess.Popen(['sleep', '120'], start_new_session=True); "
    "open(sys.argv[1], 'w').write(str(p.pid))"
)


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def bystander():
    """A process outside the step whose command line matches the old `pkill -f` pattern."""
    process = subprocess.Popen(["bash", "-c", 'exec -a "python3 -m sglang.cli.main serve" sleep 120'])
    yield process
    process.kill()
    process.wait()


def test_step_kills_what_its_command_left_and_spares_the_rest(tmp_path, bystander):
    pid_file = tmp_path / "left.pid"
    script = f'out={tmp_path}; py={sys.executable}; . {STEPS}; step leaves 30 $py -c "{LEAVES_A_SERVER}" {pid_file}'
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    left = int(pid_file.read_text())
    try:
        assert "== leaves: exit 0" in result.stdout, result.stdout + result.stderr
        assert not alive(left), "the process the step's command left behind is still running"
        assert alive(bystander.pid), "the step killed a process that was not its own"
        assert time.monotonic() - started < 15
    finally:
        if alive(left):
            os.kill(left, 9)
