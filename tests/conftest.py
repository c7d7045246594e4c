"""Fixtures for the whole suite; the stand-ins for what needs a GPU or a model live in
the package (sglang_chunk_align.harness.standins), shared with doctor and the benchmark.

The suite runs against whichever supported release is installed (.ci/run runs
it on the releases named in sglang_chunk_align/releases.py); what a release
lacks is skipped with a reason. A test marked `needs_grid_rules` skips on
releases without the grid rules, one marked `needs_radix_opt_in` on releases
where they do not reach radix hits and the tree (so the radix cache stays off there),
one marked `needs_gemm_configs` on releases before the GEMM configs.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from hypothesis import settings

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


# Under CI (CI set, as .ci/run sets it) every property test draws the same examples on every run,
# and none are replayed from a local example database: a fault is caught or not whatever the day.
# Elsewhere Hypothesis draws afresh, which finds what a fixed draw never reaches.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# marker -> (the first release it runs on, what that release brings)
RELEASE_MARKERS = {
    "needs_grid_rules": (releases.GRID_RULES, "the grid rules"),
    "needs_radix_opt_in": (
        releases.RADIX_OPT_IN, "the radix cache kept on, where the grid rules reach radix hits and the tree"
    ),
    "needs_gemm_configs": (releases.GEMM_CONFIGS, "the GEMM configs"),
}


# Test modules whose outcome does not depend on the installed SGLang release: they import neither
# SGLang nor what it pins (torch, flashinfer, triton, transformers) and read none of their versions:
# pure planning, committed records, the repository's layout, the benchmarks' parsing, pytest's own
# behaviour, and every release's wheel read as a file. Their tests are marked
# `release_independent`; .ci/run runs them on the newest release only and, on the older releases,
# the rest (`-m "not release_independent"`). test_suite_guard.py holds each module to it: it runs
# them where none of those can be imported.
RELEASE_INDEPENDENT = (
    "test_decisions.py", "test_engine_records.py", "test_layout.py", "test_model_family_records.py",
    "test_planning.py", "test_probe.py", "test_profile_determinism.py", "test_release_wheels.py",
    "test_schedule_records.py", "test_serving_benchmark.py", "test_serving_records.py", "test_split_classes.py", "test_suite_guard.py",
)


def pytest_configure(config):
    for marker, (_, what) in RELEASE_MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: skip on SGLang releases without {what}")
    config.addinivalue_line("markers", "release_independent: the same outcome on every SGLang release (RELEASE_INDEPENDENT)")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in RELEASE_INDEPENDENT:
            item.add_marker("release_independent")


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


@pytest.fixture
def triton_before_the_stock_check(monkeypatch):
    """patch_table's TritonAttnBackend rows for releases before 0.5.22, where stock aligned
    deterministic triton (SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE), put on this release's
    class: what they declare does not depend on the release. Yields the class."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_chunk_align import patch_table

    rows = [p for p in patch_table.PATCH_POINTS if p.target.startswith("TritonAttnBackend.")]
    assert {p.target for p in rows} == {"TritonAttnBackend.prefill_declaration", "TritonAttnBackend.prefill_chunk_align"}
    for row in rows:
        monkeypatch.setattr(TritonAttnBackend, row.class_and_attribute[1], row.value, raising=False)
    yield TritonAttnBackend


def sigint_at_default():
    """preexec_fn for a child that a test interrupts with SIGINT, as Ctrl-C at a terminal would. A shell
    starts a background job (`&` without job control: nohup, a CI runner) with SIGINT ignored, and a
    Python started so never raises KeyboardInterrupt: the test would see a run nothing interrupted."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )


# SGLang's batch-invariant GEMM kernel on CPU tensors, under Triton's interpreter (which must be on before
# SGLang defines the kernel, so in a fresh interpreter): run_interpreted(script) runs this, then `script`,
# which prints one JSON line last.
_INTERPRETED = r"""
import json, sys
import torch
from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels
kernels.get_device_core_count = lambda *args: 4  # 0 on a CPU: stock's grid would launch no program
"""


def run_interpreted(script):
    run = _run_python(_INTERPRETED + script, TRITON_INTERPRET="1")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def fresh_python():
    """Run code in a fresh interpreter with extra environment: fresh_python(code, **env) -> CompletedProcess."""
    return _run_python


# SGLang's launcher resolves server args, deterministic inference's radix-cache decision
# included (handle_deterministic_inference, where the plugin wraps it), for each case (model, extra
# environment, ServerArgs fields): stock first, then with the plugin loaded by SGLang's own
# loader. Per case: ["disable_radix_cache", value] or [error type, message], and what was
# logged about the radix cache.
_LAUNCHER = r"""
import json, logging, os, sys
logged = []
class Keep(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.INFO)

def resolve(model, env, fields):
    from sglang.srt.arg_groups.attention_hook import handle_deterministic_inference
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.server_args import ServerArgs
    saved = dict(os.environ)
    os.environ.update(env)
    del logged[:]
    try:
        server_args = ServerArgs(model_path=model, **fields)
        handle_deterministic_inference(server_args)
        outcome = ["disable_radix_cache", resolving_view(server_args).disable_radix_cache]
    except Exception as error:
        outcome = [type(error).__name__, str(error)]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return outcome + [[m for m in logged if "radix" in m.lower()]]

cases = json.loads(sys.argv[1])
outcomes = {"stock": [resolve(*case) for case in cases]}
from sglang.srt.plugins import load_plugins
load_plugins()
outcomes["plugin"] = [resolve(*case) for case in cases]
print(json.dumps(outcomes))
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION_ONLY_MODEL = os.path.join(ROOT, "benchmarks", "models", "qwen3-8b")
# Tiny configs of models SGLang serves with a mamba prefix cache and with absorbed MLA.
_MODEL_CONFIGS = {
    "mamba": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
        "max_position_embeddings": 4096, "vocab_size": 1024, "torch_dtype": "bfloat16",
    },
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "max_position_embeddings": 4096, "vocab_size": 1024,
        "torch_dtype": "bfloat16",
    },
}


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory):
    """Folders holding only a config.json: an attention-only model (Qwen3-8B's), one with a mamba
    prefix cache, one with absorbed MLA; SGLang reads a model's config, never its weights, here."""
    paths = {"attention": ATTENTION_ONLY_MODEL}
    for name, config in _MODEL_CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.json").write_text(json.dumps(config))
        paths[name] = str(folder)
    return paths


@pytest.fixture(scope="session")
def resolved_by_launcher():
    """resolved_by_launcher(cases) -> {"stock": [...], "plugin": [...]}, from one fresh interpreter (_LAUNCHER)."""

    def resolve(cases):
        result = _run_python(f"import sys; sys.argv[1:] = [{json.dumps(cases)!r}]\n" + _LAUNCHER,
                             SGLANG_PLUGINS="chunk_align")
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    return resolve


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
