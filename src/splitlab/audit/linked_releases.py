"""Every release of a sequence at once (`linked_releases`): the noise of a randomised defense
averaged out over the rounds.

A client sends the hidden states of each of its sequences once a round (every local epoch), each
time with fresh noise (`dchi:E`, `noise:S`). A server that keeps what it received links the
releases of one sequence across the recorded rounds and decodes them together: per round, the
token decoder of `token_inversion` trained on the auxiliary text through the client part that
round started with (a server that is, or colludes with, the sync server holds it) gives each
position's log-probabilities; a sequence of the attacked round is linked to the sequence of
another round most likely to show the same text (the likelihood ratio of one text against two,
from the two releases' decoded probabilities and the auxiliary text's unigram prior), where that
one's best match is it too (mutual; the server links on what it received, never on the true
text); the log-probabilities of the linked releases are summed (a product of the per-release
posteriors, as for independent noise draws) and each position answers the most probable token.
The same links sum the distances of each release to every token's embedding (that round's
embedding stage; the client's later stages inverted back to the embedding output, as
`embedding_inversion` does under d_chi): under d_chi's density exp(-E ||z||) the most likely
token of independent releases is the one with the least summed distance (`linked_nearest`), or
with the tokens' unigram prior, the one maximising log prior - E x the summed distance
(`linked_prior`, under `dchi:E`).
`releases` reports the mean releases decoded per target sequence, `links_right` (scored with the
recorded inputs, known to the experimenter only) the fraction of links that joined the same text.
It is the composition any DP accounting counts (a per-release epsilon grows with the releases:
the summary's `releases_per_token`), made into an attack.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.embedding_inversion import (
    distances,
    embedding_outputs,
    map_with_prior,
    token_embeddings,
    unigram_prior,
)
from splitlab.audit.records import as_produced, load_round
from splitlab.audit.token_inversion import decoded_logits, scored, token_rows
from splitlab.errors import UserError
from splitlab.models import load_shared


def link_scores(mine: torch.Tensor, theirs: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """(M, N): how likely each of `mine`'s releases (log-probabilities (M, T, V)) shows the same
    text as each of `theirs` (N, T, V): the log-likelihood ratio of one text against two
    independent ones, sum over positions of log sum over v of p(v | mine) p(v | theirs) / prior(v)."""
    same = torch.einsum("mtv,ntv->tmn", mine.exp() / prior, theirs.exp())
    return same.clamp_min(torch.finfo(same.dtype).tiny).log().sum(0)


def mutual_links(scores: torch.Tensor) -> torch.Tensor:
    """(M,): for each row of `scores` (M, N), the column scoring highest where that column's best
    row is it too; -1 if not mutual."""
    best, back = scores.argmax(1), scores.argmax(0)
    mutual = back[best] == torch.arange(len(scores), device=scores.device)
    return torch.where(mutual, best, torch.full_like(best, -1))


def release_links(log_probs: list[torch.Tensor], attacked: int, prior: torch.Tensor) -> torch.Tensor:
    """(R, M): for each of the attacked round's M sequences, its linked release in each round (its
    own index in the attacked round; -1 where none), from each round's decoded log-probabilities
    (M_r, T, V) and the tokens' `prior` (V)."""
    mine = log_probs[attacked]
    return torch.stack(
        [
            torch.arange(len(mine), device=mine.device)
            if r == attacked
            else mutual_links(link_scores(mine, theirs, prior))
            for r, theirs in enumerate(log_probs)
        ]
    )


def summed(per_round: list[torch.Tensor], links: torch.Tensor) -> torch.Tensor:
    """(M, ...): per attacked sequence, the sum of its linked releases' scores (each round's (M_r, ...))."""
    first = per_round[0]
    total = torch.zeros((links.shape[1], *first.shape[1:]), dtype=first.dtype, device=first.device)
    for scores, found in zip(per_round, links):
        linked = found >= 0
        total[linked] += scores[found[linked]]
    return total


class LinkedReleases(Attack):
    name = "linked_releases"
    inputs = ("tokens",)
    why = "it decodes the token hidden states of a language run; use attack=inversion"
    figures = {"accuracy": TEXT_RECOVERED}
    advised = False  # it needs the rounds record=N kept; a probe attacks its final model

    def run(self, target: Target) -> dict[str, Any]:
        if target.recorded is None:
            raise UserError(
                f"attack=linked_releases decodes the releases of the recorded rounds; {str(target.path)!r} recorded "
                f"none (run it with record=N)"
            )
        settings, vocabulary = target.settings, target.experiment.blueprint.num_classes
        aux = target.aux_x.long()
        rounds = sorted(target.recorded_rounds)
        log_probs, distance, inputs = [], [], []
        for rnd in rounds:
            tensors, weights = load_round(target.recorded_rounds[rnd], target.shapes, vocabulary)
            tensors, state = as_produced(tensors, weights, settings.client)
            client = target.client
            if rnd != target.recorded[0] and state is not None:
                client = copy.deepcopy(target.client)
                load_shared(client, state)
            hidden = tensors["smashed"].to(aux.device)
            logits = decoded_logits(client, target.defense, aux, hidden, vocabulary, settings.epochs, settings.seed)
            log_probs.append(F.log_softmax(logits, -1))
            candidates = token_embeddings(typing.cast(nn.Sequential, client), vocabulary, hidden.shape[1])
            distance.append(distances(embedding_outputs(typing.cast(nn.Sequential, client), hidden), candidates))
            inputs.append(tensors["inputs"].long().to(aux.device))
        attacked = rounds.index(target.recorded[0])
        prior = unigram_prior(aux, vocabulary)
        links = release_links(log_probs, attacked, prior.float())
        tokens = inputs[attacked]
        right = [
            bool((inputs[r][j] == tokens[i]).all())
            for r, found in enumerate(links)
            if r != attacked
            for i, j in enumerate(found.tolist())
            if j >= 0
        ]
        found_tokens = {
            "one_release": log_probs[attacked].argmax(-1),
            "linked": summed(log_probs, links).argmax(-1),
            "linked_nearest": summed(distance, links).argmin(-1),
        }
        if target.defense.dchi is not None:  # d_chi's density over the linked releases, with the prior
            found_tokens["linked_prior"] = map_with_prior(summed(distance, links), prior, target.defense.dchi)
        how = {
            "releases": float((links >= 0).sum(0).float().mean()),
            "links_right": sum(right) / len(right) if right else 0.0,
            "rounds": rounds,
        }
        characters = target.experiment.data.vocabulary
        return scored(found_tokens, aux, tokens, vocabulary, characters, how=how, aux_samples=len(aux))

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        return token_rows(
            result,
            ("decoder, the attacked round's release alone", f"{result['one_release']:.2%}"),
            (
                f"decoder, linked releases ({result['releases']:.2f} a sequence, rounds {result['rounds']})",
                f"{result['linked']:.2%}",
            ),
            ("nearest embedding, distances summed over the linked releases", f"{result['linked_nearest']:.2%}"),
            *(
                [("MAP: d_chi's density over the linked releases, unigram prior", f"{result['linked_prior']:.2%}")]
                if "linked_prior" in result
                else []
            ),
            ("links joining the same text", f"{result['links_right']:.1%}"),
        )
