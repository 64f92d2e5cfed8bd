"""The training conveniences every algorithm and role share: grad_accum, max_grad_norm,
optimizer=adamw, precision=bf16 and fp16, base_dtype, gradient_checkpointing (docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import global_weights, max_abs_difference, quick, straight_and_resumed, train
from splitlab.engine import run
from splitlab.loop import evaluate
from splitlab.targets import IGNORED

#: SGD, so that one step on a batch of 16 is the mean of the gradients of its 16 samples exactly
SGD = dict(optimizer="sgd", lr=0.1, train_subset=96, clients=2, local_steps=None)


@pytest.mark.parametrize("algorithm", ["sfl_v2", "sfl_v1", "sl", "fedavg", "centralized", "cse_fsl", "fsl_sage"])
def test_grad_accum_2_of_8_equals_one_batch_of_16(algorithm):
    """Clients of 48 samples: 3 steps of 16 either way; each micro-batch's loss weighted by its share."""
    config = quick(algorithm=algorithm, **SGD)
    whole = train(2, **dict(config, batch_size=16))
    accumulated = train(2, **dict(config, batch_size=8, grad_accum=2))
    assert max_abs_difference(global_weights(whole), global_weights(accumulated)) < 1e-5
    assert accumulated.ledger.state_dict() == whole.ledger.state_dict()  # the same step batches cross


def test_grad_accum_on_a_gpt_weighs_micro_batches_by_their_counted_tokens(lm):
    """A step of 16 sequences whose first 8 count far fewer tokens than the last 8: the accumulated
    gradient is the gradient of the mean over all counted tokens, not the mean of the two means."""
    experiment = train(0, **dict(lm, batch_size=8, grad_accum=2, algorithm="sfl_v2"))
    server = experiment.roles.server
    model = server.model("server_model")
    generator = torch.Generator().manual_seed(0)
    smashed = torch.randn(16, 16, 16, generator=generator)
    targets = torch.randint(0, 10, (16, 16), generator=generator)
    targets[:8, :13] = IGNORED  # 8 x 3 tokens counted, then 8 x 16
    shares = [share.item() for _, _, share in server.micro_batches(smashed, targets)]
    assert shares == pytest.approx([24 / 152, 128 / 152])
    value = server.accumulate(model, smashed, targets)
    accumulated = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    whole = server.blueprint.loss(model(smashed), targets)
    whole.backward()
    assert value.item() == pytest.approx(whole.item(), abs=1e-6)
    assert max((a - p.grad).abs().max().item() for a, p in zip(accumulated, model.parameters())) < 1e-6


def test_grad_accum_on_a_gpt_equals_the_larger_batch(lm):
    config = dict(lm, algorithm="sfl_v1", optimizer="sgd", lr=0.5, local_steps=2)
    whole = train(1, **dict(config, batch_size=8))
    accumulated = train(1, **dict(config, batch_size=4, grad_accum=2))
    assert max_abs_difference(global_weights(whole), global_weights(accumulated)) < 1e-5


def test_max_grad_norm_bounds_every_slots_step_and_a_loose_one_changes_nothing():
    """One SGD step (no momentum): each slot moves by lr x its clipped gradient, of norm <= lr x C."""
    config = quick(algorithm="sfl_v2", clients=1, local_steps=1, rounds=1, optimizer="sgd", lr=0.1)
    before = train(0, **config)
    clipped = train(1, **dict(config, max_grad_norm=0.01))
    plain = train(1, **config)
    loose = train(1, **dict(config, max_grad_norm=1e6))
    assert max_abs_difference(global_weights(plain), global_weights(loose)) == 0
    parts = zip(before.algorithm.global_model(), clipped.algorithm.global_model(), plain.algorithm.global_model())
    for start, end, unclipped in parts:  # client part, server part: each clipped on its own
        assert distance(start, end) == pytest.approx(0.1 * 0.01, rel=1e-4)
        assert distance(start, unclipped) > 0.1 * 0.1


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return torch.cat([(a[k] - b[k]).flatten() for k in a]).norm().item()


def test_adamw_decays_weights_apart_from_the_gradient():
    """AdamW's first step: w - lr * wd * w - lr * m/(sqrt(v)+eps); the decay is the only
    difference two runs with and without weight_decay make (Adam's L2 penalty enters the gradient)."""
    config = quick(algorithm="fedavg", clients=1, local_steps=1, rounds=1, lr=0.01)
    start = global_weights(train(0, **config))
    decayed = global_weights(train(1, **dict(config, optimizer="adamw", weight_decay=0.5)))
    plain = global_weights(train(1, **dict(config, optimizer="adamw")))
    for name, weight in start.items():
        assert torch.allclose(decayed[name] - plain[name], -0.01 * 0.5 * weight, atol=1e-7)
    l2 = global_weights(train(1, **dict(config, optimizer="adam", weight_decay=0.5)))
    assert max_abs_difference(l2, decayed) > 1e-4


def test_bf16_trains_a_gpt_on_the_cpu_and_halves_what_crosses_the_cut(lm):
    """SFL-V2, one round of 3 steps per client: B x T x D hidden states up and gradients down at 2
    bytes each (bfloat16), the int64 targets as before; the test loss falls; weights stay float32."""
    config = dict(lm, algorithm="sfl_v2", cut=1, precision="bf16")
    before = evaluate(train(0, **config))
    experiment = train(3, **config)
    assert evaluate(experiment)["loss"] < before["loss"]
    sequences = 3 * 3 * sum(min(8, len(node.y)) for node in experiment.roles.clients)
    ledger = experiment.ledger.state_dict()
    assert ledger["smashed"] == sequences * 16 * 16 * 2
    assert ledger["cut_grad"] == sequences * 16 * 16 * 2
    assert ledger["labels"] == sequences * 16 * 8
    assert {t.dtype for t in global_weights(experiment).values()} == {torch.float32}
    serialized = train(3, **dict(config, transport="serialized"))
    assert max_abs_difference(global_weights(experiment), global_weights(serialized)) == 0


def test_fp16_trains_a_gpt_on_the_cpu_sending_2_bytes_a_value_and_a_4_byte_scale(lm):
    """As bf16 above, in float16 with loss scaling: each of the 27 cut gradients carries its scale."""
    config = dict(lm, algorithm="sfl_v2", cut=1, precision="fp16")
    before = evaluate(train(0, **config))
    experiment = train(3, **config)
    assert evaluate(experiment)["loss"] < before["loss"]
    sequences = 3 * 3 * sum(min(8, len(node.y)) for node in experiment.roles.clients)
    ledger = experiment.ledger.state_dict()
    assert ledger["smashed"] == sequences * 16 * 16 * 2
    assert ledger["cut_grad"] == sequences * 16 * 16 * 2 + 3 * 3 * 3 * 4
    assert {t.dtype for t in global_weights(experiment).values()} == {torch.float32}
    serialized = train(3, **dict(config, transport="serialized"))
    assert max_abs_difference(global_weights(experiment), global_weights(serialized)) == 0


@pytest.mark.parametrize(
    "settings", [{"algorithm": "fsl_sage", "aux": "blocks:1", "align_interval": 1}, {"algorithm": "cycle_sfl"}]
)
def test_fp16_trains_a_gpt_with_fsl_sage_and_cyclesl(lm, settings):
    """FSL-SAGE's estimates under each client's scale and its float32 alignment, CycleSL's ServerGrad
    crossing scaled: the loss falls, the weights stay float32, serialized gives the same bits."""
    config = dict(lm, cut=1, precision="fp16", **settings)
    before = evaluate(train(0, **config))
    experiment = train(2, **config)
    assert evaluate(experiment)["loss"] < before["loss"]
    assert {t.dtype for t in global_weights(experiment).values()} == {torch.float32}
    serialized = train(2, **dict(config, transport="serialized"))
    assert max_abs_difference(global_weights(experiment), global_weights(serialized)) == 0


def test_bf16_runs_every_role_under_autocast():
    """An MLP's server part in bfloat16 gives another loss than in float32, and resumes exactly."""
    config = quick(algorithm="sfl_v2", precision="bf16")
    assert max_abs_difference(global_weights(train(1, **config)), global_weights(train(1, **quick()))) > 0
    straight, resumed = straight_and_resumed(2, **config)
    assert max_abs_difference(global_weights(straight), global_weights(resumed)) == 0


@pytest.mark.parametrize("algorithm", ["sfl_v2", "fedavg"])
def test_gradient_checkpointing_gives_the_same_results(lm, algorithm):
    config = dict(lm, algorithm=algorithm, cut=1)
    plain = train(2, **config)
    checkpointed = train(2, **dict(config, gradient_checkpointing=True))
    assert checkpointed.roles.clients[0].model("client_model").checkpointed
    assert max_abs_difference(global_weights(plain), global_weights(checkpointed)) < 1e-6


def test_gradient_checkpointing_repeats_the_dropout_it_drew():
    """A stage with dropout is recomputed in the backward pass with the same mask."""
    from splitlab.models.staged import Stages

    torch.manual_seed(0)
    stages = Stages(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5), torch.nn.Linear(6, 1))
    x = torch.randn(4, 6)
    grads = []
    for checkpointed in (False, True):
        stages.checkpointed = checkpointed
        stages.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        stages(x).sum().backward()
        grads.append([p.grad.clone() for p in stages.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_base_dtype_holds_the_frozen_base_in_bf16_and_trains_the_adapters_in_fp32(lm, pretrained, tmp_path):
    config = dict(lm, algorithm="sfl_v2", cut=1, lora="2:4", init=pretrained, precision="bf16", rounds=3)
    run(dict(config, base_dtype="bfloat16", out=str(tmp_path / "half")), progress=False)
    run(dict(config, out=str(tmp_path / "full")), progress=False)
    server = train(0, **dict(config, base_dtype="bfloat16")).roles.server.model("server_model")
    dtypes = {(p.requires_grad, p.dtype) for p in server.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    half, full = (losses_of(tmp_path / name) for name in ("half", "full"))
    assert half[-1] < half[0] and half[-1] == pytest.approx(full[-1], abs=0.05)
    assert (tmp_path / "half" / "hf" / "model.safetensors").exists()


def losses_of(out: Path) -> list[float]:
    return [json.loads(line)["test_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
