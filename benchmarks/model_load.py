"""Load benchmark: time and peak host memory of loading a checkpoint into the engine's model.

    batchgen bench model-load [--dir /tmp/batchgen-load-bench] [--dtype bfloat16] [--device cpu]
                                [--rounds 2] [--before SOURCE_TREE]

Writes (once) a random checkpoint of Llama 3.2 1B's shape in bf16 (1.24 B parameters, 2.47 GB of
model.safetensors), tensor by tensor, so writing it needs no more memory than its largest tensor.
Then each round loads it in a fresh process: the checkpoint read and the model built on `--device`
in `--dtype`, as LLM(model=DIR) does before it sizes the KV cache. The process reports its load
time, its resident memory after imports (baseline) and its peak (ru_maxrss). With `--before`, a
source tree of another batchgen version (e.g. `git archive <commit> | tar -x -C DIR`) is loaded
too, alternating with this one. Numbers, not pass/fail: this is not a timed test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

# Llama 3.2 1B's shape (its config.json less rope_scaling, which batchgen before the families refused)
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "hidden_act": "silu", "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

# what the fresh process runs: load as LLMEngine does, print one JSON line
_CHILD = r"""
import json, resource, sys, time
import torch
from engine.loader import load_checkpoint
from engine.registry import resolve_model
from engine.llm_engine import _build_model
from engine.config import EngineConfig
def rss_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
baseline = rss_kb()
start = time.perf_counter()
ckpt = load_checkpoint(resolve_model(sys.argv[1]))
try:
    from engine.families import read_model_args
    args = getattr(ckpt, "args", None) or read_model_args(ckpt.config)
except ImportError:  # a batchgen before engine.families
    from engine.model import ModelArgs
    args = ModelArgs.from_hf_config(ckpt.config)
config = EngineConfig(model=sys.argv[1], dtype=sys.argv[2], device=sys.argv[3])
model = _build_model(args, ckpt.weights, config)
if model.embed_tokens.weight.is_cuda:
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "baseline_kb": baseline, "peak_kb": peak, "model_bytes": model_bytes}))
"""


def write_checkpoint(directory: Path, config: dict, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """config.json, a ByteTokenizer marker and model.safetensors of random normal(0, 0.02) weights (norms
    1), written one tensor at a time; kept if already there."""
    import torch

    from engine.loader import expected_shapes
    from engine.model_files import BYTE_TOKENIZER_CLASS

    target = directory / "model.safetensors"
    if target.is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config)
    torch_dtype, name = getattr(torch, dtype), _SAFETENSORS_DTYPES[dtype]
    size = torch.empty(0, dtype=torch_dtype).element_size()
    header, offset = {}, 0
    for tensor, shape in shapes.items():
        nbytes = math.prod(shape) * size
        header[tensor] = {"dtype": name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    generator = torch.Generator().manual_seed(seed)
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for tensor, shape in shapes.items():
            values = torch.ones(shape) if tensor.endswith("norm.weight") else \
                torch.empty(shape).normal_(0.0, 0.02, generator=generator)
            out.write(values.to(torch_dtype).view(torch.uint8).numpy().tobytes())
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": BYTE_TOKENIZER_CLASS}))
    os.replace(tmp, target)
    return directory


def measure(source_tree: Path, directory: Path, dtype: str, device: str) -> dict:
    """One load in a fresh process running the batchgen at `source_tree`."""
    env = {**os.environ, "PYTHONPATH": str(source_tree)}
    result = subprocess.run([sys.executable, "-c", _CHILD, str(directory), dtype, device], env=env,
                            capture_output=True, text=True, cwd=source_tree)
    if result.returncode != 0:
        raise RuntimeError(f"load in {source_tree} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def report(label: str, m: dict) -> str:
    gib = 1 << 30
    beyond = (m["peak_kb"] - m["baseline_kb"]) * 1024
    on_host = m["model_bytes"] if m.get("device", "cpu") == "cpu" else 0
    return (f"{label:>7}: {m['seconds']:6.1f} s, peak RSS {m['peak_kb'] / (1 << 20):5.2f} GiB, "
            f"baseline {m['baseline_kb'] / (1 << 20):4.2f} GiB, peak - baseline {beyond / gib:5.2f} GiB "
            f"(the model itself: {m['model_bytes'] / gib:.2f} GiB; beyond baseline and the model on the "
            f"host: {(beyond - on_host) / gib:5.2f} GiB)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchgen bench model-load", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/batchgen-load-bench"))
    parser.add_argument("--dtype", default="bfloat16", choices=list(_SAFETENSORS_DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", type=Path, help="another batchgen source tree to load with, alternating")
    opts = parser.parse_args(argv)
    directory = write_checkpoint(opts.dir, LLAMA_1B)
    size = (directory / "model.safetensors").stat().st_size
    print(f"checkpoint: {directory} ({size / 1e9:.2f} GB bf16 safetensors, Llama 3.2 1B's shape); "
          f"loading into {opts.dtype} on {opts.device}; load average {os.getloadavg()[0]:.1f}")
    here = Path(__file__).resolve().parent.parent
    trees = [("before", opts.before), ("after", here)] if opts.before else [("after", here)]
    for round_ in range(opts.rounds):
        for label, tree in trees:
            m = measure(tree, directory, opts.dtype, opts.device) | {"device": opts.device}
            print(f"round {round_ + 1} {report(label, m)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
