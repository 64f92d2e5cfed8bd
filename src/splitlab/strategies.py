"""The federated half's strategies: what a client adds to its part's local objective (FedProx,
SCAFFOLD's correction) and how the sync server steps from the clients' average (FedOpt).

The roles hold the state and call these at their one place each: a client's optimizer step
(`ClientNode.before_step`, through `LocalTerms`), the sync server's averaging verb
(`SyncServer.average`, through `ServerOptimizer`). With `prox_mu=0`, `scaffold=false` and
`server_opt=avg server_opt_lr=1` neither object exists, and a run is today's bit for bit.

- FedProx (Li et al., MLSys 2020, eq. 2): client k minimises h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2,
  w^t the weights it started the round from; the term's gradient mu (w - w^t) joins every step's.
- SCAFFOLD (Karimireddy et al., ICML 2020, Algorithm 1): a client steps on g_i(y_i) - c_i + c and, after
  its K steps of learning rate eta_l, takes "(ii) c_i - c + 1/(K eta_l) (x - y_i)" as its new control
  variate c_i+; it sends Delta c_i = c_i+ - c_i, and the server sets c <- c + 1/N sum_{i in S} Delta c_i.
- FedOpt (Reddi et al., ICLR 2021, Algorithm 2): with Delta_t the weighted mean of the client deltas,
  "m_t = beta_1 m_{t-1} + (1 - beta_1) Delta_t", v_t by FedAdagrad (v_{t-1} + Delta_t^2), FedYogi
  (v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2)) or FedAdam (beta_2 v_{t-1} + (1 - beta_2) Delta_t^2),
  and "x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)", from m_{-1} = 0 and v_{-1} = tau^2; FedAvgM (Hsu et
  al. 2019) keeps momentum on the pseudo-gradient x_t - mean; `avg` steps x_t + eta Delta_t.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

State = dict[str, Any]


def trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s parameters that train, by name: what an anchor and a control variate cover."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def zeros_like(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t, dtype=torch.float32) for name, t in tensors.items()}


class LocalTerms:
    """A client's additions to its averaged slots' local objective, for the round it is in: the
    weights each started from (taken at its first step, before the optimizer moves it), its steps
    and their learning rate, and under SCAFFOLD its own control variates c_i (kept across rounds,
    checkpointed) and the server's c of this round."""

    def __init__(self, mu: float, scaffold: bool) -> None:
        self.mu, self.scaffold = mu, scaffold
        self.controls: dict[str, dict[str, torch.Tensor]] = {}  # c_i, by slot
        self.server_controls: dict[str, dict[str, torch.Tensor]] = {}  # c, the last received, by slot
        self.anchors: dict[str, dict[str, torch.Tensor]] = {}  # w^t = x, by slot
        self.steps: dict[str, int] = {}
        self.lrs: dict[str, float] = {}

    def new_round(self) -> None:
        """A round begins (or a client moved to another Ray actor before its steps): no anchor, no
        step yet. The server's c stays until the next one arrives, which comes with the model."""
        self.anchors, self.steps, self.lrs = {}, {}, {}

    def before_step(self, slot: str, module: nn.Module, lr: float) -> None:
        """Add the terms' gradients to `slot`'s (those of the parameters this step trains)."""
        params = trainable(module)
        if slot not in self.anchors:
            self.anchors[slot] = {name: p.detach().clone() for name, p in params.items()}
        self.steps[slot] = self.steps.get(slot, 0) + 1
        self.lrs[slot] = lr
        stepped = {name: p.grad for name, p in params.items() if p.grad is not None}
        grads = list(stepped.values())
        if self.mu:
            drift = torch._foreach_sub([params[n].detach() for n in stepped], [self.anchors[slot][n] for n in stepped])
            torch._foreach_add_(grads, list(drift), alpha=self.mu)
        if self.scaffold and slot in self.server_controls:
            server, own = self.server_controls[slot], self.own_control(slot, params)
            correction = torch._foreach_sub([server[n] for n in stepped], [own[n] for n in stepped])
            torch._foreach_add_(grads, list(correction))

    def own_control(self, slot: str, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """c_i of `slot` (zeros before the client's first round under SCAFFOLD)."""
        if slot not in self.controls:
            self.controls[slot] = zeros_like(params)
        return self.controls[slot]

    def control_update(self, slot: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Option II: c_i+ = c_i - c + (x - y_i) / (K eta_l); c_i becomes c_i+, Delta c_i is returned.
        A client that took no step keeps its c_i (Delta c_i = 0)."""
        params = trainable(module)
        own = self.own_control(slot, params)
        steps = self.steps.get(slot, 0)
        if steps == 0 or slot not in self.server_controls:
            return zeros_like(own)
        server, anchor, scale = self.server_controls[slot], self.anchors[slot], 1.0 / (steps * self.lrs[slot])
        updated = {n: own[n] - server[n] + (anchor[n] - p.detach()) * scale for n, p in params.items()}
        delta = {n: updated[n] - own[n] for n in params}
        self.controls[slot] = updated
        return delta


class ServerOptimizer:
    """FedOpt at the sync server: the next global model from the current one and the clients'
    weighted mean, with state (m, v) per slot that a checkpoint keeps."""

    def __init__(self, name: str, lr: float, momentum: float, betas: tuple[float, float], tau: float) -> None:
        self.name, self.lr, self.momentum, self.betas, self.tau = name, lr, momentum, betas, tau
        self.state: dict[str, State] = {}

    def step(
        self, slot: str, current: Mapping[str, torch.Tensor], mean: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """x_{t+1} for every floating tensor of `slot`; other tensors (BatchNorm's counters) take the mean."""
        state = self.state.setdefault(slot, {"m": {}, "v": {}})
        out = dict(mean)
        for name, x in current.items():
            if x.is_floating_point():
                out[name] = self._step(state, name, x.float(), mean[name].float()).to(x.dtype)
        return out

    def _step(self, state: State, name: str, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        delta = mean - x
        if self.name == "avg":
            return x + self.lr * delta
        m = state["m"].get(name, torch.zeros_like(x))
        if self.name == "avgm":  # momentum on the pseudo-gradient x - mean
            m = self.momentum * m - delta
            state["m"][name] = m
            return x - self.lr * m
        beta1, beta2 = self.betas
        m = beta1 * m + (1 - beta1) * delta
        v = state["v"].get(name, torch.full_like(x, self.tau**2))
        square = delta * delta
        if self.name == "adagrad":
            v = v + square
        elif self.name == "yogi":
            v = v - (1 - beta2) * square * torch.sign(v - square)
        else:  # adam
            v = beta2 * v + (1 - beta2) * square
        state["m"][name], state["v"][name] = m, v
        return x + self.lr * m / (v.sqrt() + self.tau)

    def state_dict(self) -> State:
        return self.state

    def load_state_dict(self, state: State) -> None:
        self.state = {slot: {"m": dict(s["m"]), "v": dict(s["v"])} for slot, s in state.items()}
