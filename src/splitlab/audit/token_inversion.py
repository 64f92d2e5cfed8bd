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

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
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


class Observed(NamedTuple):
    """What a token attack on a finished run works from."""

    client: nn.Module  # the client part
    defense: Defense  # the run's defense, which the attacker applies to its auxiliary hidden states
    aux_tokens: torch.Tensor  # (N, T): the server's auxiliary text
    hidden: torch.Tensor  # (M, T, D): the hidden states the server received for the targets
    tokens: torch.Tensor  # (M, T): the targets' tokens
    vocabulary: int

    @classmethod
    def of(cls, target: Target) -> Observed:
        x, smashed = target.observed()
        vocabulary = target.experiment.blueprint.num_classes
        return cls(target.client, target.defense, target.aux_x.long(), smashed, x.long(), vocabulary)


def token_inversion(seen: Observed, epochs: int, seed: int, characters: str | None = None) -> dict[str, Any]:
    """Train the per-position decoder on the server's auxiliary text and reconstruct the target
    tokens from the hidden states the server received. With `characters` (token i is
    characters[i]) the result shows the first target sequences and their reconstructions."""
    client, defense, aux_tokens, target_hidden, target_tokens, vocabulary = seen
    logits = decoded_logits(client, defense, aux_tokens, target_hidden, vocabulary, epochs, seed)
    found = {"decoder": logits.argmax(-1)}
    return scored(found, aux_tokens, target_tokens, vocabulary, characters, aux_samples=len(aux_tokens))


def scored(
    found: dict[str, torch.Tensor],
    aux_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    vocabulary: int,
    characters: str | None,
    named: str | None = None,
    how: Mapping[str, Any] | None = None,
    **counts: int,
) -> dict[str, Any]:
    """The result of a token attack, the same for every one: the fraction of target tokens each of
    its attackers (`found`: name -> reconstructed tokens) recovered, the strongest of them or the
    floor (a failed attack never reads as privacy), the targets' counts, then `counts`; with
    `characters` (token i is characters[i]) the strongest's first reconstructions beside the true
    text. `named`: the result's name for the attacker where it beats the floor (default: its key);
    `how`: what the attack matched or used, after the scores."""
    most_frequent, floor = token_floor(aux_tokens, target_tokens, vocabulary)
    scores = {name: float((tokens == target_tokens).float().mean()) for name, tokens in found.items()}
    best = max(scores, key=lambda name: scores[name])
    beaten = scores[best] < floor
    result: dict[str, Any] = {
        "accuracy": max(scores[best], floor),
        "attacker": "most frequent token" if beaten else named or best,
        **scores,
        **(how or {}),
        "baseline": floor,
        "baseline_token": most_frequent,
        "samples": len(target_tokens),
        "positions": target_tokens.numel(),
        **counts,
    }
    if characters is not None:
        shown = torch.full_like(found[best], most_frequent) if beaten else found[best]
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
    figures = {"accuracy": TEXT_RECOVERED}
    why = "it reconstructs the tokens of a language run; use attack=inversion"

    def run(self, target: Target) -> dict[str, Any]:
        settings, characters = target.settings, target.experiment.data.vocabulary
        return token_inversion(Observed.of(target), settings.epochs, settings.seed, characters)

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        return token_rows(result, ("decoder", f"{result['decoder']:.2%}"))


def token_rows(result: dict[str, Any], *scores: tuple[str, str]) -> list[tuple[str, str]]:
    """A token attack's result as `splitlab attack` prints it: the accuracy, its attackers' `scores`,
    the floor, then the example reconstructions (true text, then recovered)."""
    return [
        (f"token accuracy ({result['attacker']})", f"{result['accuracy']:.2%}"),
        *scores,
        (f"floor: always token {result['baseline_token']}", f"{result['baseline']:.2%}"),
        *(
            row
            for example in result.get("examples", [])
            for row in (("original", repr(example["original"])), ("reconstructed", repr(example["reconstructed"])))
        ),
    ]
