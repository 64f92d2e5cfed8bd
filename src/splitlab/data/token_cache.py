"""Tokenised corpora kept on disk, so that a second run on the same text starts at once.

A language loader hands `cached` a key naming everything its tokens depend on (the digest of the
files read, the tokenizer's identity, seq_len, the format's own settings) and how to build them.
The tensors are written once, atomically, as a safetensors file named by the key's digest under
`folder()`; the file stores the key itself and the sha256 of its tensors' bytes, and is read back
only when both agree. A file that does not read whole (truncated, corrupt, another key) is
ignored and rebuilt, never trusted; nothing is ever unpickled.

Where: `$SPLITLAB_TOKEN_CACHE` when set, else `$XDG_CACHE_HOME/splitlab/tokens` (default
`~/.cache/splitlab/tokens`). A folder that cannot be written is warned about once and the run goes
on without the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

from splitlab.data.download import cache_dir
from splitlab.data.shakespeare import VOCAB, CharacterTokenizer
from splitlab.io import write_safetensors
from splitlab.lazy import torch
from splitlab.logs import LOGGER

ENV = "SPLITLAB_TOKEN_CACHE"
#: part of every key: bump when a loader's encoding changes, so older files are not read as current
FORMAT = 2
_CHUNK = 1 << 20
_warned: set[str] = set()


def folder() -> Path:
    """Where tokenised corpora are kept (the module docstring)."""
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else cache_dir() / "tokens"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digest(path: Path) -> str:
    """sha256 over every file under `path`: its relative name and its bytes, in name order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(path).as_posix()}\0{file_digest(file)}\0".encode())
    return digest.hexdigest()


def tokenizer_identity(tokenizer: Any) -> str:
    """What decides a tokenizer's tokens, digested: a Hugging Face tokenizer's whole `tokenizers`
    definition (vocabulary, merges, normalizer, added tokens), special tokens and chat template;
    LEAF's characters' vocabulary."""
    if isinstance(tokenizer, CharacterTokenizer):
        return hashlib.sha256(f"characters {VOCAB!r}".encode()).hexdigest()
    fields = {
        "class": type(tokenizer).__name__,
        "definition": tokenizer.backend_tokenizer.to_str(),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def json_tensor(value: Any) -> torch.Tensor:
    """`value` (JSON-able: a loader's texts and ragged token lists) as a uint8 tensor of its JSON, to
    be kept beside the tokens; `from_json_tensor` reads it back (JSON, never pickle)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def from_json_tensor(tensor: torch.Tensor) -> Any:
    return json.loads(tensor.numpy().tobytes().decode())


def _tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _read(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The tensors of `path` if it is whole and was written for `key`, else None."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            metadata, names = file.metadata() or {}, file.keys()
            tensors = {name: file.get_tensor(name) for name in names}
    except (OSError, SafetensorError, ValueError, RuntimeError):
        return None
    if metadata.get("key") != key or metadata.get("sha256") != _tensors_digest(tensors):
        return None
    return tensors


def cached(key: Mapping[str, Any], build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`build()`'s tensors, read from the cache file of `key` when it holds them whole, else built
    and written there. `key` is JSON-able; splitlab's version and FORMAT are added to it."""
    text = json.dumps({**key, "splitlab": version("splitlab"), "format": FORMAT}, sort_keys=True)
    name = f"{key.get('dataset', 'tokens')}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.safetensors"
    path = folder() / name
    if path.is_file():
        tensors = _read(path, text)
        if tensors is not None:
            LOGGER.debug(f"tokens read from {path}")
            return tensors
        LOGGER.info(f"ignored the damaged or mismatching token cache file {path}; tokenising again")
    tensors = {name: tensor.contiguous() for name, tensor in build().items()}
    try:
        write_safetensors(path, tensors, {"key": text, "sha256": _tensors_digest(tensors)})
    except OSError as error:
        if str(path.parent) not in _warned:
            _warned.add(str(path.parent))
            LOGGER.warning(f"cannot keep tokenised data in {path.parent} ({error.strerror}); set ${ENV} to a folder")
    return tensors
