"""FedAvg (McMahan et al. 2017): each client trains a full copy locally; the sync server averages."""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, Context
from splitlab.roles import Client, ModelAverage


class FedAvg(Algorithm):
    """Clients are processed one after another into a running average, so memory is flat in K."""

    name = "fedavg"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.global_model = ctx.new_model()
        self._local = self.working_copy(self.global_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        average = ModelAverage()
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self.download("client_model_down", self.global_model, self._local)
            local = self.ctx.part(self._local)
            for x, y in self.ctx.batches(client, rnd):
                self.local_step(local, x, y)
            average.add(self.channel.send("client_model_up", self._local.state_dict()), alpha)
        self.average_into(self.global_model, average)

    def global_parts(self):
        return [self.global_model]
