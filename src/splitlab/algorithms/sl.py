"""Vanilla split learning (Gupta & Raskar 2018): one client part relayed from client to client.

The round's clients take turns in id order; each receives the client part from whoever held it
last (counted as `client_model_relay`), runs its local epochs with the single server part, and
keeps the model until the next client asks. The client optimizer starts fresh with every holder
(optimizer state does not travel); the server's lives for the whole run. With one client this is
centralized training at any cut (tested).
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, Context
from splitlab.roles import Client


class Relay(Algorithm):
    """One client part (`self.client_model`) handed from client to client; shared with CycleSSL."""

    holder = -1  # id of the client holding the client part; -1 before anyone has it

    def hand_to(self, client: Client) -> None:
        """Give the client part to `client`, counted unless it already holds it."""
        if self.holder not in (-1, client.id):
            self.client_model.load_state_dict(
                self.channel.send("client_model_relay", self.client_model.state_dict()))
        self.holder = client.id

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "holder": self.holder}

    def load_state_dict(self, state: dict[str, object]) -> None:
        state = dict(state)
        self.holder = int(state.pop("holder"))
        super().load_state_dict(state)


class SplitLearning(Relay):
    name = "sl"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, server_model = ctx.new_split()
        self.server = ctx.part(server_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        for client in clients:
            self.hand_to(client)
            client_part = self.ctx.part(self.client_model)
            for x, y in self.ctx.batches(client, rnd):
                self.split_step(client_part, self.server, x, y)

    def global_parts(self):
        return [self.client_model, self.server.model]
