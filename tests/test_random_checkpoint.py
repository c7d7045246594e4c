"""benchmarks/random_checkpoint.py on CPU with the real transformers: each model family's config,
shrunk to two layers, written and loaded back as a real checkpoint."""

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open

from benchmarks import random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024, bos_token_id=1, eos_token_id=2)
# Nemotron-H: one Mamba2 layer and one attention layer, its hybrid pattern kept.
SHRINK = {"nemotron-h-8b": dict(hybrid_override_pattern="M*", attention_head_dim=64, mamba_num_heads=8,
                                mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16, pad_token_id=0)}
MODELS = ("qwen2.5-7b", "llama-3.1-8b", "llama-3.2-3b", "nemotron-h-8b")


def shrunk(tmp_path, model, **changes):
    """A folder holding `model`'s config.json, two layers and small widths."""
    with open(os.path.join(ROOT, "benchmarks", "models", model, "config.json")) as file:
        config = json.load(file)
    config_type = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    if config["model_type"] not in config_type:
        pytest.skip(f"transformers {transformers.__version__} has no {config['model_type']} model")
    config.update(SMALL, **SHRINK.get(model, {}), **changes)
    folder = tmp_path / f"config-{model}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def tensors(folder):
    """{name: tensor} of every shard the index names, checking each holds exactly what it says."""
    index = json.loads((folder / random_checkpoint.INDEX).read_text())
    found, total = {}, 0
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), "pt") as shard:
            assert sorted(shard.keys()) == sorted(n for n, f in index["weight_map"].items() if f == file)
            for name in shard.keys():
                found[name] = shard.get_tensor(name)
                total += found[name].numel() * found[name].element_size()
    assert index["metadata"]["total_size"] == total
    return found


@pytest.mark.parametrize("model", MODELS)
def test_a_random_checkpoint_loads_as_the_models_own_with_well_scaled_values(tmp_path, model, monkeypatch):
    """The index covers exactly transformers' parameters, spread over shards (SHARD_BYTES made small),
    and transformers loads it with nothing missing or left over; norms 1, biases 0, the rest N(0, 0.02)."""
    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 600_000)
    config = shrunk(tmp_path, model)
    out = tmp_path / "out"
    try:
        assert random_checkpoint.write(config, str(out), seed=3, device="cpu") == str(out)
    except random_checkpoint.CheckpointError as error:
        if "cannot build the model" not in str(error):
            raise
        # transformers 5.8 (SGLang 0.5.13's) builds Nemotron-H's mixer from a kernel it fetches from a hub
        pytest.skip(f"this transformers cannot build {model} offline: {error}")
    written = tensors(out)
    model_config = transformers.AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        names = {n for n, _ in transformers.AutoModelForCausalLM.from_config(model_config).named_parameters()}
    assert set(written) == names
    assert len(set(json.loads((out / random_checkpoint.INDEX).read_text())["weight_map"].values())) > 1
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    norms = [t for n, t in written.items() if t.dim() == 1 and "norm" in n.lower()]
    biases = [t for n, t in written.items() if n.endswith("bias")]
    assert norms and all(torch.equal(t, torch.ones_like(t)) for t in norms)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in biases)
    if model == "nemotron-h-8b":
        assert any(n.endswith("dt_bias") for n in written)  # Mamba's, a bias too
    else:
        assert biases or model.startswith("llama")  # Qwen2's q/k/v biases
    largest = max(written.values(), key=torch.Tensor.numel).float()
    assert abs(largest.std().item() / 0.02 - 1) < 0.03 and abs(largest.mean().item()) < 0.001
    note = json.loads((out / random_checkpoint.NOTE).read_text())
    assert note["seed"] == 3 and note["description"] == random_checkpoint.describe(3)
    assert (out / "config.json").read_bytes() == (tmp_path / f"config-{model}" / "config.json").read_bytes()


def test_tied_embeddings_are_written_once(tmp_path):
    out = tmp_path / "out"
    random_checkpoint.write(shrunk(tmp_path, "qwen2.5-7b", tie_word_embeddings=True), str(out), device="cpu")
    written = tensors(out)
    assert "model.embed_tokens.weight" in written and "lm_head.weight" not in written
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_a_tensor_is_a_function_of_the_seed_and_its_name_alone(tmp_path, monkeypatch):
    """The same seed writes the same bytes, whatever the shard layout; another seed other values."""
    config = shrunk(tmp_path, "llama-3.1-8b")
    random_checkpoint.write(config, str(tmp_path / "a"), seed=1, device="cpu")
    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 600_000)
    random_checkpoint.write(config, str(tmp_path / "b"), seed=1, device="cpu")
    random_checkpoint.write(config, str(tmp_path / "c"), seed=2, device="cpu")
    a, b, c = (tensors(tmp_path / x) for x in "abc")
    assert len(set(json.loads((tmp_path / "b" / random_checkpoint.INDEX).read_text())["weight_map"].values())) > 1
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    drawn = [n for n in a if not torch.equal(a[n], torch.ones_like(a[n]))]
    assert drawn and all(not torch.equal(a[n], c[n]) for n in drawn)


def test_a_second_write_reuses_the_checkpoint_and_other_folders_are_refused(tmp_path):
    config = shrunk(tmp_path, "qwen2.5-7b")
    out = tmp_path / "out"
    random_checkpoint.write(config, str(out), device="cpu")
    stamps = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert random_checkpoint.write(config, str(out), device="cpu") == str(out)
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamps
    with pytest.raises(random_checkpoint.CheckpointError, match=r"another random checkpoint \(seed 0 \(asked: 5\)"):
        random_checkpoint.write(config, str(out), seed=5, device="cpu")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(random_checkpoint.CheckpointError, match="holds other files"):
        random_checkpoint.write(config, str(other), device="cpu")
    assert [f.name for f in other.iterdir()] == ["notes.txt"]
    shard = next(out.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(random_checkpoint.CheckpointError, match="incomplete"):
        random_checkpoint.write(config, str(out), device="cpu")


def test_the_cli_says_what_is_wrong_in_one_line(tmp_path, capsys):
    assert random_checkpoint.main([str(tmp_path), str(tmp_path / "out"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"random_checkpoint: {tmp_path} holds no config.json\n"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert random_checkpoint.main([str(tmp_path), str(tmp_path / "out"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("random_checkpoint: transformers ") and "cannot build" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_server_weights_is_the_one_place_a_benchmark_gets_its_weights(tmp_path):
    model = shrunk(tmp_path, "llama-3.1-8b")
    assert random_checkpoint.server_weights(model, "checkpoint", str(tmp_path)) == (model, [], f"the checkpoint at {model}")
    assert random_checkpoint.server_weights(model, "dummy", str(tmp_path))[1] == ["--load-format", "dummy", "--skip-tokenizer-init"]
    path, server_args, description = random_checkpoint.server_weights(model, "random", str(tmp_path / "w"), seed=4)
    assert path == str(tmp_path / "w" / "random-config-llama-3.1-8b-seed4") and server_args == ["--skip-tokenizer-init"]
    assert description == "well-scaled random weights: normal(0, 0.02), norms 1, biases 0, seed 4"
    assert json.loads((tmp_path / "w" / "random-config-llama-3.1-8b-seed4" / random_checkpoint.NOTE).read_text())["seed"] == 4
    assert [random_checkpoint.needs_input_ids(w) for w in random_checkpoint.WEIGHTS] == [False, True, True]
