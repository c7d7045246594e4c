"""The package's three kinds of code, kept apart by where they live, not by a list:

- runtime, `sglang_chunk_align/*.py`: what plugin loading may import (it loads in every SGLang process);
- harness, `sglang_chunk_align/harness/`: real SGLang objects driven without a GPU, for doctor,
  the tests and the benchmarks; it may import the runtime;
- tools, `sglang_chunk_align/tools/`: the user's commands; they may import the runtime and the harness.

Every import inside the package is read from the source (ast), so a new module is covered by
the folder it is put in."""

import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_chunk_align"
# What each kind may import of the package: the layers, bottom up.
MAY_IMPORT = {"runtime": {"runtime"}, "harness": {"runtime", "harness"}, "tools": {"runtime", "harness", "tools"}}


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kind(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or parts[-1] in ("tools", "harness") else "runtime"


def package_imports(path, modules):
    """The package's modules that `path` imports anywhere in its body (lazy imports included):
    `from . import x` names module x, `from .x import f` names module x."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
            targets = submodules or [base]  # `from . import x` imports module x, not the package's names
        else:
            continue
        found |= {t for t in targets if t in modules and t != module}
    return found


def import_graph():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): package_imports(p, modules) for p in paths}


def test_the_graph_is_read_from_every_module_of_the_three_kinds():
    graph = import_graph()
    assert {kind(m) for m in graph} == set(MAY_IMPORT)
    # Sensitive: known edges of each kind are seen, a lazy one among them (apply() imports patches).
    assert "sglang_chunk_align.patches" in graph["sglang_chunk_align"]
    assert "sglang_chunk_align.harness.standins" in graph["sglang_chunk_align.tools.cli"]
    assert "sglang_chunk_align.compat" in graph["sglang_chunk_align.harness.scheduler_driver"]


@pytest.mark.parametrize("module", sorted(import_graph()))
def test_each_module_imports_only_its_own_kind_or_a_lower_one(module):
    wrong = {m for m in import_graph()[module] if kind(m) not in MAY_IMPORT[kind(module)]}
    assert not wrong, f"{module} ({kind(module)}) imports {sorted(wrong)}"


def test_no_import_cycle():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as cycle:
        pytest.fail(f"import cycle: {' -> '.join(cycle.args[1])}")


def test_a_runtime_import_of_a_tool_or_a_cycle_would_be_caught(tmp_path, monkeypatch):
    """The checks above fail on the faults they exist for: a copy of the package with
    compat importing the CLI, and verify importing cli back (the cycle issue 27 removed)."""
    import shutil

    copy = tmp_path / "sglang_chunk_align"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "compat.py").open("a") as f:
        f.write("\n\ndef _late():\n    from .tools import cli\n")
    with (copy / "tools" / "verify.py").open("a") as f:
        f.write("\nfrom . import cli\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", copy)
    with pytest.raises(AssertionError, match=r"compat \(runtime\) imports \['sglang_chunk_align.tools.cli'\]"):
        test_each_module_imports_only_its_own_kind_or_a_lower_one("sglang_chunk_align.compat")
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycle()


def module_path(module):
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def dataclasses_defined(path):
    """The classes `path` decorates with dataclass (plain or called, however imported)."""
    def named_dataclass(decorator):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return (target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)) == "dataclass"

    return [node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and any(map(named_dataclass, node.decorator_list))]


@pytest.mark.parametrize("module", sorted(m for m in import_graph() if kind(m) == "runtime"))
def test_runtime_modules_define_no_dataclass(module):
    """patches.py's import-cost rule, for every module plugin loading may import: a dataclass
    costs each SGLang process ~0.6 ms to define; slots classes and NamedTuples do not."""
    assert dataclasses_defined(module_path(module)) == [], module


def test_a_dataclass_would_be_caught():
    tools = sorted(m for m in import_graph() if kind(m) == "tools")
    found = {m: dataclasses_defined(module_path(m)) for m in tools}
    assert found["sglang_chunk_align.tools.verify"] and found["sglang_chunk_align.tools.probe"]  # the tools may



ROOT = PACKAGE.parent
README = ROOT / "README.md"


def python_versions():
    """setup.cfg's one truth on Python: (python_requires's minimum, the classified 3.x versions in
    order, the SGLang release the [sglang] extra pins)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    classified = sorted((c.rpartition(" :: ")[2] for c in cfg["metadata"]["classifiers"].splitlines()
                         if c.startswith("Programming Language :: Python :: 3.")),
                        key=lambda v: tuple(map(int, v.split("."))))
    return (cfg["options"]["python_requires"].removeprefix(">="), classified,
            cfg["options.extras_require"]["sglang"].strip().removeprefix("sglang=="))


def test_the_readme_states_setup_cfgs_python_versions():
    """README.md's Python statement is setup.cfg's: the minimum, the classified range (starting at
    that minimum) and the SGLang release the [sglang] extra installs."""
    minimum, classified, pinned = python_versions()
    assert classified[0] == minimum
    assert (f"The plugin needs Python {minimum} or newer (classified for {classified[0]} to {classified[-1]}); "
            f"the `[sglang]` extra installs SGLang {pinned}, which needs Python") in " ".join(README.read_text().split())


def test_the_python_the_readme_says_the_extras_sglang_needs_is_its_own():
    """Read from that SGLang's metadata, where it is the one installed."""
    from importlib import metadata

    pinned = python_versions()[2]
    if metadata.version("sglang") != pinned:
        pytest.skip(f"SGLang {pinned}, which the [sglang] extra installs, is not the one installed")
    needed = metadata.metadata("sglang")["Requires-Python"].removeprefix(">=")
    assert (f"installs SGLang {pinned}, which needs Python {needed} or newer."
            in " ".join(README.read_text().split()))


def test_the_readme_shows_install_launch_and_proof_within_its_first_80_lines():
    """Issue 49: what it does, then how to install, launch and prove it, before the measurements;
    the README at most 400 lines (the details live in docs/)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 400
    first = "\n".join(lines[:80])
    for command in ("pip install '.[sglang]' && sglang-chunk-align doctor", "SGLANG_PLUGINS=chunk_align sglang serve",
                    "sglang-chunk-align verify --server"):
        assert command in first, command
