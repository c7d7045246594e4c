"""fa2's kernel facts per flashinfer release: what the grid rules rest on, with where each was measured.

The rules (planning.py), the alignment the deterministic FlashInferAttnBackend
declares (backends.py), the startup refusal, the radix tree's cut
(planning.published_len) and `sglang-chunk-align probe` all read one entry of
FACTS, so a flashinfer release that changes how fa2 tiles a prefill changes
the rules in one place. Each fact was measured with fa2 paged prefill planned
as SGLang's deterministic backend plans it (bf16, page size 1,
fixed_split_size, causal); the recorded runs are in tests/gpu/evidence and
benchmarks/logs. A flashinfer release with no entry gets STRICTEST (the
strictest facts measured) and one WARNING that names it and says how to
measure it.

Plain data and small functions, importing only the standard library (the one
reader of installed versions, compat.installed_release, on first use): the
plugin loads in every SGLang process, and installed_facts() runs once per
process, where a scheduler that runs fa2 or the CLI first asks. The scheduler
reads the facts in force (facts_in_force) where SGLang calls in and passes
them on; the harness chooses another release's for a block (chosen), never by
patching.
"""

import contextlib
import contextvars
import functools
import logging
from typing import NamedTuple

logger = logging.getLogger("sglang_chunk_align")

# The command that measures the installed flashinfer; the WARNING for an unmeasured release names it.
PROBE_COMMAND = "sglang-chunk-align probe"
# The command that installs a measured release into SGLang's environment: SGLang 0.5.23 pins
# flashinfer-python[cu13] 0.7.2 (pip warns of the pin) but starts on 0.7.2 or newer, and served on
# 0.7.4 (benchmarks/logs/ahead_of_triton).
INSTALL_COMMAND = "pip install 'flashinfer-python[cu13]=={}'"


class KernelFacts(NamedTuple):
    """How fa2 prefill behaves on one flashinfer release, in packed rows (tokens x GQA group).

    A NamedTuple, not a dataclass: this module loads in every SGLang process (patches.py says why).
    """

    flashinfer: str
    # Chunk starts must lie on multiples of this many packed rows (fa2's 128-row q-tile; where
    # fa2's own tile is smaller, as at head_dim 256, a start on that tile is exact too); None:
    # a start anywhere is exact.
    grid_rows: object
    # The rows of a prompt's partial final q-tile equal the same rows of a longer prompt's solo
    # prefill, where that tile is full. False: they can differ (data-dependent), so the radix
    # tree must not take them.
    partial_tile_rows_equal: bool
    # A decode step gives a position the row its prompt's solo prefill gives it. False: the
    # radix tree must not take generated tokens' KV.
    decoded_rows_equal: bool
    measured: bool = True  # False: a stand-in (STRICTEST) for a release nobody measured
    # FA2DetermineCtaTileQ (include/flashinfer/utils.cuh, the same in 0.7.2 and 0.7.4), per
    # head_dim class: (head_dim at least, ((more packed rows than, tile), ...), smallest tile).
    # A batch's tile is the first whose threshold its integer average packed q length exceeds.
    # 512 (VO-split: 32 rows above 32, else 16) is read from the source; the probe on 0.7.2 found
    # final pieces exact where these thresholds predict a tile change, so they are kept as the
    # stricter reading. Without the 256 row, head_dim 256 would be held to the stricter uncapped class.
    tile_classes: tuple = ((0, ((64, 128), (16, 64)), 16), (256, ((16, 64),), 16), (512, ((32, 32),), 16))
    # A batch member whose causal KV is at most this many tokens gets the same rows on any tile,
    # at a head_dim below SHORT_KV_BELOW_HEAD_DIM (not at 256).
    short_kv_tokens: int = 32
    short_kv_below_head_dim: int = 256
    # (fact, shapes measured, recorded run in this repository), for doctor, probe and docs/kernel-facts.md.
    evidence: tuple = ()
    # ((head_dim, (GQA groups, ...)), ...): the model shapes the evidence covers on this release.
    # Elsewhere the rules are the same arithmetic, but nothing checked that fa2 follows it there.
    measured_shapes: tuple = ()

    def cta_tile(self, packed_rows, head_dim=None):
        """The CTA q-tile fa2 picks for a batch whose average packed q length is `packed_rows`.

        head_dim None (unknown): the tuple of every head_dim class's tile, so
        two batches compare equal only where they get the same tile at every
        head_dim (512's thresholds are not a coarsening of 128's).
        """
        if head_dim is None:
            return tuple(self._tile(packed_rows, cls) for cls in self.tile_classes)
        return self._tile(packed_rows, self._tile_class(head_dim))

    def _tile_class(self, head_dim):
        """The tile class a known `head_dim` plans with: the last whose least head_dim it reaches."""
        return max(cls for cls in self.tile_classes if cls[0] <= head_dim)

    @staticmethod
    def _tile(packed_rows, tile_class):
        _, thresholds, smallest = tile_class
        return next((tile for above, tile in thresholds if packed_rows > above), smallest)

    def full_tile_above_rows(self, head_dim=None):
        """An extend of more than this many packed rows gets the largest tile at `head_dim`
        (at every head_dim where unknown)."""
        largest = self.cta_tile(1 << 30, head_dim)
        thresholds = {above for _, rows, _ in self.tile_classes for above, _ in rows} | {0}
        return min(above for above in thresholds if self.cta_tile(above + 1, head_dim) == largest)

    def rows_above(self, tile, head_dim):
        """The packed rows a call's integer average must exceed to get `tile` at a known `head_dim`;
        None for the smallest tile (below every threshold)."""
        _, thresholds, _ = self._tile_class(head_dim)
        return next((above for above, got in thresholds if got == tile), None)

    @property
    def chunk_align(self):
        """Tokens; what the deterministic FlashInferAttnBackend declares as prefill_chunk_align: the
        grid at GQA group 1 (128 rows are 128 tokens, on the grid at every group), or 1 where starts
        do not matter."""
        return self.grid_rows or 1

    def exempt_kv(self, head_dim):
        """Members whose KV is at most this many tokens may run on any tile (0: none)."""
        known_small = head_dim is not None and head_dim < self.short_kv_below_head_dim
        return self.short_kv_tokens if known_small else 0

    def describe(self):
        """One line: the release, the facts in force and the grid, for doctor, plan and the log line.
        Of an unmeasured release it names the facts taken instead; facts_for's WARNING says, once,
        that the release was not measured."""
        grid = f"chunk starts on {self.grid_rows}-row q-tiles" if self.grid_rows else "chunk starts anywhere"
        if not self.measured:
            return f"flashinfer {self.flashinfer}: the strictest measured kernel facts ({_measured_releases()}): {grid}"
        return f"flashinfer {self.flashinfer} kernel facts, measured: {grid}"

    def grid_remedy(self):
        """Where this release starts chunks on fa2's q-tile grid and a measured one starts them anywhere:
        that release and the one command that installs it, in words; else None. The scheduler's startup
        line, `plan` and doctor say it beside what the grid costs (radix hits and chunk cuts rounded down to
        it, 128 tokens at odd GQA groups; what that cost measured: docs/kernel-facts.md)."""
        anywhere = next((f for f in reversed(FACTS.values()) if f.grid_rows is None), None)
        if not self.grid_rows or anywhere is None:
            return None
        return f"flashinfer {anywhere.flashinfer} starts chunks anywhere: {INSTALL_COMMAND.format(anywhere.flashinfer)}"

    def headline(self):
        """describe(), with the shapes the facts were measured at where they were: plan's first line, doctor's."""
        return f"{self.describe()}; measured at {self.describe_shapes()}" if self.measured else self.describe()

    def describe_shapes(self):
        """The measured shapes in words, for doctor, plan and docs/kernel-facts.md; None where none were measured."""
        if not self.measured_shapes:
            return None
        *others, last = [f"{d} (GQA {', '.join(map(str, groups))})" for d, groups in self.measured_shapes]
        return f"head_dim {', '.join(others)} and {last}" if others else f"head_dim {last}"

    def shape_warning(self, group, head_dim):
        """A warning when these facts were not measured at this GQA group and head_dim, else None:
        `plan` prints it, and each scheduler logs it at startup (scheduler_hooks). It names the
        facts taken instead and the probe that measures the shape.

        An unknown head_dim (None) is checked by the group alone: the rules then assume the
        strictest head_dim. Facts nobody measured (STRICTEST) get none: facts_for warns of the
        whole release.
        """
        if not self.measured:
            return None
        shapes = dict(self.measured_shapes)
        group_anywhere = any(group in groups for groups in shapes.values())
        if head_dim is None:
            unmeasured = None if group_anywhere else f"GQA group {group}"
        elif head_dim not in shapes:
            unmeasured = f"head_dim {head_dim}" if group_anywhere else f"GQA group {group} and head_dim {head_dim}"
        else:
            unmeasured = None if group in shapes[head_dim] else f"GQA group {group} at head_dim {head_dim}"
        if unmeasured is None:
            return None
        shape = f"--group {group}" + ("" if head_dim is None else f" --head-dim {head_dim}")
        return (
            f"{unmeasured}: not measured on flashinfer {self.flashinfer}, whose kernel facts were measured at "
            f"{self.describe_shapes()}, so bit-exactness here is the rules' arithmetic with those facts, unchecked "
            f"on a GPU; run `{PROBE_COMMAND} {shape}` on a GPU to measure it"
        )


_FI072_SHAPES = "GQA groups 1, 2, 4, 8 at head_dim 128 and 256 (q/KV heads 32/32, 32/16, 32/8, 64/8, 16/8, 32/4)"

# flashinfer 0.7.2 (SGLang 0.5.23's pin), H200, torch 2.11, 2026-11-29/30.
FI072 = KernelFacts(
    flashinfer="0.7.2",
    grid_rows=128,
    partial_tile_rows_equal=False,
    decoded_rows_equal=False,
    evidence=(
        ("starts on the 128-row grid exact, off it not (100, 129, 200, 1000 tokens)", _FI072_SHAPES,
         "tests/gpu/evidence/fa2_probe_h200_fi072.json"),
        ("tile thresholds 64/16 rows; a final piece or thin batch on a smaller tile is not exact; "
         "KV of at most 32 tokens exact on any tile at head_dim 128, not at 256",
         "GQA 4 head_dim 128 (16 vs 17 tokens), co-batching at groups 1, 4, 8",
         "tests/gpu/evidence/fa2_beyond_h200_fi072.json"),
        ("tile capped at 64 rows at head_dim 256 (1000-token starts exact at GQA 8: an 8-token tile)",
         "GQA 1, 2, 4, 8 at head_dim 256", "tests/gpu/logs/h200_flashinfer072_pytest.log"),
        ("the same cap in the replay's predictions: every plugin configuration exact as predicted; 2 "
         "requests predicted clear were inexact (stock-split-128 and upstream-128, page 16, radix on, "
         "unexplained)", "GQA 2 at head_dim 256, mixed and chat workloads", "benchmarks/results_h200.json"),
        ("rows of a partial final q-tile can differ from a longer prompt's (data-dependent)",
         "GQA 1 head_dim 128, chat workload", "benchmarks/logs/h200_probe_inherited_rows.log"),
        ("decoded rows differ from the solo prefill's (192 of 192)", "GQA 1, 4, 8 at 128, GQA 2 at 256",
         "benchmarks/logs/h200_probe_decode_rows.log"),
        *((f"`sglang-chunk-align probe` reproduces every fact (24 cases a shape) at head_dim {d}",
           "GQA 1, 4, 8", f"tests/gpu/evidence/probe_h200_fi072_d{d}.json") for d in (128, 256)),
        ("head_dim 512: starts on the grid exact, off it not, partial-tile rows as at 128, decoded rows "
         "differ; final pieces on the 16-row tile were exact where the source's thresholds (kept, the "
         "stricter reading) predict a tile change", "GQA 1, 4, 8 at head_dim 512",
         "tests/gpu/evidence/probe_h200_fi072_d512.json"),
        ("the grid of 128/g tokens and pieces over 64/g tokens exact (random lengths, prefixes, chunks "
         "128-512)", "GQA 2, 4, 8, 16 at head_dim 128, GQA 2, 4 at 256",
         "tests/gpu/evidence/fa2_relaxed_h200_fi072.json"),
    ),
    measured_shapes=((128, (1, 2, 4, 8, 16)), (256, (1, 2, 4, 8)), (512, (1, 4, 8))),
)

# flashinfer 0.7.4, same machine and probe, 2026-12-01; `sglang-chunk-align probe` confirmed every
# fact at GQA 1, 4, 8 and head_dim 128 and 256, decoded rows included (they differ, as on 0.7.2), and on an
# H100 on 2026-12-07 at GQA 3, head_dim 128 (Llama-3.2-3B's shape).
FI074 = KernelFacts(
    flashinfer="0.7.4",
    grid_rows=None,
    partial_tile_rows_equal=True,
    decoded_rows_equal=False,
    evidence=(
        ("starts anywhere exact (uniform 100, 129, 200, 1000 tokens, a radix hit at 1000; split 4096 "
         "and 1024); so are the rows of each chunk's partial final q-tile", "GQA groups 1, 4, 8 at "
         "head_dim 128, GQA 2 at 256", "tests/gpu/evidence/fa2_probe_h200_fi074.json"),
        ("final pieces of 4, 6, 16 tokens and a chunk with 15 one-token extends not exact (tile as 0.7.2)",
         "GQA 4 head_dim 128", "tests/gpu/evidence/fa2_probe_h200_fi074.json"),
        *((f"`sglang-chunk-align probe`: every fact holds at head_dim {d}; decoded rows differ from the "
           "solo prefill's", "GQA 1, 4, 8", f"tests/gpu/evidence/probe_h200_fi074_d{d}.json") for d in (128, 256)),
        ("`sglang-chunk-align probe --group 3 --head-dim 128` on an H100: every fact holds", "GQA 3 at head_dim 128",
         "tests/gpu/evidence/probe_h100_fi074_g3_d128.json"),
    ),
    measured_shapes=((128, (1, 3, 4, 8)), (256, (1, 2, 4, 8))),
)

FACTS = {facts.flashinfer: facts for facts in (FI072, FI074)}

# What an unmeasured release gets: every fact at its strictest measured value.
STRICTEST = KernelFacts(
    flashinfer="unmeasured",
    grid_rows=max(f.grid_rows or 0 for f in FACTS.values()) or None,
    partial_tile_rows_equal=all(f.partial_tile_rows_equal for f in FACTS.values()),
    decoded_rows_equal=all(f.decoded_rows_equal for f in FACTS.values()),
    measured=False,
)


def facts_for(version):
    """The facts of flashinfer `version` (a release string, or None: not installed), and the
    WARNING to log where nobody measured it (None where measured)."""
    if version in FACTS:
        return FACTS[version], None
    name = f"flashinfer {version}" if version else "no flashinfer installed"
    warning = (
        f"sglang-chunk-align: {name}: its fa2 kernel facts were not measured, so the grid rules take "
        f"the strictest measured ones ({_measured_releases()}); run `{PROBE_COMMAND}` on a GPU to measure them."
    )
    return STRICTEST._replace(flashinfer=version or "none"), warning


def _measured_releases():
    return f"flashinfer {' and '.join(FACTS)}"


def installed_flashinfer():
    """The installed flashinfer-python release, or None: the release FACTS are keyed by."""
    from .compat import installed_release

    return installed_release("flashinfer-python")


def release_facts(version):
    """The facts of flashinfer `version` (None: not installed), as the plugin takes them; where
    nobody measured it, its WARNING is logged."""
    facts, warning = facts_for(version)
    if warning:
        logger.warning(warning)
    return facts


@functools.cache
def installed_facts():
    """The facts of the installed flashinfer, once per process: an unmeasured one warns once."""
    return release_facts(installed_flashinfer())


_chosen = contextvars.ContextVar("sglang_chunk_align.kernel_facts.chosen", default=None)


@contextlib.contextmanager
def chosen(facts):
    """Within this block, the plugin plans with `facts` (a KernelFacts) instead of the installed
    release's: the harness's way to schedule with a release that is not installed (scheduling
    runs no kernel), as `sglang-chunk-align plan --flashinfer` does. Yields `facts`."""
    token = _chosen.set(facts)
    try:
        yield facts
    finally:
        _chosen.reset(token)


def facts_in_force():
    """What the plugin's scheduler plans with: the facts chosen() for this block, else the
    installed release's. Read where SGLang calls in (backends.facts_needed), and passed on."""
    facts = _chosen.get()
    return installed_facts() if facts is None else facts
