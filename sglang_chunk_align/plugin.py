"""SGLang plugin entry point `chunk_align` (group `sglang.srt.plugins`).

SGLang's load_plugins() calls load() in every process that loads plugins
(the launcher, each scheduler rank, the detokenizer, the DP controller),
logs any exception and carries on. load() patches lazily (patches.apply), so
a process that never imports the scheduler pays almost nothing.
So a failure is logged as an ERROR here, and a guard makes the scheduler
refuse deterministic flashinfer instead of running stock alignment silently.
The guard gets the error itself, whose `remedy` (compat.ChunkAlignError)
names what to fix for that cause: a bad switch, an unsupported SGLang, a
missing patch point.
"""

import logging

from .compat import ChunkAlignError
from .patches import apply, install_failure_guard

logger = logging.getLogger("sglang_chunk_align")


def load():
    try:
        apply()
    except ChunkAlignError as error:
        logger.error(
            "sglang-chunk-align FAILED: %s Deterministic flashinfer will refuse to start "
            "while chunk_align is in SGLANG_PLUGINS.",
            error,
        )
        install_failure_guard(error)
        raise
