"""examples/engine_rollout.py on the CPU, with sglang.Engine stood in for (it needs a GPU).

The stand-in answers the way an Engine's result depends on its inputs: a sampled
rollout is a function of the prompt, the sampling_seed and the loaded weights;
greedy answers come from test_verify's model (through test_in_process's Engine
stand-in, so verify_engine runs for real). Each fault the example exists to
catch (a replay that differs, an update that never reaches the model, samples
without their seeds) must make it exit 1; a faithful Engine passes.
"""

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_in_process import EngineStandIn

from benchmarks import random_checkpoint

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("engine_rollout", ROOT / "examples" / "engine_rollout.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)

ARGS = ["--model-path", "stand-in", "--weights", "dummy", "--groups", "3", "--samples", "2", "--max-new-tokens", "5",
        "--verify-prompts", "4"]


class RolloutEngine(EngineStandIn):
    """sglang.Engine's batch generate, weight updates, flushes and memory calls, over EngineStandIn."""

    made = []

    def __init__(self, fault=None, **arguments):
        super().__init__(radix=arguments["chunked_prefill_size"] != -1, perturb=self.rules_off_differ)
        self.arguments, self.fault, self.weights, self.released, self.calls = arguments, fault, None, False, []
        self.tokenizer_manager.model_config.hidden_size = 8
        self.generated, self.session = 0, False
        RolloutEngine.made.append(self)

    def rules_off_differ(self, request):
        """The plugin without its grid rules differs on long prompts (the rules' case), where the fault
        asks for it; the grid rules' switch is read as the Engine's scheduler reads it, from the environment."""
        if self.fault == "rules off differ" and os.environ.get("SGLANG_CHUNK_ALIGN_RULES") == "0" and len(request.tokens) > 300:
            return "output_id", 0
        return None

    def begin_weight_update(self):
        assert not self.session
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors):
        if not self.session:  # SGLang 0.5.23's refusal
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        self.calls.append("update")
        if self.fault != "update ignored" or self.weights is None:
            self.weights = hashlib.sha256(b"".join(t.float().numpy().tobytes() for _, t in named_tensors)).hexdigest()
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self.calls.append("flush")
        return SimpleNamespace(success=True, message="")

    def release_memory_occupation(self):
        self.calls.append("release")
        self.released = True

    def resume_memory_occupation(self):
        self.calls.append("resume")
        self.released = False

    def generate(self, input_ids, sampling_params, return_logprob):
        assert not self.released and return_logprob
        self.generated += 1
        replies = []
        for ids, params in zip(input_ids, sampling_params):
            seed = params["sampling_seed"] if self.fault != "seeds ignored" else 42
            drift = self.generated if self.fault == "replay differs" else 0
            key = f"{ids} {seed} {self.weights} {drift}".encode()
            tokens = [hashlib.sha256(key + bytes([i])).digest()[0] for i in range(params["max_new_tokens"])]
            replies.append({"output_ids": tokens, "meta_info": {
                "output_token_logprobs": [[-t / 7.0, t, None] for t in tokens], "cached_tokens": 0}})
        return replies

    def shutdown(self):
        self.calls.append("shutdown")


@pytest.fixture
def engine_kind(monkeypatch):
    import sglang

    monkeypatch.setenv("SGLANG_PLUGINS", "")
    RolloutEngine.made.clear()

    def use(fault=None):
        monkeypatch.setattr(sglang, "Engine", lambda **arguments: RolloutEngine(fault, **arguments))

    return use


def run(capsys, *args):
    code = example.main([*ARGS, *args])
    return code, capsys.readouterr()


def test_the_cycle_and_the_check_pass_on_a_faithful_engine(engine_kind, tmp_path, capsys):
    engine_kind()
    reference = str(tmp_path / "reference.json")
    code, out = run(capsys, "--record-reference", reference)
    assert code == 0 and "verify_engine (server)" in out.out, out
    stock = RolloutEngine.made[-1]
    assert stock.arguments["chunked_prefill_size"] == -1 and "enable_memory_saver" not in stock.arguments
    assert stock.calls == ["update", "flush", "shutdown"]
    record_file = str(tmp_path / "cycle.json")
    code, out = run(capsys, "--recorded", reference, "--json", record_file)
    assert code == 0, out
    record = json.loads(Path(record_file).read_text())
    assert record["ok"] and record["verify"]["ok"] and record["verify"]["baseline"] == "recorded"
    steps = record["cycle"]["steps"]
    assert [(s["policy"], s["order"]) for s in steps] == [(0, "forward"), (1, "forward"), (0, "reverse"), (1, "reverse")]
    assert [s.get("identical_to_first_run") for s in steps] == [None, None, 6, 6]
    assert steps[0]["digest"] == steps[2]["digest"] != steps[1]["digest"] == steps[3]["digest"]
    assert record["cycle"]["rollouts_changed_by_the_update"] == 6
    engine = RolloutEngine.made[-1]
    assert engine.arguments["chunked_prefill_size"] == 256 and engine.arguments["enable_memory_saver"]
    # Policy 0 first; memory released and resumed before each later step; policy 0 again before the check.
    assert engine.calls == ["update", "flush"] + ["release", "resume", "update", "flush"] * 3 + ["update", "flush", "shutdown"]


@pytest.mark.parametrize("fault, says", [
    ("replay differs", "policy 0 again: 6 of 6 rollouts differ from its first run"),
    ("update ignored", "policy 1's rollouts equal policy 0's: the weight update did not reach the model"),
    ("seeds ignored", "policy 0: a group's samples came out alike: does each get its own sampling_seed?"),
])
def test_each_fault_the_example_exists_to_catch_fails_it(engine_kind, capsys, fault, says):
    engine_kind(fault)
    code, out = run(capsys)
    assert code == 1 and f"FAILED: {says}" in out.out and out.out.rstrip().endswith("NOT OK"), out


def test_a_check_that_finds_a_difference_fails_the_example(engine_kind, tmp_path, capsys):
    engine_kind()
    reference = str(tmp_path / "reference.json")
    assert run(capsys, "--record-reference", reference)[0] == 0
    answers = json.loads(Path(reference).read_text())
    for answer in answers.values():  # the reference's last input logprob of each request, one ULP off
        answer["input_logprobs"][-1] = answer["input_logprobs"][-1] * (1 + 2 ** -52) if answer["input_logprobs"][-1] else None
    Path(reference).write_text(json.dumps(answers))
    code, out = run(capsys, "--recorded", reference)
    assert code == 1 and "FAILED: verify_engine: requests differ" in out.out, out


def test_an_engine_that_does_not_start_is_one_line_and_exit_2(monkeypatch, capsys):
    import sglang

    def refuse(**arguments):
        raise ValueError("Chunked prefill is aligned to 128 tokens")

    monkeypatch.setattr(sglang, "Engine", refuse)
    monkeypatch.setenv("SGLANG_PLUGINS", "")
    code, out = run(capsys, "--chunk", "100")
    assert code == 2 and out.err == "engine_rollout: the Engine did not start: ValueError: Chunked prefill is aligned to 128 tokens\n"


@pytest.mark.parametrize("weights", [["--weights", "dummy"], ["--dummy"]])
def test_dummy_weights_reach_the_engine_as_its_keywords_and_the_record_says_so(engine_kind, tmp_path, capsys, weights):
    engine_kind()
    record_file = tmp_path / "cycle.json"
    assert example.main(["--model-path", "stand-in", *weights, *ARGS[4:], "--json", str(record_file)]) == 0
    engine = RolloutEngine.made[-1]
    assert engine.arguments["model_path"] == "stand-in"
    assert engine.arguments["load_format"] == "dummy" and engine.arguments["skip_tokenizer_init"] is True
    assert json.loads(record_file.read_text())["weights"] == random_checkpoint.DUMMY


def test_random_weights_are_written_once_and_loaded_as_a_checkpoint(engine_kind, tmp_path, capsys):
    """--weights random: the Engine loads the written checkpoint as a real one (no load_format), without a
    tokenizer; the record names the weights; the stand-in trainer's policies are a real model's (1 + noise)."""
    engine_kind()
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "num_hidden_layers": 1,
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 256, "bos_token_id": 1, "eos_token_id": 2}))
    record_file = tmp_path / "cycle.json"
    argv = ["--model-path", str(config), "--weights", "random", "--weights-seed", "7", "--checkpoints",
            str(tmp_path / "weights"), *ARGS[4:], "--json", str(record_file)]
    assert example.main(argv) == 0, capsys.readouterr()
    engine = RolloutEngine.made[-1]
    written = tmp_path / "weights" / "random-config-seed7"
    assert engine.arguments["model_path"] == str(written) and (written / random_checkpoint.NOTE).is_file()
    assert engine.arguments["skip_tokenizer_init"] is True and "load_format" not in engine.arguments
    assert json.loads(record_file.read_text())["weights"] == random_checkpoint.describe(7)
    norm = example.Policies(example.parse(argv), 64, __import__("torch")).tensors(0)[0][1].float()
    assert abs(norm.mean().item() - 1) < 0.2


def test_a_random_checkpoint_that_cannot_be_written_is_one_line_and_exit_2(engine_kind, tmp_path, capsys):
    engine_kind()
    code, out = run(capsys, "--weights", "random", "--checkpoints", str(tmp_path))
    assert code == 2 and out.err == "engine_rollout: stand-in holds no config.json\n" and not RolloutEngine.made


def test_the_control_passes_where_the_rules_off_are_found_inexact_and_fails_where_not(engine_kind, tmp_path, capsys,
                                                                                      monkeypatch):
    """--control: the plugin with SGLANG_CHUNK_ALIGN_RULES=0 (set before the Engine starts), no cycle, checked against
    the reference; exit 0 with the fraction that differed, exit 1 ("could not see") where every request was identical."""
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "1")  # restored after the test: the control sets it to 0
    engine_kind("rules off differ")
    reference = str(tmp_path / "reference.json")
    assert run(capsys, "--record-reference", reference)[0] == 0
    assert run(capsys, "--recorded", reference)[0] == 0  # the plugin, rules on: identical
    record_file = tmp_path / "control.json"
    code, out = run(capsys, "--control", reference, "--json", str(record_file))
    record = json.loads(record_file.read_text())
    assert code == 0 and record["ok"] and record["role"] == "control" and not record["verify"]["ok"], out
    assert 0 < record["control_failed_fraction"] < 1 and "control (grid rules off) differed on" in out.out
    control = RolloutEngine.made[-1]
    assert control.calls == ["update", "flush", "shutdown"] and "enable_memory_saver" not in control.arguments
    assert control.arguments["chunked_prefill_size"] == 256 and os.environ["SGLANG_CHUNK_ALIGN_RULES"] == "0"
    monkeypatch.setenv("SGLANG_CHUNK_ALIGN_RULES", "1")
    engine_kind()  # a control the check cannot tell from the reference
    code, out = run(capsys, "--control", reference, "--json", str(record_file))
    record = json.loads(record_file.read_text())
    assert code == 1 and record["control_failed_fraction"] == 0, out
    assert "FAILED: the control (grid rules off) was identical on every request: the check could not see" in out.out
