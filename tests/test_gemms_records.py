"""Every figure the README and benchmarks/logs/gemms_h200/COMMANDS.md give for issue 47's serving and
profile runs (call2, call3, call5, call6, call8, call9, call10), the GPU bits tests (call4, call5, call6,
call9, call10) and the split-K probe (call9), read from their records."""

import json
import pathlib

from benchmarks.gemm_configs import decode_step_gemms
from benchmarks.random_checkpoint import describe

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks/logs/gemms_h200"
SERVING = {entry["setup"]: entry for entry in json.loads((RECORDS / "call2/serving.json").read_text())["setups"]}
TRITON = {entry["setup"]: entry for entry in json.loads((RECORDS / "call3/serving.json").read_text())["setups"]}
PROFILE = {entry["setup"]: entry for entry in json.loads((RECORDS / "call2/profile.json").read_text())["setups"]}
MODES = {entry["setup"]: entry for entry in json.loads((RECORDS / "call5/serving.json").read_text())["setups"]}
SIDE_BY_SIDE = {entry["setup"]: entry for entry in json.loads((RECORDS / "call6/serving.json").read_text())["setups"]}
WARMED_RUN = json.loads((RECORDS / "call8/serving.json").read_text())
WARMED = {entry["setup"]: entry for entry in WARMED_RUN["setups"]}
MODES_PROFILE = {entry["setup"]: entry for entry in json.loads((RECORDS / "call5/profile.json").read_text())["setups"]}
README = " ".join((ROOT / "README.md").read_text().split())
COMMANDS = " ".join((RECORDS / "COMMANDS.md").read_text().split())
DOCS = " ".join((ROOT / "docs/gemms.md").read_text().split())
SERVING_DOC = " ".join((ROOT / "docs/serving.md").read_text().split())


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


def timed_row(entry, label):
    """The start of a COMMANDS.md serving table's row: rollouts, their first token, agents."""
    rl, agents = (entry["workloads"][w] for w in ("rl", "agent"))
    return f"| {label} | {rl['output_tok_s']:,.1f} | {rl['ttft_p50_s']:.2f} s | {agents['output_tok_s']:,.1f} |"


def assert_every_prefill_replayed_a_graph(entry, label):
    """Every prefill step of both workloads a CUDA graph's, each "N of N" in COMMANDS.md."""
    for w in ("rl", "agent"):
        prefill = entry["workloads"][w]["prefill"]
        assert prefill["graph_steps"] == prefill["steps"], (label, w)
        assert f"{prefill['steps']} of {prefill['steps']}" in COMMANDS


def breakdown(name, profile=PROFILE, scenario="decode"):
    """A profiled step's GPU time per category, in ms."""
    return profile[name]["scenarios"][scenario]["breakdown_ms_per_step"]


def profiled_ms(name, category="total", profile=PROFILE, scenario="decode"):
    """A profiled step's GPU time in one category (ms, as the tables print it)."""
    return f"{breakdown(name, profile, scenario)[category]:.2f}"


def share(name, workload):
    ceiling = SIDE_BY_SIDE["nondet-256-control"]["workloads"][workload]["output_tok_s"]
    return f"{SIDE_BY_SIDE[name]['workloads'][workload]['output_tok_s'] / ceiling:.0%}"


def gain(name, workload, over="plugin-256-stock-ops", runs=SIDE_BY_SIDE):
    return f"{runs[name]['workloads'][workload]['output_tok_s'] / runs[over]['workloads'][workload]['output_tok_s']:.2f}x"


def test_the_readmes_modes_table_is_call6s_with_call2s_and_call5s_decode_steps():
    """call6 ran the setups side by side; the decode steps are call2's profile (stock's config, before the
    norms existed: stock's ops) and call5's."""
    stock, defaults, fast = (SIDE_BY_SIDE[name] for name in ("plugin-256-stock-ops", "plugin-256-defaults", "plugin-256-fast"))
    assert stock["env"] == {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_GEMMS": "0", "SGLANG_CHUNK_ALIGN_NORMS": "0"}
    assert defaults["env"] == {"SGLANG_PLUGINS": "chunk_align"}
    assert fast["env"] == {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"}
    assert identical_per_pass(stock) == identical_per_pass(defaults) == identical_per_pass(fast) == "36 of 36"
    assert stock["verify_ok"] and defaults["verify_ok"] and fast["verify_ok"]
    assert fast["verify"]["recorded"].endswith("baseline-flashinfer-fast.json")
    assert stock["verify"]["recorded"].endswith("baseline-flashinfer.json")
    assert defaults["verify"]["recorded"].endswith("baseline-flashinfer.json")
    control = SIDE_BY_SIDE["nondet-256-control"]
    assert control["verify_ok"] is False and identical_per_pass(control) == "0 of 36"
    assert SERVING["plugin-256-defaults"]["env"] == {"SGLANG_PLUGINS": "chunk_align"}  # call2: before the configs
    rows = {"plugin-256-stock-ops": ("| stock's GEMM config and RMSNorm (`GEMMS=0`, `NORMS=0`) |",
                                     profiled_ms("plugin-256-defaults")),
            "plugin-256-defaults": ("| the plugin's defaults (stock's bits) |",
                                    profiled_ms("plugin-256-defaults", profile=MODES_PROFILE)),
            "plugin-256-fast": ("| with `SGLANG_CHUNK_ALIGN_FAST_GEMMS=1` |",
                                profiled_ms("plugin-256-fast", profile=MODES_PROFILE))}
    for name, (label, step) in rows.items():
        row = f"{label} {' / '.join(tok_s(SIDE_BY_SIDE[name]))} | {share(name, 'rl')} / {share(name, 'agent')} | {step} ms |"
        assert row in README, row
    assert (f"| non-deterministic flashinfer | {' / '.join(tok_s(control))} | | "
            f"{profiled_ms('nondet-256', profile=MODES_PROFILE)} ms | its control: 0 identical |") in README
    warmed = [gain("plugin-256-defaults", w, runs=WARMED) for w in ("agent", "rl")]
    assert (f"{gain('plugin-256-defaults', 'agent')} the agents of stock's ops "
            f"({gain('plugin-256-defaults', 'rl')} the rollouts, high: timed first; call8, its sampler warmed: "
            f"{warmed[0]} and {warmed[1]}), every answer the same") in README
    assert SIDE_BY_SIDE["plugin-256-fast"]["workloads"]["agent"]["output_tok_s"] > defaults["workloads"]["agent"]["output_tok_s"]
    for call in ("call2", "call5", "call6"):
        assert "NVIDIA H100" in json.loads((RECORDS / f"{call}/serving.json").read_text())["stack"]["gpu"], call


def test_call6s_table_and_gains_are_the_records():
    for name in SIDE_BY_SIDE:
        rl, agents = (f"{SIDE_BY_SIDE[name]['workloads'][w]['output_tok_s']:,.1f}" for w in ("rl", "agent"))
        assert f"| {rl} | {agents} |" in COMMANDS, name
    assert (f"the defaults served {gain('plugin-256-defaults', 'rl')} the rollouts and "
            f"{gain('plugin-256-defaults', 'agent')} the agents") in COMMANDS
    assert f"fast mode {gain('plugin-256-fast', 'rl')} and {gain('plugin-256-fast', 'agent')}" in COMMANDS
    shares = [f"{share(name, 'rl')} / {share(name, 'agent')}"
              for name in ("plugin-256-stock-ops", "plugin-256-defaults", "plugin-256-fast")]
    assert f"stock's ops {shares[0]}, the defaults {shares[1]}, fast mode {shares[2]}" in COMMANDS
    compared = json.loads((RECORDS / "call6/serving.json").read_text())["outputs_compared"]["plugin-256-defaults"]
    assert compared == {"against": "plugin-256-stock-ops", "agree": True, "rl": "128/128 requests identical",
                        "agent": "64/64 requests identical"}


def test_docs_gemms_gives_call6s_figures():
    rl, agents = ([tok(SIDE_BY_SIDE[name]["workloads"][w]["output_tok_s"])
                   for name in ("plugin-256-stock-ops", "plugin-256-defaults", "plugin-256-fast")] for w in ("rl", "agent"))
    ceiling = tok_s(SIDE_BY_SIDE["nondet-256-control"])
    assert (f"rollouts {rl[0]}, {rl[1]} and {rl[2]} tok/s, agents {agents[0]}, {agents[1]} and {agents[2]} "
            f"(non-deterministic {ceiling[0]} and {ceiling[1]}): the defaults {gain('plugin-256-defaults', 'rl')} and "
            f"{gain('plugin-256-defaults', 'agent')} stock's ops with every answer the same, fast mode "
            f"{gain('plugin-256-fast', 'rl')} and {gain('plugin-256-fast', 'agent')}") in DOCS
    over = "plugin-256-defaults"
    assert (f"it served {gain('plugin-256-fast', 'rl', over)} their rollouts and "
            f"{gain('plugin-256-fast', 'agent', over)} their agents") in DOCS


def test_call6s_landed_norm_test_passed():
    assert "20 passed" in (RECORDS / "call6/norm-bits.log").read_text()
    log = (RECORDS / "call6/log").read_text()
    assert "== norm-bits: exit 0" in log and "== serving: exit 0" in log


def test_call5s_tables_are_the_records():
    for name in ("plugin-256-defaults", "plugin-256-fast", "nondet-256", "nondet-256-control"):
        rl, agents = (f"{MODES[name]['workloads'][w]['output_tok_s']:,.1f}" for w in ("rl", "agent"))
        assert f"| {rl} | {agents} |" in COMMANDS, name
    for name, label in (("plugin-256-defaults", "the plugin's defaults"),
                        ("plugin-256-fast", "the defaults and fast GEMMs"),
                        ("nondet-256", "non-deterministic flashinfer")):
        cells = [profiled_ms(name, c, MODES_PROFILE) for c in ("total", "gemm", "norm", "rest")]
        decode = MODES_PROFILE[name]["scenarios"]["decode"]
        row = (f"| {label} | {cells[0]} ms | {cells[1]} ms | {cells[2]} ms | {cells[3]} ms | "
               f"{decode['itl_p50_s_unprofiled'] * 1000:.1f} ms | {profiled_ms(name, profile=MODES_PROFILE, scenario='chunk')} ms "
               f"(GEMMs {profiled_ms(name, 'gemm', MODES_PROFILE, 'chunk')}) |")
        assert row in COMMANDS, row


def test_call5s_norm_and_fast_bits_passed_with_their_controls():
    norms = (RECORDS / "call5/norms-driver.txt").read_text()
    assert "20 passed" in norms and "failed" not in norms and "== norm-bits: exit 0" in norms
    log = (RECORDS / "call5/log").read_text()
    assert "4 passed, 14 deselected" in log and "== gemm-bits: exit 0" in log
    assert "SGLANG_CHUNK_ALIGN_NORMS=0" not in log  # call5.sh's fallback did not run
    defaults = MODES["plugin-256-defaults"]
    assert any("RMSNorms that add a residual run as three kernels" in line for line in defaults["plugin_lines"])
    kernels = MODES_PROFILE["plugin-256-defaults"]["scenarios"]["decode"]["kernels"]
    assert {"add_and_square", "scale"} <= set(kernels)


def test_the_benchmarks_readme_gives_call2s_gemm_time():
    said = " ".join((ROOT / "benchmarks/README.md").read_text().split())
    assert (f"from {profiled_ms('plugin-256-defaults', 'gemm')} to {profiled_ms('plugin-256-gemms', 'gemm')} ms on an "
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
        assert f"| {label} | {profiled_ms(name)} ms | {profiled_ms(name, 'gemm')} ms |" in COMMANDS, label


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


def test_docs_gemms_gives_call7s_tiles_from_its_record():
    """call7: the tiles a fast server kept (its startup line, in the record's server log), its verify, and its
    rollouts beside call6's fast server without tiles."""
    import tarfile

    with tarfile.open(RECORDS / "call7/logs.tgz") as logs:
        fast_log = logs.extractfile("g7/serving-logs/plugin-256-fast.log").read().decode()
    tiles_line = next(line for line in fast_log.splitlines() if "fast GEMMs run one program per tile" in line)
    assert tiles_line.partition("] ")[2] in DOCS
    tiled = {entry["setup"]: entry for entry in json.loads((RECORDS / "call7/serving.json").read_text())["setups"]}
    fast = tiled["plugin-256-fast"]
    assert fast["env"] == {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"}
    assert fast["verify_ok"] and identical_per_pass(fast) == "36 of 36"
    assert fast["verify"]["recorded"].endswith("baseline-flashinfer-fast.json")
    rollouts = [SIDE_BY_SIDE["plugin-256-fast"]["workloads"]["rl"], fast["workloads"]["rl"]]
    assert (f"rollouts {tok(rollouts[1]['output_tok_s'])} tok/s, first token after {rollouts[1]['ttft_p50_s']:.2f} s, "
            f"where call6's fast server without tiles got {tok(rollouts[0]['output_tok_s'])} and the same "
            f"{rollouts[0]['ttft_p50_s']:.2f} s") in DOCS
    assert "3 passed" in (RECORDS / "call7/gemm-bits.log").read_text()


def test_call8_timed_stocks_ops_first_with_the_sampler_warmed_and_has_no_control():
    """call8 (an H100): stock's ops timed first, then the defaults, both verified against stock's unchunked
    reference; the limit cut the control, which COMMANDS.md and docs/gemms.md say. Its table, gains, first
    tokens and prefill steps are the record's, every prefill step a CUDA graph's."""
    assert "NVIDIA H100" in WARMED_RUN["stack"]["gpu"] and WARMED_RUN["stack"]["flashinfer-python"] == "0.7.2"
    assert list(WARMED) == ["plugin-256-stock-ops", "plugin-256-defaults"]
    assert "this run has no control" in COMMANDS and "== serving: exit 124" in (RECORDS / "call8/log").read_text()
    stock, defaults = WARMED["plugin-256-stock-ops"], WARMED["plugin-256-defaults"]
    assert stock["env"] == SIDE_BY_SIDE["plugin-256-stock-ops"]["env"] and defaults["env"] == {"SGLANG_PLUGINS": "chunk_align"}
    for entry, label in ((stock, "stock's GEMM config and RMSNorm, **timed first**"), (defaults, "the plugin's defaults")):
        assert entry["verify_ok"] and identical_per_pass(entry) == "36 of 36"
        assert entry["verify"]["recorded"].endswith("baseline-flashinfer.json")
        assert f"{timed_row(entry, label)} 36 of 36 identical in both passes, against stock's unchunked flashinfer |" in COMMANDS
        assert_every_prefill_replayed_a_graph(entry, label)
    assert WARMED_RUN["outputs_compared"]["plugin-256-defaults"] == {
        "against": "plugin-256-stock-ops", "agree": True, "rl": "128/128 requests identical", "agent": "64/64 requests identical"}
    rl, agents = (gain("plugin-256-defaults", w, runs=WARMED) for w in ("rl", "agent"))
    assert f"The defaults served {rl} the rollouts and {agents} the agents of stock's ops" in COMMANDS
    first = stock["workloads"]["rl"]["ttft_p50_s"]
    assert (f"call8 timed stock's ops first (first token after {first:.2f} s, no stall in a timed request) and the "
            f"defaults served {rl} their rollouts ({tok(defaults['workloads']['rl']['output_tok_s'])} against "
            f"{tok(stock['workloads']['rl']['output_tok_s'])} tok/s) and {agents} their agents "
            f"({tok(defaults['workloads']['agent']['output_tok_s'])} against {tok(stock['workloads']['agent']['output_tok_s'])})") in DOCS
    assert "call8 has no control" in DOCS
    unwarmed = SIDE_BY_SIDE["plugin-256-stock-ops"]["workloads"]["rl"]
    assert (f"call8 timed stock's GEMM config and RMSNorm first, their first token came after {first:.2f} s "
            f"({unwarmed['ttft_p50_s']:.2f} s timed first in call6)") in SERVING_DOC
    assert (f"after {first:.2f} s (call6, timed first without the sampled warm-up: {unwarmed['ttft_p50_s']:.2f} s, "
            f"{unwarmed['output_tok_s']:,.1f} rollout tok/s)") in COMMANDS


def test_call9s_probe_keeps_the_tiles_and_its_fast_server_and_bits_are_the_records():
    """call9 (an H100): the probe's tiles against fast mode's default launch, row by row and summed at M=1;
    fast mode's bits (7 of 8, none failed); fast mode served beside the control, which failed verify."""
    probe = json.loads((RECORDS / "call9/probe_split_k.json").read_text())
    assert probe["complete"] and all(probe["verdict"].values()) and "H100" in probe["environment"]["gpu"]

    def default_launch(shape):
        return f"split_{shape['fast_mode']['splits']}_s"

    tiled = [(t["fast_s"], t[default_launch(shape)]) for shape in probe["shapes"]
             for t in shape["timed"].values() if t["fast_tile"]]
    faster = sum(fast < default for fast, default in tiled)
    assert f"faster than the default launch at {faster} of the {len(tiled)} timed rows where a tile ran" in DOCS
    assert f"Of the {len(tiled)} timed rows where a tile ran, it was faster at {faster}" in COMMANDS

    def summed_at_1(key):
        return sum(shape["timed"]["1"][key(shape)] for shape in probe["shapes"]) * 1e6

    fast, default = summed_at_1(lambda s: "fast_s"), summed_at_1(default_launch)
    tuned, cublas = summed_at_1(lambda s: "tuned_s"), summed_at_1(lambda s: "cublas_s")
    assert f"M=1: {fast:.1f} µs against {default:.1f} (cuBLAS {cublas:.1f}, so fast mode {fast / cublas:.2f}x it" in DOCS
    assert (f"{fast:.1f} µs, its default launch {default:.1f}, the per-M configs (stock's bits) {tuned:.1f}, "
            f"cuBLAS {cublas:.1f}: {fast / cublas:.2f}x cuBLAS" in COMMANDS)
    bits = (RECORDS / "call9/gemm-bits.log").read_text()
    assert "7 passed" in bits and "failed" not in bits
    run = json.loads((RECORDS / "call9/serving.json").read_text())
    setups = {entry["setup"]: entry for entry in run["setups"]}
    assert list(setups) == ["plugin-256-fast", "nondet-256-control"] and "H100" in run["stack"]["gpu"]
    assert run["weights"] == describe(0)
    fast_server, control = setups["plugin-256-fast"], setups["nondet-256-control"]
    assert fast_server["env"] == {"SGLANG_PLUGINS": "chunk_align", "SGLANG_CHUNK_ALIGN_FAST_GEMMS": "1"}
    assert fast_server["verify_ok"] and identical_per_pass(fast_server) == "36 of 36"
    assert fast_server["verify"]["recorded"].endswith("baseline-flashinfer-fast.json")
    mixed = control["verify"]["workloads"]["mixed"]["passes"]
    assert not control["verify_ok"] and {p["identical"] for p in mixed.values()} == {0}
    for entry, label in ((fast_server, "fast mode (`SGLANG_CHUNK_ALIGN_FAST_GEMMS=1`), **timed first**"),
                         (control, "control: non-deterministic flashinfer")):
        assert timed_row(entry, label) in COMMANDS
        assert_every_prefill_replayed_a_graph(entry, label)
    rl, agents = (gain("plugin-256-fast", w, over="nondet-256-control", runs=setups) for w in ("rl", "agent"))
    assert f"Fast mode served {rl} the control's rollouts and {agents} its agents" in COMMANDS
    assert (f"it served {tok(fast_server['workloads']['rl']['output_tok_s'])} rollout and "
            f"{tok(fast_server['workloads']['agent']['output_tok_s'])} agent tok/s, {rl} and {agents} "
            "non-deterministic flashinfer's in the same run") in DOCS


def test_call10_served_both_modes_beside_the_control_and_its_cost_is_the_records():
    """call10 (an H100): the defaults, the control and fast mode in one run, each deterministic setup verified
    against its own unchunked reference, the control failing; determinism's cost with each mode as the README,
    docs/gemms.md and COMMANDS.md give it; the fp16 down tile test, the one call9 cut, passed."""
    run = json.loads((RECORDS / "call10/serving.json").read_text())
    setups = {entry["setup"]: entry for entry in run["setups"]}
    assert list(setups) == ["plugin-256-defaults", "nondet-256-control", "plugin-256-fast"]
    assert "NVIDIA H100" in run["stack"]["gpu"] and run["stack"]["flashinfer-python"] == "0.7.2"
    assert run["weights"] == describe(0)  # well-scaled, where a last-bit difference shows
    defaults, control, fast = (setups[name] for name in setups)
    for entry, reference in ((defaults, "baseline-flashinfer.json"), (fast, "baseline-flashinfer-fast.json")):
        assert entry["verify_ok"] and identical_per_pass(entry) == "36 of 36"
        assert entry["verify"]["recorded"].endswith(reference)
    assert not control["verify_ok"] and identical_per_pass(control) == "0 of 36"
    for entry, label in ((defaults, "the plugin's defaults, **timed first**"), (control, "control: non-deterministic flashinfer"),
                         (fast, "fast mode (`SGLANG_CHUNK_ALIGN_FAST_GEMMS=1`)")):
        assert timed_row(entry, label) in COMMANDS
        assert_every_prefill_replayed_a_graph(entry, label)
    defaults_rl, defaults_agents, fast_rl, fast_agents = (gain("nondet-256-control", w, over=name, runs=setups)
                                                          for name in ("plugin-256-defaults", "plugin-256-fast")
                                                          for w in ("rl", "agent"))
    assert (f"determinism cost {defaults_rl} on rollouts and {defaults_agents} on agents with the defaults "
            f"(stock's bits), {fast_rl} and {fast_agents} in fast mode") in COMMANDS
    assert (f"**determinism costs {defaults_rl} on rollouts and {defaults_agents} on agents with the defaults, "
            f"{fast_rl} and {fast_agents} with fast GEMMs**") in README
    assert (f"So determinism costs {defaults_rl} on rollouts and {defaults_agents} on agents with the defaults, "
            f"{fast_rl} and {fast_agents} in fast mode") in DOCS
    for entry in (defaults, fast, control):
        assert f"{tok(entry['workloads']['rl']['output_tok_s'])} / {tok(entry['workloads']['agent']['output_tok_s'])}" in DOCS
    for entry in (defaults, fast):
        shares = [entry["workloads"][w]["output_tok_s"] / control["workloads"][w]["output_tok_s"] for w in ("rl", "agent")]
        assert "{} / {} | {:.0%} / {:.0%} |".format(*tok_s(entry), *shares) in DOCS
    over_defaults = [gain("plugin-256-fast", w, over="plugin-256-defaults", runs=setups) for w in ("rl", "agent")]
    assert "Fast mode served {} the defaults' rollouts and {} their agents".format(*over_defaults) in COMMANDS
    assert "served {} the defaults' rollouts and {} their agents".format(*over_defaults) in DOCS
    kept = next(line for line in fast["plugin_lines"] if "one program per tile" in line)
    assert "bfloat16 3584x3584: M 129-256; bfloat16 3584x18944: M 129-256; bfloat16 4608x3584 +bias: none" in kept
    assert "1 passed, 21 deselected" in (RECORDS / "call10/gemm-bits.log").read_text()


def test_docs_gemms_weighs_the_other_ops_by_call5s_profile():
    """What a decode step at batch 64 pays for determinism beyond non-deterministic flashinfer's, op by op."""
    defaults, nondet = (breakdown(name, MODES_PROFILE) for name in ("plugin-256-defaults", "nondet-256"))
    gap = {category: defaults[category] - nondet[category]
           for category in ("total", "gemm", "norm", "sampling", "attention", "rest")}
    assert gap["attention"] < 0 and gap["rest"] < 0
    assert (f"took {gap['total']:.2f} ms more than non-deterministic flashinfer's: GEMMs {gap['gemm']:.2f} ms of it, "
            f"norms {gap['norm']:.2f} ms, sampling {gap['sampling']:.2f} ms") in DOCS

    def softmax_us(setup):
        kernels = MODES_PROFILE[setup]["scenarios"]["decode"]["kernels"]
        return sum(k["us"] for name, k in kernels.items() if "SoftMaxForward" in name)

    assert abs(softmax_us("plugin-256-defaults") / softmax_us("nondet-256") - 1) < 0.02


def test_docs_gemms_weighs_both_modes_against_the_issues_goals():
    """Each figure of docs/gemms.md's goals table, from call1's micro run, call5's profile, call6's serving and
    call9's probe."""
    micro = json.loads((RECORDS / "call1/gemm_configs.json").read_text())
    timed_m = set(micro["shapes"][0]["timed"])
    assert {int(m) for m in timed_m} == {1, 8, 16, 32, 64, 128, 256}
    steps = [step for m in timed_m for step in decode_step_gemms(micro["results"], micro["shapes"], m).values()]
    assert len(steps) == 12 * len(timed_m)  # six families, bf16 and fp16, at every M
    worst = max(step["tuned_s"] / step["cublas_s"] for step in steps)
    probe = json.loads((RECORDS / "call9/probe_split_k.json").read_text())
    fast_at_1 = (sum(s["timed"]["1"]["fast_s"] for s in probe["shapes"])
                 / sum(s["timed"]["1"]["cublas_s"] for s in probe["shapes"]))
    # the non-deterministic server's GEMMs are cuBLAS's
    fast_gemms = breakdown("plugin-256-fast", MODES_PROFILE)["gemm"] / breakdown("nondet-256", MODES_PROFILE)["gemm"]
    assert (f"| at most {worst:.2f}x: a decode step's GEMMs per model, six families, bf16 and fp16, M 1-256 (call1) "
            f"| {fast_gemms:.2f}x at batch 64 (call5), but {fast_at_1:.2f}x at M=1 over qkv, o and down (call9): "
            "**missed** |") in DOCS
    assert worst <= 1.8 and fast_gemms <= 1.3 < fast_at_1
    assert (f"| {profiled_ms('plugin-256-defaults', profile=MODES_PROFILE)} ms (call5) "
            f"| {profiled_ms('plugin-256-fast', profile=MODES_PROFILE)} ms (call5): **missed**; non-deterministic "
            f"{profiled_ms('nondet-256', profile=MODES_PROFILE)} |") in DOCS
    assert (f"| agents' tok/s over stock's ops (1.25x / 1.5x) | {gain('plugin-256-defaults', 'agent')} (call6) "
            f"| {gain('plugin-256-fast', 'agent')} (call6) |") in DOCS
