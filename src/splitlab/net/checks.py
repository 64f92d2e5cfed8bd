"""What the server checks in every result a client sends, before anything uses it.

The checks follow from the verb's declaration (splitlab.transport: its ledger kinds, and a keyed
result's exact keys) and the blueprint, and take a result as a whole: a keyed result holds exactly
its verb's keys; smashed data is a tensor of the client part's output dtype and shape
(B, *cut shape) with 1 <= B <= batch_size (a compressed form's claimed shape is checked before it
is expanded; a language model's cut shape is (T, D), T the sequence length); labels are the task's
targets: int64 (B,) within [0, classes), or for a language task int64 (B, T) within
[0, vocabulary) or IGNORED (-100), and never leave a client in a U-shaped split (`tail_cut`); the
gradient at a U-shaped split's second cut has the dtype and shape of the server output it answers;
a loss is a scalar of the model's dtype; a model (uploaded, relayed, snapshot or checkpointed)
has exactly the slot's tensor names, shapes and dtypes, and an optimizer state fits its model;
a SCAFFOLD control variate (sent, or in a client's state) is float32 over an averaged slot's trainable parameters;
secure aggregation's messages (`_secure_aggregation`) are uint8 keys and shares of their exact sizes, keyed by
the clients the server named, and a masked input int32 of the slot's size;
a verb that declares no kind
returns nothing (but `sample_count`: a whole number, at most the samples the client reported); a
verb with no check here is refused. Every floating tensor must be finite. In a vertical run
(`setting=vertical`) every party's smashed data and models are checked against its own bottom
model (its columns), and its private set intersection messages are 1-D uint8 tensors no larger
than its reported samples allow (`_psi`); in the joint evaluation, its embeddings of test samples
start to stop have its bottom model's dtype and shape (stop - start, *cut shape), the label
holder's labels of them are the task's targets (`_test_batch`). A client's REPORT of its data must fit the run
(`Checks.report`): class counts, for a language task its number of sequences and count of each
target token id, for a vertical party the number of samples it holds and its columns' shape (with
data=own first checked for its form alone, `OwnPartyReports`: the server plans the run from it). A
failed check is a `Refused` with one line saying what was wrong.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from splitlab.algorithms.vertical_sl import FeatureParty, parse_features
from splitlab.data.datasets import SUMMARY_KEYS, data_summary
from splitlab.loss_scale import unscaled
from splitlab.privacy import defenses
from splitlab.roles import Blueprint, ClientNode, pooled
from splitlab.secure_aggregation import KEYS_BYTES, SEALED_BYTES, SHARE_BYTES
from splitlab.strategies import trainable
from splitlab.targets import IGNORED
from splitlab.transport import KEYED, VerbSpec

#: the verbs of secure aggregation whose results a client sends (`secagg_receive` returns nothing)
SECURE_AGGREGATION_VERBS = ("secagg_keys", "secagg_shares", "upload_masked", "secagg_unmask")
#: what a vertical party reports of its data beside its columns' shape: how many samples it holds
VERTICAL_SUMMARY_KEYS = ("samples",)
#: ... and with its own files (data=own): its columns, its test samples, their ids' digest, the classes it knows
OWN_PARTY_SUMMARY_KEYS = ("samples", "columns", "test_samples", "test_ids", "classes")
#: a private set intersection message's bytes per id (a compressed curve point and its framing, splitlab.psi)
PSI_POINT_BYTES = 35
#: a private set intersection message's bytes beyond its points (the protobuf message's own fields)
PSI_EXTRA_BYTES = 16


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

    def __init__(self, blueprint: Blueprint, parties: bool = False) -> None:
        self.blueprint = blueprint
        self.parties = parties  # the nodes are vertical parties (FeatureParty): they report their rows
        self._smashed: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, dict[str, Any]] = {}
        self._samples: dict[int, int] = {}  # vertical: the samples each party reported
        self._checking = threading.local()  # whose result this thread checks (`_client`)

    def result(self, verb: str, spec: VerbSpec, args: tuple, result: Any, client_id: int | None = None) -> None:
        """Refused unless `result` is exactly what client `client_id`'s `verb(*args)` returns:
        checked as a whole (every key, name, dtype, shape, range, finite) before anything uses it.
        A verb without a check here is refused too: nothing unchecked reaches the server."""
        self._checking.client = client_id
        check_finite(result)
        kind = spec.up
        if verb == "sample_count" and kind is None:  # vertical: how many samples a party holds after alignment
            most = self._samples.get(client_id, 0) if client_id is not None else 0
            if isinstance(result, bool) or not isinstance(result, int) or not 0 <= result <= most:
                raise Refused(f"sample_count is {result!r}, expected a whole number from 0 to {most}")
        elif kind is None:
            if result is not None:
                raise Refused(f"{verb} returns nothing, but the result is a {type(result).__name__}")
        elif kind == "psi_up":
            self._psi(verb, args, result)
        elif verb in SECURE_AGGREGATION_VERBS:
            self._secure_aggregation(verb, args, result)
        elif kind == KEYED:
            self._keyed(verb, spec.result_keys(args), args, result)
        elif kind == "checkpoint":
            self._role_state(result)
        elif kind == "evaluation" and verb in ("test_embeddings", "test_labels"):
            self._test_batch(verb, args, result)
        elif kind == "client_model_relay":
            self._model("client_model", result)
        elif kind == "control_up" and args and isinstance(args[0], str):
            self._control(args[0], result)
        elif args and isinstance(args[0], str) and self._own(args[0]) in self.blueprint.builders:  # upload, snapshot
            self._model(args[0], result)
        elif verb == "infer" and args and isinstance(args[0], torch.Tensor):  # SplitGP's client exit
            want = (len(args[0]), self.blueprint.num_classes)
            if (
                not isinstance(result, torch.Tensor)
                or result.dtype != self._expected_smashed().dtype
                or tuple(result.shape) != want
            ):
                raise Refused(f"logits are {_form(result)}, expected {self._expected_smashed().dtype} {want}")
        else:
            raise Refused(f"{verb}'s result has no check, so it is not accepted")

    @property
    def _client(self) -> int | None:
        return getattr(self._checking, "client", None)

    def _own(self, slot: str) -> str:
        """The slot whose builder makes `slot` for the client being checked: a vertical party's
        `client_model` is its own bottom model, `client_model@<party>`."""
        own = f"{slot}@{self._client}"
        return own if self._client is not None and own in self.blueprint.builders else slot

    def _psi(self, verb: str, args: tuple, result: Any) -> None:
        """A party's private set intersection message (splitlab.psi): its blinded ids
        (`psi_request`), or its answer to another's (`psi_answer`: its own ids blinded, `setup`,
        and the asker's blinded again, `response`); each 1-D uint8, of at most the bytes
        (`PSI_POINT_BYTES` a point) of the ids the party reported, or of the request it answers."""
        samples = self._samples.get(self._client, 0) if self._client is not None else 0
        if verb == "psi_request":
            _psi_bytes(verb, result, samples)
            return
        if verb != "psi_answer":
            raise Refused(f"{verb}'s result has no check, so it is not accepted")
        if not isinstance(result, dict) or set(result) != {"setup", "response"}:
            held = sorted(map(str, result)) if isinstance(result, dict) else type(result).__name__
            raise Refused(f"psi_answer returns exactly ['response', 'setup'], the result holds {held}")
        request = args[0] if args and isinstance(args[0], torch.Tensor) else torch.zeros(0)
        _psi_bytes("psi_answer.setup", result["setup"], samples)
        _psi_bytes("psi_answer.response", result["response"], math.ceil(len(request) / PSI_POINT_BYTES))

    def _secure_aggregation(self, verb: str, args: tuple, result: Any) -> None:
        """A client's message in the secure aggregation of an averaged slot (splitlab.secure_aggregation):
        its public keys; its sealed shares, one for each other client the server named; its masked
        input, int32 (the ring Z_2^32) with one element per element of the slot; its shares for the
        unmasking, only of the secrets the server asked for (so at most one per client of the round)."""
        slot = args[0]
        if slot not in self.blueprint.averaged:
            raise Refused(f"{verb} of {slot!r}, which the sync server does not average")
        if verb == "secagg_keys":
            _vector(verb, result, torch.uint8, KEYS_BYTES)
        elif verb == "upload_masked":
            elements = sum(t.numel() for t in self.blueprint.initial_state(slot).values())
            _vector(verb, result, torch.int32, elements)
        else:
            if verb == "secagg_shares":  # one sealed pair for each other client whose keys it was sent
                expected, size, exact = set(args[1]) - {str(self._client)}, SEALED_BYTES, True
            else:  # secagg_unmask(slot, survivors, dropped): b shares of the survivors, s shares of the dropped
                survivors, dropped = args[1].tolist(), args[2].tolist()
                expected, size, exact = {f"b{v}" for v in survivors} | {f"s{v}" for v in dropped}, SHARE_BYTES, False
            if not isinstance(result, dict) or not (set(result) == expected if exact else set(result) <= expected):
                held = sorted(map(str, result)) if isinstance(result, dict) else type(result).__name__
                raise Refused(f"{verb} holds {held}, expected {'' if exact else 'some of '}{sorted(expected)}")
            for key, message in result.items():
                _vector(f"{verb}.{key}", message, torch.uint8, size)

    def _test_batch(self, verb: str, args: tuple, result: Any) -> None:
        """A vertical party's part of the joint evaluation of test samples `start` to `stop` (the
        server's own request): its embeddings, or the label holder's labels of them."""
        start, stop = args
        if not isinstance(result, torch.Tensor):
            raise Refused(f"{verb} returns a tensor, the result is a {type(result).__name__}")
        if verb == "test_labels":
            self._labels(result, stop - start)
            return
        expected = self._expected_smashed()
        want = (stop - start, *expected.shape[1:])
        if result.dtype != expected.dtype or tuple(result.shape) != want:
            raise Refused(f"test_embeddings are {_form(result)}, expected {expected.dtype} {want}")

    def _keyed(self, verb: str, keys: tuple[str, ...], args: tuple, result: Any) -> None:
        """Exactly `keys` (U-shaped: never labels); route(n, threshold) sends 0 to n samples, a step
        1 to batch_size."""
        if self.blueprint.config.tail_cut is not None:
            keys = tuple(key for key in keys if key != "labels")
        if self.blueprint.config.packing and "smashed" in keys:  # with the batch's segment ids
            keys = (*keys, "segments")
        if not isinstance(result, dict) or set(result) != set(keys):
            held = sorted(map(str, result)) if isinstance(result, dict) else type(result).__name__
            raise Refused(f"{verb} returns exactly {sorted(keys)}, the result holds {held}")
        batch = None
        if "smashed" in result:
            most = args[0] if verb == "route" else self.blueprint.step_batch(self.blueprint.config)
            batch = self._smashed_batch(result["smashed"], 0 if verb == "route" else 1, most)
        if "labels" in result:
            self._labels(_tensor(result, "labels"), batch)
        if "segments" in result:
            self._segments(_tensor(result, "segments"), batch)
        if "tail_grad" in result:  # tail_step(step, output): the gradient at the output sent
            grad, output = self._tail_grad(result["tail_grad"]), args[1]
            if grad.dtype != output.dtype or grad.shape != output.shape:
                raise Refused(f"tail_grad is {_form(grad)}, expected {_form(output)} (the server's output)")
        if "grad_norm_up" in result:  # backward_whole: the client part's gradient norm
            norm = _tensor(result, "grad_norm_up")
            if norm.dim() != 0 or norm.dtype != torch.float32 or float(norm) < 0:
                raise Refused(f"grad_norm_up is {_form(norm)}, expected a non-negative torch.float32 scalar")
        if "loss" in result:
            value = _tensor(result, "loss")
            want = self._expected_loss_dtype()
            if value.dim() != 0 or value.dtype != want:
                raise Refused(f"loss is {_form(value)}, expected a {want} scalar")
        if "evaluation" in result:  # route: which of the n samples went to the server
            routed = _tensor(result, "evaluation")
            if routed.dtype != torch.bool or tuple(routed.shape) != (args[0],) or int(routed.sum()) != batch:
                raise Refused(f"evaluation is {_form(routed)}, expected torch.bool ({args[0]},) with {batch} set")

    def _tail_grad(self, message: Any) -> torch.Tensor:
        """The gradient at the second cut as sent; fp16: its scaled form and scale, checked (the
        scaled values are what must fit the server's output)."""
        if self.blueprint.config.precision != "fp16":
            return _tensor({"tail_grad": message}, "tail_grad")
        try:
            unscaled(message)
        except ValueError as error:
            raise Refused(f"tail_grad: {error}") from None
        return _tensor(message, "grad")

    def _segments(self, segments: torch.Tensor, batch: int | None) -> None:
        """packing=true: which row of its sequence each position holds, int64 (B, T), nondecreasing
        along T from 0 (models/packed.py), B the batch's."""
        want = (batch, self.blueprint.input_shape[0])
        if segments.dtype != torch.int64 or segments.dim() != 2 or tuple(segments.shape) != want:
            raise Refused(f"segments are {_form(segments)}, expected torch.int64 {want}")
        if bool((segments[:, :1] != 0).any()) or bool((segments.diff(dim=1) < 0).any()):
            raise Refused("segments are not nondecreasing from 0 along each sequence")

    def _labels(self, labels: torch.Tensor, batch: int | None) -> None:
        """The task's targets of `batch` samples: int64 (B,) classes in [0, classes), or for a
        language task (B, T) next tokens in [0, vocabulary) or IGNORED (T: the sequence length)."""
        blueprint = self.blueprint
        language = blueprint.task == "language"
        target_shape = tuple(blueprint.input_shape) if language else ()
        if (
            labels.dtype != torch.int64
            or labels.dim() != 1 + len(target_shape)
            or labels.shape[1:] != target_shape
            or (batch is not None and len(labels) != batch)
        ):
            want = ", ".join(map(str, (batch if batch is not None else "B", *target_shape)))
            raise Refused(f"labels are {_form(labels)}, expected torch.int64 ({want}{',' if not target_shape else ''})")
        valid = (labels >= 0) & (labels < blueprint.num_classes)
        if language:
            valid |= labels == IGNORED
        if not bool(valid.all()):
            allowed = f"[0, {blueprint.num_classes})" + (f" or {IGNORED}" if language else "")
            raise Refused(f"labels outside {allowed}")

    def _smashed_batch(self, smashed: Any, fewest: int, most: int) -> int:
        """The number of samples in smashed data of the cut's dtype and shape (B, *cut shape),
        fewest <= B <= most (a vertical party's: its bottom model's cut shape); a compressed form's
        claimed shape is checked before it is expanded."""
        expected = self._expected_smashed()
        cut_shape = ", ".join(map(str, expected.shape[1:]))
        if isinstance(smashed, Mapping) and "shape" in smashed:  # top-k: the dense shape it would take
            claimed = smashed["shape"]
            if not isinstance(claimed, torch.Tensor) or claimed.dtype != torch.int32 or claimed.dim() != 1:
                raise Refused(f"smashed.shape is {_form(claimed)}, expected torch.int32 (D,)")
            if claimed.tolist()[1:] != list(expected.shape[1:]) or not fewest <= int(claimed[0]) <= most:
                raise Refused(f"smashed claims the shape {claimed.tolist()}, expected (B, {cut_shape})")
        tensor = _tensor({"smashed": smashed}, "smashed")
        if tensor.dtype != expected.dtype or tensor.dim() != expected.dim() or tensor.shape[1:] != expected.shape[1:]:
            raise Refused(f"smashed is {_form(tensor)}, expected {expected.dtype} (B, {cut_shape})")
        batch = tensor.shape[0]
        if not fewest <= batch <= most:
            raise Refused(f"smashed holds {batch} samples; a batch holds {fewest} to {most}")
        return batch

    def report(self, report: Any, expected: dict[str, Any] | None, client_id: int | None = None) -> dict[str, Any]:
        """The summary of client `client_id`'s data in its REPORT (see `data_report`), if the run
        can use it: the run's data mode, the dataset's sample shape (a sequence's length for a
        language task; a vertical party's columns of it), the task's summary of the targets
        (`data_summary`; a vertical party: its number of samples) that holds at least one sample,
        and the summary the run has for the client (`expected`: its partition's, or what it
        reported before), if any."""
        config, shape = self.blueprint.config, list(self.blueprint.input_shape)
        vertical = self.parties
        summary_keys = _vertical_keys(config.data) if vertical else SUMMARY_KEYS[self.blueprint.task]
        if vertical:
            shape = list(_party_shape(self.blueprint, client_id))
        *keys, last = ("data", "input_shape", *summary_keys)
        if not isinstance(report, dict) or set(report) != {*keys, last}:
            raise Refused(f"a report holds exactly {', '.join(keys)} and {last}")
        if report["data"] != config.data:
            raise Refused(f"the client was started with data={report['data']!r}; this run has data={config.data}")
        if report["input_shape"] != shape or not _whole_numbers(report["input_shape"]):
            raise Refused(f"its samples have shape {report['input_shape']!r}; {config.dataset} samples have {shape}")
        summary = {key: report[key] for key in summary_keys}
        if vertical:
            if not _whole_numbers([summary["samples"]]) or summary["samples"] < 1:
                raise Refused(f"it holds {summary['samples']!r} samples; expected at least 1")
        elif self.blueprint.task == "language":
            self._token_summary(summary)
        else:
            self._class_summary(summary)
        if expected is not None and summary != expected:
            raise Refused(f"it holds {_described(summary)}; the run has {_described(expected)} for it")
        if vertical and client_id is not None:
            self.holds(client_id, summary["samples"])
        return summary

    def holds(self, party: int, samples: int) -> None:
        """Vertical party `party` holds `samples` rows (reported): its PSI messages' bound."""
        self._samples[party] = samples

    def _class_summary(self, summary: dict[str, Any]) -> None:
        classes, counts = self.blueprint.num_classes, summary["class_counts"]
        if not _whole_numbers(counts) or len(counts) != classes or min(counts) < 0:
            raise Refused(f"its class counts are {counts!r}; expected {classes} counts (labels 0 to {classes - 1})")
        if sum(counts) < 1:
            raise Refused("it holds no samples")

    def _token_summary(self, summary: dict[str, Any]) -> None:
        vocabulary, sequences, counts = self.blueprint.num_classes, summary["sequences"], summary["token_counts"]
        if not _whole_numbers([sequences]) or sequences < 1:
            raise Refused(f"it holds {sequences!r} sequences; expected at least 1")
        if not _whole_numbers(counts) or len(counts) != vocabulary or min(counts) < 0:
            raise Refused(
                f"its token counts are {str(counts)[:80]}; expected {vocabulary} counts (tokens 0 to {vocabulary - 1})"
            )
        if sum(counts) > sequences * self.blueprint.input_shape[0]:
            raise Refused(
                f"it counts {sum(counts)} target tokens in {sequences} sequences of {self.blueprint.input_shape[0]}"
            )

    def _model(self, slot: str, state: Any) -> None:
        own = self._own(slot)
        _named_tensors(slot, state, self.blueprint.initial_state(own if own != slot else pooled(slot)))

    def _control(self, slot: str, control: Any) -> None:
        """SCAFFOLD: a control variate of an averaged slot, float32 over its trainable parameters."""
        if slot not in self.blueprint.averaged:
            raise Refused(f"a control variate of {slot!r}, which the sync server does not average")
        expected = {name: p.detach().float() for name, p in trainable(self.blueprint.initial(slot)).items()}
        _named_tensors(f"control {slot}", control, expected)

    def _role_state(self, state: Any) -> None:
        config = self.blueprint.config
        keys = {"models", "optimizers"} | ({"loss_scale"} if config.precision == "fp16" else set())
        keys |= {"controls"} if config.scaffold else set()
        keys |= {"kept_optimizers"} if config.keep_client_optimizer else set()
        if not isinstance(state, dict) or set(state) != keys:
            raise Refused(f"a client's state must hold exactly {', '.join(map(repr, sorted(keys)))}")
        if "loss_scale" in state:
            _loss_scale(state["loss_scale"])
        if "controls" in state:
            controls = state["controls"]
            if not isinstance(controls, dict) or set(controls) != {"own", "server"}:
                raise Refused("a client's controls must hold exactly 'own' and 'server'")
            for held in controls.values():
                if not isinstance(held, dict):
                    raise Refused("a client's controls must be dicts of slots")
                for slot, control in held.items():
                    self._control(slot, control)
        models, optimizers = state["models"], state["optimizers"]
        if not isinstance(models, dict) or not isinstance(optimizers, dict):
            raise Refused("a client's state's models and optimizers must be dicts")
        for slot, weights in models.items():
            if self._own(slot) not in self.blueprint.builders:
                raise Refused(f"a client's state holds an unknown slot {slot!r}")
            self._model(slot, weights)
        for slot, optimizer in optimizers.items():
            if slot not in models:
                raise Refused(f"a client's state holds an optimizer for {slot!r}, which it holds no model for")
            self._optimizer(slot, optimizer)
        kept = state.get("kept_optimizers", {})
        if not isinstance(kept, dict):
            raise Refused("a client's kept optimizers must be a dict")
        for slot, optimizer in kept.items():
            if self._own(slot) not in self.blueprint.builders:
                raise Refused(f"a client's state keeps an optimizer for an unknown slot {slot!r}")
            self._optimizer(slot, optimizer)

    def _optimizer(self, slot: str, state: Any) -> None:
        """An optimizer state that fits `slot`'s model: the param groups of the configured optimizer
        over it, and per parameter (if any) the entries one of its steps makes, of their shapes."""
        template = self._optimizer_template(slot)
        if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
            raise Refused(f"{slot}'s optimizer state must hold exactly 'state' and 'param_groups'")
        groups, want_groups = state["param_groups"], template["param_groups"]
        if not isinstance(groups, list) or len(groups) != len(want_groups):
            raise Refused(f"{slot}'s optimizer has {_count(groups)} param groups, expected {len(want_groups)}")
        for group, want in zip(groups, want_groups):
            if self.blueprint.scheduled:  # a scheduled rate keeps the rate it scales (Role.optimizer)
                want = {**want, "initial_lr": want["lr"]}
            if not isinstance(group, dict) or set(group) != set(want) or group["params"] != want["params"]:
                raise Refused(f"{slot}'s optimizer param group is not that of the configured optimizer over it")
            for key, value in group.items():
                if type(value) is not type(want[key]) or (isinstance(value, float) and not math.isfinite(value)):
                    raise Refused(f"{slot}'s optimizer setting {key}={value!r} is not a {type(want[key]).__name__}")
        per_param = state["state"]
        if not isinstance(per_param, dict):
            raise Refused(f"{slot}'s optimizer state is a {type(per_param).__name__}, expected a dict")
        for index, entries in per_param.items():
            want_entries = template["state"].get(index)
            if want_entries is None or not isinstance(entries, dict) or set(entries) != set(want_entries):
                held = sorted(map(str, entries)) if isinstance(entries, dict) else type(entries).__name__
                wanted = f"{sorted(want_entries)}" if want_entries is not None else f"no parameter {index!r}"
                raise Refused(f"{slot}'s optimizer state for parameter {index!r} holds {held}; its model has {wanted}")
            for name, value in entries.items():
                want = want_entries[name]
                fits = (value is None and want is None) or (
                    isinstance(value, torch.Tensor)
                    and isinstance(want, torch.Tensor)
                    and value.dtype == want.dtype
                    and value.shape == want.shape
                )
                if not fits:
                    raise Refused(f"{slot}'s optimizer state {index}.{name} is {_form(value)}, expected {_form(want)}")

    def _optimizer_template(self, slot: str) -> dict[str, Any]:
        """The state of the configured optimizer over `slot`'s initial model after one step (made once)."""
        own = self._own(slot)
        if own not in self._optimizers:
            module = self.blueprint.initial(own)
            optimizer = self.blueprint.optimizer(module)
            for parameter in module.parameters():
                parameter.grad = torch.zeros_like(parameter)
            optimizer.step()
            self._optimizers[own] = optimizer.state_dict()
        return self._optimizers[own]

    def _expected_smashed(self) -> torch.Tensor:
        """The client part's output on one input: its dtype and cut shape (computed once; a
        vertical party's: its bottom model's on its columns)."""
        slot = self._own("client_model")
        if slot not in self._smashed:
            blueprint = self.blueprint
            shape = blueprint.input_shape if slot == "client_model" else _party_shape(blueprint, self._client)
            x = torch.zeros(1, *shape, dtype=blueprint.input_dtype, device=blueprint.device)
            with torch.no_grad(), blueprint.autocast():
                smashed = blueprint.initial(slot).eval()(x)
            self._smashed[slot] = smashed if blueprint.cut_dtype is None else smashed.to(blueprint.cut_dtype)
        return self._smashed[slot]

    def _expected_loss_dtype(self) -> torch.dtype:
        """A client's loss: the model's dtype; under autocast (precision=bf16), float32, as torch computes losses."""
        return self._expected_smashed().dtype if self.blueprint.cut_dtype is None else torch.float32


def _named_tensors(what: str, state: Any, expected: dict[str, torch.Tensor]) -> None:
    """Refused unless `state` holds exactly `expected`'s names, each a tensor of its dtype and shape."""
    if not isinstance(state, dict) or set(state) != set(expected):
        names = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise Refused(f"{what} holds {names}, expected the tensors {sorted(expected)}")
    for name, tensor in state.items():
        want = expected[name]
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != want.dtype or tensor.shape != want.shape:
            raise Refused(f"{what}.{name} is {_form(tensor)}, expected {want.dtype} {tuple(want.shape)}")


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


def _loss_scale(state: Any) -> None:
    """precision=fp16: a role's (scale, finite steps), splitlab.loss_scale.LossScale.state."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float64 or tuple(state.shape) != (2,):
        raise Refused(f"loss_scale is {_form(state)}, expected torch.float64 (2,)")
    scale, steps = state.tolist()
    if not (scale > 0 and steps >= 0 and steps == int(steps)):
        raise Refused(f"loss_scale holds scale {scale} and {steps} steps, expected a scale > 0 and a whole count")


def _vector(where: str, message: Any, dtype: torch.dtype, size: int) -> None:
    if not isinstance(message, torch.Tensor) or message.dtype != dtype or tuple(message.shape) != (size,):
        raise Refused(f"{where} is {_form(message)}, expected {dtype} ({size},)")


def _psi_bytes(where: str, message: Any, points: int) -> None:
    """A private set intersection message: a 1-D uint8 tensor of at most `points` ids' bytes."""
    most = PSI_POINT_BYTES * points + PSI_EXTRA_BYTES
    if not isinstance(message, torch.Tensor) or message.dtype != torch.uint8 or message.dim() != 1:
        raise Refused(f"{where} is {_form(message)}, expected torch.uint8 (N,) bytes")
    if len(message) > most:
        raise Refused(f"{where} holds {len(message)} bytes; {points} ids take at most {most}")


def _party_shape(blueprint: Blueprint, party: int | None) -> tuple[int, ...]:
    """A vertical party's sample shape: its columns (`features=`) of the dataset's samples."""
    config, shape = blueprint.config, tuple(blueprint.input_shape)
    groups = parse_features(config.features, shape[-1], config.parties)
    if party is None or not 0 <= party < len(groups):
        raise Refused(f"client {party} is not a party of this run (0 to {len(groups) - 1})")
    return (*shape[:-1], len(groups[party]))


def _whole_numbers(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def data_report(node: ClientNode, data: str) -> dict[str, Any]:
    """What a client says of its samples once it has built its node (`data`: how it got them; a
    vertical party: how many it holds, since only one party, or none, holds labels)."""
    blueprint = node.blueprint
    if isinstance(node, FeatureParty):  # a vertical party: data=own says more (vertical._own_party)
        summary: dict[str, Any] = {"samples": node.num_samples, **node.reported}
    else:
        summary = data_summary(node.y, blueprint.task, blueprint.num_classes)
    return {"data": data, "input_shape": list(node.x.shape[1:]), **summary}


def _vertical_keys(data: str) -> tuple[str, ...]:
    return OWN_PARTY_SUMMARY_KEYS if data == "own" else VERTICAL_SUMMARY_KEYS


class OwnPartyReports:
    """The REPORTs of a vertical run's parties with their own files (data=own), checked for their
    form before the server knows the parties' columns: it plans the run from them (then `Checks`
    holds a party that joins again to what it first reported)."""

    def report(self, report: Any, expected: dict[str, Any] | None, client_id: int | None = None) -> dict[str, Any]:
        keys = ("data", "input_shape", *OWN_PARTY_SUMMARY_KEYS)
        if not isinstance(report, dict) or set(report) != set(keys):
            raise Refused(f"a report holds exactly {', '.join(keys)}")
        if report["data"] != "own":
            raise Refused(f"the client was started with data={report['data']!r}; this run has data=own")
        counts = [report[key] for key in ("samples", "columns", "test_samples", "classes")]
        if not _whole_numbers(counts) or min(counts[:3]) < 1 or counts[3] < 0:
            raise Refused(f"it reports {counts!r} samples, columns, test samples and classes; expected whole numbers")
        if report["input_shape"] != [report["columns"]]:
            raise Refused(f"its samples have shape {report['input_shape']!r}, not its {report['columns']} columns")
        if not isinstance(report["test_ids"], str) or len(report["test_ids"]) != 64:
            raise Refused("its test_ids is not a sha256 digest in hex")
        return {key: report[key] for key in OWN_PARTY_SUMMARY_KEYS}


def held(summary: dict[str, Any]) -> str:
    """How many samples a data summary holds, in words."""
    if "class_counts" in summary:
        return f"{sum(summary['class_counts'])} samples"
    if "samples" in summary:
        return f"{summary['samples']} samples"
    return f"{summary['sequences']} sequences"


def _described(summary: dict[str, Any]) -> str:
    """A summary in words: samples by class, or sequences and their target tokens."""
    if "class_counts" in summary:
        return f"{held(summary)}, {summary['class_counts']} by class"
    if "samples" in summary:
        return held(summary)
    counts = summary["token_counts"]
    return f"{held(summary)}, {sum(counts)} target tokens, by id {str(counts)[:60]}..."


def _count(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else f"a {type(value).__name__} of"


def _form(value: Any) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
