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
`splitlab evaluate` (splitlab.splitgp_evaluation), which reads `clients.safetensors`.
phi_k and h_k are the client's own (slots `client_model` and `aux_model`); the averages are the
sync server's, under the same slot names.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from splitlab.algorithms.base import Algorithm, ClientInfo, Context
from splitlab.models import inference, output_shape
from splitlab.roles import (
    SENT,
    SPLIT_MODELS,
    Blueprint,
    ClientNode,
    ModelAverage,
    State,
    TrainingServer,
    server_copy,
)
from splitlab.transport import KEYED, verb


class SplitGPParams(BaseModel):
    """Section III of the paper; defaults are its experimental settings (Section VI)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gamma: float = Field(0.5, ge=0, le=1, description="weight of the client-exit loss in eq. (5)")
    personalization: float = Field(
        0.2, ge=0, le=1, description="lambda of eqs. (9)-(10): share of phi_k, h_k kept after a round"
    )


def exit_head(client_part: nn.Module, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Sequential:
    """The auxiliary classifier h at the cut: flatten + one linear layer (2304 -> 10 = 23,050 params
    for splitgp_cnn at cut 4, as in the paper). Built on the CPU; its init depends only on `seed`."""
    features = math.prod(output_shape(copy.deepcopy(client_part).cpu(), input_shape))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))


def initial_exit(blueprint: Blueprint) -> nn.Module:
    return exit_head(
        blueprint.initial("client_model"), blueprint.input_shape, blueprint.num_classes, blueprint.config.seed
    ).to(blueprint.device)


def mix(own: nn.Module, average: dict[str, torch.Tensor], keep: float) -> None:
    """own <- keep * own + (1 - keep) * average; keep = 1 and keep = 0 are exact."""
    mixture = ModelAverage()
    mixture.add(own.state_dict(), keep)
    mixture.add(average, 1 - keep)
    own.load_state_dict(mixture.result(own.state_dict()))


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row's softmax."""
    return -(F.softmax(logits, dim=1) * F.log_softmax(logits, dim=1)).sum(dim=1)


def to_server(client_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Eq. (11): a sample leaves the client exactly when its client entropy exceeds E_th."""
    return entropy(client_logits) > threshold


class SplitGPClient(ClientNode[SplitGPParams]):
    """Client k: phi_k and h_k, its own for the whole run, trained on F_k (eqs. 5-8)."""

    keeps = frozenset({"client_model", "aux_model"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._inferred: tuple[torch.Tensor, torch.Tensor] | None = None

    @verb()
    def begin_round(self, rnd: int) -> None:
        super().begin_round(rnd)
        self.optimizers.clear()  # a fresh optimizer every round

    @verb(up=KEYED, keys=(*SENT, "loss"))
    def forward(self, step: int) -> State:
        """phi_k on the next batch, and the client-exit loss l_C of h_k (kept for `backward`)."""
        x, y = self.next_batch()
        with self.blueprint.timed("client"):
            smashed = self.client_output(x)
            client_loss = self.blueprint.loss(self.model("aux_model")(smashed), y)
            defended, message = self.release(x, y, smashed, step)
            self.stash[step] = defended, client_loss, self.blueprint.defense.penalty(x, smashed)
        return {**message, "loss": client_loss.detach()}

    @verb(down="cut_grad")
    def backward(self, step: int, cut_grad: Any) -> None:
        """A step on gamma * l_C plus the server's (already (1 - gamma)-scaled) cut gradient; none
        if the server skipped its step (fp16: its backward pass overflowed)."""
        smashed, client_loss, penalty = self.stash.pop(step)
        cut_grad = self.receive(step, cut_grad)
        if cut_grad is None:
            return
        gamma = self.params.gamma
        with self.blueprint.timed("client"):
            self.steps(
                ("client_model", "aux_model"),
                lambda: self.backward_pass((gamma * client_loss, None), (smashed, cut_grad), (penalty, None)),
            )

    @verb(down="{0}_down")
    def mix(self, slot: str, average: State) -> None:
        """eqs. (9)-(10): keep lambda of the own model, take 1 - lambda of the average."""
        mix(self.model(slot), average, self.params.personalization)

    # --- inference (Algorithm 1, inference phase; `splitlab evaluate`) ---------------------
    @verb(down="evaluation", up="evaluation")
    def infer(self, x: torch.Tensor) -> torch.Tensor:
        """The client exit's logits h_k(phi_k(x)) on samples the client holds (handing them over is
        the simulation's doing, not traffic). The features stay here for `route`."""
        phi, h = self.model("client_model"), self.model("aux_model")
        with inference(phi, h):
            features = self.blueprint.logits(phi, x)
            with self.blueprint.autocast():
                logits = h(features)
        self._inferred = features, logits
        return logits

    @verb(up=KEYED, keys=("smashed", "evaluation"))
    def route(self, n: int, threshold: float) -> State:
        """The entropy gate (eq. 11) on the first n samples of the last `infer`: the features of those
        it sends to the server (`smashed`), and which ones they are (telemetry)."""
        if self._inferred is None:
            raise RuntimeError(f"client {self.id} routes samples before any inference")
        features, logits = self._inferred
        routed = to_server(logits[:n], threshold)
        return {"smashed": features[:n][routed], "evaluation": routed}


class SplitGPServer(TrainingServer[SplitGPParams]):
    @staticmethod
    def cut_gradient_weight(params: Any) -> float:
        """1 - gamma (eq. 5): with gamma = 1 the server's cut gradients are zero."""
        return 1 - params.gamma

    @verb()
    def infer(self, smashed: torch.Tensor) -> torch.Tensor:
        """theta's logits on the features clients routed to the server at inference."""
        theta = self.model("server_model")
        with inference(theta):
            return self.blueprint.logits(theta, smashed)


class SplitGP(Algorithm[SplitGPParams]):
    name = "splitgp"
    refused_tasks = {
        "language": "its client exit head is a linear classifier on the flattened cut activations, one class per "
        "sample, and its personalisation is by class skew; a language model's per-token next-token task has neither"
    }
    Client = SplitGPClient
    Server = SplitGPServer
    supports_fp16 = True
    trains_server_copies = True
    models = {**SPLIT_MODELS, "aux_model": initial_exit}
    averaged = ("client_model", "aux_model")
    not_from_average = (
        "its clients start each round from their own phi_k and h_k (mixed with the average after it, eqs. 9-10), "
        "so there is no client delta from the sync server's model to step on"
    )
    not_u_shaped = "its server part is the main model's last layers, trained on the labels the clients send"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        for client in ctx.clients:  # phi_0 and h_0 go to every client once, before the first round
            self.download(client.id, "client_model")
            self.download(client.id, "aux_model")

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.for_each_client(clients, self.local_training, self.fold)
        self.server.average_copies()
        self.average("client_model")
        self.average("aux_model")
        for client in clients:
            for slot in ("client_model", "aux_model"):
                self.unless_dropped(client.id, "mix", slot, self.sync.model_state(slot))

    def local_training(self, client: ClientInfo) -> None:
        self.server.copy_server(client.id)
        for step in range(self.ctx.local_steps(client)):  # one step on F_k (eqs. 6-8)
            self.split_step(client.id, step, server_slot=server_copy(client.id))

    def step_loss(self, sent: State, reply: State) -> torch.Tensor:
        """F_k of the batch (eq. 5): the client exit's loss and the server's, weighted by gamma."""
        gamma = self.params.gamma
        return gamma * sent["loss"] + (1 - gamma) * reply["loss"]

    def fold(self, client: ClientInfo, alpha: float) -> None:
        self.contribute(client.id, alpha, ("client_model", "aux_model"))
        self.fold_server_copy(client.id, alpha)

    def client_weights(self) -> dict[str, torch.Tensor]:
        """phi_k and h_k of every client, as `client.<k>.<name>` and `exit.<k>.<name>`."""
        return {
            f"{name}.{c.id}.{key}": t
            for name, slot in (("client", "client_model"), ("exit", "aux_model"))
            for c in self.ctx.clients
            for key, t in self.client(c.id).snapshot(slot).items()
        }
