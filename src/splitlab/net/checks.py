"""What the server checks in every result a client sends, before anything uses it.

The checks follow from the verb's declared ledger kinds (splitlab.transport) and the blueprint:
smashed data is a tensor of the client part's output dtype and shape (B, *cut shape) with
1 <= B <= batch_size, labels are int64 of shape (B,) within [0, classes), a loss is a scalar, a
model (uploaded, relayed, snapshot or checkpointed) has exactly the slot's tensor names, shapes
and dtypes, and a verb that declares no kind returns no tensor. Every floating tensor must be
finite. A client's REPORT of its data must fit the run (`Checks.report`). A failed check is a
`Refused` with one line saying what was wrong.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from splitlab.privacy import defenses
from splitlab.roles import Blueprint, ClientNode
from splitlab.transport import KEYED, VerbSpec


class Refused(ValueError):
    """A message that breaks the protocol: its sender is dropped, the server goes on."""


def tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(where, tensor) for every tensor in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield path or "result", value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from tensors(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensors(item, f"{path}[{i}]")


def check_finite(value: Any) -> None:
    for where, tensor in tensors(value):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise Refused(f"{where} holds NaN or infinite values")


class Checks:
    """The expected form of clients' results, from what every role can build: the blueprint."""

    def __init__(self, blueprint: Blueprint) -> None:
        self.blueprint = blueprint
        self._smashed: torch.Tensor | None = None

    def result(self, verb: str, spec: VerbSpec, args: tuple, result: Any) -> None:
        check_finite(result)
        kind = spec.up
        if kind is None:
            if any(True for _ in tensors(result)):
                raise Refused(f"{verb} returns no tensor, but the result holds one")
        elif kind == KEYED:
            self._keyed(result)
        elif kind == "checkpoint":
            self._role_state(result)
        elif kind == "client_model_relay":
            self._model("client_model", result)
        elif args and isinstance(args[0], str) and args[0] in self.blueprint.builders:  # upload(slot), snapshot(slot)
            self._model(args[0], result)

    def _keyed(self, result: Any) -> None:
        if not isinstance(result, dict):
            raise Refused(f"expected a dict of tensors, got {type(result).__name__}")
        batch = None
        if "smashed" in result:
            expected = self._expected_smashed()
            smashed = _tensor(result, "smashed")
            if (
                smashed.dtype != expected.dtype
                or smashed.dim() != expected.dim()
                or smashed.shape[1:] != expected.shape[1:]
            ):
                cut_shape = ", ".join(map(str, expected.shape[1:]))
                raise Refused(f"smashed is {_form(smashed)}, expected {expected.dtype} (B, {cut_shape})")
            batch = smashed.shape[0]
            if not 1 <= batch <= self.blueprint.config.batch_size:
                raise Refused(f"smashed holds {batch} samples; a batch holds 1 to {self.blueprint.config.batch_size}")
        if "labels" in result:
            labels = _tensor(result, "labels")
            if labels.dtype != torch.int64 or labels.dim() != 1 or (batch is not None and len(labels) != batch):
                raise Refused(
                    f"labels are {_form(labels)}, expected torch.int64 ({batch if batch is not None else 'B'},)"
                )
            if len(labels) and not (int(labels.min()) >= 0 and int(labels.max()) < self.blueprint.num_classes):
                raise Refused(f"labels outside [0, {self.blueprint.num_classes})")
        if "loss" in result:
            value = _tensor(result, "loss")
            if value.dim() != 0 or not value.is_floating_point():
                raise Refused(f"loss is {_form(value)}, expected a floating-point scalar")

    def report(self, report: Any, expected: list[int] | None) -> list[int]:
        """The class counts of a client's REPORT (see `data_report`), if the run can use its data:
        the run's data mode, the dataset's sample shape, one count per class, at least one sample,
        and the counts the run has for the client (`expected`: its partition's, or what it
        reported before), if any."""
        config, shape, classes = self.blueprint.config, list(self.blueprint.input_shape), self.blueprint.num_classes
        if not isinstance(report, dict) or set(report) != {"data", "input_shape", "class_counts"}:
            raise Refused("a report holds exactly data, input_shape and class_counts")
        if report["data"] != config.data:
            raise Refused(f"the client was started with data={report['data']!r}; this run has data={config.data}")
        if report["input_shape"] != shape or not _whole_numbers(report["input_shape"]):
            raise Refused(f"its samples have shape {report['input_shape']!r}; {config.dataset} samples have {shape}")
        counts = report["class_counts"]
        if not _whole_numbers(counts) or len(counts) != classes or min(counts) < 0:
            raise Refused(f"its class counts are {counts!r}; expected {classes} counts (labels 0 to {classes - 1})")
        if sum(counts) < 1:
            raise Refused("it holds no samples")
        if expected is not None and counts != expected:
            raise Refused(
                f"it holds {sum(counts)} samples, {counts} by class; the run has {sum(expected)} for it, {expected}"
            )
        return counts

    def _model(self, slot: str, state: Any) -> None:
        expected = self.blueprint.initial_state(slot)
        if not isinstance(state, dict) or set(state) != set(expected):
            names = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise Refused(f"{slot} holds {names}, expected the tensors {sorted(expected)}")
        for name, tensor in state.items():
            want = expected[name]
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != want.dtype or tensor.shape != want.shape:
                raise Refused(f"{slot}.{name} is {_form(tensor)}, expected {want.dtype} {tuple(want.shape)}")

    def _role_state(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != {"models", "optimizers"}:
            raise Refused("a client's state must hold exactly 'models' and 'optimizers'")
        if not isinstance(state["models"], dict):
            raise Refused("a client's state's models must be a dict")
        for slot, weights in state["models"].items():
            if slot not in self.blueprint.builders:
                raise Refused(f"a client's state holds an unknown slot {slot!r}")
            self._model(slot, weights)

    def _expected_smashed(self) -> torch.Tensor:
        """The client part's output on one input: its dtype and cut shape (computed once)."""
        if self._smashed is None:
            blueprint = self.blueprint
            x = torch.zeros(1, *blueprint.input_shape, dtype=blueprint.input_dtype, device=blueprint.device)
            with torch.no_grad():
                self._smashed = blueprint.initial("client_model").eval()(x)
        return self._smashed


def _tensor(result: dict, key: str) -> torch.Tensor:
    value = result[key]
    if isinstance(value, Mapping):  # a defense's compressed form (quantize, topk): checked, then expanded
        try:
            value = defenses.decode(value)
        except ValueError as error:
            raise Refused(f"{key}: {error}") from None
    if not isinstance(value, torch.Tensor):
        raise Refused(f"{key} is a {type(value).__name__}, expected a tensor")
    return value


def _whole_numbers(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def data_report(node: ClientNode, data: str) -> dict[str, Any]:
    """What a client says of its samples once it has built its node (`data`: how it got them)."""
    counts = torch.bincount(node.y.cpu(), minlength=node.blueprint.num_classes)
    return {"data": data, "input_shape": list(node.x.shape[1:]), "class_counts": counts.tolist()}


def _form(value: Any) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
