"""The installed flashinfer's kernel facts (sglang_chunk_align/kernel_facts.py) hold on this GPU.

Runs `sglang-chunk-align probe`'s cases (sglang_chunk_align/tools/probe.py), one
test each, for GQA groups 1, 2, 4 and 8 at head_dim 128 and 256: fa2 paged
prefill planned as SGLang's deterministic backend plans it, chunked against
unchunked, torch.equal row by row, and each result judged by what the facts
of the installed release predict. Both directions are pinned: where the facts
say a start or a tile breaks exactness, equal rows fail the test too. Where
they say rows *can* differ (probe.EITHER: partial-tile rows on 0.7.2, decoded
rows; data-dependent, so equal rows on random data do not refute it), no
result could fail the case: it is measured and reported as skipped
("informational"), never counted as passed. An unmeasured flashinfer is judged
by the strictest measured facts.

Needs a CUDA GPU (sm80+) and flashinfer; without them the module is skipped
with the reason. See tests/gpu/README.md.
"""

import pytest

from sglang_chunk_align.tools import fa2, probe
from sglang_chunk_align.kernel_facts import installed_facts

REASON = probe.why_not_measurable()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

GROUPS = (1, 2, 4, 8)
HEAD_DIMS = (128, 256)
CASES = [(g, d, case) for d in HEAD_DIMS for g in GROUPS for case in probe.cases(g)]


@pytest.fixture(scope="module")
def shape_for():
    """One seeded Shape per (group, head_dim), sharing one workspace, as the probe runs them."""
    import torch

    workspace = torch.empty(fa2.DETERMINISTIC_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    shapes = {}

    def get(group, head_dim):
        if (group, head_dim) not in shapes:
            shapes[group, head_dim] = probe.Shape(group, head_dim, workspace)
        return shapes[group, head_dim]

    return get


@pytest.mark.parametrize(
    "group,head_dim,case", CASES, ids=[f"g{g}-d{d}-{c.fact}-{c.name}-split{c.split}" for g, d, c in CASES]
)
def test_the_installed_release_facts_hold(shape_for, group, head_dim, case):
    facts = installed_facts()
    [checked] = probe.verdicts(facts, [probe.measure(shape_for(group, head_dim), case)])
    if checked["expected"] == probe.EITHER and not checked.get("error"):
        measured = "equal" if checked["exact"] else f"{checked['n_bad_rows']} rows differ"
        pytest.skip(f"informational, not a pass: {facts.describe()} says these rows can differ; measured: {measured}")
    assert checked["holds"], (
        f"{facts.describe()}: {case.name} (split {case.split}) at GQA {group} head_dim {head_dim} should be "
        f"{checked['expected']}, got {checked.get('error') or checked}"
    )
