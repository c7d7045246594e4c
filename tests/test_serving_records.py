"""The second H200 run's records (Qwen2.5-7B's shape, Granite's defaults beside the ceiling, the
determinism profile) against what README.md, docs/serving.md and benchmarks/README.md say of them,
figure for figure. The first run's other figures are tests/test_serving_benchmark.py's; the README's
per-shape table is tests/test_ahead_of_triton_records.py's."""

import json
import pathlib
import tarfile

from benchmarks import profile_determinism, real_server

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOGS = ROOT / "benchmarks" / "logs"
QWEN = LOGS / "serving_h200_qwen2.5-7b"
PROFILE = LOGS / "profile_h200_qwen2.5-7b" / "profile.json"
GRANITE_SECOND = LOGS / "serving_h200_granite" / "second_run.json"
TOP_README = (ROOT / "README.md").read_text()
SERVING_DOC = (ROOT / "docs" / "serving.md").read_text()
BENCH_README = (ROOT / "benchmarks" / "README.md").read_text()


def table_after(text, heading):
    """{first cell: the other cells} of the first markdown table from the line starting with `heading` on."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))  # the heading may be the header
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


def setups(path):
    return {s["setup"]: s for s in json.loads(path.read_text())["setups"]}


def tok(value):
    return f"{round(value):,}"


def pair(a, b, digits):
    return f"{a:.{digits}f} / {b:.{digits}f} s"


def verified(entry):
    passes = [p for w in entry.get("verify", {}).get("workloads", {}).values() for p in w["passes"].values()]
    if not passes:
        return "not checked"
    return f"{sum(p['identical'] for p in passes)}/{sum(p['requests'] for p in passes)} identical"


QWEN_LABELS = {
    "plugin-256-defaults": ("**plugin, chunk 256, radix (the defaults)**",
                            "plugin, chunk 256, radix cache, the plugin's defaults"),
    "stock-4096": ("stock deterministic flashinfer, 4096 (radix off)",
                   "stock deterministic flashinfer, chunk 4096 (radix forced off)"),
    "triton-256": ("stock deterministic triton, 256, radix", "stock deterministic triton, chunk 256, radix cache"),
    "nondet-256": ("non-deterministic flashinfer, 256, radix (the ceiling)",
                   "non-deterministic flashinfer, chunk 256, radix cache"),
}


def test_every_qwen_setup_ran_sampled_as_rl_and_each_deterministic_one_is_identical():
    """The run the tables rest on: all four setups timed, each deterministic one 48/48 identical
    against its own backend's recorded reference, with radix hits where the radix cache is on."""
    recorded = setups(QWEN / "serving.json")
    assert set(recorded) == set(QWEN_LABELS)
    for name, entry in recorded.items():
        assert "error" not in entry and all(n == 8 for n in entry["workloads"]["rl"]["distinct_samples_per_group"])
        if name == "nondet-256":
            assert "verify" not in entry
            continue
        assert entry["verify_ok"] is True and verified(entry) == "48/48 identical", name
        cached = [p["cached_tokens_total"] for w in entry["verify"]["workloads"].values() for p in w["passes"].values()]
        assert all(c > 0 for c in cached) == (name != "stock-4096"), name
        assert entry["verify_command"].split("--recorded ")[1].split()[0].endswith(
            "baseline-triton.json" if name == "triton-256" else "baseline-flashinfer.json")


def test_the_serving_docs_qwen_table_is_the_record():
    """docs/serving.md: throughput, ratios to stock and triton for the plugin, the longest gaps."""
    recorded, rows = setups(QWEN / "serving.json"), table_after(SERVING_DOC, "| setup, Qwen2.5-7B's shape")
    plugin = recorded["plugin-256-defaults"]["workloads"]
    for name, (label, _) in QWEN_LABELS.items():
        cells, w = rows[label], recorded[name]["workloads"]
        for cell, workload in zip(cells, ("rl", "agent")):
            assert cell.strip("*").startswith(tok(w[workload]["output_tok_s"])), (label, workload)
        if name == "plugin-256-defaults":
            for cell, workload in zip(cells, ("rl", "agent")):
                stock, triton = (recorded[b]["workloads"][workload]["output_tok_s"] for b in ("stock-4096", "triton-256"))
                assert f"({plugin[workload]['output_tok_s'] / stock:.2f}x, {plugin[workload]['output_tok_s'] / triton:.2f}x)" in cell
        gaps = cells[2].removesuffix(" s").split(" / ")
        for shown, workload in zip(gaps, ("rl", "agent")):
            digits = len(shown.partition(".")[2])
            assert float(shown) == round(w[workload]["itl_max_s"], digits), (label, workload)


def test_benchmarks_readme_qwen_table_is_the_record():
    recorded, rows = setups(QWEN / "serving.json"), table_after(BENCH_README, "### The second shape: Qwen2.5-7B's")
    for name, (_, label) in QWEN_LABELS.items():
        cells, w = rows[label], recorded[name]["workloads"]
        assert cells[:2] == [tok(w["rl"]["output_tok_s"]), tok(w["agent"]["output_tok_s"])], label
        assert cells[2] == pair(w["rl"]["itl_max_s"], w["agent"]["itl_max_s"], 2), label
        assert cells[3] == pair(w["rl"]["itl_p50_s"], w["agent"]["itl_p50_s"], 3), label
        assert cells[4] == pair(w["rl"]["ttft_p50_s"], w["agent"]["ttft_p50_s"], 2), label
        assert cells[5] == verified(recorded[name]), label
    plugin = recorded["plugin-256-defaults"]["workloads"]
    said = ", ".join(" / ".join(f"{plugin[w]['output_tok_s'] / recorded[base]['workloads'][w]['output_tok_s']:.2f}x"
                                for w in ("rl", "agent")) + f" {alternative}"
                     for base, alternative in (("stock-4096", "stock deterministic flashinfer"),
                                               ("triton-256", "deterministic triton"),
                                               ("nondet-256", "non-deterministic flashinfer")))
    assert f"The plugin's defaults against each, in the same run (rl / agent): {said}." in " ".join(BENCH_README.split())


def test_granites_second_run_table_and_cost_are_the_record():
    recorded = setups(GRANITE_SECOND)
    rows = table_after(BENCH_README, "### Granite's second run")
    for name, label in (("plugin-256-defaults", "plugin, chunk 256, radix cache, the plugin's defaults"),
                        ("nondet-256", "non-deterministic flashinfer, chunk 256, radix cache")):
        cells, w = rows[label], recorded[name]["workloads"]
        assert cells[:2] == [tok(w["rl"]["output_tok_s"]), tok(w["agent"]["output_tok_s"])], label
        assert cells[2] == pair(w["rl"]["itl_max_s"], w["agent"]["itl_max_s"], 2), label
        assert cells[3] == pair(w["rl"]["ttft_p50_s"], w["agent"]["ttft_p50_s"], 2), label
        assert cells[4] == verified(recorded[name]), label
    plugin, ceiling = recorded["plugin-256-defaults"]["workloads"], recorded["nondet-256"]["workloads"]
    cost = [ceiling[w]["output_tok_s"] / plugin[w]["output_tok_s"] for w in ("rl", "agent")]
    assert f"Determinism costs {cost[0]:.2f}x on rollouts and {cost[1]:.2f}x on agents here" in BENCH_README
    assert recorded["plugin-256-defaults"]["env"] == {"SGLANG_PLUGINS": "chunk_align"}


def qwen_server_log(name):
    with tarfile.open(QWEN / "server_logs.tgz") as logs:
        return logs.extractfile(f"qwen-logs/{name}.log").read().decode()


def prefill_batches(name):
    """[(new tokens, whether a CUDA graph replayed it)] of the 'Prefill batch' lines in a Qwen server's log."""
    return [(int(tokens), graph == "True") for tokens, _, graph in real_server.PREFILL_LINE.findall(qwen_server_log(name))]


def prefill_steps(name):
    """(steps, tokens) of the 'Prefill batch' lines in a Qwen server's log, as serving.json now records them."""
    counted = real_server.prefill_steps(qwen_server_log(name))
    return counted["steps"], counted["new_tokens"]


def test_the_prefill_graph_replays_the_docs_give_are_the_server_logs():
    said = " ".join(BENCH_README.split())
    for name, who in (("plugin-256-defaults", "the plugin's"), ("triton-256", "triton's"),
                      ("nondet-256", "non-deterministic flashinfer's")):
        batches = prefill_batches(name)
        assert f"{sum(graph for _, graph in batches)} of {who} {len(batches)}" in said
        assert {tokens for tokens, graph in batches if not graph} == {1}  # "the steps that did not are 1-token extends"


def test_the_prefill_step_counts_the_docs_give_are_the_server_logs():
    (plugin, plugin_tokens), (triton, triton_tokens) = prefill_steps("plugin-256-defaults"), prefill_steps("triton-256")
    assert f"{plugin} steps of {plugin_tokens:,} tokens for the plugin, {triton} of {triton_tokens:,}" in " ".join(
        BENCH_README.split())
    assert f"ran {plugin / triton - 1:.0%} more prefill steps over the server's life ({plugin} against {triton})" in " ".join(
        SERVING_DOC.split())


PROFILE_LABELS = {"plugin-256-defaults": "plugin (deterministic flashinfer)",
                  "nondet-256": "non-deterministic flashinfer", "triton-256": "deterministic triton"}


def test_the_profile_table_is_the_record():
    """benchmarks/README.md's breakdown is profile.json's (which test_profile_determinism holds to
    what CATEGORIES make of its kernels today)."""
    profiled = setups(PROFILE)
    rows = table_after(BENCH_README, "## Where determinism's cost goes")
    for name, label in PROFILE_LABELS.items():
        for scenario, measured in (("decode", "itl_p50_s_unprofiled"), ("chunk", "ttft_p50_s_unprofiled")):
            result = profiled[name]["scenarios"][scenario]
            breakdown = result["breakdown_ms_per_step"]
            cells = rows[f"{scenario}, {label}"]
            keys = ("attention", "gemm", "norm", "sampling", "rest", "total")
            assert cells[:6] == [f"{breakdown[k]:.2f}" for k in keys], (name, scenario)
            assert cells[6].startswith(f"{result[measured] * 1000:.1f} ms"), (name, scenario)


def test_the_profile_recorded_what_it_says_it_profiled():
    """Each decode profile is of a step of the whole batch, each chunk profile of one chunk over the
    cached prefix, and deterministic GEMMs are the batch-invariant Triton kernel, cuBLAS's otherwise."""
    record = json.loads(PROFILE.read_text())
    assert record["workload"] == {"batch": 64, "context": 2048, "chunk_tokens": 256, "steps": 8}
    for name, entry in setups(PROFILE).items():
        chunk, decode = entry["scenarios"]["chunk"], entry["scenarios"]["decode"]
        assert chunk["cached_tokens"] == [2048]
        gemms = {k for k in decode["kernels"] if profile_determinism.category(k) == "gemm"}
        assert (gemms == {"matmul_kernel_persistent"}) == (name != "nondet-256"), name
        # one sampling softmax per decode step: 8 profiled steps
        softmax = [v["count"] for k, v in decode["kernels"].items() if "SoftMaxForward" in k]
        assert softmax == [8], name


def test_the_sentences_on_determinisms_cost_are_the_records():
    """The cost of determinism per shape (README.md and docs/serving.md), and where it goes (the doc)."""
    text = " ".join(SERVING_DOC.split())
    qwen, granite = setups(QWEN / "serving.json"), setups(GRANITE_SECOND)
    for recorded, said in ((qwen, "{:.1f}x on rollouts and {:.1f}x on agents on Qwen2.5-7B's shape"),
                           (granite, "{:.1f}x and {:.1f}x on Granite's")):
        cost = [recorded["nondet-256"]["workloads"][w]["output_tok_s"] /
                recorded["plugin-256-defaults"]["workloads"][w]["output_tok_s"] for w in ("rl", "agent")]
        for where in (text, " ".join(TOP_README.split())):
            assert said.format(*cost) in where
    decode = {s: e["scenarios"]["decode"]["breakdown_ms_per_step"] for s, e in setups(PROFILE).items()}
    det, nondet = decode["plugin-256-defaults"], decode["nondet-256"]
    assert (f"took {det['gemm']:.1f} ms of a {det['total']:.1f} ms decode step (64 requests, 2k tokens of context "
            f"each) against cuBLAS's {nondet['gemm']:.1f} ms of {nondet['total']:.1f} ms, while attention took the "
            f"same ({det['attention']:.1f} against {nondet['attention']:.1f} ms)") in text
    assert f"a decode step {det['total']:.1f} ms of GPU time against triton's {decode['triton-256']['total']:.1f}" in text


def test_each_cited_runs_first_timed_setup_is_named():
    """Each run's first timed setup met SGLang's seeded sampler uncompiled in its rollouts (serving.warm_up
    says why, and now warms it): the README names it for every run its table cites (Granite's first run,
    issue 48's Qwen run, call6's stock ops in the GEMM bullet), and docs/serving.md sets call7's defaults,
    timed first, beside call6's, timed second."""
    readme, doc = " ".join(TOP_README.split()), " ".join(SERVING_DOC.split())
    first = {run: json.loads((LOGS / run / "serving.json").read_text())["setups"][0]["setup"]
             for run in ("serving_h200_qwen2.5-7b", "serving_h200_granite", "gemms_h200/call6", "gemms_h200/call7",
                         "ahead_of_triton/qwen2.5-7b-fi074")}
    assert first == {"serving_h200_qwen2.5-7b": "plugin-256-defaults", "serving_h200_granite": "stock-4096",
                     "gemms_h200/call6": "plugin-256-stock-ops", "gemms_h200/call7": "plugin-256-defaults",
                     "ahead_of_triton/qwen2.5-7b-fi074": "plugin-256-defaults"}
    assert "stock flashinfer, timed first, met SGLang's seeded sampler uncompiled, so 2.05x over it is high" in readme
    assert "The defaults were timed first" in readme and "(1.81x the rollouts, high: timed first;" in readme
    assert "Granite's stock deterministic flashinfer and Qwen's plugin defaults here" in doc
    first_rl, second_rl = (setups(LOGS / f"gemms_h200/{run}/serving.json")["plugin-256-defaults"]["workloads"]["rl"]
                           for run in ("call7", "call6"))
    assert (f"the same defaults first (call7) and second (call6, `benchmarks/logs/gemms_h200/COMMANDS.md`): "
            f"{tok(first_rl['output_tok_s'])} against {tok(second_rl['output_tok_s'])} rollout tok/s, a median first "
            f"token of {first_rl['ttft_p50_s']:.2f} s against {second_rl['ttft_p50_s']:.2f} s") in doc
