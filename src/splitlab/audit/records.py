"""Reading what `record=N` kept (splitlab.privacy.record writes it): the recorded rounds of a run,
each checked before an attack uses it, with the client weights that produced it, and the test
samples an attack may take."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from splitlab.codec import read_tensors
from splitlab.errors import UserError
from splitlab.privacy.record import RECORD_DIR, WEIGHTS
from splitlab.targets import IGNORED


def attack_sizes(
    available: int, aux: int | None, targets: int | None, held_out: bool, defaults: tuple[int, int] = (2000, 500)
) -> tuple[int, int]:
    """(held-out targets, auxiliary samples) out of `available` test samples: the given sizes, or
    refused if they do not fit (never shrunk silently); a size not given takes its default (aux,
    targets) or, if that does not fit, what does (half the split for targets, the rest for aux)."""
    if not held_out:  # the targets are the recorded samples
        chosen_targets = 0
    else:
        chosen_targets = targets if targets is not None else min(defaults[1], available // 2)
    chosen_aux = aux if aux is not None else min(defaults[0], available - chosen_targets)
    if chosen_targets + chosen_aux > available or chosen_aux < 10:
        raise UserError(
            f"aux={chosen_aux} and targets={chosen_targets} need {chosen_targets + chosen_aux} test samples; "
            f"the run's test split holds {available}: ask for fewer (aux + targets <= {available})"
        )
    return chosen_targets, chosen_aux


_RECORD_NAME = re.compile(r"round_(\d{4,})\.safetensors")


def record_files(path: Path) -> dict[int, Path]:
    """Round number -> its file in RUN/record/; anything else there is refused (a stray file could
    be mistaken for a round)."""
    folder = path / RECORD_DIR
    if not folder.exists():
        return {}
    if not folder.is_dir():
        raise UserError(f"{str(folder)!r} is not a folder of recorded rounds; move it away")
    files = {}
    for entry in sorted(folder.iterdir()):
        match = _RECORD_NAME.fullmatch(entry.name)
        if match is None or not entry.is_file() or int(match[1]) < 1:
            raise UserError(
                f"{str(entry)!r} is not a recorded round (round_<r>.safetensors, r from 1); "
                f"move it out of {RECORD_DIR}/"
            )
        files[int(match[1])] = entry
    return files


def record_problem(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], num_classes: int) -> str:
    """What is wrong with a record's tensors ('' if nothing). A language run's labels (targets) hold
    a token per position or IGNORED, and its inputs (token ids, recorded as floats) whole token ids."""
    tail = ["tail_grad"] if "tail_grad" in shapes else []
    names, optional = set(tensors), {"clients", "batches", "cut_grad", *tail}
    if {"inputs", "smashed", "labels"} - names or names - {"inputs", "smashed", "labels", *optional}:
        return f"tensors {sorted(names)}, expected inputs, smashed, labels (and {', '.join(sorted(optional))})"
    lengths = {name: len(tensor) if tensor.dim() else 0 for name, tensor in sorted(tensors.items())}
    if len(set(lengths.values())) > 1:  # which one was cut short cannot be told: name every length
        held = ", ".join(f"{name} {length}" for name, length in lengths.items())
        return f"its tensors hold different numbers of samples ({held}), one row per recorded sample each"
    n = len(tensors["labels"])
    expected = {**shapes, "cut_grad": shapes["smashed"], "clients": (), "batches": ()}
    for name, tensor in tensors.items():
        integer = name in ("labels", "clients", "batches")
        if tensor.dtype != torch.int64 if integer else not tensor.dtype.is_floating_point:
            return f"{name} has dtype {tensor.dtype}, expected {'int64' if integer else 'a float type'}"
        if tensor.dim() == 0 or len(tensor) != n or tuple(tensor.shape[1:]) != expected[name]:
            return f"{name} has shape {tuple(tensor.shape)}, expected ({n}, {', '.join(map(str, expected[name]))})"
        if not integer and not bool(torch.isfinite(tensor).all()):
            return f"{name} holds NaN or infinite values"
    if "batches" in tensors and bool((tensors["batches"] < -1).any()):
        return "batches must be batch numbers, 0 or more (-1: a batch cut short)"
    labels, language = tensors["labels"], bool(shapes["labels"])
    in_range = (labels >= 0) & (labels < num_classes)
    if n == 0 or not bool((in_range | (labels == IGNORED) if language else in_range).all()):
        return f"labels must be 0 to {num_classes - 1}{f' or {IGNORED}' if language else ''}, at least one"
    inputs = tensors["inputs"]
    if language and not bool(((inputs >= 0) & (inputs < num_classes) & (inputs == inputs.round())).all()):
        return f"inputs must be token ids, whole numbers 0 to {num_classes - 1}"
    return ""


def chosen_round(path: Path, files: dict[int, Path], rnd: int | None) -> int | None:
    """The recorded round to attack: `rnd`, else the last; None if the run recorded nothing and no
    round was asked for (an attack then uses the final model)."""
    rounds = sorted(files)
    if rnd is not None and rnd not in rounds:
        have = f"recorded rounds: {rounds}" if rounds else "the run recorded nothing (run it with record=N)"
        raise UserError(f"round {rnd} was not recorded in {str(path)!r}; {have}")
    if not rounds:
        return None
    return rounds[-1] if rnd is None else rnd


def load_record(file: Path, shapes: dict[str, tuple[int, ...]], num_classes: int) -> dict[str, torch.Tensor]:
    """A recorded round, every tensor checked: names, dtypes, shapes, one length, finite, labels in range."""
    return load_round(file, shapes, num_classes)[0]


Weights = dict[int, dict[str, torch.Tensor]]  # by client: the shared state of its client part


def load_round(
    file: Path, shapes: dict[str, tuple[int, ...]], num_classes: int
) -> tuple[dict[str, torch.Tensor], Weights]:
    """A recorded round's checked tensors and, by client, the client part that produced them (the
    weights the round started with; empty for a record made before they were kept)."""
    tensors = read_tensors(file)
    weights: Weights = {}
    for name in [n for n in tensors if n.startswith(WEIGHTS + ".")]:
        client, _, key = name[len(WEIGHTS) + 1 :].partition(".")
        tensor = tensors.pop(name)
        finite = not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())
        if not client.isdigit() or not key or not finite:
            raise UserError(f"{str(file)!r} is not a record of this run: {name!r} is not a client's finite weights")
        weights.setdefault(int(client), {})[key] = tensor
    problem = record_problem(tensors, shapes, num_classes)
    if problem:
        raise UserError(f"{str(file)!r} is not a record of this run: {problem}")
    return tensors, weights


def as_produced(
    tensors: dict[str, torch.Tensor], weights: Weights, client: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(the samples, the client weights that produced them) of a round: every sample where every
    recorded client started the round from the same client part (a global one, which the sync
    server handed out), else only client `client`'s (or the first recorded client's) samples;
    no weights for a record that kept none."""
    if not weights:
        return tensors, None
    chosen = client if client in weights else min(weights)
    state = weights[chosen]

    def same(other: dict[str, torch.Tensor]) -> bool:
        return other.keys() == state.keys() and all(torch.equal(other[k], state[k]) for k in state)

    if "clients" not in tensors or all(same(w) for w in weights.values()):
        return tensors, state
    kept = tensors["clients"] == chosen
    return {name: t[kept] for name, t in tensors.items()}, state


def sample_keys(inputs: torch.Tensor) -> list[bytes]:
    """Each recorded sample's identity across rounds, to link its releases: its inputs' bytes (the
    server links them by the batch order the run's seed fixes; the experimenter by what it recorded)."""
    return [row.cpu().numpy().tobytes() for row in inputs.flatten(1)]
