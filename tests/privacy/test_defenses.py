"""Defenses at the cut: identity when off, exact wire sizes, bounded quantization error, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import global_weights, personal_weights, quick, straight_and_resumed, train
from splitlab.algorithms import algorithm_names, get_algorithm
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.privacy.defenses import (
    FP16_ABSOLUTE_ERROR,
    FP16_RELATIVE_ERROR,
    Defense,
    decode,
    distance_correlation,
    parse_defense,
)


def test_zero_noise_without_clipping_is_bit_identical_to_no_defense():
    plain = train(2, **quick(algorithm="sfl_v2"))
    noised = train(2, **quick(algorithm="sfl_v2", defense="noise:0"))
    a, b = global_weights(plain), global_weights(noised)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert plain.ledger.state_dict() == noised.ledger.state_dict()


def test_noise_with_a_fixed_key_repeats_and_changes_training():
    first = global_weights(train(1, **quick(algorithm="sfl_v2", defense="clip:1+noise:0.5", noise_key="k")))
    again = global_weights(train(1, **quick(algorithm="sfl_v2", defense="clip:1+noise:0.5", noise_key="k")))
    plain = global_weights(train(1, **quick(algorithm="sfl_v2")))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], plain[k]) for k in first)


@pytest.mark.parametrize("algorithm", ["sfl_v2", "cycle_sfl"])
def test_defended_runs_are_bit_identical_through_either_transport(algorithm):
    config = quick(
        algorithm=algorithm, defense="clip:5+noise:0.3+gradnoise:0.5+topk:0.5+quantize:int8", noise_key="fixed"
    )
    direct = train(2, **config)
    serialized = train(2, transport="serialized", **config)
    a, b = global_weights(direct), global_weights(serialized)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()


# Batches of the quick config: 300 samples over 3 clients -> 100 each, batches of 32, 32, 32, 4.
# mlp cut 1 sends 200 activations per sample; labels are int64.
SAMPLES, BATCHES, WIDTH = 300, 12, 200


@pytest.mark.parametrize(
    ("defense", "per_sample", "per_batch"),
    [
        ("none", 4 * WIDTH, 0),
        ("quantize:int8", WIDTH + 4, 0),  # int8 values + one float32 scale per sample
        ("quantize:fp16", 2 * WIDTH, 0),
        ("topk:0.25", 50 * (4 + 4), 2 * 4),  # 50 float32 values + int32 indices; the int32 shape (2,)
        ("topk:0.1+quantize:int8", 20 * (1 + 4) + 4, 2 * 4),
    ],
)
def test_ledger_counts_the_compressed_payload(defense, per_sample, per_batch):
    ledger = train(1, **quick(algorithm="sfl_v2", defense=defense)).ledger.state_dict()
    assert ledger["smashed"] == ledger["cut_grad"] == SAMPLES * per_sample + BATCHES * per_batch
    assert ledger["labels"] == SAMPLES * 8


def test_quantization_round_trips_within_its_stated_error():
    torch.manual_seed(0)
    x = torch.randn(16, 3, 5, 5) * torch.logspace(-3, 3, 16).view(-1, 1, 1, 1)
    int8 = decode(Defense(quantize="int8").encode(x))
    bound = x.flatten(1).abs().amax(1) / 254  # half a step of max|x_i| / 127, per sample
    assert ((int8 - x).flatten(1).abs().amax(1) <= bound * (1 + 1e-6)).all()
    fp16 = decode(Defense(quantize="fp16").encode(x))
    assert ((fp16 - x).abs() <= x.abs() * FP16_RELATIVE_ERROR + FP16_ABSOLUTE_ERROR).all()
    sparse = decode(Defense(topk=0.2).encode(x))
    kept = sparse.flatten(1) != 0
    assert (kept.sum(1) == math.ceil(0.2 * 75)).all() and torch.equal(sparse.flatten(1)[kept], x.flatten(1)[kept])
    smallest_kept = torch.where(kept, x.flatten(1).abs(), torch.inf).amin(1)
    largest_dropped = torch.where(kept, 0, x.flatten(1).abs()).amax(1)
    assert (smallest_kept >= largest_dropped).all()


def test_clipping_bounds_each_sample_and_nopeek_measures_dependence():
    z = torch.randn(8, 10) * 5
    clipped = Defense(clip=2.0).protect(z, None)
    assert torch.allclose(clipped.norm(dim=1), torch.full((8,), 2.0))
    x = torch.randn(64, 5)
    assert distance_correlation(x, x) == pytest.approx(1.0, abs=1e-5)
    assert distance_correlation(x, torch.randn(64, 5)) < 0.5


@pytest.mark.parametrize(
    "message",
    [
        {"int8": torch.zeros(2, 3, dtype=torch.int8), "scale": torch.zeros(3)},
        {"int8": torch.zeros(2, 3), "scale": torch.zeros(2)},
        {"int8": torch.zeros(2, 3, dtype=torch.int8), "scale": torch.tensor([1.0, float("nan")])},
        {
            "values": torch.ones(2, 1),
            "indices": torch.tensor([[0], [3]], dtype=torch.int32),
            "shape": torch.tensor([2, 3], dtype=torch.int32),
        },
        {"fp16": torch.tensor([float("inf")], dtype=torch.float16)},
        {"pickle": torch.zeros(1)},
        torch.zeros(2, dtype=torch.int64),
    ],
)
def test_malformed_cut_layer_messages_are_refused(message):
    with pytest.raises(ValueError):
        decode(message)


SPLIT_ALGORITHMS = [name for name in algorithm_names() if "server_model" in get_algorithm(name).models]


@pytest.mark.parametrize("algorithm", SPLIT_ALGORITHMS)
def test_every_algorithm_trains_with_every_defense_through_bytes(algorithm):
    """Compressed messages survive the serialized transport, and every algorithm that sends smashed
    data applies the defenses; personal and global models come out finite."""
    config = quick(
        algorithm=algorithm, defense="clip:5+noise:0.1+gradnoise:0.1+nopeek:0.1+topk:0.5+quantize:int8", rounds=1
    )
    experiment = train(1, transport="serialized", **config)
    states = (
        personal_weights(experiment).values() if experiment.algorithm.personal_models else [global_weights(experiment)]
    )
    assert all(torch.isfinite(t.float()).all() for state in states for t in state.values())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("noise:-1", "noise:<sigma in [0, 1e6]>"),
        ("noise:x", "noise:<sigma in [0, 1e6]>"),
        ("blur:1", "unknown item 'blur:1'"),
        ("quantize:int4", "quantize:int8|fp16"),
        ("topk:0", "topk:<fraction in (0, 1]>"),
        ("clip:1+clip:2", "given twice item 'clip:2'"),
        ("clip:inf", "clip:<max L2 norm > 0>"),
    ],
)
def test_bad_defense_values_are_refused_in_one_line(tmp_path, capsys, value, message):
    code = main(["run", "dataset=synthetic", "model=mlp", f"defense={value}", f"out={tmp_path / 'x'}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and repr(value) in err
    assert not (tmp_path / "x").exists()
    with pytest.raises(UserError):
        parse_defense(value)


def test_nopeek_joins_the_client_objective():
    plain = global_weights(train(1, **quick(algorithm="sfl_v2")))
    nopeek = global_weights(train(1, **quick(algorithm="sfl_v2", defense="nopeek:10")))
    assert not torch.equal(plain["fc1.1.weight"], nopeek["fc1.1.weight"])  # the client part's gradient changed


def test_a_defended_run_resumes_bit_for_bit():
    config = quick(algorithm="sfl_v2", defense="clip:5+noise:0.3+gradnoise:0.5", noise_key="fixed")
    straight, resumed = straight_and_resumed(3, **config)
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm", sorted(set(algorithm_names()) - set(SPLIT_ALGORITHMS)))
@pytest.mark.parametrize("setting", ["defense=clip:1+noise:1", "record=10"])
def test_privacy_settings_where_nothing_is_split_are_refused_in_one_line(tmp_path, capsys, algorithm, setting):
    assert main(["run", f"algorithm={algorithm}", setting, f"out={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"does not apply to {algorithm}: nothing crosses a cut" in err
    assert not (tmp_path / "r").exists()


def test_a_noise_key_without_noise_is_refused():
    with pytest.raises(UserError, match="noise_key= applies to a randomised defense"):
        train(1, **quick(algorithm="sfl_v2", defense="clip:1", noise_key="k"))


def test_defended_runs_report_accuracy_as_deployed_beside_the_undefended_path(tmp_path):
    strong = run(quick(algorithm="sfl_v2", defense="clip:0.1+noise:20", out=str(tmp_path / "a")), progress=False)
    assert strong["final_accuracy_deployed"] < strong["final_accuracy"]  # noise 20x the clip norm drowns the signal
    assert "as deployed" in strong["accuracy_paths"]
    loose = run(quick(algorithm="sfl_v2", defense="clip:1000000", out=str(tmp_path / "b")), progress=False)
    assert loose["final_accuracy_deployed"] == loose["final_accuracy"]  # a clip that never bites changes nothing
    rows = (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    assert all('"test_accuracy_deployed"' in row for row in rows)
    plain = run(quick(algorithm="sfl_v2", defense="nopeek:1", out=str(tmp_path / "c")), progress=False)
    assert "final_accuracy_deployed" not in plain
