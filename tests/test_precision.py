"""precision=fp16: autocast in float16, one dynamic loss scale per role that trains, the cut
gradient crossing scaled with its scale (splitlab.loss_scale, docs/performance.md)."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    assert_same_run,
    global_weights,
    held_plugin,
    max_abs_difference,
    quick,
    sigkilled_after_first_checkpoint,
    straight_and_resumed,
    train,
)
from splitlab import loss_scale
from splitlab.algorithms.fsl_sage import cut_gradient
from splitlab.build import check
from splitlab.cli import main
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.loss_scale import LossScale, scaled, unscaled

FP16 = quick(precision="fp16")
#: quick()'s clients hold 100 samples each: steps of 32, 32, 32 and 4 per round
STEPS_PER_ROUND = 3 * 4


def every_weight(experiment) -> dict[str, torch.Tensor]:
    """The global model's weights, if the algorithm has one, and every role's own (personal
    client parts too), by role, slot and name."""
    roles = [role for role in (experiment.roles.server, *experiment.roles.clients) if role is not None]
    states = experiment.algorithm.global_model() or []
    return {
        **{f"global.{name}": t for state in states for name, t in state.items()},
        **{
            f"{i}.{slot}.{name}": t
            for i, role in enumerate(roles)
            for slot, model in role.models.items()
            for name, t in model.state_dict().items()
        },
    }


def trained_alike_on_both_transports(rounds: int, /, **config):
    """Trained in process and through the serialized transport: every weight, byte count and loss
    scale alike, bit for bit. Returns the run in process."""
    direct, serialized = train(rounds, **config), train(rounds, **dict(config, transport="serialized"))
    assert max_abs_difference(every_weight(direct), every_weight(serialized)) == 0
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()
    for a, b in zip([direct.roles.server, *direct.roles.clients], [serialized.roles.server, *serialized.roles.clients]):
        assert torch.equal(a.loss_scale.state(), b.loss_scale.state())
    return direct


SAGE = dict(FP16, algorithm="fsl_sage", align_interval=1)


@pytest.mark.parametrize("algorithm", ["sfl_v2", "cse_fsl", "fedavg", "fsl_sage", "sglr", "cycle_sfl", "splitgp"])
def test_fp16_trains_as_fp32_does_with_float32_weights(algorithm):
    config = dict(FP16, algorithm=algorithm, **({"align_interval": 1} if algorithm == "fsl_sage" else {}))
    before = evaluate(train(0, **config))["loss"]
    experiment = train(2, **config)
    after, fp32 = evaluate(experiment)["loss"], evaluate(train(2, **dict(config, precision="fp32")))["loss"]
    assert after < before - 0.1 and after == pytest.approx(fp32, abs=0.02)
    assert {t.dtype for t in every_weight(experiment).values()} == {torch.float32}
    roles = [experiment.roles.server, *experiment.roles.clients]
    assert {role.loss_scale.scale for role in roles if role is not None} == {loss_scale.INITIAL_SCALE}  # no overflow


def test_fp16_hidden_states_and_cut_gradients_cross_as_2_bytes_and_each_gradient_its_4_byte_scale():
    """The MLP's cut holds 200 values per sample: 300 samples a round up and down at 2 bytes,
    and beside each of a round's 12 cut gradients its float32 scale."""
    experiment = train(2, **dict(FP16, algorithm="sfl_v2"))
    ledger = experiment.ledger.state_dict()
    assert ledger["smashed"] == 2 * 300 * 200 * 2
    assert ledger["cut_grad"] == 2 * (300 * 200 * 2 + STEPS_PER_ROUND * 4)
    assert ledger["labels"] == 2 * 300 * 8


def test_an_overflow_skips_the_step_backs_off_and_never_crosses(monkeypatch):
    """Scales of 2^40 overflow float16: the server skips such steps (sending zeros with scale 0, so
    that its client skips too) and halves its scale each time, until steps pass; in process and
    through the serialized transport alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", 2.0**40)
    config = dict(FP16, algorithm="sfl_v2")
    direct = trained_alike_on_both_transports(2, **config)
    server = direct.roles.server
    optimizer = server.optimizers["server_model"]
    taken = int(next(iter(optimizer.state.values()))["step"])
    skipped = 2 * STEPS_PER_ROUND - taken
    assert 0 < taken < 2 * STEPS_PER_ROUND
    assert server.loss_scale.scale == 2.0**40 / 2**skipped
    assert all(torch.isfinite(t).all() for t in global_weights(direct).values())
    # only one server step passed (at 2^17); its client then overflowed at its own 2^40 and halved
    # it; the other clients only received skipped steps, which leave their scales as they were
    assert taken == 1 and sorted(node.loss_scale.scale for node in direct.roles.clients) == [2.0**39, 2.0**40, 2.0**40]


def test_fsl_sage_in_fp16_scales_each_sides_steps_and_aligns_in_float32(monkeypatch):
    """FSL-SAGE sends no cut gradient: at 2^40 the server's steps overflow and skip, and so do the
    clients' (their estimate of the cut gradient is taken of the scaled aux loss), each halving its
    own scale; the alignment (its own Adam, outside a role step) runs in float32 and its aux models
    come down finite. In process and serialized alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", 2.0**40)
    direct = trained_alike_on_both_transports(2, **SAGE)
    roles = [direct.roles.server, *direct.roles.clients]
    # q=5 of 4 steps a round: each client sends once a round, 6 server steps in all, each skipped,
    # as are the 8 steps of each client: each side halves its own scale on each of its own
    assert [role.loss_scale.scale for role in roles] == [2.0**34, *[2.0**32] * 3]
    assert not direct.roles.server.optimizers["server_model"].state
    for node in direct.roles.clients:
        assert {t.dtype for t in node.model("aux_model").state_dict().values()} == {torch.float32}
        assert all(torch.isfinite(t).all() for t in node.model("aux_model").state_dict().values())
    assert all(torch.isfinite(t).all() for t in global_weights(direct).values())


def test_fsl_sage_clients_estimate_the_cut_gradient_under_their_scale():
    """The estimate is taken of the aux loss times the client's scale and divided by it: in float32,
    equal to the unscaled estimate where nothing flushes, and it keeps values that float16 flushes."""
    client = train(0, **SAGE).roles.clients[0]
    aux, loss = client.model("aux_model"), client.blueprint.loss
    smashed, labels = torch.randn(4, 200), torch.tensor([0, 1, 2, 3])
    plain = cut_gradient(loss, aux, smashed, labels)
    assert torch.equal(cut_gradient(loss, aux, smashed, labels, scale=2.0**16), plain)
    with torch.autocast("cpu", dtype=torch.float16):
        flushed = cut_gradient(lambda z, y: loss(z, y) * 2.0**-24, aux, smashed.half(), labels)
        kept = cut_gradient(lambda z, y: loss(z, y) * 2.0**-24, aux, smashed.half(), labels, scale=2.0**16)
    assert kept.dtype == torch.float32 and (flushed == 0).float().mean() > (kept == 0).float().mean()


@pytest.mark.parametrize(
    ("algorithm", "server_steps"),
    [("sglr", 8), ("cycle_psl", 6), ("cycle_sglr", 6), ("cycle_sfl", 6), ("cycle_ssl", 6)],
)
def test_cut_gradients_averaged_or_from_the_frozen_server_cross_scaled_and_checked(
    monkeypatch, algorithm, server_steps
):
    """SGLR's averaged cut gradients and CycleSL's ServerGrad are computed after the server's step
    (of its loss times its scale, averaged in float32) and checked as they cross: at 2^40 every
    server step overflows (SGLR: 4 lockstep steps a round; CycleSL: 96 pooled samples in batches of
    32 a round), the server halves its scale once a step, zeros cross with scale 0 and the clients
    skip every step, their scales unchanged. In process and serialized alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", 2.0**40)
    averaging = {"average_fraction": 1.0} if "sglr" in algorithm else {}
    config = dict(FP16, algorithm=algorithm, optimizer="adam", **averaging)
    direct = trained_alike_on_both_transports(2, **config)
    roles = [direct.roles.server, *direct.roles.clients]
    assert [role.loss_scale.scale for role in roles] == [2.0 ** (40 - server_steps), *[2.0**40] * 3]
    assert not any(optimizer.state for role in roles for optimizer in role.optimizers.values())  # Adam: no step
    assert all(torch.isfinite(t).all() for t in every_weight(direct).values())


def test_splitgp_clients_skip_with_the_server_and_step_their_exit_under_their_own_scale(monkeypatch):
    """SplitGP's client step back-propagates gamma x its exit's loss and the server's cut gradient
    through `backward_pass` under its own scale: at 2^40 the server's steps (on its per-client
    copies, one scale) overflow, zeros cross with scale 0 and the clients skip; in process and
    serialized alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", 2.0**40)
    config = dict(FP16, algorithm="splitgp", cut=1, partition="shards:2", optimizer="adam")
    direct = trained_alike_on_both_transports(2, **config)
    roles = [direct.roles.server, *direct.roles.clients]
    # 24 server steps (3 clients x 4 a round, 2 rounds): 22 overflow, halving to 2^18, where the last
    # two pass, both the third client's: it overflows at its own 2^40 and 2^39; the others only
    # received skipped steps, which leave their scales as they were
    assert [role.loss_scale.scale for role in roles] == [2.0**18, 2.0**40, 2.0**40, 2.0**38]
    assert all(torch.isfinite(t).all() for t in every_weight(direct).values())


@pytest.mark.parametrize("initial", [2.0**16, 2.0**40], ids=["fitting", "overflowing"])
@pytest.mark.parametrize(
    ("algorithm", "tail_passes"),
    [("sglr", 8), ("cycle_psl", 8), ("cycle_sglr", 8), ("cycle_sfl", 8), ("cycle_ssl", 4)],
)
def test_u_shaped_sglr_and_cyclesl_in_fp16_skip_the_server_step_when_a_tail_overflowed(
    monkeypatch, initial, algorithm, tail_passes
):
    """cut=1,2: each client's tail sends its gradient at the second cut scaled with its scale; the
    server unscales them, seeds its step with its own scale and sends the (averaged) cut gradients
    scaled. At 2^40 every tail pass overflows (SGLR: 4 lockstep steps a round; CycleSL: 3 pooled
    batches and ServerGrad, cycle_ssl's one batch and ServerGrad per client cycle), each client
    halving its scale each time; the server skips every step (its scale unchanged) and zeros
    cross with scale 0, so no one steps. In process and serialized alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", initial)
    averaging = {"average_fraction": 1.0} if "sglr" in algorithm else {}
    config = dict(FP16, algorithm=algorithm, cut="1,2", optimizer="adam", **averaging)
    before = evaluate(train(0, **config))["loss"]
    direct = trained_alike_on_both_transports(2, **config)
    scales = [role.loss_scale.scale for role in (direct.roles.server, *direct.roles.clients)]
    if initial == 2.0**16:
        assert evaluate(direct)["loss"] < before - 0.1 and set(scales) == {2.0**16}
    else:
        assert scales == [2.0**40, *[2.0 ** (40 - tail_passes)] * 3]
        roles = (direct.roles.server, *direct.roles.clients)
        assert not any(optimizer.state for role in roles for optimizer in role.optimizers.values())


@pytest.mark.parametrize("initial", [2.0**16, 2.0**40], ids=["fitting", "overflowing"])
def test_u_shaped_fp16_sends_the_second_cuts_gradient_scaled_and_transports_agree(monkeypatch, initial):
    """cut=1,2: the client's tail scales its loss; the gradient at the second cut goes up scaled,
    with the client's scale (an overflow there: zeros and scale 0, and the server skips as well);
    the server's scaled cut gradient comes down. In process and serialized alike, bit for bit."""
    monkeypatch.setattr(loss_scale, "INITIAL_SCALE", initial)
    config = dict(FP16, algorithm="sfl_v2", cut="1,2")
    before = evaluate(train(0, **config))["loss"]
    direct = trained_alike_on_both_transports(2, **config)
    ledger = direct.ledger.state_dict()
    assert "labels" not in ledger
    assert ledger["server_output"] == 2 * 300 * 200 * 2  # the server's output at the second cut, fp16
    assert ledger["tail_grad"] == ledger["cut_grad"] == 2 * (300 * 200 * 2 + STEPS_PER_ROUND * 4)
    scales = [role.loss_scale.scale for role in (direct.roles.server, *direct.roles.clients)]
    if initial == 2.0**16:
        assert evaluate(direct)["loss"] < before - 0.1 and set(scales) == {2.0**16}
    else:  # every tail overflows (its client halves, 8 steps each); the server skips every step unscaled
        assert scales == [2.0**40, *[2.0**32] * 3] and "server_model" not in direct.roles.server.optimizers


def scales(experiment) -> list[list[float]]:
    """Every role's (scale, finite steps)."""
    roles = [experiment.roles.server, *experiment.roles.clients]
    return [role.loss_scale.state().tolist() for role in roles if role is not None]


FP16_ALGORITHMS = {
    "sfl_v2": {},
    "sfl_v1": {},
    "sl": {},
    "psl": {},
    "fedavg": {},
    "centralized": {},
    "cse_fsl": {},
    "fsl_sage": {"align_interval": 1},
    "sglr": {"average_fraction": 1.0},
    "cycle_sfl": {},
    "splitgp": {"cut": 1, "partition": "shards:2"},
}


@pytest.mark.parametrize("algorithm", sorted(FP16_ALGORITHMS))
def test_fp16_resumes_with_every_roles_loss_scale_and_step_count(monkeypatch, algorithm):
    """Scales that double after every 2 finite steps (and halve on the overflows that follow) move
    on every role; a run whose every role is checkpointed after round 1 and restored into fresh
    roles ends round 2 bit for bit as the straight one: weights, scales and their finite-step
    counts (clients that keep no slot, as sfl_v2's, have a scale of their own to keep)."""
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)
    config = dict(FP16, algorithm=algorithm, **FP16_ALGORITHMS[algorithm])
    straight, resumed = straight_and_resumed(2, **config)
    assert any(scale != loss_scale.INITIAL_SCALE for scale, _ in scales(straight))  # 4+ steps a round: they moved
    assert scales(straight) == scales(resumed)
    assert max_abs_difference(every_weight(straight), every_weight(resumed)) == 0


def test_fp16_sfl_v2_killed_after_round_1_and_resumed_ends_as_the_straight_run(monkeypatch, tmp_path):
    """A `splitlab run` SIGKILLed once round 1's checkpoint is written: it holds each client's scale
    (moving: doubled after every 2 finite steps), so resume=true ends with the straight run's
    metrics and weights, bit for bit."""
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)  # here; the plugin sets it in the killed process
    held, hold = held_plugin(tmp_path, "sfl_v2")
    with (tmp_path / f"{held['plugins']}.py").open("a") as plugin:
        plugin.write("\nfrom splitlab import loss_scale\nloss_scale.GROWTH_INTERVAL = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = [f"{k}={v}" for k, v in {**FP16, **held, "rounds": 3, "checkpoint_every": 0}.items()]
    killed = tmp_path / "killed"
    sigkilled_after_first_checkpoint(tmp_path, args, killed)
    hold.unlink()
    assert main(["run", "--no-progress", *args, f"out={killed}", "resume=true"]) == 0
    assert main(["run", "--no-progress", *args, f"out={tmp_path / 'straight'}"]) == 0
    assert_same_run(tmp_path / "straight", killed)


def test_the_scale_halves_on_an_overflow_and_doubles_after_an_interval_of_finite_steps(monkeypatch):
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)
    scale = LossScale()
    grads = [torch.full((3,), 4.0)]
    assert scale.unscale(grads) and grads[0].tolist() == [4 / 2**16] * 3
    assert scale.unscale([torch.ones(2)]) and scale.scale == 2.0**17 and scale.used == 2.0**16
    assert not scale.unscale([torch.ones(2)], [torch.tensor([float("inf")], dtype=torch.float16)])
    assert scale.scale == 2.0**16 and scale.used == 0 and scale.finite_steps == 0
    loss, grad = scale.seed(torch.tensor(0.5), None)
    assert loss.item() == 2.0**15 and grad is None


def test_a_scaled_cut_gradient_is_checked_and_a_skipped_one_reads_as_none():
    grad = torch.tensor([[2.0, -4.0]], dtype=torch.float16)
    assert unscaled(scaled(grad, 4.0, grad.device)).tolist() == [[0.5, -1.0]]
    assert unscaled(scaled(torch.zeros_like(grad), 0.0, grad.device)) is None
    for bad in (
        {"grad": grad},
        {"grad": grad, "scale": torch.tensor(-1.0)},
        {"grad": grad, "scale": torch.tensor(1.0, dtype=torch.float64)},
        {"grad": torch.tensor([float("inf")], dtype=torch.float16), "scale": torch.tensor(1.0)},
    ):
        with pytest.raises(ValueError):
            unscaled(bad)


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"setting": "vertical", "algorithm": "sl", "dataset": "breast_cancer"}, "setting=vertical"),
        ({"algorithm": "sfl_v2", "defense": "gradnoise:0.1"}, "noise on cut gradients"),
        ({"dataset": "shakespeare", "model": "lstm"}, "no float16 LSTM kernel on the CPU"),
    ],
)
def test_fp16_is_refused_in_one_line_where_it_does_not_apply(settings, why, tmp_path):
    """As the config resolves, or (setting=vertical) as the setting plans the run."""
    with pytest.raises(UserError, match=why) as refused:
        check(dict(FP16, **settings, out=str(tmp_path / "run")))
    assert "\n" not in str(refused.value) and "precision=bf16" in str(refused.value)
