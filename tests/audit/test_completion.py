"""Model completion (Fu et al. 2022): a client part trained with the labels lets its holder infer
labels from a few known ones, far better than the same client part untrained; the `attack` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import quick, train
from splitlab.audit import model_completion as completion
from splitlab.cli import main
from splitlab.engine import run
from splitlab.models import split


def test_a_trained_client_part_completed_with_one_label_per_class_infers_labels():
    """Digits, LEAF CNN cut 3 (the client holds both convolutions and the dense layer), 3 rounds;
    the attacker knows one label of each class (the first of each in the test split's first 180)
    and infers the labels of the other 180. Measured: 81.7% trained, 61.1% untrained, floor 12.8%
    (seeds 1 and 2: 87.8% / 64.4%, 81.7% / 57.8%)."""
    experiment = train(3, dataset="digits", model="cnn", cut=3, clients=2, device="cpu", seed=0)
    client, _ = experiment.assemble(experiment.algorithm.global_model())
    untrained, _ = split(experiment.blueprint.new_model(), 3)
    x, y = experiment.data.test_x, experiment.data.test_y
    labelled = completion.balanced_labelled(y[:180].numpy(), 10, 10)
    aux_x, aux_y, target_x, target_y = x[labelled], y[labelled], x[180:], y[180:]
    result = completion.model_completion(client, untrained.eval(), aux_x, aux_y, target_x, target_y, 10, 30, 0)
    assert result["labelled"] == 10 and result["labelled_per_class"] == 1 and result["samples"] == 180
    assert result["floor"] == pytest.approx(np.bincount(y[180:].numpy()).max() / 180)
    assert result["accuracy"] > result["floor"] + 0.5
    assert result["accuracy"] > result["untrained_accuracy"] + 0.15  # what training put in the client part


def test_labelled_samples_are_the_first_of_each_class_and_too_few_are_refused():
    labels = np.array([2, 0, 1, 0, 2, 1, 1])
    assert completion.balanced_labelled(labels, 3, 3).tolist() == [0, 1, 2]
    assert completion.balanced_labelled(labels, 6, 3).tolist() == [0, 1, 2, 3, 4, 5]
    assert completion.balanced_labelled(labels, None, 3).tolist() == [0, 1, 2, 3, 4, 5]  # what fits: 2 of each
    with pytest.raises(ValueError, match="holds 2 samples of class 0, fewer than 3"):
        completion.balanced_labelled(labels, 9, 3)
    with pytest.raises(ValueError, match="aux=4 is not a multiple of the 3 classes"):
        completion.balanced_labelled(labels, 4, 3)
    with pytest.raises(ValueError, match="lack a class"):
        completion.balanced_labelled(labels, None, 4)


def test_the_model_completion_command_and_its_bad_options(tmp_path, capsys):
    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", record=40), "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=model_completion", "aux=20", "epochs=1"]) == 0
    result = json.loads((out / "attack.json").read_text())["model_completion"]
    assert result["labelled"] == 20 and result["samples"] == 40 and result["targets"] == "recorded round 2"
    assert result["accuracy"] > result["floor"]
    capsys.readouterr()
    for args, message in [
        (["aux=25"], "aux=25 is not a multiple of the 10 classes"),
        (["aux=310"], "the run's test split holds 300"),
        (["epochs=0"], "invalid value 0 for epochs"),
    ]:
        assert main(["attack", str(out), "attack=model_completion", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert main(["attack", str(out), "attack=token_inversion"]) == 2
    assert "attack=token_inversion does not apply" in capsys.readouterr().err
