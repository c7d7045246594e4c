"""Every figure the README and benchmarks/logs/gemms_h200/COMMANDS.md give for issue 47's serving and
profile runs (call2, call3) and the GPU bits test (call4), read from their records."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks/logs/gemms_h200"
SERVING = {entry["setup"]: entry for entry in json.loads((RECORDS / "call2/serving.json").read_text())["setups"]}
TRITON = {entry["setup"]: entry for entry in json.loads((RECORDS / "call3/serving.json").read_text())["setups"]}
PROFILE = {entry["setup"]: entry for entry in json.loads((RECORDS / "call2/profile.json").read_text())["setups"]}
README = " ".join((ROOT / "README.md").read_text().split())
COMMANDS = " ".join((RECORDS / "COMMANDS.md").read_text().split())


def tok(value):
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def tok_s(entry):
    return [tok(entry["workloads"][w]["output_tok_s"]) for w in ("rl", "agent")]


def identical_per_pass(entry):
    """verify's "identical of requests", the same in both passes."""
    workloads = entry["verify"]["workloads"].values()
    found = {(sum(w["passes"][name]["identical"] for w in workloads), sum(w["passes"][name]["requests"] for w in workloads))
             for name in ("sequential", "concurrent")}
    assert len(found) == 1, found
    identical, requests = found.pop()
    return f"{identical} of {requests}"


def decode_ms(name, category="total"):
    return f"{PROFILE[name]['scenarios']['decode']['breakdown_ms_per_step'][category]:.2f}"


def test_the_readmes_gemm_figures_are_call2s():
    defaults, tuned, ceiling = (SERVING[n] for n in ("plugin-256-defaults", "plugin-256-gemms", "nondet-256"))
    assert defaults["env"] == {"SGLANG_PLUGINS": "chunk_align"}
    assert tuned["env"] == {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_GEMMS": "1"}
    (rl_before, agents_before), (rl_after, agents_after) = tok_s(defaults), tok_s(tuned)
    assert (f"rollouts {rl_before} to {rl_after} tok/s, agents {agents_before} to {agents_after} "
            f"(non-deterministic {' / '.join(tok_s(ceiling))}), both verified "
            f"{identical_per_pass(tuned)}") in README
    assert identical_per_pass(defaults) == identical_per_pass(tuned) == "36 of 36"
    assert (f"a decode step at batch 64 {decode_ms('plugin-256-defaults')} to {decode_ms('plugin-256-gemms')} ms "
            f"(non-deterministic {decode_ms('nondet-256')})") in README
    assert "NVIDIA H100" in json.loads((RECORDS / "call2/serving.json").read_text())["stack"]["gpu"]


def test_the_benchmarks_readme_gives_call2s_gemm_time():
    said = " ".join((ROOT / "benchmarks/README.md").read_text().split())
    assert (f"from {decode_ms('plugin-256-defaults', 'gemm')} to {decode_ms('plugin-256-gemms', 'gemm')} ms on an "
            "H100") in said


def test_the_gemm_configs_left_every_answer_as_stocks_config_gave_it():
    compared = json.loads((RECORDS / "call2/serving.json").read_text())["outputs_compared"]["plugin-256-gemms"]
    assert compared == {"against": "plugin-256-defaults", "agree": True, "rl": "128/128 requests identical",
                        "agent": "64/64 requests identical"}
    compared = json.loads((RECORDS / "call3/serving.json").read_text())["outputs_compared"]["triton-256-gemms"]
    assert compared["agree"] and compared["against"] == "triton-256"


def test_the_commands_tables_are_the_records():
    for name, label in (("plugin-256-defaults", "the plugin's defaults, stock's GEMM config"),
                        ("plugin-256-gemms", "the plugin's defaults, `SGLANG_CHUNK_ALIGN_GEMMS=1`")):
        rl, agents = tok_s(SERVING[name])
        verified = identical_per_pass(SERVING[name])
        assert f"| {label} | {rl} | {agents} | {verified} requests identical in both passes |" in COMMANDS, label
    for name, label in (("triton-256", "stock deterministic triton, chunk 256, radix cache"),
                        ("triton-256-gemms", "the same with the plugin's GEMM configs")):
        rl, agents = tok_s(TRITON[name])
        assert f"| {label} | {rl} | {agents} | {identical_per_pass(TRITON[name])} identical in each pass |" in COMMANDS
    for name, label in (("plugin-256-defaults", "the plugin's defaults"),
                        ("plugin-256-gemms", "with `SGLANG_CHUNK_ALIGN_GEMMS=1`"),
                        ("nondet-256", "non-deterministic flashinfer")):
        assert f"| {label} | {decode_ms(name)} ms | {decode_ms(name, 'gemm')} ms |" in COMMANDS, label


def test_stock_triton_failed_only_the_chat_turns_after_a_radix_hit():
    """README: "27 of 36 `verify` requests identical"; the 9 are every chat turn after the first, in both
    setups and both passes, each first differing in its prompt."""
    for entry in TRITON.values():
        assert entry["verify_ok"] is False and identical_per_pass(entry) == "27 of 36"
        chat = entry["verify"]["workloads"]["chat"]
        for run in chat["passes"].values():
            assert sorted((f["turn"], f["first_difference"]) for f in run["failures"]) == sorted(
                [(turn, "input") for turn in (1, 2, 3)] * 3)
    assert "(27 of 36 `verify` requests identical), where the plugin passed 36 of 36" in README


def test_call4s_bits_test_passed_whole_on_an_h100():
    log = (RECORDS / "call4/gemm-bits.log").read_text()
    assert "14 passed" in log and "failed" not in log and log.rstrip().endswith("exit 0")
    assert "H100" in (RECORDS / "call4/gpu.txt").read_text()
    assert "**14 passed**" in COMMANDS
