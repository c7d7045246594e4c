"""Probe (GPU): issue 47's fast mode (sglang_chunk_align/split_k.py) at every split. Does a split-K with
the split fixed for every M stay batch-invariant, and does it beat the bit-compatible configs at decode sizes?

At decode sizes a GEMM streams its weight; with few output tiles, few SMs stream it. The
bit-compatible configs (gemms.py) add tiles by narrowing them, down to 32 columns. A split-K adds
them along K instead: SPLITS programs per tile, each summing its own fixed K range in stock's
BLOCK_K loop into an fp32 partial, then one pass adding the partials in a fixed order (split 0,
then 1, ...) and the bias. The split count is fixed per GEMM shape, never by M, so each output's
sum is one order at every batch size: batch-invariant by construction, with other bits than
stock's (stock has one K range). SPLITS 1 is stock's own sum, so its bits must equal stock's.

For each GEMM of Qwen2.5-7B's shape (benchmarks/gemm_configs.model_gemms), bf16, at each split of
SPLITS with split_k.py's tile for each M (split_k.tile_for):

- batch invariance: each M's rows against the rows of the largest M, and each row of M against
  that row alone (M = 1);
- bits against stock's kernel (expected to match at SPLITS 1 only);
- the control that must fail: the split chosen by M (1 below 17 rows, else 4), whose rows differ
  from the same rows at another M wherever the split changes the sum;
- time (triton.testing.do_bench median) at each M of TIMED_ROWS, beside stock's config, the
  plugin's tuned config (gemms.tune) and cuBLAS; and, for a shape fast mode splits, fast mode as a
  server runs it: its split (split_k.splits_for) with the tiles gemms.split_tiles keeps at startup
  (one program per tile where that gave the split's bits and was faster), whose choice is recorded.

GEMM path: SGLang's Triton kernel (DeepGEMM does not load on the H200 machine's torch 2.11).
Run from the repository root on a GPU:
python3 -m benchmarks.probe_split_k --json benchmarks/logs/gemms_h200/probe_split_k.json
On a CPU: TRITON_INTERPRET=1 python3 -m benchmarks.probe_split_k --stand-in (tiny shapes, the
checks only).
"""

import json
import sys

import triton

from benchmarks.gemm_configs import bench_for, model_gemms, probe_parser, timed_at, until_interrupted, write_json
from sglang_chunk_align import gemms, split_k

SPLITS = split_k.SPLITS
ROWS = (1, 3, 16, 17, 64, 200, 256, 1000)
TIMED_ROWS = (1, 8, 16, 32, 64, 128, 256)
STAND_IN_ROWS = (1, 3, 16, 17, 40)
# Under the interpreter a split sums its partial as the kernel's one K loop would, block by block, so
# only a split of several BLOCK_K blocks regroups the sum (K of 32 and 17 blocks of fp32's 32, the first
# long enough for fast mode to split it, so its tiles are checked too); and fp32 outputs keep the last
# bits that a 16-bit output would mostly round away in so few rows.
STAND_IN_GEMMS = (("qkv", gemms.Shape("float32", 96, 1024, True)), ("down", gemms.Shape("float32", 40, 520, False)))


def run_split(a, b, bias, splits, tile=None):
    """a @ b (+ bias) as the runtime's fast mode runs it (split_k.launch), `splits` K ranges, in one
    program per `tile` (a gemms.Config) or the default launch."""
    return split_k.launch(a, b, a.dtype, bias, splits, gemms.STOCK[gemms.dtype_name(a.dtype)].block_k, config=tile)


def split_by_m(m):
    """The control: a split that changes with the batch, as a non-invariant split-K chooses it."""
    return 1 if m <= 16 else 4


def check(tensors, rows):
    """Batch invariance and bits against stock, per split; and the control. `tensors`: bench.tensors."""
    a, weight, bias = tensors
    b, largest = weight.t(), rows[-1]
    stock = {m: gemms.stock(a[:m], b, a.dtype, bias) for m in rows}

    def run(m, splits):
        return run_split(a[:m], b, bias, splits)

    found = {}
    for splits in SPLITS:
        out = {m: run(m, splits) for m in rows}
        alone = [run_split(a[i:i + 1], b, bias, splits) for i in range(3)]
        found[splits] = {
            "rows_differ_from_largest_m": [m for m in rows if not gemms.same_bits(out[m], out[largest][:m])],
            "rows_differ_from_alone": [m for m in rows if not all(
                gemms.same_bits(out[m][i:i + 1], alone[i]) for i in range(min(m, 3)))],
            "differs_from_stock_at": [m for m in rows if not gemms.same_bits(out[m], stock[m])],
        }
    control = {m: run_split(a[:m], b, bias, split_by_m(m)) for m in rows}
    found["control_rows_differ_from_largest_m"] = [
        m for m in rows if not gemms.same_bits(control[m], control[largest][:m])]
    return found


def timing(bench, shape, tensors, rows):
    """Per M: gemm_configs.timed_at's seconds (stock's config, the tuned one, cuBLAS), and each split's;
    where fast mode splits the shape, its own launch (fast_s) with the tiles split_tiles keeps. Also
    those tiles and any that gave other bits."""
    a, weight, bias = tensors
    tuned, _ = gemms.tune(shape, weight, bias, bench.clock)
    splits = split_k.splits_for(shape.n, shape.k)
    tiles, differing = gemms.split_tiles(shape, weight, bias, splits, tuned, lambda tile, a, b, bias: bench.seconds(
        lambda: run_split(a, b, bias, splits, tile))) if splits > 1 else ({}, [])

    def fast(m):
        tile = tiles.get(gemms.bucket(m))
        return {"fast_s": bench.seconds(lambda: run_split(a[:m], weight.t(), bias, splits, tile)),
                "fast_tile": tile and list(tile)} if splits > 1 else {}

    timed = {m: {**timed_at(bench, tensors, tuned, m),
                 **{f"split_{s}_s": bench.seconds(lambda: run_split(a[:m], weight.t(), bias, s)) for s in SPLITS},
                 **fast(m)}
             for m in rows}
    return timed, {"splits": splits, "tiles": {top: list(t) for top, t in tiles.items()},
                   "tiles_of_other_bits": [list(t) for t in differing]}


def verdict(shapes):
    invariant = all(not s["check"][splits]["rows_differ_from_largest_m"] and not s["check"][splits]["rows_differ_from_alone"]
                    for s in shapes for splits in SPLITS)
    one_split_is_stock = all(not s["check"][1]["differs_from_stock_at"] for s in shapes)
    control_seen = any(s["check"]["control_rows_differ_from_largest_m"] for s in shapes)
    tiles_exact = not any(s["fast_mode"]["tiles_of_other_bits"] for s in shapes)
    return {"batch_invariant_at_every_split": invariant, "one_split_gives_stock_bits": one_split_is_stock,
            "control_seen": control_seen, "fast_mode_tiles_give_the_split_bits": tiles_exact}


def main(argv=None):
    parser = probe_parser(__doc__)
    parser.add_argument("--layers", nargs="+", help="only these of Qwen2.5-7B's GEMMs (qkv, o, gate_up, down, lm_head)")
    args = parser.parse_args(argv)
    bench = bench_for(parser, args)
    if bench is None:
        return 2
    rows, timed_rows = (STAND_IN_ROWS, STAND_IN_ROWS[:2]) if args.stand_in else (ROWS, TIMED_ROWS)
    found = STAND_IN_GEMMS if args.stand_in else [(layer, shape) for layer, shape, _ in model_gemms("qwen2.5-7b", "bfloat16")
                                                  if layer in (args.layers or [layer])]
    shapes = []
    environment = {"gpu": "CPU (Triton interpreter, stand-in)" if args.stand_in else bench.torch.cuda.get_device_name(),
                   "triton": triton.__version__, "gemm_path": "SGLang's batch-invariant Triton kernel (DeepGEMM not loaded)"}

    def document(complete):
        return {"complete": complete, "environment": environment, "splits": SPLITS, "rows": rows, "shapes": shapes,
                "verdict": verdict(shapes)}

    def measure():
        for layer, shape in found:
            print(f"{layer} {shape.key}", file=sys.stderr, flush=True)
            tensors = bench.tensors(shape)
            timed, fast_mode = timing(bench, shape, tensors, timed_rows)
            shapes.append({"layer": layer, "shape": shape._asdict(), "check": check(tensors, rows),
                           "timed": timed, "fast_mode": fast_mode})
            # Written after each shape too: call7's probe ended at the limit's SIGINT without its "interrupted"
            # line (why is not known) and left no JSON of the two shapes it had finished.
            write_json(args.json, document(False))

    doc = document(until_interrupted(measure))
    print(json.dumps(doc["verdict"]))
    for s in shapes:
        for m, t in s["timed"].items():
            print(f"{s['layer']:>8} M={m:>3}: " + ", ".join(
                f"{key[:-2]} {t[key] / t['cublas_s']:.2f}x" for key in t if key.endswith("_s") and key != "cublas_s") + " cuBLAS")
        print(f"{s['layer']:>8} fast mode: {s['fast_mode']}")
    write_json(args.json, doc)
    v = doc["verdict"]
    return 0 if doc["complete"] and all(v.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
