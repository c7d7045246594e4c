"""benchmarks/serving.py on CPU: its workloads and long-prompt probe against a stand-in for
SGLang's streamed /generate (the servers themselves need a GPU), and the recorded H200 run."""

import ast
import json
import pathlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from benchmarks import random_checkpoint, real_server, serving, serving_plot
from sglang_chunk_align import decode_wait
from sglang_chunk_align.compat import DECODE_WAIT_ENV, SWITCHES

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
TOP_README = README.parent.parent / "README.md"
SERVING_DOC = README.parent.parent / "docs" / "serving.md"
RECORD = serving_plot.RECORD
EARLIER = README.parent / "logs" / "serving_h200" / "printed_call2.txt"


def row(text, label):
    """The cells after the first of the markdown table row that starts with `label`."""
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.strip(" |").split(" | ")][1:]


def number(cell):
    """The first number in a cell: '**2,667 tok/s** (1.81x, 1.72x)' -> 2667.0."""
    return float(cell.split()[0].strip("*").replace(",", ""))


def shown(cell, *values):
    """Whether a cell such as '0.30 / 0.15 s' shows `values`, each to the digits it is shown with."""
    parts = cell.strip("*").removesuffix(" s").split(" / ")
    return len(parts) == len(values) and all(
        float(part) == round(value, len(part.partition(".")[2])) for part, value in zip(parts, values))


# Each timed setup's row in docs/serving.md's table, then in benchmarks/README.md's.
ROW_LABELS = {
    "plugin-256-no-wait": ("**plugin, chunk 256, radix (the defaults)**",
                           "plugin, chunk 256, radix cache, decode wait off (the defaults)"),
    "plugin-256": ("plugin, chunk 256, radix, decode wait on", "plugin, chunk 256, radix cache, decode wait on"),
    "plugin-1024": ("plugin, chunk 1024, radix, decode wait on", "plugin, chunk 1024, radix cache, decode wait on"),
    "stock-4096": ("stock deterministic flashinfer, 4096 (radix off)",
                   "stock deterministic flashinfer, chunk 4096 (radix forced off)"),
    "triton-256": ("stock deterministic triton, 256, radix", "stock deterministic triton, chunk 256, radix cache"),
}


def ratio(a, b):
    return f"{a / b:.2f}x"


def test_the_serving_docs_table_is_the_recorded_runs_first_rounds():
    """docs/serving.md: each setup's throughput, its ratios to stock and triton, and its longest gaps."""
    setups, text = serving_plot.recorded_setups(), SERVING_DOC.read_text()
    for name, (label, _) in ROW_LABELS.items():
        cells, workloads = row(text, label), setups[name][1]
        for cell, w in zip(cells, serving_plot.WORKLOADS):
            assert number(cell) == round(workloads[w]["output_tok_s"]), (label, w)
            if name.startswith("plugin"):
                stock, triton = (setups[base][1][w]["output_tok_s"] for base in ("stock-4096", "triton-256"))
                tok_s = workloads[w]["output_tok_s"]
                assert f"({ratio(tok_s, stock)}, {ratio(tok_s, triton)})" in cell, (label, w)
        assert shown(cells[2], *(workloads[w]["itl_max_s"] for w in serving_plot.WORKLOADS)), label


def test_benchmarks_readme_serving_tables_are_the_record():
    """benchmarks/README.md: the setups (throughput, gaps, time to first token, the re-check), the
    ratios, the decode wait's rounds and the re-check's counts, each from the committed JSON."""
    setups, text = serving_plot.recorded_setups(), README.read_text()
    rechecked = {s["setup"]: s for s in json.loads((RECORD / "verify.json").read_text())["setups"]}
    for name, (_, label) in ROW_LABELS.items():
        cells, (verified, workloads) = row(text, label), setups[name]
        rl, agent = workloads["rl"], workloads["agent"]
        assert [number(cells[0]), number(cells[1])] == [round(rl["output_tok_s"]), round(agent["output_tok_s"])]
        for cell, key in zip(cells[2:5], ("itl_max_s", "itl_p99_s", "ttft_p50_s")):
            assert shown(cell, rl[key], agent[key]), (label, key)
        passes = [p for w in rechecked.get(name, {}).get("verify", {}).get("workloads", {}).values()
                  for p in w["passes"].values()]
        identical = f"{sum(p['identical'] for p in passes)}/{sum(p['requests'] for p in passes)} identical"
        assert cells[5] == (identical if verified else "not in the re-check"), label
    for label, name in {"chunk 256, the defaults": "plugin-256-no-wait", "chunk 256, decode wait on": "plugin-256",
                        "chunk 1024, decode wait on": "plugin-1024"}.items():
        plugin = setups[name][1]
        assert row(text, label) == [" / ".join(ratio(plugin[w]["output_tok_s"], setups[base][1][w]["output_tok_s"])
                                               for w in serving_plot.WORKLOADS) for base in ("stock-4096", "triton-256")]
    verdict = json.loads((RECORD / "serving.json").read_text())["decode_wait"]
    for w, m in verdict["workloads"].items():
        cells = row(text, w)
        for cell, runs in zip(cells, (m["output_tok_s_wait"], m["output_tok_s_control"])):
            assert [float(v.replace(",", "")) for v in cell.split(", ")] == [round(v, 1 if w == "agent" else 0) for v in runs]
        assert cells[2] == f"{m['cost']:.1%}" and shown(cells[3], m["itl_max_s_wait"], m["itl_max_s_control"])
    for label, name in {"plugin, chunk 256, decode wait on": "plugin-256", "control: non-deterministic flashinfer, 256":
                        "nondet-256-control"}.items():
        report = rechecked[name]["verify"]["workloads"]
        counts = [", ".join(f"{p['identical']}/{p['requests']}" for p in report[w]["passes"].values()) for w in ("mixed", "chat")]
        assert row(text, label)[:2] == counts, label


def test_the_decode_wait_default_and_its_reasons_are_the_records():
    """Off by default because the record's verdict says so, with the verdict's own figures."""
    verdict = json.loads((RECORD / "serving.json").read_text())["decode_wait"]
    assert SWITCHES[DECODE_WAIT_ENV] is verdict["keep_default"] is False
    rl, agent = verdict["workloads"]["rl"], verdict["workloads"]["agent"]
    assert (f"it cost {rl['cost']:.1%} of RL rollout throughput and {agent['cost']:.1%} on agents, while it held the "
            f"longest inter-token gap to {rl['itl_max_s_wait']:.2f} s (rollouts) and {agent['itl_max_s_wait']:.2f} s "
            f"(agents), against {rl['itl_max_s_control']:.1f} s and {agent['itl_max_s_control']:.1f} s without it"
            ) in decode_wait.MEASURED


def test_what_the_readme_and_the_doc_say_of_the_decode_wait_is_its_verdict():
    """Its cost and bound over three rounds, in README.md and docs/serving.md; and, beside the doc's
    table of first rounds, why the wait's first round was faster than the defaults' first."""
    verdict = json.loads((RECORD / "serving.json").read_text())["decode_wait"]["workloads"]
    rl, agent = verdict["rl"], verdict["agent"]
    said = (f"bounded the longest gap at {rl['itl_max_s_wait']:.2f} s on rollouts ({rl['itl_max_s_control']:.1f} s "
            f"without) and {agent['itl_max_s_wait']:.2f} s on agents ({agent['itl_max_s_control']:.1f} s), for "
            f"{rl['cost']:.1%} and {agent['cost']:.1%} of the throughput (over three rounds each")
    readme, doc = (" ".join(path.read_text().split()) for path in (TOP_README, SERVING_DOC))
    assert said in readme and said in doc
    setups = serving_plot.recorded_setups()
    wait, defaults = (setups[name][1]["rl"] for name in ("plugin-256", "plugin-256-no-wait"))
    assert wait["output_tok_s"] == min(rl["output_tok_s_wait"]) and defaults["output_tok_s"] == min(rl["output_tok_s_control"])
    assert (f"its first rollout round, {round(wait['output_tok_s']):,} tok/s, beat the defaults' first, "
            f"{round(defaults['output_tok_s']):,}, while the medians of three rounds put it {rl['cost']:.1%} behind, "
            f"and its longest rollout gap over the rounds was {rl['itl_max_s_wait']:.2f} s "
            f"({wait['itl_max_s']:.2f} s in the first). The first round was the slowest on both servers.") in doc


def printed_setups(path=EARLIER):
    """The earlier run's summary lines: setup -> {workload: (wall_s, output_tok_s, itl_p99_s, itl_max_s)}."""
    setups = {}
    for line in path.read_text().splitlines():
        if line.startswith("SETUP "):
            _, name, _, rest = line.split(" ", 3)
            setups[name] = ast.literal_eval(rest[rest.index("{"):rest.index("}") + 1])
    return setups


def test_the_earlier_runs_table_is_what_it_printed():
    earlier, text = printed_setups(), README.read_text()
    for name in ("plugin-256", "stock-4096", "triton-256", "nondet-256"):
        label = next(line for line in text.splitlines() if line.startswith(f"| `{name}`: ")).split(" | ")[0][2:]
        cells = row(text, label)
        for cell, w in zip(cells, ("rl", "agent", "interactive", "streamed")):
            tok_s, longest = earlier[name][w][1], earlier[name][w][3]
            assert number(cell) == round(tok_s) and shown(cell.split("(")[1].rstrip(")"), longest), (label, w)


def test_the_plot_draws_every_setup_the_readme_shows(tmp_path):
    """The figure in the README comes from the same record, every setup the run timed but the one
    the deadline left out."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")
    setups = serving_plot.recorded_setups()
    assert set(setups) == set(serving_plot.LABELS)
    out = tmp_path / "serving.png"
    serving_plot.plot(setups, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def serving_run(tmp_path, **args):
    """A ServingRun over Granite's config, as main() builds it, for one setup's timing."""
    defaults = dict(model_path="benchmarks/models/granite-3.1-8b", logs=str(tmp_path), out=str(tmp_path / "s.json"),
                    port=0, deadline_s=60, extra=[], workloads="rl,agent", groups=2, samples=2, conversations=2,
                    turns=2, repeats=3, repeat_setups="plugin-256", skip_long_prompts=False, weights="dummy", checkpoints=None, weights_seed=0)
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
    per_round = paths.index("/flush_cache") - 6 - 2  # after the warm-up's six requests and two turns
    assert paths.count("/flush_cache") == 2 and rounds == 8 + 3 * per_round
    assert [i for i, p in enumerate(paths) if p == "/flush_cache"] == [8 + per_round, 9 + 2 * per_round]
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


def test_the_decode_wait_pair_differs_in_the_switch_alone():
    """The verdict compares the two setups as wait on and wait off, so neither may lean on the default."""
    on, off = serving.SETUPS["plugin-256"], serving.SETUPS["plugin-256-no-wait"]
    assert (on.env[DECODE_WAIT_ENV], off.env[DECODE_WAIT_ENV]) == ("1", "0")
    assert {k: v for k, v in on.env.items() if k != DECODE_WAIT_ENV} == {k: v for k, v in off.env.items() if k != DECODE_WAIT_ENV}
    assert (on.chunk, on.extra, on.backend) == (off.chunk, off.extra, off.backend)


@pytest.mark.parametrize("chunk", [512, 1024])
def test_issue_48s_larger_chunks_differ_from_the_defaults_in_the_chunk_and_then_the_wait_alone(chunk):
    defaults, waiting, at_256 = (serving.SETUPS[name] for name in
                                 (f"plugin-{chunk}-defaults", f"plugin-{chunk}", "plugin-256-defaults"))
    assert (defaults.env, defaults.extra, defaults.backend, defaults.reference) == \
        (at_256.env, at_256.extra, at_256.backend, at_256.reference)
    assert defaults.chunk == waiting.chunk == chunk
    assert waiting.env == {**defaults.env, DECODE_WAIT_ENV: "1"}


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

    run = SimpleNamespace(args=SimpleNamespace(prompts=4), input_ids=True, config={"vocab_size": VOCAB})
    cache = str(tmp_path / "baseline-flashinfer.json")
    reference = started()
    assert real_server.verify(run, reference, reference, cache, radix=False)["ok"] is True
    reference.http.shutdown()
    check = real_server.verify(run, started(), None, cache, radix=True)
    assert check["ok"] is True and f"--recorded {cache}" in check["verify_command"]
    wrong = started(perturb=lambda request: ("output_id", 0))
    assert real_server.verify(run, wrong, None, cache, radix=True)["ok"] is False


def test_a_workload_with_a_failed_request_raises_saying_how_many(stand_in):
    """A workload missing a request measures something else: run_requests raises, naming the count,
    instead of handing back a None among the results."""
    Streaming.limit = 100
    try:
        plan = [(0.0, [1] * 50, 2), (0.0, [2] * 200, 2), (0.0, [3] * 50, 2)]
        with pytest.raises(serving.RequestFailed, match=r"1 of 3 requests failed.*HTTP 400"):
            serving.run_requests(stand_in, plan)
    finally:
        Streaming.limit = 10**9


@pytest.mark.parametrize("name, failing", [("stock-4096", "warm-up"), ("plugin-256", "repeat")])
def test_a_setup_whose_requests_fail_records_the_error_and_no_figures(stand_in, tmp_path, monkeypatch, name, failing):
    """The run goes on to the next setup: a failure in the warm-up, or in a later round after the
    first one's figures were in, is the entry's error, and the entry keeps no workloads."""
    stand_in.plugin_lines, stand_in.describe, stand_in.log = (lambda: []), (lambda: {}), (lambda: "the server's log")
    if failing == "warm-up":
        monkeypatch.setattr(Streaming, "limit", 10000)  # the warm-up's 16384-token prompt is refused
    else:
        flush = serving.verify.Server.flush

        def flush_then_refuse(self, *args, **kwargs):
            flush(self, *args, **kwargs)
            monkeypatch.setattr(Streaming, "limit", 500)  # the second round's prompts are refused

        monkeypatch.setattr(serving.verify.Server, "flush", flush_then_refuse)
    entry = serving_run(tmp_path)._time(name, stand_in)
    assert "workloads" not in entry and entry["error"].startswith("RequestFailed: ")
    assert "requests failed" in entry["error"] and entry["error"].endswith("the server's log")


class FakeServer:
    """A setup's server as ServingRun starts it, recording stop()."""

    def __init__(self, run, name, *args, **kwargs):
        self.name, self.stopped = name, 0

    def stop(self):
        self.stopped += 1


def test_start_keeps_every_setup_server(tmp_path, monkeypatch):
    """time_setups can stop only the servers it knows of."""
    monkeypatch.setattr(serving, "Server", FakeServer)
    run = serving_run(tmp_path, graph_bs=8)
    started = [run._start("plugin-256"), run._start("triton-256", pool=1000)]
    assert run.setup_servers == started and [s.name for s in started] == ["plugin-256", "triton-256"]


def test_an_interrupted_run_stops_every_setup_server_it_started(tmp_path, monkeypatch):
    """The device call's limit interrupts a run mid-setup: the server being timed and the one still
    in its checks (which would stop it) are both stopped, and the interruption goes on up."""
    monkeypatch.setattr(serving, "Server", FakeServer)
    timed = []

    def time_then_interrupt(self, name, server):
        timed.append(name)
        if len(timed) == 2:
            raise KeyboardInterrupt
        return {"setup": name}

    monkeypatch.setattr(serving.ServingRun, "_time", time_then_interrupt)
    monkeypatch.setattr(serving.ServingRun, "_check", lambda self, name, server, entry, long=True: None)  # still checking
    run = serving_run(tmp_path, graph_bs=8, deadline_s=3600)
    with pytest.raises(KeyboardInterrupt):
        run.time_setups(["plugin-256", "triton-256", "nondet-256"])
    assert timed == ["plugin-256", "triton-256"]
    assert [s.name for s in run.setup_servers] == ["plugin-256", "triton-256"]
    assert all(s.stopped >= 1 for s in run.setup_servers)


@pytest.mark.parametrize("skip", [False, True])
def test_skip_long_prompts_leaves_the_long_prompts_out_of_the_checks(tmp_path, monkeypatch, skip):
    """--skip-long-prompts: the workloads and verify alone, no single long prompts after them."""
    probed = []
    monkeypatch.setattr(serving, "long_prompts", lambda server, lengths, run: probed.append(lengths) or ["probed"])
    monkeypatch.setitem(serving.SETUPS, "unchecked-long", serving.Setup("long prompts, no reference", 256, serving.PLUGIN,
                                                                        reference=None, long_prompts=True))
    run = serving_run(tmp_path, skip_long_prompts=skip)
    server = SimpleNamespace(stop=lambda: None, split_batches=lambda: 0)
    run._check("unchecked-long", server, {"setup": "unchecked-long"})
    assert probed == ([] if skip else [serving.LONG_PROMPTS["setup"]])
    assert ("long_prompts" in run.results["setups"][0]) is not skip


def test_exact_setups_must_return_the_same_tokens_for_the_same_requests(stand_in):
    """outputs_compared: every setup claiming the flashinfer reference's answers against the first one
    timed (split attention against its deferrals, in issue 32's run); triton has its own reference,
    and the ceiling none, so neither is compared with them. One request's token differing is caught."""
    rollouts = serving.rl(stand_in, small_run(), seed=0)
    assert len(set(rollouts["outputs"])) == len(rollouts["outputs"]) == 6  # each sample's own seed

    def entry(name, outputs):
        return {"setup": name, "workloads": {"rl": {"outputs": outputs}}}

    other = ["0" * 12] * 6
    same = serving.outputs_compared([entry("plugin-256-defaults", rollouts["outputs"]), entry("triton-256", other),
                                     entry("nondet-256", other), entry("plugin-256-no-split", rollouts["outputs"])])
    assert same == {"plugin-256-no-split": {"against": "plugin-256-defaults", "agree": True,
                                            "rl": "6/6 requests identical"}}
    one_off = list(rollouts["outputs"])
    one_off[4] = serving.output_digest(list(range(999)))
    differs = serving.outputs_compared([entry("plugin-256-defaults", rollouts["outputs"]),
                                        entry("plugin-256-no-split", one_off)])
    assert differs["plugin-256-no-split"]["agree"] is False
    assert differs["plugin-256-no-split"]["rl"] == "5/6 requests identical"
    assert serving.output_digest([1, 2, 3]) != serving.output_digest([1, 2, 4])


def test_the_setup_before_split_attention_differs_in_its_switch_alone():
    before, after = serving.SETUPS["plugin-256-no-split"], serving.SETUPS["plugin-256-defaults"]
    assert before.env == {**after.env, "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION": "0"} and before.chunk == after.chunk
    assert "SGLANG_CHUNK_ALIGN_SPLIT_ATTENTION" in SWITCHES


def test_a_fast_gemm_setup_is_checked_against_a_reference_running_fast_gemms_unchunked(tmp_path, monkeypatch):
    """Fast GEMMs are not stock's bits: their reference loads the plugin with the same switch, unchunked,
    radix off, and a context its unchunked prefill fits; the per-M GEMMs keep stock's reference."""
    started = []

    class Down(FakeServer):
        def __init__(self, run, name, chunk, page, env, extra=(), backend=None, **options):
            super().__init__(run, name)
            started.append((name, chunk, env, list(extra), backend))

        def wait_ready(self):
            return False

        def log(self):
            return "down"

    monkeypatch.setattr(serving, "Server", Down)
    run = serving_run(tmp_path, graph_bs=8)
    setups = ("plugin-256-fast", "plugin-256-gemms")
    run.record_references({serving.SETUPS[name].reference for name in setups})
    assert sorted(started) == [
        ("reference-flashinfer", -1, serving.STOCK, ["--disable-radix-cache"], "flashinfer"),
        ("reference-flashinfer-fast", -1, {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"},
         ["--disable-radix-cache", "--context-length", "24576"], "flashinfer"),
    ]
    fast, tuned = (serving.SETUPS[name] for name in setups)
    assert fast.env == {**serving.PLUGIN, "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"} and fast.chunk == tuned.chunk == 256
    assert [r["reference"] for r in run.results["references"]] == ["flashinfer", "flashinfer-fast"]


def test_a_servers_split_batches_are_read_from_its_log(tmp_path):
    """The plugin logs the 1st, 10th, 100th... split batch at INFO: the highest one read is a floor."""
    server = object.__new__(real_server.Server)
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text("[x] sglang-chunk-align: prefill chunks aligned to 128 tokens\n")
    assert server.split_batches() == 0
    with server.log_path.open("a") as log:
        for n in (1, 10, 100):
            log.write(f"[x] sglang-chunk-align: split attention: prefill batch {n} split into fa2 calls of 3+1 requests\n")
    assert server.split_batches() == 100


def test_the_record_says_which_weights_ran(tmp_path):
    assert serving_run(tmp_path).results["weights"] == random_checkpoint.DUMMY


def test_weights_that_cannot_be_written_are_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        serving.main(["--model-path", str(tmp_path), "--weights", "random", "--checkpoints", str(tmp_path / "w"),
                      "--out", str(tmp_path / "s.json")])
    assert exit.value.code == 2 and f"error: {tmp_path} holds no config.json" in capsys.readouterr().err


def test_the_warm_up_samples_as_the_timed_workloads_do_alone_and_several_at_once(stand_in):
    """Every sampling mode the timed workloads send is warmed first, at a batch of one and of several:
    SGLang compiles its seeded sampler at its first use of each (serving.warm_up says what a greedy
    warm-up cost the first setup timed)."""
    serving.warm_up(stand_in, small_run())
    warmed = [p for path, p in Streaming.seen if path == "/generate"]
    Streaming.seen = []
    serving.rl(stand_in, small_run(), seed=0)
    serving.agent(stand_in, small_run(), seed=0)
    timed = {p.get("temperature", 0) for path, p in Streaming.seen if path == "/generate"}
    sampled = [p for p in warmed if p.get("temperature")]
    assert timed <= {p.get("temperature", 0) for p in warmed}
    assert warmed[0].get("temperature") and "sampling_seed" in warmed[0]  # alone, before any other request
    assert len({p["sampling_seed"] for p in sampled}) >= 2  # and several samples of one prompt at once


# SGLang 0.5.23's lines as it writes them: the first and the decode line from gemms_h200/call7's
# plugin-256-defaults.log, the second one of its lines with the step number LOG_FORWARD_ITERS adds, the last
# made up: a 1-token extend over a radix hit that ran eagerly.
PREFILL_LOG = """\
[2026-12-07 00:47:13] Prefill batch, #new-seq: 6, #new-token: 222, #cached-token: 9984, token usage: 0.01, #running-req: 2, #queue-req: 119, #pending-token: 238520, cuda graph: True, input throughput (token/s): 12107.93
[2026-12-07 00:47:13] Prefill batch [812], #new-seq: 1, #new-token: 256, #cached-token: 0, token usage: 0.01, #running-req: 8, #queue-req: 119, #pending-token: 238264, cuda graph: True, input throughput (token/s): 17087.38
[2026-12-07 00:47:16] Decode batch, #running-req: 128, #token: 39648, token usage: 0.16, cuda graph: True, gen throughput (token/s): 151.18, #queue-req: 0
[2026-12-07 00:47:22] Prefill batch, #new-seq: 1, #new-token: 1, #cached-token: 2047, token usage: 0.02, #running-req: 8, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 9.3
"""


def test_prefill_steps_are_read_from_sglangs_prefill_lines_alone():
    assert real_server.prefill_steps(PREFILL_LOG) == {"steps": 3, "new_tokens": 479, "cached_tokens": 12031,
                                                      "graph_steps": 2}
    assert real_server.prefill_steps("") == {"steps": 0, "new_tokens": 0, "cached_tokens": 0, "graph_steps": 0}


def test_each_workload_records_the_prefill_steps_its_server_logged_while_it_ran(monkeypatch, tmp_path):
    """The log before a workload (the warm-up's, an earlier workload's) is not the workload's."""
    lines = PREFILL_LOG.splitlines(keepends=True)
    log = [lines[0]]  # logged before the round: not counted

    def workload(new_lines):
        def run(server, run, seed):
            log.extend(new_lines)
            return {}
        return run

    monkeypatch.setattr(serving, "WORKLOADS", {"rl": workload(lines[1:3]), "agent": workload(lines[3:])})
    result = serving_run(tmp_path)._round(SimpleNamespace(log=lambda: "".join(log)))
    assert result["rl"]["prefill"] == {"steps": 1, "new_tokens": 256, "cached_tokens": 0, "graph_steps": 1}
    assert result["agent"]["prefill"] == {"steps": 1, "new_tokens": 1, "cached_tokens": 2047, "graph_steps": 0}


def test_issue_48s_plan_runs_setups_serving_knows_with_a_control_on_models_it_has():
    plan = (pathlib.Path(__file__).resolve().parents[1] / "benchmarks/logs/ahead_of_triton/run.sh").read_text()
    setups = plan.split("${SETUPS:-")[1].split("}")[0].split(",")
    assert set(setups) <= set(serving.SETUPS), set(setups) - set(serving.SETUPS)
    assert {"plugin-256-defaults", "triton-256", "stock-4096"} <= set(setups)
    # The control is the run's only non-deterministic server, so its timed workloads are the ceiling; second,
    # so that a limit cuts a timed setup before it.
    assert [name for name in setups if not serving.SETUPS[name].deterministic] == ["nondet-256-control"] == setups[1:2]
    assert not serving.SETUPS["nondet-256-control"].expect_identical
    for model in ("qwen2.5-7b", "granite-3.1-8b", "llama-3.2-3b"):
        assert f"MODEL={model}" in plan and (pathlib.Path(serving.__file__).parent / "models" / model / "config.json").exists()
    # The padded schedules it replays first, named by the installed flashinfer, are committed for both releases.
    replayed = [word.strip('"') for word in plan.split() if "schedules_" in word and "$release" in word]
    assert replayed == ['benchmarks/schedules_pad_$release.json', 'benchmarks/schedules_chat_pad_$release.json']
    for release in ("fi072", "fi074"):
        assert all((pathlib.Path(serving.__file__).parents[1] / path.replace("$release", release)).exists() for path in replayed)


def test_non_deterministic_flashinfer_compiles_its_kernels_beside_the_references(tmp_path, monkeypatch):
    """Its own server's start would JIT-compile them (107 s in gemms_h200/call8): a server of the setup with
    the references' pool starts beside them and is stopped once up; deterministic setups and triton's
    compile nothing there. A reference that did not come up is stopped too (a start past the timeout runs on)."""
    started, servers = [], []

    class Up(FakeServer):
        def __init__(self, run, name, chunk, page, env, extra=(), backend=None, deterministic=True, **options):
            super().__init__(run, name)
            started.append((name, chunk, env, backend, deterministic, options.get("max_total_tokens")))
            servers.append(self)

        def wait_ready(self):
            return not self.name.startswith("reference-")  # the references' own work is not this test's

        def log(self):
            return "down"

    monkeypatch.setattr(serving, "Server", Up)
    run = serving_run(tmp_path, graph_bs=8)
    setups = ["plugin-256-defaults", "nondet-256-control", "triton-256", "stock-4096"]
    assert serving.compiled_beside_references(setups) == ["nondet-256-control"]
    run.record_references({"flashinfer"}, serving.compiled_beside_references(setups))
    assert sorted(started) == [
        ("kernels-nondet-256-control", 256, serving.STOCK, "flashinfer", False, 40000),
        ("reference-flashinfer", -1, serving.STOCK, "flashinfer", True, 40000),
    ]
    assert all(server.stopped for server in servers)
    assert list(run.results["kernels_compiled"]) == ["nondet-256-control"]
    assert run.results["kernels_compiled"]["nondet-256-control"] >= 0
