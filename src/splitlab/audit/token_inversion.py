"""Token reconstruction from the hidden states at the cut of a language model (`token_inversion`).

The curious training server of a split language model receives, per sequence, the hidden states
(T, D) after the client's blocks. It reconstructs the input tokens with a learned inversion model,
the learning-based attack of the split-LLM literature (the embedding-inversion attack that
SplitLLM's BiSR starts from; He et al. 2019's decoder, for tokens): a per-position classifier
from a hidden state to the token at that position, trained on auxiliary text passed through a
copy of the client part. Assumed, as for image inversion (splitlab.audit.inversion): the server
holds auxiliary text from the clients' distribution (a seeded part of the test split, disjoint
from the targets), the client part's weights (the run's final global client part: a training
server that is, or colludes with, the sync server has them) and the defense configuration, which
it applies to its auxiliary hidden states, but not the clients' noise itself.

Scored by token accuracy (the fraction of target positions reconstructed exactly), against the
**floor** of an attacker who ignores the hidden states and answers the auxiliary text's most
frequent token everywhere; the reported accuracy is the stronger of the two, as for images.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import Attack, Target
from splitlab.audit.common import DECODER_WIDTH, fit
from splitlab.privacy.defenses import Defense, received

EXAMPLE_CHARACTERS = 64
EXAMPLES = 3  # example reconstructions in a result


def train_token_decoder(
    hidden: torch.Tensor, tokens: torch.Tensor, vocabulary: int, epochs: int, seed: int
) -> nn.Module:
    """An MLP from one position's hidden state (D) to its token's logits (V), fit by cross-entropy
    on the server's auxiliary (hidden state, token) pairs, every position alike."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        decoder = nn.Sequential(
            nn.LayerNorm(hidden.shape[1]),
            nn.Linear(hidden.shape[1], DECODER_WIDTH),
            nn.ReLU(),
            nn.Linear(DECODER_WIDTH, vocabulary),
        ).to(hidden.device)
        return fit(decoder, hidden, tokens, F.cross_entropy, epochs, 256)


def decoded_logits(
    client: nn.Module,
    defense: Defense,
    aux_tokens: torch.Tensor,
    target_hidden: torch.Tensor,
    vocabulary: int,
    epochs: int,
    seed: int,
) -> torch.Tensor:
    """The decoder's token logits (M, T, V) for the hidden states received (M, T, D), the decoder
    trained on the auxiliary text (N, T) through `client` with the run's defense (the attacker's draw)."""
    aux_hidden = received(client, aux_tokens, defense, seed + 1)
    decoder = train_token_decoder(aux_hidden.flatten(0, 1), aux_tokens.flatten(), vocabulary, epochs, seed)
    with torch.no_grad():
        return torch.cat([decoder(h) for h in target_hidden.split(256)])


def token_inversion(
    client: nn.Module,
    defense: Defense,
    aux_tokens: torch.Tensor,
    target_hidden: torch.Tensor,
    target_tokens: torch.Tensor,
    vocabulary: int,
    epochs: int,
    seed: int,
    characters: str | None = None,
) -> dict[str, Any]:
    """Train the per-position decoder on the server's auxiliary text (N, T) and reconstruct the
    target tokens (M, T) from the hidden states the server received (M, T, D). With `characters`
    (token i is characters[i]) the result shows the first target sequence and its reconstruction."""
    reconstructed = decoded_logits(client, defense, aux_tokens, target_hidden, vocabulary, epochs, seed).argmax(-1)
    most_frequent, floor = token_floor(aux_tokens, target_tokens, vocabulary)
    learned = float((reconstructed == target_tokens).float().mean())
    best = "decoder" if learned >= floor else "most frequent token"
    result: dict[str, Any] = {
        "accuracy": max(learned, floor),
        "attacker": best,  # the stronger of the two: a failed decoder never reads as privacy
        "decoder": learned,
        "baseline": floor,
        "baseline_token": most_frequent,
        "samples": len(target_tokens),
        "positions": target_tokens.numel(),
        "aux_samples": len(aux_tokens),
    }
    if characters is not None:
        shown = reconstructed if best == "decoder" else torch.full_like(reconstructed, most_frequent)
        result["examples"] = examples(target_tokens, shown, characters)
    return result


def token_floor(aux_tokens: torch.Tensor, target_tokens: torch.Tensor, vocabulary: int) -> tuple[int, float]:
    """The floor of every token attack: (the auxiliary text's most frequent token, the fraction of
    target positions an attacker who answers it everywhere, ignoring what it observed, gets right)."""
    most_frequent = int(torch.bincount(aux_tokens.flatten(), minlength=vocabulary).argmax())
    return most_frequent, float((target_tokens == most_frequent).float().mean())


def examples(tokens: torch.Tensor, reconstructed: torch.Tensor, characters: str) -> list[dict[str, str]]:
    """The first EXAMPLES target sequences as text beside their reconstructions (token i is characters[i])."""

    def text(row: torch.Tensor) -> str:
        return "".join(characters[t] for t in row[:EXAMPLE_CHARACTERS].tolist())

    return [{"original": text(t), "reconstructed": text(r)} for t, r in zip(tokens[:EXAMPLES], reconstructed)]


class TokenInversion(Attack):
    name = "token_inversion"
    inputs = ("tokens",)
    why = "it reconstructs the tokens of a language run; use attack=inversion"

    def run(self, target: Target) -> dict[str, Any]:
        settings, experiment = target.settings, target.experiment
        x, smashed = target.observed()
        return token_inversion(
            target.client,
            target.defense,
            target.aux_x,
            smashed,
            x.long(),
            experiment.blueprint.num_classes,
            settings.epochs,
            settings.seed,
            experiment.data.vocabulary,
        )

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            (f"token accuracy ({result['attacker']})", f"{result['accuracy']:.2%}"),
            ("decoder", f"{result['decoder']:.2%}"),
            (f"floor: always token {result['baseline_token']}", f"{result['baseline']:.2%}"),
            *example_rows(result),
        ]


def example_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """A token attack's example reconstructions as `splitlab attack` prints them: true text, then recovered."""
    return [
        row
        for example in result.get("examples", [])
        for row in (("original", repr(example["original"])), ("reconstructed", repr(example["reconstructed"])))
    ]
