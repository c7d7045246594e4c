"""The patch table checks itself: one point per target and release, the grid rules named, and
an install that fails partway, whatever the kind of the point that fails, leaves SGLang stock."""

import configparser
import importlib
import os

from types import SimpleNamespace

import pytest
from packaging.version import Version

from sglang_chunk_align import patch_table, patches, releases
from sglang_chunk_align.compat import ChunkAlignError, installed_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


GUARD = patch_table.failure_guard(ChunkAlignError("test"))


def _owner_dicts():
    """Point name -> what its owner's __dict__ holds now, for this release's points."""
    state = {}
    for point in patches.release_points(patch_table, installed_version()):
        owner, attribute = point.owner()
        state[point.name] = vars(owner).get(attribute)
    return state


def _is_stock(stock):
    now = _owner_dicts()
    return all(now[name] is value for name, value in stock.items())


def test_the_grid_rule_points_are_the_prefill_hooks_and_split_attention():
    """doctor reports these off under SGLANG_CHUNK_ALIGN_RULES=0: exactly the wrappers that run the rules."""
    from sglang_chunk_align import prefill_hooks, split_attention

    rule_modules = {prefill_hooks.__name__, split_attention.__name__}
    for point in patch_table.PATCH_POINTS:
        wrapper = getattr(point, "wrapper", None)
        assert point.grid_rule == (getattr(wrapper, "__module__", None) in rule_modules), point.name


def test_every_wrapped_function_names_the_parameters_its_wrapper_reads():
    """Each row's contract, which tests/test_release_wheels.py checks in every release's source."""
    unsigned = [p.name for p in (*patch_table.PATCH_POINTS, GUARD) if isinstance(p, patches.Wrap) and not p.signature]
    assert not unsigned


@pytest.mark.parametrize("release", releases.RELEASES)
def test_no_release_selects_a_target_twice(release):
    names = [p.name for p in patches.release_points(patch_table, Version(release))]
    assert len(names) == len(set(names))


def test_overlapping_ranges_are_refused_before_anything_changes():
    stock = _owner_dicts()
    release = patches.release_points(patch_table, installed_version())
    twin = next(p for p in patch_table.PATCH_POINTS if isinstance(p, patches.Wrap) and p in release)
    table = SimpleNamespace(PATCH_POINTS=patch_table.PATCH_POINTS + (twin,), failure_guard=patch_table.failure_guard,
                            reset=patch_table.reset)  # any such object is a table (patches.py)
    with pytest.raises(ChunkAlignError, match=f"selects {twin.name} more than once"):
        patches.apply(table)
    assert patches.state() == patches.STOCK and not patches.installed_names()
    assert _is_stock(stock)


def test_remove_restores_every_kind_exactly():
    points = patches.release_points(patch_table, installed_version())
    stock = _owner_dicts()
    patches.apply(patch_table, now=True)
    assert patches.installed_names() == {p.name for p in points}
    assert not _is_stock(stock)
    patches.remove()
    assert patches.state() == patches.STOCK and not patches.installed_names()
    assert _is_stock(stock)


def test_install_failing_partway_is_rolled_back(monkeypatch):
    """The last point to go in fails: every point before it, of whatever kind, comes out again."""
    points = patches.release_points(patch_table, installed_version())
    stock = _owner_dicts()
    installs = []

    def failing_last(install):
        def counted(point, site):
            installs.append(point)
            if len(installs) == len(points):
                raise TypeError("simulated")
            install(point, site)

        return counted

    for kind in {type(p) for p in points}:
        monkeypatch.setattr(kind, "install", failing_last(kind.install))
    with pytest.raises(ChunkAlignError, match="installing patch point .* failed .*restored to stock"):
        patches.apply(patch_table, now=True)
    assert len(installs) == len(points)
    assert patches.state() == patches.STOCK and not patches.installed_names()
    assert _is_stock(stock)


def test_state_names_what_is_installed(monkeypatch):
    importlib.import_module(GUARD.module)  # the guard goes in at once only where its module is imported
    assert patches.state() == patches.STOCK
    patches.apply(patch_table)
    installed = patches.installed_names()
    patches.apply(patch_table)
    assert patches.state() == patches.APPLIED and patches.installed_names() == installed
    patches.remove()
    patches.install_failure_guard(patch_table, ChunkAlignError("test"))
    assert patches.state() == patches.GUARDED and patches.installed_names() == {GUARD.name}
    patches.apply(patch_table)  # a later successful apply drops the guard
    assert patches.state() == patches.APPLIED and patches.installed_names() == installed
    patches.install_failure_guard(patch_table, ChunkAlignError("test"))  # never over an applied plugin
    assert patches.installed_names() == installed


def test_the_sglang_extra_installs_the_newest_release():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    assert setup["options.extras_require"]["sglang"].split() == [f"sglang=={releases.NEWEST}"]
