"""Issue 34's H200 records (benchmarks/logs/model_families_h200/) against what README.md and
benchmarks/README.md say of them, figure for figure: Qwen3-8B, the Mamba2 kernel probe, the Mamba2
hybrids' servers, and the MoE's reference."""

import json
import pathlib
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "logs" / "model_families_h200"
README = " ".join((ROOT / "README.md").read_text().split())
BENCH_README = " ".join((ROOT / "benchmarks" / "README.md").read_text().split())
MAMBA_LINE = "256-token linear-attention kernel chunks: one request per prefill batch"


def servers(path):
    return {s["name"]: s for s in json.loads((RECORDS / path).read_text())["servers"]}


def identical(server):
    """(identical, requests, cached tokens) over every pass of every workload."""
    passes = [p for w in server["verify"]["workloads"].values() for p in w["passes"].values()]
    return (sum(p["identical"] for p in passes), sum(p["requests"] for p in passes),
            sum(p["cached_tokens_total"] for p in passes))


def test_qwen3_8b_was_identical_per_server_with_radix_hits():
    recorded = servers("call1/qwen3-8b.json")
    for chunk in (128, 256):
        server = recorded[f"plugin-chunk{chunk}-page1-radixon"]
        same, requests, cached = identical(server)
        assert server["ok"] and same == requests == 72 and cached > 0
        assert "grid rules on: 32-token grid" in server["plugin_lines"][0]
    assert "| Qwen3 (dense) | Qwen3-8B: GQA 4, head_dim 128 | 128, 256 | on | 72 of 72 identical per server" in README


def test_the_mamba2_probe_is_what_both_readmes_say():
    probe = json.loads((RECORDS / "call2/probe_mamba2.json").read_text())
    summary = {key: (row["identical"], row["cases"]) for key, row in probe["summary"].items()}
    assert summary == {
        "batched after 100 tokens": (0, 9), "batched after 256 tokens": (9, 9),
        "chunked cut at 128": (0, 9), "chunked cut at 256": (9, 9), "chunked cut at 512": (9, 9),
    }
    assert probe["shape"]["chunk"] == 256 and probe["versions"]["sglang"] == "0.5.23"
    assert "| batched after a 100-token request (starts inside a kernel chunk) | 0 of 9 | 0.5 |" in BENCH_README
    assert "| chunked at 256 | 9 of 9 | 0 |" in BENCH_README
    assert "identical to its solo scan in 0 of 9 cases, and in 9 of 9 after one ending on a kernel chunk" in README


def test_the_granite_4_h_servers_were_exact_one_request_a_prefill_batch_and_refused_128():
    recorded = servers("call2/granite-4.0-h-micro.json")
    for chunk in (256, 512):
        server = recorded[f"plugin-chunk{chunk}-page1-radixdefault"]
        same, requests, cached = identical(server)
        assert server["ok"] and same == requests == 72 and cached == 0
        line = server["plugin_lines"][0]
        assert MAMBA_LINE in line and "radix cache off, as stock (a mamba prefix cache" in line
        assert "SGLANG_CHUNK_ALIGN_RADIX_CACHE" not in server["env"]
    refused = recorded["plugin-chunk128-page1-radixdefault"]
    assert not refused["ok"] and "Raise --chunked-prefill-size to at least 256" in refused["error"]
    assert "72 of 72 identical per server, one request per prefill batch" in README


def test_the_plugin_never_batched_two_prefills_where_stock_did():
    """The servers' own logs (logs.tgz): stock's reference co-batched prefills, the plugin never."""
    with tarfile.open(RECORDS / "call2/logs.tgz") as archive:
        logs = {pathlib.Path(m.name).name: archive.extractfile(m).read().decode()
                for m in archive.getmembers() if m.name.startswith("m34b/granite-4.0-h-micro-logs/") and m.isfile()}
    most = {name: max((int(line.split("#new-seq: ")[1].split(",")[0]) for line in log.splitlines()
                       if "Prefill batch" in line), default=0) for name, log in logs.items()}
    assert most["reference-page1.log"] == 7
    assert most["plugin-chunk256-page1-radixdefault.log"] == most["plugin-chunk512-page1-radixdefault.log"] == 1
    assert most["plugin-chunk128-page1-radixdefault.log"] == 0  # refused at startup
    assert "the plugin's servers every one of theirs (378 and 216) with one" in BENCH_README


def test_nemotron_h_and_the_moe_started_and_their_references_matched_themselves():
    for path in ("call1/nemotron-h-8b.json", "call2/nemotron-h-8b.json", "call2/qwen3-30b-a3b.json"):
        reference = servers(path)["reference-page1"]
        assert reference["ok"] and identical(reference)[:2] == (72, 72), path
    refused = servers("call1/nemotron-h-8b.json")["plugin-chunk128-page1-radixdefault"]
    assert "Raise --chunked-prefill-size to at least 256" in refused["error"] and MAMBA_LINE in refused["plugin_lines"][0]
    assert not any(name.startswith("plugin") for name in servers("call2/qwen3-30b-a3b.json"))
    assert "its stock reference identical to itself, 72 of 72; the plugin not run (device time)" in README
