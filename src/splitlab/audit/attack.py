"""The attack registry: one module per attack, each a subclass of `Attack` declaring what it
needs, so that `splitlab attack` looks the attack up, checks the run against the declarations
(a refusal says what the attack needs and what the run has) and hands it a `Target` built once
for all (splitlab.audit.run). A new attack is one module here, imported in `ATTACK_MODULES`, or a
subclass of `Attack` in a module of your own that `plugins=` imports (docs/extending.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from splitlab.errors import UserError
from splitlab.plugins import named_subclasses
from splitlab.privacy.defenses import received

if TYPE_CHECKING:
    from splitlab.assembly import Experiment
    from splitlab.audit.settings import AttackSettings
    from splitlab.config import ResolvedConfig
    from splitlab.privacy.defenses import Defense

#: the built-in attacks, in the order `splitlab attack` lists them
ATTACK_MODULES = (
    "inversion",
    "label_leak",
    "unsplit",
    "fsha",
    "model_completion",
    "token_inversion",
    "embedding_inversion",
    "targets_channel",
    "linked_releases",
    "gradient_matching",
    "bisr",
)

#: the kind of figure the token attacks report (`Attack.figures`): the fraction of the text recovered
TEXT_RECOVERED = "text recovered"


@dataclass
class Target:
    """What an attack on a (horizontal) finished run starts from: the final split model, the run's
    defense, the targets (a recorded round's inputs, or held-out test samples through the final
    model), the attacker's auxiliary test samples, and the run itself for what only some need."""

    path: Path
    settings: AttackSettings
    experiment: Experiment
    client: nn.Module  # the client part that made the recorded round (else the final one); U-shaped: head and tail
    server: nn.Module
    defense: Defense
    x: torch.Tensor  # the targets' inputs and labels
    y: torch.Tensor
    recorded: tuple[int, dict[str, torch.Tensor]] | None  # (round, its checked tensors) or None
    recorded_rounds: dict[int, Path]  # every recorded round's file (label_leak scores each)
    shapes: dict[str, tuple[int, ...]]  # of a record's tensors, per sample
    order: np.ndarray  # the test split, shuffled by the attack's seed: targets first, then the pool
    held_out: int
    aux_x: torch.Tensor  # the attacker's auxiliary samples, disjoint from the targets
    gradient: str  # what the server infers labels from: "cut_grad", or U-shaped "tail_grad"
    source: str  # what the targets are, for the result
    client_weights: str = "the run's final client part"  # which weights `client` holds, for the result

    def observed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The targets' inputs and what the server received for them: the recorded round's, or the
        final client part's output through the run's defenses (the attacker's own noise draw)."""
        if self.recorded:
            inputs, smashed = (self.recorded[1][name].to(self.x.device) for name in ("inputs", "smashed"))
            return inputs, smashed
        return self.x, received(self.client, self.x, self.defense, self.settings.seed)

    def pretrained(self) -> tuple[nn.Module, nn.Module]:
        """(client part, server part) with the weights the run started from: the checkpoint it was
        started from (`init=`, `model_dir=`) or the seeded initial model the server handed out."""
        return self.experiment.blueprint.new_split()


@dataclass
class VerticalTarget:
    """What an attack on a finished vertical run starts from: the final model (every party's
    bottom, the top), the plan of who holds which columns, the targets (a recorded round, or
    held-out test samples), the attacker's auxiliary samples and the passive parties."""

    path: Path
    settings: AttackSettings
    config: ResolvedConfig
    plan: Any  # splitlab.algorithms.vertical_sl's FeaturePlan: parties, column groups, labels_at
    model: Any  # splitlab.algorithms.vertical_sl's VerticalModel: bottoms, top, shapes
    defense: Defense
    x: torch.Tensor
    y: torch.Tensor
    aux_x: torch.Tensor
    recorded: tuple[int, dict[str, torch.Tensor]] | None
    passive: list[int]  # the parties without the labels
    source: str  # what the targets are, for the result


class Attack:
    """An attack on a finished run. Its declarations say which runs it applies to; `run` (and
    `run_vertical` for attacks played per party of a vertical run) returns the scores."""

    name: ClassVar[str]
    #: the inputs it attacks, among "images", "table rows" and "tokens"
    inputs: ClassVar[tuple[str, ...]]
    #: why it needs them, said when a run has other inputs (with the attack to use there, if any)
    why: ClassVar[str]
    #: what it does to a vertical run's parties ('' if it is not played on vertical runs)
    vertical: ClassVar[str] = ""
    #: it replays a recorded round when the run has one; False: it is simulated afresh (fsha)
    replays_record: ClassVar[bool] = True
    #: it needs auxiliary samples; False: a vertical run's targets may take the whole test split
    aux: ClassVar[bool] = True
    #: the client part's weights it assumes the server knows: "final" (the trained ones, which a server
    #: that is or colludes with the sync server holds: those a recorded round started with, where the
    #: record kept them, else the run's final ones) or "pretrained" (only those the run started from)
    weights: ClassVar[str] = "final"
    #: `splitlab advise` plays it on every probe; False: too slow for a probe (run it with `splitlab attack`)
    advised: ClassVar[bool] = True
    #: its result's headline figures, key -> kind (higher is more leaked; a dotted key reads a nested
    #: figure): `splitlab attack` reports beside them the strongest figure of each kind over every attack
    #: run on the same targets
    figures: ClassVar[dict[str, str]] = {}

    def run(self, target: Target) -> dict[str, Any]:
        raise NotImplementedError

    def run_vertical(self, target: VerticalTarget) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        """The result as `splitlab attack` prints it: (what, figure) rows."""
        raise NotImplementedError


def attacks() -> dict[str, type[Attack]]:
    """Name -> attack class for every subclass of `Attack` that sets its own `name`: the built-in
    ones in their listed order (each module is named after its attack), then those plugins define
    (`plugins=`), in the order they were defined (splitlab.plugins.named_subclasses)."""
    for module in ATTACK_MODULES:
        importlib.import_module(f"splitlab.audit.{module}")
    found = named_subclasses(Attack, "attack")
    builtin = {name: found[name] for name in ATTACK_MODULES}
    return {**builtin, **{name: cls for name, cls in found.items() if name not in builtin}}


def attack_named(name: str) -> type[Attack]:
    """The attack `attack=` names, built-in or a plugin's; one line listing them otherwise."""
    found = attacks()
    if name not in found:
        quoted = [repr(known) for known in found]
        raise UserError(f"invalid value {name!r} for attack: Input should be {', '.join(quoted[:-1])} or {quoted[-1]}")
    return found[name]


def offered_vertical() -> str:
    """The attacks played on vertical runs, from their declarations."""
    offered = [f"{cls.name} ({cls.vertical})" for cls in attacks().values() if cls.vertical]
    return "offered: " + " and ".join(offered)


def check_vertical(name: str) -> type[Attack]:
    attack = attacks()[name]
    if not attack.vertical:
        raise UserError(f"attack={name} is not offered for a vertical run; {offered_vertical()}")
    return attack


def check_inputs(attack: type[Attack], inputs: str, task: str, path: Path) -> None:
    """Refuse, in one line, an attack on a run whose inputs it does not attack."""
    if inputs not in attack.inputs:
        raise UserError(
            f"attack={attack.name} does not apply to {str(path)!r}, a {task} run: {attack.why} "
            f"(it needs {' or '.join(attack.inputs)}; this run has {inputs})"
        )


def inputs_of(task: str, x: torch.Tensor) -> str:
    """What a run's inputs are, in the words of the attacks' `inputs`."""
    if task == "language":
        return "tokens"
    if x.dim() == 4:
        return "images"
    return "table rows" if x.dim() == 2 else f"inputs of shape {tuple(x.shape[1:])}"
