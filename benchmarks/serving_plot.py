"""The recorded H200 serving run as a figure: each setup's output tokens/s and longest
inter-token gap per workload (benchmarks/serving.py's SETUP lines, as printed in the run).

    python -m benchmarks.serving_plot [--record PATH] [--out PATH]

Needs matplotlib (the `bench` extra). tests/test_serving_benchmark.py checks the README tables
against the same lines, read by recorded_setups().
"""

import argparse
import ast
import pathlib

LOGS = pathlib.Path(__file__).parent / "logs" / "serving_h200"
RECORD = LOGS / "printed_call2.txt"
WORKLOADS = ("rl", "agent", "interactive", "streamed")
LABELS = {
    "plugin-256": "plugin, chunk 256, radix",
    "stock-4096": "stock det. flashinfer, 4096",
    "triton-256": "stock det. triton, 256, radix",
    "nondet-256": "non-det. flashinfer, 256 (ceiling)",
}


def recorded_setups(path=RECORD):
    """The run's summary lines: setup -> (verify ok, {workload: (wall_s, output_tok_s,
    itl_p99_s, itl_max_s)}); a setup the run did not reach has no workloads."""
    setups = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if line.startswith("SETUP "):
            _, name, verify, rest = line.split(" ", 3)
            setups[name] = (ast.literal_eval(verify), ast.literal_eval(rest[rest.index("{"):rest.index("}") + 1]))
    return setups


def plot(setups, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [name for name in LABELS if setups.get(name, (None, {}))[1]]
    fig, (throughput, gap) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(ran)
    for i, name in enumerate(ran):
        workloads = setups[name][1]
        xs = [w + (i - (len(ran) - 1) / 2) * width for w in range(len(WORKLOADS))]
        verified = "" if setups[name][0] is None else " (verified bit-exact)" if setups[name][0] else " (NOT exact)"
        throughput.bar(xs, [workloads[w][1] for w in WORKLOADS], width, label=LABELS[name] + verified)
        gap.bar(xs, [workloads[w][3] for w in WORKLOADS], width)
    for axis, title in ((throughput, "output tokens/s (higher is better)"),
                        (gap, "longest inter-token gap, s (log; lower is better)")):
        axis.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        axis.set_title(title)
    gap.set_yscale("log")
    fig.legend(loc="lower center", ncol=2, frameon=False)
    fig.suptitle("SGLang 0.5.23 on one H200, Granite-3.1-8B shape (benchmarks/logs/serving_h200)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", default=str(RECORD))
    parser.add_argument("--out", default=str(LOGS / "serving_h200.png"))
    args = parser.parse_args(argv)
    plot(recorded_setups(args.record), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
