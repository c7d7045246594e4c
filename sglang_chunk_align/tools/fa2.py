"""flashinfer's fa2 paged prefill and tensor-core decode, planned as SGLang's deterministic
FlashInferAttnBackend plans them: the one plan/forward call the probe and the GPU benchmarks run.

Every kernel fact (kernel_facts.py) was measured through these calls, so
they must match SGLang's exactly (flashinfer_backend.py, 0.5.23): prefill
wrappers are BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
backend="fa2"), planned with page size 1 (every last page full), bf16 q and
KV and fixed_split_size from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, and
run causal with sm_scale head_dim**-0.5; decode wrappers are
BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) with the fixed split
SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE in eager steps and no split in CUDA
graphs (wrappers made with use_cuda_graph over the index buffers). What callers choose is a parameter:
the workspace, the split, and where the index tensors live.

Imports torch and flashinfer only when called; imported by the probe and the
benchmarks, never by plugin loading.
"""

from ..unsplit_decode import UNSPLIT

PREFILL_SPLIT = 4096  # SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE default
DECODE_SPLIT = 2048  # SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE default
DETERMINISTIC_WORKSPACE_BYTES = 2 << 30  # the workspace SGLang gives deterministic flashinfer


def indptr(lengths, device=None):
    """[0, l0, l0 + l1, ...] as int32: the indptr of consecutive segments of `lengths`."""
    import torch

    return torch.tensor([0, *lengths], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


class PagedPrefill:
    """One fa2 paged-prefill wrapper on `workspace`, for one model shape."""

    def __init__(self, workspace, num_qo_heads, num_kv_heads, head_dim):
        import flashinfer

        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim

    def plan(self, qo_indptr, kv_indptr, kv_indices, fixed_split):
        """Plan one batch: request i's query rows qo_indptr[i:i+2] over its KV pages (page size 1)
        kv_indices[kv_indptr[i]:kv_indptr[i+1]]."""
        import torch

        self.wrapper.plan(
            qo_indptr, kv_indptr, kv_indices,
            torch.ones(len(qo_indptr) - 1, dtype=torch.int32, device=qo_indptr.device),  # every last page is full
            self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, fixed_split_size=fixed_split,
        )

    def forward(self, q, k_cache, v_cache):
        return self.wrapper.forward(q, (k_cache, v_cache), causal=True, sm_scale=self.head_dim**-0.5)


# How SGLang's deterministic backend splits decode KV (flashinfer_backend.py, 0.5.23): eager steps
# (init_forward_metadata) at the fixed decode split, CUDA-graph steps (init_forward_metadata_out_graph)
# not at all, which is the plan unsplit_decode.py gives eager steps too (its UNSPLIT, stated there once).
# Each is the split half of a decode plan's keyword arguments.
EAGER_DECODE_PLAN = dict(fixed_split_size=DECODE_SPLIT, disable_split_kv=False)
GRAPH_DECODE_PLAN = UNSPLIT


class TensorCoreDecode:
    """One tensor-core decode wrapper on `workspace`, for one model shape. `graph_buffers` (use_cuda_graph
    and the index buffers) make it a wrapper for CUDA graphs, as SGLang makes its graph wrappers."""

    def __init__(self, workspace, num_qo_heads, num_kv_heads, head_dim, **graph_buffers):
        import flashinfer

        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True,
                                                                     **graph_buffers)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim

    @classmethod
    def for_graph(cls, workspace, num_qo_heads, num_kv_heads, head_dim, kv_indptr, kv_indices):
        """A wrapper for CUDA graphs whose index buffers are the batch's own (kv_indptr, kv_indices),
        planned over that batch as SGLang plans graph decode: GRAPH_DECODE_PLAN."""
        import torch

        last = torch.ones(len(kv_indptr) - 1, dtype=torch.int32, device=kv_indptr.device)
        decode = cls(workspace, num_qo_heads, num_kv_heads, head_dim, use_cuda_graph=True,
                     paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                     paged_kv_last_page_len_buffer=last)
        decode.plan_batch(kv_indptr, kv_indices, **GRAPH_DECODE_PLAN)
        return decode

    def plan(self, kv_indices, fixed_split):
        """Plan one request's decode step over its KV pages `kv_indices` (page size 1)."""
        self.plan_batch(indptr([len(kv_indices)]), kv_indices, fixed_split_size=fixed_split)

    def plan_batch(self, kv_indptr, kv_indices, **split):
        """Plan a decode step of requests whose KV pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
        (page size 1), with `split`'s fixed_split_size and disable_split_kv (flashinfer's defaults
        where absent)."""
        import torch

        self.wrapper.plan(
            kv_indptr, kv_indices,
            torch.ones(len(kv_indptr) - 1, dtype=torch.int32, device=kv_indptr.device),  # every last page is full
            self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **split,
        )

    def forward(self, q, k_cache, v_cache):
        return self.wrapper.forward(q, (k_cache, v_cache), sm_scale=self.head_dim**-0.5)

    def replayed(self, q, k_cache, v_cache):
        """forward captured in a CUDA graph and replayed: called once outside the graph first, as
        SGLang's capture warms up."""
        import torch

        q = q.clone()  # the graph's own input
        self.forward(q, k_cache, v_cache)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.forward(q, k_cache, v_cache)
        graph.replay()
        return out
