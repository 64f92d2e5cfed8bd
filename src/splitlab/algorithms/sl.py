"""Vanilla split learning (Gupta & Raskar 2018): one client part relayed from client to client.

The round's clients take turns in id order; each receives the client part from whoever held it
last (counted once, as `client_model_relay`), runs its local epochs with the single server part,
and keeps the model until the next client asks. The client optimizer starts fresh with every
round (optimizer state does not travel); the server's lives for the whole run. With one client
this is centralized training at any cut (tested).
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import ClientNode, State
from splitlab.transport import COUNTED_BY_SENDER, verb


class RelayClient(ClientNode):
    """A client that may hold the one client part between its turns."""

    @verb()
    def begin_round(self, rnd: int) -> None:
        super().begin_round(rnd)
        self.optimizers.pop("client_model", None)

    @verb(up="client_model_relay")
    def hand_over(self) -> State:
        """Give the client part away (it leaves this client)."""
        self.optimizers.pop("client_model", None)
        return self.models.pop("client_model").state_dict()

    @verb(down=COUNTED_BY_SENDER)
    def take_over(self, state: State) -> None:
        self.model("client_model").load_state_dict(state)


class Relay(Algorithm):
    """One client part handed from client to client; shared with CycleSSL."""

    Client = RelayClient
    holder = -1  # id of the client holding the client part; -1 before anyone has it

    def hand_to(self, client_id: int) -> None:
        """Give the client part to `client_id`; the first holder starts from the initial weights."""
        if self.holder not in (-1, client_id):
            self.client(client_id).take_over(self.client(self.holder).hand_over())
        self.holder = client_id

    def global_model(self) -> list[State]:
        holder = self.client(max(self.holder, self.ctx.clients[0].id))
        return [holder.snapshot("client_model"), self.server.snapshot("server_model")]

    def state_dict(self) -> State:
        return {"holder": self.holder}

    def load_state_dict(self, state: State) -> None:
        self.holder = int(state["holder"])


class SplitLearning(Relay, Algorithm[NoParams]):
    name = "sl"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:
            self.hand_to(client.id)
            for step in range(self.ctx.local_steps(client)):
                self.split_step(client.id, step)
