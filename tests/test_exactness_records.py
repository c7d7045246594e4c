"""Every figure docs/exactness.md and the README give for issue 46's H200 runs, read from their records:
benchmarks/logs/exactness_h200/call1/ to call4/ (real_server.py, engine_rollout.py) and
benchmarks/logs/unsplit_decode_h200/unsplit_decode.json (probe_unsplit_decode.py)."""

import json
import pathlib
import tarfile

import pytest

from benchmarks.real_server import failed_fraction
from sglang_chunk_align import scheduler_hooks

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks/logs/exactness_h200"
RUN = json.loads((RECORDS / "call1/qwen2.5-7b.json").read_text())
CALL2 = {name: json.loads((RECORDS / f"call2/{name}.json").read_text())
         for name in ("qwen2.5-7b", "llama-3.1-8b", "nemotron-h-8b")}
CALL3 = {"nemotron-h-8b": json.loads((RECORDS / "call3/nemotron-h-8b.json").read_text()),
         "qwen2.5-7b": json.loads((RECORDS / "call3/fi074/qwen2.5-7b.json").read_text())}
CALL4 = {"qwen2.5-7b": json.loads((RECORDS / "call4/qwen2.5-7b.json").read_text())}
ENGINE_REFERENCE = json.loads((RECORDS / "call2/engine-reference.json").read_text())
ENGINE3 = {role: json.loads((RECORDS / f"call3/engine-{role}.json").read_text()) for role in ("reference", "plugin", "control")}
PROBE = json.loads((ROOT / "benchmarks/logs/unsplit_decode_h200/unsplit_decode.json").read_text())
PROBE_FI074 = json.loads((ROOT / "benchmarks/logs/unsplit_decode_h200/fi074/unsplit_decode_fi074.json").read_text())
DOC = (ROOT / "docs/exactness.md").read_text()
README = (ROOT / "README.md").read_text()
SERVERS = {entry["name"]: entry for entry in RUN["servers"]}
LARGE = {entry["name"]: entry for entry in RUN["large_batch"]}
SHAPES = {"qwen2.5-7b": "Qwen2.5-7B", "llama-3.1-8b": "Llama-3.1-8B"}
# The doc's verify table, row by row: (record, run).
ROWS = [("qwen2.5-7b", 128, "call1"), ("qwen2.5-7b", 256, "call1"), ("qwen2.5-7b", 256, "call2"),
        ("qwen2.5-7b", 1024, "call2"), ("llama-3.1-8b", 128, "call2"), ("llama-3.1-8b", 256, "call2"),
        ("llama-3.1-8b", 1024, "call2"), ("qwen2.5-7b", 256, "call3"), ("qwen2.5-7b", 256, "call4")]
RUN_LABELS = {"call3": "call3, flashinfer 0.7.4", "call4": "call4, an H100"}


def record(model, run):
    return RUN if run == "call1" else {"call2": CALL2, "call3": CALL3, "call4": CALL4}[run][model]


def servers(model, run):
    return {e["name"]: e for e in record(model, run)["servers"]}


def passes_of(entry):
    return [p for w in entry["verify"]["workloads"].values() for p in w["passes"].values()]


def passes(name):
    return passes_of(SERVERS[name])


def counts(entry):
    return sum(p["identical"] for p in passes_of(entry)), sum(p["requests"] for p in passes_of(entry))


def identical(name):
    return counts(SERVERS[name])


def cached(name, workload, entries=None):
    return (entries or SERVERS)[name]["verify"]["workloads"][workload]["passes"]["sequential"]["cached_tokens_total"]


def flat(text):
    return " ".join(text.split())


def test_the_run_served_well_scaled_random_weights_on_the_stack_the_doc_names():
    assert RUN["weights"] == "well-scaled random weights: normal(0, 0.02), norms 1, biases 0, seed 0"
    assert "normal(0, 0.02), norms 1, biases 0, seed 0" in flat(DOC)
    assert (RUN["stack"]["sglang"], RUN["stack"]["flashinfer-python"], RUN["stack"]["torch"]) == ("0.5.23", "0.7.2", "2.11.0")
    assert (RUN["model"]["num_attention_heads"], RUN["model"]["num_key_value_heads"]) == (28, 4)  # GQA 7
    assert "SGLang 0.5.23, flashinfer 0.7.2 (one server on 0.7.4), torch 2.11" in flat(DOC)
    assert "GQA 7, head_dim 128" in DOC


def test_call2_and_call3_ran_the_same_stack_and_weights_as_call1_but_one_server_on_flashinfer_0_7_4():
    for run in (*CALL2.values(), CALL3["nemotron-h-8b"]):
        assert run["weights"] == RUN["weights"] and run["stack"] == RUN["stack"]
    fi074 = CALL3["qwen2.5-7b"]
    assert fi074["weights"] == RUN["weights"] and fi074["stack"] == {**RUN["stack"], "flashinfer-python": "0.7.4"}
    assert all(e["weights"] == RUN["weights"] and e["versions"]["flashinfer-python"] == "0.7.2" for e in ENGINE3.values())
    assert (CALL2["llama-3.1-8b"]["model"]["num_attention_heads"], CALL2["llama-3.1-8b"]["model"]["num_key_value_heads"]) == (32, 8)
    assert ENGINE_REFERENCE["weights"] == RUN["weights"] and ENGINE_REFERENCE["role"] == "reference"


@pytest.mark.parametrize("model, chunk, run", ROWS)
def test_the_verify_table_is_the_record(model, chunk, run):
    entries = servers(model, run)
    assert counts(entries["reference-page1"]) == (192, 192)
    plugin, control = f"plugin-chunk{chunk}-page1-radixon", entries.get(f"plugin-chunk{chunk}-page1-radixoff-rules0")
    assert counts(entries[plugin]) == (192, 192)
    hits = f"{cached(plugin, 'mixed', entries):,} / {cached(plugin, 'chat', entries):,}"
    if "workloads" in control["verify"]:
        same, total = counts(control)
        said = f"**{100 * failed_fraction(control):.1f}%** ({same} of {total} identical)"
    else:  # stopped by the step's time limit: verify's report holds its traceback alone
        assert control["verify_exit"] == -2 and not control["ok"]
        said = "not measured: the step's time limit stopped it"
    assert f"| {SHAPES[model]} | {chunk} | **192 of 192** | {hits} | {said} | {RUN_LABELS.get(run, run)} |" in DOC
    assert "which matched itself in 192 of 192 on both dense shapes" in flat(DOC)


def test_each_plugin_setup_is_exact_beside_a_control_that_failed():
    assert [(v["server"], v["verdict"]) for v in RUN["verdicts"]] == [
        ("plugin-chunk256-page1-radixon", "exact"), ("plugin-chunk128-page1-radixon", "exact")]
    assert [(v["server"], v["verdict"]) for v in CALL2["qwen2.5-7b"]["verdicts"]] == [
        ("plugin-chunk1024-page1-radixon", "exact"), ("plugin-chunk256-page1-radixon", "could not see")]
    assert {v["verdict"] for v in CALL2["llama-3.1-8b"]["verdicts"]} == {"exact"}
    assert "(call2's Qwen2.5-7B at 256 on call1's control;" in flat(DOC)
    chat_256 = SERVERS["plugin-chunk256-page1-radixoff-rules0"]["verify"]["workloads"]["chat"]["passes"]
    assert all(p["identical"] == p["requests"] for p in chat_256.values())  # "none of its requests failed"
    assert "none of chat's requests failed the control at chunk 256" in flat(DOC)


def test_chat_failed_every_control_sequentially_and_concurrently_only_at_chunk_128():
    chats = {(model, chunk): servers(model, "call2")[f"plugin-chunk{chunk}-page1-radixoff-rules0"]["verify"]["workloads"]["chat"]["passes"]
             for model, chunk, run in ROWS if run == "call2" and (model, chunk) != ("qwen2.5-7b", 256)}
    assert all(c["sequential"]["identical"] == 0 and c["sequential"]["requests"] == 32 for c in chats.values())
    assert {key[1]: c["concurrent"]["identical"] for key, c in chats.items()} == {128: 0, 256: 32, 1024: 32}
    doc = flat(DOC)
    assert "call2 all 32 failed the control in the sequential pass, at every chunk" in doc
    assert "chat matched at chunks 256 and 1024 and failed in 32 of 32 at 128" in doc


def test_stock_nemotron_h_did_not_match_itself_and_calls2_plugin_servers_were_stopped():
    entries = servers("nemotron-h-8b", "call2")
    workloads = entries["reference-page1"]["verify"]["workloads"]
    alone = [w["passes"]["sequential"] for w in workloads.values()]
    assert (sum(p["identical"] for p in alone), sum(p["requests"] for p in alone)) == (96, 96)
    together = {name: w["passes"]["concurrent"] for name, w in workloads.items()}
    assert entries["reference-page1"]["verify"]["concurrency"] == 8
    assert {name: p["identical"] for name, p in together.items()} == {"mixed": 8, "chat": 11, "tiles": 10}
    first = [f["first_difference"] for p in together.values() for f in p["failures"]]
    assert (len(first), first.count("input"), first.count("output")) == (67, 62, 5)
    doc = flat(DOC)
    assert "(96 of 96), but sent 8 at a time only 29 of 96 did (mixed 8, chat 11, tiles 10 of 32); 62 of the 67" in doc
    assert "5 in the generated tokens' logprobs" in doc
    plugin_runs = [e for name, e in entries.items() if name.startswith("plugin-")]
    assert len(plugin_runs) == 4 and all(e["verify_exit"] == -2 and "workloads" not in e["verify"] for e in plugin_runs)
    assert "call2's four plugin servers of the same setups were stopped by the step's time limit before `verify` reported" in doc


def test_call3s_nemotron_h_plugin_matched_the_references_solo_answers_where_stock_did_not_itself():
    entries = servers("nemotron-h-8b", "call3")
    reference = entries["reference-page1"]["verify"]["workloads"]
    alone = [w["passes"]["sequential"] for w in reference.values()]
    together = {name: w["passes"]["concurrent"] for name, w in reference.items()}
    assert sum(p["identical"] for p in alone) == 96 and {n: p["identical"] for n, p in together.items()} == {
        "mixed": 10, "chat": 11, "tiles": 10}
    first = [f["first_difference"] for p in together.values() for f in p["failures"]]
    assert (len(first), first.count("input")) == (65, 59)
    doc = flat(DOC)
    assert "96 of 96 alone, 31 of 96 eight at a time (mixed 10, chat 11, tiles 10), 59 of the 65 differing first" in doc
    for chunk, said in ((256, "**73.4%** (51 of 192 identical) at 256"), (512, "**59.9%** (77 of 192) at 512")):
        plugin, control = entries[f"plugin-chunk{chunk}-page1-radixdefault"], entries[f"plugin-chunk{chunk}-page1-radixoff-rules0"]
        assert counts(plugin) == (192, 192) and plugin["verify"]["concurrency"] == 8
        assert "one request per prefill batch" in plugin["plugin_lines"][-1]
        assert "radix cache off, as stock (a mamba prefix cache" in plugin["plugin_lines"][-1]
        assert f"{100 * failed_fraction(control):.1f}%** ({counts(control)[0]} of 192" in said and said in doc
    assert [(v["server"], v["verdict"]) for v in CALL3["nemotron-h-8b"]["verdicts"]] == [
        ("plugin-chunk512-page1-radixdefault", "exact"), ("plugin-chunk256-page1-radixdefault", "exact")]
    assert "**identical to the reference's solo answers in 192 of 192 requests at chunks 256 and 512**" in doc
    families = flat((ROOT / "docs/model-families.md").read_text())
    assert ("Nemotron-H's stock reference matched itself in 31 of 96 concurrent requests, and the plugin matched the "
            "reference's solo answers in 192 of 192 at chunks 256 and 512") in families


def test_call3s_engine_cycle_and_check_were_exact_beside_a_control_that_differed():
    reference, plugin, control = ENGINE3["reference"], ENGINE3["plugin"], ENGINE3["control"]
    assert reference["verify"]["ok"] and counts(reference) == (96, 96) and "--record-reference" in reference["argv"]
    replays = [step for step in plugin["cycle"]["steps"] if "identical_to_first_run" in step]
    assert len(replays) == 2 and all(step["identical_to_first_run"] == 32 for step in replays)
    assert plugin["cycle"]["rollouts_changed_by_the_update"] == 32
    assert plugin["ok"] and counts(plugin) == (96, 96) and "--recorded" in plugin["argv"]
    hits = [plugin["verify"]["workloads"][w]["passes"]["sequential"]["cached_tokens_total"] for w in ("mixed", "chat")]
    assert counts(control)[0] == 59 and "--control" in control["argv"]
    assert control["verify"]["workloads"]["chat"]["passes"]["sequential"]["identical"] == 0
    doc = flat(DOC)
    assert "were identical in 32 of 32, and the update changed 32 of 32" in doc
    assert f"**96 of 96 identical**, with radix hits ({hits[0]:,} / {hits[1]:,} cached tokens" in doc
    assert (f"**{100 * control['control_failed_fraction']:.1f}%** differed (59 of 96 identical; chat 0 of 16 in the "
            "sequential pass)") in doc


def test_flashinfer_0_7_4_kept_radix_hits_whole():
    fi074, fi072 = servers("qwen2.5-7b", "call3"), servers("qwen2.5-7b", "call2")
    plugin = "plugin-chunk256-page1-radixon"
    assert "1-token grid" in fi074[plugin]["plugin_lines"][-1] and "128-token grid" in fi072[plugin]["plugin_lines"][-1]
    mixed, chat = cached(plugin, "mixed", fi074), cached(plugin, "chat", fi074)
    assert (cached(plugin, "mixed", fi072), cached(plugin, "chat", fi072)) == (9600, 50944)
    assert f"{mixed:,} cached tokens on mixed against 9,600 on 0.7.2's 128-token grid (chat: {chat:,} against 50,944)" in flat(DOC)
    assert "GQA 1, 4 and 8, not at this shape's 7" in flat(DOC)
    assert "GQA group 7 at head_dim 128: not measured on flashinfer 0.7.4" in fi074[plugin]["plugin_lines"][0]


def baseline_answers(archive):
    with tarfile.open(archive) as tar:
        return tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("qwen2.5-7b-logs/baseline-page1.json"))).read()


def test_call4_ran_call2s_stack_on_an_h100_whose_reference_recorded_the_h200s_answers():
    call4 = CALL4["qwen2.5-7b"]
    assert call4["weights"] == RUN["weights"]
    assert call4["stack"] == {**RUN["stack"], "gpu": "NVIDIA H100 80GB HBM3, 580.159.04"} and RUN["stack"]["gpu"].startswith("NVIDIA H200")
    assert [(v["server"], v["verdict"]) for v in call4["verdicts"]] == [("plugin-chunk256-page1-radixon", "exact")]
    answers = baseline_answers(RECORDS / "call4/qwen2.5-7b-logs.tgz")
    assert len(json.loads(answers)) == 110 and answers == baseline_answers(RECORDS / "call2/logs.tgz")
    doc = flat(DOC)
    assert "its stock reference recorded byte for byte the answers of call2's H200 reference" in doc
    assert "call4 ran that setup again beside its own" in doc


def generate_times(archive, server):
    """The server log's timestamps of its /generate requests, in seconds of the day."""
    with tarfile.open(archive) as tar:
        log = tar.extractfile(f"qwen2.5-7b-logs/{server}.log").read().decode()
    stamps = [line[12:20] for line in log.splitlines() if '"POST /generate HTTP/1.1" 200' in line]
    return [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in (stamp.split(":") for stamp in stamps)]


def test_verifys_default_check_took_about_a_minute_on_an_8b_shape():
    archive = RECORDS / "call4/qwen2.5-7b-logs.tgz"
    plugin, control = (generate_times(archive, name) for name in (
        "plugin-chunk256-page1-radixon", "plugin-chunk256-page1-radixoff-rules0"))
    # Each server's first /generate is SGLang's own warmup; then verify's 192 (the reference: the 110 it recorded).
    assert len(plugin) == 1 + 192 and plugin[-1] - plugin[0] == 69 and control[0] < plugin[-1]  # side by side
    reference = generate_times(archive, "reference-page1")
    recorded = len(json.loads(baseline_answers(archive)))
    assert reference[recorded] - reference[0] == 26 and reference[recorded] < min(plugin + control)
    doc = flat(DOC)
    assert ("SGLang's warmup request at 16:32:50 and `verify`'s 192nd at 16:33:59, **69 s**, with the control "
            "checked on the same GPU at the same time") in doc
    assert "its 110 cold answers to record in 26 s" in doc


def test_the_rules_off_control_failed_the_same_sequential_requests_on_flashinfer_0_7_2_and_0_7_4():
    def failures(model, run, mode):
        control = servers(model, run)["plugin-chunk256-page1-radixoff-rules0"]["verify"]["workloads"]
        return {name: [(f["request"], f["prompt_tokens"]) for f in w["passes"][mode]["failures"]] for name, w in control.items()}
    fi072, fi074 = failures("qwen2.5-7b", "call4", "sequential"), failures("qwen2.5-7b", "call3", "sequential")
    assert fi072 == fi074 and sum(map(len, fi072.values())) == 59
    assert {tokens % 1024 for failed in fi072.values() for _, tokens in failed} <= set(range(1, 9))
    concurrent = failures("qwen2.5-7b", "call4", "concurrent")
    assert {name: len(failed) for name, failed in concurrent.items()} == {"mixed": 1, "chat": 0, "tiles": 1}
    assert not any(failures("qwen2.5-7b", "call3", "concurrent").values())
    doc = flat(DOC)
    assert "On 0.7.2 (call4) the same control failed 31.8%: **the same 59 requests in the sequential pass**" in doc
    assert "and one concurrent request each on mixed and tiles" in doc


def test_the_engine_reference_matched_itself():
    verified = ENGINE_REFERENCE["verify"]
    assert verified["ok"] and counts(ENGINE_REFERENCE) == (96, 96)
    assert "checkpoint; 96 of 96 identical to themselves)" in flat(DOC)


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
    rows = [(servers(model, run)[f"plugin-chunk{chunk}-page1-radixon"],
             servers(model, run)[f"plugin-chunk{chunk}-page1-radixoff-rules0"]) for model, chunk, run in ROWS]
    assert all(counts(plugin) == (192, 192) for plugin, _ in rows)
    fractions = [failed_fraction(control) for _, control in rows if "workloads" in control["verify"]]
    readme = flat(README)
    assert (f"192 of 192 `verify` requests identical on {len(rows)} servers, the {len(fractions)} rules-off controls "
            f"failing {100 * min(fractions):.1f}-{100 * max(fractions):.1f}%;") in readme
    assert "(one server on flashinfer 0.7.4, one on an H100)" in readme
    hybrid = servers("nemotron-h-8b", "call3")
    assert all(counts(hybrid[f"plugin-chunk{c}-page1-radixdefault"]) == (192, 192) for c in (256, 512))
    said = "Nemotron-H's hybrid 192 of 192 at chunks 256 and 512 (controls {:.1f}%, {:.1f}%)".format(
        *(100 * failed_fraction(hybrid[f"plugin-chunk{c}-page1-radixoff-rules0"]) for c in (256, 512)))
    assert said in readme
    stock = [sum(w["passes"]["concurrent"]["requests"] - w["passes"]["concurrent"]["identical"]
                 for w in servers("nemotron-h-8b", run)["reference-page1"]["verify"]["workloads"].values())
             for run in ("call2", "call3")]
    assert f"differed from itself in {min(stock)}-{max(stock)} of 96 concurrent requests" in readme
    assert (f"an Engine's RL cycle and check {counts(ENGINE3['plugin'])[0]} of 96 "
            f"(control {100 * ENGINE3['control']['control_failed_fraction']:.1f}%)") in readme
    assert "64 of 64 decoding past the CUDA graphs' batch (0 of 64 without unsplit eager decode)" in readme
    assert "on well-scaled ones, where the control differed on 38.5%" in readme
    assert f"      {scheduler_hooks._unsplit_decode_note(True)}\n" in README
    assert "where 0 of 64 such requests matched" in readme
