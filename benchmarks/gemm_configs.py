"""Micro benchmark (GPU): issue 47. Does SGLang's batch-invariant GEMM kernel give stock's bits with
other tile configs, BLOCK_K kept, and how fast is it with the configs the plugin tunes per M?

For every GEMM that reaches SGLang's Triton kernel in the models of MODELS (qkv, o, gate_up, down,
the MoE router and the vocabulary projection, TP 1; gemms.model_shapes' layers), in bf16 and fp16:

- bits: SGLang's kernel with each config of proven_configs() (every config the plugin may tune, and
  wider ones) against stock's config, at every M of ROWS up to 16,384; and stock's own rows at each
  M against its rows at the largest M (batch invariance). cuBLAS (torch's F.linear, SGLang's GEMM
  outside deterministic inference) is the control that must fail: its bits against stock's, and its
  rows against its own at the largest M.
- speed: the plugin's own tuner (gemms.tune, the code a server runs at startup) picks a config per
  bucket; then the median time (triton.testing.do_bench) at each M of TIMED_ROWS of stock's config,
  the tuned one and cuBLAS, and each model's GEMM time per decode step at batch 64.

Weights normal(0, 0.02) and inputs normal(0, 1), seeded, as the well-scaled checkpoints. The GEMM
path: SGLang's Triton kernel, where a full SGLang 0.5.23 install on sm90 would send bf16 GEMMs to
DeepGEMM (docs say which path each figure ran on). Run from the repository root on a GPU:
python3 -m benchmarks.gemm_configs --json benchmarks/logs/gemms_h200/gemm_configs.json
On a CPU, TRITON_INTERPRET=1 python3 -m benchmarks.gemm_configs --stand-in runs the same plan on
tiny shapes under Triton's interpreter, timed by the wall clock: the checks, not the speed.
"""

import argparse
import json
import os
import sys
import time

from sglang_chunk_align import gemms

MODELS = ("qwen2.5-7b", "llama-3.1-8b", "granite-3.1-8b", "qwen3-8b", "gemma-2b", "qwen3-30b-a3b")
DTYPES = ("bfloat16", "float16")
ROWS = (1, 2, 3, 7, 16, 24, 33, 64, 100, 128, 200, 256, 257, 1000, 4096, 16384)
TIMED_ROWS = (1, 8, 16, 32, 64, 128, 256)
DECODE_BATCH = 64
VOCAB_PADDING = 64  # SGLang pads the vocabulary projection's rows to a multiple of 64 (ParallelLMHead)
STAND_IN_ROWS = (1, 3, 16, 24, 64, 100, 256, 300)


def proven_configs(dtype):
    """Every config the plugin may tune for `dtype`, then wider ones (16 and 256 columns, 5 stages, 8 warps)."""
    tunable = {c for top in gemms.BUCKETS for c in gemms.candidates(dtype, top)}
    block_k = gemms.STOCK[dtype].block_k
    wider = {gemms.Config(16, 16, block_k, 4, 4), gemms.Config(16, 256, block_k, 3, 4),
             gemms.Config(32, 64, block_k, 5, 4), gemms.Config(64, 128, block_k, 4, 8),
             gemms.Config(128, 256, block_k, 3, 8)}
    return sorted(tunable | wider)


def model_gemms(name, dtype):
    """[(layer, gemms.Shape, times per decode step)] of benchmarks/models/<name>/config.json at TP 1."""
    path = os.path.join(os.path.dirname(__file__), "models", name, "config.json")
    with open(path) as file:
        config = json.load(file)
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    vocab = -(-config["vocab_size"] // VOCAB_PADDING) * VOCAB_PADDING
    found = [
        ("qkv", gemms.Shape(dtype, (heads + 2 * kv_heads) * head_dim, hidden, qkv_bias), layers),
        ("o", gemms.Shape(dtype, hidden, heads * head_dim, False), layers),
    ]
    if config.get("num_experts"):  # the experts run SGLang's fused MoE kernel; the router is a GEMM
        found.append(("router", gemms.Shape(dtype, config["num_experts"], hidden, False), layers))
    else:
        intermediate = config["intermediate_size"]
        found += [("gate_up", gemms.Shape(dtype, 2 * intermediate, hidden, False), layers),
                  ("down", gemms.Shape(dtype, hidden, intermediate, False), layers)]
    return [*found, ("lm_head", gemms.Shape(dtype, vocab, hidden, False), 1)]


def stand_in_gemms(name, dtype):
    """Tiny shapes for the interpreter, with and without a bias, one not a multiple of 16."""
    return [("qkv", gemms.Shape(dtype, 96, 64, True), 2), ("down", gemms.Shape(dtype, 40, 80, False), 2)]


class Bench:
    """The device-dependent parts: tensors, cuBLAS and the clock."""

    def __init__(self, stand_in):
        import torch

        self.torch = torch
        self.stand_in = stand_in
        self.device = "cpu" if stand_in else "cuda"
        self.rows = STAND_IN_ROWS if stand_in else ROWS
        self.timed_rows = tuple(m for m in TIMED_ROWS if m <= self.rows[-1])
        self.gemms_of = stand_in_gemms if stand_in else model_gemms
        if stand_in:
            from sglang.srt.batch_invariant_ops import batch_invariant_ops as kernels

            kernels.get_device_core_count = lambda *args: 4  # 0 on a CPU: no program would run

    def tensors(self, shape):
        torch = self.torch
        generator = torch.Generator(device=self.device).manual_seed(0)
        dtype = getattr(torch, shape.dtype)

        def normal(*size, std=1.0):
            return (torch.randn(*size, generator=generator, device=self.device) * std).to(dtype)

        weight = normal(shape.n, shape.k, std=0.02)
        bias = normal(shape.n, std=0.02) if shape.bias else None
        return normal(self.rows[-1], shape.k), weight, bias

    def cublas(self, a, weight, bias):
        return self.torch.nn.functional.linear(a, weight, bias)

    def seconds(self, call):
        """The plugin's own GPU clock (gemms.gpu_seconds); the wall clock under the interpreter."""
        if not self.stand_in:
            return gemms.gpu_seconds(call)
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    def clock(self, config, a, b, bias):
        """gemms.tune's clock: one launch of `config`, as gemms.gpu_clock times it on a GPU."""
        return self.seconds(lambda: gemms.launch(a, b, a.dtype, bias, config))


def bits(bench, shape, tensors):
    """Where each config's bits differ from stock's, stock's and cuBLAS's batch invariance, and cuBLAS
    against stock's bits; `tensors`: bench.tensors(shape)."""
    a, weight, bias = tensors
    b, largest = weight.t(), bench.rows[-1]
    stock_rows = {m: gemms.stock(a[:m], b, a.dtype, bias) for m in bench.rows}
    cublas_largest = bench.cublas(a, weight, bias)
    differing = {}
    for config in proven_configs(shape.dtype):
        rows = [m for m in bench.rows if not gemms.same_bits(gemms.launch(a[:m], b, a.dtype, bias, config), stock_rows[m])]
        if rows:
            differing[str(list(config))] = rows
    cublas = {m: bench.cublas(a[:m], weight, bias) for m in bench.rows}
    return {
        "configs_checked": len(proven_configs(shape.dtype)),
        "configs_differing": differing,
        "stock_rows_differ_from_its_largest_m": [
            m for m in bench.rows if not gemms.same_bits(stock_rows[m], stock_rows[largest][:m])],
        "cublas_differs_from_stock_at": [m for m in bench.rows if not gemms.same_bits(cublas[m], stock_rows[m])],
        "cublas_rows_differ_from_its_largest_m": [
            m for m in bench.rows if not gemms.same_bits(cublas[m], cublas_largest[:m])],
    }


def timed_at(bench, tensors, tuned, m):
    """The median seconds of stock's config, the `tuned` one of M's bucket (stock's where none) and
    cuBLAS, at M rows of `tensors` (bench.tensors)."""
    a, weight, bias = tensors
    b, config = weight.t(), tuned.get(gemms.bucket(m))
    stock_s = bench.seconds(lambda: gemms.stock(a[:m], b, a.dtype, bias))
    tuned_s = bench.seconds(lambda: gemms.launch(a[:m], b, a.dtype, bias, config)) if config else stock_s
    return {"stock_s": stock_s, "tuned_s": tuned_s, "tuned_config": list(config) if config else None,
            "cublas_s": bench.seconds(lambda: bench.cublas(a[:m], weight, bias))}


def speed(bench, shape, tensors):
    """The tuned configs and, per timed M, timed_at's seconds."""
    _, weight, bias = tensors
    tuned, differing = gemms.tune(shape, weight, bias, bench.clock)
    return {"tuned": {top: list(c) for top, c in tuned.items()}, "tuner_differing": [list(c) for c in differing],
            "timed": {m: timed_at(bench, tensors, tuned, m) for m in bench.timed_rows}}


def measure(bench, models, dtypes, results, seen):
    """Fills `seen` (shape: its bits and speed) as it goes, and `results` (a row per GEMM) a model at a
    time, so that an interruption keeps every shape measured and no model's decode step half summed."""
    for dtype in dtypes:
        for model in models:
            rows = []
            for layer, shape, per_step in bench.gemms_of(model, dtype):
                if shape not in seen:
                    print(f"{model} {layer} {shape.key}", file=sys.stderr, flush=True)
                    tensors = bench.tensors(shape)
                    seen[shape] = {"shape": shape._asdict(), **bits(bench, shape, tensors),
                                   **speed(bench, shape, tensors)}
                rows.append({"model": model, "layer": layer, "per_decode_step": per_step, "shape": shape.key})
            results += rows


def decode_step_gemms(results, shapes, batch):
    """Per model and dtype: the GEMM seconds of one decode step at `batch` rows (each layer's GEMMs
    times the layers, and the vocabulary projection), stock's config, tuned and cuBLAS."""
    by_key = {gemms.Shape(**s["shape"]).key: s for s in shapes}
    steps = {}
    for row in results:
        timed = by_key[row["shape"]]["timed"].get(batch)
        if timed is None:
            continue
        step = steps.setdefault(f"{row['model']} {row['shape'].split()[0]}", {"stock_s": 0, "tuned_s": 0, "cublas_s": 0})
        for key in step:
            step[key] += timed[key] * row["per_decode_step"]
    return steps


def verdict(shapes):
    differing = sum(bool(s["configs_differing"]) for s in shapes)
    control_failed = sum(bool(s["cublas_differs_from_stock_at"] or s["cublas_rows_differ_from_its_largest_m"])
                         for s in shapes)
    stock_variant = sum(bool(s["stock_rows_differ_from_its_largest_m"]) for s in shapes)
    return {
        "shapes": len(shapes),
        "shapes_with_a_config_differing_from_stock": differing,
        "shapes_where_stock_is_batch_variant": stock_variant,
        "shapes_where_the_cublas_control_failed": control_failed,
        "bit_compatible": differing == 0 and stock_variant == 0,
        "control_seen": control_failed > 0,
    }


def summary(doc):
    lines = [f"{doc['verdict']}" + ("" if doc["complete"] else " INTERRUPTED: the shapes measured before SIGINT")]
    for s in doc["shapes"]:
        key = gemms.Shape(**s["shape"]).key
        for m, t in s["timed"].items():
            lines.append(f"{key:>28} M={m:>5}: stock {t['stock_s'] / t['cublas_s']:5.2f}x cuBLAS, "
                         f"tuned {t['tuned_s'] / t['cublas_s']:5.2f}x ({t['tuned_config']})")
    for model, step in doc["decode_step_gemms"].items():
        lines.append(f"{model}: decode step GEMMs at batch {doc['decode_batch']}: stock {step['stock_s'] * 1e3:.2f} ms, "
                     f"tuned {step['tuned_s'] * 1e3:.2f} ms, cuBLAS {step['cublas_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


def environment(bench):
    import torch
    import triton

    from sglang_chunk_align.compat import installed_version

    return {"torch": torch.__version__, "triton": triton.__version__, "sglang": str(installed_version()),
            "gpu": "CPU (Triton interpreter, stand-in)" if bench.stand_in else torch.cuda.get_device_name(),
            "gemm_path": "SGLang's batch-invariant Triton kernel (DeepGEMM not loaded)"}


def probe_parser(doc):
    """A GEMM probe's arguments: --json and --stand-in."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--json", help="write the JSON document here too")
    parser.add_argument("--stand-in", action="store_true",
                        help="tiny shapes under TRITON_INTERPRET=1 on a CPU: the checks, not the speed")
    return parser


def bench_for(parser, args):
    """The Bench `args` ask for, or None where there is no GPU to run it (said on stderr)."""
    if args.stand_in != (os.environ.get("TRITON_INTERPRET") == "1"):
        parser.error("--stand-in runs under TRITON_INTERPRET=1, and only it does")
    bench = Bench(args.stand_in)
    if not args.stand_in and not bench.torch.cuda.is_available():
        print("needs a CUDA GPU (or --stand-in under TRITON_INTERPRET=1)", file=sys.stderr)
        return None
    return bench


def until_interrupted(fill):
    """Runs `fill` (which keeps its results as it goes): True where it ended, False where SIGINT cut it
    short (the GPU plan's time limit: gpu_steps.sh's `step`), so a probe writes what it has."""
    try:
        fill()
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", file=sys.stderr, flush=True)
        return False
    return True


def write_json(path, doc):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as file:
            json.dump(doc, file, indent=1)


def main(argv=None):
    parser = probe_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    args = parser.parse_args(argv)
    bench = bench_for(parser, args)
    if bench is None:
        return 2
    doc = measured(bench, ["stand-in"] if args.stand_in else args.models, args.dtypes)
    print(summary(doc))
    write_json(args.json, doc)
    return 0 if doc["complete"] and doc["verdict"]["bit_compatible"] and doc["verdict"]["control_seen"] else 1


def measured(bench, models, dtypes):
    """The record of measure(): whole, or, where SIGINT cut it short (the GPU plan's time limit), what was
    measured before it, marked incomplete."""
    started = time.monotonic()
    results, seen = [], {}
    complete = until_interrupted(lambda: measure(bench, models, dtypes, results, seen))
    shapes = list(seen.values())
    return {"environment": environment(bench), "rows": list(bench.rows), "decode_batch": DECODE_BATCH,
            "complete": complete, "results": results, "shapes": shapes, "verdict": verdict(shapes),
            "decode_step_gemms": decode_step_gemms(results, shapes, DECODE_BATCH),
            "seconds": round(time.monotonic() - started, 1)}


if __name__ == "__main__":
    sys.exit(main())
