"""Only trainable tensors train, travel, are averaged and checkpointed (LoRA on a pretrained
model=gpt): the ledger's bytes by hand, the frozen base bit-identical after training and held once."""

from __future__ import annotations

import pytest
import torch

from helpers import global_weights, max_abs_difference, straight_and_resumed, train
from splitlab.checkpoints import role_states
from splitlab.errors import UserError

# 2 blocks of width 16; LoRA rank 4 on each block's c_attn (16 -> 48): A is 4 x 16, B is 48 x 4
ADAPTER_BYTES = (4 * 16 + 48 * 4) * 4


def frozen(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in module.named_parameters() if not p.requires_grad}


@pytest.fixture
def lm(lm, pretrained) -> dict:
    """`lm` from a finished run of its model, which LoRA fine-tunes."""
    return dict(lm, init=pretrained)


def test_lora_ledger_counts_the_adapters_alone_by_hand(lm):
    sfl_v1 = train(1, **dict(lm, algorithm="sfl_v1", cut=1, lora="4:8"))
    ledger = sfl_v1.ledger.state_dict()
    assert ledger["client_model_down"] == ledger["client_model_up"] == 3 * ADAPTER_BYTES  # block1's adapters
    fedavg = train(1, **dict(lm, algorithm="fedavg", lora="4:8")).ledger.state_dict()
    assert fedavg["client_model_down"] == fedavg["client_model_up"] == 3 * 2 * ADAPTER_BYTES  # both blocks'
    state = role_states(sfl_v1)
    assert set(state["sync"]["models"]["client_model"]) == {"block1.attn.c_attn.lora_A", "block1.attn.c_attn.lora_B"}


def test_the_frozen_base_is_bit_identical_after_training_and_held_once(lm):
    config = dict(lm, algorithm="sfl_v1", cut=1, lora="4:8")
    experiment = train(2, **config)
    initial = train(0, **config)
    trained_server, fresh_server = experiment.roles.server.model("server_model"), initial.blueprint.new_split()[1]
    assert frozen(trained_server).keys() == frozen(fresh_server).keys() and len(frozen(fresh_server)) > 0
    assert all(torch.equal(p, frozen(fresh_server)[name]) for name, p in frozen(trained_server).items())
    adapters = {n: p for n, p in trained_server.named_parameters() if p.requires_grad}
    assert max(float(p.detach().abs().max()) for n, p in adapters.items() if n.endswith("lora_B")) > 0  # trained
    # the server part and the working copies of it of clients training at once share one frozen base
    server = experiment.roles.server
    for k in range(3):
        server.copy_server(k)
    copies = [trained_server, *(server.models[f"server_copy@{k}"] for k in range(3))]
    assert len({id(copy) for copy in copies}) == 4
    for name in frozen(trained_server):
        assert len({frozen(copy)[name].data_ptr() for copy in copies}) == 1


def test_sfl_v1_equals_fedavg_and_resume_is_exact_with_lora(lm):
    config = dict(lm, lora="4:8", optimizer="sgd", lr=0.5)
    fedavg = global_weights(train(2, algorithm="fedavg", **config))
    sfl_v1 = global_weights(train(2, algorithm="sfl_v1", cut=1, **config))
    assert max_abs_difference(sfl_v1, fedavg) <= 1e-5
    with pytest.raises(UserError, match="cut=2 leaves the server part nothing to train"):
        train(0, algorithm="sfl_v1", cut=2, **config)  # only the frozen head is left on the server
    straight, resumed = straight_and_resumed(2, **dict(config, algorithm="fsl_sage", aux="blocks:1"))
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_targets_that_do_not_exist_are_one_line(lm):
    with pytest.raises(UserError, match="lora_targets: 'q_proj' names no linear layer"):
        train(0, **dict(lm, algorithm="sfl_v2", lora="4:8", lora_targets="q_proj"))
    with pytest.raises(UserError, match="lora_targets=c_attn does not apply here: lora_targets needs lora"):
        train(0, **dict(lm, algorithm="sfl_v2", lora_targets="c_attn"))
    with pytest.raises(UserError, match="invalid value 4 for lora"):
        train(0, **dict(lm, algorithm="sfl_v2", lora="4"))
