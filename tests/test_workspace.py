"""workspace.py: the fa2 split partials of a chunk's worst step against SGLang's 2 GiB
deterministic workspace, held to what real servers did on the H200, and the startup refusal."""

import ast
import pathlib
import re
from types import SimpleNamespace

import pytest

import sglang_chunk_align
from sglang_chunk_align import releases
from sglang_chunk_align.harness import standins
from sglang_chunk_align.compat import sglang_at_least
from sglang_chunk_align.kernel_facts import FI072
from sglang_chunk_align.workspace import Planned, partial_bytes

RECORD = pathlib.Path(__file__).parent.parent / "benchmarks" / "logs" / "serving_h200" / "printed_call1.txt"
GRANITE = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, split=4096)  # per rank, as the servers ran
WORKSPACE = 2 * 2**30  # SGLang's deterministic flashinfer workspace
needs_stock_check = pytest.mark.skipif(
    not sglang_at_least(releases.STOCK_STARTUP_CHECK),
    reason=f"the refusal runs in Scheduler.check_truncation_align_fits_chunk ({releases.STOCK_STARTUP_CHECK}+) here",
)


def recorded(prefix):
    """The long prompts one server of the recorded H200 run was sent: [(tokens, outcome)]."""
    line = next(line for line in RECORD.read_text().splitlines() if line.startswith(prefix))
    return ast.literal_eval(line[line.rindex(" ["):].strip())


def fits(qo_len, kv_len):
    return partial_bytes(qo_len, kv_len, cta_tile=FI072.cta_tile, **GRANITE) <= WORKSPACE


def test_the_formula_says_which_prompts_the_h200_servers_served():
    """Unchunked (the stock reference): served up to 20480 tokens, refused 24576. Chunks of 4096
    (stock): every prompt served, up to 131000 tokens, whose final chunk is 4024 tokens over the
    whole prompt. The formula agrees on each, the side each fell on included."""
    reference = recorded("REF flashinfer")
    assert {outcome for _, outcome in reference} == {"served", "refused"}
    for tokens, outcome in reference:
        assert fits(tokens, tokens) is (outcome == "served"), tokens
    stock = recorded("SETUP stock-4096")
    assert stock and all(outcome == "served" for _, outcome in stock)
    for tokens, _ in stock:
        assert all(fits(min(start + 4096, tokens) - start, min(start + 4096, tokens))
                   for start in range(0, tokens, 4096)), tokens
    # What the final chunk of 131000 tokens escaped: a full 4096-token chunk over the same KV.
    assert not fits(4096, 131000)


@pytest.mark.parametrize("chunk", [128, 256, 1024, 2048])
def test_the_plugins_chunks_fit_a_128k_context(chunk):
    assert Planned(**GRANITE, workspace_bytes=WORKSPACE).refusal(chunk, 131072, FI072.cta_tile) is None


@pytest.mark.parametrize("chunk, max_prompt", [(4096, 131072), (None, 32768), (8192, 65536)])
def test_a_refusal_names_a_context_and_a_chunk_that_fit_and_nothing_larger_does(chunk, max_prompt):
    planned = Planned(**GRANITE, workspace_bytes=WORKSPACE)
    message = planned.refusal(chunk, max_prompt, FI072.cta_tile)
    context, largest = map(int, re.search(r"--context-length (\d+) .* --chunked-prefill-size (\d+)", message).groups())
    step = chunk or max_prompt
    assert planned.refusal(chunk, context, FI072.cta_tile) is None
    assert planned.refusal(chunk, context + 1, FI072.cta_tile) is not None
    assert largest % 128 == 0 and planned.refusal(largest, max_prompt, FI072.cta_tile) is None
    assert largest < step and "would fail mid-request" in message


def granite_backend():
    buffer = SimpleNamespace(numel=lambda: WORKSPACE, element_size=lambda: 1)
    return standins.flashinfer_backend(planned=(32, 8, 128), workspace_buffer=buffer)


@needs_stock_check
def test_the_scheduler_refuses_a_chunk_whose_worst_step_outgrows_the_workspace_where_stock_starts():
    """Chunk 4096 at a 131072-token context: stock's startup check accepts it (and fails a request
    later); the plugin refuses at startup. Chunk 1024 starts either way."""
    state = {"max_req_input_len": 131072}
    sglang_chunk_align.remove()
    assert standins.scheduler_alignment(granite_backend, chunk=4096, state=dict(state)) == 4096
    sglang_chunk_align.apply()
    with pytest.raises(ValueError, match="--context-length 126976 or less, or --chunked-prefill-size 3968"):
        standins.scheduler_alignment(granite_backend, chunk=4096, state=dict(state))
    assert standins.scheduler_alignment(granite_backend, chunk=1024, state=dict(state)) == 128


@needs_stock_check
def test_unarmed_the_workspace_is_not_checked(plugin):
    """Non-deterministic flashinfer plans without a fixed split: the plugin is not armed there."""
    state = {"max_req_input_len": 131072}
    assert standins.scheduler_alignment(granite_backend, deterministic=False, chunk=4096, state=state) is None
