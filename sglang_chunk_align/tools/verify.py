"""`sglang-chunk-align verify`: check a running SGLang server bit for bit, end to end.

The CPU tests and the replay benchmark check the scheduler's decisions; only a
live server shows what users get: the plugin loaded in every process, the real
backend, CUDA graphs, the overlap scheduler and the radix tree. This command
sends that server the workloads a deterministic deployment meets and compares
every request's input-token logprobs and generated tokens, bit for bit, with
the same request answered alone and cold (the baseline).

Standard library only, and imported only by the command and by the in-process
check of an sglang.Engine (in_process.py, which reuses check()): it runs on a
client machine without SGLang, and plugin loading in SGLang's processes never
pays for it.

Workloads (deterministic per --seed; --prompts requests each):

- mixed: prompts of 1-32 tokens, at and one token around multiples of the
  128-token q-tile grid, long ones (2049-4104 tokens, several chunks at every
  chunk size), and prompts sharing a long prefix (1000-2500 tokens) so that
  radix hits land off the grid; the long and the prefixed prompts are 1024k
  plus 1-8 tokens, so at chunks of 128-1024 their last piece is a few tokens
  over thousands of KV, which fa2 runs on a smaller tile unless the grid
  rules keep it from running so (SHORT_END);
- chat: conversations of up to 4 turns after a shared system prompt; each
  turn's prompt is the previous turn's prompt, its output and new user text,
  so later turns hit the radix cache; every turn's prompt is 1024k plus 1-8
  tokens too (SHORT_END; the new text's length chosen once the answer before
  it is known);
- tiles: a long prompt (1025-2056 tokens, a short last piece), then two short ones of the small fa2
  tile classes (1-2, 3-8, 9-16, 17-32, 33-64 tokens), in turn: in the
  concurrent pass a long prompt's pieces share prefill batches with short
  prompts, which the plugin's split attention runs as one fa2 call per tile
  class (where the classes differ: at GQA 1, or head_dim 256).

Prompts are random token ids below --vocab-size with --input-ids (for servers
started with --skip-tokenizer-init, such as dummy weights), otherwise words
(about one token each) sent as text.

Every request is greedy (temperature 0) with return_logprob. SGLang serves a
request from the radix cache only up to its logprob_start_len
(Req._compute_max_prefix_len), so logprob_start_len 0 would switch radix hits
off. A request that repeats an earlier one's prefix (a mixed prompt on a shared
prefix, a chat turn) therefore asks for input logprobs from where that prefix
ends: the logprobs of every token computed on top of a hit (and the generated
tokens, which depend on the whole prompt) are compared; other requests from 0.
The baseline gets the identical request.

Passes, each after one /flush_cache of the server under test: `sequential`
(one request at a time, conversations turn by turn) and `concurrent`
(--concurrency requests in flight; a conversation's turns stay in order). The
chat prompts are built from the server's answers in the sequential pass and
then fixed. The baseline sends each prompt alone after a /flush_cache: to
--reference (meant to run with chunked prefill off, so chunked vs unchunked is
checked), or without one to --server itself, which checks concurrency and
cache hits but not chunked vs unchunked (the report says so).

With --baseline-cache FILE the cold answers are recorded, and later runs
against the same baseline reuse them: many servers (chunk sizes, page sizes,
radix on and off) are checked against one reference, in parallel, while the
reference still answers each request alone (the file's lock makes the runs
take turns there).

A chat pass on the server under test that never hits the radix cache checks
no radix hit, so it fails, unless --no-radix says the server runs with the
radix cache off: stock SGLang under deterministic flashinfer, and with the
plugin --disable-radix-cache, SGLANG_CHUNK_ALIGN_RADIX_CACHE=0, or a server where
the grid rules cannot make it exact (each scheduler's startup line says whether
it is on, and why). A baseline request that reports
cached tokens after its /flush_cache was not cold, and a null logprob (NaN or
infinite on the server) compares equal unchecked: both fail too. The baseline
and the passes flush the servers' caches, so run verify where nobody else
sends them requests.

Before anything is sent, both servers must answer as SGLang does (GET
/get_model_info, which changes nothing on them, answered with SGLang's model
info); where neither does, the error names both. Their GEMMs must also sum K
alike (GET /get_server_info: the plugin's fast GEMMs say so there, and give
other bits than stock's), and so must the recorded answers' server.

Exit status: 0 when every request is identical, 1 on any difference or
problem, 2 when a server cannot be reached or answers badly, or an argument is
bad (one line on stderr; with --json also {"ok": false, "error": "..."} on
stdout), 130 when interrupted (Ctrl-C or SIGINT): the report of the workloads
compared before it is printed, with "interrupted" naming the one cut.

--json prints one object with these keys:
  ok, server, reference (null without one), baseline ("reference" or "server"),
  chunked_vs_unchunked_checked, radix_expected, input ("input_ids" or "text"),
  seed, concurrency, max_new_tokens, problems (list of strings),
  workloads: {name: {requests, conversations, prompt_tokens (per request),
    logprob_start_len (per request), baseline_cached_tokens (per request),
    passes: {"sequential"|"concurrent": {requests, identical,
      cached_tokens (per request), cached_tokens_total, requests_with_hit,
      failures: [{request, conversation, turn, prompt_tokens,
                  first_difference ("input" or "output"), index}]}}}},
  interrupted (only when interrupted: the workload it cut).
Requests are numbered conversation by conversation, turn by turn (a mixed
prompt is a conversation of one turn); index is the token's position in the
prompt (input) or among the generated tokens (output).
"""

import argparse
import fcntl
import hashlib
import http.client
import json
import math
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http import HTTPStatus

from ..alignment import PREFILL_Q_TILE_TOKENS
from ..compat import FAST_GEMMS_ENV
from ..gemms import SUMS_KEY
from .arguments import at_least

INTERRUPTED = 128 + 2  # the shell's status for SIGINT
TURNS = 4
SYSTEM_PROMPT_TOKENS = 300
WORDS = (
    "the of and to in is that it for on with as was at by be this from or have an are not but what all "
    "were when we there can been has more if will one so no out up about into than them only other new "
    "some could time these two may then first any like now my such over also back after use our way"
).split()
# The defaults of the command and of the in-process check (in_process.py).
PROMPTS = 32  # requests per workload
CONCURRENCY = 8  # requests in flight in the concurrent pass
MAX_NEW_TOKENS = 8
TIMEOUT_S = 300  # what one request may take
STOCK_SUMS = "stock's, one K range"  # a server whose /get_server_info has no gemms.SUMS_KEY
FLUSH_WAIT_S = 30  # how long a /flush_cache may wait for the server to go idle
RADIX_HINT = (
    "start the server with the radix cache on (the plugin's default under deterministic flashinfer; its startup "
    "line says why where it is off), or pass --no-radix if it runs without one"
)


class ServerError(Exception):
    """A server could not answer as SGLang does; run() prints it on one line and exits 2."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, or a time limit's SIGINT, during check(): `report` holds the workloads compared before it.
    The command prints that report (run()); a library caller (verify_engine) is stopped, as by any Ctrl-C."""

    def __init__(self, report):
        super().__init__(report["interrupted"])
        self.report = report


def add_parser(commands):
    """The `verify` subcommand on cli.py's subparsers; returns it for run()."""
    verifier = commands.add_parser(
        "verify",
        help="compare a running server's logprobs with solo, cold requests",
        description="Send mixed and multi-turn chat workloads to a running SGLang server, sequentially and "
        "concurrently, and compare each request's input logprobs and greedy tokens bit for bit with the same "
        "request sent alone after /flush_cache to --reference (or to --server itself). "
        "verify FLUSHES THE RADIX CACHE of --server before each pass and of the baseline server before each "
        "cold request: point it only at servers nobody else uses (a live rollout server loses its cache).",
        epilog="Exit status: 0 every request identical; 1 a difference, or a chat pass without radix hits; "
        "2 a server unreachable or answering badly, or a bad argument (with --json also "
        '{"ok": false, "error": "..."} on stdout); 130 interrupted (SIGINT), the workloads compared before it '
        "reported.",
    )
    verifier.add_argument("--server", type=_url, required=True, help="URL of the server under test")
    verifier.add_argument("--reference", type=_url, help="URL of a reference server (chunked prefill off)")
    verifier.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all", help="default all")
    verifier.add_argument("--prompts", type=at_least(1), default=PROMPTS, help=f"requests per workload (default {PROMPTS})")
    verifier.add_argument("--concurrency", type=at_least(1), default=CONCURRENCY,
                          help=f"requests in flight in the concurrent pass (default {CONCURRENCY})")
    verifier.add_argument("--seed", type=int, default=0, help="seed of the workloads")
    verifier.add_argument("--max-new-tokens", type=at_least(1), default=MAX_NEW_TOKENS,
                          help=f"greedy tokens generated per request (default {MAX_NEW_TOKENS})")
    verifier.add_argument("--input-ids", action="store_true", help="send token ids (servers with --skip-tokenizer-init)")
    verifier.add_argument("--vocab-size", type=at_least(1), help="with --input-ids: the model's vocab_size; ids are drawn below it")
    verifier.add_argument("--no-radix", action="store_true", help="the server runs without a radix cache: chat need not hit it")
    verifier.add_argument(
        "--baseline-cache", metavar="FILE", type=file_to_write,
        help="reuse cold answers recorded in FILE (JSON) by earlier runs against the same baseline server, "
        "and record new ones there; runs in parallel take turns at the baseline",
    )
    verifier.add_argument(
        "--recorded", metavar="FILE",
        help="check against the reference's cold answers that an earlier run recorded in FILE (--baseline-cache FILE "
        "with --reference, the same --seed, --prompts, --max-new-tokens and input), with no reference running: "
        "one GPU can record the reference, stop it, then serve the server under test; a request FILE lacks is an error",
    )
    verifier.add_argument("--timeout", type=_seconds, default=TIMEOUT_S, help=f"seconds each HTTP call may take (default {TIMEOUT_S})")
    verifier.add_argument("--json", action="store_true", help="print a JSON report")
    return verifier


def _url(text):
    """An argparse type: an http(s) URL with a host, so a typo is refused before anything is sent."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text.rstrip("/")


def file_to_write(text):
    """An argparse type: a file path whose folder exists, not a folder itself, so a bad path is
    refused before any server is asked (the file is written after both passes), and nothing (no
    FILE.lock) is left beside it."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: give a file in it, such as "
                                         f"{os.path.join(text, 'baseline.json')!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: there is no directory {folder!r}")
    return text


def _seconds(text):
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def run(verifier, args):
    if args.input_ids != (args.vocab_size is not None):
        verifier.error("--input-ids and --vocab-size go together: token ids are drawn below the vocab size")
    if args.recorded and (args.reference or args.baseline_cache):
        verifier.error("--recorded is the reference's answers: it takes neither --reference nor --baseline-cache")
    prompts = TokenIds(args.vocab_size) if args.input_ids else Words()
    server = Server(args.server, args.timeout)
    progress = Progress(enabled=not args.json and sys.stderr.isatty())
    baseline = Server(args.reference, args.timeout) if args.reference else server
    try:
        if args.recorded:
            baseline = Recorded(args.recorded)
        check_reachable({"server": server, "reference": baseline} if args.reference else {"server": server})
        report = check(server, baseline, prompts, args, progress)
    except Interrupted as interrupted:
        report = interrupted.report
    except ServerError as error:
        progress.clear()
        print(f"sglang-chunk-align verify: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "error": str(error)}))
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return INTERRUPTED if "interrupted" in report else 0 if report["ok"] else 1


def check(server, baseline, prompts, args, progress):
    """The report of every workload `args` names, sent to `server` and compared with `baseline`'s cold
    answers (a Server, Recorded, or `server` itself); a ServerError stops it, as do GEMMs that sum K
    unlike the baseline's. Shared by the command and the in-process check of an sglang.Engine
    (in_process.py), whose `server` answers as Server does."""
    sums = baseline.gemm_sums()
    if baseline is not server:
        check_same_sums({"server": server.gemm_sums(), baseline_role(args): sums})
    report = {
        "ok": None,
        "server": server.url,
        "reference": args.reference,
        "recorded": args.recorded,
        "baseline": baseline_role(args),
        "chunked_vs_unchunked_checked": bool(args.reference or args.recorded),
        "radix_expected": not args.no_radix,
        "input": prompts.field,
        "seed": args.seed,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "problems": [],
        "workloads": {},
    }
    for name in WORKLOADS if args.workload == "all" else (args.workload,):
        conversations = BUILDERS[name](random.Random(f"{args.seed}:{name}"), args.prompts, prompts)
        try:
            report["workloads"][name] = check_workload(
                name, conversations, server, baseline, prompts, args, progress, report["problems"], sums
            )
        except KeyboardInterrupt:  # the workloads already compared still count
            progress.clear()
            report["ok"], report["interrupted"] = False, name
            report["problems"].append(f"interrupted during {name}: it and the workloads after it were not checked")
            raise Interrupted(report) from None
    report["ok"] = not report["problems"] and all(
        p["identical"] == p["requests"] for w in report["workloads"].values() for p in w["passes"].values()
    )
    return report


# ---------------------------------------------------------------------------
# Workloads: conversations, each a list of turns' new units (token ids or words).
# ---------------------------------------------------------------------------


class TokenIds:
    """Prompts as token ids, for servers started with --skip-tokenizer-init."""

    field = "input_ids"

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def units(self, rng, count):
        return [rng.randrange(self.vocab_size) for _ in range(count)]

    def first(self, units):
        return list(units)

    def follow_up(self, prompt, answer, units):
        return prompt + answer.output_ids + units


class Words:
    """Prompts as text of common words, about one token each, for servers with a tokenizer."""

    field = "text"

    def units(self, rng, count):
        return [rng.choice(WORDS) for _ in range(count)]

    def first(self, units):
        return " ".join(units)

    def follow_up(self, prompt, answer, units):
        return prompt + answer.text + " " + " ".join(units)


@dataclass(frozen=True)
class Turn:
    """One turn's new units, and how many leading units of its prompt an earlier request had.

    `shared` becomes the request's logprob_start_len: SGLang serves a request
    from the radix cache only up to its logprob_start_len
    (Req._compute_max_prefix_len), so a request meant to hit the cache asks for
    the logprobs of the tokens computed on top of the hit, not from 0. None on a
    follow-up turn: the previous turn's prompt and output, counted by the server.
    A follow-up turn's `units` are cut when it is built (follow_up_units), so that
    its whole prompt ends `short_end` units past a SHORT_END_BLOCK.
    """

    units: list
    shared: "int | None" = 0
    short_end: "int | None" = None


# Prompts of SHORT_END_BLOCK * k + r tokens, r in SHORT_END: at every chunk size dividing the block (128,
# 256, 512, 1024), such a prompt's last piece is r tokens over thousands of KV. fa2 runs a piece of at most
# 64 packed rows (8 tokens at GQA 8) on a smaller q tile than the whole prompt gets alone, which changes
# its bits: the grid rules never let such a piece run alone, and where they are off (the exactness
# records' control, SGLANG_CHUNK_ALIGN_RULES=0) these requests differ.
SHORT_END_BLOCK = 1024
SHORT_END = (1, 8)


def short_end(rng, blocks):
    """A prompt length of `blocks` (low, high) SHORT_END_BLOCKs and a short last piece."""
    return SHORT_END_BLOCK * rng.randint(*blocks) + rng.randint(*SHORT_END)


def mixed_workload(rng, count, prompts):
    """Single-turn prompts, a quarter each short, around the grid, long, and on a shared prefix; the
    long ones, and the prefixed ones as wholes, end in a short last piece (short_end)."""
    prefixes = [prompts.units(rng, rng.randint(1000, 2500)) for _ in range(max(1, count // 16))]  # 4 prompts each
    conversations = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            turn = Turn(prompts.units(rng, rng.randint(1, 32)))
        elif kind == 1:
            turn = Turn(prompts.units(rng, PREFILL_Q_TILE_TOKENS * rng.randint(1, 24) + rng.choice((-1, 0, 1))))
        elif kind == 2:
            turn = Turn(prompts.units(rng, short_end(rng, (2, 4))))
        else:
            prefix = prefixes[(i // 4) % len(prefixes)]
            suffix = (short_end(rng, (3, 3)) - len(prefix)) % SHORT_END_BLOCK or SHORT_END_BLOCK
            turn = Turn(prefix + prompts.units(rng, suffix), len(prefix))
        conversations.append([turn])
    rng.shuffle(conversations)
    return conversations


def chat_workload(rng, count, prompts):
    """Conversations of up to TURNS turns, `count` turns in all, after one shared system prompt; every
    turn's whole prompt ends in a short last piece (short_end), the later ones once built."""
    system = prompts.units(rng, SYSTEM_PROMPT_TOKENS)
    conversations = []
    for done in range(0, count, TURNS):
        turns = min(TURNS, count - done)
        first = Turn(system + prompts.units(rng, short_end(rng, (1, 1)) - len(system)), len(system))
        conversations.append([first] + [Turn(prompts.units(rng, SHORT_END_BLOCK), None, rng.randint(*SHORT_END))
                                         for _ in range(turns - 1)])
    return conversations


# Short prompts' lengths, one range per fa2 tile class a short prompt can fall in at some GQA group.
SHORT_TILE_CLASSES = ((1, 2), (3, 8), (9, 16), (17, 32), (33, 64))


def tiles_workload(rng, count, prompts):
    """Single-turn prompts, a long one (ending in a short last piece, short_end) and two short ones in
    turn (see the module's docstring)."""
    conversations = []
    for i in range(count):
        length = short_end(rng, (1, 2)) if i % 3 == 0 else rng.randint(*rng.choice(SHORT_TILE_CLASSES))
        conversations.append([Turn(prompts.units(rng, length))])
    return conversations


BUILDERS = {"mixed": mixed_workload, "chat": chat_workload, "tiles": tiles_workload}
WORKLOADS = tuple(BUILDERS)


# ---------------------------------------------------------------------------
# SGLang's native HTTP API.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One /generate request as sent to every server: its prompt and where its input logprobs start."""

    prompt: "list | str"
    logprob_start_len: int


@dataclass
class Answer:
    """What is compared of one /generate reply, and what the next turn needs."""

    input_logprobs: list  # one value per prompt token from logprob_start_len on; the first is None
    output: list  # (token id, logprob) per generated token
    output_ids: list
    text: str
    prompt_tokens: int
    cached_tokens: int


def baseline_role(args):
    """What the cold answers come from: a running reference, one recorded earlier, or the server itself."""
    return "reference" if args.reference else "recorded" if args.recorded else "server"


class NotRecorded(ServerError):
    """--recorded's file holds no answer for a request."""


class Recorded:
    """The reference's cold answers recorded in a file by an earlier run (--recorded), standing in for
    a reference that is no longer running; they are read, never written."""

    def __init__(self, path):
        self.path, self.url = path, f"answers recorded in {path}"
        try:
            self.answers = BaselineCache.read(path, "--recorded")
        except OSError as error:
            raise ServerError(f"--recorded {path}: {error.strerror or error}") from None

    def flush(self):
        """Recorded answers were cold when recorded."""

    def gemm_sums(self):
        return BaselineCache.recorded_sums(self.answers)

    def generate(self, field, request, max_new_tokens):
        found = BaselineCache.found(self.answers, field, request, max_new_tokens)
        if found is None:
            raise NotRecorded(f"--recorded {self.path} holds no answer for a request this run sends alike every "
                              "time: record it against the reference with this run's --seed, --prompts, "
                              "--max-new-tokens and input")
        return found


def generate_request(field, request, max_new_tokens):
    """The /generate body of a request: greedy, with logprobs from its logprob_start_len. An
    sglang.Engine's generate takes the same keywords (in_process.py)."""
    return {
        field: request.prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": request.logprob_start_len,
    }


def answer_from(where, reply):
    """The Answer in SGLang's reply to one generate request (a decoded /generate body, or what an
    sglang.Engine returns); a ServerError, naming `where`, for an abort or any other shape."""
    try:
        meta = reply["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":  # SGLang answers some aborts with 200
            raise ServerError(f"{where}: request aborted: {finish.get('message')}")
        return Answer(
            input_logprobs=[_null_if_not_finite(entry[0]) for entry in meta["input_token_logprobs"]],
            output=[(entry[1], _null_if_not_finite(entry[0])) for entry in meta["output_token_logprobs"]],
            output_ids=reply["output_ids"],
            text=reply.get("text") or "",
            prompt_tokens=int(meta["prompt_tokens"]),
            cached_tokens=int(meta["cached_tokens"]),
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ServerError(
            f"{where}: not an SGLang reply with logprobs and output ids ({type(error).__name__}: {error})"
        ) from None


def _null_if_not_finite(logprob):
    """A NaN or infinite logprob as None: SGLang's JSON encoder writes them as null, an Engine
    returns the floats, and verify counts nulls (_nulls) the same way for both."""
    return None if isinstance(logprob, float) and not math.isfinite(logprob) else logprob


def retry_while_busy(attempt, wait_s=FLUSH_WAIT_S):
    """Call attempt() until it returns None (done); while it returns the error a busy server gives,
    retry every 0.2 s for up to `wait_s`, then raise that error. A final refusal it raises itself.
    The flushes of a server and of an in-process Engine (in_process.py) wait so."""
    deadline = time.monotonic() + wait_s
    while (busy := attempt()) is not None:
        if time.monotonic() > deadline:
            raise busy
        time.sleep(0.2)


def check_reachable(servers):
    """Raise one ServerError naming every server ({role: Server}) that does not answer as SGLang."""
    unreachable = []
    for role, server in servers.items():
        try:
            server.reach()
        except ServerError as error:
            unreachable.append(f"{role} {error}")
    if unreachable:
        raise ServerError("; ".join(unreachable))


def check_same_sums(sums):
    """Raise a ServerError where the GEMMs of the servers ({role: gemm_sums()}) sum K differently: their
    answers would differ wherever a GEMM does, and the difference would be the modes', not the chunks'."""
    if len(set(sums.values())) > 1:
        raise ServerError(
            "their GEMMs sum K differently (" + "; ".join(f"{role}: {how}" for role, how in sums.items()) + "), so "
            "their bits differ whatever the chunks do. Fast GEMMs are not stock's bits: check a server started "
            f"with {FAST_GEMMS_ENV}=1 against a reference started with it too (--chunked-prefill-size -1, "
            "--disable-radix-cache), and a server without it against one without it")


class Server:
    """One SGLang server's /generate and /flush_cache, every call under a timeout."""

    def __init__(self, url, timeout):
        self.url = url
        self.timeout = timeout

    def generate(self, field, request, max_new_tokens):
        status, reply = self._request("/generate", json.dumps(generate_request(field, request, max_new_tokens)).encode())
        if status != 200:
            raise ServerError(f"{self.url}/generate: HTTP {status}: {_error_text(reply)}")
        try:
            reply = json.loads(reply)
        except ValueError as error:
            raise ServerError(f"{self.url}/generate: not an SGLang reply ({error})") from None
        return answer_from(f"{self.url}/generate", reply)

    def flush(self):
        """Empty the radix cache. SGLang refuses while requests run (HTTP 400, retried); 0.5.23
        waits up to ?timeout for idle. Any other answer is final."""

        def attempt():
            status, reply = self._request(f"/flush_cache?timeout={min(FLUSH_WAIT_S, self.timeout / 2)}", b"")
            if status == 200:
                return None
            refused = ServerError(f"{self.url}/flush_cache: HTTP {status}: {_error_text(reply)}")
            if status != HTTPStatus.BAD_REQUEST:
                raise refused
            return refused

        retry_while_busy(attempt)

    def reach(self):
        """Raise ServerError unless the server answers as SGLang: its model info, a JSON object
        with a model_path, from /get_model_info (every SGLang release has it), which changes nothing
        (/health would run a generate request)."""
        status, reply = self._request("/get_model_info", None)
        try:
            sglang = status == 200 and "model_path" in json.loads(reply)
        except (ValueError, TypeError):
            sglang = False
        if not sglang:
            raise ServerError(f"{self.url}/get_model_info: not an SGLang server (HTTP {status}, not SGLang's "
                              f"model info: {_error_text(reply)})")

    def gemm_sums(self):
        """How the server's batch-invariant GEMMs sum K: what the plugin's fast mode reports in
        /get_server_info (gemms.report_sums), else stock's (stock SGLang, or the plugin without fast mode)."""
        status, reply = self._request("/get_server_info", None)
        try:
            return json.loads(reply).get(SUMS_KEY, STOCK_SUMS) if status == 200 else STOCK_SUMS
        except (ValueError, AttributeError):
            return STOCK_SUMS

    def _request(self, path, data):
        """(status, body) of a POST of `data`, or a GET where `data` is None."""
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out, cut off
            detail = str(getattr(error, "reason", error)) or type(error).__name__
            raise ServerError(f"{self.url}{path.split('?')[0]}: {detail}") from None


def _error_text(reply):
    """SGLang's error message from a reply body, on one line; an HTML page (not SGLang's) by its title."""
    text = reply.decode(errors="replace")
    if text.lstrip().startswith("<"):
        title = re.search(r"<title>(.*?)</title>", text, re.IGNORECASE | re.DOTALL)
        return "an HTML page" + (f" titled {' '.join(title.group(1).split())!r}" if title else "")
    try:
        reply = json.loads(text)
        message = reply.get("error") or reply["detail"]  # SGLang's errors, FastAPI's HTTPException
        text = message.get("message", message) if isinstance(message, dict) else message
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return " ".join(str(text).split())[:500]


# ---------------------------------------------------------------------------
# Passes and the comparison.
# ---------------------------------------------------------------------------


def check_workload(name, conversations, server, baseline, prompts, args, progress, problems, sums):
    """Both passes on the server under test, then each request alone and cold, compared request by
    request; `sums`: how the baseline's GEMMs sum K, kept with the answers it records."""
    requests = [(c, t) for c, turns in enumerate(conversations) for t in range(len(turns))]
    built = {}  # (conversation, turn) -> Request, fixed by the sequential pass
    answers = {}
    for label, concurrency in (("sequential", 1), ("concurrent", args.concurrency)):
        progress.start(f"{name} {label}", len(requests))
        server.flush()
        answers[label] = run_pass(server, conversations, built, prompts, args, concurrency, progress)
    progress.start(f"{name} baseline ({baseline_role(args)}, cold)", len(requests))
    with BaselineCache(args.baseline_cache, sums) as recorded:
        cold, unrecorded = {}, 0
        for key in requests:
            cold[key] = recorded.get(prompts.field, built[key], args.max_new_tokens)
            if cold[key] is None:
                baseline.flush()
                try:
                    cold[key] = baseline.generate(prompts.field, built[key], args.max_new_tokens)
                except NotRecorded:
                    if conversations[key[0]][key[1]].shared is not None:
                        raise  # a prompt every run sends alike: FILE is another run's
                    # A follow-up turn built on an answer that differed: it cannot equal anything recorded.
                    cold[key] = Answer([], [], [], "", answers["sequential"][key].prompt_tokens, 0)
                    unrecorded += 1
                recorded.put(prompts.field, built[key], args.max_new_tokens, cold[key])
            progress.advance()
    progress.clear()
    if unrecorded:
        problems.append(f"{name}: {unrecorded} follow-up turns are not in --recorded {args.recorded}: "
                        "they follow answers that differed from the reference's")

    nulls = sum(_nulls(answer) for got in (cold, *answers.values()) for answer in got.values())
    if nulls:
        problems.append(
            f"{name}: {nulls} logprobs came back null (NaN or infinite on the server), "
            "and nulls compare equal without being checked"
        )
    warm = [key for key in requests if cold[key].cached_tokens]
    if warm:
        problems.append(
            f"{name} baseline: {len(warm)} of {len(requests)} requests to {baseline.url} reported cached tokens "
            "right after /flush_cache, so they were not cold"
        )
    report = {
        "requests": len(requests),
        "conversations": len(conversations),
        "prompt_tokens": [cold[key].prompt_tokens for key in requests],
        "logprob_start_len": [built[key].logprob_start_len for key in requests],
        "baseline_cached_tokens": [cold[key].cached_tokens for key in requests],
        "passes": {},
    }
    for label, got in answers.items():
        report["passes"][label] = result = compare_pass(requests, built, cold, got)
        # One request alone has nothing to hit.
        if name == "chat" and not args.no_radix and len(requests) > 1 and not result["requests_with_hit"]:
            problems.append(f"{name} {label}: the radix cache was never hit on {server.url}: {RADIX_HINT}")
    return report


class BaselineCache:
    """Cold answers recorded by request (--baseline-cache), so that many servers can be checked
    against one reference without asking it the same prompts again.

    A server under test that answers as the reference does builds the same chat
    prompts, so its requests are found; any other request goes to the baseline
    server and is recorded. The file is locked (flock on FILE.lock) from reading
    to writing back, so runs in parallel ask the baseline server one at a time,
    and each request there still runs alone. Without a file, nothing is recorded.
    """

    def __init__(self, path, sums=None):
        self.path, self.sums = path, sums or STOCK_SUMS  # how the recording server's GEMMs sum K
        self.answers = {}

    def __enter__(self):
        if self.path:
            self.lock = open(self.path + ".lock", "w")
            fcntl.flock(self.lock, fcntl.LOCK_EX)
            try:
                self.answers = self.read(self.path, "--baseline-cache")
                check_same_sums({f"the answers in {self.path}": self.recorded_sums(self.answers),
                                 "the baseline": self.sums})
            except FileNotFoundError:
                pass
            except ServerError:
                self._unlock()
                raise
        return self

    @staticmethod
    def recorded_sums(answers):
        """How the GEMMs of the server whose `answers` a file holds summed K (__exit__ writes it)."""
        return answers.get(SUMS_KEY, STOCK_SUMS)

    @staticmethod
    def read(path, option):
        """The answers a file holds; FileNotFoundError where there is none, ServerError where it is not verify's."""
        try:
            with open(path) as file:
                return json.load(file)
        except ValueError as error:
            raise ServerError(f"{option} {path}: not a file verify wrote ({error})") from None

    def __exit__(self, *exc):
        if self.path:
            if self.sums != STOCK_SUMS:
                self.answers[SUMS_KEY] = self.sums
            with open(self.path + ".tmp", "w") as file:
                json.dump(self.answers, file)
            os.replace(self.path + ".tmp", self.path)
            self._unlock()

    def _unlock(self):
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        self.lock.close()

    @staticmethod
    def _key(field, request, max_new_tokens):
        text = json.dumps([field, request.prompt, request.logprob_start_len, max_new_tokens])
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, field, request, max_new_tokens):
        return self.found(self.answers, field, request, max_new_tokens)

    @classmethod
    def found(cls, answers, field, request, max_new_tokens):
        """The Answer recorded in `answers` for a request, or None."""
        found = answers.get(cls._key(field, request, max_new_tokens))
        return None if found is None else Answer(**{**found, "output": [tuple(pair) for pair in found["output"]]})

    def put(self, field, request, max_new_tokens, answer):
        if self.path:
            self.answers[self._key(field, request, max_new_tokens)] = asdict(answer)


def compare_pass(requests, built, cold, got):
    """One pass's report: its answers against the cold ones, request by request, and its cache hits."""
    cached = [got[key].cached_tokens for key in requests]
    failures = []
    for number, key in enumerate(requests):
        difference = first_difference(cold[key], got[key])
        if difference:
            where, index = difference
            failures.append(
                {"request": number, "conversation": key[0], "turn": key[1],
                 "prompt_tokens": cold[key].prompt_tokens, "first_difference": where,
                 "index": index + built[key].logprob_start_len * (where == "input")}
            )
    return {
        "requests": len(requests),
        "identical": len(requests) - len(failures),
        "cached_tokens": cached,
        "cached_tokens_total": sum(cached),
        "requests_with_hit": sum(1 for c in cached if c),
        "failures": failures,
    }


def _nulls(answer):
    """Logprobs SGLang sent as null (its JSON encoder writes NaN and infinities so); the first prompt token's is always null."""
    return answer.input_logprobs[1:].count(None) + sum(logprob is None for _, logprob in answer.output)


def follow_up_units(turn, before):
    """A follow-up turn's new units: as many as bring its prompt (the one before, its output and these)
    to turn.short_end past a SHORT_END_BLOCK; as tokens where prompts are token ids, about so in words."""
    so_far = before.prompt_tokens + len(before.output_ids)
    return turn.units[: (turn.short_end - so_far) % SHORT_END_BLOCK or SHORT_END_BLOCK]


def run_pass(server, conversations, built, prompts, args, concurrency, progress):
    """Every conversation's turns in order, `concurrency` conversations at a time. Interrupted, it
    waits only for the requests in flight: no conversation starts another turn."""
    interrupted = threading.Event()

    def converse(c):
        answers = {}
        for t, turn in enumerate(conversations[c]):
            if interrupted.is_set():
                break
            if (c, t) not in built and turn.shared is None:
                before = answers[c, t - 1]
                prompt = prompts.follow_up(built[c, t - 1].prompt, before, follow_up_units(turn, before))
                built[c, t] = Request(prompt, before.prompt_tokens + len(before.output_ids))
            elif (c, t) not in built:
                built[c, t] = Request(prompts.first(turn.units), turn.shared)
            answers[c, t] = server.generate(prompts.field, built[c, t], args.max_new_tokens)
            progress.advance()
        return answers

    pool = ThreadPoolExecutor(concurrency)
    try:
        return {key: answer for answers in pool.map(converse, range(len(conversations))) for key, answer in answers.items()}
    except KeyboardInterrupt:
        interrupted.set()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def first_difference(want, got):
    """("input", i) or ("output", j) at the first token whose logprob or id differs, or None.

    i counts from the request's logprob_start_len.

    JSON floats round-trip exactly, so != is a bitwise difference.
    """
    at = _first_mismatch(want.input_logprobs, got.input_logprobs)
    if at is not None:
        return "input", at
    at = [i for i in (_first_mismatch(want.output_ids, got.output_ids), _first_mismatch(want.output, got.output)) if i is not None]
    return ("output", min(at)) if at else None


def _first_mismatch(a, b):
    """The first index where two lists differ, a missing item counting as different; None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


class Progress:
    """A plain-text bar on stderr: `[####      ] 12/40 mixed concurrent`."""

    WIDTH = 30

    def __init__(self, enabled, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.label, self.total, self.done = "", 0, 0

    def start(self, label, total):
        self.label, self.total, self.done = label, total, 0
        self._draw()

    def advance(self):
        with self.lock:
            self.done += 1
            self._draw()

    def clear(self):
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def _draw(self):
        if self.enabled:
            filled = self.WIDTH * self.done // max(self.total, 1)
            self.stream.write(f"\r[{'#' * filled}{' ' * (self.WIDTH - filled)}] {self.done}/{self.total} {self.label}\033[K")
            self.stream.flush()


def format_report(report):
    against = {
        "reference": f"reference {report['reference']} (each prompt alone after /flush_cache)",
        "recorded": f"the reference's answers recorded in {report['recorded']}",
        "server": "itself, each prompt alone after /flush_cache",
    }[report["baseline"]]
    lines = [f"sglang-chunk-align verify: {report['server']} against {against}; prompts as {report['input']}"]
    for name, workload in report["workloads"].items():
        tokens = workload["prompt_tokens"]
        conversations = f" in {workload['conversations']} conversations" * (workload["conversations"] < workload["requests"])
        lines.append(f"{name}: {workload['requests']} requests{conversations}, {min(tokens)}-{max(tokens)} prompt tokens")
        for label, result in workload["passes"].items():
            lines.append(
                f"  {label}: {result['identical']} of {result['requests']} identical; "
                f"cached tokens {result['cached_tokens_total']} in {result['requests_with_hit']} of {result['requests']} requests"
            )
            lines += [
                f"    request {f['request']} (conversation {f['conversation']}, turn {f['turn']}, "
                f"{f['prompt_tokens']} prompt tokens): first difference at {f['first_difference']} token {f['index']}"
                for f in result["failures"]
            ]
    if not report["chunked_vs_unchunked_checked"]:
        lines.append(
            "NOT CHECKED: chunked vs unchunked prefill (no --reference); only concurrency and cache hits "
            "against the same server's cold, solo answers"
        )
    lines += [f"FAILED: {problem}" for problem in report["problems"]]
    lines.append("OK: every request identical" if report["ok"] else "NOT OK")
    return "\n".join(lines)
