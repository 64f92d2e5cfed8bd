"""Vertical split learning (vertical SplitNN; Vepakomma et al., "Split learning for health", 2018).

P parties hold different features (columns) of the same samples, each with its samples' ids; the
labels are at the server or at one party (`labels_at=`). `setting=vertical algorithm=sl` runs it.

1. Alignment. The label holder and every other party find the samples all of them hold by private
   set intersection (splitlab.psi): the label holder narrows its ids with each party's in turn,
   then each party narrows its ids to the label holder's, now the intersection. Each party keeps
   only those samples, in id order, so that row i is the same sample at every party; a party's
   node holds no id outside the intersection. A sample some party lacks (a missing cell of its
   columns, a missing label) is not trained on.
2. Every step, on the same rows at every party (a seeded order all of them draw alike): each party
   runs its bottom model (the model's stages before the cut, built for its columns) and sends the
   embedding; the label holder sends the labels unless the server holds them. The server combines
   the embeddings (`combine=concat|sum|mean`), runs the top model (the stages from the cut on),
   steps, and sends each party the gradient at its embedding; each party steps.
3. Evaluation, as vertical inference goes (`role_metrics`): every party holds its columns of the
   test samples (the dataset's test split, in its order); per inference batch each runs its bottom
   model on them and sends the embeddings, the server runs its top model on their combination, and
   the metrics are computed where the labels are (the label holder's test labels go up with its
   embeddings, as in training). No bottom model nor test feature reaches the server; the metrics
   are those of the whole model on every column. Telemetry (`evaluation`), never counted.

Over a network (`splitlab launch`: one process per party) the alignment's messages are checked
like any result (splitlab.net.checks); a party that leaves during it stops the run (one line). A
party that drops out of a round is left out for the rest of it (it rejoins as a fresh node, given
its kept state and aligned again): the server
combines zeros in place of its embedding (concat, sum) or averages the others (mean); without the
label holder no step can be taken, and the round ends there. Every party's optimizer is its own
for the whole run. With one party holding every feature and the labels, this is vanilla split
learning with one client (tested, with a stateless optimizer: vanilla SL's client optimizer starts
fresh every round).

This class has no `name`: it is not an algorithm of its own but what `algorithm=sl` means in the
vertical setting (splitlab.settings.vertical plans it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from splitlab import psi
from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.errors import UserError
from splitlab.metrics import TASK_METRICS
from splitlab.models import build_model, inference, output_shape, split
from splitlab.privacy.defenses import decode
from splitlab.privacy.record import PartyRecorder
from splitlab.roles import STREAM_BATCHES, Blueprint, ClientNode, State, TrainingServer, server_part
from splitlab.transport import KEYED, ClientDropped, verb

LABELS_AT_SERVER = "server"


# --- features and models -----------------------------------------------------------------------
@dataclass(frozen=True)
class FeaturePlan:
    """Which columns (of the samples' last axis: image columns, table columns) each party holds,
    and how the server combines their embeddings."""

    input_shape: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    combine: str
    labels_at: int | str

    @property
    def parties(self) -> int:
        return len(self.groups)

    def party_shape(self, party: int) -> tuple[int, ...]:
        return (*self.input_shape[:-1], len(self.groups[party]))

    def columns(self, x: Any, party: int) -> Any:
        """Party `party`'s features of the samples `x` (stored or prepared)."""
        return x[..., list(self.groups[party])]

    def join(self, embeddings: Sequence[torch.Tensor | None], shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """The embeddings combined, a missing one (a party that dropped out) as zeros (concat,
        sum) or left out (mean)."""
        present = [e for e in embeddings if e is not None]
        if self.combine == "mean":
            return functools.reduce(torch.add, present) / len(present)
        batch, like = len(present[0]), present[0]
        filled = [e if e is not None else like.new_zeros((batch, *shape)) for e, shape in zip(embeddings, shapes)]
        if self.combine == "concat":
            return torch.cat(filled, dim=-1)
        return functools.reduce(torch.add, filled)


def parse_features(text: str | None, columns: int, parties: int) -> tuple[tuple[int, ...], ...]:
    """`features=` -> each party's column indices: groups split by `/`, each a comma-separated list
    of indices and inclusive ranges (`0-13/14-27`); None: `parties` contiguous, near-equal groups."""
    if text is None:
        if parties > columns:
            raise UserError(f"parties={parties} is more than the {columns} feature columns to divide among them")
        return tuple(tuple(int(c) for c in part) for part in np.array_split(np.arange(columns), parties))
    groups: list[tuple[int, ...]] = []
    for number, written in enumerate(str(text).split("/")):
        indices: list[int] = []
        for item in written.split(","):
            first, dash, last = item.strip().partition("-")
            try:
                low, high = int(first), int(last if dash else first)
            except ValueError:
                raise UserError(
                    f"invalid features={text!r}: {item.strip()!r} is not a column index or range a-b; "
                    f"expected e.g. 0-13/14-27"
                ) from None
            if not 0 <= low <= high < columns:
                raise UserError(f"invalid features={text!r}: {item.strip()!r} is outside columns 0 to {columns - 1}")
            indices.extend(range(low, high + 1))
        if not indices:
            raise UserError(f"invalid features={text!r}: party {number}'s group is empty")
        groups.append(tuple(indices))
    if len(groups) != parties:
        raise UserError(f"features={text!r} gives {len(groups)} groups (split by /) for parties={parties}")
    seen: dict[int, int] = {}
    for party, group in enumerate(groups):
        for column in group:
            if column in seen:
                raise UserError(
                    f"invalid features={text!r}: column {column} is in party {seen[column]}'s group and "
                    f"party {party}'s; groups may not overlap"
                )
            seen[column] = party
    return tuple(groups)


def bottom_model(blueprint: Blueprint, plan: FeaturePlan, party: int) -> nn.Module:
    """Party `party`'s bottom model: the configured model's stages before the cut, built for its columns."""
    cfg = blueprint.config
    model = build_model(
        cfg.model, plan.party_shape(party), blueprint.num_classes, seed=cfg.seed, **blueprint.model_settings
    )
    return split(model, cfg.cut)[0].to(blueprint.device)


def embedding_shapes(blueprint: Blueprint, plan: FeaturePlan) -> list[tuple[int, ...]]:
    """The shape of one sample's embedding at every party (by a dry run)."""
    dtype = blueprint.input_dtype
    return [
        output_shape(bottom_model(blueprint, plan, j).cpu(), plan.party_shape(j), dtype) for j in range(plan.parties)
    ]


def top_model(blueprint: Blueprint, plan: FeaturePlan) -> nn.Module:
    """The server's top model: the configured model's stages from the cut on. Flat embeddings
    concatenated are wider than the model's cut: its first linear layer then takes them all (seeded)."""
    top = server_part(blueprint)
    shapes = embedding_shapes(blueprint, plan)
    expected = output_shape(split(blueprint.build_model(), blueprint.config.cut)[0], blueprint.input_shape)
    joined = _joined_shape(shapes, plan.combine)
    if joined == expected:
        return top
    if plan.combine == "concat" and len(expected) == 1 and joined is not None and len(joined) == 1:
        return _widened(top, joined[0], blueprint.config.seed)
    said = ", ".join("x".join(map(str, s)) for s in shapes)
    raise UserError(
        f"combine={plan.combine} cannot join the parties' embeddings at cut={blueprint.config.cut} (shapes {said}) "
        f"into the {'x'.join(map(str, expected))} the model's part after the cut takes; "
        + (
            "choose features that divide the columns evenly, or another cut"
            if plan.combine == "concat"
            else "use combine=concat, or features of equal widths"
        )
    )


def _joined_shape(shapes: list[tuple[int, ...]], combine: str) -> tuple[int, ...] | None:
    if combine == "concat":
        leading = {s[:-1] for s in shapes}
        return (*shapes[0][:-1], sum(s[-1] for s in shapes)) if len(leading) == 1 else None
    return shapes[0] if len(set(shapes)) == 1 else None


def _widened(top: nn.Module, width: int, seed: int) -> nn.Module:
    """`top` with its first linear layer replaced by one taking `width` inputs (seeded), same name."""
    name, first = next((n, m) for n, m in top.named_modules() if isinstance(m, nn.Linear))
    parent, _, child = name.rpartition(".")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wider = nn.Linear(width, first.out_features, bias=first.bias is not None)
    setattr(top.get_submodule(parent) if parent else top, child, wider.to(first.weight.device))
    return top


def vertical_models(plan: FeaturePlan) -> dict[str, Any]:
    """The slots' builders: party j's bottom model (`client_model@j`) and the server's top model."""
    parties = {f"client_model@{j}": functools.partial(bottom_model, plan=plan, party=j) for j in range(plan.parties)}
    return {**parties, "server_model": functools.partial(top_model, plan=plan)}


class VerticalModel(nn.Module):
    """The whole vertical model, as evaluated on samples with every feature: every party's bottom
    model on its columns, the combination, the top model."""

    def __init__(self, bottoms: list[nn.Module], top: nn.Module, plan: FeaturePlan, shapes: list[tuple[int, ...]]):
        super().__init__()
        self.bottoms, self.top, self.plan, self.shapes = nn.ModuleList(bottoms), top, plan, shapes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeddings = [bottom(self.plan.columns(x, j)) for j, bottom in enumerate(self.bottoms)]
        return self.top(self.plan.join(embeddings, self.shapes))


# --- the shared order of samples ------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _order(seed: int, rnd: int, epoch: int, count: int) -> np.ndarray:
    return np.random.default_rng([seed, rnd, STREAM_BATCHES, 0, epoch]).permutation(count)


def batch_rows(blueprint: Blueprint, rnd: int, count: int, step: int) -> torch.Tensor:
    """The aligned rows of mini-batch `step` of round `rnd`: every party and the server draw the
    same seeded order (that of vanilla SL's client 0), `local_epochs` passes over the `count` rows."""
    size = blueprint.config.batch_size
    epoch, index = divmod(step, math.ceil(count / size))
    return torch.as_tensor(_order(blueprint.config.seed, rnd, epoch, count)[index * size : (index + 1) * size])


# --- roles -----------------------------------------------------------------------------------
class IdHolder:
    """Sample ids (sorted) with rows of data, aligned with others' by private set intersection."""

    ids: np.ndarray
    _asker: psi.PsiAsker | None = None

    def keep_rows(self, rows: np.ndarray) -> None:
        raise NotImplementedError

    @verb(up="psi_up")
    def psi_request(self) -> torch.Tensor:
        """Our ids, blinded, to ask another holder which of them it holds too."""
        self._asker = psi.PsiAsker(self.ids)
        return self._asker.request()

    @verb(down="psi_down", up="psi_up")
    def psi_answer(self, request: torch.Tensor) -> dict[str, torch.Tensor]:
        return psi.answer(self.ids, request)

    @verb(down="psi_down")
    def psi_narrow(self, answer: dict[str, torch.Tensor]) -> None:
        """Keep only the samples whose ids the answerer holds too (learnt from its answer)."""
        assert self._asker is not None, "psi_narrow answers a psi_request"
        kept, self._asker = self._asker.intersect(answer), None
        rows = np.searchsorted(self.ids, kept)
        self.ids = kept
        self.keep_rows(rows)

    @verb()
    def sample_count(self) -> int:
        return len(self.ids)


class FeatureParty(IdHolder, ClientNode[NoParams]):
    """A party: its columns of the samples it holds, with their ids, and its bottom model; and
    its columns of the test samples (every party holds the dataset's test split, in its order)."""

    def __init__(
        self,
        blueprint: Blueprint,
        party: int,
        ids: np.ndarray,
        x: torch.Tensor,
        prepare: Any,
        labels: Any = None,
        test_x: torch.Tensor | None = None,
        test_y: torch.Tensor | None = None,
    ) -> None:
        super().__init__(blueprint, party, x, labels if labels is not None else torch.zeros(0), prepare)
        self.ids = ids
        self.test_x = x[:0] if test_x is None else test_x
        self.test_y = torch.zeros(0, dtype=torch.long) if test_y is None else test_y
        self.reported: dict[str, Any] = {}  # data=own: what it says of its files when it joins
        self.model("client_model")

    @property
    def num_samples(self) -> int:
        return len(self.ids)

    def model(self, slot: str) -> nn.Module:
        if slot not in self.models:  # this party's own bottom model
            self.models[slot] = self.blueprint.initial(f"{slot}@{self.id}")
        return self.models[slot]

    def keep_rows(self, rows: np.ndarray) -> None:
        self.x = self.x[torch.as_tensor(rows, dtype=torch.long, device=self.x.device)]

    def rows(self, step: int) -> torch.Tensor:
        """The aligned rows of batch `step` this round (the same at every party)."""
        return batch_rows(self.blueprint, self.round, self.num_samples, step).to(self.x.device)

    @verb(up=KEYED, keys=("smashed",))
    def forward(self, step: int) -> State:
        """Bottom model on this party's columns of batch `step`; the embedding waits for its gradient."""
        return {"smashed": self._released(step)["smashed"]}

    def _released(self, step: int) -> State:
        """Batch `step`'s message as it leaves (splitlab.roles.ClientNode.release): the embedding with
        the party's defenses, and its labels (`label_dp`: randomised) where it holds them."""
        rows = self.rows(step)
        x = self.inputs(self.x[rows])
        with self.blueprint.timed("client"):
            smashed = self.model("client_model")(x)
            defended, message = self.release(x, self.batch_labels(rows), smashed, step)
            self.stash[step] = defended, self.blueprint.defense.penalty(x, smashed)
        return message

    def batch_labels(self, rows: torch.Tensor) -> torch.Tensor:
        """The labels of `rows` this party holds: none."""
        return torch.zeros(0, dtype=torch.long)

    @verb(up="evaluation")
    def test_embeddings(self, start: int, stop: int) -> torch.Tensor:
        """The bottom model on this party's columns of test samples `start` to `stop`, as the whole
        model is evaluated (eval mode, no defense at the cut), for the joint evaluation."""
        model = self.model("client_model")
        with inference(model), self.blueprint.autocast():
            return model(self.inputs(self.test_x[start:stop]))


class LabelParty(FeatureParty):
    """The party that also holds the labels (`labels_at=<party>`): they go up with its embeddings."""

    def keep_rows(self, rows: np.ndarray) -> None:
        super().keep_rows(rows)
        self.y = self.y[torch.as_tensor(rows, dtype=torch.long, device=self.y.device)]

    def batch_labels(self, rows: torch.Tensor) -> torch.Tensor:
        return self.y[rows]

    @verb(up=KEYED, keys=("smashed", "labels"))
    def forward(self, step: int) -> State:
        message = self._released(step)
        return {"smashed": message["smashed"], "labels": message["labels"]}

    @verb(up="evaluation")
    def test_labels(self, start: int, stop: int) -> torch.Tensor:
        """The labels of test samples `start` to `stop`: they go up with the embeddings, as in training."""
        return self.test_y[start:stop]


class VerticalServer(IdHolder, TrainingServer[NoParams]):
    """The top model and how many test samples the run evaluates on; with `labels_at=server`,
    also the labels and their ids, and the test samples' labels."""

    def __init__(
        self,
        blueprint: Blueprint,
        plan: FeaturePlan,
        ids: np.ndarray,
        labels: torch.Tensor,
        test_samples: int = 0,
        test_y: torch.Tensor | None = None,
    ) -> None:
        super().__init__(blueprint)
        self.plan, self.ids, self.labels = plan, ids, labels
        self.test_samples, self.test_y = test_samples, test_y
        self.shapes = embedding_shapes(blueprint, plan)

    def keep_rows(self, rows: np.ndarray) -> None:
        self.labels = self.labels[torch.as_tensor(rows, dtype=torch.long, device=self.labels.device)]

    @verb()
    def train_joint(self, step: int, embeddings: list[Any], labels: torch.Tensor | None) -> State:
        """One step of the top model on the parties' embeddings (None: a party that dropped out)
        and the labels (None: the server's own); every party's gradient at its embedding, and the loss."""
        received = [None if e is None else decode(e).requires_grad_() for e in embeddings]
        if labels is None:
            labels = self.labels[batch_rows(self.blueprint, self.round, len(self.ids), step).to(self.labels.device)]
            if isinstance(self.blueprint.recorder, PartyRecorder):  # record=N: the recorded rows get their labels
                self.blueprint.recorder.labelled(step, labels)
        with self.blueprint.timed("server"):
            value = self.blueprint.loss(self.model("server_model")(self.plan.join(received, self.shapes)), labels)
            self.step("server_model", value.backward, tuple(r for r in received if r is not None), value)
        grads = [None if r is None else self.send_gradient(cast(torch.Tensor, r.grad), labels) for r in received]
        return {"cut_grads": grads, "loss": value.detach()}

    @verb()
    def test_batches(self) -> list[tuple[int, int]]:
        """(start, stop) of each batch of the joint evaluation: the test samples in inference batches."""
        size, count = self.blueprint.inference_batch, self.test_samples
        return [(start, min(start + size, count)) for start in range(0, count, size)]

    @verb()
    def test_logits(self, embeddings: list[torch.Tensor]) -> torch.Tensor:
        """The top model (eval mode) on the parties' embeddings of one batch of test samples, combined."""
        model = self.model("server_model")
        with inference(model), self.blueprint.autocast():
            return model(self.plan.join(embeddings, self.shapes))

    @verb()
    def test_metrics(self, logits: torch.Tensor, labels: torch.Tensor | None) -> dict[str, float]:
        """The test metrics of every test sample's logits, against the server's own test labels
        (None) or those the label holder sent."""
        truth = self.test_y if labels is None else labels
        assert truth is not None, "labels_at=server: the server holds the test labels"
        return TASK_METRICS[self.blueprint.task](logits, truth)


# --- the algorithm -----------------------------------------------------------------------------
@contextlib.contextmanager
def _blaming(party: int) -> Iterator[None]:
    """A PSI message of `party`'s that the server cannot use (its form passed the checks, its bytes
    are no PSI message): the run stops, in one line naming the party."""
    try:
        yield
    except psi.PsiError as error:
        raise UserError(f"party {party}'s private set intersection message is malformed ({error})") from None


class VerticalSplitNN(Algorithm[NoParams]):
    """Vertical SplitNN: align the parties' samples, then train bottom models and the top model."""

    Client = FeatureParty
    Server = VerticalServer

    def round_batches(self, clients: list[ClientInfo]) -> int | None:
        return None  # the parties take the rows of shared batches (FeatureParty.rows), not batches of their own

    @property
    def labels_at(self) -> int | str:
        return self.ctx.config.labels_at

    def label_holder(self) -> Any:
        return self.server if self.labels_at == LABELS_AT_SERVER else self.client(int(self.labels_at))

    def align(self) -> None:
        """Private set intersection: the label holder narrows its ids with every other party's in
        turn, then every other party narrows its ids to the label holder's (the intersection).
        Every party must take part: one that leaves or is refused meanwhile stops the run (one line)."""
        others = [c.id for c in self.ctx.clients if c.id != self.labels_at]
        try:
            for party in others:
                self._narrow_holder(party)
            for party in others:
                self._narrow_party(party)
        except ClientDropped as dropped:
            raise UserError(
                f"party {dropped.client_id} left during the private set intersection ({dropped}); "
                f"every party must take part in the alignment"
            ) from None

    def _narrow_holder(self, party: int) -> None:
        holder = self.label_holder()
        with _blaming(party):
            holder.psi_narrow(self.client(party).psi_answer(holder.psi_request()))

    def _narrow_party(self, party: int) -> None:
        with _blaming(party):
            self.client(party).psi_narrow(self.label_holder().psi_answer(self.client(party).psi_request()))

    def rejoined(self, client_id: int) -> None:
        """A party back as a fresh node (over a network) holds all its rows again: it gets its kept
        state, then aligns them anew as at the start (its PSI messages counted again)."""
        super().rejoined(client_id)
        if client_id == self.labels_at:
            for party in (c.id for c in self.ctx.clients if c.id != client_id):
                self._narrow_holder(party)
        else:
            self._narrow_party(client_id)

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.server.begin_round(rnd)
        first = sorted(clients, key=lambda party: party.id != self.labels_at)  # the label holder, if a party
        for step in range(self.ctx.local_steps(clients[0])):
            sent: dict[int, Any] = {}
            for party in first:
                sent[party.id] = self.unless_dropped(party.id, "forward", step)
                if sent[party.id] is None and party.id == self.labels_at:
                    return  # the label holder dropped out: no step can be taken without labels
            if all(message is None for message in sent.values()):
                return
            labels = None if self.labels_at == LABELS_AT_SERVER else sent[int(self.labels_at)]["labels"]
            embeddings = [None if sent[party.id] is None else sent[party.id]["smashed"] for party in clients]
            reply = self.server.train_joint(step, embeddings, labels)
            for party, grad in zip(clients, reply["cut_grads"]):
                if grad is not None:
                    self.unless_dropped(party.id, "backward", step, grad)
            self.track(reply["loss"])

    def role_metrics(self) -> dict[str, float]:
        """Joint evaluation, as vertical inference goes: for each batch of test samples, every
        party's bottom model on its own columns, the server's top model on their combination; the
        metrics where the labels are (the label holder's go up with its embeddings, as in
        training). No party's model nor columns leave it; what crosses is telemetry
        (`evaluation`), never counted, as the models a vanilla evaluation fetches."""
        logits, labels = [], []
        for start, stop in self.server.test_batches():
            embeddings = [self.client(c.id).test_embeddings(start, stop) for c in self.ctx.clients]
            logits.append(self.server.test_logits(embeddings))
            if self.labels_at != LABELS_AT_SERVER:
                labels.append(self.client(int(self.labels_at)).test_labels(start, stop))
        return self.server.test_metrics(torch.cat(logits), torch.cat(labels) if labels else None)

    def global_model(self) -> list[State]:
        """Every party's bottom model, then the top model."""
        bottoms = [self.client(c.id).snapshot("client_model") for c in self.ctx.clients]
        return [*bottoms, self.server.snapshot("server_model")]


class VerticalAssembler:
    """The evaluated model from role states (every bottom model, then the top): a `VerticalModel`
    made once (the engine's `Assembler` for vertical runs)."""

    def __init__(self, blueprint: Blueprint, plan: FeaturePlan) -> None:
        bottoms = [bottom_model(blueprint, plan, j) for j in range(plan.parties)]
        self.model = VerticalModel(bottoms, top_model(blueprint, plan), plan, embedding_shapes(blueprint, plan))
        self.model.eval()

    def __call__(self, states: list[State]) -> nn.Module:
        from splitlab.models import load_shared

        for part, state in zip([*self.model.bottoms, self.model.top], states):
            load_shared(part, state)
        return self.model

    @property
    def parts(self) -> list[nn.Module]:
        return [self.model]

    def full_state(self, states: list[State]) -> dict[str, torch.Tensor]:
        """The whole model's weights: party j's as `bottoms.j.<name>`, the top's as `top.<name>`."""
        self(states)
        return OrderedDict((name, t) for name, t in self.model.state_dict().items())
