"""Phase 1 of the replay benchmark: schedule a workload with SGLang's real PrefillAdder (CPU).

Each configuration's schedule is run by the harness the tests share
(sglang_chunk_align.harness.scheduler_driver: SGLang's own scheduling loop, step by
step, over real SGLang objects); this module runs it over the seeded workload
of workload.py and writes the schedule document the replay reads.
"""

import os
import subprocess
from dataclasses import asdict

from sglang_chunk_align import kernel_facts
from sglang_chunk_align.compat import installed_release
from sglang_chunk_align.harness.scheduler_driver import SchedulerDriver, sglang_config, truncation_align_size

from .workload import CONFIGS, SHAPES, WORKLOAD_SEED, RequestSpec, WorkloadSpec, group_token_lists, make_workload, prompt_tokens


def schedule_workload(spec: WorkloadSpec, configs=CONFIGS, radix_modes=(False, True), page_sizes=(1,), shapes=SHAPES,
                      name="mixed", flashinfer=None):
    """Schedule the workload under every configuration; the schedule document.

    With the grid rules the schedule depends on the model shape (the grid is
    counted in packed rows), so those configurations are scheduled once per
    shape; the others once, with "shape" None. `flashinfer`: the release whose
    kernel facts the plugin plans with (default: the installed one).
    """
    checkout = checkout_state()  # before scheduling: the code that runs is the code imported now
    requests, group_lens = make_workload(spec)
    groups = group_token_lists(group_lens)
    arrivals = [(request, prompt_tokens(request, groups)) for request in requests]
    schedules = []
    facts = kernel_facts.release_facts(flashinfer) if flashinfer else kernel_facts.installed_facts()
    with kernel_facts.chosen(facts):  # scheduling runs no kernel: any release's facts plan it
        _schedule_all(spec, configs, radix_modes, page_sizes, shapes, arrivals, schedules)
    return dict(
        meta=dict(name=name, sglang=installed_release("sglang"), seed=WORKLOAD_SEED, workload=asdict(spec),
                  checkout=checkout, flashinfer_facts=facts.flashinfer),
        requests=[asdict(request) for request in requests],
        group_lens=group_lens,
        schedules=schedules,
    )


def _schedule_all(spec, configs, radix_modes, page_sizes, shapes, arrivals, schedules):
    for page_size in page_sizes:
        for radix in radix_modes:
            for cfg in configs:
                for shape in shapes if cfg.plugin and cfg.rules else (None,):
                    with sglang_config(cfg, radix, page_size) as server_args:
                        align = truncation_align_size(server_args, shape, page_size)
                        result = SchedulerDriver(spec, cfg, radix, align, page_size).run(arrivals)
                    if not any(result["pads"]):
                        del result["pads"]
                        if len(result["calls"]) == len(result["steps"]):  # one call per step: the steps say it
                            del result["calls"]
                    schedules.append(dict(
                        config=cfg.name, radix=radix, page_size=page_size, shape=shape and shape.name,
                        chunk=cfg.chunk, fixed_split=cfg.fixed_split, truncation_align_size=align,
                        plugin=cfg.plugin, **result,
                    ))


def checkout_state():
    """The commit the plugin rows were scheduled with, and whether its package had local edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()

    return dict(commit=git("rev-parse", "HEAD") or None,
                plugin_modified=bool(git("status", "--porcelain", "sglang_chunk_align")))


def load_requests(doc):
    return {r["rid"]: RequestSpec(**r) for r in doc["requests"]}


def donor_runs(schedule):
    """rid -> [(donor rid, start, end)]; JSON turns the rid keys into strings."""
    return {int(rid): [tuple(run) for run in runs] for rid, runs in schedule["donors"].items()}
