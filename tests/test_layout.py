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
    """Read from that SGLang's wheel (SGLANG_RELEASE_WHEELS, which .ci/run fills), whatever SGLang is
    installed, if any: this module's outcome is the same on every release (tests/conftest.py)."""
    import os
    import zipfile
    from email.parser import Parser

    pinned = python_versions()[2]
    folder = os.environ.get("SGLANG_RELEASE_WHEELS")
    if not folder:
        pytest.skip("set SGLANG_RELEASE_WHEELS to a folder of sglang wheels; .ci/run does")
    (wheel, *_) = sorted(Path(folder).glob(f"sglang-{pinned}-*.whl")) or [None]
    assert wheel is not None, f"no sglang-{pinned}-*.whl in {folder}"
    with zipfile.ZipFile(wheel) as archive:
        needed = Parser().parsestr(archive.read(f"sglang-{pinned}.dist-info/METADATA").decode())["Requires-Python"]
    needed = needed.removeprefix(">=")
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

# Where the package's module attributes must never be reassigned from outside the module: a
# module changes its own state through its own functions (prefill_hooks.activate, say), and
# the tests and the harness reach a module through parameters, observers (prefill_hooks.
# counting_deferrals) or what it chooses for a block (kernel_facts.chosen).
SCANNED = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks"]
SETTERS = {"setattr", "delattr", "object"}  # setattr, monkeypatch.setattr / delattr, mock.patch.object


def module_aliases(tree, path, modules):
    """The names `tree` binds to the package's modules: {local name: module}."""
    inside = path.is_relative_to(PACKAGE)
    module = module_name(path) if inside else ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    aliases[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else PACKAGE.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def reassigned_module_attributes(path, source, modules):
    """`module.name = ...` (or del, +=), setattr(module, ...), monkeypatch.setattr(module, ...) or
    mock.patch.object(module, ...), and monkeypatch.setattr / mock.patch with a dotted name, for
    a package module other than `path`'s own: ["line: module.name", ...]."""
    tree = ast.parse(source)
    aliases = module_aliases(tree, path, modules)
    own = module_name(path) if path.is_relative_to(PACKAGE) else None

    def module_of(node):
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            outer = module_of(node.value)
            return f"{outer}.{node.attr}" if f"{outer}.{node.attr}" in modules else None
        return None

    found = []

    def check(line, module, attribute):
        if module is not None and module != own:
            found.append(f"{line}: {module}.{attribute}")

    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, ast.Attribute):
                check(node.lineno, module_of(target.value), target.attr)
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and name in {"setattr", "delattr", "patch"}:
            dotted, _, attribute = first.value.rpartition(".")
            check(node.lineno, dotted if dotted in modules else None, attribute)
        elif name in SETTERS and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            check(node.lineno, module_of(first), node.args[1].value)
    return found


def package_modules():
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


def test_no_module_attribute_of_the_package_is_reassigned_from_outside_it():
    modules = package_modules()
    found = {
        str(path.relative_to(PACKAGE.parent)): hits
        for root in SCANNED for path in sorted(root.rglob("*.py"))
        if (hits := reassigned_module_attributes(path, path.read_text(), modules))
    }
    assert found == {}


@pytest.mark.parametrize("source, caught", [
    # The scheduler driver's deferral count before prefill_hooks.counting_deferrals.
    ("from .. import prefill_hooks\nprefill_hooks.deferral = counted\n", "2: sglang_chunk_align.prefill_hooks.deferral"),
    ("from sglang_chunk_align import patches\ndef t(monkeypatch):\n    monkeypatch.setattr(patches, 'x', 1)\n",
     "3: sglang_chunk_align.patches.x"),
    ("import sglang_chunk_align.tools.verify as v\nv.FLUSH_WAIT_S += 1\n", "2: sglang_chunk_align.tools.verify.FLUSH_WAIT_S"),
    ("import sglang_chunk_align\nsglang_chunk_align.tools.verify.FLUSH_WAIT_S = 1\n",
     "2: sglang_chunk_align.tools.verify.FLUSH_WAIT_S"),
    ("from unittest import mock\nwith mock.patch('sglang_chunk_align.compat.installed_version'): pass\n",
     "2: sglang_chunk_align.compat.installed_version"),
    ("from .. import prefill_hooks\nprefill_hooks.activate(None)\nstep = prefill_hooks.Step\n", None),
])
def test_a_reassigned_module_attribute_would_be_caught(source, caught):
    path = PACKAGE / "harness" / "scheduler_driver.py"
    assert reassigned_module_attributes(path, source, package_modules()) == ([caught] if caught else [])
