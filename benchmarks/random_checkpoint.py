"""Well-scaled random checkpoints from a config.json, and how a benchmark's server gets its weights.

SGLang's dummy weights (`--load-format dummy`) are uniform in +-1e-3, norms
included: every activation is tiny, the logits nearly flat, and a kernel's
last-bit difference rarely reaches a logprob, so a bit-exactness check on them
sees little. This writes a checkpoint that SGLang loads as a real one, in the
config's dtype, with the scale of a freshly initialised model: linear weights,
embeddings and every other parameter normal(0, 0.02), norm weights 1 (any 1-D
parameter whose name says norm), biases 0 (names ending in "bias", Mamba's
dt_bias included).

Names and shapes are transformers' own (AutoModelForCausalLM.from_config on the
meta device, tied parameters once), so a config transformers cannot build is
refused. Each tensor is drawn by a generator seeded from (seed, name) alone: its
values depend on neither the order nor the shard layout, only on the generator's
device type (CUDA and CPU draw different numbers, the note says which). Shards
of about SHARD_BYTES stream to disk while the next one is drawn, into a scratch
folder renamed into place at the end, so a folder is either a complete
checkpoint or absent. A second call with the same seed, config and device type
reuses it (NOTE says what was written); a folder holding anything else is
refused.

    python3 -m benchmarks.random_checkpoint benchmarks/models/qwen2.5-7b /tmp/qwen-random [--seed 0] [--device cuda]
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

# torch, transformers and safetensors are imported where a checkpoint is written: the benchmarks that take
# --weights (real_server.py, serving.py) import this module for their arguments alone, and their tests run
# where SGLang and torch are not installed (tests/conftest.py's RELEASE_INDEPENDENT).

STD = 0.02
SHARD_BYTES = 4 * 10**9
NOTE = "random_checkpoint.json"  # what was written; its presence (last) marks the checkpoint complete
INDEX = "model.safetensors.index.json"
WRITER = "benchmarks/random_checkpoint.py"
WEIGHTS = ("checkpoint", "dummy", "random")
TOKENIZER_FREE = ("dummy", "random")  # served with --skip-tokenizer-init: prompts go as input ids
DUMMY = "SGLang's dummy weights (uniform in ±1e-3, norms included)"
WORKDIR = os.path.join(tempfile.gettempdir(), "sglang-chunk-align-checkpoints")


class CheckpointError(Exception):
    """A checkpoint that cannot be written where or as asked; the message says why."""


def server_weights(model_path, weights, workdir, seed=0):
    """(path to serve, extra server arguments, description) for --weights: a real checkpoint as it is,
    SGLang's dummy weights, or a random checkpoint written (once) under workdir from model_path's config."""
    if weights == "checkpoint":
        return model_path, [], f"the checkpoint at {model_path}"
    if weights == "dummy":
        return model_path, ["--load-format", "dummy", "--skip-tokenizer-init"], DUMMY
    if weights == "random":
        name = os.path.basename(os.path.normpath(model_path))
        path = write(model_path, os.path.join(workdir, f"random-{name}-seed{seed}"), seed)
        return path, ["--skip-tokenizer-init"], describe(seed)
    raise CheckpointError(f"--weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")


def needs_input_ids(weights):
    """Whether prompts must be sent as input ids: dummy and random weights come without a tokenizer."""
    return weights in TOKENIZER_FREE


def describe(seed):
    return f"well-scaled random weights: normal(0, {STD}), norms 1, biases 0, seed {seed}"


def add_arguments(parser):
    """--weights (with --dummy, the older spelling of --weights dummy), --weights-seed and --checkpoints."""
    parser.add_argument("--weights", choices=WEIGHTS, default="checkpoint",
                        help="checkpoint: --model-path as it is; dummy: SGLang's --load-format dummy (uniform "
                             "±1e-3); random: a well-scaled random checkpoint written from --model-path's "
                             "config.json (benchmarks/random_checkpoint.py). dummy and random send input ids")
    parser.add_argument("--dummy", dest="weights", action="store_const", const="dummy", help="--weights dummy")
    parser.add_argument("--weights-seed", type=int, default=0, help="--weights random: the checkpoint's seed")
    parser.add_argument("--checkpoints", default=WORKDIR,
                        help="--weights random: the folder random checkpoints are written to and reused from")


def write(config_dir, out_dir, seed=0, device=None):
    """Write (or reuse) the random checkpoint of config_dir's config.json in out_dir; return out_dir."""
    config_file = os.path.join(config_dir, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{config_dir} holds no config.json")
    import torch
    import transformers
    from safetensors.torch import save_file

    out_dir = os.path.normpath(out_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with open(config_file, "rb") as file:
        config_bytes = file.read()
    identity = {"writer": WRITER, "seed": seed, "generator_device": device.type,
                "config_sha256": hashlib.sha256(config_bytes).hexdigest()}
    if _reusable(out_dir, identity):
        return out_dir
    parameters, dtype = _parameters(config_dir)
    scratch = os.path.join(os.path.dirname(os.path.abspath(out_dir)), f".{os.path.basename(out_dir)}.partial")
    shutil.rmtree(scratch, ignore_errors=True)  # this writer's own leftover from a run cut short
    os.makedirs(scratch)
    started = time.monotonic()
    shards = _plan(parameters, dtype)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with ThreadPoolExecutor(1) as disk:  # the next shard is drawn while this one is written
        pending = None
        for names, file in zip(shards, files):
            tensors = {name: _draw(name, parameters[name], dtype, seed, device).cpu() for name in names}
            if pending is not None:
                pending.result()
            pending = disk.submit(save_file, tensors, os.path.join(scratch, file), {"format": "pt"})
        if pending is not None:
            pending.result()
    total = sum(math.prod(shape) for shape in parameters.values()) * dtype.itemsize
    weight_map = {name: file for names, file in zip(shards, files) for name in names}
    _dump(os.path.join(scratch, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    shutil.copyfile(config_file, os.path.join(scratch, "config.json"))
    sizes = {file: os.path.getsize(os.path.join(scratch, file)) for file in files}
    with open(os.path.join(scratch, "README.md"), "w") as readme:
        readme.write(f"# A random checkpoint, not a trained model\n\n{describe(seed)}, in {dtype}; each tensor "
                     f"drawn on {device.type} by its own generator seeded from (seed, name). Written by {WRITER} "
                     f"from {config_dir}/config.json; {NOTE} says what was written.\n")
    _dump(os.path.join(scratch, NOTE), {
        **identity, "description": describe(seed), "dtype": str(dtype), "config_dir": config_dir,
        "distribution": {"default": f"normal(0, {STD})", "1-D with 'norm' in the name": "1",
                         "name ending in 'bias'": "0"},
        "transformers": transformers.__version__, "torch": torch.__version__, "parameters": len(parameters),
        "files": sizes, "seconds": round(time.monotonic() - started, 1)})
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty: _reusable refused anything else
    os.rename(scratch, out_dir)
    return out_dir


def _reusable(out_dir, identity):
    """True for a complete checkpoint of `identity` in out_dir; False for no folder or an empty one;
    CheckpointError for anything else (never overwritten)."""
    if not os.path.isdir(out_dir):
        if os.path.exists(out_dir):
            raise CheckpointError(f"{out_dir} exists and is not a folder")
        return False
    if not os.listdir(out_dir):
        return False
    note_file = os.path.join(out_dir, NOTE)
    if not os.path.isfile(note_file):
        raise CheckpointError(f"{out_dir} holds other files (no {NOTE}): refusing to write a checkpoint over them")
    with open(note_file) as file:
        note = json.load(file)
    differ = [f"{key} {note.get(key)!r} (asked: {value!r})" for key, value in identity.items() if note.get(key) != value]
    if differ:
        raise CheckpointError(f"{out_dir} holds another random checkpoint ({'; '.join(differ)}): remove it or "
                              "choose another folder")
    missing = [f for f, size in note["files"].items() if not os.path.isfile(os.path.join(out_dir, f))
               or os.path.getsize(os.path.join(out_dir, f)) != size]
    if missing:
        raise CheckpointError(f"{out_dir}'s checkpoint is incomplete ({', '.join(missing)} missing or cut short): "
                              "remove it to write it again")
    return True


def _parameters(config_dir):
    """{name: shape} of the model transformers builds from the config (tied parameters once), and its dtype."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(config_dir)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError, ImportError) as error:
        raise CheckpointError(f"transformers {transformers.__version__} cannot build the model of {config_dir}/config.json "
                              f"(this writer does not run remote code): {type(error).__name__}: {' '.join(str(error).split())}") from None
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return {name: tuple(p.shape) for name, p in model.named_parameters()}, dtype


def _plan(parameters, dtype):
    """The parameter names of each shard, in the model's order, each shard up to SHARD_BYTES (a larger
    tensor alone)."""
    shards, size = [[]], 0
    for name, shape in parameters.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _draw(name, shape, dtype, seed, device):
    """One parameter's values: 1 for a norm's weight, 0 for a bias, else normal(0, STD) drawn in float32
    by a generator seeded from (seed, name) alone, then rounded to dtype."""
    import torch

    if len(shape) == 1 and "norm" in name.lower():
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    generator = torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    values = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, STD, generator=generator)
    return values.to(dtype)


def _dump(path, value):
    with open(path, "w") as file:
        json.dump(value, file, indent=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config_dir", help="a folder holding a config.json (e.g. benchmarks/models/qwen2.5-7b)")
    parser.add_argument("out_dir", help="the checkpoint's folder: absent, empty, or this same checkpoint (reused)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where tensors are drawn (default: cuda if present)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        out = write(args.config_dir, args.out_dir, args.seed, args.device)
    except CheckpointError as error:
        print(f"random_checkpoint: {error}", file=sys.stderr)
        return 2
    print(f"{out}: {describe(args.seed)} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
