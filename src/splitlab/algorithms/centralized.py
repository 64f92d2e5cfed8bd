"""Centralized training on the union of all clients' data: the reference every method is held to."""

from __future__ import annotations

import numpy as np

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.config import NoParams
from splitlab.roles import State, whole_model


class Centralized(Algorithm[NoParams]):
    """One model and one optimizer, kept by a single data owner (node 0) that holds every sample:
    nothing is sent."""

    name = "centralized"
    models = {"client_model": whole_model}
    not_u_shaped = "nothing is split: one node trains the whole model"
    not_averaged = "one node trains the whole model: there is nothing to average"
    supports_fp16 = True
    clips_whole_model = True

    @staticmethod
    def data_owners(indices: list[np.ndarray]) -> list[np.ndarray]:
        return [np.sort(np.concatenate(indices))]

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        (owner,) = clients
        for _ in range(self.ctx.local_steps(owner)):
            self.track(self.client(owner.id).local_step()["loss"])

    def global_model(self) -> list[State]:
        return [self.client(0).snapshot("client_model")]
