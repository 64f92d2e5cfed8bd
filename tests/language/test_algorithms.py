"""Every algorithm with a cut on model=gpt + shakespeare_lm: the equivalences that hold for images
hold here, what crosses the cut is counted by hand, serialized == direct, resume is exact."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import global_weights, max_abs_difference, straight_and_resumed, train
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.models.lora import KeyedDropout

ALGORITHMS = [
    "fedavg",
    "sl",
    "sfl_v1",
    "sfl_v2",
    "psl",
    "sglr",
    "cycle_psl",
    "cycle_sglr",
    "cycle_sfl",
    "cycle_ssl",
    "cse_fsl",
    "fsl_sage",
]
AUX = {"cse_fsl": {"aux": "blocks:1"}, "fsl_sage": {"aux": "blocks:1", "align_interval": 1}}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_with_a_cut_trains_a_gpt_and_serialized_is_bit_identical(lm, algorithm):
    config = dict(lm, algorithm=algorithm, cut=1, **AUX.get(algorithm, {}))
    direct, serialized = train(2, **config), train(2, transport="serialized", **config)
    before = evaluate(train(0, **config))
    after = evaluate(direct)
    assert set(after) == {"accuracy", "loss", "perplexity"}
    assert after["loss"] < before["loss"]
    assert after == evaluate(serialized)
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()


def test_splitgp_is_refused_in_one_line(lm):
    with pytest.raises(UserError, match="algorithm=splitgp cannot run dataset=shakespeare_lm: its client exit head"):
        train(0, **dict(lm, algorithm="splitgp"))


def test_a_class_based_partition_of_sequences_is_refused(lm):
    with pytest.raises(UserError, match="partition=dirichlet:0.5 splits by class"):
        train(0, **dict(lm, algorithm="sfl_v2", partition="dirichlet:0.5"))


def test_sfl_v1_equals_fedavg_on_a_gpt(lm):
    config = dict(lm, optimizer="sgd", lr=0.1)
    fedavg = global_weights(train(2, algorithm="fedavg", **config))
    assert max_abs_difference(fedavg, global_weights(train(0, algorithm="fedavg", **config))) > 1e-3
    for cut in (1, 2):
        sfl_v1 = global_weights(train(2, algorithm="sfl_v1", cut=cut, **config))
        assert max_abs_difference(sfl_v1, fedavg) <= 1e-5, f"cut {cut}"


def test_sfl_v2_with_one_client_equals_centralized_on_a_gpt(lm):
    config = dict(lm, clients=1, optimizer="sgd", lr=0.1)
    reference = global_weights(train(2, algorithm="centralized", **config))
    for cut in (1, 2):
        split = global_weights(train(2, algorithm="sfl_v2", cut=cut, **config))
        assert max_abs_difference(split, reference) <= 1e-5, f"cut {cut}"


def test_what_crosses_the_cut_is_hidden_states_and_masked_targets_by_hand(lm):
    """SFL-V2, one round of 3 steps per client: each step sends B x T x D float32 hidden states
    and B x T int64 targets (the loss mask is in them) up, and the same hidden-state shape down."""
    experiment = train(1, **dict(lm, algorithm="sfl_v2", cut=1))
    sizes = [len(node.y) for node in experiment.roles.clients]
    batches = [min(8, n) for n in sizes]  # 3 steps of batch 8 (every client holds more than 24)
    assert all(n >= 24 for n in sizes)
    sequences = 3 * sum(batches)
    ledger = experiment.ledger.state_dict()
    assert ledger["smashed"] == sequences * 16 * 16 * 4
    assert ledger["cut_grad"] == sequences * 16 * 16 * 4
    assert ledger["labels"] == sequences * 16 * 8


def test_fsl_sage_runs_end_to_end_with_falling_test_loss(lm, tmp_path):
    summary = run(
        dict(lm, algorithm="fsl_sage", aux="blocks:1", cut=1, rounds=3, align_interval=1, out=str(tmp_path / "run")),
        progress=False,
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [1, 2, 3]
    assert rows[-1]["test_loss"] < rows[0]["test_loss"]
    assert summary["final_perplexity"] == pytest.approx(torch.tensor(rows[-1]["test_loss"]).exp().item(), rel=1e-6)


@pytest.mark.parametrize("algorithm", ["sfl_v1", "fsl_sage"])
def test_resume_is_bit_identical_on_a_gpt(lm, algorithm):
    straight, resumed = straight_and_resumed(2, **dict(lm, algorithm=algorithm, **AUX.get(algorithm, {})))
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lora_dropout, hf_dropout", [(0.0, "off"), (0.1, "off"), (0.0, "checkpoint")])
def test_fsl_sage_with_a_full_aux_equals_sfl_v2_on_a_checkpoint_with_dropout(plays, tmp_path, lora_dropout, hf_dropout):
    """docs/fsl.md: with aux=full and q = l = 1, FSL-SAGE's first step is SplitFed-v2's, also on a
    GPT-2 checkpoint whose config asks for dropout 0.1: model=hf turns a checkpoint's dropout off
    in every copy alike (the aux model, a deep copy, included), and nothing draws from torch's
    global random state; LoRA dropout's masks and, with hf_dropout=checkpoint, the checkpoint's
    dropout layers' masks, keyed by the input, are alike in every copy too, and the same through
    every transport."""
    from hf_helpers import tiny_hf_model
    from splitlab.models import build_model

    model_dir = tiny_hf_model(tmp_path / "gpt2", "gpt2")
    assert json.loads((model_dir / "config.json").read_text())["resid_pdrop"] == 0.1
    built = build_model("hf", (16,), 300, model_dir=str(model_dir), hf_dropout=hf_dropout)
    applied = {m.p for m in built.modules() if isinstance(m, torch.nn.Dropout | KeyedDropout)} - {0.0}
    assert applied == ({0.1} if hf_dropout == "checkpoint" else set()) and built.training
    common = dict(
        dataset="shakespeare_lm", data_dir=plays, model="hf", model_dir=str(model_dir), seq_len=16, lora="4:8",
        clients=1, batch_size=8, local_steps=1, cut=1, device="cpu", optimizer="sgd", lr=0.5, lora_dropout=lora_dropout,
        hf_dropout=hf_dropout,
    )  # fmt: skip
    sage = dict(algorithm="fsl_sage", server_update_interval=1, align_interval=1, aux="full")
    experiment = train(0, **common, **sage)
    global_state = torch.get_rng_state()
    experiment.algorithm.run_round(0, experiment.clients)
    assert torch.equal(torch.get_rng_state(), global_state)
    sfl_v2 = train(1, **common, algorithm="sfl_v2")
    assert max_abs_difference(global_weights(experiment), global_weights(sfl_v2)) == 0
    assert max_abs_difference(global_weights(experiment), global_weights(train(0, **common, algorithm="sfl_v2"))) > 0
    if lora_dropout or hf_dropout != "off":
        serialized = train(1, **common, algorithm="sfl_v2", transport="serialized")
        assert max_abs_difference(global_weights(serialized), global_weights(sfl_v2)) == 0
        without = train(1, **dict(common, lora_dropout=0.0, hf_dropout="off"), algorithm="sfl_v2")
        assert max_abs_difference(global_weights(without), global_weights(sfl_v2)) > 0


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_dropout_checkpoint_applies_the_checkpoints_dropout_in_training_only(tmp_path, arch):
    """Every dropout of the checkpoint (GPT-2's embd_pdrop, attn_pdrop and resid_pdrop; the Llama
    layout's attention_dropout, on attention probabilities only) drops in training, with the same
    masks for the same input and no global random draws, and is gone in evaluation."""
    from hf_helpers import tiny_hf_model
    from splitlab.models import build_model

    model_dir = tiny_hf_model(tmp_path / arch, arch)
    if arch == "llama":
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    checkpoint = build_model("hf", (16,), 300, model_dir=str(model_dir), hf_dropout="checkpoint", seed=3)
    off = build_model("hf", (16,), 300, model_dir=str(model_dir), seed=3)
    keyed = {name: m.key for name, m in checkpoint.named_modules() if isinstance(m, KeyedDropout)}
    attention = "block1.layer.attn.attn_dropout" if arch == "gpt2" else "block1.layer.self_attn.attn_dropout"
    assert keyed[attention] == f"3:{attention}" and len(keyed) == (1 + 3 * 3 if arch == "gpt2" else 3)
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in checkpoint.modules())
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    global_state = torch.get_rng_state()
    with torch.no_grad():
        dropped = checkpoint(tokens)
        assert torch.equal(checkpoint(tokens), dropped) and not torch.equal(dropped, off(tokens))
        assert torch.equal(torch.get_rng_state(), global_state)
        assert torch.equal(checkpoint.eval()(tokens), off.eval()(tokens))


def test_hf_dropout_checkpoint_with_gradient_checkpointing_recomputes_the_same_masks(plays, tmp_path):
    from hf_helpers import tiny_hf_model

    model_dir = tiny_hf_model(tmp_path / "gpt2", "gpt2")
    common = dict(
        dataset="shakespeare_lm", data_dir=plays, model="hf", model_dir=str(model_dir), seq_len=16, lora="4:8",
        clients=1, batch_size=4, local_steps=2, device="cpu", optimizer="sgd", lr=0.5, algorithm="sfl_v2",
        hf_dropout="checkpoint",
    )  # fmt: skip
    plain, recomputed = train(1, **common), train(1, **common, gradient_checkpointing=True)
    assert max_abs_difference(global_weights(plain), global_weights(recomputed)) == 0
