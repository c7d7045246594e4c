"""Batch-invariant GEMMs with a config per M (gemms.py): the dispatch, the tuner's bit check, the cache,
the switch and the startup line, on SGLang's own kernel.

SGLang's Triton kernel runs here under Triton's interpreter (TRITON_INTERPRET=1, which must be set
before SGLang defines the kernel, so in a subprocess of its own) on CPU tensors in fp16: the K loop
is the kernel's, so a config with another BLOCK_K sums in another order and gives other bits, and
the tuner must refuse it. That configs with stock's BLOCK_K give stock's bits on a GPU, and how fast
they are, is tests/gpu/test_gemm_bits.py's and benchmarks/gemm_configs.py's.
"""

import logging
import os

import pytest
from conftest import run_interpreted

from sglang_chunk_align import gemms
from sglang_chunk_align.compat import GEMMS_ENV

pytestmark = pytest.mark.needs_gemm_configs

# Run under the interpreter: tune one fp16 shape (a stand-in clock that prefers 64-column tiles, and
# one candidate with half stock's BLOCK_K slipped in), then serve it through SGLang's matmul_persistent
# with the plugin applied, and after patches.remove().
INTERPRETED = r"""
from sglang_chunk_align import gemms, patch_table, patches

torch.manual_seed(0)
weight, bias = torch.randn(96, 128, dtype=torch.float16), torch.randn(96, dtype=torch.float16)
shape = gemms.Shape("float16", 96, 128, True)
other_block_k = gemms.Config(16, 64, 32, 3, 4)
candidates = gemms.candidates
gemms.candidates = lambda dtype, top: candidates(dtype, top) + [other_block_k]
tuned, differing = gemms.tune(shape, weight, bias, lambda config, a, b, bias: config.block_n + config.stages / 10)
gemms.candidates = candidates

launched = []
launch = gemms.launch
def recording_launch(a, b, out_dtype, bias, config):
    launched.append(list(config))
    return launch(a, b, out_dtype, bias, config)
gemms.launch = recording_launch

def served(rows):
    a = torch.randn(rows, 128, dtype=torch.float16)
    del launched[:]
    out = kernels.matmul_persistent(a, weight.t(), bias=bias)
    reference = launch(a, weight.t(), a.dtype, bias, gemms.STOCK["float16"])  # stock's launch, not recorded
    return {"configs": list(launched), "stock_bits": gemms.same_bits(out, reference)}

patches.apply(patch_table)
gemms.activate(gemms.Table({shape: tuned}))
report = {"tuned": {top: list(c) for top, c in tuned.items()}, "differing": [list(c) for c in differing],
          "rows": {rows: served(rows) for rows in (1, 5, 17, 200, 300)}}
patches.remove()
report["after_remove"] = served(5)
report["active_after_remove"] = gemms._table is not None
json.dump(report, sys.stdout)
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(INTERPRETED)


def test_the_tuner_keeps_stock_block_k_and_refuses_a_config_with_other_bits(interpreted):
    assert interpreted["differing"] == [[16, 64, 32, 3, 4]]
    # The stand-in clock's fastest admitted config per bucket: the fewest columns offered, 3 stages, the fewest rows.
    assert interpreted["tuned"] == {"16": [16, 32, 64, 3, 4], "32": [16, 32, 64, 3, 4], "64": [32, 32, 64, 3, 4],
                                    "128": [32, 64, 64, 3, 4], "256": [32, 64, 64, 3, 4]}


@pytest.mark.parametrize("rows, config", [(1, [16, 32, 64, 3, 4]), (5, [16, 32, 64, 3, 4]),
                                          (17, [16, 32, 64, 3, 4]), (200, [32, 64, 64, 3, 4]), (300, None)])
def test_sglang_matmul_runs_the_bucket_config_with_stock_bits(interpreted, rows, config):
    served = interpreted["rows"][str(rows)]
    assert served["configs"] == ([config] if config else [])  # above 256 rows: stock's own launch
    assert served["stock_bits"]


def test_removing_the_plugin_restores_stock_launches(interpreted):
    assert interpreted["after_remove"] == {"configs": [], "stock_bits": True}
    assert not interpreted["active_after_remove"]


def test_buckets():
    assert [gemms.bucket(m) for m in (1, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257)] == [
        16, 16, 32, 32, 64, 64, 128, 128, 256, 256, None]


def test_each_bucket_is_probed_in_every_variant_triton_compiles():
    """M of 1, M a multiple of 16, and the rest: each bucket's configs run in each it serves in."""
    low = 1
    for top in gemms.BUCKETS:
        probes = gemms.probe_rows(low, top)
        assert probes[0] == low and probes[-1] == top
        variants = {"one" if m == 1 else "sixteens" if m % 16 == 0 else "other" for m in range(low, top + 1)}
        assert {"one" if m == 1 else "sixteens" if m % 16 == 0 else "other" for m in probes} == variants
        low = top + 1


def test_every_candidate_keeps_stock_block_k():
    for dtype, stock in gemms.STOCK.items():
        for top in gemms.BUCKETS:
            assert {c.block_k for c in gemms.candidates(dtype, top)} == {stock.block_k}


def _weight_transpose(n, k, dtype):
    import torch

    return torch.empty(n, k, dtype=dtype).t()


@pytest.fixture
def table():
    return gemms.Table({gemms.Shape("float16", 96, 128, False): {16: gemms.Config(16, 64, 64, 3, 4)}})


def test_the_table_serves_only_what_was_checked(table, caplog):
    import torch

    b = _weight_transpose(96, 128, torch.float16)
    a = torch.empty(8, 128, dtype=torch.float16)
    assert table.config(a, b, torch.float16, None) == gemms.Config(16, 64, 64, 3, 4)
    assert table.config(a, b, torch.float32, None) is None  # another output dtype
    assert table.config(a, b.contiguous(), torch.float16, None) is None  # not a weight's transpose
    assert table.config(a.t().contiguous().t(), b, torch.float16, None) is None  # rows not contiguous
    assert table.config(torch.empty(40, 128, dtype=torch.float16), b, torch.float16, None) is None  # bucket not faster
    assert table.config(torch.empty(300, 128, dtype=torch.float16), b, torch.float16, None) is None  # above 256
    assert table.config(a, b, torch.float16, torch.empty(96, dtype=torch.float16)) is None  # tuned without a bias
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        other = _weight_transpose(64, 128, torch.float16)
        assert table.config(a, other, torch.float16, None) is None
        assert table.config(a, other, torch.float16, None) is None
    assert [r.getMessage() for r in caplog.records].count(
        "sglang-chunk-align: GEMM float16 64x128 was not tuned at startup: stock's config") == 1


def test_the_cache_round_trips_and_drops_a_config_that_would_change_the_bits(tmp_path, caplog):
    path = str(tmp_path / "gemms" / "gpu.json")
    shape = gemms.Shape("bfloat16", 4608, 3584, True)
    kept, other_block_k = gemms.Config(16, 64, 64, 3, 4), gemms.Config(16, 64, 128, 3, 4)
    gemms.write_cache(path, {shape: {16: kept, 32: other_block_k}})
    assert gemms.read_cache(path) == {shape: {16: kept}}
    with open(path, "w") as broken:
        broken.write("{")
    with caplog.at_level(logging.WARNING, logger="sglang_chunk_align"):
        assert gemms.read_cache(path) == {}
    assert "ignoring the GEMM cache" in caplog.text
    assert gemms.read_cache(str(tmp_path / "absent.json")) == {}


def test_an_unwritable_cache_is_reported_and_the_configs_still_serve(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="sglang_chunk_align"):
        gemms.write_cache(str(blocker / "gemms.json"), {})
    assert "could not write the GEMM cache" in caplog.text


def test_model_shapes_are_the_unquantized_linear_layers_one_per_shape():
    import torch

    from sglang.srt.layers.linear import ReplicatedLinear

    model = torch.nn.Sequential(
        ReplicatedLinear(128, 96, bias=True, params_dtype=torch.float16),
        ReplicatedLinear(128, 96, bias=True, params_dtype=torch.float16),  # the same shape: tuned once
        ReplicatedLinear(96, 128, bias=False, params_dtype=torch.float16),
        torch.nn.Linear(128, 128),  # not SGLang's: a layer SGLang's GEMMs never see
    )
    shapes = gemms.model_shapes(model)
    assert list(shapes) == [gemms.Shape("float16", 96, 128, True), gemms.Shape("float16", 128, 96, False)]
    assert shapes[gemms.Shape("float16", 96, 128, True)][0] is model[0].weight


def test_the_switch_off_keeps_stock_config_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(GEMMS_ENV, "0")
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        assert gemms.startup_table(model=None, previous=None) is None
    assert f"batch-invariant GEMMs keep stock's one config ({GEMMS_ENV}=0)" in caplog.text


def test_the_startup_line_counts_tuned_and_cached_shapes_and_names_other_bits(monkeypatch, tmp_path, caplog):
    import torch

    from sglang.srt.layers.linear import ReplicatedLinear

    monkeypatch.setenv(GEMMS_ENV, "1")
    model = torch.nn.Sequential(ReplicatedLinear(128, 96, bias=False, params_dtype=torch.float16),
                                ReplicatedLinear(96, 64, bias=False, params_dtype=torch.float16))
    cached_shape, fresh_shape = gemms.Shape("float16", 96, 128, False), gemms.Shape("float16", 64, 96, False)
    fast, other_bits = gemms.Config(16, 64, 64, 3, 4), gemms.Config(16, 128, 64, 3, 4)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = gemms.cache_path(model[0].weight.device)
    assert path.startswith(str(tmp_path / "sglang-chunk-align" / "gemms"))
    gemms.write_cache(path, {cached_shape: {16: fast}})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        table = gemms.startup_table(model, None, tune_shape=lambda shape, weight, bias: ({}, [other_bits]))
    assert table.configs == {cached_shape: {16: fast}, fresh_shape: {}}
    assert gemms.read_cache(path) == table.configs  # the fresh shape is cached too
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(
        "sglang-chunk-align: batch-invariant GEMMs run stock's kernel with a tile config per M for 1 of 2 "
        "Triton GEMM shapes (float16 96x128), each checked for stock's bits on this GPU (1 tuned in ")
    assert f"1 read from {path}); M above 256, the other shapes keep stock's config" in lines[0]
    assert lines[1] == f"sglang-chunk-align: GEMM float16 64x96: {other_bits} gave bits other than stock's, not used"
    # A second runner in the process (a draft model's) keeps what the first tuned and tunes nothing again.
    os.remove(path)
    again = gemms.startup_table(model, table, tune_shape=lambda *shape: pytest.fail("tuned again"))
    assert again.configs == table.configs


def test_a_model_without_triton_gemms_tunes_nothing_and_says_so(monkeypatch, caplog):
    """With the switch unset: on by default."""
    import torch

    monkeypatch.delenv(GEMMS_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="sglang_chunk_align"):
        table = gemms.startup_table(torch.nn.Sequential(torch.nn.Linear(8, 8)), None,
                                    tune_shape=lambda *shape: pytest.fail("nothing to tune"))
    assert table.configs == {}
    assert "no GEMM of this model reaches SGLang's Triton kernel: nothing to tune" in caplog.text


def test_a_shape_that_cannot_be_tuned_keeps_stock_config_and_says_why(monkeypatch, tmp_path, caplog):
    import torch

    from sglang.srt.layers.linear import ReplicatedLinear

    monkeypatch.setenv(GEMMS_ENV, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def out_of_memory(shape, weight, bias):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = torch.nn.Sequential(ReplicatedLinear(128, 96, bias=False, params_dtype=torch.float16))
    with caplog.at_level(logging.WARNING, logger="sglang_chunk_align"):
        table = gemms.startup_table(model, None, tune_shape=out_of_memory)
    assert table.configs == {}
    assert ("GEMM float16 96x128 keeps stock's config: tuning failed (OutOfMemoryError: CUDA out of memory)"
            in caplog.text)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_startup_tunes_nothing_without_batch_invariant_mode_or_a_cuda_gpu(batch_invariant, monkeypatch):
    """The SGLang hook (ModelRunner.configure_kv_cache_dtype) on this CPU machine: stock's step runs,
    and no table is made, whether SGLang's batch-invariant mode is on or not (on NPUs those GEMMs are
    not the Triton kernel). Its tuning on a GPU is tests/gpu/test_gemm_bits.py's."""
    from types import SimpleNamespace

    from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    monkeypatch.setenv(GEMMS_ENV, "1")
    # SGLang's own flag: its enable_batch_invariant_mode() refuses a machine without an accelerator.
    monkeypatch.setattr(kernels, "_batch_invariant_MODE", batch_invariant)
    assert is_batch_invariant_mode_enabled() is batch_invariant
    runner = SimpleNamespace(model=None)  # a model would be read only if tuning ran
    assert gemms.tune_at_startup(lambda: "stock's step", runner, (), {}) == "stock's step"
    assert gemms._table is None
