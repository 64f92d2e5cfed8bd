"""Gradient matching on a client's model update (`gradient_matching`): DLG (Zhu et al., NeurIPS'19)
and TAG (Deng et al., EMNLP'21) for the client part of a split language model, as SplitLLM
(CCS'24) plays them on the adapters that cross under LoRA.

The sync server averages the client parts the clients upload (SplitFed's client models, their
LoRA adapters): one local SGD step on a batch uploads theta - lr * g, so from the weights it sent
the sync server reads the gradient g of the client part's trainable parameters. Colluding with
the training server (whose part it then also knows), it looks for the text that gives that
gradient: soft tokens, a softmax over the vocabulary at each position, whose embedding is the mix
of the client's embedding-stage outputs, optimised by Adam so that the gradient they give the
client's trainable parameters (the blocks after the embedding, or their adapters) matches the
observed one (TAG's distance: squared L2 plus L1). The next-token targets are the soft tokens
shifted by one (a language model's targets are its text), so the attacker uses no label it
would not have; the last position's target is a soft token of its own. Each target sequence is
one update (a batch of one, DLG's setting); the observed update is simulated from the run's
final model. Scored by the fraction of tokens whose most likely soft token is the true one,
against the floor of every token attack (the auxiliary text's most frequent token everywhere).
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.embedding_inversion import token_embeddings
from splitlab.audit.token_inversion import scored, token_rows
from splitlab.data.datasets import IGNORED

SEQUENCES = 8  # target sequences attacked (one optimisation each)
LEARNING_RATE = 0.1
L1_WEIGHT = 0.01  # TAG's weight of the L1 distance


def soft_loss(logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token logits (T, V) against target distributions (T, V)."""
    return -(soft_targets * F.log_softmax(logits, -1)).sum(-1).mean()


def update_gradient(
    after_embedding: nn.Module, server: nn.Module, embedded: torch.Tensor, loss: typing.Callable, params: list
) -> list[torch.Tensor]:
    """The gradient of the client's trainable parameters for one sequence's embedding (T, D)."""
    logits = server(after_embedding(embedded[None]))[0]
    return list(torch.autograd.grad(loss(logits), params, create_graph=True))


def match_sequence(
    client: nn.Sequential,
    server: nn.Module,
    candidates: torch.Tensor,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    seed: int,
) -> torch.Tensor:
    """The tokens (T,) the optimised soft tokens give for the update of one sequence."""
    after_embedding = nn.Sequential(*list(client)[1:])
    params = [p for p in after_embedding.parameters() if p.requires_grad]
    length, vocabulary = tokens.shape[0], candidates.shape[0]
    positions = torch.arange(length, device=tokens.device)
    kept = labels != IGNORED
    observed = [
        g.detach()
        for g in update_gradient(
            after_embedding,
            server,
            candidates[tokens, positions],
            lambda logits: F.cross_entropy(logits[kept], labels[kept]),
            params,
        )
    ]
    generator = torch.Generator(tokens.device).manual_seed(seed)
    dummy = torch.randn(length + 1, vocabulary, generator=generator, device=tokens.device).requires_grad_()
    optimizer = torch.optim.Adam([dummy], lr=LEARNING_RATE)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        soft = dummy.softmax(-1)  # positions 0..T-1 are the inputs, 1..T the targets
        embedded = torch.einsum("tv,vtd->td", soft[:length], candidates)
        found = update_gradient(
            after_embedding, server, embedded, functools.partial(soft_loss, soft_targets=soft[1:]), params
        )
        distance = sum(((f - o) ** 2).sum() + L1_WEIGHT * (f - o).abs().sum() for f, o in zip(found, observed))
        typing.cast(torch.Tensor, distance).backward()
        optimizer.step()
    return dummy[:length].argmax(-1).detach()


class GradientMatching(Attack):
    name = "gradient_matching"
    inputs = ("tokens",)
    figures = {"accuracy": TEXT_RECOVERED}
    why = "it rebuilds the tokens of a language run from a client's update; for images use attack=inversion"
    replays_record = False  # it needs the update of a sequence, which a record does not hold
    advised = False  # an optimisation per sequence: minutes per cut on a CPU

    def run(self, target: Target) -> dict[str, Any]:
        settings, experiment = target.settings, target.experiment
        client, server = typing.cast(nn.Sequential, target.client), target.server
        tokens, labels = target.x[:SEQUENCES].long(), target.y[:SEQUENCES].long()
        vocabulary = experiment.blueprint.num_classes
        candidates = token_embeddings(client, vocabulary, tokens.shape[1])
        client.eval(), server.eval()  # no dropout: the update of a sequence is one function of it
        found = torch.stack(
            [
                match_sequence(client, server, candidates, x, y, settings.steps, settings.seed + i)
                for i, (x, y) in enumerate(zip(tokens, labels))
            ]
        )
        return scored(
            {"matched": found},
            target.aux_x.long(),
            tokens,
            vocabulary,
            experiment.data.vocabulary,
            named="gradient matching",
            steps=settings.steps,
        )

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        return token_rows(
            result,
            (f"gradient matching ({result['samples']} sequences, {result['steps']} steps)", f"{result['matched']:.2%}"),
        )
