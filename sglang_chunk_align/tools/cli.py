"""The `sglang-chunk-align` command. No GPU needed.

`plan` shows how one request is chunked, upstream and with the plugin, and
flags every hazard. `doctor` checks whether this environment can run the
plugin: it applies the patches in its own process, reports each patch point, and asks
every installed attention-backend class what it declares under deterministic
inference, using instances built without __init__ (no GPU, no model). It also
says which installed SGLang plugins SGLANG_PLUGINS makes SGLang skip.
`verify` checks a running server bit for bit against solo, cold requests (verify.py).
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import pkgutil
import signal
import sys
from importlib import metadata

from packaging.version import InvalidVersion, Version

from .. import backends, decode_wait, patch_table, patches, releases
from . import fa2, probe, verify
from ..harness import standins
from ..workspace import Planned
from .arguments import at_least, report_errors_as_json
from ..planning import plan, switched_rules
from ..alignment import chunk_size_error
from ..kernel_facts import chosen, facts_for, installed_flashinfer
from ..compat import (
    DECODE_WAIT_ENV,
    RADIX_OPT_IN_NEEDS,
    RULES_ENV,
    SUPPORTED_SGLANG,
    ChunkAlignError,
    admits,
    check_sglang_version,
    check_switches,
    installed_release,
    installed_version,
    radix_cache,
    sglang_at_least,
    sglang_missing,
    switch_values,
)

RULES_OFF = f"off ({RULES_ENV}=0)"
# plan lists every chunk: 10M tokens is 78,125 chunks of 128 (about 2 s of CPU), as long as the longest
# contexts models offer. Without a bound a typo such as 10**12 hangs it, growing memory.
MAX_PLAN_PROMPT_LEN = 10_000_000
# SGLang's TpModelWorker admits prompts of max_req_input_len = min(context_len - 1, KV pool - 1) - 5
# tokens: at most this many fewer than the context length.
PROMPT_BELOW_CONTEXT = 6
# Where each scheduler takes its grid from (backends.flashinfer_declaration); its log line names the grid.
GRID_SOURCE = (
    "{grid}, the group and head_dim read at scheduler start from "
    "FlashInferAttnBackend.indices_updater_prefill (the heads fa2 prefill is planned with); "
    "{fallback} where the backend does not say"
)
# SGLang's entry-point group for general plugins (sglang.srt.plugins.GENERAL_PLUGINS_GROUP).
PLUGINS_GROUP = "sglang.srt.plugins"
# SGLang's Ray scheduler actors never call load_plugins() (docs/loading.md, "Ray").
RAY_WARNING = (
    "Ray is installed: SGLang's Ray scheduler actors (--use-ray, RayEngine) never load plugins, so "
    "deterministic flashinfer refuses to start on them while chunk_align is loaded. An sglang.Engine "
    "inside a Ray actor is fine: it starts its schedulers as processes, which load the plugin."
)


def main(argv=None):
    """The command's exit status. A reader that stops early (`plan ... | head`) ends it quietly, as
    it ends other commands, with no traceback: every command prints on stdout."""
    try:
        status = _run(argv)
        sys.stdout.flush()  # here, inside the try: a closed pipe fails now rather than at exit
        return status
    except BrokenPipeError:
        # Python's recipe (the signal module's "Note on SIGPIPE"): stdout on devnull, so the
        # interpreter's last flush cannot fail again; the status of a command killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _run(argv):
    parser = argparse.ArgumentParser(prog="sglang-chunk-align")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_release('sglang-chunk-align')}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor = commands.add_parser("doctor", help="check the installed SGLang and the patch points")
    doctor.add_argument("--json", action="store_true", help="print a JSON report")
    planner = commands.add_parser(
        "plan",
        help="show one request's chunks, upstream and with the plugin",
        description="Chunk one request as SGLang's length alignment does and as the plugin's grid rules do, "
        "with the tile each chunk gets and every hazard. The grid depends on the model's GQA group and "
        "head_dim: take them from its config.json (--model-path) or give them (--group, --head-dim); the "
        "scheduler names the ones it runs with in its startup log line.",
    )
    planner.add_argument(
        "--prompt-len", type=at_least(1, MAX_PLAN_PROMPT_LEN), required=True, help="prompt length in tokens"
    )
    planner.add_argument("--cached", type=at_least(0), default=0, help="radix-cache hit length in tokens (default 0)")
    planner.add_argument(
        "--chunk", type=_chunk_size, required=True, help="per-rank --chunked-prefill-size (-1 or 0: chunked prefill off)"
    )
    planner.add_argument(
        "--group", type=at_least(1),
        help="GQA group, q heads per KV head (default: the model's with --model-path, else 1: the coarsest grid, "
        "safe for every model)",
    )
    planner.add_argument(
        "--head-dim", type=at_least(1),
        help="model head_dim; below 256 exempts very short KV (default: the model's with --model-path, else "
        "unknown: tiles compared at every head_dim)",
    )
    planner.add_argument(
        "--model-path", help="a local model folder: take the GQA group and head_dim from its config.json "
        "(num_attention_heads / num_key_value_heads, head_dim)",
    )
    planner.add_argument(
        "--context-length", type=at_least(PROMPT_BELOW_CONTEXT + 1),
        help="with --model-path: the server's --context-length (default: the model's, from its config.json as "
        "SGLang reads it). The scheduler refuses at startup a chunk whose worst step at the longest prompt this "
        "admits outgrows SGLang's deterministic fa2 workspace, with the model's heads on one GPU; plan refuses "
        "it the same way",
    )
    planner.add_argument(
        "--flashinfer", metavar="VERSION", type=_flashinfer_release,
        help="the flashinfer release whose kernel facts to plan with "
        f"(default: the installed one, {installed_flashinfer() or 'none installed'})",
    )
    planner.add_argument("--json", action="store_true", help="print JSON")
    verifier = verify.add_parser(commands)
    prober = commands.add_parser("probe", help="measure the installed flashinfer's fa2 kernel facts on this GPU")
    probe.add_arguments(prober)
    argv = sys.argv[1:] if argv is None else argv
    if "--json" in argv:
        report_errors_as_json(parser, *commands.choices.values())
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan(planner, args)
    if args.command == "verify":
        return verify.run(verifier, args)
    if args.command == "probe":
        return probe.main(prober, args)
    with contextlib.redirect_stdout(sys.stderr):  # some SGLang modules print on import
        report = run_doctor()
    print(json.dumps(report, indent=2) if args.json else format_doctor(report))
    return 0 if report["ok"] else 1


def _chunk_size(text):
    """An argparse type: like the scheduler (Scheduler.init_chunked_prefill), a size <= 0 turns
    chunked prefill off (None); run_plan refuses what the scheduler refuses, by the kernel facts."""
    chunk = at_least(None)(text)
    return chunk if chunk > 0 else None


def _flashinfer_release(text):
    """An argparse type: a release number as flashinfer's metadata spells it (0.7.4; v0.7.4 reads the same)."""
    try:
        return str(Version(text))
    except InvalidVersion:
        raise argparse.ArgumentTypeError(f"{text!r} is not a flashinfer release such as 0.7.2") from None


def run_plan(planner, args):
    """Chunks of one request prefilled alone: SGLang's length alignment vs the plugin's rules."""
    if args.cached >= args.prompt_len:
        planner.error(
            f"--cached {args.cached} must be below --prompt-len {args.prompt_len}: "
            "SGLang always prefills at least the last prompt token"
        )
    groups, head_dims = probe.shape_from_arguments(
        planner, args.model_path, args.group and [args.group], args.head_dim and [args.head_dim]
    )
    if head_dims and len(head_dims) > 1:
        planner.error(f"--model-path {args.model_path} uses head_dim {' and '.join(map(str, head_dims))}: "
                      "give --head-dim, the one its flashinfer prefill is planned with")
    group, head_dim = (groups or [1])[0], (head_dims or [None])[0]
    facts, warning = facts_for(args.flashinfer or installed_flashinfer())
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    # Split attention and padded calls as the switches give them to the scheduler: pads keep radix hits whole.
    rules = switched_rules(group=group, head_dim=head_dim, facts=facts)
    # The chunk sizes the scheduler accepts, refused with its own message, naming plan's flag.
    error = chunk_size_error(args.chunk, facts.chunk_align, facts.chunk_align, min_piece=rules.min_tail, flag="--chunk")
    if error:
        planner.error(f"argument --chunk: {error}")
    _check_workspace(planner, args, head_dim, facts)
    schedules = {
        "upstream length alignment": plan(args.prompt_len, args.cached, args.chunk, rules, aligned=False),
        "sglang-chunk-align": plan(args.prompt_len, args.cached, args.chunk, rules),
    }
    warnings = list(filter(None, [facts.shape_warning(group, head_dim)]))
    if args.json:
        print(json.dumps(
            {**{name: [c._asdict() for c in chunks] for name, chunks in schedules.items()}, "warnings": warnings,
             "grid_rules": rules.describe()},
            indent=2,
        ))
    else:
        print(facts.headline())
        for warning in warnings:
            print(f"WARNING: {warning}")
        print(f"grid rules: {rules.describe()}")
        if args.chunk is None:
            print("chunked prefill off: one piece from the reused prefix to the end")
        for name, chunks in schedules.items():
            hazards = sum(bool(c.hazards) for c in chunks)
            print(f"{name}: {len(chunks)} chunk{'s' * (len(chunks) != 1)}, {hazards} with hazards")
            for c in chunks:
                padded = f" (its call padded by {c.pad} tokens)" * bool(c.pad)
                print(f"  [{c.start:>6}, {c.end:>6})  tile {c.tile}{padded}  {'; '.join(c.hazards) or 'ok'}")
    return 0


def _check_workspace(planner, args, head_dim, facts):
    """The scheduler's startup check that the worst chunk step fits the deterministic fa2 workspace
    (workspace.Planned.refusal, the same call), for --model-path's heads at the longest prompt a
    server at --context-length admits; that prompt length bounds --prompt-len too. It needs the
    model's heads: without --model-path there is nothing to check."""
    if args.model_path is None:
        if args.context_length is not None:
            planner.error("--context-length needs --model-path: the workspace check needs the model's heads")
        return
    config = probe.read_config(args.model_path)  # model_shape has read it: it is there and valid
    context = args.context_length or probe.context_length(config)
    said = f"--context-length {context}" + ("" if args.context_length else " (the model's, from its config.json)")
    longest = context - PROMPT_BELOW_CONTEXT
    if args.prompt_len > longest:
        planner.error(f"--prompt-len {args.prompt_len} is longer than the {longest} tokens a server at {said} admits")
    heads = config["num_attention_heads"]
    planned = Planned(heads, config.get("num_key_value_heads") or heads, head_dim, fa2.PREFILL_SPLIT,
                      fa2.DETERMINISTIC_WORKSPACE_BYTES)
    refusal = planned.refusal(args.chunk, longest, facts.cta_tile)
    if refusal:
        planner.error(f"at {said}: {refusal}")


def run_doctor():
    version = installed_version()
    report = {
        "versions": {d: installed_release(d) for d in ("sglang-chunk-align", "sglang", "flashinfer-python", "torch", "wrapt")},
        "supported_sglang": SUPPORTED_SGLANG,
        "switches": {name: value if value is None or isinstance(value, str) else int(value)
                     for name, value in switch_values().items()},
        "plugins": plugin_selection(os.environ.get("SGLANG_PLUGINS")),
        "radix_cache": None,
        "decode_wait": None,
        "grid_rules": None,
        "grid": None,
        "grid_cost": None,
        "kernel_facts": None,
        "problems": [],
        "warnings": [RAY_WARNING] if importlib.util.find_spec("ray") else [],
        "patch_points": [],
        "backends": {},
    }
    report["decode_wait"] = _decode_wait(report["switches"][DECODE_WAIT_ENV])
    if report["plugins"]["skipped"]:  # a value that keeps the plugin itself from loading is a problem
        stock = "chunk_align" in report["plugins"]["skipped"]
        report["problems" if stock else "warnings"].append(skipped_plugins_warning(report["plugins"]))
    if version is None:  # said whatever else is wrong: a bad switch would hide it below
        report["problems"].append(str(sglang_missing()))
    applied = contextlib.nullcontext()  # apply() would refuse for the reason found first
    try:
        report["radix_cache"], refusals = _radix_cache(check_switches(), version)
        report["problems"] += refusals
        if version is not None:  # without SGLang the patch points mean nothing
            warning = check_sglang_version(version)
            if warning:
                report["warnings"].append(warning)
            applied = _plugin_applied(report)
    except ChunkAlignError as error:
        report["problems"].append(str(error))
    # facts_for, not installed_facts: that logs the WARNING for an unmeasured release, which the
    # report says once. The plugin's code reads the same facts through chosen().
    facts, warning = facts_for(installed_flashinfer())
    report["kernel_facts"] = {"flashinfer": facts.flashinfer, "measured": facts.measured,
                              "summary": facts.headline(), "shapes": facts.describe_shapes()}
    if warning:
        report["warnings"].append(warning)
    with chosen(facts), applied:
        if version is not None:
            _check_release(report, version, facts)
    report["ok"] = not report["problems"]
    return report


def plugin_selection(value):
    """Which installed plugins SGLang's load_plugins() loads with SGLANG_PLUGINS=`value` (None: unset).

    As sglang.srt.plugins.load_plugins_by_group decides (the same in 0.5.12 to
    0.5.23): unset or empty loads every installed plugin; otherwise the value is
    a comma-separated list of names (spaces around a name and empty items
    ignored), the named plugins load, every other is skipped ("Skipping plugin
    ... (not in SGLANG_PLUGINS)"), and a name no plugin has is ignored.
    `keep` is the value that also loads the skipped ones.
    """
    installed = {ep.name: ep.dist.name if ep.dist else None for ep in metadata.entry_points(group=PLUGINS_GROUP)}
    named = [name.strip() for name in (value or "").split(",") if name.strip()]
    skipped = sorted(name for name in installed if value and name not in named)
    return {
        "SGLANG_PLUGINS": value,
        "installed": dict(sorted(installed.items())),
        "loaded": sorted(set(installed) - set(skipped)),
        "skipped": skipped,
        "unknown": [name for name in named if name not in installed],
        "keep": ",".join(dict.fromkeys([name for name in named if name in installed] + skipped)) if skipped else None,
    }


def skipped_plugins_warning(plugins):
    """The installed plugins SGLANG_PLUGINS skips, and the value that keeps them."""
    skipped = ", ".join(f"{name} ({plugins['installed'][name]})" for name in plugins["skipped"])
    stock = " chunk_align is among them: SGLang runs stock." if "chunk_align" in plugins["skipped"] else ""
    return (
        f"SGLANG_PLUGINS={plugins['SGLANG_PLUGINS']!r} makes SGLang skip the installed "
        f"plugin{'s' * (len(plugins['skipped']) > 1)} {skipped}.{stock} To keep "
        f"{'them' if len(plugins['skipped']) > 1 else 'it'}: SGLANG_PLUGINS={plugins['keep']} "
        "(or leave SGLANG_PLUGINS unset: every installed plugin loads)."
    )


@contextlib.contextmanager
def _plugin_applied(report):
    """Every patch point applied, imported by SGLang yet or not, while the report is made; stock
    SGLang again afterwards. A point that cannot be applied is a problem in the report."""
    try:
        patches.apply(patch_table, now=True)
    except ChunkAlignError as error:
        report["problems"].append(str(error))
    try:
        yield
    finally:
        patches.remove()


def _check_release(report, version, facts):
    """Each patch point's status and what the backends declare, on the installed release, with
    the installed flashinfer's kernel `facts`."""
    rules_off = report["switches"].get(RULES_ENV) == 0
    applied = patches.installed_names()
    release = patches.release_points(patch_table, version)
    for point in patch_table.PATCH_POINTS:
        if point not in release:
            status = f"not for SGLang {version}"
        elif rules_off and point.grid_rule:
            status = RULES_OFF
        elif point.name in applied:
            status = "applied"
        else:
            status = "not applied"
        report["patch_points"].append(
            {"name": point.name, "versions": point.versions, "reason": point.reason, "status": status}
        )
    if not admits(patch_table.GRID_RULES_RELEASES, version):
        report["grid_rules"] = f"not on SGLang {version}: {releases.WITHOUT_GRID_RULES}"
    else:
        radix = "" if sglang_at_least(releases.RADIX_OPT_IN) else f"; {RADIX_OPT_IN_NEEDS}"
        report["grid_rules"] = RULES_OFF if rules_off else f"available{radix}"
        rows = facts.grid_rows
        report["grid"] = None if rules_off else GRID_SOURCE.format(
            grid=f"{rows}/gcd({rows}, GQA group) tokens" if rows else "the KV page (chunk starts anywhere)",
            fallback=f"{rows} tokens" if rows else "the page",
        )
        remedy = None if rules_off else facts.grid_remedy()
        report["grid_cost"] = remedy and (
            f"radix hits and chunk cuts round down to the grid ({rows} tokens at odd GQA groups); {remedy}")
    if applied:
        report["backends"] = declared_alignments()
        expected = facts.chunk_align
        if report["backends"].get("FlashInferAttnBackend") != expected:
            report["problems"].append(
                f"FlashInferAttnBackend does not declare {expected} under deterministic inference"
            )


def _decode_wait(switch):
    """The decode wait `switch` (1, 0, or the invalid text) gives, and why it is not the default."""
    limit_ms = round(decode_wait.DECODE_WAIT_S * 1000)
    if switch == 1:
        return (f"on ({DECODE_WAIT_ENV}=1): decoding requests wait at most {limit_ms} ms behind prefill chunks, "
                f"on SGLang {releases.DECODE_WAIT}+ without --prefill-decode-interval or DP attention")
    state = "off, stock's prefill-first order" if switch == 0 else "invalid (see PROBLEM)"
    return (f"{state}; {DECODE_WAIT_ENV}=1 bounds decoding requests' wait at {limit_ms} ms. Not the default: "
            f"{decode_wait.MEASURED}")


def _radix_cache(switches, version):
    """Under deterministic flashinfer: the scheduler's decision (compat.radix_cache), which also
    depends on the model's mamba state, and its refusals."""
    _, why, refusals = radix_cache(switches, version)
    _, mamba_why, _ = radix_cache(switches, version, mamba=True)
    return (why if why == mamba_why else f"{why}; for a mamba model: {mamba_why}"), refusals


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
    """Problems first, right under the versions and switches they concern, so a user sees them
    before the patch-point list; the verdict is repeated last."""
    lines = ["sglang-chunk-align doctor"]
    lines += [f"  {name:<20} {version or 'not installed'}" for name, version in report["versions"].items()]
    lines.append(f"  supported SGLang     {report['supported_sglang']}")
    lines += [
        f"  {name}={value!r} (invalid)" if isinstance(value, str) else f"  {name} unset" if value is None
        else f"  {name}={value}"
        for name, value in report["switches"].items()
    ]
    lines.append(f"  SGLANG_PLUGINS       {_plugins_line(report['plugins'])}")
    if report["radix_cache"]:
        lines.append(f"  radix cache          under deterministic flashinfer: {report['radix_cache']}")
    lines.append(f"  decode wait          {report['decode_wait']}")
    facts = report["kernel_facts"]
    others = "; plan --group --head-dim warns on others" if facts["measured"] else ""
    lines.append(f"  kernel facts         {facts['summary']}{others}")
    lines += [f"PROBLEM: {p}" for p in report["problems"]]
    if report["versions"]["sglang"] is None:
        lines.append("patch points: not checked (SGLang not installed)")
    else:
        lines.append(f"  grid rules           {report['grid_rules']}")
        if report["grid"]:
            lines.append(f"  grid                 {report['grid']}")
        if report["grid_cost"]:
            lines.append(f"  grid cost            {report['grid_cost']}")
        lines.append("patch points:")
    lines += [
        f"  [{p['status']}] {p['name']}  ({p['versions'] or 'all releases'}: {p['reason']})" for p in report["patch_points"]
    ]
    if report["backends"]:
        lines.append("prefill_chunk_align under deterministic inference (wrappers around flashinfer):")
        lines += [f"  {name:<40} {value}" for name, value in report["backends"].items()]
    lines += [f"WARNING: {w}" for w in report["warnings"]]
    lines.append("OK" if report["ok"] else f"NOT OK: {len(report['problems'])} PROBLEM line(s) above")
    return "\n".join(lines)


def _plugins_line(plugins):
    value, loads = plugins["SGLANG_PLUGINS"], ", ".join(plugins["loaded"]) or "no plugin"
    if not value:
        return f"{'unset' if value is None else repr(value)}: SGLang loads every installed plugin ({loads})"
    parts = [f"{value!r}: SGLang loads {loads}"]
    if plugins["skipped"]:
        parts.append(f"skips {', '.join(plugins['skipped'])}")
    if plugins["unknown"]:
        parts.append(f"no installed plugin is named {', '.join(plugins['unknown'])}")
    return "; ".join(parts)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _forwarded_children(cls):
    """The children a wrapper class's declaration forwards (backends.Forward), else none."""
    declaration = getattr(cls, "prefill_declaration", None)
    return declaration.children if isinstance(declaration, backends.Forward) else ()


if __name__ == "__main__":
    sys.exit(main())
