"""SplitGP (Han et al. 2022, Algorithm 1): personalized client exits + a generalized server part.

Client k keeps its own client part phi_k and an exit h_k at the cut (flatten + one linear layer);
the server part theta is shared. Each batch minimises F_k = gamma * l_C(phi_k, h_k) +
(1 - gamma) * l_S(phi_k, theta) (eq. 5): the server's cut gradient is already scaled by
(1 - gamma) when it is sent down. After the round (eqs. 9-10, Algorithm 1 lines 10-12):

    theta   <- sum_k alpha_k theta_k                                  (server copies, no traffic)
    phi_k   <- lambda * phi_k + (1 - lambda) * sum_i alpha_i phi_i     (every sampled client)
    h_k     <- lambda * h_k   + (1 - lambda) * sum_i alpha_i h_i

lambda is the `personalization` key. With gamma = 0 and lambda = 0 this is SplitFed v1 (tested);
lambda = 0 alone is a two-exit network trained with FedAvg (the paper's multi-exit baseline).
Only the round's clients are mixed: one that sits a round out keeps its personal model.
`predict` (the engine's per-round test accuracy) uses the averaged client part with theta, the
model a newly arriving client would get; the paper's per-client, entropy-gated view is
`splitlab evaluate` (splitlab.splitgp.evaluation), which reads `clients.safetensors`.
"""

from __future__ import annotations

import copy
import math

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from splitlab.algorithms.base import Algorithm, Context
from splitlab.models import output_shape
from splitlab.roles import Client, ModelAverage, Part


class SplitGPParams(BaseModel):
    """Section III of the paper; defaults are its experimental settings (Section VI)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gamma: float = Field(0.5, ge=0, le=1, description="weight of the client-exit loss in eq. (5)")
    personalization: float = Field(0.2, ge=0, le=1,
                                   description="lambda of eqs. (9)-(10): share of phi_k, h_k kept after a round")


def exit_head(client_part: nn.Module, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Sequential:
    """The auxiliary classifier h at the cut: flatten + one linear layer (2304 -> 10 = 23,050 params
    for splitgp_cnn at cut 4, as in the paper). Built on the CPU; its init depends only on `seed`."""
    features = math.prod(output_shape(copy.deepcopy(client_part).cpu(), input_shape))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))


def mix(own: nn.Module, average: dict[str, torch.Tensor], keep: float) -> None:
    """own <- keep * own + (1 - keep) * average; keep = 1 and keep = 0 are exact."""
    mixture = ModelAverage()
    mixture.add(own.state_dict(), keep)
    mixture.add(average, 1 - keep)
    own.load_state_dict(mixture.result(own.state_dict()))


class SplitGP(Algorithm):
    name = "splitgp"
    Params = SplitGPParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_average, self.server_model = ctx.new_split()
        head = exit_head(self.client_average, ctx.data.input_shape, ctx.data.num_classes, ctx.config.seed)
        self.exit_average = head.to(ctx.device)
        # phi_0 and h_0 go to every client once, before the first round.
        self.client_models = [self.working_copy(self.client_average) for _ in ctx.clients]
        self.exits = [self.working_copy(self.exit_average) for _ in ctx.clients]
        for phi, h in zip(self.client_models, self.exits):
            self.download("client_model_down", self.client_average, phi)
            self.download("aux_model_down", self.exit_average, h)
        self._server_copy = self.working_copy(self.server_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        client_avg, exit_avg, server_avg = ModelAverage(), ModelAverage(), ModelAverage()
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            phi, h = self.client_models[client.id], self.exits[client.id]
            self._server_copy.load_state_dict(self.server_model.state_dict())
            client_part = self.ctx.part(nn.ModuleList([phi, h]))
            server_part = self.ctx.part(self._server_copy)
            for x, y in self.ctx.batches(client, rnd):
                self.multi_exit_step(client_part, server_part, x, y)
            client_avg.add(self.channel.send("client_model_up", phi.state_dict()), alpha)
            exit_avg.add(self.channel.send("aux_model_up", h.state_dict()), alpha)
            server_avg.add(self._server_copy.state_dict(), alpha)
        self.average_into(self.server_model, server_avg)
        self.average_into(self.client_average, client_avg)
        self.average_into(self.exit_average, exit_avg)
        keep = self.params.personalization
        for client in clients:
            average_phi = self.channel.send("client_model_down", self.client_average.state_dict())
            average_h = self.channel.send("aux_model_down", self.exit_average.state_dict())
            mix(self.client_models[client.id], average_phi, keep)
            mix(self.exits[client.id], average_h, keep)

    def multi_exit_step(self, client: Part, server: Part, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step on F_k = gamma * l_C + (1 - gamma) * l_S (eqs. 6-8)."""
        gamma = self.params.gamma
        phi, h = client.model
        with self.timed("client"):
            smashed = phi(x)
            client_loss = self.loss(h(smashed), y)
        received = self.channel.send("smashed", smashed).requires_grad_()
        labels = self.channel.send("labels", y)
        with self.timed("server"):
            server_loss = self.loss(server.model(received), labels)
            server.optimizer.zero_grad(set_to_none=True)
            ((1 - gamma) * server_loss).backward()
            server.optimizer.step()
        cut_grad = self.channel.send("cut_grad", received.grad)
        with self.timed("client"):
            client.optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward([gamma * client_loss, smashed], [None, cut_grad])
            client.optimizer.step()
        return self.track(gamma * client_loss.detach() + (1 - gamma) * server_loss.detach())

    def global_parts(self):
        return [self.client_average, self.server_model]

    def client_weights(self) -> dict[str, torch.Tensor]:
        """phi_k and h_k of every client, as `client.<k>.<name>` and `exit.<k>.<name>`."""
        return {f"{role}.{k}.{name}": t
                for role, modules in (("client", self.client_models), ("exit", self.exits))
                for k, module in enumerate(modules) for name, t in module.state_dict().items()}

    def load_client_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        for role, modules in (("client", self.client_models), ("exit", self.exits)):
            for k, module in enumerate(modules):
                prefix = f"{role}.{k}."
                module.load_state_dict({name[len(prefix):]: t for name, t in tensors.items()
                                        if name.startswith(prefix)})
