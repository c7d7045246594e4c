"""`sglang-chunk-align probe`: measure the kernel facts of the installed flashinfer on this GPU.

The grid rules take fa2's facts from kernel_facts.FACTS, one entry per
flashinfer release. This runs the measurements behind them on the installed
flashinfer, with fa2 paged prefill planned as SGLang's deterministic
FlashInferAttnBackend plans it (bf16, page size 1 with separate K and V pool
buffers in NHD layout, plan(..., fixed_split_size=S), forward(causal=True)),
comparing each chunked prefill with the unchunked prefill of the same seeded
prompt (torch.equal, row by row):

- starts: uniform chunks on the 128-token grid and off it (100, 129, 1000
  tokens), at fixed split 4096 and 1024;
- tiles: short final pieces and a chunk batched with one-token extends;
- partial-tile rows: a shorter prompt's solo prefill against the longer one's;
- decoded rows: tensor-core decode (fixed split 2048) against solo prefill rows.

`expectation` says what the table's facts predict for each case and
`verdicts` compares: a case whose result the facts do not predict makes the
command exit 1. Pure functions except `measure`, so the CPU tests check the
verdict logic on recorded results and tests/gpu runs the same cases on a GPU.
Imported only by the CLI and the tests, never by plugin load.
"""

import json
import os
import sys
from dataclasses import asdict, dataclass

from . import fa2
from .arguments import at_least, report_errors_as_json
from ..kernel_facts import facts_for, installed_flashinfer

SEED = 20261129
PROMPT_LEN = 2500
SPLITS = (fa2.PREFILL_SPLIT, 1024)  # SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE: SGLang's default, and a smaller one
DEFAULT_GROUPS, DEFAULT_HEAD_DIMS = (1, 4, 8), (128, 256)
DECODE_STEPS = 8
EXTRA_KV_TOKENS = 300  # KV of each one-token extend batched with a chunk
EXACT, INEXACT, EITHER = "exact", "inexact", "either"
# Exit statuses: the facts hold; some do not; nothing could be measured here.
HOLD, DO_NOT_HOLD, CANNOT_MEASURE = 0, 1, 2


@dataclass(frozen=True)
class Case:
    """One measurement: the request's extends `bounds` (its chunks), each batched with `extra`
    one-token extends of other requests, against its unchunked prefill; rows [0, `rows`) only
    where `rows` is set. `fact` names what it tests."""

    fact: str
    name: str
    prompt_len: int
    bounds: tuple
    split: int
    extra: int = 0
    rows: int = None
    decode: bool = False


def _uniform(chunk, prompt_len=PROMPT_LEN):
    return (*range(0, prompt_len, chunk), prompt_len)


def cases(group, decode=True):
    """The cases for one shape; short pieces are chosen in packed rows, so per group."""
    found = [Case("reference", "unchunked twice", PROMPT_LEN, (0, PROMPT_LEN), SPLITS[0])]
    for split in SPLITS:
        found += [Case("grid", f"uniform{c}", PROMPT_LEN, _uniform(c), split) for c in (128, 256, 100, 129, 1000)]
    found.append(Case("grid", "radix hit 1000", PROMPT_LEN, (0, 1000, PROMPT_LEN), SPLITS[0]))
    for rows in (16, 24, 48, 64, 72):  # at and around every tile threshold in kernel_facts (16, 32, 64 packed rows)
        tokens = max(1, rows // group)
        found.append(Case("tiles", f"final piece of {tokens}", 1024 + tokens, (0, 512, 1024, 1024 + tokens), SPLITS[0]))
    found += [Case("tiles", f"chunk 256 with {n} one-token extends", PROMPT_LEN, _uniform(256), SPLITS[0], extra=n)
              for n in (1, 7, 15)]
    found += [Case("partial_tile_rows", f"rows of a {n}-token prompt", PROMPT_LEN, (0, n), SPLITS[0], rows=n)
              for n in (1000, 1042, 2063)]
    if decode:
        found.append(Case("decoded_rows", f"last {DECODE_STEPS} rows decoded", PROMPT_LEN,
                          (0, PROMPT_LEN - DECODE_STEPS), fa2.DECODE_SPLIT, decode=True))
    return found


def expectation(facts, group, head_dim, case):
    """What `facts` predict for `case`: EXACT, INEXACT, or EITHER (a fact that says rows *can*
    differ, data-dependently, is not refuted by equal rows on random data)."""
    if case.fact == "reference":
        return EXACT
    if case.fact == "partial_tile_rows":
        return EXACT if facts.partial_tile_rows_equal else EITHER
    if case.fact == "decoded_rows":
        return EXACT if facts.decoded_rows_equal else EITHER
    solo = facts.cta_tile(case.prompt_len * group, head_dim)
    for start, end in zip(case.bounds, case.bounds[1:]):
        rows = ((end - start) + case.extra) * group // (1 + case.extra)
        if facts.cta_tile(rows, head_dim) != solo:
            return INEXACT
        # fa2's own tile is the unit where it is finer than the grid (head_dim 256: 64 rows).
        if facts.grid_rows and start * group % min(facts.grid_rows, solo):
            return INEXACT
    return EXACT


def verdicts(facts, results):
    """Per result (a measured case with its shape): whether the facts predicted it."""
    out = []
    for r in results:
        case = Case(**r["case"])
        expected = expectation(facts, r["group"], r["head_dim"], case)
        if r.get("error"):
            holds = False
        else:
            holds = expected == EITHER or (expected == EXACT) == r["exact"]
        out.append({**r, "expected": expected, "holds": holds})
    return out


def summary(facts, checked):
    """Per fact: how many cases held; the exit status."""
    facts_seen = {}
    for r in checked:
        key = (r["case"]["fact"], r["group"], r["head_dim"])
        held, total = facts_seen.get(key, (0, 0))
        facts_seen[key] = (held + r["holds"], total + 1)
    status = HOLD if all(r["holds"] for r in checked) else DO_NOT_HOLD
    return facts_seen, status


def format_report(facts, checked):
    lines = [facts.describe()]
    per_fact, status = summary(facts, checked)
    for (fact, group, head_dim), (held, total) in per_fact.items():
        lines.append(f"  GQA {group} head_dim {head_dim} {fact:<18} {'holds' if held == total else 'DOES NOT HOLD'} "
                     f"({held}/{total})")
    for r in checked:
        if not r["holds"] or r["expected"] == EITHER:
            got = r.get("error") or ("exact" if r["exact"] else f"{r['n_bad_rows']} rows differ, max abs {r['max_abs']:.3g}")
            mark = "" if r["holds"] else "  <- the table says " + r["expected"]
            lines.append(f"    GQA {r['group']} head_dim {r['head_dim']} {r['case']['name']} "
                         f"(split {r['case']['split']}): {got}{mark}")
    lines.append("the table's facts hold here" if status == HOLD
                 else f"the table's facts for flashinfer {facts.flashinfer} do NOT hold here")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------


def why_not_measurable():
    """None where this machine can run fa2, else the one-line reason."""
    try:
        import torch
    except ImportError:
        return "torch is not installed: the probe runs flashinfer's fa2 prefill on a CUDA GPU"
    if not torch.cuda.is_available():
        return "no CUDA device: the probe runs flashinfer's fa2 prefill on a GPU"
    if torch.cuda.get_device_capability() < (8, 0):
        return "flashinfer's fa2 prefill needs an sm80+ GPU, found sm%d%d" % torch.cuda.get_device_capability()
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"flashinfer cannot be imported ({error}): pip install flashinfer-python"
    return None


class Shape:
    """Seeded q and a paged KV pool for one (group, head_dim); slot 0 is padding, the slots a
    seeded permutation as a KV pool hands them out."""

    def __init__(self, group, head_dim, workspace):
        import torch

        self.group, self.head_dim = group, head_dim
        self.num_kv_heads = max(8, 32 // group)
        self.num_qo_heads = self.num_kv_heads * group
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(SEED + 1000 * group + head_dim)
        pool = PROMPT_LEN + 16 * (EXTRA_KV_TOKENS + 1) + 64

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)

        self.q = randn(pool, self.num_qo_heads, head_dim)
        self.k = randn(pool, self.num_kv_heads, head_dim)
        self.v = randn(pool, self.num_kv_heads, head_dim)
        self.slots = (torch.randperm(pool - 1, generator=gen, device=dev) + 1).to(torch.int32)
        self.workspace = workspace
        self.paged_prefill = fa2.PagedPrefill(workspace, self.num_qo_heads, self.num_kv_heads, head_dim)

    def _request(self, i):
        """Slots of request i: 0 is the probed prompt, 1.. the one-token extends' KV."""
        if i == 0:
            return self.slots[:PROMPT_LEN + DECODE_STEPS]
        start = PROMPT_LEN + DECODE_STEPS + (i - 1) * EXTRA_KV_TOKENS
        return self.slots[start:start + EXTRA_KV_TOKENS]

    def prefill(self, extends, split):
        """One batch of extends (request, start, end): query rows [start, end) over KV [0, end)."""
        import torch

        dev = self.q.device
        kv = [self._request(i)[:end] for i, _, end in extends]
        q = torch.cat([self.q[self._request(i)[start:end].long()] for i, start, end in extends])
        self.paged_prefill.plan(
            fa2.indptr([e - s for _, s, e in extends], dev), fa2.indptr([e for _, _, e in extends], dev), torch.cat(kv), split
        )
        out = self.paged_prefill.forward(q, self.k, self.v)
        return out[: extends[0][2] - extends[0][1]]

    def decode_rows(self, positions, split):
        import torch

        decode = fa2.TensorCoreDecode(self.workspace, self.num_qo_heads, self.num_kv_heads, self.head_dim)
        slots, rows = self._request(0), []
        for p in positions:
            decode.plan(slots[: p + 1], split)
            rows.append(decode.forward(self.q[slots[p: p + 1].long()], self.k, self.v))
        return torch.cat(rows)

    def run(self, case):
        """(rows the case computes, the same rows of the unchunked prefill)."""
        import torch

        reference = self.prefill([(0, 0, case.prompt_len)], SPLITS[0] if case.decode else case.split)
        if case.decode:
            positions = range(case.bounds[-1], case.prompt_len)
            got, want = self.decode_rows(positions, case.split), reference[case.bounds[-1]:]
        else:
            extras = [(i, EXTRA_KV_TOKENS - 1, EXTRA_KV_TOKENS) for i in range(1, case.extra + 1)]
            got = torch.cat([self.prefill([(0, s, e), *extras], case.split) for s, e in zip(case.bounds, case.bounds[1:])])
            want = reference[: case.bounds[-1]] if case.fact != "reference" else \
                self.prefill([(0, 0, case.prompt_len)], case.split)
            if case.rows is not None:
                got, want = got[: case.rows], want[: case.rows]
        torch.cuda.synchronize()
        return got, want


def measure(shape, case):
    """The result of one case: exact, and where not, how many rows differ."""
    try:
        got, want = shape.run(case)
    except Exception as error:  # a head_dim this flashinfer cannot plan: recorded, not raised
        return {**_result(shape, case), "error": f"{type(error).__name__}: {error}".splitlines()[0]}
    bad = (got != want).flatten(1).any(dim=1)
    rows = bad.nonzero().flatten()
    return {
        **_result(shape, case),
        "exact": not bool(bad.any()), "n_bad_rows": int(bad.sum()),
        "first_bad_row": int(rows[0]) if rows.numel() else None,
        "max_abs": (got.float() - want.float()).abs().max().item(),
    }


def _result(shape, case):
    return {"case": asdict(case), "group": shape.group, "head_dim": shape.head_dim}


def run_probe(groups, head_dims, decode=True):
    """Measure every case for every shape on the installed flashinfer: yields each shape's results.

    Where the reference of a head_dim fails (this flashinfer cannot build or plan
    fa2 for it), its other cases are recorded with that error instead of
    retrying the JIT build for each.
    """
    import torch

    workspace = torch.empty(fa2.DETERMINISTIC_WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    for head_dim in head_dims:
        failed = None
        for group in groups:
            shape = Shape(group, head_dim, workspace)
            results = []
            for case in cases(group, decode):
                result = measure(shape, case) if failed is None else {**_result(shape, case), "error": failed}
                failed = failed or (result.get("error") if case.fact == "reference" else None)
                results.append(result)
            yield results


def environment():
    import torch

    return {"flashinfer": installed_flashinfer(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}


# The keys SGLang's get_context_length (sglang/srt/utils/hf_transformers/common.py) reads, in its order.
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")


def read_config(path):
    """The config.json of the model folder `path`: its text_config where it has one, as SGLang reads
    a multimodal model's (hf_text_config)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def context_length(config):
    """A model's context length as SGLang derives it from its config (get_context_length): the
    first of CONTEXT_LENGTH_KEYS it has (2048 without one), times rope_scaling's factor unless the
    scaling names original_max_position_embeddings or is llama3's."""
    scaling = config.get("rope_scaling") or {}
    keeps = "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3"
    length = next((config[key] for key in CONTEXT_LENGTH_KEYS if config.get(key) is not None), 2048)
    return int((1 if keeps else scaling.get("factor", 1)) * length)


def model_shape(path):
    """(GQA group, head_dims, what config.json says) of the model folder `path`: attention heads
    per KV head before tensor parallelism, and every head_dim it uses (global_head_dim too).
    Raises ValueError naming what is missing or wrong."""
    try:
        config = read_config(path)
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dims = {config.get("head_dim") or config["hidden_size"] // heads, config.get("global_head_dim")} - {None}
    except OSError as error:
        raise ValueError(f"{path!r} has no readable config.json ({error.strerror or error}): give a local model folder") from None
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as error:
        raise ValueError(f"{path!r}: config.json gives no attention heads and head_dim ({type(error).__name__}: {error})") from None
    if not all(isinstance(n, int) and n > 0 for n in (heads, kv_heads, *head_dims)) or heads % kv_heads:
        raise ValueError(f"{path!r}: config.json's {heads!r} attention heads / {kv_heads!r} KV heads, head_dim "
                         f"{' and '.join(map(repr, head_dims))} are no GQA shape")
    said = f"{heads} attention heads / {kv_heads} KV heads, head_dim {' and '.join(map(str, sorted(head_dims)))}"
    return heads // kv_heads, sorted(head_dims), said


def shape_from_arguments(parser, model_path, groups, head_dims):
    """The GQA groups and head_dims a command runs with: the model's with --model-path, where a
    --group or --head-dim given too must agree with it (parser.error, exit 2, otherwise: a
    silent choice of one would plan or measure a shape the user did not mean)."""
    if model_path is None:
        return groups, head_dims
    try:
        group, model_head_dims, said = model_shape(model_path)
    except ValueError as error:
        parser.error(f"argument --model-path: {error}")
    if groups is not None and set(groups) != {group}:
        parser.error(f"--group {' '.join(map(str, groups))} disagrees with --model-path {model_path} "
                     f"({said}: GQA group {group}); give one of them")
    if head_dims is not None and not set(head_dims) <= set(model_head_dims):
        parser.error(f"--head-dim {' '.join(map(str, head_dims))} disagrees with --model-path {model_path} ({said})")
    return [group], head_dims or model_head_dims


def main(parser, args):
    """The `probe` subcommand; parser and args from cli.py (or __main__ below). Returns the exit
    status. The arguments are checked first, so a mistake is named on any machine."""
    groups, head_dims = shape_from_arguments(parser, args.model_path, args.group, args.head_dim)
    reason = why_not_measurable()
    if reason:
        print(f"sglang-chunk-align probe: cannot measure here: {reason}", file=sys.stderr)
        if args.json:  # one JSON document on every outcome, as verify --json
            print(json.dumps({"ok": False, "error": f"cannot measure here: {reason}"}))
        return CANNOT_MEASURE
    facts, warning = facts_for(installed_flashinfer())
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    checked = []
    for results in run_probe(groups or DEFAULT_GROUPS, head_dims or DEFAULT_HEAD_DIMS, decode=not args.no_decode):
        checked += verdicts(facts, results)
        _, status = summary(facts, checked)
        report = {"ok": status == HOLD, "environment": environment(), "facts": facts.flashinfer,
                  "facts_measured": facts.measured, "holds": status == HOLD, "results": checked}
        if args.out:  # after every shape, so a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1) if args.json else format_report(facts, checked))
    return status


def add_arguments(parser):
    parser.add_argument("--group", type=at_least(1), nargs="+", help="GQA groups to measure (default: the model's "
                        f"with --model-path, else {' '.join(map(str, DEFAULT_GROUPS))})")
    parser.add_argument("--head-dim", type=at_least(1), nargs="+", help="head_dims to measure (default: the model's "
                        f"with --model-path, else {' '.join(map(str, DEFAULT_HEAD_DIMS))})")
    parser.add_argument("--model-path", help="a local model folder: take the GQA group and head_dims from its config.json")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoded-rows case")
    parser.add_argument("--json", action="store_true", help="print the JSON report")
    parser.add_argument("--out", help="also write the JSON report to this file")


if __name__ == "__main__":  # python -m sglang_chunk_align.tools.probe: no CLI imports (wrapt, SGLang) needed
    import argparse

    cli = argparse.ArgumentParser(prog="sglang-chunk-align probe")
    add_arguments(cli)
    if "--json" in sys.argv:
        report_errors_as_json(cli)
    sys.exit(main(cli, cli.parse_args()))
