"""FedAvg (McMahan et al. 2017): each client trains a full copy locally; the sync server averages."""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import State, whole_model


class FedAvg(Algorithm[NoParams]):
    """Clients train independently (in parallel where the backend can) and are added into a running
    average in client order, so memory is flat in K."""

    name = "fedavg"
    models = {"client_model": whole_model}
    not_u_shaped = "nothing is split: every client trains the whole model"
    supports_fp16 = True
    averaged = ("client_model",)
    clips_whole_model = True
    can_keep_client_optimizer = True
    supports_vectorize = True

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        if self.ctx.together is None:
            self.for_each_client(clients, self.local_training, self.contribute_model)
        else:
            self.train_together(rnd, clients, {"client_model": "averaged"})
        self.average("client_model")

    def local_training(self, client: ClientInfo) -> None:
        self.download(client.id)
        for _ in range(self.ctx.local_steps(client)):
            self.local_step(client.id)

    def contribute_model(self, client: ClientInfo, alpha: float) -> None:
        self.contribute(client.id, alpha)

    def global_model(self) -> list[State]:
        return [self.sync.model_state("client_model")]
