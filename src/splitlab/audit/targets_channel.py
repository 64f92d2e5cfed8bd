"""The next-token targets a language split sends the server (`targets_channel`): no attack, a channel.

In a vanilla split of a language model (every algorithm but the U-shaped ones, `cut=A,B`) the
client sends the training server, with each sequence's hidden states, its next-token targets:
the sequence shifted by one token. The server reads the text off them: position t's token is the
target of position t - 1, for every position but the first (and those whose target is ignored),
where it answers the floor's token. A U-shaped split keeps the targets on the client: the server
holds none, and the channel gives the floor. Under `label_dp:E` the server sees the targets after
randomised response (the attacker's own draw of it). Scored as every token attack
(splitlab.audit.token_inversion.scored), so that the strongest figure counts this channel too.
"""

from __future__ import annotations

from typing import Any

import torch

from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target
from splitlab.audit.token_inversion import scored, token_floor, token_rows
from splitlab.models import HeadAndTail
from splitlab.targets import IGNORED


def text_from_targets(targets: torch.Tensor, filler: int) -> torch.Tensor:
    """(M, T) tokens read off next-token targets (M, T): position t is the target of t - 1;
    position 0, and a position whose target was ignored, get `filler`."""
    text = torch.full_like(targets, filler)
    text[:, 1:] = targets[:, :-1]
    return text.masked_fill(text == IGNORED, filler)


class TargetsChannel(Attack):
    name = "targets_channel"
    inputs = ("tokens",)
    why = "it reads the text off a language run's next-token targets; use attack=label_leak"
    figures = {"accuracy": TEXT_RECOVERED}

    def run(self, target: Target) -> dict[str, Any]:
        x, labels = target.x.long(), target.y
        if target.recorded:
            x, labels = target.recorded[1]["inputs"].long(), target.recorded[1]["labels"]
        vocabulary = target.experiment.blueprint.num_classes
        aux = target.aux_x.long()
        filler, _ = token_floor(aux, x, vocabulary)
        at_server = not isinstance(target.client, HeadAndTail)
        if at_server and target.defense.label_dp is not None:  # what the server receives: randomised response
            generator = torch.Generator(device=labels.device).manual_seed(target.settings.seed)
            kept = labels != IGNORED
            noised = target.defense.private_labels(labels.clamp(min=0), vocabulary, generator)
            labels = torch.where(kept, noised, labels)
        text = text_from_targets(labels, filler) if at_server else torch.full_like(x, filler)
        characters = target.experiment.data.vocabulary
        how = {"targets_at_server": at_server}
        return scored({"read_off_targets": text}, aux, x, vocabulary, characters, how=how, aux_samples=len(aux))

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        said = "read off the targets" if result["targets_at_server"] else "none: U-shaped, the targets stay"
        return token_rows(result, ("next-token targets at the server", said))
