"""Every figure docs/exactness.md and the README give for issue 46's H200 run, read from its records:
benchmarks/logs/exactness_h200/call1/qwen2.5-7b.json (real_server.py) and
benchmarks/logs/unsplit_decode_h200/unsplit_decode.json (probe_unsplit_decode.py)."""

import json
import pathlib

from benchmarks.real_server import failed_fraction
from sglang_chunk_align import scheduler_hooks

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = json.loads((ROOT / "benchmarks/logs/exactness_h200/call1/qwen2.5-7b.json").read_text())
PROBE = json.loads((ROOT / "benchmarks/logs/unsplit_decode_h200/unsplit_decode.json").read_text())
PROBE_FI074 = json.loads((ROOT / "benchmarks/logs/unsplit_decode_h200/fi074/unsplit_decode_fi074.json").read_text())
DOC = (ROOT / "docs/exactness.md").read_text()
README = (ROOT / "README.md").read_text()
SERVERS = {entry["name"]: entry for entry in RUN["servers"]}
LARGE = {entry["name"]: entry for entry in RUN["large_batch"]}


def passes(name):
    return [p for w in SERVERS[name]["verify"]["workloads"].values() for p in w["passes"].values()]


def identical(name):
    return sum(p["identical"] for p in passes(name)), sum(p["requests"] for p in passes(name))


def cached(name, workload):
    return SERVERS[name]["verify"]["workloads"][workload]["passes"]["sequential"]["cached_tokens_total"]


def flat(text):
    return " ".join(text.split())


def test_the_run_served_well_scaled_random_weights_on_the_stack_the_doc_names():
    assert RUN["weights"] == "well-scaled random weights: normal(0, 0.02), norms 1, biases 0, seed 0"
    assert "normal(0, 0.02), norms 1, biases 0, seed 0" in flat(DOC)
    assert (RUN["stack"]["sglang"], RUN["stack"]["flashinfer-python"], RUN["stack"]["torch"]) == ("0.5.23", "0.7.2", "2.11.0")
    assert (RUN["model"]["num_attention_heads"], RUN["model"]["num_key_value_heads"]) == (28, 4)  # GQA 7
    assert "SGLang 0.5.23, flashinfer 0.7.2, torch 2.11" in flat(DOC) and "GQA 7, head_dim 128" in DOC


def test_the_verify_table_is_the_record():
    doc = flat(DOC)
    assert identical("reference-page1") == (192, 192) and "which matched itself in 192 of 192" in doc
    for chunk in (128, 256):
        plugin = f"plugin-chunk{chunk}-page1-radixon"
        assert identical(plugin) == (192, 192)
        hits = f"mixed {cached(plugin, 'mixed'):,}, chat {cached(plugin, 'chat'):,}"
        assert f"| plugin, chunk {chunk}, radix on | **192 of 192** | {hits} |" in DOC
    for chunk, words in ((128, "control: rules off (`SGLANG_CHUNK_ALIGN_RULES=0`), chunk 128"),
                         (256, "control: rules off, chunk 256")):
        control = f"plugin-chunk{chunk}-page1-radixoff-rules0"
        same, total = identical(control)
        percent = f"{100 * failed_fraction(SERVERS[control]):.1f}%"
        assert f"| {words} | {same} of {total} (**{percent} failed**) | radix off |" in DOC


def test_each_plugin_setup_is_exact_beside_a_control_that_failed():
    assert [(v["server"], v["verdict"]) for v in RUN["verdicts"]] == [
        ("plugin-chunk256-page1-radixon", "exact"), ("plugin-chunk128-page1-radixon", "exact")]
    chat_256 = SERVERS["plugin-chunk256-page1-radixoff-rules0"]["verify"]["workloads"]["chat"]["passes"]
    assert all(p["identical"] == p["requests"] for p in chat_256.values())  # "none of its requests failed"
    assert "none of its requests failed the control at chunk 256" in flat(DOC)


def test_the_large_batch_table_is_the_record():
    unsplit, control, no_graphs = (LARGE[f"large-batch-{n}"] for n in ("unsplit", "split-control", "unsplit-no-graphs"))
    assert all(e["requests"] == 64 and e["largest_decode_batch"] == 64 and e["eager_decode_steps_logged"] > 0
               for e in (unsplit, control, no_graphs))
    assert (unsplit["decode_graph_max_bs"], control["decode_graph_max_bs"], no_graphs["decode_graph_max_bs"]) == (8, 8, None)
    prompts = unsplit["prompt_tokens"]
    assert f"64 prompts of {min(prompts):,}-{max(prompts):,} tokens" in flat(DOC)
    assert (unsplit["identical"], control["identical"], no_graphs["identical"]) == (64, 0, 64)
    assert all(d == ["output", 1] for d in control["first_differences"])  # the first decoded token
    assert no_graphs["alone_identical_to_graphs"] == 64
    doc = flat(DOC)
    assert "| the plugin (unsplit decode) | **64 of 64** |" in DOC
    assert "`SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE=0` | **0 of 64** (each from its first decoded token) |" in DOC
    assert "**64 of 64**, and alone identical to the graphs' server alone in 64 of 64" in doc


def test_what_the_fix_costs_is_the_record():
    unsplit, control = LARGE["large-batch-unsplit"], LARGE["large-batch-split-control"]
    doc = flat(DOC)
    assert (f"{unsplit['eager_gen_throughput_median']:,.0f} tok/s against "
            f"{control['eager_gen_throughput_median']:,.0f} without it") in doc
    assert f"{unsplit['output_tokens_per_s']} against {control['output_tokens_per_s']} output tok/s" in doc
    ratios = {(t["shape"], t["kv_len"], t["batch"]): t["fix_over_stock"] for t in PROBE["timings"]}
    head_dim_128_big = [r for (shape, kv, batch), r in ratios.items() if shape != "gemma-2b" and batch >= 64]
    assert f"{min(head_dim_128_big):.2f}-{max(head_dim_128_big):.2f}x stock's from batch 64" in doc
    batch1_32k = [r for (shape, kv, batch), r in ratios.items() if kv == 32768 and batch == 1]
    assert (round(min(batch1_32k)), round(max(batch1_32k))) == (8, 11) and "8-11x at batch 1 with 32k of KV" in doc


def test_the_probe_verdicts_are_the_records():
    for probe, flashinfer, rows, said in ((PROBE, "0.7.2", 54, "stock's split differed in 54 of 54 rows past 2048"),
                                          (PROBE_FI074, "0.7.4", 36, "(36 of 36 stock rows past 2048 differing")):
        assert probe["environment"]["flashinfer"] == flashinfer
        assert probe["verdict"]["fix"] == "holds" and probe["verdict"]["stock_inexact"] and not probe["verdict"]["suspect"]
        past = [c for shape in probe["results"] for c in shape["cells"]
                if c["variant"] == "eager_stock" and c["kv_len"] > 2048]
        assert len(past) == rows and not any(c["exact"] for c in past)
        assert said in flat(DOC)
        fixed = [c for shape in probe["results"] for c in shape["cells"] if c["variant"] != "eager_stock"]
        assert fixed and all(c["exact"] for c in fixed)


def test_the_readme_cites_the_same_figures_and_the_startup_clause_is_the_plugins():
    readme = flat(README)
    assert ("chunks 128 and 256, radix hits included, 192 of 192 `verify` requests identical, their rules-off "
            "controls failing 27.6% and 15.6%; 64 requests decoding past the CUDA graphs' batch, 64 of 64 "
            "(0 of 64 without unsplit eager decode)") in readme
    assert f"      {scheduler_hooks._unsplit_decode_note(True)}\n" in README
    assert "where 0 of 64 such requests matched" in readme
