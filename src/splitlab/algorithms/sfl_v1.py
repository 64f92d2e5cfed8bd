"""SplitFed v1 (Thapa et al. 2022; cut-layer paper, Algorithm 1): a server copy per client.

Each client trains its client part with its own copy of the server part; at the end of the round
the sync server averages the client parts and the training server averages its server copies,
both with weights |D_k|. Every client is independent within a round, so clients train in parallel
where the backend can, and are added into running averages in client order (memory flat in K).
With the same optimizer, learning rate and batches this is exactly FedAvg at any cut (Prop. 1 of
the cut-layer paper): tested.
Averaging the server copies happens inside the training server, so it costs no communication.
"""

from __future__ import annotations

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import server_copy
from splitlab.u_shaped import UShapedClient, UShapedServer


class SFLV1(Algorithm[NoParams]):
    name = "sfl_v1"
    supports_packing = True
    Client, Server = UShapedClient, UShapedServer
    supports_u_shape = True
    supports_fp16 = True
    averaged = ("client_model",)
    clips_whole_model = True
    trains_server_copies = True
    can_keep_client_optimizer = True
    supports_vectorize = True

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        if self.ctx.together is None:
            self.for_each_client(clients, self.local_training, self.fold)
        else:  # one model, client part then server copy: the same steps (FedAvg at any cut)
            self.train_together(rnd, clients, {"client_model": "averaged", "server_model": "server copy"})
        self.average("client_model")
        self.server.average_copies()

    def local_training(self, client: ClientInfo) -> None:
        self.download(client.id)
        self.server.copy_server(client.id)
        for step in range(self.ctx.local_steps(client)):
            self.split_step(client.id, step, server_slot=server_copy(client.id))

    def fold(self, client: ClientInfo, alpha: float) -> None:
        self.contribute(client.id, alpha)
        self.fold_server_copy(client.id, alpha)
