"""Turning the radix cache back on under deterministic flashinfer (opt-in)."""

import pytest

from sglang_chunk_align.standins import scheduler_alignment

pytestmark = pytest.mark.needs_radix_opt_in

# SGLang's own deterministic-inference hook decides whether the radix cache stays on.
RESOLVE = r'''
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.attention_hook import handle_deterministic_inference
from sglang.srt.arg_groups.model_override_base import resolving_view
server_args = ServerArgs(model_path="dummy", enable_deterministic_inference=True, attention_backend="flashinfer")
handle_deterministic_inference(server_args)
print("disable_radix_cache", resolving_view(server_args).disable_radix_cache)
'''


@pytest.mark.parametrize("opt_in, disabled", [("0", True), ("1", False)])
def test_radix_cache_stays_on_only_when_opted_in(fresh_python, opt_in, disabled):
    result = fresh_python(RESOLVE, SGLANG_PLUGINS="chunk_align", SGLANG_CHUNK_ALIGN_RADIX_CACHE=opt_in)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith(f"disable_radix_cache {disabled}")


def test_radix_cache_needs_the_grid_rules(plugin, monkeypatch):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    tree_cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1,
        tree_components=(ComponentType.FULL,),
    ))
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RADIX_CACHE", "1")
    assert scheduler_alignment(chunk=256, state={"tree_cache": tree_cache}) == 128
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "0")
    with pytest.raises(ValueError, match="SGLANG_CHUNK_ALIGN_RADIX_CACHE=1 needs the grid rules"):
        scheduler_alignment(chunk=256, state={"tree_cache": tree_cache})
