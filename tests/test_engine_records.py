"""Issue 33's H200 records (benchmarks/logs/engine_h200/) against what README.md and
docs/deployments.md say of them, figure for figure: the in-process check, the RL cycle, and
flashinfer 0.7.4 in real servers."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "logs" / "engine_h200"
README = " ".join((ROOT / "README.md").read_text().split())
DEPLOYMENTS = " ".join((ROOT / "docs" / "deployments.md").read_text().split())
BENCH_README = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())


def load(path):
    return json.loads((RECORDS / path).read_text())


def passes(report):
    return [p for w in report["workloads"].values() for p in w["passes"].values()]


def test_the_in_process_check_found_every_request_identical_with_radix_hits():
    cycle, reference = load("run2/cycle.json"), load("run2/reference_run.json")
    assert reference["ok"] and reference["role"] == "reference" and "--record-reference" in reference["argv"]
    check = cycle["verify"]
    assert check["ok"] and check["baseline"] == "recorded" and check["chunked_vs_unchunked_checked"]
    identical, requests = sum(p["identical"] for p in passes(check)), sum(p["requests"] for p in passes(check))
    assert identical == requests == 96 and sum(p["cached_tokens_total"] for p in passes(check)) > 0
    assert cycle["versions"]["flashinfer-python"] == "0.7.2" and "--chunk" not in cycle["argv"]  # the default, 256
    assert f"all {identical} requests ({requests // 2}, in two passes) were identical" in README
    assert f"`verify_engine`, {identical} of {requests} identical" in DEPLOYMENTS


def test_the_first_cycle_failed_for_the_reason_the_records_give():
    cycle = load("run2/cycle.json")["cycle"]
    assert {min(s["distinct_samples_per_group"]) for s in cycle["steps"]} == {1}
    assert cycle["rollouts_changed_by_the_update"] == 0
    assert [s.get("identical_to_first_run") for s in cycle["steps"]] == [None, None, 32, 32]


def test_the_cycle_on_flashinfer_074_is_what_the_readme_says():
    record = load("run3/cycle_alone.json")
    cycle = record["cycle"]
    assert record["ok"] and record["versions"]["flashinfer-python"] == "0.7.4" and "--no-memory-saver" not in record["argv"]
    samples = cycle["requests_per_step"] // len(cycle["prompt_tokens"])
    assert all(set(s["distinct_samples_per_group"]) == {samples} for s in cycle["steps"])
    assert cycle["rollouts_changed_by_the_update"] == cycle["requests_per_step"] == 32
    replays = [s["identical_to_first_run"] for s in cycle["steps"] if "identical_to_first_run" in s]
    assert replays == [32, 32]
    assert f"every replay was identical, 32 of 32 for each policy, and the seeds gave every group {samples} distinct samples" in README


def test_flashinfer_074_servers_are_what_the_deployments_doc_says():
    record = load("run3/fi074_granite.json")
    assert record["stack"]["flashinfer-python"] == "0.7.4"
    plugins = [s for s in record["servers"] if s["name"].startswith("plugin")]
    assert sorted(s["chunk"] for s in plugins) == [128, 256] and {s["radix"] for s in plugins} == {"on"}
    for server in plugins:
        assert server["ok"] and "flashinfer 0.7.4 kernel facts" in server["plugin_lines"][0]
        checked = passes(server["verify"])
        assert sum(p["identical"] for p in checked) == sum(p["requests"] for p in checked) == 72
        assert sum(p["cached_tokens_total"] for p in checked) > 0
    assert "72 of 72 requests identical per server" in DEPLOYMENTS


def test_the_one_token_grid_of_074_kept_more_of_the_same_prompts_radix_hits_than_072s():
    def cached(record, name):
        server = next(s for s in json.loads(record.read_text())["servers"] if s["name"] == name)
        return {w: server["verify"]["workloads"][w]["passes"]["sequential"]["cached_tokens_total"] for w in ("mixed", "chat")}, \
            server["verify"]["workloads"]["mixed"]["prompt_tokens"]

    name = "plugin-chunk256-page1-radixon"
    new, prompts = cached(RECORDS / "run3" / "fi074_granite.json", name)
    old, same_prompts = cached(ROOT / "benchmarks" / "logs" / "real_server_h200" / "granite-3.1-8b" / "page1.json", name)
    assert prompts == same_prompts and new["mixed"] > old["mixed"] and new["chat"] > old["chat"]
    assert (f"reused {new['mixed']:,} and {new['chat']:,} cached tokens per mixed and chat pass where 0.7.2's "
            f"128-token grid kept {old['mixed']:,} and {old['chat']:,}") in BENCH_README
