"""Issue 34's H200 records (benchmarks/logs/model_families_h200/) against what docs/model-families.md
and benchmarks/README.md say of them, figure for figure: Qwen3-8B and Llama-3.1-8B, the MoE, the Mamba2
kernel probe, and the Mamba2 hybrids' servers."""

import json
import pathlib
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "logs" / "model_families_h200"
FAMILIES_LINES = (ROOT / "docs" / "model-families.md").read_text().splitlines()
FAMILIES = " ".join(" ".join(FAMILIES_LINES).split())
BENCH_README = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
MAMBA_LINE = "256-token linear-attention kernel chunks: one request per prefill batch"


def servers(path):
    return {s["name"]: s for s in json.loads((RECORDS / path).read_text())["servers"]}


def identical(server):
    """(identical, requests, cached tokens) over every pass of every workload."""
    passes = [p for w in server["verify"]["workloads"].values() for p in w["passes"].values()]
    return (sum(p["identical"] for p in passes), sum(p["requests"] for p in passes),
            sum(p["cached_tokens_total"] for p in passes))


def new_requests_per_prefill_batch(call, model):
    """Each server's log in the call's logs.tgz: the new requests of every prefill batch it ran."""
    with tarfile.open(RECORDS / call / "logs.tgz") as archive:  # RUN/MODEL-logs/SERVER.log
        logs = {path.name: archive.extractfile(m).read().decode() for m in archive.getmembers()
                if m.isfile() and (path := pathlib.PurePath(m.name)).parent.name == f"{model}-logs"
                and path.suffix == ".log"}
    return {name: [int(line.split("#new-seq: ")[1].split(",")[0]) for line in log.splitlines()
                   if "Prefill batch" in line] for name, log in logs.items()}


@pytest.mark.parametrize("path, row", [
    ("call1/qwen3-8b.json", "| Qwen3 (dense) | Qwen3-8B: GQA 4, head_dim 128 | 128, 256 | on | 72 of 72 identical per server, with radix hits | `logs/model_families_h200/call1` |"),
    ("call3/llama-3.1-8b.json", "| Llama-3.1 (dense) | Llama-3.1-8B: GQA 4, head_dim 128 | 128, 256 | on | 72 of 72 identical per server, with radix hits | `logs/model_families_h200/call3` |"),
])
def test_the_dense_families_were_identical_per_server_with_radix_hits(path, row):
    recorded = servers(path)
    for chunk in (128, 256):
        server = recorded[f"plugin-chunk{chunk}-page1-radixon"]
        same, requests, cached = identical(server)
        assert server["ok"] and same == requests == 72 and cached > 0
        assert "grid rules on: 32-token grid" in server["plugin_lines"][0]
    assert row in FAMILIES


def test_the_moe_was_identical_against_its_recorded_reference_with_radix_hits():
    recorded = servers("call3/qwen3-30b-a3b.json")
    server = recorded["plugin-chunk256-page1-radixon"]
    same, requests, cached = identical(server)
    assert server["ok"] and same == requests == 72 and cached == 27520
    assert "--recorded" in server["verify_command"]  # one model on the GPU at a time
    assert "grid rules on: 16-token grid, pieces over 8 tokens (GQA group 8" in server["plugin_lines"][0]
    assert "| 256 | on | 72 of 72 identical, with radix hits | `logs/model_families_h200/call3` |" in FAMILIES
    assert "the plugin at chunk 256, radix on, checked against them: 72 of 72 identical" in BENCH_README


def test_the_mamba2_probe_is_what_the_docs_say():
    probe = json.loads((RECORDS / "call2/probe_mamba2.json").read_text())
    summary = {key: (row["identical"], row["cases"]) for key, row in probe["summary"].items()}
    assert summary == {
        "batched after 100 tokens": (0, 9), "batched after 256 tokens": (9, 9),
        "chunked cut at 128": (0, 9), "chunked cut at 256": (9, 9), "chunked cut at 512": (9, 9),
    }
    assert probe["shape"]["chunk"] == 256 and probe["versions"]["sglang"] == "0.5.23"
    assert "| batched after a 100-token request (starts inside a kernel chunk) | 0 of 9 | 0.5 |" in BENCH_README
    assert "| chunked at 256 | 9 of 9 | 0 |" in BENCH_README
    assert "identical to its solo scan in 0 of 9 cases, and in 9 of 9 after one ending on a kernel chunk" in FAMILIES


@pytest.mark.parametrize("served, refused, name", [
    ("call2/granite-4.0-h-micro.json", "call2/granite-4.0-h-micro.json", "Granite-4.0-H-Micro"),
    ("call3/nemotron-h-8b.json", "call1/nemotron-h-8b.json", "Nemotron-H-8B"),
])
def test_the_hybrids_were_exact_one_request_a_prefill_batch_and_refused_128(served, refused, name):
    recorded = servers(served)
    for chunk in (256, 512):
        server = recorded[f"plugin-chunk{chunk}-page1-radixdefault"]
        same, requests, cached = identical(server)
        assert server["ok"] and same == requests == 72 and cached == 0
        line = server["plugin_lines"][0]
        assert MAMBA_LINE in line and "radix cache off, as stock (a mamba prefix cache" in line
        assert "SGLANG_CHUNK_ALIGN_RADIX_CACHE" not in server["env"]
    refusal = servers(refused)["plugin-chunk128-page1-radixdefault"]
    assert not refusal["ok"] and "Raise --chunked-prefill-size to at least 256" in refusal["error"]
    assert MAMBA_LINE in refusal["plugin_lines"][0]
    row = next(line for line in FAMILIES_LINES if f"| hybrid, Mamba2 | {name}" in line)
    assert "| 256, 512; 128 refused at startup |" in row and "72 of 72 identical per server, one request per prefill batch" in row


@pytest.mark.parametrize("call, model, batches", [
    ("call2", "granite-4.0-h-micro", (378, 216)), ("call3", "nemotron-h-8b", (366, 208)),
])
def test_the_plugin_never_batched_two_prefills_where_stock_did(call, model, batches):
    """The servers' own logs: stock's reference co-batched prefills, the plugin's servers never."""
    logs = new_requests_per_prefill_batch(call, model)
    reference = logs["reference-page1.log"]
    assert max(reference) == 7 and sum(n > 1 for n in reference) == 8 and len(reference) == 90
    plugin = [logs[f"plugin-chunk{chunk}-page1-radixdefault.log"] for chunk in (256, 512)]
    assert [max(counts) for counts in plugin] == [1, 1] and tuple(map(len, plugin)) == batches
    assert ("ran 8 of its 90 prefill batches with several new requests (up to 7), the plugin's servers every one"
            f" of theirs ({batches[0]} and {batches[1]}) with one") in BENCH_README


def test_every_reference_matched_itself():
    for path in ("call1/nemotron-h-8b.json", "call2/nemotron-h-8b.json", "call3/nemotron-h-8b.json",
                 "call2/qwen3-30b-a3b.json", "call3/qwen3-30b-a3b.json", "call1/qwen3-8b.json",
                 "call3/llama-3.1-8b.json"):
        reference = servers(path)["reference-page1"]
        assert reference["ok"] and identical(reference)[:2] == (72, 72), path
