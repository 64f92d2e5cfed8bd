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
Bayes decision on its output. The client's stages after the embedding are inverted (each a
residual map, by fixed-point iteration) back to the noised embedding output u, and each position
answers the token maximising prior(v) x exp(-E ||u - E[v, t]||): d_chi's density, with the
prior the auxiliary text's unigram frequencies, where nearest-token search assumes every token
equally likely.
"""

from __future__ import annotations

import math
import typing
from typing import Any

import torch
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.token_inversion import Observed, scored, token_rows
from splitlab.models import HeadAndTail
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
    how: dict[str, Any] = {}
    if defense.dchi is not None:  # the mechanism known: its density on the embedding output, with the tokens' prior
        inverted = embedding_outputs(typing.cast(nn.Sequential, client), target_hidden)
        how["inverted"] = inverted is not target_hidden
        found["prior"] = map_with_prior(
            distances(inverted, candidates), unigram_prior(aux_tokens, vocabulary), defense.dchi
        )
    return scored(found, aux_tokens, target_tokens, vocabulary, characters, how=how, aux_samples=len(aux_tokens))


def unigram_prior(tokens: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """(V,): the tokens' frequencies in `tokens` (the attacker's auxiliary text), add-one smoothed."""
    counts = torch.bincount(tokens.flatten(), minlength=vocabulary).double() + 1
    return counts / counts.sum()


#: fixed-point iterations per stage when the client's stages after the embedding are inverted
INVERSION_STEPS = 30
#: the inversion is used where it reproduces the hidden states to this relative error
INVERSION_TOLERANCE = 1e-4


def embedding_outputs(client: nn.Sequential, hidden: torch.Tensor) -> torch.Tensor:
    """(M, T, D): the embedding stage's outputs (with their noise) that the client's later stages
    took to `hidden`, each stage inverted as a residual map u -> u + g(u) by the fixed point
    u = h - g(u) (i-ResNet's inversion, Behrmann et al. 2019), last stage first; `hidden` itself
    where that does not reproduce it (the iteration need not converge: g is not always contractive)."""
    head = list(client)[: client.head_stages] if isinstance(client, HeadAndTail) else list(client)
    stages = head[1:]  # U-shaped: the head's, before the cut the server receives
    found = hidden
    with torch.no_grad():
        for stage in reversed(stages):
            wanted, found = found, found.clone()
            for _ in range(INVERSION_STEPS):
                found = wanted - (stage(found) - found)
        again = nn.Sequential(*stages)(found) if stages else found
    error = float((again - hidden).norm() / hidden.norm().clamp_min(1e-12))
    return found if math.isfinite(error) and error < INVERSION_TOLERANCE else hidden


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
