"""Eager decode planned as the CUDA graphs plan it (unsplit_decode.py), through SGLang's own code.

SGLang's FlashInferAttnBackend plans every decode batch through
FlashInferIndicesUpdaterDecode.call_begin_forward: eagerly from
init_forward_metadata, in CUDA graphs from init_forward_metadata_out_graph.
Here both run for real on a backend built without __init__ (its buffers and
flashinfer wrappers need a GPU): the flashinfer wrapper stands in and records
the plan it is given. Stock plans the two differently under deterministic
inference; with the plugin armed they must be one plan, and where it is not
armed (the switch at 0, non-deterministic flashinfer, no scheduler startup)
each stays stock's. The kernels' side (that the one plan gives the same bits
at every batch size, and the stock pair does not) is benchmarks/probe_unsplit_decode.py's, on a GPU.
"""

from types import SimpleNamespace

import pytest

from sglang_chunk_align import releases, unsplit_decode
from sglang_chunk_align.compat import RULES_ENV, UNSPLIT_DECODE_ENV, installed_version, sglang_at_least
from sglang_chunk_align.harness.standins import bare, flashinfer_backend, scheduler_alignment

STOCK_EAGER = {"fixed_split_size": 2048, "disable_split_kv": False}
KV_LENS = (3000, 5)  # a request past the 2048 split beside a short one


class RecordingWrapper:
    """flashinfer's BatchDecodeWithPagedKVCacheWrapper as SGLang's updater uses it: its index buffer,
    and begin_forward (plan), which records what the plan asked for."""

    is_cuda_graph_enabled = True  # the updater then writes the KV indices into this buffer, no CUDA tensor made

    def __init__(self):
        import torch

        self._paged_kv_indices_buf = torch.zeros(sum(KV_LENS), dtype=torch.int32)
        self.plans = []

    def begin_forward(self, *args, **kwargs):
        self.plans.append({key: kwargs[key] for key in STOCK_EAGER})


def decode_backend(deterministic=True):
    """A FlashInferAttnBackend as its __init__ leaves it for decode, with one eager and one graph wrapper."""
    import torch
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferIndicesUpdaterDecode

    eager, graph = RecordingWrapper(), RecordingWrapper()
    translator = SimpleNamespace(reads_are_translated=False, pack_read_stream=lambda plan, **kw: None)
    backend = flashinfer_backend(
        deterministic=deterministic, use_sliding_window_kv_pool=False,
        decode_split_tile_size=2048 if deterministic else None, disable_cuda_graph_kv_split=deterministic,
        decode_wrappers=[eager], decode_cuda_graph_metadata={len(KV_LENS): [graph]},
    )
    updater = bare(
        FlashInferIndicesUpdaterDecode, attn_backend=backend, num_qo_heads=28, num_kv_heads=4, head_dim=128,
        data_type=torch.bfloat16, q_data_type=torch.bfloat16, kv_indptr=[torch.zeros(8, dtype=torch.int32)],
        kv_last_page_len=torch.ones(8, dtype=torch.int32), _swa_kv_pool=None,
    )
    updater.update = updater.update_single_wrapper  # what __init__ dispatches to for full attention
    backend.kv_index_translator = translator
    backend.indices_updater_decode = updater
    return backend, eager, graph


def decode_plans(deterministic=True):
    """(the eager plan, the graph plan) SGLang's backend makes for one decode batch of KV_LENS."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    backend, eager, graph = decode_backend(deterministic)
    seq_lens = torch.tensor(KV_LENS, dtype=torch.int32)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=len(KV_LENS), seq_lens=seq_lens, seq_lens_cpu=seq_lens,
        seq_lens_sum=sum(KV_LENS), encoder_lens=None, spec_info=None, out_cache_loc=None, kv_loc_plan=None,
        req_pool_indices=torch.arange(len(KV_LENS)), positions=torch.zeros(len(KV_LENS)),
    )
    backend.init_forward_metadata(batch)
    backend.init_forward_metadata_out_graph(batch)
    (eager_plan,), (graph_plan,) = eager.plans, graph.plans
    return eager_plan, graph_plan


needs_this_updater = pytest.mark.skipif(
    not sglang_at_least(releases.NEWEST),
    reason=f"the stand-ins fit SGLang {releases.NEWEST}'s decode updater, not {installed_version()}'s "
           "(every release's call_begin_forward is checked for the keywords the wrapper sets in tests/test_release_wheels.py)",
)


def start(monkeypatch, switch=None):
    """A stand-in scheduler's startup under deterministic flashinfer; the switch set as given."""
    if switch is None:
        monkeypatch.delenv(UNSPLIT_DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(UNSPLIT_DECODE_ENV, switch)
    planned = lambda: flashinfer_backend(planned=(28, 4, 128))  # noqa: E731 (Qwen2.5-7B's heads)
    scheduler_alignment(planned, chunk=256)


@needs_this_updater
def test_stock_plans_eager_decode_otherwise_than_its_graphs():
    """The hole itself: stock's eager plan splits the KV at 2048, its graph plan does not split."""
    eager, graph = decode_plans()
    assert eager == STOCK_EAGER
    assert graph == unsplit_decode.UNSPLIT


@needs_this_updater
def test_armed_plugin_plans_eager_decode_as_its_graphs(plugin, monkeypatch):
    start(monkeypatch)
    eager, graph = decode_plans()
    assert eager == graph == unsplit_decode.UNSPLIT


@needs_this_updater
def test_switch_off_keeps_stocks_eager_split(plugin, monkeypatch):
    start(monkeypatch, "0")
    assert decode_plans() == (STOCK_EAGER, unsplit_decode.UNSPLIT)


@needs_this_updater
def test_non_deterministic_flashinfer_and_an_unarmed_process_plan_as_stock(plugin, monkeypatch):
    stock = decode_plans(deterministic=False)
    start(monkeypatch)
    assert decode_plans(deterministic=False) == stock  # flashinfer chooses its own split there, as stock
    unsplit_decode.activate(False)  # a process whose scheduler did not arm the plugin
    assert decode_plans() == (STOCK_EAGER, unsplit_decode.UNSPLIT)


@pytest.mark.parametrize("switch, active, words", [
    (None, True, "eager decode planned as in CUDA graphs (no KV split: the same bits at every decode batch size)"),
    ("1", True, "eager decode planned as in CUDA graphs"),
    ("0", False, f"eager decode splits the KV at 2048 as stock does ({UNSPLIT_DECODE_ENV}=0)"),
])
def test_the_startup_line_says_how_eager_decode_is_planned(plugin, monkeypatch, caplog, switch, active, words):
    with caplog.at_level("INFO", logger="sglang_chunk_align"):
        start(monkeypatch, switch)
    (line,) = [r.getMessage() for r in caplog.records if "prefill chunks aligned to" in r.getMessage()]
    assert words in line
    assert unsplit_decode._active is active


def test_an_unarmed_scheduler_leaves_decode_as_stock(plugin, monkeypatch):
    monkeypatch.delenv(UNSPLIT_DECODE_ENV, raising=False)
    scheduler_alignment(lambda: flashinfer_backend(deterministic=False), deterministic=False, chunk=256)
    assert unsplit_decode._active is False


def test_remove_forgets_the_unsplit_plan(monkeypatch):
    import sglang_chunk_align

    sglang_chunk_align.apply()
    start(monkeypatch)
    assert unsplit_decode._active is True
    sglang_chunk_align.remove()
    assert unsplit_decode._active is False


def test_the_grid_rules_off_keep_the_unsplit_plan(plugin, monkeypatch):
    """The hole is decode's, whatever prefill does; and SGLANG_CHUNK_ALIGN_RULES=0, the exactness
    records' control, must differ from the plugin in the grid rules alone."""
    monkeypatch.setenv(RULES_ENV, "0")
    start(monkeypatch)
    assert unsplit_decode._active is True
