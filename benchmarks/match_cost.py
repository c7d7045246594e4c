"""What rounding a radix hit to the grid costs: match_on_grid matches the tree a second time.

SGLang's match only caps a hit (max_prefix_len), so a hit that ends off the
grid is matched again at the rounded length; that second match splits the
tree node at the rounded end and touches the matched nodes' LRU time again.
This times Req.init_next_round_input (which calls match_kv_cache) for a
request whose 1000-token hit rounds down to 992 (GQA group 4), stock against
the plugin, interleaved in one process, on SGLang's real UnifiedRadixCache,
and reports the prefix each used. (The extra node the second match splits off
cannot be counted here: 0.5.23's tree core is in Rust.) Run from the repository root (CPU,
SGLang 0.5.23): python -m benchmarks.match_cost [--rounds N] [--matches N]
"""

import argparse
import statistics
import time

from sglang_chunk_align.harness.scheduler_driver import SchedulerDriver, sglang_config, truncation_align_size

from .workload import CONFIGS, SHAPES, SMALL_WORKLOAD, RequestSpec

STOCK = next(c for c in CONFIGS if c.name == "upstream-128")  # the plugin without its rules: stock matching
PLUGIN = next(c for c in CONFIGS if c.name == "plugin-256")
SHAPE = next(s for s in SHAPES if s.name == "g4-d128")
CACHED, OWN = 1000, 500  # tokens: the cached prefix (off the 32-token grid) and the request's own


def time_matches(cfg, matches):
    """Per-call ns of init_next_round_input over a cached prefix, and the prefix it used."""
    with sglang_config(cfg, radix=True) as server_args:
        driver = SchedulerDriver(SMALL_WORKLOAD, cfg, True, truncation_align_size(server_args, SHAPE))
        prefix = list(range(1000, 1000 + CACHED))
        driver.run([(RequestSpec(0, 0, CACHED, -1, 0, 1), prefix)])  # now cached in the tree
        times = []
        for rid in range(1, matches + 1):
            req = driver.make_req(RequestSpec(rid, 0, CACHED + OWN, -1, 0, 1), prefix + [200_000 + rid] * OWN)
            start = time.perf_counter_ns()
            req.init_next_round_input(driver.tree)
            times.append(time.perf_counter_ns() - start)
        return times, req.prefix_len


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="alternating stock/plugin rounds")
    parser.add_argument("--matches", type=int, default=200, help="matches timed per round")
    args = parser.parse_args(argv)
    arms = {"stock": STOCK, "plugin": PLUGIN}
    medians, facts = {name: [] for name in arms}, {}
    for round_index in range(args.rounds):
        for name in list(arms)[:: 1 if round_index % 2 == 0 else -1]:
            times, prefix_len = time_matches(arms[name], args.matches)
            medians[name].append(statistics.median(times) / 1000)
            facts[name] = prefix_len
    ratios = sorted(p / s for s, p in zip(medians["stock"], medians["plugin"]))
    for name in arms:
        print(f"{name}: median {statistics.median(medians[name]):.1f} us per match, prefix used {facts[name]} of {CACHED}")
    print(f"ratio {statistics.median(ratios):.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f} over {args.rounds} rounds); "
          f"+{statistics.median(medians['plugin']) - statistics.median(medians['stock']):.1f} us per rounded hit")


if __name__ == "__main__":
    main()
