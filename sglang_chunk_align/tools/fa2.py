"""flashinfer's fa2 paged prefill and tensor-core decode, planned as SGLang's deterministic
FlashInferAttnBackend plans them: the one plan/forward call the probe and the GPU benchmarks run.

Every kernel fact (kernel_facts.py) was measured through these calls, so
they must match SGLang's exactly (flashinfer_backend.py, 0.5.23): prefill
wrappers are BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD",
backend="fa2"), planned with page size 1 (every last page full), bf16 q and
KV and fixed_split_size from SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE, and
run causal with sm_scale head_dim**-0.5; decode wrappers are
BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) with the fixed split
SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE. What callers choose is a parameter:
the workspace, the split, and where the index tensors live.

Imports torch and flashinfer only when called; imported by the probe and the
benchmarks, never by plugin loading.
"""

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


class TensorCoreDecode:
    """One tensor-core decode wrapper on `workspace`, for one model shape: a step of one request."""

    def __init__(self, workspace, num_qo_heads, num_kv_heads, head_dim):
        import flashinfer

        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim

    def plan(self, kv_indices, fixed_split):
        """Plan one request's decode step over its KV pages `kv_indices` (page size 1)."""
        import torch

        self.wrapper.plan(
            torch.tensor([0, len(kv_indices)], dtype=torch.int32), kv_indices, torch.ones(1, dtype=torch.int32),
            self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, fixed_split_size=fixed_split,
        )

    def forward(self, q, k_cache, v_cache):
        return self.wrapper.forward(q, (k_cache, v_cache), sm_scale=self.head_dim**-0.5)
