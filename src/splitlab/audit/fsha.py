"""FSHA (Pasquini, Ateniese & Bernaschi 2021, "Unleashing the Tiger: Inference Attacks on Split
Learning") and SplitGuard (Erdogan, Küpçü & Cicek 2022, "SplitGuard: Detecting and Mitigating
Training-Hijacking Attacks in Split Learning").

FSHA is an active attack: a malicious training server does not train the server part. On public
auxiliary data it trains a pilot encoder f~ (here: the client part's architecture, its own weights)
with a decoder f~^-1 as an autoencoder, and a discriminator D (Wasserstein loss with gradient
penalty, as in the paper) that tells f~'s features from the client's. The cut gradient it sends
the client is that of D's verdict on the client's smashed data, so the client part f is trained
to make its features look like f~'s; then f~^-1 decodes the client's smashed data into its
inputs. The server still receives the labels and may train a task head on the side (here: the
run's server part on the smashed data it receives, whose gradients it keeps), so the task accuracy
the client would get from the hijacked model is measured, not assumed.

SplitGuard is the client's detector: after `warmup` steps it sends, every `guard` steps, a fake
batch (its samples with uniformly random other labels), keeps the cut gradient the server returns
and does not apply it. With F the fake batches' gradients and R the regular ones' (split at random
into R1 and R2), d(A, B) the difference of the mean gradient norms and theta(A, B) the angle
between the mean gradients,

    S = (theta(F, R) d(F, R) - theta(R1, R2) d(R1, R2)) / (d(F, R) + d(R1, R2)),
    SG = sigmoid(alpha S)^beta

An honest server's gradients answer the labels, so fake batches' gradients differ from regular
ones (SG near 1); a hijacking server's ignore them (SG near sigmoid(0)^beta).

Both are simulated in this module's own loop: one client trains its part on its private samples
(the run's config: model, cut, optimizer, learning rate, batch size, defense at the cut) against
either server. The run's roles implement honest servers only, and the loop has to play the
client's side of SplitGuard too; no algorithm of the run is replayed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import Attack, Target
from splitlab.audit.common import image_scores, write_picture
from splitlab.audit.unsplit import surrogate_of
from splitlab.errors import UserError
from splitlab.privacy import defenses
from splitlab.privacy.defenses import Defense, decode

WIDTH = 512  # hidden width of the decoder and the discriminator
GRADIENT_PENALTY = 10.0  # WGAN-GP's weight (Gulrajani et al. 2017), as FSHA uses it
LR = 1e-3  # Adam's, for the attacker's three networks
SG_ALPHA, SG_BETA = 5.0, 2.0  # SplitGuard's squashing


@dataclass(frozen=True)
class Simulation:
    """What both simulated trainings share: the client's side and the data."""

    client: nn.Module  # the client part at its initial weights (copied per simulation)
    server: nn.Module  # the server part at its initial weights (the task head)
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]  # the run's optimizer
    defense: Defense
    private_x: torch.Tensor  # the client's training samples
    private_y: torch.Tensor
    aux_x: torch.Tensor  # the attacker's public data, disjoint from the client's
    test_x: torch.Tensor  # for the task accuracy, disjoint from both
    test_y: torch.Tensor
    num_classes: int
    batch_size: int


def splitguard_score(fake: list[torch.Tensor], regular: list[torch.Tensor], seed: int) -> float:
    """SplitGuard's SG score of the fake and regular batches' flattened cut gradients."""
    order = np.random.default_rng(seed).permutation(len(regular))
    half = len(regular) // 2
    groups = [torch.stack(g).double() for g in (fake, regular, [regular[i] for i in order[:half]])]
    groups.append(torch.stack([regular[i] for i in order[half:]]).double())
    fakes, all_regular, first, second = groups

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return abs(float(a.norm(dim=1).mean() - b.norm(dim=1).mean()))

    def angle(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.arccos(F.cosine_similarity(a.mean(0), b.mean(0), dim=0).clamp(-1, 1)))

    d_fake, d_regular = distance(fakes, all_regular), distance(first, second)
    total = d_fake + d_regular
    if total == 0:
        return float(torch.sigmoid(torch.zeros(())) ** SG_BETA)
    score = (angle(fakes, all_regular) * d_fake - angle(first, second) * d_regular) / total
    return float(torch.sigmoid(torch.tensor(SG_ALPHA * score)) ** SG_BETA)


class Attacker:
    """The malicious server's networks: pilot encoder, its decoder, the discriminator."""

    def __init__(self, architecture: nn.Module, input_shape: tuple[int, ...], smashed_size: int, seed: int) -> None:
        self.pilot = surrogate_of(architecture, seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            inputs = int(np.prod(input_shape))
            self.decoder = nn.Sequential(
                nn.Flatten(),
                nn.Linear(smashed_size, WIDTH),
                nn.ReLU(),
                nn.Linear(WIDTH, inputs),
                nn.Unflatten(1, input_shape),
            )
            self.discriminator = nn.Sequential(
                nn.Flatten(), nn.Linear(smashed_size, WIDTH), nn.LeakyReLU(0.2), nn.Linear(WIDTH, 1)
            )
        device = next(architecture.parameters()).device
        self.decoder.to(device)
        self.discriminator.to(device)
        autoencoder = [*self.pilot.parameters(), *self.decoder.parameters()]
        self.autoencoder_optimizer = torch.optim.Adam(autoencoder, lr=LR, foreach=True)
        self.discriminator_optimizer = torch.optim.Adam(self.discriminator.parameters(), lr=LR, foreach=True)

    def cut_gradient(self, smashed: torch.Tensor, aux: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One attacker step on a batch of the client's smashed data and one of its own; returns the
        gradient it sends the client: that of the discriminator's verdict on the client's features."""
        self.autoencoder_optimizer.zero_grad(set_to_none=True)
        features = self.pilot(aux)
        F.mse_loss(self.decoder(features), aux).backward()
        self.autoencoder_optimizer.step()

        real, fake = features.detach(), smashed.detach()
        n = min(len(real), len(fake))
        mix = torch.rand((n,) + (1,) * (real.dim() - 1), generator=generator, device=real.device)
        between = (mix * real[:n] + (1 - mix) * fake[:n]).requires_grad_()
        (slope,) = torch.autograd.grad(self.discriminator(between).sum(), between, create_graph=True)
        penalty = ((slope.flatten(1).norm(dim=1) - 1) ** 2).mean()
        self.discriminator_optimizer.zero_grad(set_to_none=True)
        critic = self.discriminator(fake).mean() - self.discriminator(real).mean()
        (critic + GRADIENT_PENALTY * penalty).backward()
        self.discriminator_optimizer.step()

        received = smashed.detach().requires_grad_()
        (grad,) = torch.autograd.grad(-self.discriminator(received).mean(), received)
        return grad

    def reconstruct(self, smashed: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.decoder(smashed)


def simulate(
    setup: Simulation, malicious: bool, steps: int, checkpoints: int, warmup: int, guard: int, seed: int
) -> dict[str, Any]:
    """Train the client part `steps` steps against an honest or a malicious (FSHA) server, the
    client running SplitGuard. Malicious: the decoder's SSIM/PSNR on the client's first 64
    private samples at `checkpoints` evenly spaced steps, against the mean image of the aux data."""
    generator = torch.Generator(setup.private_x.device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    client, head = copy.deepcopy(setup.client).train(), copy.deepcopy(setup.server).train()
    client_optimizer, head_optimizer = setup.make_optimizer(client), setup.make_optimizer(head)
    smashed_size = int(np.prod(_smashed_shape(client, setup.private_x)))
    attacker = Attacker(setup.client, tuple(setup.private_x.shape[1:]), smashed_size, seed + 3) if malicious else None
    targets = setup.private_x[:64]
    data_range = float(targets.max() - targets.min())
    floor = image_scores(setup.aux_x.mean(0, keepdim=True).expand_as(targets), targets, data_range)
    batch = min(setup.batch_size, len(setup.private_y), len(setup.aux_x))
    fake_grads: list[torch.Tensor] = []
    regular_grads: list[torch.Tensor] = []
    by_step: dict[int, dict[str, float]] = {}
    report_at = {round(steps * (i + 1) / checkpoints) for i in range(checkpoints)}
    for step in range(1, steps + 1):
        idx = torch.as_tensor(rng.choice(len(setup.private_y), batch, replace=False))
        x, y = setup.private_x[idx], setup.private_y[idx]
        fake = step > warmup and (step - warmup) % guard == 0
        if fake:  # SplitGuard: the same samples, every label replaced by another class at random
            y = (
                y + torch.randint(1, setup.num_classes, y.shape, generator=generator, device=y.device)
            ) % setup.num_classes
        smashed = client(x)
        defended = setup.defense.protect(smashed, generator)
        received = decode(setup.defense.encode(defended)).detach().requires_grad_()
        task_loss = F.cross_entropy(head(received), y)
        head_optimizer.zero_grad(set_to_none=True)
        task_loss.backward()  # the head learns in both cases; the honest server's cut gradient comes with it
        head_optimizer.step()
        if attacker is None:
            assert received.grad is not None
            grad = received.grad
        else:
            aux = setup.aux_x[torch.as_tensor(rng.choice(len(setup.aux_x), batch, replace=False))]
            grad = attacker.cut_gradient(received, aux, generator)
        grad = decode(setup.defense.send_gradient(grad, generator, y))
        if fake:  # SplitGuard's client keeps the fake batch's gradient and does not apply it
            fake_grads.append(grad.flatten().float())
        else:
            if step > warmup:
                regular_grads.append(grad.flatten().float())
            client_optimizer.zero_grad(set_to_none=True)
            defenses.backward((defended, grad), (setup.defense.penalty(x, smashed), None))
            client_optimizer.step()
        if step in report_at:
            client.eval()
            head.eval()
            row = {"task_accuracy": _accuracy(client, head, setup)}
            if attacker is not None:
                with torch.no_grad():
                    row.update(image_scores(attacker.reconstruct(client(targets)), targets, data_range))
            by_step[step] = row
            client.train()
            head.train()
    last = by_step[steps]
    result: dict[str, Any] = {**last, "by_step": by_step}
    if attacker is not None:
        result["baseline"] = floor
        with torch.no_grad():
            result["reconstructed"] = attacker.reconstruct(client.eval()(targets[:16])).cpu()
    if fake_grads and len(regular_grads) >= 2:
        result["splitguard"] = splitguard_score(fake_grads, regular_grads, seed)
    return result


def _smashed_shape(client: nn.Module, x: torch.Tensor) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(client(x[:1]).shape[1:])


def _accuracy(client: nn.Module, head: nn.Module, setup: Simulation) -> float:
    """Test accuracy of the client part and the server's task head, the defense applied at the cut."""
    with torch.no_grad():
        generator = torch.Generator(setup.test_x.device).manual_seed(0)
        correct = sum(
            int((head(decode(setup.defense.encode(setup.defense.protect(client(x), generator)))).argmax(1) == y).sum())
            for x, y in zip(setup.test_x.split(256), setup.test_y.split(256))
        )
    return correct / len(setup.test_y)


class FSHA(Attack):
    name = "fsha"
    inputs = ("images",)
    why = "FSHA reconstructs images"
    replays_record = False  # an active attack during training: simulated afresh on the run's setting

    def run(self, target: Target) -> dict[str, Any]:
        from splitlab.roles import client_part, server_part

        settings, experiment = target.settings, target.experiment
        warmup = settings.steps // 5  # SplitGuard starts once training has settled a little
        if (settings.steps - warmup) // settings.guard < 1:
            raise UserError(
                f"guard={settings.guard} leaves SplitGuard no fake batch and regular ones to compare in "
                f"steps={settings.steps} (the first {warmup} are warm-up); allowed: 2 to {(settings.steps - warmup)}"
            )
        assert experiment.roles is not None  # load_run builds every role in this process
        node = experiment.roles.clients[settings.client]
        blueprint = experiment.blueprint
        setup = Simulation(
            client=client_part(blueprint),
            server=server_part(blueprint),
            make_optimizer=blueprint.optimizer,
            defense=target.defense,
            private_x=node.inputs(node.x),
            private_y=node.y,
            aux_x=target.aux_x,
            test_x=target.x,
            test_y=target.y,
            num_classes=blueprint.num_classes,
            batch_size=experiment.config.run.batch_size,
        )
        result: dict[str, Any] = {
            "targets": f"client {settings.client}'s training samples, {settings.steps} simulated steps"
        }
        result["malicious"] = simulate(setup, True, settings.steps, 5, warmup, settings.guard, settings.seed)
        result["honest"] = simulate(setup, False, settings.steps, 5, warmup, settings.guard, settings.seed)
        write_picture(
            target.path / "attack_fsha.png", setup.private_x[:16].cpu(), result["malicious"].pop("reconstructed")
        )
        return result

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        malicious, honest = result["malicious"], result["honest"]
        rows = [
            (
                f"  step {step}: SSIM / PSNR, task accuracy",
                f"{row['ssim']:.3f} / {row['psnr']:.2f} dB, {row['task_accuracy']:.2%}",
            )
            for step, row in malicious["by_step"].items()
        ]
        return [
            *rows,
            ("floor: mean image", f"{malicious['baseline']['ssim']:.3f} / {malicious['baseline']['psnr']:.2f} dB"),
            (
                "task accuracy: honest / FSHA server",
                f"{honest['task_accuracy']:.2%} / {malicious['task_accuracy']:.2%}",
            ),
            ("SplitGuard score: honest / FSHA server", f"{honest['splitguard']:.3f} / {malicious['splitguard']:.3f}"),
        ]
