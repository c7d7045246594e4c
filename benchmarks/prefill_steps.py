"""CPU: the prefill steps and radix-hit tokens serving.py's rollouts and agents take under each scheduling
setup, from SGLang's own scheduler (the harness's SchedulerDriver), per model shape and flashinfer release.

Issue 48 holds the plugin to at most 1.02x deterministic triton's prefill steps, with cached tokens
within 2% of triton's. At chunk 256 a prefill step costs about the same on every backend (25.6-27.4 ms
alone on Qwen2.5-7B's shape, benchmarks/README.md), so the steps a setup schedules are a large part of
what its rollouts wait for. Triton's scheduling is plain chunked prefill with the radix cache (SGLang
aligns chunks for flashinfer alone), scheduled here as chunk 256 without alignment. The plugin's is
scheduled with each flashinfer release's kernel facts: on 0.7.2 a radix hit is cut to the q-tile grid
(128/gcd(128, group) tokens) and a prompt's partial final q-tile is not published; 0.7.4's facts take
starts anywhere. Neither publishes generated tokens' KV (decoded rows differ from prefill's).

The workloads are serving.py's requests (its seeds, its lengths), ids drawn below the stand-in model's
vocabulary: rollouts all at once; agents' turns arrive once every conversation's last turn has ended (in
a server a conversation's next turn follows its own answer). Each answer is the stand-in's tokens, which
the next turn's prompt carries, as serving.py's agents carry theirs. Decode runs one step per token; no
time is modelled. A server's counts also hold the warm-up and verify; serving.json now records each
workload's own (real_server.prefill_steps), which is what these predict.

    python -m benchmarks.prefill_steps [--json OUT]

exits 0 and prints a table: steps, prefilled tokens and radix-hit tokens per workload, shape and setup,
with the plugin's steps and hits over triton's.
"""

import argparse
import json
import pathlib
import sys

from sglang_chunk_align import kernel_facts
from sglang_chunk_align.compat import installed_release
from sglang_chunk_align.harness.scheduler_driver import OUTPUT_BASE, SchedulerDriver, sglang_config, truncation_align_size

from .serving import AGENT_ANSWER_TOKENS, agent_parts, rl_requests
from .workload import PAD_CONFIGS, ModelShape, RequestSpec, SchedulingConfig, WorkloadSpec

MODELS = pathlib.Path(__file__).resolve().parent / "models"
# Granite's and Qwen's serving runs, and an odd group no serving run has used (Llama-3.2-3B: GQA 3).
SHAPES = (ModelShape("granite-3.1-8b", 32, 8, 128), ModelShape("qwen2.5-7b", 28, 4, 128),
          ModelShape("llama-3.2-3b", 24, 8, 128))
TRITON = SchedulingConfig("triton-256", 256, deterministic=False)  # no alignment: what SGLang gives triton
SETUPS = ((TRITON, None), *((SchedulingConfig(f"plugin-{chunk}", chunk, plugin=True), release)
                           for release in ("0.7.2", "0.7.4") for chunk in (256, 512, 1024)),
          *((padded, release) for padded in PAD_CONFIGS for release in ("0.7.2", "0.7.4")))
TURN_GAP_STEPS = 10_000  # longer than any turn: a conversation's next turn waits for its answer


def vocab_size(shape):
    """The model's vocabulary (its config in benchmarks/models), which serving.py draws prompt ids below:
    the same ids, so the same lengths, as the GPU run's. Below the stand-in's answers (OUTPUT_BASE)."""
    vocab = json.loads((MODELS / shape.name / "config.json").read_text())["vocab_size"]
    assert vocab <= OUTPUT_BASE, (shape.name, vocab)
    return vocab


def rollouts(vocab, seed=0, groups=16, samples=8):
    """serving.py's rollouts, all arriving at once: (RequestSpec, prompt ids) per sample."""
    plan = rl_requests(seed, vocab, groups, samples)
    return [(RequestSpec(rid, 0, len(prompt), -1, 0, new), prompt) for rid, (prompt, new, _) in enumerate(plan)]


def agent_turns(vocab, seed=0, conversations=8, turns=8):
    """serving.py's agents, turn by turn: each turn's prompt is the last, its answer (the stand-in's tokens
    for that request) and its tool output."""
    prompts, tools = agent_parts(seed, vocab, conversations, turns)
    requests = []
    for turn in range(turns):
        for c in range(conversations):
            rid = len(requests)
            requests.append((RequestSpec(rid, turn * TURN_GAP_STEPS, len(prompts[c]), -1, 0, AGENT_ANSWER_TOKENS),
                             prompts[c]))
            prompts[c] = prompts[c] + [OUTPUT_BASE + rid] * AGENT_ANSWER_TOKENS + tools[c][turn]
    return requests


WORKLOADS = {"rl": rollouts, "agent": agent_turns}


def schedule(requests, cfg, shape, release):
    """SGLang's scheduler over `requests` under `cfg`: its prefill steps, prefilled and radix-hit tokens."""
    pools = WorkloadSpec(len(requests), max(spec.prompt_len for spec, _ in requests), 0, 0.0,
                         max(spec.output_len for spec, _ in requests), 1, 0, kv_tokens=600_000, max_running_requests=256)
    facts = kernel_facts.release_facts(release) if release else kernel_facts.installed_facts()
    with kernel_facts.chosen(facts), sglang_config(cfg, radix=True) as server_args:
        align = truncation_align_size(server_args, shape if cfg.plugin else None)
        result = SchedulerDriver(pools, cfg, True, align).run(requests)
    return {"prefill_steps": result["prefill_steps"], "radix_hit_tokens": result["radix_hit_tokens"],
            "prefilled_tokens": sum(end - start for step in result["steps"] for _, start, end in step)}


def measure(workloads=WORKLOADS, shapes=SHAPES, setups=SETUPS):
    rows = []
    for workload, make in workloads.items():
        for shape in shapes:
            requests = make(vocab_size(shape))
            base = schedule(requests, TRITON, shape, None)
            for cfg, release in setups:
                got = base if cfg is TRITON else schedule(requests, cfg, shape, release)
                rows.append({"workload": workload, "shape": shape.name, "group": shape.group, "setup": cfg.name,
                             "flashinfer_facts": release, **got,
                             "steps_to_triton": round(got["prefill_steps"] / base["prefill_steps"], 3),
                             "hits_to_triton": round(got["radix_hit_tokens"] / max(1, base["radix_hit_tokens"]), 3)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = measure()
    print(f"{'workload':8} {'shape':15} {'setup':12} {'facts':6} {'steps':>6} {'prefilled':>10} {'hits':>8} "
          f"{'steps/triton':>12} {'hits/triton':>11}")
    for r in rows:
        print(f"{r['workload']:8} {r['shape']:15} {r['setup']:12} {r['flashinfer_facts'] or '':6} {r['prefill_steps']:>6} "
              f"{r['prefilled_tokens']:>10} {r['radix_hit_tokens']:>8} {r['steps_to_triton']:>12} {r['hits_to_triton']:>11}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"sglang": installed_release("sglang"), "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
