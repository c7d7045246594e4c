"""Every patch point exists, with the shape its wrapper relies on, in every SGLang release in range.

The rest of the suite imports the one SGLang installed in the venv, so it
proves the patch points against that release only. This test reads each
release's wheel as data (zipfile + ast; nothing is installed or imported) and
checks what patches.apply() would resolve there: every point of SGLang's
table (patch_table.py) that patches.release_points() gives for that version,
and the failure guard, which every release needs. The
version gates come from that table, the single source of truth, and so does
what each wrapper relies on in its function (a row's signature, calls and
statements); this file only knows how to find a point in source.

The wheels come from SGLANG_RELEASE_WHEELS, a folder of sglang-<version>-*.whl
files (`pip download --no-deps sglang==<version> -d DIR`). Without it the
module skips; with it, a release whose wheel is missing fails.
"""

import ast
import functools
import os
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_chunk_align import patch_table, prefill_hooks, scheduler_hooks
from sglang_chunk_align.compat import ChunkAlignError
from sglang_chunk_align.patches import Declare, Wrap, release_points
from sglang_chunk_align.releases import MEMORY_BUDGET, NEWEST, RELEASES

WHEELS_ENV = "SGLANG_RELEASE_WHEELS"
if not os.environ.get(WHEELS_ENV):
    pytest.skip(
        f"set {WHEELS_ENV} to a folder of sglang wheels (pip download --no-deps sglang==X); .ci/run does",
        allow_module_level=True,
    )

# The memory budget methods whose wrappers answer a continuation (prefill_hooks.continue_on_grid):
# stock calls them in PrefillAdder.add_chunked_req only.
CONTINUATION_ONLY = ("fit_chunk", "available_chunk_tokens")


class Wheel:
    """One wheel's module sources, parsed on first use."""

    def __init__(self, path):
        self._archive = zipfile.ZipFile(path)  # open for the session: reading its index is the slow part
        self._names = set(self._archive.namelist())
        self._trees = {}

    def source(self, module):
        """The wheel member that holds dotted `module`, or None."""
        base = module.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self._names), None)

    def bindings(self, module):
        """Names bound at the top level of `module`, or None when the wheel lacks it."""
        source = self.source(module)
        if source is None:
            return None
        if source not in self._trees:
            self._trees[source] = ast.parse(self._archive.read(source), source)
        return _bindings(self._trees[source].body)

    def sources_mentioning(self, *needles):
        """(member, parsed module) for every module source that contains one of the byte strings."""
        for name in sorted(self._names):
            if name.endswith(".py"):
                text = self._archive.read(name)
                if any(needle in text for needle in needles):
                    yield name, ast.parse(text, name)

    def imported(self, node):
        """(source module, its bindings) for a one-name `from ... import`; relative ones stay unresolved."""
        source = "." * node.level + (node.module or "")
        return source, self.bindings(source)


@functools.cache
def release_wheel(release):
    folder = Path(os.environ[WHEELS_ENV])
    found = sorted(folder.glob(f"sglang-{release}-*.whl"))
    if not found:
        pytest.fail(
            f"SGLang {release}: no sglang-{release}-*.whl in {folder} "
            f"(pip download --no-deps sglang=={release} -d {folder})"
        )
    return Wheel(found[0])


def _bindings(body):
    """Name -> the statement that binds it last; an import maps to a one-name ImportFrom."""
    bound = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[node.name] = node
        elif isinstance(node, ast.Assign):
            bound.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound[alias.asname or alias.name] = ast.ImportFrom(node.module, [alias], node.level)
    return bound


def point_problems(wheel, point):
    """What the point's resolve() would refuse in `wheel`, plus signature changes."""
    class_name, attribute = point.class_and_attribute
    bound = wheel.bindings(point.module)
    if bound is None:
        return [f"{point.name}: no module {point.module}"]
    if class_name:
        owner = bound.get(class_name)
        if not isinstance(owner, ast.ClassDef):
            return [f"{point.name}: no class {class_name} in {point.module}"]
        bound = _bindings(owner.body)
    stock = bound.get(attribute)
    if isinstance(point, Declare):
        return [f"{point.name}: already defined in SGLang, line {stock.lineno}"] if stock else []
    assert isinstance(point, Wrap), point
    return _wrapped_problems(wheel, point, stock, class_name)


def _wrapped_problems(wheel, point, stock, class_name):
    if isinstance(stock, ast.ImportFrom) and not class_name:
        source, bound = wheel.imported(stock)
        stock = (bound or {}).get(stock.names[0].name)
        where = f"{source} (imported into {point.module})"
    else:
        where = point.module
    if not isinstance(stock, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{point.name}: no def {point.target.split('.')[-1]} in {where}"]
    if point.signature and not _signature_fits(stock.args, point.signature):
        return [f"{point.name}: signature ({ast.unparse(stock.args)}) in {where}, expected ({point.signature})"]
    for callee, keyword in point.calls:
        if not _calls(stock, callee, keyword):
            return [f"{point.name}: no call {callee}({f'{keyword}=...' if keyword else ''}) in {where}"]
    written = {_statement(node) for node in ast.walk(stock) if isinstance(node, ast.stmt)}
    missing = [line for line in point.statements if line not in written]
    if missing:
        return [f"{point.name}: no statement {missing[0]!r} in {where}"]
    if point.wrapper is prefill_hooks.continue_on_grid and not _waits_when_nothing_fits(stock):
        return [f"{point.name}: does not return req when memory_budget.fit_chunk answers None, in {where}"]
    return []


def _statement(node):
    """A statement's first line as ast.unparse writes it (a compound one's header)."""
    return ast.unparse(node).splitlines()[0]


def _waits_when_nothing_fits(function):
    """Whether stock returns the request at once when fit_chunk answers None: the "no grid cut"
    answer of fit_on_grid is that None."""
    for node in ast.walk(function):
        body = getattr(node, "body", None)
        for statement, following in zip(body, body[1:]) if isinstance(body, list) else ():
            if (
                isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)
                and ast.unparse(statement.value.func) == "self.memory_budget.fit_chunk"
                and isinstance(following, ast.If)
                and ast.unparse(following.test) == f"{ast.unparse(statement.targets[0])} is None"
                and [ast.unparse(s) for s in following.body] == ["return req"]
            ):
                return True
    return False


def _calls(function, callee, keyword):
    return any(
        isinstance(node, ast.Call) and ast.unparse(node.func) == callee
        and (keyword is None or any(k.arg == keyword for k in node.keywords))
        for node in ast.walk(function)
    )


def _signature_fits(args, expected):
    head, _, keywords = (part.strip(", ") for part in expected.partition("*"))
    leading = [p.strip() for p in head.split(",")]
    positional = [a.arg for a in args.posonlyargs + args.args]
    if leading[-1] == "...":
        fits = positional[: len(leading) - 1] == leading[:-1]
    else:
        fits = positional == leading and not (args.vararg or args.kwonlyargs or args.kwarg)
    by_keyword = {a.arg for a in args.args + args.kwonlyargs}
    return fits and all(k.strip() in by_keyword for k in keywords.split(",") if k.strip())


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_point_fits_the_release(release):
    guard = patch_table.failure_guard(ChunkAlignError("read from the wheel"))  # installed when apply() fails
    points = [*release_points(patch_table, Version(release)), guard]
    problems = [p for point in points for p in point_problems(release_wheel(release), point)]
    assert not problems, f"SGLang {release}:\n" + "\n".join(problems)


@pytest.mark.parametrize("release", RELEASES)
def test_every_release_loads_plugins_first_in_each_scheduler_process(release):
    """Why an sglang.Engine inside a Ray actor runs the plugin on every release (docs/loading.md, "Ray"): the
    Engine starts each scheduler process with run_scheduler_process (run_scheduler_process_func),
    whose first statement is SGLang's load_plugins(). tests/test_loading.py runs it on the installed one."""
    wheel = release_wheel(release)
    scheduler = wheel.bindings("sglang.srt.managers.scheduler")
    run = scheduler["run_scheduler_process"]
    first = next(n for n in run.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)))
    assert ast.unparse(first) == "load_plugins()"
    assert scheduler["load_plugins"].module == "sglang.srt.plugins"
    engine = wheel.bindings("sglang.srt.entrypoints.engine")["Engine"]
    assert "run_scheduler_process_func: Callable = staticmethod(run_scheduler_process)" in [
        ast.unparse(n) for n in engine.body if isinstance(n, ast.AnnAssign)
    ]


def _wrong(kind, target, value, module="sglang.srt.managers.scheduler"):
    return kind(module, target, value, "deliberately wrong", ">=0")


def _row(wrapper):
    """The patch table's row whose wrapper is `wrapper`."""
    (row,) = [p for p in patch_table.PATCH_POINTS if getattr(p, "wrapper", None) is wrapper]
    return row


def calls_outside(tree, methods, allowed):
    """(where, callee) of each call of an attribute named in `methods` outside the function
    `allowed` ("Class.function"), where being the enclosing "Class.function" or the module."""
    found = []

    def visit(node, where):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            where = f"{where}.{node.name}" if where else node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
            if where != allowed:
                found.append((where or "<module>", ast.unparse(node.func)))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "")
    return found


def _answers_continuations(point):
    return isinstance(point, Wrap) and point.wrapper in (prefill_hooks.ride_on_budget, prefill_hooks.fit_on_grid)


@pytest.mark.parametrize(
    "release", [r for r in RELEASES if any(_answers_continuations(p) for p in release_points(patch_table, Version(r)))]
)
def test_budget_wrappers_answer_continuations_only(release):
    """ride_on_budget and fit_on_grid answer whatever budget call comes while a continuation is cut:
    stock must call those methods for a continuation only (PrefillAdder.add_chunked_req), and no
    budget method may call another one's (super().fit_chunk would apply a wrapper twice)."""
    needles = [f".{method}(".encode() for method in CONTINUATION_ONLY]
    found = [
        f"{name}: {where} calls {callee}"
        for name, tree in release_wheel(release).sources_mentioning(*needles)
        for where, callee in calls_outside(tree, CONTINUATION_ONLY, "PrefillAdder.add_chunked_req")
    ]
    assert not found, f"SGLang {release}:\n" + "\n".join(found)


def test_call_finder_names_the_caller():
    tree = ast.parse(
        "class PrefillAdder:\n    def add_chunked_req(self):\n        self.memory_budget.fit_chunk()\n"
        "class SWAPrefillBudget:\n    def fit_chunk(self):\n        return super().fit_chunk()\n"
    )
    found = calls_outside(tree, CONTINUATION_ONLY, "PrefillAdder.add_chunked_req")
    assert found == [("SWAPrefillBudget.fit_chunk", "super().fit_chunk")]


@pytest.mark.parametrize(
    "point, reported",
    [
        (_wrong(Wrap, "Scheduler.no_such_method", print), "no def no_such_method"),
        (_wrong(Declare, "Scheduler.init_deterministic_inference_config", None), "already defined"),
        (_wrong(Wrap, "NoSuchClass.init_deterministic_inference_config", print), "no class NoSuchClass"),
    ],
)
def test_checker_reports_a_wrong_point(point, reported):
    (problem,) = point_problems(release_wheel(NEWEST), point)
    assert reported in problem


def _before(release):
    return RELEASES[RELEASES.index(release) - 1]


@pytest.mark.parametrize(
    "wrapper, release, reported",
    [
        # The release before the memory budget (0.5.20): its add_chunked_req clamps a
        # continuation itself, no memory budget answers for it.
        (prefill_hooks.continue_on_grid, _before(MEMORY_BUDGET), "no call self.memory_budget.available_chunk_tokens()"),
        # The first with the memory budget (0.5.21) takes the clamp from it, which _stock_clamp does not restate.
        (prefill_hooks.continue_on_grid_by_clamp, MEMORY_BUDGET,
         "no statement '_rem_tokens = min(self.rem_chunk_tokens, int(self.rem_total_tokens))'"),
    ],
)
def test_checker_reports_a_missing_call_or_statement(wrapper, release, reported):
    """A row's contract checked in a release its version gate leaves out."""
    (problem,) = point_problems(release_wheel(release), _row(wrapper))
    assert reported in problem


def test_checker_reports_a_function_that_reads_no_radix_backends():
    """keep_radix_cache_where_exact works only where stock reads the list when called."""
    row = _row(scheduler_hooks.keep_radix_cache_where_exact)
    point = Wrap(row.module, "handle_multi_item_scoring", row.wrapper, "deliberately wrong", ">=0",
                 statements=row.statements)
    (problem,) = point_problems(release_wheel(NEWEST), point)
    assert "no statement 'from sglang.srt.server_args import RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND'" in problem


@pytest.mark.parametrize(
    "source, waits",
    [
        ("def f(self, req):\n    n = self.memory_budget.fit_chunk(extend_input_len=1)\n    if n is None:\n        return req", True),
        ("def f(self, req):\n    n = self.memory_budget.fit_chunk(extend_input_len=1)\n    if n is None:\n        n = 0", False),
    ],
)
def test_wait_check_reads_what_stock_does_when_nothing_fits(source, waits):
    (function,) = ast.parse(source).body
    assert _waits_when_nothing_fits(function) is waits


@pytest.mark.parametrize(
    "source, fits",
    [
        ("def f(self, trunc_len, remaining): ...", True),
        ("def f(self, remaining, trunc_len): ...", False),
        ("def f(self, trunc_len, remaining, extra=None): ...", False),
    ],
)
def test_signature_check_is_exact_without_ellipsis(source, fits):
    (function,) = ast.parse(source).body
    assert _signature_fits(function.args, _row(prefill_hooks.hand_back_ignore_eos_cut).signature) is fits
