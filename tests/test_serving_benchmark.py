"""benchmarks/serving.py on CPU: its workloads and long-prompt probe against a stand-in for
SGLang's streamed /generate (the servers themselves need a GPU), and the recorded H200 run."""

import json
import pathlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from benchmarks import real_server, serving, serving_plot

class Streaming(BaseHTTPRequestHandler):
    """SGLang's streamed /generate with --skip-tokenizer-init, as far as the benchmark reads it:
    cumulative output_ids and meta_info per token; prompts longer than `limit` get a 400."""

    limit = 10**9

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, tokens = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if len(prompt) > self.limit:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "too long"}}')
            return
        self.send_response(200)
        self.end_headers()
        for n in range(1, tokens + 1):
            meta = {"completion_tokens": n, "prompt_tokens": len(prompt), "cached_tokens": len(prompt) // 2}
            self.wfile.write(b"data: " + json.dumps({"output_ids": list(range(n)), "meta_info": meta}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    http = ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = SimpleNamespace(url=f"http://127.0.0.1:{http.server_port}", process=SimpleNamespace(poll=lambda: None),
                             log=lambda: "")
    server.wait_ready = lambda timeout: real_server.Server.wait_ready(server, timeout)  # its /health, for real
    yield server
    http.shutdown()


def small_run():
    args = SimpleNamespace(groups=3, samples=2, conversations=2, turns=3)
    return SimpleNamespace(args=args, config={"vocab_size": 1000})


def test_rl_sends_every_sample_and_counts_what_came_back(stand_in):
    result = serving.rl(stand_in, small_run(), seed=0)
    assert result["requests"] == 6
    assert 6 * 128 <= result["output_tokens"] <= 6 * 512
    assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["wall_s"], rel=0.01)
    assert result["prompt_tokens"] // 2 - 6 <= result["cached_tokens"] <= result["prompt_tokens"] // 2
    assert result["itl_p50_s"] <= result["itl_p99_s"] <= result["itl_max_s"]


def test_agent_turns_append_the_answer_and_a_tool_output(stand_in):
    result = serving.agent(stand_in, small_run(), seed=0)
    assert result["requests"] == 2 * 3
    # The third turn holds the first prompt, two answers of 128 and two tool outputs of 800 or more.
    assert result["longest_prompt_tokens"] >= 1500 + 300 + 2 * (128 + 800)


def test_the_same_seed_sends_the_same_workload(stand_in):
    """Setups are compared on identical requests."""
    assert serving.rl(stand_in, small_run(), 0)["prompt_tokens"] == serving.rl(stand_in, small_run(), 0)["prompt_tokens"]
    assert serving.rl(stand_in, small_run(), 0)["prompt_tokens"] != serving.rl(stand_in, small_run(), 1)["prompt_tokens"]


def test_long_prompts_stop_at_the_first_refusal(stand_in):
    Streaming.limit = 3000
    try:
        outcomes = serving.long_prompts(stand_in, (1000, 2000, 4000, 8000), small_run())
    finally:
        Streaming.limit = 10**9
    assert [o["outcome"] for o in outcomes] == ["served", "served", "refused"]
    assert "HTTP 400" in outcomes[-1]["detail"] and outcomes[-1]["server_alive_after"]


def test_a_stream_cut_short_is_an_error_not_a_measurement(stand_in):
    with pytest.raises(serving.RequestFailed, match="stream ended after"):
        original = Streaming.do_POST

        def short(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            meta = {"completion_tokens": 1, "prompt_tokens": len(body["input_ids"])}
            self.wfile.write(b"data: " + json.dumps({"output_ids": [0], "meta_info": meta}).encode() + b"\n\n")

        Streaming.do_POST = short
        try:
            serving.stream(stand_in.url, [1, 2, 3], 4)
        finally:
            Streaming.do_POST = original


README = pathlib.Path(serving.__file__).parent / "README.md"
ROWS = {"plugin, chunk 256, radix cache": "plugin-256",
        "stock deterministic flashinfer, chunk 4096 (radix forced off)": "stock-4096",
        "stock deterministic triton, chunk 256, radix cache": "triton-256",
        "non-deterministic flashinfer, chunk 256, radix cache (the ceiling)": "nondet-256"}
WORKLOADS = serving_plot.WORKLOADS
printed_setups = serving_plot.recorded_setups


def readme_row(label):
    return next(line for line in README.read_text().splitlines() if line.startswith(f"| {label} |")).split(" | ")


def test_the_readme_tables_are_the_recorded_runs_numbers():
    """Every throughput, longest gap and ratio in benchmarks/README.md's serving tables, from the record."""
    setups = printed_setups()
    assert [verify for verify, _ in setups.values()][:3] == [True, True, True]
    for label, name in ROWS.items():
        cells = readme_row(label)
        workloads = setups[name][1]
        assert [c.strip("*") for c in cells[1:5]] == [f"{round(workloads[w][1]):,}" for w in WORKLOADS], label
        gaps = cells[5].strip("*").removesuffix(" s").split(" / ")
        shown = [round(workloads[w][3], len(g.partition(".")[2])) for g, w in zip(gaps, WORKLOADS)]
        assert [float(g) for g in gaps] == shown, label
    plugin = setups["plugin-256"][1]
    for label, name in {"stock deterministic flashinfer, 4096": "stock-4096", "stock deterministic triton, 256":
                        "triton-256", "non-deterministic flashinfer, 256": "nondet-256"}.items():
        ratios = [cell.strip(" |") for cell in readme_row(label)[1:5]]
        assert ratios == [f"{plugin[w][1] / setups[name][1][w][1]:.2f}x" for w in WORKLOADS], label


def test_the_top_readmes_table_is_the_recorded_runs_numbers():
    """README.md, "Should I use this?": each workload's throughputs and ratios, and the longest gaps."""
    setups = {name: workloads for name, (_, workloads) in printed_setups().items()}
    order = ("plugin-256", "stock-4096", "triton-256", "nondet-256")
    lines = (README.parent.parent / "README.md").read_text().splitlines()
    for prefix, workload in (("| RL rollouts", "rl"), ("| agents", "agent"), ("| interactive", "interactive")):
        cells = next(line for line in lines if line.startswith(prefix)).split(" | ")[1:]
        numbers = [float(c.split()[0].strip("* |").replace(",", "")) for c in cells]
        assert numbers == [round(setups[name][workload][1]) for name in order], workload
        plugin = setups["plugin-256"][workload][1]
        ratios = [plugin / setups[name][workload][1] for name in order[1:3]]
        assert f"({ratios[0]:.2f}x, {ratios[1]:.2f}x)" in cells[0], workload
    gaps = next(line for line in lines if line.startswith("| longest wait")).split(" | ")[1:]
    assert [float(g.strip("* |").removesuffix(" s")) for g in gaps] == [
        round(max(setups[name][w][3] for w in WORKLOADS), 1 if name != "plugin-256" else 2) for name in order]


def test_the_plot_draws_every_setup_the_run_reached(tmp_path):
    """benchmarks/logs/serving_h200/serving_h200.png comes from the same lines; plugin-1024,
    which the run did not reach, is left out rather than drawn empty."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")
    setups = printed_setups()
    assert setups["plugin-1024"] == (None, {}) and len([s for s in setups.values() if s[1]]) == 4
    out = tmp_path / "serving.png"
    serving_plot.plot(setups, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
