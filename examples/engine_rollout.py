"""An RL cycle on an in-process sglang.Engine with the plugin, checked bit for bit.

RL frameworks host SGLang in process and run a cycle: generate rollout groups
with sampling, hand the GPU to the trainer, take the new weights, flush the
cache and generate again. This runs that cycle and checks what reproducibility
means there: the same weights and the same per-sample seeds give the same
rollouts, token for token and logprob for logprob, after weight updates, cache
flushes and memory release in between, and with the requests sent in another
order. It then proves the deployment exact with the in-process check
(`verify_engine`) against a stock, unchunked reference recorded beforehand.

    # 1. The reference: stock SGLang, chunked prefill off, radix off; records verify's answers.
    python examples/engine_rollout.py --model-path MODEL --record-reference reference.json
    # 2. The cycle with the plugin, then the check against that file.
    python examples/engine_rollout.py --model-path MODEL --recorded reference.json --json cycle.json

Each step of the cycle:
  - release and resume the Engine's GPU memory (where --memory-saver: the
    weights are backed up on the CPU, as a trainer sharing the GPU needs);
  - the trainer's update: update_weights_from_tensor with that step's tensors
    (a stand-in trainer writes the final norm's weight, `--param`; each step's
    tensor is a function of the step alone), then flush the cache;
  - the rollouts: --groups prompts, each sampled --samples times at
    temperature 1.0 with a sampling_seed per sample, all sent in one batch so
    that a group's samples share its prompt through the radix cache.
The steps run policies 0, 1, then 0 and 1 again with the requests in reverse
order; each replay must equal its first run exactly, and policy 1 must differ
from policy 0 (the update reached the model). Both runs, the reference and the
check, start by loading policy 0, and the check runs with policy 0 loaded.

A check whose control passes proves little, so a third run is the control:

    # 3. The plugin with its grid rules off (SGLANG_CHUNK_ALIGN_RULES=0), checked the same way.
    python examples/engine_rollout.py --model-path MODEL --control reference.json --json control.json

It runs no cycle, only verify_engine against the reference, and it passes (exit
0) where that check finds it inexact: the record gives the fraction of requests
that differed. Where every request was identical, the check could not see a
broken rule on these weights, and the control fails (exit 1).

--weights says which weights run (benchmarks/random_checkpoint.py): the
checkpoint at --model-path (the default); SGLang's dummy weights from a folder
holding a config.json (--weights dummy, or --dummy; --load-format dummy
--skip-tokenizer-init); or a well-scaled random checkpoint written once from
that config.json (--weights random: normal(0, 0.02), norms 1, biases 0), which
the Engine loads as a real one. The record says which ran.

On dummy weights SGLang draws each parameter's values from the same seed,
so the embedding and the LM head (the same size) hold the same values, and with
a positive final norm the model repeats its last token with probability 1: no
seed can change a sample, and no policy a logprob (the first H200 run showed
exactly that). The dummy policies' norm weights are therefore zero-mean,
DUMMY_NORM_SCALE * N(0, 1), which breaks that echo and spreads the logits
(a standard deviation of about 2), so that each seed draws its own sample. On
real weights a policy is 1 + POLICY_NOISE * N(0, 1): the stand-in trainer
replaces that norm, and the answers change, which is what a new policy does.

Exit status: 0 when every comparison holds and the check passes, 1 otherwise
(each failure named), 2 for bad arguments, a random checkpoint that cannot be
written or an Engine that cannot start.
"""

import argparse
import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import random_checkpoint  # noqa: E402  (run as a script from the repository root)
from benchmarks.real_server import failed_fraction  # noqa: E402

DUMMY_NORM_SCALE = 64.0  # a dummy policy's norm weight: DUMMY_NORM_SCALE * N(0, 1)
POLICY_NOISE = 0.25  # a real model's: 1 + POLICY_NOISE * N(0, 1)


def main(argv=None):
    args = parse(argv)
    reference = bool(args.record_reference)
    # The Engine's scheduler processes load plugins and read switches themselves: set before it starts.
    os.environ["SGLANG_PLUGINS"] = "none" if reference else "chunk_align"
    if args.control:
        os.environ["SGLANG_CHUNK_ALIGN_RULES"] = "0"
    import sglang
    import torch

    from sglang_chunk_align.tools.in_process import verify_engine

    try:
        path, server_args, weights = random_checkpoint.server_weights(args.model_path, args.weights, args.checkpoints, args.weights_seed)
    except random_checkpoint.CheckpointError as error:
        print(f"engine_rollout: {error}", file=sys.stderr)
        return 2
    role = "reference" if reference else "control" if args.control else "plugin"
    record = {"argv": sys.argv[1:] if argv is None else argv, "role": role,
              "weights": weights, "versions": versions(), "problems": []}
    started = time.monotonic()
    try:
        engine = sglang.Engine(**engine_arguments(args, reference, path, server_args))
    except Exception as error:  # SGLang's own refusal (a bad chunk size, say) or a failed start
        print(f"engine_rollout: the Engine did not start: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    record["engine_start_s"] = round(time.monotonic() - started, 1)
    try:
        config = engine.tokenizer_manager.model_config
        policies = Policies(args, config.hidden_size, torch)
        update(engine, policies, 0)
        if reference:
            record["verify"] = verify_engine(engine, record=args.record_reference, radix=False, prompts=args.verify_prompts)
        elif args.control:
            record["verify"] = verify_engine(engine, recorded=args.control, radix=False, prompts=args.verify_prompts)
            record["control_failed_fraction"] = failed_fraction(record)
            if not record["control_failed_fraction"]:
                record["problems"].append("the control (grid rules off) was identical on every request: "
                                          "the check could not see a broken rule on these weights")
        else:
            record["cycle"] = cycle(engine, args, policies, config.vocab_size, record["problems"])
            update(engine, policies, 0)
            if args.recorded:
                record["verify"] = verify_engine(engine, recorded=args.recorded, prompts=args.verify_prompts)
        if "verify" in record and not record["verify"]["ok"] and not args.control:
            record["problems"].append("verify_engine: " + ("; ".join(record["verify"]["problems"]) or "requests differ"))
    finally:
        engine.shutdown()
    record["ok"] = not record["problems"]
    if args.json:
        with open(args.json, "w") as file:
            json.dump(record, file, indent=1)
    print(summary(record))
    return 0 if record["ok"] else 1


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    random_checkpoint.add_arguments(parser)
    parser.add_argument("--chunk", type=int, default=256, help="the plugin's chunked prefill size (default 256)")
    parser.add_argument("--groups", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt, each with its own seed (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--param", default="model.norm.weight", help="the weight the stand-in trainer writes")
    parser.add_argument("--memory-saver", action=argparse.BooleanOptionalAction, default=True,
                        help="release and resume GPU memory between steps (enable_memory_saver; default on)")
    parser.add_argument("--verify-prompts", type=int, default=16, help="verify_engine's prompts per workload (default 16)")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--log-level", default="info", help="the Engine's (info shows the plugin's startup line)")
    roles = parser.add_mutually_exclusive_group()
    roles.add_argument("--record-reference", metavar="FILE", help="run the stock, unchunked reference and record "
                       "verify_engine's answers in FILE, instead of the cycle")
    roles.add_argument("--recorded", metavar="FILE", help="after the cycle, check the Engine against FILE")
    roles.add_argument("--control", metavar="FILE", help="the control: the plugin with its grid rules off, checked "
                       "against FILE instead of the cycle; it passes where it is found inexact")
    parser.add_argument("--json", metavar="FILE", help="write the record as JSON")
    args = parser.parse_args(argv)
    if min(args.groups, args.samples, args.max_new_tokens, args.verify_prompts) < 1:
        parser.error("--groups, --samples, --max-new-tokens and --verify-prompts must be at least 1")
    return args


def engine_arguments(args, reference, path, server_args):
    """The Engine's keywords: deterministic flashinfer; the reference unchunked (its radix cache stays
    off, as stock keeps it there), the plugin at --chunk with the radix cache (its default; the
    control's rules off keep it off); the memory saver for the cycle alone; the weights' path, and
    their server arguments as the Engine's keywords."""
    arguments = dict(
        model_path=path, **engine_keywords(server_args), attention_backend="flashinfer",
        enable_deterministic_inference=True,
        chunked_prefill_size=-1 if reference else args.chunk, mem_fraction_static=args.mem_fraction_static,
        log_level=args.log_level,
    )
    if args.memory_saver and not (reference or args.control):
        arguments.update(enable_memory_saver=True, enable_weights_cpu_backup=True)
    return arguments


def engine_keywords(server_args):
    """sglang.Engine's keywords for server flags: --load-format dummy is load_format="dummy", and a
    flag without a value (--skip-tokenizer-init) is True."""
    keywords, flags = {}, list(server_args)
    while flags:
        name = flags.pop(0).removeprefix("--").replace("-", "_")
        keywords[name] = flags.pop(0) if flags and not flags[0].startswith("--") else True
    return keywords


class Policies:
    """The stand-in trainer: policy k's tensor for --param, a function of k alone (see the docstring
    above for why dummy weights get a zero-mean one)."""

    def __init__(self, args, hidden_size, torch):
        self.name, self.hidden_size, self.torch, self.dummy = args.param, hidden_size, torch, args.weights == "dummy"

    def tensors(self, step):
        noise = self.torch.randn(self.hidden_size, generator=self.torch.Generator().manual_seed(step))
        weight = DUMMY_NORM_SCALE * noise if self.dummy else 1 + POLICY_NOISE * noise
        return [(self.name, weight.to(self.torch.bfloat16))]


def update(engine, policies, step):
    """Load policy `step` in place and flush the cache (its entries were computed with other weights).
    SGLang 0.5.23 takes tensors only inside a weight-update session (begin_weight_update() ..
    end_weight_update()); releases before it have none."""
    session = hasattr(engine, "begin_weight_update")
    if session:
        succeeded("begin_weight_update", engine.begin_weight_update())
    succeeded(f"update_weights_from_tensor({policies.name})", engine.update_weights_from_tensor(policies.tensors(step)))
    if session:
        succeeded("end_weight_update", engine.end_weight_update())
    succeeded("flush_cache", engine.flush_cache())


def succeeded(call, result):
    """Raise where an Engine call answered failure: a (success, message) pair, or an object with both."""
    success, message = result if isinstance(result, tuple) else (result.success, result.message)
    if not success:
        raise RuntimeError(f"{call} failed: {message}")


def cycle(engine, args, policies, vocab_size, problems):
    """Policies 0, 1, 0, 1, the replays in reverse order; each replay compared with its first run."""
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(300, 3000))] for _ in range(args.groups)]
    requests = [(g, s) for g in range(args.groups) for s in range(args.samples)]
    steps, first = [], {}
    for number, (policy, order) in enumerate(((0, 1), (1, 1), (0, -1), (1, -1))):
        if number and args.memory_saver:  # the trainer's turn on the GPU
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
        if number:
            update(engine, policies, policy)
        started = time.monotonic()
        sent = requests[::order]
        replies = engine.generate(
            input_ids=[prompts[g] for g, _ in sent],
            sampling_params=[{"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "sampling_seed": 1000 * g + s}
                             for g, s in sent],
            return_logprob=True,
        )
        seconds = time.monotonic() - started
        answers = {key: rollout(reply) for key, reply in zip(sent, replies)}
        step = {
            "policy": policy, "order": "reverse" if order < 0 else "forward", "seconds": round(seconds, 2),
            "output_tokens": sum(len(a["ids"]) for a in answers.values()),
            "cached_tokens": sum(r["meta_info"]["cached_tokens"] for r in replies),
            "distinct_samples_per_group": [len({digest(answers[g, s]) for s in range(args.samples)})
                                           for g in range(args.groups)],
            "digest": digest([answers[key] for key in requests]),
        }
        if min(step["distinct_samples_per_group"]) < args.samples:
            problems.append(f"policy {policy}: a group's samples came out alike: does each get its own sampling_seed?")
        if policy in first:
            differ = [list(key) for key in requests if answers[key] != first[policy][key]]
            step["identical_to_first_run"] = len(requests) - len(differ)
            step["differing_requests"] = differ
            if differ:
                problems.append(f"policy {policy} again: {len(differ)} of {len(requests)} rollouts differ from its first run")
        else:
            first[policy] = answers
        steps.append(step)
    changed = sum(first[0][key] != first[1][key] for key in requests)
    if not changed:
        problems.append("policy 1's rollouts equal policy 0's: the weight update did not reach the model")
    return {"prompt_tokens": [len(p) for p in prompts], "requests_per_step": len(requests), "steps": steps,
            "rollouts_changed_by_the_update": changed}


def rollout(reply):
    """What is compared of one sampled reply: its tokens and their logprobs (floats compare bitwise)."""
    meta = reply["meta_info"]
    return {"ids": list(reply["output_ids"]), "logprobs": [entry[0] for entry in meta["output_token_logprobs"]]}


def digest(value):
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def versions():
    import importlib.metadata as metadata

    found = {}
    for name in ("sglang", "flashinfer-python", "torch", "sglang-chunk-align"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def summary(record):
    lines = [f"engine_rollout ({record['role']}): the Engine started in {record.get('engine_start_s')} s"]
    for step in record.get("cycle", {}).get("steps", ()):
        same = f", identical to the first run: {step['identical_to_first_run']}" if "identical_to_first_run" in step else ""
        lines.append(f"  policy {step['policy']} ({step['order']}): {step['output_tokens']} tokens in {step['seconds']} s, "
                     f"cached tokens {step['cached_tokens']}, distinct samples per group "
                     f"{min(step['distinct_samples_per_group'])}-{max(step['distinct_samples_per_group'])}{same}")
    if "cycle" in record:
        lines.append(f"  the update changed {record['cycle']['rollouts_changed_by_the_update']} of "
                     f"{record['cycle']['requests_per_step']} rollouts")
    if "verify" in record:
        verified = record["verify"]
        counts = ", ".join(f"{name} {p['identical']}/{p['requests']} {label}" for name, w in verified["workloads"].items()
                           for label, p in w["passes"].items())
        lines.append(f"  verify_engine ({verified['baseline']}): {counts}")
    if "control_failed_fraction" in record:
        lines.append(f"  the control (grid rules off) differed on {record['control_failed_fraction']:.1%} of its requests")
    lines += [f"FAILED: {problem}" for problem in record["problems"]]
    lines.append("OK" if record["ok"] else "NOT OK")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
