"""sglang-chunk-align: bit-exact deterministic flashinfer prefill with small chunks.

`apply()` / `remove()` patch and restore an installed SGLang in this process;
SGLang's plugin loader calls `plugin.load()` when SGLANG_PLUGINS names
`chunk_align`. Importing this package imports nothing of SGLang.
"""

from .alignment import PREFILL_Q_TILE_TOKENS


def apply():
    from . import patch_table, patches

    patches.apply(patch_table)


def remove():
    from .patches import remove

    remove()


__all__ = ["PREFILL_Q_TILE_TOKENS", "apply", "remove"]
