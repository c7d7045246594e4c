"""`sglang-chunk-align verify` against a local stand-in of SGLang's HTTP API.

The stand-in models what verify relies on in a server: logprobs and greedy
tokens that are a pure function of the token ids, a prefix cache that reports
`cached_tokens` and, as SGLang does, serves a request only up to its
`logprob_start_len`, input logprobs from there on (the first null),
/flush_cache refusing while busy, and SGLang's reply shapes (`output_ids`;
`text` only with a tokenizer). Faults are switched on per test: wrong KV from
one token on (every later logprob moved by one ULP), one output logprob moved
or one generated token changed, when a request overlaps another, hits the
cache or is long; null logprobs; aborts; no cache hits; a flush that keeps the
cache; a dropped connection; a slow answer. Each fault must make verify fail
and name the first token it can see. Only the remote API is stood in for;
nothing of SGLang itself is faked (the bodies are checked with SGLang's own
/generate contract where it is installed).
"""

import importlib.util
import json
import pathlib
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import sigint_at_default

from sglang_chunk_align import PREFILL_Q_TILE_TOKENS, gemms
from sglang_chunk_align.tools import verify
from sglang_chunk_align.tools.cli import main

VOCAB = 1000
ROOT = Path(__file__).resolve().parent.parent
FAST = ["--prompts", "8", "--max-new-tokens", "4", "--concurrency", "4"]
IDS = ["--input-ids", "--vocab-size", str(VOCAB)]


@dataclass
class Request:
    """One /generate call as the stand-in saw it; faults decide on it."""

    tokens: list
    cached: int
    overlapped: bool = False  # another request was in flight at some time during this one


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that gave up (verify's timeout) is part of the test; anything else is printed."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def __init__(self, perturb=None, radix=True, skip_tokenizer_init=False, drop_after=None,
                 busy_flushes=0, flush_ignored=False, delay=0.0, flush_missing=False, server_info=None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.server_info = server_info  # /get_server_info's reply; None: 404, as an SGLang without it
        self.perturb = perturb or (lambda request: None)  # Request -> (where, index) or None
        self.radix = radix
        self.skip_tokenizer_init = skip_tokenizer_init
        self.drop_after = drop_after
        self.busy_flushes = busy_flushes
        self.flush_ignored = flush_ignored
        self.flush_missing = flush_missing  # /flush_cache answers 404 with an HTML page
        self.delay = delay
        self.lock = threading.Lock()
        self.cache = []  # token sequences whose KV is kept
        self.in_flight = []
        self.bodies = []
        self.gets = []
        self.flushes = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def generate(self, body):
        """(status, reply) for one /generate body."""
        if "input_ids" in body:
            tokens = body["input_ids"]
        elif self.skip_tokenizer_init:  # SGLang's words for this case
            return 400, {"error": {"message": "The engine initialized with skip_tokenizer_init=True cannot accept text prompts."}}
        else:
            tokens = [int(w[1:]) if re.fullmatch(r"t\d+", w) else zlib.crc32(w.encode()) % VOCAB for w in body["text"].split()]
        start = body["logprob_start_len"]
        with self.lock:
            cached = max((_common(tokens, seq) for seq in self.cache), default=0) if self.radix else 0
            request = Request(tokens, min(cached, len(tokens) - 1, start))  # SGLang's cap on a hit
            self.in_flight.append(request)
            for other in self.in_flight if len(self.in_flight) > 1 else ():
                other.overlapped = True
        time.sleep(self.delay)
        seq = list(tokens)
        for _ in range(body["sampling_params"]["max_new_tokens"]):
            seq.append(zlib.crc32(f"{seq[-2:]} {len(seq)}".encode()) % VOCAB)
        with self.lock:
            self.in_flight.remove(request)
            self.cache.append(seq)
        logprobs = [None] + [_logprob(seq, i) for i in range(1, len(seq))]
        outputs = seq[len(tokens):]
        where, index = self.perturb(request) or (None, None)
        if where == "input":  # wrong KV from this token on: every later logprob moves
            logprobs[index:] = [math.nextafter(lp, 0) for lp in logprobs[index:]]
        elif where == "output":
            logprobs[len(tokens) + index] = math.nextafter(logprobs[len(tokens) + index], 0)
        elif where == "output_id":
            outputs[index] = (outputs[index] + 1) % VOCAB
        elif where == "null":  # a NaN logit: SGLang's JSON encoder writes null
            logprobs[index] = None
        finish = {"type": "abort", "message": "aborted by the test"} if where == "abort" else {"type": "length", "length": len(outputs)}
        reply = {
            "output_ids": outputs,
            "meta_info": {
                "input_token_logprobs": [[None, tokens[start], None]]
                + [[lp, t, None] for lp, t in zip(logprobs[start + 1 : len(tokens)], tokens[start + 1 :])],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs[len(tokens):], outputs)],
                "cached_tokens": request.cached,
                "finish_reason": finish,
                "prompt_tokens": len(tokens),
                "completion_tokens": len(outputs),
            },
        }
        if not self.skip_tokenizer_init:
            reply["text"] = "".join(f" t{t}" for t in outputs)
        return 200, reply

    def flush(self):
        with self.lock:
            self.flushes += 1
            if self.busy_flushes or self.in_flight:
                self.busy_flushes = max(0, self.busy_flushes - 1)
                return 400, "Cache not flushed because there are pending requests."
            if not self.flush_ignored:
                self.cache.clear()
        return 200, "Cache flushed.\nPlease check backend logs for more details.\n"


def _common(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _logprob(seq, i):
    """A full-precision float that depends on the token, its predecessor and its position."""
    return math.log((zlib.crc32(f"{seq[i - 1]} {seq[i]} {i}".encode()) % 999_983 + 1) / 1e6)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        """SGLang's /get_model_info (verify's reachability check); recorded, so a test sees it came first."""
        with self.server.lock:
            self.server.gets.append(self.path)
        if self.path == "/get_server_info" and self.server.server_info is not None:
            return self._send(200, json.dumps(self.server.server_info).encode(), "application/json")
        if self.path != "/get_model_info":
            return self._send(404, b"not found", "text/plain")
        self._send(200, json.dumps({"model_path": "stand-in", "is_generation": True}).encode(), "application/json")

    def do_POST(self):
        server = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = urllib.parse.urlsplit(self.path).path
        if path == "/flush_cache" and server.flush_missing:
            return self._send(404, b"<html><head><title>Not Found</title></head><body>nothing</body></html>", "text/html")
        if path == "/flush_cache":
            status, reply = server.flush()
            return self._send(status, reply.encode(), "text/plain")
        if path != "/generate":
            return self._send(404, b"not found", "text/plain")
        body = json.loads(body)
        with server.lock:
            server.bodies.append(body)
            drop = server.drop_after is not None and len(server.bodies) > server.drop_after
        if drop:  # the server went away mid-run: no answer at all
            self.close_connection = True
            return
        status, reply = server.generate(body)
        self._send(status, json.dumps(reply).encode(), "application/json")

    def _send(self, status, data, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def standin():
    """standin(**faults) -> a running StandIn, shut down after the test."""
    started = []

    def start(**faults):
        server = StandIn(**faults)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def run_verify(capsys, *args):
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *args):
    code, out, _ = run_verify(capsys, *args, "--json")
    return code, json.loads(out)


def failures(report, workload, label):
    return report["workloads"][workload]["passes"][label]["failures"]


def test_identical_servers_pass_with_radix_hits(capsys, standin):
    server, reference = standin(), standin()
    code, out, err = run_verify(capsys, "--server", server.url, "--reference", reference.url, *FAST, *IDS)
    assert code == 0, out
    assert err == ""  # no progress bar where stderr is not a terminal
    for line in ("  sequential: 8 of 8 identical", "  concurrent: 8 of 8 identical"):
        assert out.count(line) == 3  # mixed, chat and tiles
    assert "chat: 8 requests in 2 conversations" in out
    assert "NOT CHECKED" not in out
    assert out.splitlines()[-1] == "OK: every request identical"


def test_json_report_has_the_documented_keys_and_counts(capsys, standin):
    server, reference = standin(), standin()
    code, report = run_json(capsys, "--server", server.url, "--reference", reference.url, *FAST, *IDS)
    assert code == 0 and report["ok"] is True
    assert list(report) == [
        "ok", "server", "reference", "recorded", "baseline", "chunked_vs_unchunked_checked", "radix_expected", "input",
        "seed", "concurrency", "max_new_tokens", "problems", "workloads",
    ]
    assert (report["baseline"], report["input"], report["problems"]) == ("reference", "input_ids", [])
    for name, workload in report["workloads"].items():
        assert set(workload) == {
            "requests", "conversations", "prompt_tokens", "logprob_start_len", "baseline_cached_tokens", "passes"
        }
        assert workload["requests"] == 8 and workload["baseline_cached_tokens"] == [0] * 8
        for result in workload["passes"].values():
            assert set(result) == {"requests", "identical", "cached_tokens", "cached_tokens_total", "requests_with_hit", "failures"}
            assert (result["requests"], result["identical"], result["failures"]) == (8, 8, [])
            assert result["cached_tokens_total"] == sum(result["cached_tokens"])
            assert result["requests_with_hit"] == sum(1 for c in result["cached_tokens"] if c)
    starts, tokens = report["workloads"]["chat"]["logprob_start_len"], report["workloads"]["chat"]["prompt_tokens"]
    # A turn asks for logprobs from where its cacheable prefix ends: the system prompt, or the turn before.
    assert [starts[0], starts[4]] == [verify.SYSTEM_PROMPT_TOKENS] * 2
    assert all(starts[t] == tokens[t - 1] + 4 for t in (1, 2, 3, 5, 6, 7))
    assert set(report["workloads"]["mixed"]["logprob_start_len"]) - {0}  # the shared prefix's prompts
    chat = report["workloads"]["chat"]["passes"]["sequential"]["cached_tokens"]
    # The first turn of conversation 0 is cold; the second conversation's first turn hits the shared
    # system prompt; every later turn hits the turn before it, output included.
    assert chat[0] == 0 and chat[4] >= verify.SYSTEM_PROMPT_TOKENS and all(chat[t] for t in (1, 2, 3, 5, 6, 7))
    assert report["workloads"]["mixed"]["passes"]["sequential"]["requests_with_hit"] >= 1  # the shared prefix


def first_visible(workload, request, wrong_from):
    """Where verify must see KV that is wrong from token `wrong_from` on: the first input logprob
    it asked for at or after it, else the first generated token."""
    start, tokens = workload["logprob_start_len"][request], workload["prompt_tokens"][request]
    at = max(wrong_from, start + 1)  # the logprob at logprob_start_len itself is null
    return ("input", at) if at < tokens else ("output", 0)


def test_a_long_prompt_fault_on_the_server_names_its_first_token(capsys, standin):
    server = standin(perturb=lambda r: ("input", 300) if len(r.tokens) > 300 else None)
    args = ("--server", server.url, "--reference", standin().url, *FAST, *IDS)
    code, report = run_json(capsys, *args)
    assert code == 1 and report["ok"] is False
    for name, workload in report["workloads"].items():
        long = [i for i, n in enumerate(workload["prompt_tokens"]) if n > 300]
        assert long, name
        for label in ("sequential", "concurrent"):
            got = failures(report, name, label)
            assert [f["request"] for f in got] == long
            assert [(f["first_difference"], f["index"]) for f in got] == [first_visible(workload, i, 300) for i in long]
    assert ("input", 300) in [(f["first_difference"], f["index"]) for f in failures(report, "mixed", "sequential")]
    code, out, _ = run_verify(capsys, *args, "--workload", "mixed")
    assert code == 1 and out.splitlines()[-1] == "NOT OK"
    first = failures(report, "mixed", "sequential")[0]
    assert (
        f"    request {first['request']} (conversation {first['request']}, turn 0, {first['prompt_tokens']} prompt tokens): "
        f"first difference at {first['first_difference']} token {first['index']}"
    ) in out.splitlines()


def test_a_fault_under_concurrency_fails_only_the_concurrent_pass(capsys, standin):
    """Requests that overlapped another get wrong KV: verify fails each of them (every one, in the
    concurrent pass: the sequential pass overlaps none) and no other."""
    overlapped = []

    def perturb(request):
        if not request.overlapped:
            return None
        overlapped.append(request)
        return "input", len(request.tokens) // 2

    server = standin(perturb=perturb, delay=0.02)
    args = ("--server", server.url, "--reference", standin().url, *FAST, *IDS, "--workload", "mixed")
    code, report = run_json(capsys, *args)
    assert code == 1
    assert failures(report, "mixed", "sequential") == []
    got = failures(report, "mixed", "concurrent")
    mixed = report["workloads"]["mixed"]
    assert len(got) == len(overlapped) > 0
    for f in got:
        assert (f["first_difference"], f["index"]) == first_visible(mixed, f["request"], f["prompt_tokens"] // 2)


def test_without_a_reference_a_cache_hit_fault_fails_and_chunking_is_not_checked(capsys, standin):
    server = standin(perturb=lambda r: ("input", r.cached) if r.cached else None)
    code, report = run_json(capsys, "--server", server.url, *FAST, *IDS)
    assert code == 1 and report["baseline"] == "server" and report["chunked_vs_unchunked_checked"] is False
    for name, workload in report["workloads"].items():
        for label, result in workload["passes"].items():
            hits = [i for i, c in enumerate(result["cached_tokens"]) if c]
            assert [f["request"] for f in result["failures"]] == hits, (name, label)
            # concurrent prompts on one prefix may all miss; tiles' prompts share none
            assert hits or label == "concurrent" or name == "tiles", name
            assert [(f["first_difference"], f["index"]) for f in result["failures"]] == [
                first_visible(workload, i, result["cached_tokens"][i]) for i in hits
            ]
    code, out, _ = run_verify(capsys, "--server", standin().url, *FAST, *IDS, "--workload", "mixed")
    assert code == 0
    assert "NOT CHECKED: chunked vs unchunked prefill (no --reference)" in out


@pytest.mark.parametrize("where, index", [("output", 2), ("output_id", 1)])
def test_a_generated_token_or_its_logprob_differing_is_named(capsys, standin, where, index):
    server = standin(perturb=lambda r: (where, index) if r.cached else None)
    code, report = run_json(capsys, "--server", server.url, "--reference", standin().url, *FAST, *IDS, "--workload", "chat")
    assert code == 1
    got = failures(report, "chat", "sequential")
    assert len(got) == 7  # every turn but the cold first one
    assert {(f["first_difference"], f["index"]) for f in got} == {("output", index)}


def test_chat_without_radix_hits_fails_unless_radix_is_said_to_be_off(capsys, standin):
    server = standin(radix=False)
    code, out, _ = run_verify(capsys, "--server", server.url, *FAST, *IDS)
    assert code == 1
    assert "  sequential: 8 of 8 identical; cached tokens 0 in 0 of 8 requests" in out
    for label in ("sequential", "concurrent"):
        assert (
            f"FAILED: chat {label}: the radix cache was never hit on {server.url}: start the server with the radix cache "
            "on (the plugin's default under deterministic flashinfer; its startup line says why where it is off), "
            "or pass --no-radix if it runs without one"
        ) in out.splitlines()
    assert "mixed" not in "".join(line for line in out.splitlines() if line.startswith("FAILED"))
    assert run_verify(capsys, "--server", server.url, *FAST, *IDS, "--no-radix")[0] == 0
    assert run_verify(capsys, "--server", server.url, *FAST, *IDS, "--workload", "mixed")[0] == 0
    assert run_verify(capsys, "--server", server.url, *IDS, "--prompts", "1", "--workload", "chat")[0] == 0  # nothing to hit


def test_a_baseline_that_is_not_cold_fails(capsys, standin):
    server = standin(flush_ignored=True)
    code, report = run_json(capsys, "--server", server.url, *FAST, *IDS, "--workload", "mixed")
    assert code == 1
    hits = sum(1 for start in report["workloads"]["mixed"]["logprob_start_len"] if start)  # the only ones that can hit
    assert hits and report["problems"] == [
        f"mixed baseline: {hits} of 8 requests to {server.url} reported cached tokens right after /flush_cache, so they were not cold"
    ]


def test_null_logprobs_are_not_passed_as_identical(capsys, standin):
    server = standin(perturb=lambda r: ("null", 1))
    code, report = run_json(capsys, "--server", server.url, *FAST, *IDS, "--workload", "mixed")
    assert code == 1 and failures(report, "mixed", "sequential") == []
    nulls = 3 * report["workloads"]["mixed"]["logprob_start_len"].count(0)  # token 1 is sent from 0 only; 3 answers each
    assert report["problems"] == [
        f"mixed: {nulls} logprobs came back null (NaN or infinite on the server), and nulls compare equal without being checked"
    ]


def test_a_busy_flush_is_retried(capsys, standin):
    server = standin(busy_flushes=2)
    assert run_verify(capsys, "--server", server.url, *FAST, *IDS, "--workload", "mixed")[0] == 0
    assert run_verify(capsys, "--server", server.url, *IDS, "--prompts", "1", "--workload", "chat")[0] == 0  # nothing to hit
    assert server.busy_flushes == 0


def test_text_and_input_id_bodies_are_what_sglang_generate_accepts(capsys, standin):
    text, ids = standin(), standin(skip_tokenizer_init=True)
    assert run_verify(capsys, "--server", text.url, *FAST)[0] == 0
    assert run_verify(capsys, "--server", ids.url, *FAST, *IDS)[0] == 0
    sampling = {"max_new_tokens": 4, "temperature": 0}
    for server, field, kind in ((text, "text", str), (ids, "input_ids", list)):
        assert server.bodies
        for body in server.bodies:
            assert set(body) == {field, "sampling_params", "return_logprob", "logprob_start_len"}
            assert isinstance(body[field], kind) and body[field]
            assert (body["sampling_params"], body["return_logprob"]) == (sampling, True)
            assert 0 <= body["logprob_start_len"] < len(body[field].split() if field == "text" else body[field])
        assert {body["logprob_start_len"] > 0 for body in server.bodies} == {True, False}
    assert all(0 <= t < VOCAB for body in ids.bodies for t in body["input_ids"])
    contract = sglang_generate_contract()
    for body in (text.bodies[0], ids.bodies[0]):
        contract.GenerateRequest.from_json_value(body)  # raises JsonContractError where SGLang refuses it
    with pytest.raises(contract.JsonContractError):  # the contract does refuse a bad body
        contract.GenerateRequest.from_json_value({**ids.bodies[0], "input_ids": "0 1"})


def sglang_generate_contract():
    """The schema SGLang's /generate checks every body against (http_server.generate_contract_error).

    Its module, sglang/api/v1/api_types.py, needs only msgspec; it is loaded from the installed
    wheel by path, because `import sglang` imports torch (20 s here).
    """
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.origin).parent / "api" / "v1" / "api_types.py" if spec else None
    if path is None or not path.exists():
        pytest.skip("no SGLang with a /generate contract (sglang/api/v1/api_types.py) is installed")
    name = "sglang_generate_contract"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # msgspec resolves the annotations through the module
    module.__spec__.loader.exec_module(module)
    return module


def test_text_to_a_server_without_a_tokenizer_is_one_line_with_its_message(capsys, standin):
    server = standin(skip_tokenizer_init=True)
    code, out, err = run_verify(capsys, "--server", server.url, *FAST)
    assert (code, out) == (2, "")
    assert err == (
        f"sglang-chunk-align verify: {server.url}/generate: HTTP 400: "
        "The engine initialized with skip_tokenizer_init=True cannot accept text prompts.\n"
    )


@pytest.mark.parametrize(
    "faults, says",
    [({"drop_after": 3}, "/generate: Remote end closed connection without response"), ({"delay": 2}, "/generate: timed out")],
)
def test_a_server_that_stops_answering_is_one_line(capsys, standin, faults, says):
    server = standin(**faults)
    code, out, err = run_verify(capsys, "--server", server.url, *FAST, *IDS, "--timeout", "0.5")
    assert (code, out) == (2, "")
    assert err == f"sglang-chunk-align verify: {server.url}{says}\n"


# A client machine: SGLang cannot be imported. verify runs there, and the plugin never loads it.
WITHOUT_SGLANG = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "sglang":
            raise ImportError("sglang is hidden")
sys.meta_path.insert(0, Hide())
import sglang_chunk_align.plugin, sglang_chunk_align.patches
assert "sglang_chunk_align.tools.verify" not in sys.modules, "plugin loading imported verify"
from sglang_chunk_align.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _python(*args, code=None):
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "sglang_chunk_align.tools.cli", *args]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": pythonpath})


def test_verify_runs_where_sglang_is_not_installed(standin):
    result = _python("verify", "--server", standin().url, "--workload", "mixed", "--prompts", "2", code=WITHOUT_SGLANG)
    assert result.returncode == 0, result.stderr
    assert "mixed: 2 requests" in result.stdout and result.stdout.endswith("OK: every request identical\n")


def test_an_aborted_request_is_one_line_not_a_comparison(capsys, standin):
    server = standin(perturb=lambda r: ("abort", 0) if r.cached else None)
    code, out, err = run_verify(capsys, "--server", server.url, *FAST, *IDS, "--workload", "chat")
    assert (code, out) == (2, "")
    assert err == f"sglang-chunk-align verify: {server.url}/generate: request aborted: aborted by the test\n"


@pytest.fixture
def closed_url():
    """closed_url() -> the URL of a port bound but never listening: connections are refused."""
    sockets = []

    def url():
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        sockets.append(closed)
        return f"http://127.0.0.1:{closed.getsockname()[1]}"

    yield url
    for closed in sockets:
        closed.close()


def test_an_unreachable_server_is_one_line_from_the_command(standin, closed_url):
    url = closed_url()
    for args, role in ((["--server", url], "server"), (["--server", standin().url, "--reference", url], "reference")):
        result = _python("verify", *args, "--prompts", "1")
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.startswith(f"sglang-chunk-align verify: {role} {url}/get_model_info: ")
        assert "Connection refused" in result.stderr and len(result.stderr.splitlines()) == 1


def test_both_servers_down_are_both_named(capsys, closed_url):
    server, reference = closed_url(), closed_url()
    code, out, err = run_verify(capsys, "--server", server, "--reference", reference)
    assert (code, out) == (2, "")
    named = err.removeprefix("sglang-chunk-align verify: ").rstrip("\n").split("; ")
    assert [line.split(": ")[0] for line in named] == [f"server {server}/get_model_info", f"reference {reference}/get_model_info"]
    assert all("Connection refused" in line for line in named)


def test_a_reference_that_is_down_stops_verify_before_the_server_is_touched(capsys, standin, closed_url):
    """Found before the passes, not after them: nothing is sent to (or flushed on) the server under test."""
    server, reference = standin(), closed_url()
    code, _, err = run_verify(capsys, "--server", server.url, "--reference", reference, *FAST, *IDS)
    assert code == 2 and err.startswith(f"sglang-chunk-align verify: reference {reference}/get_model_info: ")
    assert (server.gets, server.flushes, server.bodies) == (["/get_model_info"], 0, [])


def test_the_reachability_check_comes_first_and_changes_nothing(capsys, standin):
    server, reference = standin(), standin()
    assert run_verify(capsys, "--server", server.url, "--reference", reference.url, *FAST, *IDS)[0] == 0
    # GETs, once each, before any /flush_cache or /generate: reachable, then how their GEMMs sum K
    assert server.gets == reference.gets == ["/get_model_info", "/get_server_info"]


FAST_SUMS = {gemms.SUMS_KEY: gemms.SPLIT_SUMS}  # what a server in fast mode reports (gemms.report_sums)


def test_a_fast_gemm_server_is_refused_against_a_stock_reference_before_anything_is_sent(capsys, standin):
    server, reference = standin(server_info=FAST_SUMS), standin(server_info={})
    code, _, err = run_verify(capsys, "--server", server.url, "--reference", reference.url, *FAST, *IDS)
    assert code == 2
    assert err.startswith(f"sglang-chunk-align verify: their GEMMs sum K differently (server: {gemms.SPLIT_SUMS}; "
                          f"reference: {verify.STOCK_SUMS})")
    assert "against a reference started with it too" in err
    assert (server.flushes, server.bodies, reference.flushes, reference.bodies) == (0, [], 0, [])
    # Both fast: compared as any two servers are.
    assert run_verify(capsys, "--server", server.url, "--reference", standin(server_info=FAST_SUMS).url, *FAST, *IDS)[0] == 0


def test_answers_recorded_from_a_fast_reference_say_so_and_refuse_a_stock_server(capsys, standin, tmp_path):
    cache = str(tmp_path / "fast.json")
    reference = standin(server_info=FAST_SUMS)
    assert run_verify(capsys, "--server", reference.url, "--baseline-cache", cache, *FAST, *IDS)[0] == 0
    assert json.loads(open(cache).read())[gemms.SUMS_KEY] == gemms.SPLIT_SUMS
    stock = standin()
    code, _, err = run_verify(capsys, "--server", stock.url, "--recorded", cache, *FAST, *IDS)
    assert code == 2 and "their GEMMs sum K differently (server: stock's, one K range; recorded: split-k" in err
    assert stock.bodies == []
    # The same file as --baseline-cache of a stock reference: refused before it records anything.
    code, _, err = run_verify(capsys, "--server", stock.url, "--reference", standin().url, "--baseline-cache", cache,
                              *FAST, *IDS)
    assert code == 2 and f"(the answers in {cache}: split-k" in err


@pytest.mark.parametrize(
    "case",
    ["both down", "reference down", "text to a server without a tokenizer", "a bad argument", "an unknown argument",
     "ids without a vocab size"],
)
def test_with_json_an_error_is_a_json_report_on_stdout_too(capsys, standin, closed_url, case):
    """Exit 2 (no report could be made) reads {"ok": false, "error": ...} on stdout, the line on stderr stays."""
    down, up = closed_url(), standin(skip_tokenizer_init=True).url
    args = {
        "both down": ["--server", down, "--reference", closed_url()],
        "reference down": ["--server", up, "--reference", down, *IDS],
        "text to a server without a tokenizer": ["--server", up, *FAST],
        "a bad argument": ["--server", up, "--prompts", "0"],
        "an unknown argument": ["--server", up, "--prompt", "8"],
        "ids without a vocab size": ["--server", up, "--input-ids"],
    }[case]
    with pytest.raises(SystemExit) as exit:
        sys.exit(main(["verify", *args, "--json"]))
    out, err = capsys.readouterr()
    assert exit.value.code == 2
    report = json.loads(out)
    assert list(report) == ["ok", "error"] and report["ok"] is False
    assert report["error"] and report["error"] in err
    if case == "both down":
        assert down in report["error"] and report["error"].count("Connection refused") == 2


def test_help_says_verify_flushes_the_servers_caches(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "verify FLUSHES THE RADIX CACHE of --server before each pass and of the baseline server before each cold " \
        "request: point it only at servers nobody else uses (a live rollout server loses its cache)." in text


@pytest.mark.parametrize(
    "args, bad",
    [
        (["--prompts", "0"], "argument --prompts: '0' is not an integer >= 1"),
        (["--concurrency", "x"], "argument --concurrency: 'x' is not an integer >= 1"),
        (["--timeout", "0"], "argument --timeout: '0' is not a positive number of seconds"),
        (["--workload", "code"], "argument --workload: invalid choice: 'code'"),
        (["--reference", "localhost:30001"], "argument --reference: 'localhost:30001' is not an http:// or https:// URL"),
        (["--input-ids"], "--input-ids and --vocab-size go together"),
        (["--vocab-size", "10"], "--input-ids and --vocab-size go together"),
        (["--recorded", "r.json", "--reference", "http://127.0.0.1:9"], "--recorded is the reference's answers"),
        (["--recorded", "r.json", "--baseline-cache", "b.json"], "--recorded is the reference's answers"),
    ],
)
def test_a_bad_argument_exits_2_naming_it(capsys, args, bad):
    with pytest.raises(SystemExit) as exit:
        main(["verify", "--server", "http://127.0.0.1:1", *args])
    assert exit.value.code == 2
    assert f"sglang-chunk-align verify: error: {bad}" in capsys.readouterr().err


def test_workloads_cover_the_grid_long_prompts_and_shared_prefixes_per_seed():
    ids = verify.TokenIds(VOCAB)
    mixed = verify.mixed_workload(random.Random(1), 32, ids)
    assert mixed == verify.mixed_workload(random.Random(1), 32, ids)
    assert mixed != verify.mixed_workload(random.Random(2), 32, ids)
    assert all(len(turns) == 1 for turns in mixed)
    prompts = [turns[0] for turns in mixed]
    lengths = [len(p.units) for p in prompts]
    assert min(lengths) <= 32 and max(lengths) > 2048
    around_grid = [n for n in lengths if n % PREFILL_Q_TILE_TOKENS in (PREFILL_Q_TILE_TOKENS - 1, 0, 1) and n > 32]
    assert len(around_grid) >= 8
    shared = [p for p in prompts if p.shared]
    assert len(shared) == 8 and all(1000 <= p.shared < len(p.units) for p in shared)
    assert len({tuple(p.units[: p.shared]) for p in shared}) == 2  # two prefixes, four prompts on each
    chat = verify.chat_workload(random.Random(1), 10, verify.Words())
    assert [len(turns) for turns in chat] == [4, 4, 2]
    system = chat[0][0].units[: verify.SYSTEM_PROMPT_TOKENS]
    assert all(turns[0].units[: turns[0].shared] == system for turns in chat)
    assert all(turn.shared is None for turns in chat for turn in turns[1:])  # the turn before, as the server counts it
    assert all(w in verify.WORDS for turns in chat for turn in turns for w in turn.units)


def test_the_tiles_workload_puts_short_prompts_of_every_small_tile_class_beside_long_ones():
    """A long prompt, then two short ones, in turn; over enough prompts every short class appears;
    fixed per seed and drawn apart from the other workloads (its own Random), so adding it changed
    no mixed or chat prompt that recorded answers are kept for."""
    ids = verify.TokenIds(50000)
    tiles = verify.tiles_workload(random.Random(1), 60, ids)
    assert tiles == verify.tiles_workload(random.Random(1), 60, ids) != verify.tiles_workload(random.Random(2), 60, ids)
    lengths = [len(turn.units) for [turn] in tiles]
    assert all(ends_short(n) for n in lengths[::3])
    shorts = [n for i, n in enumerate(lengths) if i % 3]
    assert {next(c for c in verify.SHORT_TILE_CLASSES if c[0] <= n <= c[1]) for n in shorts} == set(
        verify.SHORT_TILE_CLASSES)


def ends_short(length):
    """Whether a prompt of `length` tokens ends in a piece of 1-8 tokens over more than 1024 of KV at
    every chunk of 128-1024 tokens."""
    return length > 1024 and all(1 <= length % chunk <= 8 for chunk in (128, 256, 512, 1024))


def test_long_and_prefixed_prompts_end_in_a_short_piece_at_every_chunk():
    """What puts the grid rules' cases in front of verify: such a last piece runs on a smaller fa2
    tile than its prompt alone unless the rules keep it from running so (SGLANG_CHUNK_ALIGN_RULES=0,
    the records' control, lets it). Half of mixed's prompts and a third of tiles' end so."""
    ids = verify.TokenIds(VOCAB)
    for seed in range(5):
        mixed = [turn for [turn] in verify.mixed_workload(random.Random(seed), 32, ids)]
        assert all(ends_short(len(t.units)) for t in mixed if t.shared)
        assert sum(ends_short(len(t.units)) for t in mixed if not t.shared and len(t.units) > 32) >= 8
        tiles = [len(turn.units) for [turn] in verify.tiles_workload(random.Random(seed), 32, ids)]
        assert sum(map(ends_short, tiles)) == 11


def test_first_difference_counts_a_missing_token_as_different():
    answer = verify.Answer([None, -1.5, -0.25], [(7, -0.5), (8, -0.75)], [7, 8], "", 3, 0)
    shorter = verify.Answer([None, -1.5, -0.25], [(7, -0.5)], [7], "", 3, 0)
    assert verify.first_difference(answer, answer) is None
    assert verify.first_difference(answer, shorter) == ("output", 1)
    assert verify.first_difference(answer, verify.Answer([None, -1.5], [], [], "", 2, 0)) == ("input", 2)


def test_progress_bar_draws_on_a_terminal_only():
    import io

    stream = io.StringIO()
    bar = verify.Progress(enabled=True, stream=stream)
    bar.start("mixed concurrent", 4)
    bar.advance()
    assert stream.getvalue().endswith("\r[#######                       ] 1/4 mixed concurrent\033[K")
    quiet = io.StringIO()
    verify.Progress(enabled=False, stream=quiet).start("mixed", 4)
    assert quiet.getvalue() == ""


def test_a_baseline_cache_is_reused_and_a_wrong_server_is_still_caught(capsys, standin, tmp_path):
    """--baseline-cache: answers recorded against the reference serve later runs, which then send it
    nothing; a request the cache lacks (a wrong server builds other chat prompts) goes to it."""
    cache = str(tmp_path / "baseline.json")
    reference = standin()
    args = ("--reference", reference.url, "--baseline-cache", cache, *FAST, *IDS)
    assert run_json(capsys, "--server", standin().url, *args)[0] == 0
    asked = len(reference.bodies)
    assert asked > 0
    code, again = run_json(capsys, "--server", standin().url, *args)
    assert code == 0 and len(reference.bodies) == asked  # every cold answer came from the file
    wrong = standin(perturb=lambda r: ("output_id", 0) if len(r.tokens) > 300 else None)
    code, report = run_json(capsys, "--server", wrong.url, *args)
    assert code == 1 and failures(report, "mixed", "sequential")
    assert len(reference.bodies) > asked  # the chat turns after a wrong answer were not in the file
    (tmp_path / "baseline.json").write_text("not json")
    code, out, err = run_verify(capsys, "--server", standin().url, *args)
    assert code == 2 and err.count("\n") == 1 and "--baseline-cache" in err


def test_recorded_answers_stand_in_for_a_reference_that_is_gone(capsys, standin, tmp_path):
    """--recorded: the reference's answers, recorded once with --baseline-cache, check a server later
    with no reference running (one GPU, one server at a time); a wrong server still fails, its chat
    follow-ups (built on answers that differed) named as not recorded."""
    cache = str(tmp_path / "reference.json")
    reference = standin()
    assert run_json(capsys, "--server", reference.url, "--baseline-cache", cache, *FAST, *IDS)[0] == 0
    reference.shutdown()
    recorded = pathlib.Path(cache).read_bytes()
    code, report = run_json(capsys, "--server", standin().url, "--recorded", cache, *FAST, *IDS)
    assert code == 0 and (report["baseline"], report["recorded"], report["chunked_vs_unchunked_checked"]) == (
        "recorded", cache, True)
    code, out, _ = run_verify(capsys, "--server", standin().url, "--recorded", cache, *FAST, *IDS)
    assert code == 0 and f"against the reference's answers recorded in {cache}" in out.splitlines()[0]
    wrong = standin(perturb=lambda r: ("output_id", 0) if len(r.tokens) > 300 else None)
    code, report = run_json(capsys, "--server", wrong.url, "--recorded", cache, *FAST, *IDS)
    assert code == 1 and failures(report, "mixed", "sequential")
    assert any("follow-up turns are not in --recorded" in problem for problem in report["problems"])
    assert pathlib.Path(cache).read_bytes() == recorded  # read, never written


def test_recorded_answers_of_another_run_are_refused(capsys, standin, tmp_path):
    cache = str(tmp_path / "reference.json")
    reference = standin()
    assert run_json(capsys, "--server", reference.url, "--baseline-cache", cache, *FAST, *IDS)[0] == 0
    code, _, err = run_verify(capsys, "--server", reference.url, "--recorded", cache, "--seed", "1", *FAST, *IDS)
    assert code == 2 and "holds no answer for a request this run sends alike every time" in err


def test_a_recorded_file_that_is_missing_is_one_line(capsys, standin, tmp_path):
    code, out, err = run_verify(capsys, "--server", standin().url, "--recorded", str(tmp_path / "none.json"), *FAST, *IDS)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--recorded" in err and "No such file" in err


@pytest.mark.parametrize("bad", ["no folder", "a folder"])
def test_a_bad_baseline_cache_path_is_refused_before_any_server_is_asked(capsys, standin, tmp_path, bad):
    """Exit 2 with the path named, no traceback, nothing sent, and nothing (FILE.lock) left behind."""
    folder = tmp_path / "d"
    folder.mkdir()
    path = str(folder / "no" / "x.json") if bad == "no folder" else str(folder)
    server = standin()
    with pytest.raises(SystemExit) as exit:
        main(["verify", "--server", server.url, "--baseline-cache", path, *FAST, *IDS])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"sglang-chunk-align verify: error: argument --baseline-cache: '{path}'" in err
    assert ("is a directory" if bad == "a folder" else f"there is no directory '{folder / 'no'}'") in err
    assert (server.gets, server.flushes, server.bodies) == ([], 0, [])
    assert list(tmp_path.iterdir()) == [folder] and list(folder.iterdir()) == []


def test_a_server_that_is_not_sglang_is_named_at_once_without_its_html(tmp_path):
    """A plain HTTP server (python -m http.server) answers /get_model_info with a 404 page: verify
    says it is not SGLang, names the endpoint, prints no HTML and does not retry."""
    import functools
    from http.server import SimpleHTTPRequestHandler

    plain = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{plain.server_address[1]}"
    try:
        started = time.monotonic()
        result = _python("verify", "--server", url, "--prompts", "1")
        took = time.monotonic() - started
    finally:
        plain.shutdown()
        plain.server_close()
    assert result.returncode == 2 and result.stdout == "" and took < verify.FLUSH_WAIT_S / 3
    assert result.stderr.startswith(f"sglang-chunk-align verify: server {url}/get_model_info: not an SGLang server (HTTP 404")
    assert len(result.stderr.splitlines()) == 1 and "<" not in result.stderr


def test_a_flush_that_sglang_would_not_answer_is_final_not_retried(capsys, standin):
    """Only SGLang's busy answer (400) is retried; a 404 page is named at once, as an HTML page."""
    server = standin(flush_missing=True)
    started = time.monotonic()
    code, out, err = run_verify(capsys, "--server", server.url, *FAST, *IDS)
    assert (code, out) == (2, "") and time.monotonic() - started < verify.FLUSH_WAIT_S / 3
    assert err == (f"sglang-chunk-align verify: {server.url}/flush_cache: HTTP 404: an HTML page titled 'Not Found'\n")


def test_every_chat_turn_ends_in_a_short_piece_once_built():
    """The chat workload's prompts, built turn by turn from a server's answers as a pass builds them
    (run_pass): every one is 1024k plus 1-8 tokens, the first and each follow-up whatever the answers'
    lengths; their turns still extend the conversation before them."""

    class Echo:
        """A server answering each prompt with 3-11 tokens, counted as SGLang counts them."""

        def generate(self, field, request, max_new_tokens):
            output = list(range(3 + len(request.prompt) % 9))
            return verify.Answer([None] * len(request.prompt), [(t, -1.0) for t in output], output, "",
                                 len(request.prompt), 0)

    ids = verify.TokenIds(VOCAB)
    chat = verify.chat_workload(random.Random(3), 12, ids)
    built = {}
    progress = SimpleNamespace(advance=lambda: None)
    verify.run_pass(Echo(), chat, built, ids, SimpleNamespace(max_new_tokens=8), 2, progress)
    lengths = [len(built[c, t].prompt) for c, turns in enumerate(chat) for t in range(len(turns))]
    assert len(lengths) == 12 and all(ends_short(n) for n in lengths), lengths
    for c, turns in enumerate(chat):
        for t in range(1, len(turns)):
            assert built[c, t].prompt[: len(built[c, t - 1].prompt)] == built[c, t - 1].prompt


@pytest.mark.parametrize("interrupt_at, cut", [(20, "chat's sequential pass"), (26, "chat's concurrent pass")])
def test_an_interrupted_verify_reports_the_workloads_it_compared_and_sends_nothing_more(standin, interrupt_at, cut):
    """SIGINT (Ctrl-C, or a device call's time limit) in the middle of chat: mixed, already compared, is
    reported with exit 130, and only the requests in flight are answered: no conversation starts
    another turn (chat: 8 requests in 2 conversations; the server's /generate bodies 17-24 are its
    sequential pass, 25-32 its concurrent one)."""
    server, reference = standin(delay=0.2), standin()
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_chunk_align.tools.cli", "verify", "--server", server.url, "--reference",
         reference.url, *FAST, *IDS, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": pythonpath},
        preexec_fn=sigint_at_default)
    deadline = time.monotonic() + 60
    while len(server.bodies) < interrupt_at and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, (cut, err)
    report = json.loads(out)
    assert report["interrupted"] == "chat" and report["ok"] is False
    assert [p["identical"] for p in report["workloads"]["mixed"]["passes"].values()] == [8, 8]
    assert list(report["workloads"]) == ["mixed"]
    assert any(problem.startswith("interrupted during chat") for problem in report["problems"])
    assert len(server.bodies) <= interrupt_at + 2, cut  # the turns in flight, not the 32 of an uninterrupted run
    assert "Traceback" not in err
