"""Parallel split learning (Jeon & Kim 2020; Joshi et al. 2021): client parts are never averaged.

Every client keeps its own client part (and its optimizer) for the whole run; there is no sync
server. The training server pairs each sampled client with a copy of the server part, and at the
end of the round averages the copies with weights |D_k| (inside the server: no communication).
Clients are independent within a round, so they train in parallel where the backend can, and
their copies are added into a running average in client order. With one client this is SFL-V1 with one client (tested).

`PersonalClients` is the part shared with SGLR and the cycle versions of both: a client's part
starts from the initial weights the first time it trains (so memory grows with the clients that
have trained, not with K), is checkpointed with its client, and is used for its evaluation. A
finished run keeps the model client k would deploy as the shared server part (`weights.safetensors`)
and every client's own part (`clients.safetensors`, `client.<k>.<name>`, the layout of SplitGP's).
"""

from __future__ import annotations

import torch

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import State, server_copy
from splitlab.u_shaped import UShapedClient, UShapedServer


class PersonalClient(UShapedClient):
    keeps = frozenset({"client_model"})


class PersonalClients(Algorithm):
    """Base for algorithms whose clients keep their own client part and optimizer across rounds."""

    personal_models = True
    Client = PersonalClient
    not_averaged = "every client keeps its own client part for the run; no sync server averages them"

    def global_model(self) -> None:
        return None

    def personal_model(self, client_id: int) -> list[State]:
        client_slot, server_slot = self.personal_slots
        return [self.client(client_id).snapshot(client_slot), self.server.snapshot(server_slot)]

    def shared_model(self) -> list[State]:
        return [self.server.snapshot("server_model")]

    def client_weights(self) -> dict[str, torch.Tensor]:
        """Every client's own part, as `client.<k>.<name>`."""
        return {
            f"client.{c.id}.{key}": t
            for c in self.ctx.clients
            for key, t in self.client(c.id).snapshot("client_model").items()
        }


class PSL(PersonalClients, Algorithm[NoParams]):
    name = "psl"
    supports_packing = True
    Server = UShapedServer
    supports_u_shape = True
    supports_fp16 = True
    clips_whole_model = True
    trains_server_copies = True
    supports_vectorize = True

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        if self.ctx.together is None:
            self.for_each_client(clients, self.local_training, self.fold)
        else:  # SFL-V1's steps, each client from its own part
            self.train_together(rnd, clients, {"client_model": "own", "server_model": "server copy"})
        self.server.average_copies()

    def local_training(self, client: ClientInfo) -> None:
        self.server.copy_server(client.id)
        for step in range(self.ctx.local_steps(client)):
            self.split_step(client.id, step, server_slot=server_copy(client.id))

    def fold(self, client: ClientInfo, alpha: float) -> None:
        self.fold_server_copy(client.id, alpha)
