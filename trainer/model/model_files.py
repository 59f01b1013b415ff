"""Check a model directory before anything heavy runs: config.json, the weights' headers, the tokenizer; and
find the model's tokenizer.json (`resolve_tokenizer_file`), in the local Hugging Face cache first. Read a
model directory's weights (`from_pretrained`) and write its config.json as FLAN-T5's says (`write_config`).

A missing or truncated `model.safetensors` otherwise fails inside `from_pretrained` with a long traceback,
and only after the data is indexed (minutes on millions of recipes). `check_model_dir` reads the small files
and the weights' headers, never the weights, and raises ModelFilesError in one line naming the file and what
is wrong with it.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError
from trainer.model.model_shape import transformers_major


class ModelFilesError(ConfigError):
    """model_name_or_path's files: missing, damaged, or not to be had (not in the Hugging Face cache, and the
    Hub out of reach). The CLI says "model error"."""


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
    """Check the model `name` (a local directory, or a Hub id) without loading it; ModelFilesError in one
    line for a missing or damaged file.

    A local directory needs config.json, whole weights (`weights=False`: none needed, e.g. random_init) and
    tokenizer.json. A Hub id is checked only as far as it is in the local Hugging Face cache (files not
    there yet are downloaded by training); None when it is not cached at all."""
    path = Path(name).expanduser()
    cached = False
    if not path.is_dir():
        if path.exists():
            raise ModelFilesError(f"model_name_or_path {_shown(name)}: is a file, not a model directory")
        if _is_local_path(name):
            raise ModelFilesError(f"model_name_or_path {_shown(name)}: no such directory")
        path = _cached_snapshot(name)
        if path is None:
            return None
        cached = True
    _check_json(path / "config.json", required=not cached)
    n_params = None
    present = [f for f in WEIGHT_FILES if (path / f).is_file()]
    if weights and not present and not cached:
        raise ModelFilesError(f"{path}: no weights (none of {', '.join(WEIGHT_FILES)})")
    if present:  # transformers' order: safetensors first
        n_params = _check_weights(path, present[0])
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file() or not cached:
        _check_json(tokenizer, required=True)
    return ModelFiles(path, n_params)


def resolve_tokenizer_file(name: str) -> Path:
    """tokenizer.json of the model `name`: a file, a local directory holding one, or a Hub model id: from the
    local Hugging Face cache, else downloaded (one try when the Hub cannot be reached, not a minute of
    retries). ModelFilesError in one line, saying how to get it, when there is none."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return path / "tokenizer.json"
        raise ModelFilesError(f"{path}: directory has no tokenizer.json")
    if _is_local_path(name):
        raise ModelFilesError(f"model_name_or_path {_shown(name)}: no such file or directory")
    from huggingface_hub import (
        constants,
        get_hf_file_metadata,
        hf_hub_download,
        hf_hub_url,
        try_to_load_from_cache,
    )

    try:
        cached = try_to_load_from_cache(name, "tokenizer.json")
    except Exception as e:  # a malformed id
        raise ModelFilesError(
            f"model_name_or_path {name}: not a Hub model id nor a directory ({e})"
        ) from None
    if isinstance(cached, str):
        return Path(cached)
    missing = f"{name}: its tokenizer.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    get_it = (
        f"download the model once where the Hub is reachable (`hf download {name}`), or mount a Hugging Face "
        "cache that holds it (HF_HOME)"
    )
    if constants.HF_HUB_OFFLINE:
        raise ModelFilesError(f"{missing} and HF_HUB_OFFLINE is set: {get_it}")
    try:
        # One request, not retried: hf_hub_download retries a connection error for half a minute.
        get_hf_file_metadata(hf_hub_url(name, "tokenizer.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
        return Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as e:  # unreachable, no such repository, gated, no tokenizer.json: one line
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelFilesError(
            f"{missing}, and the Hub did not give it ({type(e).__name__}: {reason}): {get_it}"
        ) from None


def _is_local_path(name: str) -> bool:
    """Whether `name` can only be a local path, not a Hub id (org/name)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _shown(name: str) -> str:
    """`name` with the directory a relative path was resolved against, as the data loader says it."""
    if os.path.isabs(os.path.expanduser(name)):
        return name
    return f"{name} (resolved against {os.getcwd()})"


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
            raise ModelFilesError(f"{path} is missing")
        return
    try:
        value = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise ModelFilesError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}); truncated?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFilesError(f"cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ModelFilesError(f"{path} holds a {type(value).__name__}, not a JSON object")


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
        raise ModelFilesError(f"{index} has no weight_map")
    n_params = 0
    for shard in sorted(set(weight_map.values())):
        shard_path = path / shard
        if not shard_path.is_file():
            raise ModelFilesError(f"{shard_path} is missing (a shard listed in {index.name})")
        if name.startswith("model.safetensors"):
            tensors = check_safetensors(shard_path)
            wanted = [k for k, v in weight_map.items() if v == shard and k not in tensors]
            if wanted:
                raise ModelFilesError(
                    f"{shard_path} lacks {len(wanted)} tensor(s) that {index.name} puts there, "
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
            raise ModelFilesError(f"{path} is truncated ({size} bytes, not even a safetensors header)")
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, _MAX_HEADER):
            raise ModelFilesError(
                f"{path} is truncated or not a safetensors file (header of {header_len} bytes, "
                f"file of {size})"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFilesError(f"{path} has a damaged safetensors header") from None
    if not isinstance(header, dict):
        raise ModelFilesError(f"{path} has a damaged safetensors header")
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
            raise ModelFilesError(f"{path} has a damaged safetensors header (tensor {key!r})") from None
        if end > data_size:
            raise ModelFilesError(
                f"{path} is truncated: tensor {key!r} ends at byte {end:,} of the data, the file "
                f"holds {max(data_size, 0):,} ({size:,} bytes; expected at least {8 + header_len + end:,})"
            )
        n = math.prod(shape)
        if not 0 <= begin <= end or (dtype in _ITEMSIZE and end - begin != n * _ITEMSIZE[dtype]):
            raise ModelFilesError(f"{path} has a damaged safetensors header (tensor {key!r}: offsets)")
        elements[key] = n
    return elements


def _check_bin(path: Path) -> None:
    """pytorch_model.bin: present and not empty; a zip archive (torch.save's format) must be whole (its
    central directory, at the end of the file, is read)."""
    size = path.stat().st_size
    if size == 0:
        raise ModelFilesError(f"{path} is empty")
    with open(path, "rb") as f:
        zipped = f.read(2) == b"PK"
    if zipped and not zipfile.is_zipfile(path):
        raise ModelFilesError(f"{path} is truncated (its zip directory is missing; {size:,} bytes)")


def is_adapter_dir(path: str | Path) -> bool:
    """A LoRA run's checkpoint or final model: a PEFT adapter (adapter_config.json, naming its base), no
    model of its own."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def dtype_kwarg() -> str:
    """transformers 5 takes `dtype=`, 4.5x `torch_dtype=`."""
    # transformers takes seconds to import: loaded when a model is (the CLI's light commands import this
    # module)
    from transformers import PreTrainedModel

    params = inspect.signature(PreTrainedModel.from_pretrained).parameters
    return "dtype" if transformers_major() >= 5 or "dtype" in params else "torch_dtype"


def from_pretrained(path: str | Path, **kwargs):
    """`AutoModelForSeq2SeqLM.from_pretrained(path, **kwargs)`, without transformers 5's warning about
    FLAN-T5's LM head: transformers 5 forces T5's tie_word_embeddings on, then warns that the head, FLAN-T5's
    own, is not tied to the embedding and that the config should say tie_word_embeddings=False, which it does
    (`write_config`): nothing for the user to do."""
    from transformers import AutoModelForSeq2SeqLM

    hf_log = logging.getLogger("transformers.modeling_utils")
    hf_log.addFilter(_untied_head_warning)
    try:
        return AutoModelForSeq2SeqLM.from_pretrained(path, **kwargs)
    finally:
        hf_log.removeFilter(_untied_head_warning)


def _untied_head_warning(record: logging.LogRecord) -> bool:
    return "NOT tie them" not in record.getMessage()


def write_config(model, path: str | Path) -> None:
    """Make the config.json save_pretrained wrote for `model` into `path` say how its LM head is: a head of
    its own (FLAN-T5's) as `"tie_word_embeddings": false`, as google/flan-t5-xl's config.json says it.
    transformers 5 writes true for every T5 and keeps the real tie in `scale_decoder_outputs`, which
    transformers 4 does not read: it would tie the trained head to the embedding and scale the decoder's
    outputs, another model."""
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        return
    file = Path(path) / "config.json"
    config = json.loads(file.read_text(encoding="utf-8"))
    config["tie_word_embeddings"] = False
    config.pop("scale_decoder_outputs", None)  # transformers 5 derives it from the tie again
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
