"""The generic installer: patch points of two kinds, put in and taken out exactly.

SGLang's own points are a table of their own (patch_table.py), handed to
apply(): any object with PATCH_POINTS (a tuple of points), failure_guard(error)
(the point installed when patching fails) and reset() (called once stock is
restored, to forget what the hooks activated).

apply() checks the SGLang version, resolves every point that the version
gates select, and changes nothing unless all of them are found: a missing or
changed point raises ChunkAlignError naming the version and the symbol.
Each installed point is a Site that records what its owner's __dict__ held
(never read through getattr, which would bind descriptors), so remove()
restores stock exactly and apply() twice is a no-op.

A point is one of two kinds, each with its own check, install and restore:
Wrap (a wrapt wrapper around a function SGLang has) and Declare (a new
attribute SGLang lacks).

No two points a release selects may share a target (their version ranges
would overlap, and the second wrapper would hide the first from remove()),
and an install that fails partway is rolled back before the error is raised.

Why wrapt and not SGLang's own plugins/hook_registry.py: hooks go in lazily, per module, when
SGLang imports it (post-import hooks); remove() restores exactly what was there; each point has a
version range; and a failed install leaves a guard that refuses deterministic flashinfer.
"""

import importlib
import logging
import sys
import threading

import wrapt

from .compat import ChunkAlignError, admits, check_sglang_version, installed_version

logger = logging.getLogger("sglang_chunk_align")

ALL_RELEASES = ""  # every release compat.SUPPORTED_SGLANG admits
_ABSENT = object()  # what an owner's __dict__ holds for an attribute it lacks


# The import-cost rule for every module plugin loading imports (it loads in every SGLang
# process): no dataclasses. Defining one costs ~0.6 ms (its generated methods are compiled at
# import); four of them were 3.3 of the plugin's 5.5 ms of module imports (python -X importtime,
# bytecode compiled, 2-core CPU). Objects are plain classes with __slots__ (~0.01 ms); immutable
# values that need equality or _replace are typing.NamedTuple (~0.1 ms). The tools may use dataclasses.
class PatchPoint:
    """What every kind shares: where the point goes, which releases select it, and why."""

    __slots__ = ("module", "target", "reason", "versions", "grid_rule")

    def __init__(self, module, target, reason, versions, grid_rule):
        self.module = module
        self.target = target  # "Class.attribute", or "attribute" of the module
        self.reason = reason
        self.versions = versions  # a version gate (compat.admits): ">=0.5.22", "<0.5.22", ALL_RELEASES
        # It only runs planning.py's grid rules, which SGLANG_CHUNK_ALIGN_RULES=0 turns off (doctor says so).
        self.grid_rule = grid_rule

    @property
    def name(self):
        return f"{self.module}.{self.target}"

    @property
    def class_and_attribute(self):
        """(the owning class's name, or None for a module attribute; the attribute's name)."""
        class_name, _, attribute = self.target.rpartition(".")
        return class_name or None, attribute

    def owner(self):
        """(the module or class whose __dict__ holds the attribute, the attribute's name).

        Imports the point's module; raises ImportError or AttributeError where SGLang lacks it.
        """
        class_name, attribute = self.class_and_attribute
        owner = importlib.import_module(self.module)
        return (getattr(owner, class_name) if class_name else owner), attribute

    def resolve(self, version, replacing=None):
        """The Site this point goes in on SGLang `version`, or ChunkAlignError where it is missing
        or changed. `replacing`: the site of a failure guard on the same target, dropped before
        this point goes in, so what the guard replaced is stock."""
        try:
            owner, attribute = self.owner()
        except (ImportError, AttributeError) as error:
            raise ChunkAlignError(
                f"SGLang {version}: patch point {self.name} is missing or does not import "
                f"({type(error).__name__}: {error}); nothing was patched."
            ) from error
        stock = replacing.stock if replacing is not None else owner.__dict__.get(attribute, _ABSENT)
        problem = self.problem(stock)
        if problem:
            raise ChunkAlignError(f"SGLang {version}: patch point {self.name} {problem}; nothing was patched.")
        return Site(self, owner, attribute, stock)


class Wrap(PatchPoint):
    """A wrapt wrapper around a function or method SGLang has, with the contract the wrapper relies
    on there, which tests/test_release_wheels.py checks in every release's source:

    - `signature`: the parameters it reads, leading positional names in order ("..." allows
      further ones; without it the function takes exactly these), names after "*" accepted by
      keyword; None: none read;
    - `calls`: (callee as written in the function, a keyword it must pass or None) for each stock
      call inside it that the wrapper's answers reach;
    - `statements`: stock statements it restates or relies on, as ast.unparse writes them.
    """

    __slots__ = ("wrapper", "signature", "calls", "statements")

    def __init__(self, module, target, wrapper, reason, versions=ALL_RELEASES, *, grid_rule=False, signature=None,
                 calls=(), statements=()):
        super().__init__(module, target, reason, versions, grid_rule)
        self.wrapper = wrapper
        self.signature, self.calls, self.statements = signature, calls, statements

    def problem(self, stock):
        if not (callable(stock) or isinstance(stock, classmethod)):
            return f"is missing: no function {self.class_and_attribute[1]} there"
        return None

    def install(self, site):
        wrapt.wrap_function_wrapper(site.owner, site.attribute, self.wrapper)

    def restore(self, site):
        setattr(site.owner, site.attribute, site.stock)


class Declare(PatchPoint):
    """A new attribute value: SGLang must not have the attribute."""

    __slots__ = ("value",)

    def __init__(self, module, target, value, reason, versions=ALL_RELEASES):
        super().__init__(module, target, reason, versions, False)
        self.value = value

    def problem(self, stock):
        if stock is not _ABSENT:
            return "already exists in SGLang; this release needs a newer sglang-chunk-align"
        return None

    def install(self, site):
        setattr(site.owner, site.attribute, self.value)

    def restore(self, site):
        delattr(site.owner, site.attribute)


class Site:
    """A resolved point: the owner whose __dict__ holds its attribute, and what that held (stock)."""

    __slots__ = ("point", "owner", "attribute", "stock")

    def __init__(self, point, owner, attribute, stock):
        self.point, self.owner, self.attribute, self.stock = point, owner, attribute, stock


STOCK, APPLIED, GUARDED = "stock", "applied", "guarded"  # what this process has installed
_lock = threading.RLock()  # re-entered when installing a point imports a module with a pending hook
_state = STOCK
_version = None  # the SGLang release the points were selected for
_table = None  # the table last applied or guarded: its reset() runs on restore
_installed = {}  # point name -> Site
_pending = {}  # module name -> points to install when SGLang imports it
_hooked = set()  # modules with a post-import hook (wrapt cannot unregister one; it checks _pending)


def apply(table, now=False):
    """Install every point of `table` for the installed SGLang; a no-op when already applied.

    Points in modules this process has imported are installed at once, all
    resolved before anything changes; the others when SGLang imports their
    module (a post-import hook), so a process that never schedules pays
    almost nothing. `now` imports them all here instead (doctor, tests). A
    point that fails when its module is imported restores stock SGLang,
    logs an ERROR and installs the table's failure guard.
    """
    global _state, _version, _table
    with _lock:
        if _state == APPLIED:
            return
        version = installed_version()
        warning = check_sglang_version(version)
        if warning:
            logger.warning("sglang-chunk-align: %s", warning)
        by_module = {}
        for point in release_points(table, version):
            by_module.setdefault(point.module, []).append(point)
        ready = {module for module in by_module if now or module in sys.modules}
        sites = [_resolve(point, version) for module in ready for point in by_module[module]]
        _restore_all()  # drops a failure guard left by an earlier attempt
        _table = table
        _install_all(sites, version)
        _state, _version = APPLIED, version
        for module in by_module.keys() - ready:
            _install_when_imported(module, by_module[module])


def install_failure_guard(table, error):
    """Make the scheduler refuse deterministic flashinfer, citing `error`; only over stock SGLang."""
    global _state, _table
    with _lock:
        if _state != STOCK:
            return
        _state, _table = GUARDED, table
        guard = table.failure_guard(error)
        _install_when_imported(guard.module, [guard])


def state():
    """STOCK, APPLIED, or GUARDED (only the failure guard is installed)."""
    return _state


def remove():
    """Restore every patched attribute to exactly what stock SGLang had, and install nothing later."""
    with _lock:
        _restore_all()


def installed_names():
    return set(_installed)


def release_points(table, version):
    """The table's points whose version gate admits `version`: the points apply() installs; at most one per target."""
    points = [p for p in table.PATCH_POINTS if admits(p.versions, version)]
    names = [p.name for p in points]
    overlapping = sorted({name for name in names if names.count(name) > 1})
    if overlapping:
        raise ChunkAlignError(
            f"SGLang {version}: the patch table selects {', '.join(overlapping)} more than once "
            f"(overlapping version ranges); nothing was patched."
        )
    return points


def _resolve(point, version):
    return point.resolve(version, _installed.get(point.name))


def _install_all(sites, version):
    """Install resolved points; one that fails rolls every installed point back."""
    for site in sites:
        try:
            site.point.install(site)
        except Exception as error:
            _restore_all()
            raise ChunkAlignError(
                f"SGLang {version}: installing patch point {site.point.name} failed "
                f"({type(error).__name__}: {error}); every point was restored to stock."
            ) from error
        _installed[site.point.name] = site


def _install_when_imported(module, points):
    _pending[module] = points
    if module in sys.modules:
        _on_import(sys.modules[module])
    elif module not in _hooked:
        _hooked.add(module)
        wrapt.register_post_import_hook(_on_import, module)


def _on_import(module):
    """Install the points pending for `module`, which SGLang has just imported."""
    with _lock:
        points = _pending.pop(module.__name__, None)
        if not points:
            return
        try:
            _install_all([_resolve(point, _version) for point in points], _version)
        except ChunkAlignError as error:  # never raised into SGLang's import
            if _state == GUARDED:
                logger.error("sglang-chunk-align: could not install its failure guard either: %s", error)
                return
            logger.error("%s", error.failure_report())
            _restore_all()
            install_failure_guard(_table, error)


def _restore_all():
    global _state
    for site in reversed(list(_installed.values())):
        site.point.restore(site)
    _installed.clear()
    _pending.clear()
    _state = STOCK
    if _table is not None:
        _table.reset()
