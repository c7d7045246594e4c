"""Compare input logprobs of a chunked and an unchunked server, bit for bit.

This is how the 128-token alignment is checked end to end on a real GPU:
start two servers from examples/launch_server.sh (one chunked, one with
CHUNK=-1), then send the same prompts to both, sequentially and concurrently,
and compare every input-token logprob exactly. Prompts are long enough to
span many 256-token chunks. Standard library only.

    python examples/compare_logprobs.py --chunked http://127.0.0.1:30000 \
        --unchunked http://127.0.0.1:30001
"""

import argparse
import json
import random
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

WORDS = "the of a to in is model token chunk prefill cache tile grid batch query key value head layer".split()


def make_prompts(count, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(50, 3000) for _ in range(count)]  # words, roughly 1.3 tokens each
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in lengths]


class ServerError(Exception):
    """A server could not answer; main() prints it on one line instead of a traceback."""


def input_logprobs(server, prompt):
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    url = server.rstrip("/") + "/generate"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            meta = json.load(response)["meta_info"]
    except (OSError, ValueError) as error:  # URLError, HTTPError, timeouts, a reply that is not SGLang's JSON
        raise ServerError(f"{url}: {getattr(error, 'reason', error)}") from None
    return [entry[0] for entry in meta["input_token_logprobs"]]


def compare(chunked, unchunked, prompts, concurrency):
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda p: input_logprobs(chunked, p), prompts))
        want = list(pool.map(lambda p: input_logprobs(unchunked, p), prompts))
    mismatches = 0
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:  # JSON floats round-trip exactly, so != is a bitwise difference
            first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else "length"
            print(f"  prompt {index} ({len(b)} tokens): differs from token {first}")
            mismatches += 1
    return mismatches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunked", required=True, help="URL of the chunked server")
    parser.add_argument("--unchunked", required=True, help="URL of the unchunked reference server")
    parser.add_argument("--prompts", type=int, default=16, help="number of prompts (50-3000 words each)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the prompts")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight in the concurrent pass")
    args = parser.parse_args()
    prompts = make_prompts(args.prompts, args.seed)
    failed = 0
    for label, concurrency in (("sequential", 1), ("concurrent", args.concurrency)):
        try:
            mismatches = compare(args.chunked, args.unchunked, prompts, concurrency)
        except ServerError as error:
            print(f"compare_logprobs: cannot get logprobs from {error}", file=sys.stderr)
            return 2
        print(f"{label}: {len(prompts) - mismatches}/{len(prompts)} prompts bit-identical")
        failed += mismatches
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
