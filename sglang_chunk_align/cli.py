"""The `sglang-chunk-align` command. No GPU needed.

`plan` shows how one request is chunked, upstream and with the plugin, and
flags every hazard. `doctor` checks whether this environment can run the
plugin: it applies the patches in its own process, reports each patch point, and asks
every installed attention-backend class what it declares under deterministic
inference, using instances built without __init__ (no GPU, no model).
"""

import argparse
import contextlib
import importlib
import inspect
import json
import pkgutil
import sys
from importlib import metadata

from packaging.specifiers import SpecifierSet

from . import patches, standins
from .planning import Rules, plan
from .alignment import PREFILL_Q_TILE_TOKENS
from .compat import (
    ALLOW_UNTESTED_ENV,
    RADIX_CACHE_ENV,
    RULES_ENV,
    SUPPORTED_SGLANG,
    ChunkAlignError,
    check_sglang_version,
    env_flag,
    installed_version,
)

# The environment switches and their defaults (README, "Switches").
SWITCHES = {RULES_ENV: True, RADIX_CACHE_ENV: False, ALLOW_UNTESTED_ENV: False}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="sglang-chunk-align")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check the installed SGLang and the patch points")
    doctor.add_argument("--json", action="store_true", help="print a JSON report")
    planner = commands.add_parser("plan", help="show one request's chunks, upstream and with the plugin")
    planner.add_argument("--prompt-len", type=int, required=True, help="prompt length in tokens")
    planner.add_argument("--cached", type=int, default=0, help="radix-cache hit length in tokens")
    planner.add_argument("--chunk", type=int, required=True, help="per-rank --chunked-prefill-size")
    planner.add_argument("--group", type=int, default=1, help="GQA group (q heads per KV head)")
    planner.add_argument("--head-dim", type=int, help="model head_dim (below 256 exempts very short KV)")
    planner.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan(parser, args)
    with contextlib.redirect_stdout(sys.stderr):  # some SGLang modules print on import
        report = run_doctor()
    print(json.dumps(report, indent=2) if args.json else format_doctor(report))
    return 0 if report["ok"] else 1


def run_plan(parser, args):
    """Chunks of one request prefilled alone: SGLang's length alignment vs the plugin's rules."""
    if args.prompt_len < 1 or args.cached < 0 or args.group < 1 or args.chunk < PREFILL_Q_TILE_TOKENS:
        parser.error(f"need --prompt-len >= 1, --cached >= 0, --group >= 1, --chunk >= {PREFILL_Q_TILE_TOKENS}")
    rules = Rules(group=args.group, head_dim=args.head_dim)
    schedules = {
        "upstream length alignment": plan(args.prompt_len, args.cached, args.chunk, rules, aligned=False),
        "sglang-chunk-align": plan(args.prompt_len, args.cached, args.chunk, rules),
    }
    if args.json:
        print(json.dumps({name: [vars(c) for c in chunks] for name, chunks in schedules.items()}, indent=2))
    else:
        for name, chunks in schedules.items():
            hazards = sum(bool(c.hazards) for c in chunks)
            print(f"{name}: {len(chunks)} chunks, {hazards} with hazards")
            for c in chunks:
                print(f"  [{c.start:>6}, {c.end:>6})  tile {c.tile}  {'; '.join(c.hazards) or 'ok'}")
    return 1 if any(c.hazards for c in schedules["sglang-chunk-align"]) else 0


def run_doctor():
    version = installed_version()
    report = {
        "versions": {d: _dist_version(d) for d in ("sglang-chunk-align", "sglang", "flashinfer-python", "torch", "wrapt")},
        "supported_sglang": str(SUPPORTED_SGLANG),
        "switches": {},
        "grid_rules": None,
        "problems": [],
        "warnings": [],
        "patch_points": [],
        "backends": {},
    }
    for name, default in SWITCHES.items():
        try:
            report["switches"][name] = int(env_flag(name, default))
        except ChunkAlignError as error:
            report["problems"].append(str(error))
    try:
        warning = check_sglang_version(version)
        if warning:
            report["warnings"].append(warning)
        patches.apply()
    except ChunkAlignError as error:
        report["problems"].append(str(error))
    applied = patches.installed_names()
    release = patches.release_points(version) if version else []
    for point in patches.PATCH_POINTS:
        if point not in release:
            status = f"not for SGLang {version}"
        elif point.name in applied:
            status = "applied"
        elif point.opt_in:
            status = f"off (opt in with {point.opt_in}=1)"
        else:
            status = "not applied"
        report["patch_points"].append(
            {"name": point.name, "versions": str(point.versions), "reason": point.reason, "status": status}
        )
    if version:
        grid_rules = SpecifierSet(patches.GRID_RULES_RELEASES).contains(version, prereleases=True)
        report["grid_rules"] = "available" if grid_rules else f"not on SGLang {version} (needs {patches.GRID_RULES_RELEASES})"
    if applied:
        report["backends"] = declared_alignments()
        if report["backends"].get("FlashInferAttnBackend") != 128:
            report["problems"].append("FlashInferAttnBackend does not declare 128 under deterministic inference")
        patches.remove()
    report["problems"] = list(dict.fromkeys(report["problems"]))  # an invalid switch is seen twice
    report["ok"] = not report["problems"]
    return report


def declared_alignments():
    """Class name -> prefill_chunk_align under deterministic inference.

    Wrappers are built around a deterministic FlashInferAttnBackend child.
    """
    import sglang.srt.layers.attention as attention_package
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    for module in pkgutil.iter_modules(attention_package.__path__, attention_package.__name__ + "."):
        try:
            importlib.import_module(module.name)
        except Exception:  # a backend for other hardware; its classes stay unlisted
            pass

    child = standins.flashinfer_backend(deterministic=True)
    declared = {}
    for cls in sorted(_subclasses(AttentionBackend), key=lambda c: c.__name__):
        wrapped_children = dict.fromkeys(_forwarded_children(cls), child)
        instance = standins.backend(cls, **{**standins.flashinfer_state(deterministic=True), **wrapped_children})
        declared[cls.__name__] = instance.prefill_chunk_align
    return declared


def format_doctor(report):
    lines = ["sglang-chunk-align doctor"]
    lines += [f"  {name:<20} {version or 'not installed'}" for name, version in report["versions"].items()]
    lines.append(f"  supported SGLang     {report['supported_sglang']}")
    lines += [f"  {name}={value}" for name, value in report["switches"].items()]
    lines.append(f"  grid rules           {report['grid_rules']}")
    lines.append("patch points:")
    lines += [
        f"  [{p['status']}] {p['name']}  ({p['versions'] or 'all releases'}: {p['reason']})" for p in report["patch_points"]
    ]
    if report["backends"]:
        lines.append("prefill_chunk_align under deterministic inference (wrappers around flashinfer):")
        lines += [f"  {name:<40} {value}" for name, value in report["backends"].items()]
    lines += [f"WARNING: {w}" for w in report["warnings"]]
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    lines.append("OK" if report["ok"] else "NOT OK")
    return "\n".join(lines)


def _dist_version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _forwarded_children(cls):
    getter = getattr(inspect.getattr_static(cls, "prefill_chunk_align"), "fget", None)
    return getattr(getter, "children", ())


if __name__ == "__main__":
    sys.exit(main())
