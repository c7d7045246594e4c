"""SGLang plugin entry point `chunk_align` (group `sglang.srt.plugins`).

SGLang's load_plugins() calls load() in every process that loads plugins
(the launcher, each scheduler rank, the detokenizer, the DP controller),
logs any exception with its traceback ("Failed to execute general plugin")
and carries on. load() hands SGLang's table (patch_table) to patches.apply,
which patches lazily, so a process that never imports the scheduler pays
almost nothing.

So a failure is logged here, once, as one ERROR line with its cause and
remedy (compat.ChunkAlignError: a bad switch, an unsupported SGLang, a
missing patch point), and not raised: SGLang would only log it again, with a
traceback of the same error. What stops deterministic flashinfer from
running stock alignment silently is the failure guard, which makes the
scheduler refuse it with the same cause and remedy.
"""

import logging

from . import patch_table, patches
from .compat import ChunkAlignError

logger = logging.getLogger("sglang_chunk_align")


def load():
    try:
        patches.apply(patch_table)
    except ChunkAlignError as error:
        logger.error("%s", error.failure_report())
        patches.install_failure_guard(patch_table, error)
