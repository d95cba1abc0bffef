"""A bad checkpoint is refused when the job is submitted (exit 2, the file named, no job recorded),
never discovered by a worker mid-job: a missing shard, a tensor of the wrong shape, a truncated
safetensors or GGUF file, a config that contradicts its tensors or that batchgen does not implement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.loader import save_hf_dir, tiny_random_checkpoint
from jobs.cli import cli
from tests.engine.conftest import write_tiny_gguf


def _model(tmp_path: Path, shards: bool = False) -> Path:
    """The tiny random Llama as a directory, in two shards when asked."""
    directory = tmp_path / "model"
    checkpoint = tiny_random_checkpoint()
    save_hf_dir(checkpoint, directory)
    if shards:
        from safetensors.torch import save_file

        (directory / "model.safetensors").unlink()
        names = sorted(checkpoint.weights)
        files = {"model-00001-of-00002.safetensors": names[:9], "model-00002-of-00002.safetensors": names[9:]}
        for file, part in files.items():
            save_file({n: checkpoint.weights[n] for n in part}, str(directory / file))
        weight_map = {n: file for file, part in files.items() for n in part}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _replace_tensor(directory: Path, name: str, tensor) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    tensors[name] = tensor
    save_file(tensors, str(directory / "model.safetensors"))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _missing_shard(d: Path) -> tuple[Path, str]:
    (d / "model-00002-of-00002.safetensors").unlink()
    return d, r"model-00002-of-00002\.safetensors: listed in model\.safetensors\.index\.json but missing"


def _wrong_shape(d: Path) -> tuple[Path, str]:
    import torch

    _replace_tensor(d, "model.layers.1.mlp.up_proj.weight", torch.zeros(255, 128))
    return d, (r"tensor model\.layers\.1\.mlp\.up_proj\.weight has shape \(255, 128\), "
               r"config\.json implies \(256, 128\)")


def _truncated(d: Path) -> tuple[Path, str]:
    _truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size - 1000)
    return d, r"model\.safetensors: truncated safetensors: tensor .* ends at byte \d+, the file has \d+"


def _contradicting_config(d: Path) -> tuple[Path, str]:
    _edit_config(d, num_hidden_layers=3)
    return d, r"missing tensor\(s\) model\.layers\.2\."


def _unimplemented_config(d: Path) -> tuple[Path, str]:
    _edit_config(d, rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
    return d, r"config\.json: rope_parameters: rope_type 'longrope' is not supported"


def _extra_tensor(d: Path) -> tuple[Path, str]:
    import torch

    _replace_tensor(d, "model.layers.5.mlp.up_proj.weight", torch.zeros(2, 2))
    return d, r"unexpected tensor\(s\) model\.layers\.5\.mlp\.up_proj\.weight for a llama checkpoint"


def _bad_tokenizer(d: Path) -> tuple[Path, str]:
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return d, r"no tokenizer\.json"


def _truncated_gguf(d: Path) -> tuple[Path, str]:
    path = d.parent / "tiny.gguf"
    write_tiny_gguf(path)
    _truncate(path, path.stat().st_size - 100)
    return path, r"tiny\.gguf: (corrupt or )?truncated"


BREAKAGES = {
    "missing-shard": (_missing_shard, True), "wrong-shape": (_wrong_shape, False),
    "truncated": (_truncated, False), "config-contradicts-tensors": (_contradicting_config, False),
    "unimplemented-config": (_unimplemented_config, False), "extra-tensor": (_extra_tensor, False),
    "no-tokenizer": (_bad_tokenizer, False), "truncated-gguf": (_truncated_gguf, False),
}


@pytest.mark.parametrize("command", ["submit", "run"])
@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_bad_checkpoint_is_refused_at_submission(tmp_path, breakage, command):
    breaker, shards = BREAKAGES[breakage]
    model, message = breaker(_model(tmp_path, shards))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    data_dir = tmp_path / "data"
    result = CliRunner().invoke(cli, [command, str(src), "--model", str(model), "--data-dir", str(data_dir)])
    assert result.exit_code == 2, result.output
    assert "--model: " in result.output
    assert re.search(message, result.output.replace("\n", " ")), result.output
    jobs = data_dir / "jobs"
    assert not jobs.exists() or not any(p.name.startswith("job-") for p in jobs.iterdir())


def test_a_good_sharded_checkpoint_passes_and_loads(tmp_path):
    from engine import LLM, SamplingParams

    model = _model(tmp_path, shards=True)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    args = ["submit", str(src), "--model", str(model), "--data-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    logits = {}
    for name in ("tiny-random", str(model)):
        llm = LLM(name, num_kv_blocks=8)
        out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
        logits[name] = out.logprobs
    assert logits[str(model)] == logits["tiny-random"]
