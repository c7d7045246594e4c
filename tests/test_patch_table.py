"""The patch table checks itself: one kind per point, one point per target and release,
and an install that fails partway leaves SGLang stock."""

import configparser
import os

import pytest
from packaging.version import Version

from sglang_chunk_align import patches, releases
from sglang_chunk_align.compat import ChunkAlignError, installed_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _owner_dicts():
    """Point name -> what its owner's __dict__ holds now, for this release's points."""
    state = {}
    for point in patches.release_points(installed_version()):
        owner, attribute = patches.owner_of(point)
        state[point.name] = vars(owner).get(attribute)
    return state


@pytest.mark.parametrize(
    "kinds",
    [{}, {"wrapper": print, "declare": None}, {"declare": None, "member": "x"}, {"wrapper": print, "member": "x"}],
)
def test_a_point_has_exactly_one_kind(kinds):
    with pytest.raises(ValueError, match="exactly one of wrapper, declare and member"):
        patches.PatchPoint("m", "C.f", patches.ALL_RELEASES, "test", **kinds)


def test_every_table_point_has_one_kind():
    for point in (*patches.PATCH_POINTS, patches.FAILURE_GUARD):
        kinds = [point.wrapper is not None, point.declare is not patches._ABSENT, point.member is not patches._ABSENT]
        assert kinds.count(True) == 1, point.name


def test_the_grid_rule_points_are_the_prefill_hooks():
    """doctor reports these off under SGLANG_CHUNK_ALIGN_RULES=0: exactly the wrappers that run the rules."""
    from sglang_chunk_align import prefill_hooks

    for point in patches.PATCH_POINTS:
        assert point.grid_rule == (getattr(point.wrapper, "__module__", None) == prefill_hooks.__name__), point.name


@pytest.mark.parametrize("release", releases.RELEASES)
def test_no_release_selects_a_target_twice(release):
    names = [p.name for p in patches.release_points(Version(release))]
    assert len(names) == len(set(names))


def test_overlapping_ranges_are_refused_before_anything_changes(monkeypatch):
    stock = _owner_dicts()
    twin = next(p for p in patches.PATCH_POINTS if p.wrapper is not None and p in patches.release_points(installed_version()))
    monkeypatch.setattr(patches, "PATCH_POINTS", patches.PATCH_POINTS + (twin,))
    with pytest.raises(ChunkAlignError, match=f"selects {twin.name} more than once"):
        patches.apply()
    assert patches.state() == patches.STOCK and not patches.installed_names()
    monkeypatch.undo()
    assert all(_owner_dicts()[name] is value for name, value in stock.items())


def test_install_failing_partway_is_rolled_back(monkeypatch):
    stock = _owner_dicts()
    install = patches._install
    points = patches.selected_points(installed_version())

    def fail_at_the_last(point, *rest):
        if point is points[-1]:
            raise TypeError("simulated")
        install(point, *rest)

    monkeypatch.setattr(patches, "_install", fail_at_the_last)
    with pytest.raises(ChunkAlignError, match=f"installing patch point {points[-1].name} failed .*restored to stock"):
        patches.apply()
    assert patches.state() == patches.STOCK and not patches.installed_names()
    assert all(_owner_dicts()[name] is value for name, value in stock.items())


def test_state_names_what_is_installed(monkeypatch):
    assert patches.state() == patches.STOCK
    patches.apply()
    installed = patches.installed_names()
    patches.apply()
    assert patches.state() == patches.APPLIED and patches.installed_names() == installed
    patches.remove()
    patches.install_failure_guard(ChunkAlignError("test"))
    assert patches.state() == patches.GUARDED and patches.installed_names() == {patches.FAILURE_GUARD.name}
    patches.apply()  # a later successful apply drops the guard
    assert patches.state() == patches.APPLIED and patches.installed_names() == installed
    patches.install_failure_guard(ChunkAlignError("test"))  # never over an applied plugin
    assert patches.installed_names() == installed


def test_the_sglang_extra_installs_the_newest_release():
    setup = configparser.ConfigParser()
    setup.read(os.path.join(ROOT, "setup.cfg"))
    assert setup["options.extras_require"]["sglang"].split() == [f"sglang=={releases.NEWEST}"]
