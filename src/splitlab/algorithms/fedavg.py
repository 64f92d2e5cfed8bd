"""FedAvg (McMahan et al. 2017): each client trains a full copy locally; the sync server averages."""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import State, whole_model


class FedAvg(Algorithm[NoParams]):
    """Clients are processed one after another into a running average, so memory is flat in K."""

    name = "fedavg"
    models = {"client_model": whole_model}

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self.download(client.id)
            for _ in range(self.ctx.local_steps(client)):
                self.local_step(client.id)
            self.contribute(client.id, alpha)
        self.sync.average("client_model")

    def global_model(self) -> list[State]:
        return [self.sync.model_state("client_model")]
