"""SplitFed v1 (Thapa et al. 2022; cut-layer paper, Algorithm 1): a server copy per client.

Each client trains its client part with its own copy of the server part; at the end of the round
the sync server averages the client parts and the training server averages its server copies,
both with weights |D_k|. Every client is independent within a round, so clients are processed one
after another into running averages (memory flat in K). With the same optimizer, learning rate
and batches this is exactly FedAvg at any cut (Prop. 1 of the cut-layer paper): tested.
Averaging the server copies happens inside the training server, so it costs no communication.
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, Context
from splitlab.roles import Client, ModelAverage


class SFLV1(Algorithm):
    name = "sfl_v1"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, self.server_model = ctx.new_split()
        self._client_copy = self.working_copy(self.client_model)
        self._server_copy = self.working_copy(self.server_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        client_average, server_average = ModelAverage(), ModelAverage()
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self.download("client_model_down", self.client_model, self._client_copy)
            self._server_copy.load_state_dict(self.server_model.state_dict())
            client_part, server_part = self.ctx.part(self._client_copy), self.ctx.part(self._server_copy)
            for x, y in self.ctx.batches(client, rnd):
                self.split_step(client_part, server_part, x, y)
            client_average.add(self.channel.send("client_model_up", self._client_copy.state_dict()), alpha)
            server_average.add(self._server_copy.state_dict(), alpha)
        self.average_into(self.client_model, client_average)
        self.average_into(self.server_model, server_average)

    def global_parts(self):
        return [self.client_model, self.server_model]
