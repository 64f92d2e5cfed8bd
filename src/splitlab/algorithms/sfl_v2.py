"""SplitFed v2 (Thapa et al. 2022; cut-layer paper, Algorithm 2): one shared server model.

Client parts are per-client copies averaged by the sync server after each round (weights |D_k|);
the single server part is trained on every client's smashed data in turn and keeps its optimizer
for the whole run. Two server schedules:

- `interleaved` (default; the cut-layer paper's Algorithm 2): at every local step each client
  with batches left sends one batch, and the server takes them in a fresh random order.
- `sequential` (the original SplitFed code): clients in a random order, each running all its
  local epochs with the server before the next starts. Needs one client copy at a time.

With one client both are centralized training at any cut (tested). With vectorize=true the
interleaved schedule takes each local step's client halves together: the clients' forward passes,
then the server's steps in its random order, then their backward passes (a client's forward needs
only its own previous steps, so this is the same order of computations).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import STREAM_ORDER, Algorithm, ClientInfo
from splitlab.u_shaped import UShapedClient, UShapedServer


class SFLV2Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_schedule: Literal["interleaved", "sequential"] = Field(
        "interleaved",
        description="interleaved: one batch of each client at a time, in a random order | sequential: clients "
        "in a random order, each all its steps (the original SplitFed code)",
    )


class SFLV2(Algorithm[SFLV2Params]):
    name = "sfl_v2"
    Client, Server = UShapedClient, UShapedServer
    supports_u_shape = True
    supports_fp16 = True
    averaged = ("client_model",)
    clips_whole_model = True
    can_keep_client_optimizer = True
    supports_packing = True
    supports_vectorize = True

    @staticmethod
    def not_vectorized(params: SFLV2Params) -> str:
        if params.server_schedule == "sequential":
            return "server_schedule=sequential trains one client at a time, each all its steps with the server"
        return ""

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        if self.ctx.together is not None:  # the clients' halves of each step together, the server's in turn
            self.interleaved_together(rnd, clients)
            self.average("client_model")
        elif self.params.server_schedule == "interleaved":
            for client in clients:
                self.download(client.id)
            for k, step in self.ctx.interleaved(rnd, clients):
                self.split_step(clients[k].id, step)
            self.federated_average(clients)
        else:
            alphas = self.ctx.weights(clients)
            for k in self.ctx.rng(rnd, STREAM_ORDER).permutation(len(clients)):
                self.download(clients[k].id)
                for step in range(self.ctx.local_steps(clients[k])):
                    self.split_step(clients[k].id, step)
                self.contribute(clients[k].id, alphas[k])
            self.average("client_model")
