"""Vanilla split learning (Gupta & Raskar 2018): one client part relayed from client to client.

The round's clients take turns in id order; each receives the client part from whoever held it
last (counted once, as `client_model_relay`), runs its local epochs with the single server part,
and keeps the model until the next client asks. The client optimizer starts fresh with every
round (optimizer state does not travel); the server's lives for the whole run. With one client
this is centralized training at any cut (tested).

The client part passes through the server on its way, and the server keeps it as it last relayed
it: a holder that drops out takes its turn's training with it, and the next client goes on from
that copy (before anyone has held it: the initial weights), sent by the server.
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.models import load_shared, shared_state
from splitlab.roles import State
from splitlab.transport import COUNTED_BY_SENDER, verb
from splitlab.u_shaped import UShapedClient, UShapedServer


class RelayClient(UShapedClient):
    """A client that may hold the one client part between its turns."""

    @verb()
    def begin_round(self, rnd: int) -> None:
        super().begin_round(rnd)
        self.optimizers.pop("client_model", None)

    @verb(up="client_model_relay")
    def hand_over(self) -> State:
        """Give the client part away (it leaves this client)."""
        self.optimizers.pop("client_model", None)
        return shared_state(self.models.pop("client_model"))

    @verb(down=COUNTED_BY_SENDER)
    def take_over(self, state: State) -> None:
        load_shared(self.model("client_model"), state)

    @verb(down="client_model_down")
    def take_from_server(self, state: State) -> None:
        """Take the client part from the server, as it relayed it to a holder that dropped out."""
        self.take_over(state)


class Relay(Algorithm):
    """One client part handed from client to client; shared with CycleSSL."""

    Client = RelayClient
    not_averaged = "one client part is relayed from client to client, never averaged"
    holder = -1  # id of the client holding the client part; -1 before anyone has it
    relayed: State | None = None  # the client part as the server last relayed it (None: not yet)
    lost = False  # the holder dropped out with the client part

    def run_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        super().run_round(rnd, clients)
        self.lost = self.lost or self.holder in self.dropped

    def hand_to(self, client_id: int) -> None:
        """Give the client part to `client_id` (unless it dropped out); the first holder starts from
        the initial weights. If the holder dropped out, the server sends the part as it relayed it."""
        if client_id in self.dropped or (client_id == self.holder and not self.lost):
            return
        holder_has_it = self.holder != -1 and not (self.lost or self.holder in self.dropped)
        handed = self.unless_dropped(self.holder, "hand_over") if holder_has_it else None
        if handed is not None:
            self.relayed = handed
            self.unless_dropped(client_id, "take_over", handed)
        elif self.holder != -1:
            self.unless_dropped(client_id, "take_from_server", self.last_relayed())
        self.holder, self.lost = client_id, False

    def last_relayed(self) -> State:
        """The client part as the server last relayed it (the initial weights before it ever did)."""
        return self.relayed if self.relayed is not None else self.sync.model_state("client_model")

    def global_model(self) -> list[State]:
        if self.lost:
            return [self.last_relayed(), self.server.snapshot("server_model")]
        holder = self.client(max(self.holder, self.ctx.clients[0].id))
        return [holder.snapshot("client_model"), self.server.snapshot("server_model")]

    def state_dict(self) -> State:
        return {"holder": self.holder, "lost": self.lost, "relayed": self.relayed or {}}

    def load_state_dict(self, state: State) -> None:
        self.holder, self.lost = int(state["holder"]), bool(state.get("lost", False))
        self.relayed = state.get("relayed") or None


class SplitLearning(Relay, Algorithm[NoParams]):
    name = "sl"
    supports_packing = True
    Server = UShapedServer
    supports_u_shape = True
    supports_fp16 = True
    clips_whole_model = True

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:
            self.hand_to(client.id)
            for step in range(self.ctx.local_steps(client)):
                self.split_step(client.id, step)
