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
    cumulative output_ids and meta_info per token; prompts longer than `limit` get a 400. As
    deterministic SGLang samples: greedy at temperature 0, else by sampling_seed (42 where the
    request names none), so requests alike but for their seed differ. Every request's path and
    sampling params are kept in `seen`, /flush_cache's too."""

    limit = 10**9
    seen = []

    def do_POST(self):
        if self.path.startswith("/flush_cache"):
            self.seen.append(("/flush_cache", None))
            self.send_response(200)
            self.end_headers()
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, params = body["input_ids"], body["sampling_params"]
        self.seen.append(("/generate", params))
        if len(prompt) > self.limit:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "too long"}}')
            return
        self.send_response(200)
        self.end_headers()
        seed = params.get("sampling_seed", 42) if params.get("temperature") else 0
        for n in range(1, params["max_new_tokens"] + 1):
            meta = {"completion_tokens": n, "prompt_tokens": len(prompt), "cached_tokens": len(prompt) // 2}
            output = [seed + i for i in range(n)]
            self.wfile.write(b"data: " + json.dumps({"output_ids": output, "meta_info": meta}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    Streaming.seen = []
    http = ThreadingHTTPServer(("127.0.0.1", 0), Streaming)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = SimpleNamespace(url=f"http://127.0.0.1:{http.server_port}", process=SimpleNamespace(poll=lambda: None),
                             log=lambda: "")
    server.wait_ready = lambda timeout=5: real_server.Server.wait_ready(server, timeout)  # its /health, for real
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


def test_rollouts_sample_as_rl_each_sample_with_its_own_seed(stand_in):
    result = serving.rl(stand_in, small_run(), seed=0)
    params = [p for _, p in Streaming.seen]
    assert all(p["temperature"] == 1.0 for p in params)
    assert sorted(p["sampling_seed"] for p in params) == list(range(6))
    assert result["distinct_samples_per_group"] == [2, 2, 2]
    assert serving.alike_groups({"workloads": {"rl": result}}) == 0


def test_groups_whose_samples_come_back_alike_are_counted_in_every_round(stand_in, monkeypatch):
    """A server (or a benchmark) that ignores the seeds: each such group counts, repeats included."""
    real_stream = serving.stream
    monkeypatch.setattr(serving, "stream", lambda url, ids, tokens, **sampling: real_stream(url, ids, tokens))
    result = serving.rl(stand_in, small_run(), seed=0)
    assert result["distinct_samples_per_group"] == [1, 1, 1]
    assert serving.alike_groups({"workloads": {"rl": result}, "repeats": [{"rl": result}]}) == 6


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


def serving_run(tmp_path, **args):
    """A ServingRun over Granite's config, as main() builds it, for one setup's timing."""
    defaults = dict(model_path="benchmarks/models/granite-3.1-8b", logs=str(tmp_path), out=str(tmp_path / "s.json"),
                    port=0, deadline_s=60, extra=[], workloads="rl,agent", groups=2, samples=2, conversations=2,
                    turns=2, repeats=3, repeat_setups="plugin-256")
    return serving.ServingRun(SimpleNamespace(**{**defaults, **args}))


def test_a_repeated_setup_runs_every_round_cold_after_a_flush(stand_in, tmp_path):
    """The decode wait's rounds: the same requests each time, never served from the last round's cache."""
    stand_in.plugin_lines = lambda: []
    stand_in.describe = lambda: {}
    entry = serving_run(tmp_path)._time("plugin-256", stand_in)
    assert [set(r) for r in [entry["workloads"], *entry["repeats"]]] == [{"rl", "agent"}] * 3
    assert entry["repeats"][1]["rl"]["prompt_tokens"] == entry["workloads"]["rl"]["prompt_tokens"]
    paths = [path for path, _ in Streaming.seen]
    rounds = len(paths) - paths.count("/flush_cache")
    per_round = paths.index("/flush_cache") - 5 - 2  # after the warm-up's five requests and two turns
    assert paths.count("/flush_cache") == 2 and rounds == 7 + 3 * per_round
    assert [i for i, p in enumerate(paths) if p == "/flush_cache"] == [7 + per_round, 8 + 2 * per_round]
    assert "repeats" not in serving_run(tmp_path)._time("stock-4096", stand_in)


def timed(name, rounds):
    """A setup's record: per round, per workload, (output tok/s, longest gap s)."""
    workloads = [{w: {"output_tok_s": tok, "itl_max_s": gap} for w, (tok, gap) in r.items()} for r in rounds]
    return {"setup": name, "workloads": workloads[0], "repeats": workloads[1:]}


@pytest.mark.parametrize("wait_rl, wait_gap, keep", [
    ((975, 1000, 990), 0.2, True),     # median 990 against 1000: 1% cost
    ((975, 970, 960), 0.2, True),      # median 970: 3% cost, the most allowed
    ((969, 1000, 960), 0.2, False),    # median 969: 3.1%
    ((1000, 1000, 1000), 0.31, False),  # free, but its longest gap is over the bound
])
def test_the_decode_wait_stays_the_default_only_within_its_cost_and_gap_bound(wait_rl, wait_gap, keep):
    control = timed("plugin-256-no-wait", [{"rl": (1000, 3.0), "agent": (200, 1.0)}] * 3)
    wait = timed("plugin-256", [{"rl": (tok, wait_gap), "agent": (200, 0.1)} for tok in wait_rl])
    verdict = serving.decode_wait_verdict([control, wait, timed("stock-4096", [{"rl": (1, 1)}])])
    assert verdict["workloads"]["rl"]["cost"] == pytest.approx(1 - sorted(wait_rl)[1] / 1000)
    assert verdict["workloads"]["rl"]["itl_max_s_control"] == 3.0 and verdict["workloads"]["agent"]["cost"] == 0
    assert verdict["keep_default"] is keep


def test_no_decode_wait_verdict_without_its_control():
    assert serving.decode_wait_verdict([timed("plugin-256", [{"rl": (1000, 0.1)}])]) is None


def test_a_setup_is_verified_against_its_references_recorded_answers_alone(tmp_path):
    """The reference records its cold answers, then stops (a long prompt may end it): each setup is
    verified against the file alone, and a wrong setup is caught there."""
    from test_verify import VOCAB, StandIn

    def started(**faults):
        http = StandIn(**faults)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        return SimpleNamespace(url=f"http://127.0.0.1:{http.server_port}", http=http, describe=lambda: {})

    run = SimpleNamespace(args=SimpleNamespace(prompts=4, dummy=True), config={"vocab_size": VOCAB})
    cache = str(tmp_path / "baseline-flashinfer.json")
    reference = started()
    assert real_server.verify(run, reference, reference, cache, radix=False)["ok"] is True
    reference.http.shutdown()
    check = real_server.verify(run, started(), None, cache, radix=True)
    assert check["ok"] is True and f"--recorded {cache}" in check["verify_command"]
    wrong = started(perturb=lambda request: ("output_id", 0))
    assert real_server.verify(run, wrong, None, cache, radix=True)["ok"] is False
