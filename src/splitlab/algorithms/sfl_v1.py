"""SplitFed v1 (Thapa et al. 2022; cut-layer paper, Algorithm 1): a server copy per client.

Each client trains its client part with its own copy of the server part; at the end of the round
the sync server averages the client parts and the training server averages its server copies,
both with weights |D_k|. Every client is independent within a round, so clients are processed one
after another into running averages (memory flat in K). With the same optimizer, learning rate
and batches this is exactly FedAvg at any cut (Prop. 1 of the cut-layer paper): tested.
Averaging the server copies happens inside the training server, so it costs no communication.
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams


class SFLV1(Algorithm[NoParams]):
    name = "sfl_v1"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self.download(client.id)
            self.server.copy_server()
            for step in range(self.ctx.local_steps(client)):
                self.split_step(client.id, step, server_slot="server_copy")
            self.server.fold_copy(alpha)
            self.contribute(client.id, alpha)
        self.sync.average("client_model")
        self.server.average_copies()
