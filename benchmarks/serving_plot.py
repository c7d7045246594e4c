"""The recorded H200 serving run as a figure: each setup's output tokens/s (over stock deterministic
flashinfer's) and longest inter-token gap per workload, from benchmarks/serving.py's JSON and its verify re-check.

    python -m benchmarks.serving_plot [--record DIR] [--out PATH]

Needs matplotlib (the `bench` extra). tests/test_serving_benchmark.py checks the README tables
against the same record, read by recorded_setups().
"""

import argparse
import json
import pathlib

RECORD = pathlib.Path(__file__).parent / "logs" / "serving_h200_granite"
WORKLOADS = ("rl", "agent")
BASELINE = "stock-4096"  # throughput is drawn as a ratio to it, so both workloads read on one axis
# The setups the README shows, in its order: the plugin as a user gets it first.
LABELS = {
    "plugin-256-no-wait": "plugin, 256, radix (the defaults)",
    "plugin-256": "plugin, 256, radix, decode wait on",
    "plugin-1024": "plugin, 1024, radix, decode wait on",
    "stock-4096": "stock det. flashinfer, 4096",
    "triton-256": "stock det. triton, 256, radix",
}


def recorded_setups(record=RECORD):
    """setup -> (verified, {workload: metrics of its first round}) for every setup the run timed.

    `verified` is the re-check's answer (verify.json: each setup's command started again and checked
    against the references' answers the run recorded), since the run's own checks could not reach
    those answers (serving.json says why); None where the re-check did not include the setup."""
    record = pathlib.Path(record)
    timed = json.loads((record / "serving.json").read_text())["setups"]
    rechecked = {s["setup"]: s.get("verify_ok") for s in json.loads((record / "verify.json").read_text())["setups"]}
    return {s["setup"]: (rechecked.get(s["setup"]), s["workloads"]) for s in timed if s.get("workloads")}


def plot(setups, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [name for name in LABELS if name in setups]
    fig, (throughput, gap) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(ran)
    for i, name in enumerate(ran):
        verified, workloads = setups[name]
        xs = [w + (i - (len(ran) - 1) / 2) * width for w in range(len(WORKLOADS))]
        said = " (not verified)" if verified is None else " (verified bit-exact)" if verified else " (NOT exact)"
        relative = [workloads[w]["output_tok_s"] / setups[BASELINE][1][w]["output_tok_s"] for w in WORKLOADS]
        throughput.bar(xs, relative, width, label=LABELS[name] + said)
        gap.bar(xs, [workloads[w]["itl_max_s"] for w in WORKLOADS], width)
    for axis, title in ((throughput, f"output tokens/s over {LABELS[BASELINE]}'s (higher is better)"),
                        (gap, "longest inter-token gap, s (log; lower is better)")):
        axis.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        axis.set_title(title)
    gap.set_yscale("log")
    fig.legend(loc="lower center", ncol=2, frameon=False)
    fig.suptitle("SGLang 0.5.23 on one H200, Granite-3.1-8B's shape (benchmarks/logs/serving_h200_granite)")
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    fig.savefig(out, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", default=str(RECORD))
    parser.add_argument("--out", default=str(RECORD / "serving_h200_granite.png"))
    args = parser.parse_args(argv)
    plot(recorded_setups(args.record), args.out)
    print(args.out)


if __name__ == "__main__":
    main()
