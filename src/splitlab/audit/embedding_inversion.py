"""Embedding inversion (`embedding_inversion`): nearest-token search on the hidden states at the cut
of a language model, the embedding inversion attack (EIA) of SplitLLM (Chen et al., CCS'24) and of
Song & Raghunathan's "Information leakage in embedding models" (CCS'20).

The server knows the embedding table: its pretrained weights are public (or it holds the client
part's weights, as a sync server does). For every vocabulary token v and position t it computes
the embedding stage's output E[v, t] (token embedding plus position embedding, for a GPT) and
answers, at each position, the token whose E[v, t] is nearest (L2) to the hidden state it
observed. Right after the embedding that is exact; after a block, the residual stream still
carries the embedding, and a linear map fitted by least squares on auxiliary text (hidden state
-> embedding of the true token) first brings the hidden states back to embedding space. The
result is the better of the raw search and the mapped one, against the floor every token attack
reports (token_inversion's: the auxiliary text's most frequent token everywhere).

Under `dchi:E` the attacker knows the mechanism (Kerckhoffs): a third answer (`prior`) is the
Bayes decision on its output, the token maximising prior(v) x exp(-s ||h - E[v, t]||) with the
prior the auxiliary text's unigram frequencies and s calibrated on the auxiliary text (E times a
few multiples), where nearest-token search assumes every token equally likely.
"""

from __future__ import annotations

import typing
from typing import Any

import torch
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.token_inversion import Observed, scored, token_rows
from splitlab.privacy.defenses import received


def token_embeddings(client: nn.Sequential, vocabulary: int, length: int) -> torch.Tensor:
    """(V, T, D): the client's embedding stage (its first) on every token at every position."""
    embed = list(client)[0]
    device = next(client.parameters()).device
    every_token = torch.arange(vocabulary, device=device)[:, None].expand(vocabulary, length)
    with torch.no_grad():
        return embed(every_token)


def distances(hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(M, T, V): at each position, the L2 distance of `hidden` (M, T, D) to every token's
    candidate embedding (V, T, D)."""
    # per position t: (M, D) against (V, D), exact distances (not through a matrix product)
    per_position = torch.cdist(
        hidden.transpose(0, 1), candidates.transpose(0, 1), compute_mode="donot_use_mm_for_euclid_dist"
    )
    return per_position.transpose(0, 1)  # (T, M, V) -> (M, T, V)


def nearest_tokens(hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """(M, T): at each position, the token whose candidate embedding (V, T, D) is nearest to `hidden` (M, T, D)."""
    return distances(hidden, candidates).argmin(-1)


def map_with_prior(distance: torch.Tensor, prior: torch.Tensor, scale: float) -> torch.Tensor:
    """(M, T): the most probable token under d_chi's density exp(-scale x distance) (M, T, V) and the
    tokens' `prior` (V, probabilities): argmax over v of log prior(v) - scale x distance(v)."""
    return (prior.log() - scale * distance).argmax(-1)


def embedding_map(hidden: torch.Tensor, tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The least-squares affine map (D + 1, D) from hidden states (N, T, D) to the candidate embedding
    of their true tokens, on the attacker's auxiliary text."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    wanted = candidates[tokens, positions].flatten(0, 1)
    inputs = torch.cat([hidden.flatten(0, 1), torch.ones_like(hidden[..., :1]).flatten(0, 1)], 1)
    return torch.linalg.lstsq(inputs.double(), wanted.double()).solution.to(hidden.dtype)


def embedding_inversion(seen: Observed, seed: int, characters: str | None = None) -> dict[str, Any]:
    """Nearest-token search on the target hidden states, raw and through the map fitted on the
    auxiliary text; scored by the fraction of target tokens recovered."""
    client, defense, aux_tokens, target_hidden, target_tokens, vocabulary = seen
    candidates = token_embeddings(typing.cast(nn.Sequential, client), vocabulary, target_tokens.shape[1])
    raw = nearest_tokens(target_hidden, candidates)
    aux_hidden = received(client, aux_tokens, defense, seed + 1)
    mapping = embedding_map(aux_hidden, aux_tokens, candidates)
    mapped_hidden = torch.cat([target_hidden, torch.ones_like(target_hidden[..., :1])], -1) @ mapping
    mapped = nearest_tokens(mapped_hidden, candidates)
    found = {"nearest": raw, "mapped": mapped}
    how = {}
    if defense.dchi is not None:  # the mechanism known: its density, with the tokens' prior
        aux_mapped = torch.cat([aux_hidden, torch.ones_like(aux_hidden[..., :1])], -1) @ mapping
        found["prior"], how["prior_scale"] = mechanism_map(
            distances(aux_mapped, candidates),
            aux_tokens,
            distances(mapped_hidden, candidates),
            defense.dchi,
            vocabulary,
        )
    return scored(found, aux_tokens, target_tokens, vocabulary, characters, how=how, aux_samples=len(aux_tokens))


#: the scales of d_chi's density tried, as multiples of its epsilon (the fitted map changes distances)
PRIOR_SCALES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)


def mechanism_map(
    aux_distance: torch.Tensor, aux_tokens: torch.Tensor, distance: torch.Tensor, epsilon: float, vocabulary: int
) -> tuple[torch.Tensor, float]:
    """MAP decoding of d_chi's output: the tokens' prior is the auxiliary text's unigram frequencies
    (add-one smoothed) and the likelihood d_chi's density exp(-s x distance), s epsilon times the
    PRIOR_SCALES multiple that decodes the auxiliary text best (the fitted map shrinks or stretches
    the noise, so the attacker calibrates s on its own text); (the targets' tokens, s)."""
    prior = (torch.bincount(aux_tokens.flatten(), minlength=vocabulary) + 1).to(distance.dtype)
    prior = prior / prior.sum()

    def aux_accuracy(scale: float) -> float:
        return float((map_with_prior(aux_distance, prior, scale) == aux_tokens).float().mean())

    scale = max((epsilon * m for m in PRIOR_SCALES), key=aux_accuracy)
    return map_with_prior(distance, prior, scale), scale


class EmbeddingInversion(Attack):
    name = "embedding_inversion"
    inputs = ("tokens",)
    figures = {"accuracy": TEXT_RECOVERED}
    why = "it searches the vocabulary's embeddings for the tokens of a language run; use attack=inversion"

    def run(self, target: Target) -> dict[str, Any]:
        return embedding_inversion(Observed.of(target), target.settings.seed, target.experiment.data.vocabulary)

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        prior = [("MAP: d_chi's density and the unigram prior", f"{result['prior']:.2%}")] if "prior" in result else []
        return token_rows(
            result,
            ("nearest embedding", f"{result['nearest']:.2%}"),
            ("nearest after the fitted map", f"{result['mapped']:.2%}"),
            *prior,
        )
