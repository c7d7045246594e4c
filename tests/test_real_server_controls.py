"""benchmarks/real_server.py's controls on CPU: each plugin server's verdict beside the grid rules off at
its chunk, and the large-batch phase (issue 46's eager-decode check) against a fake SGLang that answers
/generate over HTTP the way the hole would: a request of the control setup decoded in a batch larger
than the decode graphs gets another logprob."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from benchmarks import real_server


def report(*passes):
    """A verify report with one workload whose passes identical/requests are `passes`."""
    return {"workloads": {"mixed": {"passes": {f"p{i}": {"requests": r, "identical": i_}
                                               for i, (i_, r) in enumerate(passes)}}}}


def entry(name, chunk, rules, ok, *passes):
    return {"name": name, "chunk": chunk, "page": 1, "rules": rules, "ok": ok, "verify": report(*passes)}


def test_a_plugin_server_is_exact_only_beside_a_control_that_failed():
    servers = [
        entry("plugin-128", 128, True, True, (32, 32), (32, 32)),
        entry("control-128", 128, False, False, (20, 32), (28, 32)),
        entry("plugin-256", 256, True, True, (32, 32)),
        entry("control-256", 256, False, True, (32, 32)),
        entry("plugin-1024", 1024, True, False, (31, 32)),
        entry("plugin-512", 512, True, True, (32, 32)),
    ]
    rows = {row["server"]: row for row in real_server.verdicts(servers)}
    assert rows["plugin-128"] == {"server": "plugin-128", "verdict": "exact", "plugin_failed_fraction": 0.0,
                                  "control": "control-128", "control_failed_fraction": 0.25}
    assert rows["plugin-256"]["verdict"] == "could not see"  # its control passed
    assert rows["plugin-1024"]["verdict"] == "inexact"
    assert rows["plugin-512"]["verdict"] == "could not see" and rows["plugin-512"]["control"] is None
    assert set(rows) == {"plugin-128", "plugin-256", "plugin-1024", "plugin-512"}  # controls get no verdict


def test_a_plugin_server_whose_verify_was_interrupted_is_cut_short_unless_it_already_differed():
    """A time limit's SIGINT stops verify mid-run (exit 130, "interrupted" in its report): what it
    compared stays in the record, and a plugin identical so far is neither exact nor inexact."""
    cut = entry("plugin-128", 128, True, False, (32, 32))
    differed = entry("plugin-256", 256, True, False, (31, 32))
    for server in (cut, differed):
        server["verify"]["interrupted"] = "chat"
    servers = [cut, differed, entry("control-128", 128, False, False, (20, 32)),
               entry("control-256", 256, False, False, (20, 32))]
    rows = {row["server"]: row["verdict"] for row in real_server.verdicts(servers)}
    assert rows == {"plugin-128": "cut short", "plugin-256": "inexact"}


def test_the_record_holds_the_verdicts_of_the_servers_recorded_so_far(tmp_path):
    """The JSON is rewritten after each server, its verdicts with it: a run cut short keeps them."""
    out = tmp_path / "out.json"
    args = SimpleNamespace(model_path=str(tmp_path), weights="dummy", checkpoints=None, weights_seed=0,
                           logs=str(tmp_path), out=str(out), port=0)
    run = real_server.Run(args)
    run.record(entry("control-128", 128, False, False, (20, 32)))
    run.record(entry("plugin-128", 128, True, True, (32, 32)))
    assert [(v["server"], v["verdict"]) for v in json.loads(out.read_text())["verdicts"]] == [("plugin-128", "exact")]


class FakeSGLang:
    """One fake server of the large-batch phase: /generate answers greedily from the prompt alone,
    except that the control setup (the unsplit plan off) answers other logprobs in a batch larger than
    its decode graph holds; /flush_cache and the log SGLang writes. The phase flushes before each pass:
    in the first every request runs alone, in the second they wait for each other (a barrier, whatever
    the machine's load) and run as one batch."""

    def __init__(self, run, name, chunk, page, env=(), extra=(), decode_graph_bs=8, max_total_tokens=None):
        self.name, self.env, self.graph_bs = name, dict(env), decode_graph_bs
        self.split = self.env.get("SGLANG_CHUNK_ALIGN_UNSPLIT_DECODE") == "0"
        self.flushes, self.lock, self.lines = 0, threading.Lock(), []
        self.together = threading.Barrier(run.args.large_batch_requests, timeout=30)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path.startswith("/flush_cache"):
                    fake.flushes += 1
                    return self.reply({})
                self.reply(fake.generate(body))

            def reply(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generate(self, body):
        ids, new = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        batch = 1
        if self.flushes > 1:  # the all-at-once pass
            self.together.wait()
            batch = self.together.parties
        eager = batch > (self.graph_bs or 0)
        with self.lock:
            self.lines.append(f"Decode batch, #running-req: {batch}, #token: 1, token usage: 0.0, "
                              f"cuda graph: {not eager}, gen throughput (token/s): {100.0 * batch:.2f}, #queue-req: 0")
        logprob = -0.25 if (self.split and eager and batch > 1) else -0.5
        first = sum(ids) % 1000
        return {"output_ids": [first + i for i in range(new)], "text": "",
                "meta_info": {"input_token_logprobs": [[None, ids[-1], None]],
                              "output_token_logprobs": [[logprob, first + i, None] for i in range(new)],
                              "prompt_tokens": len(ids), "cached_tokens": 0, "finish_reason": {"type": "length"}}}

    def wait_ready(self):
        return True

    def log(self):
        return "\n".join(self.lines)

    def describe(self):
        return {"name": self.name, "env": self.env}

    def stop(self):
        self.http.shutdown()


def test_the_large_batch_phase_finds_the_control_differing_and_the_plugin_identical(tmp_path):
    args = SimpleNamespace(large_batch_requests=12, large_batch_new_tokens=3)
    recorded = []
    run = SimpleNamespace(args=args, config={"vocab_size": 1000}, time_left=lambda: 1000,
                          record=lambda e, key: recorded.append((key, e)))
    real_server.phase_large_batch(run, start_server=FakeSGLang)
    rows = {e["name"]: e for key, e in recorded}
    assert {key for key, _ in recorded} == {"large_batch"}
    unsplit, control, no_graphs = (rows[f"large-batch-{n}"] for n in ("unsplit", "split-control", "unsplit-no-graphs"))
    assert unsplit["ok"] and unsplit["identical"] == 12 and unsplit["expect_identical"]
    assert control["ok"] and control["identical"] == 0 and not control["expect_identical"]  # ok: it differed, as a control must
    assert control["first_differences"][0] == ("output", 0)
    assert no_graphs["ok"] and no_graphs["alone_identical_to_graphs"] == 12 and no_graphs["decode_graph_max_bs"] is None
    assert unsplit["largest_decode_batch"] == 12 and unsplit["eager_decode_steps_logged"] >= 1
    assert all(len(e["prompt_tokens"]) == 12 and min(e["prompt_tokens"]) >= 3000 for e in rows.values())
