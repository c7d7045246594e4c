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
import importlib.util
import inspect
import json
import pkgutil
import sys
from importlib import metadata

from . import patches, releases, standins
from .planning import Rules, plan
from .alignment import PREFILL_Q_TILE_TOKENS, chunk_size_error
from .compat import (
    RADIX_OPT_IN_NEEDS,
    RULES_ENV,
    SUPPORTED_SGLANG,
    ChunkAlignError,
    admits,
    check_sglang_version,
    check_switches,
    installed_version,
    sglang_at_least,
)

RULES_OFF = f"off ({RULES_ENV}=0)"
# Where each scheduler takes its grid from (backends.flashinfer_q_tile_geometry); its log line names the grid.
GRID_SOURCE = (
    "128/gcd(128, GQA group) tokens, the group and head_dim read at scheduler start from "
    "FlashInferAttnBackend.indices_updater_prefill (the heads fa2 prefill is planned with); "
    "128 tokens where the backend does not say"
)
# SGLang's Ray scheduler actors never call load_plugins() (README, "Use it on a GPU server").
RAY_WARNING = (
    "Ray is installed: SGLang's Ray scheduler actors (--use-ray, RayEngine) never load plugins, "
    "so chunk_align does not run there and their chunks keep stock alignment."
)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="sglang-chunk-align")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_dist_version('sglang-chunk-align')}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check the installed SGLang and the patch points")
    doctor.add_argument("--json", action="store_true", help="print a JSON report")
    planner = commands.add_parser("plan", help="show one request's chunks, upstream and with the plugin")
    planner.add_argument("--prompt-len", type=_at_least(1), required=True, help="prompt length in tokens")
    planner.add_argument("--cached", type=_at_least(0), default=0, help="radix-cache hit length in tokens")
    planner.add_argument("--chunk", type=_chunk_size, required=True, help="per-rank --chunked-prefill-size")
    planner.add_argument("--group", type=_at_least(1), default=1, help="GQA group (q heads per KV head)")
    planner.add_argument("--head-dim", type=_at_least(1), help="model head_dim (below 256 exempts very short KV)")
    planner.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan(planner, args)
    with contextlib.redirect_stdout(sys.stderr):  # some SGLang modules print on import
        report = run_doctor()
    print(json.dumps(report, indent=2) if args.json else format_doctor(report))
    return 0 if report["ok"] else 1


def _at_least(lowest):
    """An argparse type: an integer >= lowest, so each bad argument is named on its own."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {lowest}")
        return value

    return parse


def _chunk_size(text):
    """An argparse type: a chunk the scheduler would accept, refused with the scheduler's own message."""
    chunk = _at_least(1)(text)
    error = chunk_size_error(chunk, align=PREFILL_Q_TILE_TOKENS, q_tile=PREFILL_Q_TILE_TOKENS)
    if error:
        raise argparse.ArgumentTypeError(error)
    return chunk


def run_plan(planner, args):
    """Chunks of one request prefilled alone: SGLang's length alignment vs the plugin's rules."""
    if args.cached >= args.prompt_len:
        planner.error(
            f"--cached {args.cached} must be below --prompt-len {args.prompt_len}: "
            "SGLang always prefills at least the last prompt token"
        )
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
            print(f"{name}: {len(chunks)} chunk{'s' * (len(chunks) != 1)}, {hazards} with hazards")
            for c in chunks:
                print(f"  [{c.start:>6}, {c.end:>6})  tile {c.tile}  {'; '.join(c.hazards) or 'ok'}")
    return 0


def run_doctor():
    version = installed_version()
    report = {
        "versions": {d: _dist_version(d) for d in ("sglang-chunk-align", "sglang", "flashinfer-python", "torch", "wrapt")},
        "supported_sglang": SUPPORTED_SGLANG,
        "switches": {},
        "grid_rules": None,
        "grid": None,
        "problems": [],
        "warnings": [RAY_WARNING] if importlib.util.find_spec("ray") else [],
        "patch_points": [],
        "backends": {},
    }
    try:
        report["switches"] = {name: int(value) for name, value in check_switches().items()}
        warning = check_sglang_version(version)
        if warning:
            report["warnings"].append(warning)
    except ChunkAlignError as error:
        report["problems"].append(str(error))
        applied = contextlib.nullcontext()  # apply() would refuse for the same reason
    else:
        applied = _plugin_applied(report)
    with applied:
        if version is not None:  # without SGLang the patch points mean nothing
            _check_release(report, version)
    report["ok"] = not report["problems"]
    return report


@contextlib.contextmanager
def _plugin_applied(report):
    """Every patch point applied, imported by SGLang yet or not, while the report is made; stock
    SGLang again afterwards. A point that cannot be applied is a problem in the report."""
    try:
        patches.apply(now=True)
    except ChunkAlignError as error:
        report["problems"].append(str(error))
    try:
        yield
    finally:
        patches.remove()


def _check_release(report, version):
    """Each patch point's status and what the backends declare, on the installed release."""
    rules_off = report["switches"].get(RULES_ENV) == 0
    applied = patches.installed_names()
    release = patches.release_points(version)
    for point in patches.PATCH_POINTS:
        if point not in release:
            status = f"not for SGLang {version}"
        elif rules_off and point.grid_rule:
            status = RULES_OFF
        elif point.name in applied:
            status = "applied"
        elif point.opt_in:
            status = f"off (opt in with {point.opt_in}=1)"
        else:
            status = "not applied"
        report["patch_points"].append(
            {"name": point.name, "versions": point.versions, "reason": point.reason, "status": status}
        )
    if not admits(patches.GRID_RULES_RELEASES, version):
        report["grid_rules"] = f"not on SGLang {version}: {releases.WITHOUT_GRID_RULES}"
    else:
        radix = "" if sglang_at_least(releases.RADIX_OPT_IN) else f"; {RADIX_OPT_IN_NEEDS}"
        report["grid_rules"] = RULES_OFF if rules_off else f"available{radix}"
        report["grid"] = None if rules_off else GRID_SOURCE
    if applied:
        report["backends"] = declared_alignments()
        if report["backends"].get("FlashInferAttnBackend") != 128:
            report["problems"].append("FlashInferAttnBackend does not declare 128 under deterministic inference")


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
    if report["versions"]["sglang"] is None:
        lines.append("patch points: not checked (SGLang not installed)")
    else:
        lines.append(f"  grid rules           {report['grid_rules']}")
        if report["grid"]:
            lines.append(f"  grid                 {report['grid']}")
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
