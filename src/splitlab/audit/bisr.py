"""Bidirectional semi-white-box reconstruction (`bisr`): SplitLLM's attack on the hidden states at
the cut of a split language model (Chen et al., "Unveiling the Vulnerability of Private
Fine-Tuning in Split-Based Frameworks for Large Language Models: A Bidirectionally Enhanced
Attack", CCS'24).

Semi-white-box: the curious training server knows the model's weights at the start of the run
(the pretrained checkpoint the clients fine-tune, `model_dir=` or `init=`, or the seeded initial
model handed out), not what the client part became in training. Two halves, as in the paper:

(a) learning-based, forward: token_inversion's per-position decoder, trained on auxiliary text
    pushed through the *pretrained* client part (with the run's defense), decodes the hidden
    states received;
(b) optimisation: soft tokens (logits per position over the vocabulary, started from (a)'s),
    mixed through the pretrained embedding stage and run through the pretrained client blocks,
    optimised by Adam so that their output matches the hidden states received (BiSR(f): squared
    L2 relative to the received norm). On a U-shaped run the server also receives the gradient
    its output gets from the client's tail: the same soft tokens shifted by one are the
    next-token targets, whose gradient through the pretrained tail must point where the received
    one does (BiSR(b): cosine distance, since a batch's mean loss scales it). The two distances
    are summed and minimised together (the paper alternates them).

Scored as every token attack: the fraction of target tokens recovered, by (a) alone and after
(b), against the floor of the auxiliary text's most frequent token everywhere.
"""

from __future__ import annotations

import typing
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.embedding_inversion import token_embeddings
from splitlab.audit.gradient_matching import soft_loss
from splitlab.audit.label_leak import tail_gradients
from splitlab.audit.token_inversion import decoded_logits, scored, token_rows
from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import Defense

LEARNING_RATE = 0.1


class TailGradients(NamedTuple):
    """U-shaped, what BiSR(b) matches: the pretrained tail, the server's outputs at the second cut
    for the targets (M, T, D) and the gradients the client's tail sent back for them."""

    tail: nn.Module
    outputs: torch.Tensor
    gradients: torch.Tensor


def optimised_tokens(
    head: nn.Sequential, logits: torch.Tensor, observed: torch.Tensor, steps: int, tail: TailGradients | None = None
) -> torch.Tensor:
    """The tokens (M, T) of soft tokens started from `logits` (M, T, V) and optimised so that the
    pretrained client part `head` (its first stage the embedding) gives the hidden states received
    (M, T, D), and on a U-shaped run that their next-token gradient matches the tail's."""
    stages = list(head)
    blocks = nn.Sequential(*stages[1 : head.head_stages if isinstance(head, HeadAndTail) else len(stages)])
    count, length, vocabulary = logits.shape
    candidates = token_embeddings(head, vocabulary, length)
    observed = observed.float()
    scale = observed.pow(2).sum((1, 2)).clamp_min(1e-12)
    # positions 0..T-1 are the inputs, 1..T the next-token targets (the last one beyond the input)
    soft_logits = torch.cat([logits, logits.new_zeros(count, 1, vocabulary)], 1).requires_grad_()
    optimizer = torch.optim.Adam([soft_logits], lr=LEARNING_RATE)
    for _ in range(steps):
        soft = soft_logits.softmax(-1)
        hidden = blocks(torch.einsum("mtv,vtd->mtd", soft[:, :length], candidates))
        distance = ((hidden - observed) ** 2).sum((1, 2)) / scale
        if tail is not None:
            outputs = tail.outputs.detach().requires_grad_()
            loss = soft_loss(tail.tail(outputs), soft[:, 1:])
            (found,) = torch.autograd.grad(loss, outputs, create_graph=True)
            distance = distance + 1 - F.cosine_similarity(found.flatten(1), tail.gradients.flatten(1), dim=1)
        (soft_logits.grad,) = torch.autograd.grad(distance.sum(), soft_logits)
        optimizer.step()
    return soft_logits[:, :length].argmax(-1).detach()


def bisr(
    pretrained: nn.Sequential,
    defense: Defense,
    aux_tokens: torch.Tensor,
    target_hidden: torch.Tensor,
    target_tokens: torch.Tensor,
    vocabulary: int,
    epochs: int,
    steps: int,
    seed: int,
    tail: TailGradients | None = None,
    characters: str | None = None,
) -> dict[str, Any]:
    """(a) then (b) on the target hidden states (M, T, D) from the pretrained client part; the
    result as every token attack's, with (a)'s and (b)'s recovery."""
    logits = decoded_logits(pretrained, defense, aux_tokens, target_hidden, vocabulary, epochs, seed)
    optimised = optimised_tokens(pretrained, logits, target_hidden, steps, tail)
    found = {"learned": logits.argmax(-1), "optimised": optimised}
    how = {"gradients": tail is not None}
    return scored(
        found, aux_tokens, target_tokens, vocabulary, characters, how=how, aux_samples=len(aux_tokens), steps=steps
    )


class BiSR(Attack):
    name = "bisr"
    inputs = ("tokens",)
    figures = {"accuracy": TEXT_RECOVERED}
    why = "it reconstructs the tokens of a language run from its pretrained weights; use attack=inversion"
    weights = "pretrained"
    advised = False  # an optimisation through the client part: minutes per cut on a CPU

    def run(self, target: Target) -> dict[str, Any]:
        settings, experiment = target.settings, target.experiment
        x, smashed = target.observed()
        pretrained = typing.cast(nn.Sequential, target.pretrained()[0]).eval()
        tail = None
        if isinstance(pretrained, HeadAndTail):  # the server also receives the tail's gradients
            with torch.no_grad():
                outputs = torch.cat([target.server(z) for z in smashed.split(256)])
            if target.recorded:
                gradients = target.recorded[1]["tail_grad"].to(outputs.device)
            else:  # as the client's final tail would send them
                gradients = tail_gradients(
                    typing.cast(HeadAndTail, target.client),
                    target.server,
                    x,
                    target.y,
                    target.defense,
                    experiment.config.run.batch_size,
                    settings.seed,
                )
            tail = TailGradients(pretrained.tail_part(), outputs, gradients.float())
        return bisr(
            pretrained,
            target.defense,
            target.aux_x.long(),
            smashed,
            x.long(),
            experiment.blueprint.num_classes,
            settings.epochs,
            settings.steps,
            settings.seed,
            tail,
            experiment.data.vocabulary,
        )

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        matched = "hidden states and tail gradients" if result["gradients"] else "hidden states"
        return token_rows(
            result,
            ("(a) decoder on the pretrained client part", f"{result['learned']:.2%}"),
            (f"(b) optimised against the {matched} ({result['steps']} steps)", f"{result['optimised']:.2%}"),
        )
