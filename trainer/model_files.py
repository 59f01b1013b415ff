"""Check a model directory before anything heavy runs: config.json, the weights' headers, the tokenizer.

A missing or truncated `model.safetensors` otherwise fails inside `from_pretrained` with a long traceback,
and only after the data is indexed (minutes on millions of recipes). `check_model_dir` reads the small files
and the weights' headers, never the weights, and raises ConfigError in one line naming the file and what is
wrong with it.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Bytes per element of safetensors' dtypes (https://github.com/huggingface/safetensors, `Dtype`).
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


@dataclass
class ModelFiles:
    """What the check found: the directory checked and the parameter count from the weights' headers
    (None for pytorch_model.bin weights or when the weights are not there yet)."""

    path: Path
    n_params: int | None


def check_model_dir(name: str, *, weights: bool = True) -> ModelFiles | None:
    """Check the model `name` (a local directory, or a Hub id) without loading it; ConfigError in one line
    for a missing or damaged file.

    A local directory needs config.json, whole weights (`weights=False`: none needed, e.g. random_init) and
    tokenizer.json. A Hub id is checked only as far as it is in the local Hugging Face cache (files not
    there yet are downloaded by training); None when it is not cached at all."""
    path = Path(name).expanduser()
    cached = False
    if not path.is_dir():
        if path.exists():
            raise ConfigError(f"model_name_or_path {name}: is a file, not a model directory")
        if name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a local path, not a Hub id (org/name)
            raise ConfigError(f"model_name_or_path {name}: no such directory")
        path = _cached_snapshot(name)
        if path is None:
            return None
        cached = True
    _check_json(path / "config.json", required=not cached)
    n_params = None
    present = [f for f in WEIGHT_FILES if (path / f).is_file()]
    if weights and not present and not cached:
        raise ConfigError(f"model {path}: no weights (none of {', '.join(WEIGHT_FILES)})")
    if present:  # transformers' order: safetensors first
        n_params = _check_weights(path, present[0])
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file() or not cached:
        _check_json(tokenizer, required=True)
    return ModelFiles(path, n_params)


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # a malformed id or an unreadable cache: training says what is wrong
        return None
    return Path(found).parent if isinstance(found, str) else None


def _check_json(path: Path, *, required: bool) -> None:
    if not path.is_file():
        if required:
            raise ConfigError(f"model: {path} is missing")
        return
    try:
        value = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model: {path} is not valid JSON (line {e.lineno}: {e.msg}); truncated?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"model: cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"model: {path} holds a {type(value).__name__}, not a JSON object")


def _check_weights(path: Path, name: str) -> int | None:
    """Check the weights `name` in `path`; the parameter count for safetensors."""
    if name == "model.safetensors":
        return sum(check_safetensors(path / name).values())
    if name == "pytorch_model.bin":
        _check_bin(path / name)
        return None
    index = path / name
    _check_json(index, required=True)
    weight_map = json.loads(index.read_bytes()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"model: {index} has no weight_map")
    n_params = 0
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            raise ConfigError(f"model: {shard_path} is missing (a shard listed in {index.name})")
        if name.startswith("model.safetensors"):
            tensors = check_safetensors(shard_path)
            wanted = [k for k, v in weight_map.items() if v == shard and k not in tensors]
            if wanted:
                raise ConfigError(
                    f"model: {shard_path} lacks {len(wanted)} tensor(s) that {index.name} puts there, "
                    f"e.g. {wanted[0]!r}"
                )
            n_params += sum(tensors.values())
        else:
            _check_bin(shard_path)
    return n_params if name.startswith("model.safetensors") else None


def check_safetensors(path: Path) -> dict[str, int]:
    """Read a .safetensors file's header (8-byte little-endian length, then JSON) and check that every
    tensor's bytes lie inside the file and match its dtype and shape. Returns {tensor name: elements}."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"model: {path} is truncated ({size} bytes, not even a safetensors header)")
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, _MAX_HEADER):
            raise ConfigError(
                f"model: {path} is truncated or not a safetensors file (header of {header_len} bytes, "
                f"file of {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"model: {path} has a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise ConfigError(f"model: {path} has a damaged safetensors header")
    data_size = size - 8 - header_len
    elements = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"model: {path} has a damaged safetensors header (tensor {key!r})") from None
        if end > data_size:
            raise ConfigError(
                f"model: {path} is truncated: tensor {key!r} ends at byte {end:,} of the data, the file "
                f"holds {max(data_size, 0):,} ({size:,} bytes; expected at least {8 + header_len + end:,})"
            )
        n = math.prod(shape)
        if not 0 <= begin <= end or (dtype in _ITEMSIZE and end - begin != n * _ITEMSIZE[dtype]):
            raise ConfigError(f"model: {path} has a damaged safetensors header (tensor {key!r}: offsets)")
        elements[key] = n
    return elements


def _check_bin(path: Path) -> None:
    """pytorch_model.bin: present and not empty; a zip archive (torch.save's format) must be whole (its
    central directory, at the end of the file, is read)."""
    size = path.stat().st_size
    if size == 0:
        raise ConfigError(f"model: {path} is empty")
    with open(path, "rb") as f:
        zipped = f.read(2) == b"PK"
    if zipped and not zipfile.is_zipfile(path):
        raise ConfigError(f"model: {path} is truncated (its zip directory is missing; {size:,} bytes)")
