"""The tensors of a Hugging Face directory's safetensors files, from their headers alone (no torch).

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and [begin, end) byte range in the data that follows, then the data. `read_index`
reads the headers of model.safetensors, or of every shard model.safetensors.index.json names, and
checks what can be checked without reading the data: every shard present, every tensor's range the
size its dtype and shape say and inside its file (a truncated file is caught here), every name in
the index found in the shard it points to. The loader maps the data (engine/loader.py); the checks
at job submission read only this.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from engine.families.config import ModelFileError

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
# stored dtypes a checkpoint's weights may have, and their sizes in bytes
WEIGHT_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_ITEM_SIZES = {**WEIGHT_DTYPES, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER_BYTES = 100 << 20  # the format's own limit


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's data is."""

    file: Path
    dtype: str  # safetensors' name: F32, F16, BF16, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset of its data in the file
    end: int


def read_index(directory: Path) -> dict[str, TensorEntry]:
    """Every tensor of the directory's safetensors files, by name; ModelFileError naming the file for
    a missing shard, a truncated or malformed file, or an index that disagrees with its shards."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise ModelFileError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    entries: dict[str, TensorEntry] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ModelFileError(f"{path}: listed in {INDEX_FILE} but missing")
        entries.update(read_header(path))
    for tensor, file in weight_map.items():
        if tensor not in entries or entries[tensor].file.name != Path(file).name:
            raise ModelFileError(f"{directory / file}: {INDEX_FILE} lists tensor {tensor} in it, "
                                 "but it is not there")
    return entries


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ModelFileError(f"{index}: not a valid index ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(f"{index}: no 'weight_map' object of tensor name -> file name")
    return weight_map


def read_header(path: Path) -> dict[str, TensorEntry]:
    """One file's tensors; every range checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ModelFileError(f"{path}: cannot read safetensors (truncated: {size} bytes)")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ModelFileError(f"{path}: cannot read safetensors (a {length}-byte header in a {size}-byte "
                                 "file: truncated or not safetensors)")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFileError(f"{path}: cannot read safetensors (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: cannot read safetensors (header is not a JSON object)")
    base = 8 + length
    return {name: _entry(path, name, info, base, size) for name, info in header.items()
            if name != "__metadata__"}


def _entry(path: Path, name: str, info, base: int, size: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ModelFileError(f"{path}: cannot read safetensors (tensor {name}: malformed entry "
                             f"{info!r})") from None
    if dtype not in _ITEM_SIZES:
        raise ModelFileError(f"{path}: tensor {name} has unknown dtype {dtype}")
    if end - begin != math.prod(shape) * _ITEM_SIZES[dtype] or begin < 0:
        raise ModelFileError(f"{path}: cannot read safetensors (tensor {name}: {end - begin} bytes for "
                             f"{dtype} {list(shape)})")
    if base + end > size:
        raise ModelFileError(f"{path}: truncated safetensors: tensor {name} ends at byte {base + end}, "
                             f"the file has {size}")
    return TensorEntry(path, dtype, shape, base + begin, base + end)
