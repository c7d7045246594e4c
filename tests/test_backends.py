"""What every attention-backend kind declares, on real SGLang classes."""

from types import SimpleNamespace

import pytest

from sglang_chunk_align import releases
from sglang_chunk_align.compat import installed_version, sglang_at_least
from sglang_chunk_align.harness.standins import backend, flashinfer_backend, mamba2_backend, published


@pytest.fixture
def deterministic(plugin):
    with published(deterministic=True) as server_args:
        yield server_args


def _class(module, name):
    """The class from the installed SGLang; a test of a class this release lacks skips."""
    import importlib

    try:
        return getattr(importlib.import_module("sglang.srt.layers.attention." + module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"SGLang {installed_version()} has no {module}.{name}")


def test_base_backend_declares_none(deterministic):
    AttentionBackend = _class("base_attn_backend", "AttentionBackend")
    TritonAttnBackend = _class("triton_backend", "TritonAttnBackend")
    assert AttentionBackend.prefill_chunk_align is None
    assert TritonAttnBackend.__new__(TritonAttnBackend).prefill_chunk_align is None


def test_deterministic_flashinfer_declares_the_q_tile(deterministic):
    from sglang_chunk_align.alignment import PREFILL_Q_TILE_TOKENS

    assert PREFILL_Q_TILE_TOKENS == 128
    assert flashinfer_backend().prefill_chunk_align == 128


def test_flashinfer_declares_none_without_deterministic_inference(plugin):
    with published(deterministic=False):
        assert flashinfer_backend().prefill_chunk_align is None


def test_flashinfer_declares_none_without_a_fixed_split_or_fa2(deterministic):
    unsplit = flashinfer_backend()
    unsplit.prefill_split_tile_size = None
    other_kernel = flashinfer_backend()
    other_kernel.prefill_backend = "fa3"
    assert unsplit.prefill_chunk_align is None and other_kernel.prefill_chunk_align is None


@pytest.mark.parametrize(
    "module, name",
    [("trtllm_mha_backend", "TRTLLMHAAttnBackend"), ("llada2_cfg_flashinfer_backend", "LLaDA2CFGFlashInferAttnBackend")],
)
def test_flashinfer_subclasses_running_other_kernels_declare_none(deterministic, module, name):
    cls = _class(module, name)
    assert issubclass(cls, _class("flashinfer_backend", "FlashInferAttnBackend"))
    assert flashinfer_backend(cls).prefill_chunk_align is None


@pytest.mark.parametrize(
    "module, name",
    [("flashinfer_mla_backend", "FlashInferMLAAttnBackend"), ("trtllm_mla_backend", "TRTLLMMLABackend")],
)
def test_flashinfer_mla_backends_declare_none(deterministic, module, name):
    cls = _class(module, name)
    instance = cls.__new__(cls)
    instance.enable_deterministic = True  # even with deterministic state it has no fixed-split fa2 prefill
    assert instance.prefill_chunk_align is None


def _hybrid(prefill, decode):
    """A HybridAttnBackend over the two, with a stand-in for the GPU model runner."""
    HybridAttnBackend = _class("hybrid_attn_backend", "HybridAttnBackend")
    runner = SimpleNamespace(
        kv_cache_dtype=None, token_to_kv_pool=None, req_to_token_pool=None, kv_index_translator=None,
        model_config=SimpleNamespace(context_len=4096),
    )
    return HybridAttnBackend(runner, prefill, decode)


def test_hybrid_forwards_its_prefill_backend(deterministic):
    TritonAttnBackend = _class("triton_backend", "TritonAttnBackend")
    triton = TritonAttnBackend.__new__(TritonAttnBackend)
    assert _hybrid(flashinfer_backend(), triton).prefill_chunk_align == 128
    assert _hybrid(triton, flashinfer_backend()).prefill_chunk_align is None


def test_only_a_declaration_for_the_fa2_grid_arms_the_plugin(deterministic, triton_before_the_stock_check):
    """The declaration's fa2 backends, which the scheduler's Startup.armed asks: a deterministic
    flashinfer backend, or a wrapper forwarding its prefill to one; not the stock alignment
    deterministic triton declares before 0.5.22 (put on here), nor a wrapper forwarding to it."""
    triton = backend(triton_before_the_stock_check, enable_deterministic=True)
    fa2 = flashinfer_backend()
    assert triton.prefill_chunk_align == 4096 and triton.prefill_declaration.fa2 == ()
    assert fa2.prefill_declaration.fa2 == (fa2,) and _hybrid(fa2, triton).prefill_declaration.fa2 == (fa2,)
    assert _hybrid(triton, flashinfer_backend()).prefill_chunk_align == 4096
    assert _hybrid(triton, flashinfer_backend()).prefill_declaration.fa2 == ()
    assert flashinfer_backend(skip_prefill=True).prefill_declaration.fa2 == ()


@pytest.mark.parametrize("name", ["HybridLinearAttnBackend", "ShortConvHybridAttnBackend"])
def test_hybrid_linear_forwards_its_full_attention_backend(deterministic, name):
    cls = _class("hybrid_linear_attn_backend", name)
    assert cls(flashinfer_backend(), mamba2_backend(), [0]).prefill_chunk_align == 128
    with published(deterministic=False):
        assert cls(flashinfer_backend(), mamba2_backend(), [0]).prefill_chunk_align is None


def test_mamba2_chunks_join_the_fa2_grid_where_the_plugin_is_armed(deterministic):
    """Mamba2's chunked scan counts its chunks from a prefill batch's first token: beside
    deterministic fa2 the hybrid declares them (chunk starts on their multiples; the grid rules
    keep one request per prefill batch), and nowhere else does it change what stock aligns to."""
    cls = _class("hybrid_linear_attn_backend", "HybridLinearAttnBackend")
    hybrid = cls(flashinfer_backend(), mamba2_backend(256), [0])
    assert hybrid.prefill_chunk_align == 256 and hybrid.prefill_declaration.packed_chunk == 256
    assert hybrid.prefill_declaration.geometry == flashinfer_backend().prefill_declaration.geometry
    assert cls(flashinfer_backend(), mamba2_backend(64), [0]).prefill_chunk_align == 128
    with published(deterministic=False):
        assert cls(flashinfer_backend(), mamba2_backend(256), [0]).prefill_chunk_align is None
    TritonAttnBackend = _class("triton_backend", "TritonAttnBackend")
    triton = backend(TritonAttnBackend, enable_deterministic=True)
    assert cls(triton, mamba2_backend(256), [0]).prefill_chunk_align == triton.prefill_chunk_align


def test_tbo_forwards_its_primary(deterministic):
    TboAttnBackend = _class("tbo_backend", "TboAttnBackend")
    assert TboAttnBackend(flashinfer_backend(), [flashinfer_backend()]).prefill_chunk_align == 128
    skipping = flashinfer_backend(skip_prefill=True)
    assert TboAttnBackend(skipping, [flashinfer_backend()]).prefill_chunk_align is None


def test_minimax_hybrid_combines_dense_and_sparse(deterministic):
    cls = _class("minimax_sparse_backend", "MiniMaxHybridAttnBackend")
    sparse_cls = _class("minimax_sparse_backend", "MiniMaxSparseAttnBackend")
    assert cls(flashinfer_backend(), sparse_cls.__new__(sparse_cls), [1]).prefill_chunk_align == 128


def test_dots_wrappers_forward_their_children(deterministic):
    swa_cls = _class("dots_hybrid_backend", "DotsSWAMLAAttnBackend")
    hybrid_cls = _class("dots_hybrid_backend", "DotsHybridAttnBackend")
    mla_cls = _class("flashinfer_mla_backend", "FlashInferMLAAttnBackend")
    swa = swa_cls(flashinfer_backend())
    assert swa.prefill_chunk_align == 128
    assert hybrid_cls(backend(mla_cls), swa).prefill_chunk_align == 128
    assert hybrid_cls(backend(mla_cls), swa_cls(backend(mla_cls))).prefill_chunk_align is None


def test_kimi_linear_under_flashinfer_keeps_only_the_mamba_grid(deterministic):
    """Kimi-Linear is MLA + KDA: flashinfer selects the MLA backend, which has no deterministic fa2."""
    cls = _class("hybrid_linear_attn_backend", "HybridLinearAttnBackend")
    mla_cls = _class("flashinfer_mla_backend", "FlashInferMLAAttnBackend")
    kda_cls = _class("linear.kda_backend", "KDAAttnBackend")
    assert cls(backend(mla_cls), kda_cls.__new__(kda_cls), [3]).prefill_chunk_align is None


def test_deterministic_triton_keeps_its_stock_alignment_where_stock_had_one(deterministic, monkeypatch):
    """Before 0.5.22 stock aligned deterministic triton to SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE."""
    TritonAttnBackend = _class("triton_backend", "TritonAttnBackend")
    triton = TritonAttnBackend.__new__(TritonAttnBackend)
    triton.enable_deterministic = True
    if sglang_at_least(releases.STOCK_STARTUP_CHECK):
        assert triton.prefill_chunk_align is None
    else:
        assert triton.prefill_chunk_align == 4096
        monkeypatch.setenv("SGLANG_TRITON_PREFILL_TRUNCATION_ALIGN_SIZE", "2048")
        assert triton.prefill_chunk_align == 2048
        triton.enable_deterministic = False
        assert triton.prefill_chunk_align is None


def test_deterministic_flashinfer_declares_the_geometry_it_plans_prefill_with(deterministic):
    from sglang_chunk_align.backends import QTileGeometry

    assert _geometry(flashinfer_backend(planned=(32, 8, 128))) == QTileGeometry(4, 128)
    assert _geometry(flashinfer_backend(planned=(8, 8, 256))) == QTileGeometry(1, 256)
    assert _geometry(flashinfer_backend()) is None  # no planned heads: unknown
    assert _geometry(flashinfer_backend(planned=(12, 8, 128))) is None  # not a whole group
    assert _geometry(flashinfer_backend(planned=(32, 8, 128), skip_prefill=True)) is None
    with published(deterministic=False):
        assert _geometry(flashinfer_backend(planned=(32, 8, 128))) is None


def _geometry(backend):
    return backend.prefill_declaration.geometry


def test_wrappers_forward_the_geometry_of_their_aligned_children(deterministic):
    from sglang_chunk_align.backends import QTileGeometry

    TboAttnBackend = _class("tbo_backend", "TboAttnBackend")
    cls = _class("minimax_sparse_backend", "MiniMaxHybridAttnBackend")
    sparse_cls = _class("minimax_sparse_backend", "MiniMaxSparseAttnBackend")
    group_4 = QTileGeometry(4, 128)
    assert _geometry(TboAttnBackend(flashinfer_backend(planned=(32, 8, 128)), [])) == group_4
    assert _geometry(cls(flashinfer_backend(planned=(32, 8, 128)), sparse_cls.__new__(sparse_cls), [1])) == group_4
    dense_and_dense = cls(flashinfer_backend(planned=(32, 8, 128)), flashinfer_backend(planned=(32, 4, 128)), [1])
    assert _geometry(dense_and_dense) is None  # children disagree: conservative
    trtllm = flashinfer_backend(_class("trtllm_mha_backend", "TRTLLMHAAttnBackend"), planned=(32, 8, 128))
    assert _geometry(trtllm) is None  # declares no alignment: its prefill is not fa2
