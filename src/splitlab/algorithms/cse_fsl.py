"""CSE-FSL (Mu & Shen 2023, as summarised in the FSL-SAGE paper): clients learn from a local loss.

Each client trains its client part together with an auxiliary head (models/aux.py) on the local
loss CE(aux(client(x)), y), so no gradient ever comes back from the server. At every q-th local
step (steps 0, q, 2q, ... of the round, as in the authors' code) the client also sends that
batch's smashed data and labels; the single server part takes one step on them. After the round
the sync server averages the client parts and the auxiliary heads (weights |D_k|); both travel
down and up every round.

`AuxiliaryFSL` is what CSE-FSL and FSL-SAGE share (the server's `learn_from` is a plain server step
here; FSL-SAGE's server also keeps what it received). Clients take their local steps interleaved
as in SplitFed-v2's default schedule: at each local step the clients with batches left go in a
fresh random order, which is the server's first-come-first-served order of the FSL-SAGE paper's
Algorithm 3 (with q = 1 the server sees exactly SFL-V2's sequence of batches). Nothing the
server does reaches a client within a round, so the order only matters to the server part, and
clients take their steps in parallel where the backend can (`interleaved_steps`).
"""

from __future__ import annotations

import typing
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from splitlab.algorithms.base import Algorithm, ClientInfo, PartKind
from splitlab.errors import UserError
from splitlab.models.aux import build_aux, parse_aux
from splitlab.roles import SPLIT_MODELS, Blueprint, ClientNode, State, sent_if
from splitlab.transport import KEYED, verb

AUX_SLOTS = ("client_model", "aux_model")
"""A client's model for its local loss: the client part, then the auxiliary model."""


class CSEFSLParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_update_interval: int = Field(
        5,
        ge=1,
        le=1_000_000,
        description="q: a client sends smashed data + labels at every q-th local step (authors: 5)",
    )
    aux: str = Field(
        "stage",
        description="auxiliary model: linear | half | stage | full (FSL-SAGE App. D.4) | blocks:N (the first N "
        "server blocks and the server's head)",
    )

    @field_validator("aux")
    @classmethod
    def _check_aux(cls, value: str) -> str:
        try:
            parse_aux(value)
        except UserError:
            raise ValueError("expected 'linear', 'half', 'stage', 'full' or 'blocks:N' (N >= 1)") from None
        return value


def initial_aux(blueprint: Blueprint) -> nn.Module:
    """The initial auxiliary model for this run's model, cut and seed."""
    cfg, params = blueprint.config, typing.cast(CSEFSLParams, blueprint.params)
    return build_aux(
        params.aux,
        blueprint.new_model().cpu(),
        cfg.cut,
        blueprint.input_shape,
        seed=cfg.seed,
        dtype=blueprint.input_dtype,
    ).to(blueprint.device)


class AuxiliaryFSL(Algorithm):
    """Federated split learning with auxiliary models: the client slots in `averaged` go down to
    the round's clients and come back averaged, one server part is fed every q-th step. Subclasses
    may say what follows a round (`finish_round`); their clients say, in `local_aux_step`, how a
    client steps without the server."""

    models = {**SPLIT_MODELS, "aux_model": initial_aux}
    not_u_shaped = (
        "its clients step on an auxiliary model's loss at the cut and send the server their labels to train on"
    )
    supports_vectorize = True

    def server_steps(self, clients: list[ClientInfo]) -> dict[str, int]:
        """One server step per batch sent: every q-th local step of each client, from its first."""
        q = self.params.server_update_interval
        return {"server_model": sum(-(-self.ctx.local_steps(c) // q) for c in clients)}

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        if self.ctx.together is None:
            for client in clients:
                for slot in self.averaged:
                    self.download(client.id, slot)
            steps = self.interleaved_steps(rnd, clients, self.aux_step)
        else:  # every client's local steps first: nothing the server does reaches a client in the round
            steps = self.aux_steps_together(rnd, clients)
        for client, sent in steps:
            if sent:  # smashed data and labels up, one server step; nothing goes back
                reply = self.on_data_of(client.id, "learn_from", client.id, sent["smashed"], sent["labels"])
                if reply is not None:
                    self.track(reply["loss"])
        if self.ctx.together is None:
            for client, alpha in zip(clients, self.ctx.weights(clients)):
                self.contribute(client.id, alpha, self.averaged)
        for slot in self.averaged:
            self.average(slot)
        self.finish_round(rnd, clients)

    def aux_step(self, client: ClientInfo, step: int) -> State | None:
        """The client's step on its local loss; its smashed data and labels at every q-th step
        (None: the client dropped out, and is skipped for the rest of the round)."""
        return self.unless_dropped(client.id, "local_aux_step", self.sends(step))

    def sends(self, step: int) -> bool:
        """Whether a client sends its smashed data and labels at local step `step`: every q-th, from the first."""
        return step % self.params.server_update_interval == 0

    def aux_steps_together(self, rnd: int, clients: list[ClientInfo]) -> Iterator[tuple[ClientInfo, State | None]]:
        """vectorize=true: every client's local steps, then what they sent in the server's order (as
        `interleaved_steps`'). The aux model is trained and averaged with the client part where it
        is averaged (CSE-FSL); else it is each client's own, held fixed (FSL-SAGE)."""
        parts: dict[str, PartKind] = {slot: "averaged" if slot in self.averaged else "fixed" for slot in AUX_SLOTS}
        sent = self.train_together(rnd, clients, parts, self.sends)
        for k, step in self.ctx.interleaved(rnd, clients):
            yield clients[k], sent.pop((clients[k].id, step), None)

    def finish_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        """What follows the round's averages (nothing here)."""


class CSEFSLClient(ClientNode[CSEFSLParams]):
    @verb(up=KEYED, keys=sent_if)
    def local_aux_step(self, send: bool) -> State:
        """One step of client part and auxiliary head on the local loss; the smashed data if `send`."""
        x, y = self.next_batch()
        with self.blueprint.timed("client"):
            smashed = self.client_output(x)
            value = self.blueprint.loss(self.model("aux_model")(smashed), y)
            penalty = self.blueprint.defense.penalty(x, smashed)
            self.steps(("client_model", "aux_model"), lambda: self.backward_pass((value, None), (penalty, None)))
        return self.release(x, y, smashed.detach())[1] if send else {}


class CSEFSL(AuxiliaryFSL, Algorithm[CSEFSLParams]):
    name = "cse_fsl"
    Client = CSEFSLClient
    supports_fp16 = True
    averaged = ("client_model", "aux_model")
