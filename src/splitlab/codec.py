"""Messages and checkpoints as bytes, without pickle: tensors in safetensors, the rest as JSON.

A message is a nest of dicts (str or int keys), lists, tuples, tensors, ints, floats, bools,
strings and None: what role verbs exchange and what role states are made of (optimizer states
included). `encode` stores every tensor under a running number in one safetensors buffer and the
nest around them, with tensors replaced by their number, as strict JSON in the buffer's metadata.
`decode` reverses it and refuses anything else: a truncated, empty or foreign buffer, a skeleton
that is not strict JSON (NaN or Infinity literals, a key twice) or is larger or deeper than any
message splitlab sends (MAXSKELETON_BYTES, MAX_DEPTH: checked before it is parsed) is a
`MessageError`, never an object built from attacker-chosen code.

The files a user hands splitlab are read here too: safetensors files (`read_tensors`,
`read_header`: a damaged or non-finite file is one line naming it) and JSON (`user_json`: nesting
checked before parsing, syntax errors with their line and column).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_tensors
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

from splitlab.errors import UserError
from splitlab.io import cpu_copy
from splitlab.json_text import check_depth

SKELETON = "splitlab.skeleton"
MAXSKELETON_BYTES = 16 << 20
"""The largest skeleton accepted (a role state of thousands of tensors is well under 1 MiB)."""
MAX_DEPTH = 64
"""The deepest nest accepted (a role state with its optimizers is about 8 deep)."""


class MessageError(ValueError):
    """Bytes that are not a well-formed splitlab message."""


def encode(message: Any) -> bytes:
    tensors, metadata = flatten(message)
    return save_tensors(tensors, metadata=metadata)


def flatten(message: Any, copy: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of `message`'s safetensors buffer, for a writer that streams them
    to a file (`io.write_safetensors`) instead of building the buffer in memory. With `copy`, every
    tensor is a copy of its own, so that the caller may go on changing the message meanwhile."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def skeleton(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            name = str(len(tensors))
            if copy:
                tensor = cpu_copy(value)
            else:
                tensor = value.detach().to("cpu").contiguous()
                storage = tensor.untyped_storage()
                if storage.data_ptr() in seen or storage.nbytes() != tensor.numel() * tensor.element_size():
                    tensor = tensor.clone()  # safetensors refuses views and shared storage
                seen.add(tensor.untyped_storage().data_ptr())
            tensors[name] = tensor
            return {"$t": name}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: skeleton(v) for k, v in value.items()}
            return {"$d": [[_key(k), skeleton(v)] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"$tuple": [skeleton(v) for v in value]}
        if isinstance(value, list):
            return [skeleton(v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            return {"$f": repr(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot encode a {type(value).__name__} in a message")

    nest = json.dumps(skeleton(message), allow_nan=False, separators=(",", ":"))
    return tensors, {SKELETON: nest}


def _key(key: Any) -> Any:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise TypeError(f"cannot encode a dict key of type {type(key).__name__}")
    return key


def decode(data: bytes, device: torch.device | str = "cpu") -> Any:
    """The message in `data`, its tensors on `device`; MessageError if `data` is not one."""
    try:
        tensors = load_tensors(data)
        nest = strict_json(_metadata(data)[SKELETON])
    except (SafetensorError, ValueError, KeyError, TypeError, OverflowError) as error:
        raise MessageError(f"not a splitlab message ({error})") from None
    used: set[str] = set()

    def build(value: Any) -> Any:
        if isinstance(value, list):
            return [build(v) for v in value]
        if not isinstance(value, dict):
            return value
        if set(value) == {"$t"} and value["$t"] in tensors and value["$t"] not in used:
            used.add(value["$t"])
            return tensors[value["$t"]].to(device)
        if set(value) == {"$d"} and isinstance(value["$d"], list):
            return {_key(k): build(v) for k, v in value["$d"]}
        if set(value) == {"$tuple"} and isinstance(value["$tuple"], list):
            return tuple(build(v) for v in value["$tuple"])
        if set(value) == {"$f"} and value["$f"] in ("inf", "-inf", "nan"):
            return float(value["$f"])
        if any(k.startswith("$") for k in value):
            raise MessageError(f"not a splitlab message (unknown entry {sorted(value)})")
        return {k: build(v) for k, v in value.items()}

    try:
        message = build(nest)
    except (TypeError, ValueError) as error:
        raise MessageError(f"not a splitlab message ({error})") from None
    if used != set(tensors):
        raise MessageError("not a splitlab message (tensors outside its structure)")
    return message


def read_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path` (never unpickled), on `device`: every reader of
    a file the user hands splitlab (a run's weights, adapters, records) reads through here, so that
    a missing, truncated or foreign file, or one holding NaN or inf, is one line naming it."""
    try:
        tensors = load_file(path, device=str(device))
    except (OSError, SafetensorError, ValueError, RuntimeError) as error:
        raise UserError(f"cannot read {str(path)!r}: {_first_line(error)}") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UserError(
                f"{str(path)!r} holds non-finite values ({name!r} has NaN or inf): the run that wrote it "
                f"diverged or the file is damaged"
            )
    return tensors


def read_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape of each tensor, the metadata) of the safetensors file at `path`, from its
    header alone (`read_tensors`' refusals)."""
    try:
        with safe_open(str(path), "pt") as file:
            shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}  # noqa: SIM118 (not a dict)
            return shapes, file.metadata() or {}
    except (OSError, SafetensorError, ValueError, RuntimeError) as error:
        raise UserError(f"cannot read {str(path)!r}: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


def strict_json(text: str) -> Any:
    """`text` parsed as strict JSON: ValueError for NaN or Infinity literals, a key given twice, or
    a text over MAXSKELETON_BYTES or nested deeper than MAX_DEPTH (both checked first, so that
    no nest is ever deep enough to exhaust the parser's recursion)."""
    if len(text) > MAXSKELETON_BYTES:
        raise ValueError(f"a skeleton of {len(text)} characters, over {MAXSKELETON_BYTES}")
    check_depth(text, MAX_DEPTH)
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError(f"a key given twice in {sorted(k for k, _ in pairs)}")
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"the literal {name} (not JSON)")


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's metadata (`load_tensors` has already checked the header)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise KeyError("no metadata")
    return metadata
