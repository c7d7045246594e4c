"""Loading through SGLang's own plugin loader, and every order of import, apply and
remove, each in a fresh interpreter (the dd-trace-py pattern)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the comma-separated steps in $ORDER, then prints the patch points' state as JSON.
ORDER_SCRIPT = r'''
import json, os
import wrapt
from sglang_chunk_align import patch_table, patches

ABSENT = object()

def owner_dicts():
    state = {}
    for point in patches.release_points(patch_table, patches.installed_version()):
        owner, attribute = point.owner()
        state[point.name] = owner.__dict__.get(attribute, ABSENT)
    return state

stock = None
for step in os.environ["ORDER"].split(","):
    if step == "import":
        stock = owner_dicts()
    elif step == "load_plugins":
        from sglang.srt.plugins import load_plugins
        load_plugins()
    elif step == "load":
        from sglang_chunk_align.plugin import load
        load()
    elif step == "apply":
        patches.apply(patch_table)
    else:
        assert step == "remove", step
        patches.remove()

final = owner_dicts()
print(json.dumps({
    "installed": sorted(patches.installed_names()),
    "present": sorted(n for n, v in final.items() if v is not ABSENT),
    "wrapped": sorted(n for n, v in final.items() if isinstance(v, wrapt.FunctionWrapper)),
    "double_wrapped": sorted(
        n for n, v in final.items()
        if isinstance(v, wrapt.FunctionWrapper) and isinstance(v.__wrapped__, wrapt.FunctionWrapper)
    ),
    "identical_to_stock": stock is not None and all(final[n] is stock[n] for n in final),
}))
'''


@pytest.fixture
def run_order(fresh_python):
    def run(order, plugins="chunk_align"):
        result = fresh_python(ORDER_SCRIPT, ORDER=order, SGLANG_PLUGINS=plugins)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    return run


def _release_points():
    from sglang_chunk_align import patch_table, patches

    return patches.release_points(patch_table, patches.installed_version())


def _all_points():
    return sorted(p.name for p in _release_points())


def _methods():
    from sglang_chunk_align.patches import Wrap

    return sorted(p.name for p in _release_points() if isinstance(p, Wrap))


def _stock_methods_only(state):
    """What stock SGLang has: the wrapped functions, unwrapped, the lists, and no declarations."""
    from sglang_chunk_align.patches import Declare

    stock = sorted(p.name for p in _release_points() if not isinstance(p, Declare))
    return state["present"] == stock and state["wrapped"] == [] and state["installed"] == []


def test_sglang_load_plugins_applies_the_entry_point(run_order):
    state = run_order("load_plugins")
    assert state["installed"] == _all_points()
    assert state["present"] == sorted(p.name for p in _release_points())
    assert state["wrapped"] == _methods()


def test_sglang_load_plugins_skips_it_when_another_plugin_is_selected(run_order):
    assert _stock_methods_only(run_order("load_plugins", plugins="some_other_plugin"))


@pytest.mark.parametrize(
    "order",
    [
        "import,apply",
        "apply,import",
        "import,apply,apply",
        "load_plugins,load,apply",
        "import,apply,remove,apply",
    ],
)
def test_orders_that_end_applied_patch_once(run_order, order):
    state = run_order(order)
    assert state["installed"] == _all_points()
    assert state["wrapped"] == _methods()
    assert state["double_wrapped"] == []


@pytest.mark.parametrize("order", ["import,apply,remove", "import,apply,apply,remove", "import,remove", "import,load,remove,remove"])
def test_orders_that_end_removed_restore_stock_exactly(run_order, order):
    state = run_order(order)
    assert state["identical_to_stock"]
    assert _stock_methods_only(state)


def test_remove_before_import_leaves_stock(run_order):
    assert _stock_methods_only(run_order("apply,remove,import"))


LAZY_SCRIPT = r'''
import json, sys
import sglang.srt.managers.detokenizer_manager  # what a detokenizer process has imported
from sglang.srt.plugins import load_plugins
from sglang_chunk_align import patches
load_plugins()
report = {"scheduler imported by the plugin": "sglang.srt.managers.scheduler" in sys.modules,
          "installed before": sorted(patches.installed_names())}
import sglang.srt.managers.scheduler
report["scheduler points after import"] = sorted(n for n in patches.installed_names() if ".scheduler." in n)
print(json.dumps(report))
'''


def test_points_are_installed_when_sglang_imports_their_module(fresh_python):
    """A process that never schedules does not import the scheduler for the plugin's sake."""
    result = fresh_python(LAZY_SCRIPT, SGLANG_PLUGINS="chunk_align")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["scheduler imported by the plugin"] is False
    assert not any(".managers.scheduler." in name for name in report["installed before"])
    scheduler_points = sorted(p.name for p in _release_points() if p.module == "sglang.srt.managers.scheduler")
    assert report["scheduler points after import"] == scheduler_points


FAILING_ON_IMPORT = r'''
import logging
from sglang_chunk_align import patch_table, patches
from sglang_chunk_align.harness import standins
broken = patches.Declare("sglang.srt.layers.attention.hybrid_attn_backend", "NoSuchBackend.prefill_chunk_align",
                         None, "a point this release does not have")
patch_table.PATCH_POINTS = patch_table.PATCH_POINTS + (broken,)
patches.apply(patch_table)
print("applied:", patches.state())
import sglang.srt.layers.attention.hybrid_attn_backend  # SGLang imports the module: the point fails
print("after the import:", patches.state(), sorted(patches.installed_names()))
try:
    standins.scheduler_alignment(chunk=256)  # the guard goes in with the scheduler module
except RuntimeError as error:
    print("scheduler:", sorted(patches.installed_names()), error)
'''


def test_a_point_failing_when_its_module_is_imported_restores_stock_and_guards(fresh_python):
    result = fresh_python(FAILING_ON_IMPORT)
    assert result.returncode == 0, result.stderr[-3000:]
    applied, after, refused = result.stdout.strip().splitlines()[-3:]
    assert applied == "applied: applied"
    from sglang_chunk_align import patch_table
    from sglang_chunk_align.compat import ChunkAlignError

    assert after == "after the import: guarded []"  # stock everywhere; the guard waits for the scheduler
    guard = patch_table.failure_guard(ChunkAlignError("test"))
    assert refused.startswith(f"scheduler: {[guard.name]!r}")
    assert "NoSuchBackend" in refused and "Refusing to start deterministic flashinfer" in refused
    assert "sglang-chunk-align FAILED: SGLang" in result.stderr and "NoSuchBackend" in result.stderr


def _gates():
    from sglang_chunk_align import compat, patch_table

    return sorted({compat.SUPPORTED_SGLANG, patch_table.GRID_RULES_RELEASES, *(p.versions for p in patch_table.PATCH_POINTS)})


def _near(bound):
    """Versions on either side of a gate's bound, and its own pre-, dev-, post- and local releases."""
    major, minor, patch = bound.split(".")
    return [f"{major}.{minor}.{int(patch) + step}{suffix}" for step in (-1, 0, 1)
            for suffix in ("", "rc1", ".dev0", ".post1", "+local", ".0", ".1")] + [f"1!{bound}"]


def test_version_gates_answer_as_packaging_specifiers_does():
    """compat.admits reads the gates at load time without packaging.specifiers; it must agree with it."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from sglang_chunk_align import compat, releases

    bounds = {clause.strip().lstrip("<>=") for gate in _gates() for clause in gate.split(",") if clause.strip()}
    versions = {Version(v) for v in (*releases.RELEASES, *(n for b in bounds for n in _near(b)))}
    disagree = [(gate, str(v)) for gate in _gates() for v in sorted(versions)
                if compat.admits(gate, v) != SpecifierSet(gate).contains(v, prereleases=True)]
    assert not disagree
    assert len({compat.admits(gate, v) for gate in _gates() for v in versions}) == 2  # the gates do refuse


@pytest.mark.parametrize("gate", [">0.5.12", "==0.5.12", "~=0.5", "0.5.12"])
def test_a_gate_with_another_operator_is_refused(gate):
    from packaging.version import Version

    from sglang_chunk_align import compat

    with pytest.raises(ValueError, match="each clause is >=A or <B"):
        compat.admits(gate, Version("0.5.12"))


# Never imported by plugin loading: the version specifier parser (~5 ms to import), and the user
# tools and the harness, whatever modules those packages hold (tests/test_layout.py keeps the
# runtime from importing them); the plugin loads in every SGLang process.
NOT_LOADED_PREFIXES = ("packaging.specifiers", "sglang_chunk_align.tools", "sglang_chunk_align.harness")


def test_loading_the_plugin_imports_no_version_specifier_parser_and_no_tools_or_harness(fresh_python):
    result = fresh_python(
        "import sys\nfrom sglang_chunk_align.plugin import load\nload()\n"
        f"print(sorted(m for m in sys.modules if m.startswith({NOT_LOADED_PREFIXES!r}) or m == 'sglang_chunk_align.patches'))"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "['sglang_chunk_align.patches']"


# `sglang serve`, the entry point SGLang recommends (0.5.12 to 0.5.23 have it), is the console
# script next to this Python. Its serve() calls load_plugins() and then picks a backend: an
# unknown --model-type is refused right there, before anything needs a model or a GPU.
SGLANG_SERVE = str(Path(sys.executable).with_name("sglang"))
SERVE_ARGS = ["serve", "--model-type", "no-such-backend", "--model-path", "unused"]
# 0.5.23's words, and older releases' (0.5.13: an Exception from _extract_model_type_override).
SERVE_REFUSALS = ("Unknown serve backend 'no-such-backend'", "invalid --model-type 'no-such-backend'")
SERVE_SCRIPT = f"""
import sys
from sglang_chunk_align import patches
from sglang.cli.main import main  # what the `sglang` console script runs
sys.argv = ["sglang", *{SERVE_ARGS!r}]
try:
    main()
except Exception as error:  # ValueError on 0.5.23, a bare Exception on older releases
    print("serve refused:", error)
print("plugin:", patches.state())
"""


def test_sglang_serve_applies_the_plugin_in_its_process(fresh_python):
    """`sglang serve` loads the plugin in its launcher process (which also runs the tokenizer
    manager). The processes it starts are spawned (multiprocessing's spawn start method) and each
    calls load_plugins() itself: run_scheduler_process, run_detokenizer_process and
    run_data_parallel_controller_process, loaded as the tests above load them."""
    assert Path(SGLANG_SERVE).is_file()
    result = fresh_python(SERVE_SCRIPT, SGLANG_PLUGINS="chunk_align")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert any(refusal in lines[-2] for refusal in SERVE_REFUSALS) and lines[-2].startswith("serve refused:")
    assert lines[-1] == "plugin: applied"


# What a framework that hosts sglang.Engine in a Ray actor runs in that actor's process: the Engine
# starts each scheduler as a spawned process (Engine._launch_scheduler_processes,
# mp.Process(target=run_scheduler_process_func) under the spawn method _set_envs_and_config sets),
# and run_scheduler_process (sglang/srt/managers/scheduler.py) calls load_plugins() first.
ENGINE_SCHEDULER_SCRIPT = r'''
import inspect
import json
import multiprocessing
from sglang.srt.entrypoints.engine import Engine
from sglang_chunk_align import patches


class FirstRead:
    """Stands in for ServerArgs in the scheduler process (real ones go on to load a model on a GPU):
    the first read of it reports what the plugin did in that process by then, and ends the process."""

    def __getattr__(self, name):
        if name.startswith("__"):  # pickle's lookups
            raise AttributeError(name)
        print("scheduler process:", patches.state(), json.dumps(sorted(patches.installed_names())), flush=True)
        raise SystemExit(0)


def scheduler_arguments():
    """The release's own parameter list (0.5.13 takes ten, 0.5.23 seven): ranks 0, the rest None."""
    required = [
        p.name for p in inspect.signature(Engine.run_scheduler_process_func).parameters.values()
        if p.default is inspect.Parameter.empty
    ]
    arguments = {name: 0 if name.endswith(("_id", "_rank")) and name != "dp_rank" else None for name in required}
    return {**arguments, "server_args": FirstRead()}


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    scheduler = multiprocessing.Process(target=Engine.run_scheduler_process_func, kwargs=scheduler_arguments())
    scheduler.start()
    scheduler.join()
    print("engine process:", patches.state(), "scheduler exit", scheduler.exitcode)
'''


def test_a_scheduler_process_an_engine_spawns_loads_the_plugin_itself(tmp_path):
    """Why an sglang.Engine inside a Ray actor gets the plugin (docs/loading.md, "Ray"): its schedulers are
    processes that load it through the entry point, before they read their arguments, whatever the
    process that spawned them did. The spawning process here never loads plugins."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.scheduler import run_scheduler_process

    assert Engine.run_scheduler_process_func is run_scheduler_process
    script = tmp_path / "engine_process.py"  # a file: spawn re-imports the main module for FirstRead
    script.write_text(ENGINE_SCHEDULER_SCRIPT)
    env = {**os.environ, "SGLANG_PLUGINS": "chunk_align"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "scheduler exit 0" in result.stdout, result.stdout + result.stderr[-3000:]
    scheduler, engine = result.stdout.splitlines()[-2:]
    assert engine == "engine process: stock scheduler exit 0"
    state, installed = scheduler.removeprefix("scheduler process: ").split(" ", 1)
    # Applied, and patched lazily: the points of the modules imported by then, the scheduler's among them.
    scheduler_points = {p.name for p in _release_points() if p.module == "sglang.srt.managers.scheduler"}
    assert state == "applied" and scheduler_points <= set(json.loads(installed)) <= set(_all_points())


def test_sglang_serve_reports_a_bad_switch_once_with_its_remedy(reported_once):
    """`sglang serve` (SGLang's console script) calls load_plugins() in its own process; the plugin
    reports there, once. SERVE_ARGS makes serve fail right after that, with SGLang's own error."""
    env = {**os.environ, "SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_RULES": "yes"}
    result = subprocess.run([SGLANG_SERVE, *SERVE_ARGS], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and any(r in result.stderr for r in SERVE_REFUSALS), result.stderr[-3000:]  # serve went on
    reported_once(
        result.stderr, "SGLANG_CHUNK_ALIGN_RULES='yes' is not valid", "Fix SGLANG_CHUNK_ALIGN_RULES (1 or 0, or unset)."
    )
