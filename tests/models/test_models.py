"""Every model splits at every valid cut into parts that compose to the unsplit model."""

from __future__ import annotations

import pytest
import torch

from splitlab.config import NoParams, RunConfig
from splitlab.errors import UserError
from splitlab.models import build_model, largest_activation_bytes, model_names, split
from splitlab.roles import INFERENCE_BUDGET, Blueprint

SHAPES = {
    "mlp": (1, 8, 8),
    "cnn": (1, 28, 28),
    "splitgp_cnn": (1, 28, 28),
    "vgg11": (3, 32, 32),
    "resnet18": (3, 32, 32),
    "resnet50": (3, 32, 32),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_split_parts_compose_to_the_full_model(name):
    model = build_model(name, SHAPES[name], 10, seed=1).eval()
    x = torch.randn(3, *SHAPES[name])
    with torch.no_grad():
        expected = model(x)
        assert expected.shape == (3, 10)
        for cut in model.valid_cuts:
            client, server = split(model, cut)
            torch.testing.assert_close(server(client(x)), expected, rtol=0, atol=0)
            names = set(client.state_dict()) | set(server.state_dict())
            assert names == set(model.state_dict()), "split parts keep the unsplit names"
            assert not set(client.state_dict()) & set(server.state_dict())


def test_same_seed_same_weights_and_different_seed_different_weights():
    a, b, c = (build_model("cnn", (1, 28, 28), 10, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["conv1.0.weight"], c.state_dict()["conv1.0.weight"])


def test_resnet_cuts_follow_the_papers_numbering():
    model = build_model("resnet18", (3, 32, 32), 10)
    assert model.valid_cuts == [1, 2, 3, 4]
    for cut in model.valid_cuts:
        client, _ = split(model, cut)
        assert list(dict(client.named_children())) == ["stem"] + [f"layer{i}" for i in range(1, cut + 1)]


def test_splitgp_cnn_matches_the_papers_parameter_counts():
    client, server = split(build_model("splitgp_cnn", (1, 28, 28), 10), 4)
    assert sum(p.numel() for p in client.parameters()) == 387_840
    assert sum(p.numel() for p in server.parameters()) == 3_480_330


@pytest.mark.parametrize("cut", [0, 3, -1])
def test_cut_outside_the_range_is_a_user_error(cut):
    with pytest.raises(UserError, match=rf"cut {cut} is out of range .*valid cuts: \[1, 2\]"):
        split(build_model("mlp", (1, 8, 8), 10), cut)


def test_unknown_model_lists_the_available_ones():
    with pytest.raises(UserError, match="unknown model 'nope'; available: " + ", ".join(model_names())):
        build_model("nope", (1, 8, 8), 10)


def test_largest_activation_is_the_biggest_layer_output_per_sample():
    # LEAF CNN: conv1's 32 channels at 28x28 (before pooling); ResNet-18 at 64x64: the stem's 64 channels
    assert largest_activation_bytes(build_model("cnn", (1, 28, 28), 10, seed=0), (1, 28, 28)) == 32 * 28 * 28 * 4
    assert largest_activation_bytes(build_model("resnet18", (3, 64, 64), 10, seed=0), (3, 64, 64)) == 64 * 64 * 64 * 4


@pytest.mark.parametrize(
    ("model", "shape", "device", "batch"),
    [
        ("cnn", (1, 28, 28), "cpu", 256),
        ("resnet18", (3, 64, 64), "cpu", 32),
        ("cnn", (1, 28, 28), "cuda", 2048),
        ("resnet18", (3, 64, 64), "cuda", 256),
    ],
)
def test_inference_batches_keep_the_largest_activation_within_the_budget(model, shape, device, batch):
    config = RunConfig(algorithm="fedavg", dataset="fashion_mnist", model=model, cut=1)
    blueprint = Blueprint(config, NoParams(), torch.device(device), shape, 10, torch.float32)
    assert blueprint.inference_batch == batch  # the largest power of two within the device's budget
    assert batch * largest_activation_bytes(build_model(model, shape, 10, seed=0), shape) <= INFERENCE_BUDGET[device]
    assert 2 * batch * largest_activation_bytes(build_model(model, shape, 10, seed=0), shape) > INFERENCE_BUDGET[device]


def test_inference_gives_every_submodule_its_own_mode_back():
    """A model that keeps a part in eval mode (a checkpoint's dropout, transformers' way) finds it
    in eval mode after `inference`, not switched on by a recursive train()."""
    from torch import nn

    from splitlab.models import inference

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5).eval())
    with inference(model):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == [True, True, False]
