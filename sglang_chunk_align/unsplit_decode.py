"""Deterministic flashinfer decode planned one way at every batch size: eager as in CUDA graphs.

Stock SGLang plans deterministic flashinfer decode two ways. A decode batch
that fits a CUDA graph is planned with split-KV disabled (one pass over each
request's whole KV). A larger batch (over --cuda-graph-max-bs-decode), or any
batch under --disable-cuda-graph, runs eagerly and is planned with a fixed
split of SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE (2048): past 2048 tokens of
KV a request's attention is computed in parts and merged, which rounds
differently. So a request's next token depends on how many requests decode
beside it: in a real server (Qwen2.5-7B's shape, well-scaled random weights)
none of 16 requests of 3,000-3,555 tokens decoded as it did alone once the
decode batch outgrew a graph of 4 (issue 46).

Here eager decode is planned as the graphs plan it, so every batch size gives
a request the same bits. The graphs keep their plan, which is the one every
small batch (and a request alone) already gets. What it costs is the split's
parallelism in eager batches of few requests with long KV: measured in
benchmarks/probe_unsplit_decode.py. SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE=0 keeps
stock's eager split.
"""

# What stock's CUDA-graph decode passes under deterministic inference (init_forward_metadata_out_graph).
UNSPLIT = {"fixed_split_size": None, "disable_split_kv": True}

_active = False  # whether this process's scheduler armed the plugin with the switch on


def activate(active):
    global _active
    _active = bool(active)


def plan_as_graph(wrapped, instance, args, kwargs):
    """Wraps FlashInferIndicesUpdaterDecode.call_begin_forward, through which every decode plan
    goes (eager and graph, every wrapper kind). Its backend's disable_cuda_graph_kv_split is
    stock's own mark of deterministic inference; elsewhere the plan is stock's."""
    if _active and instance.attn_backend.disable_cuda_graph_kv_split:
        kwargs = {**kwargs, **UNSPLIT}
    return wrapped(*args, **kwargs)
