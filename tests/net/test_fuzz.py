"""Property-based mutations of what clients send (hypothesis): the codec either decodes a message or
refuses it with a MessageError, and the server's checks either refuse a result (Refused) or pass one
the server can use, per verb and per algorithm family; never another exception."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import quick
from splitlab import codec
from splitlab.engine import build
from splitlab.net.checks import Checks, Refused

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
MESSAGE = codec.encode({"smashed": torch.ones(2, 3), "labels": torch.tensor([0, 1]), "n": [1, 2.5, None]})


def _with_skeleton(skeleton: str) -> bytes:
    from safetensors.torch import save

    return save({"0": torch.zeros(1)}, metadata={"splitlab.skeleton": skeleton})


@FUZZ
@given(st.data())
def test_the_codec_decodes_or_refuses_any_bytes(data):
    choice = data.draw(st.sampled_from(["bytes", "flip", "truncate", "skeleton"]))
    if choice == "bytes":
        buffer = data.draw(st.binary(max_size=256))
    elif choice == "flip":
        at = data.draw(st.integers(0, len(MESSAGE) - 1))
        buffer = MESSAGE[:at] + bytes([MESSAGE[at] ^ data.draw(st.integers(1, 255))]) + MESSAGE[at + 1 :]
    elif choice == "truncate":
        buffer = MESSAGE[: data.draw(st.integers(0, len(MESSAGE) - 1))]
    else:
        depth = data.draw(st.integers(1, 5000))
        skeleton = data.draw(
            st.sampled_from(
                [
                    "[" * depth + '{"$t":"0"}' + "]" * depth,
                    '{"a":{"$t":"0"},"a":1}',
                    '{"a":{"$t":"0"},"b":NaN}',
                    '{"a":{"$t":"0"},"b":-Infinity}',
                    '{"$d":[[1]],"x":{"$t":"0"}}',
                    '{"$t":"1"}',
                    json.dumps({"a": {"$t": "0"}, "s": "[[[[" * depth}),
                ]
            )
        )
        buffer = _with_skeleton(skeleton)
    with contextlib.suppress(codec.MessageError):
        codec.decode(buffer)


def test_the_codec_refuses_what_json_would_take():
    for skeleton, why in [
        ('{"a":{"$t":"0"},"a":1}', "a key given twice"),
        ('{"a":{"$t":"0"},"b":NaN}', "the literal NaN"),
        ("[" * 65 + '{"$t":"0"}' + "]" * 65, "nested deeper than 64"),
    ]:
        with pytest.raises(codec.MessageError, match=why):
            codec.decode(_with_skeleton(skeleton))
    nested_string = json.dumps({"a": {"$t": "0"}, "s": "[" * 500})  # brackets in a string do not nest
    assert codec.decode(_with_skeleton(nested_string))["s"] == "[" * 500


FAMILIES = {  # algorithm -> the keyed verb whose result the server uses, and its arguments
    "sfl_v2": ("forward", (0,)),
    "fedavg": ("local_step", ()),
    "cse_fsl": ("local_aux_step", (True,)),
    "splitgp": ("forward", (0,)),
}


@pytest.fixture(scope="module")
def honest() -> dict:
    """Per family: the checks, the verb's spec, and a client node's real result."""
    found = {}
    for algorithm, (verb, args) in FAMILIES.items():
        experiment = build(quick(algorithm=algorithm, clients=2, train_subset=100))
        node = experiment.roles.clients[0]
        node.begin_round(0)
        if algorithm in ("cse_fsl", "splitgp"):
            node.load("client_model", experiment.blueprint.initial_state("client_model"))
            node.load("aux_model", experiment.blueprint.initial_state("aux_model"))
        spec = getattr(type(node), verb).__verb__
        found[algorithm] = Checks(experiment.blueprint), spec, args, getattr(node, verb)(*args), experiment
    return found


def _mutate(data: st.DataObject, result: dict) -> dict:
    result = dict(result)
    key = data.draw(st.sampled_from(sorted(result)))
    how = data.draw(
        st.sampled_from(["drop", "add", "rename", "reshape", "retype", "nonfinite", "huge", "truncate", "other"])
    )
    value = result[key]
    if how == "drop":
        del result[key]
    elif how == "add":
        result[data.draw(st.sampled_from(["extra", "smashed", "loss", "labels", "cut_grad"]))] = torch.zeros(
            data.draw(st.integers(0, 70)), 3
        )
    elif how == "rename":
        result[key + "_"] = result.pop(key)
    elif how == "reshape":
        result[key] = value.reshape(-1) if value.dim() != 1 else value.reshape(1, -1)
    elif how == "retype":
        result[key] = value.to(data.draw(st.sampled_from([torch.float64, torch.float16, torch.int32, torch.bool])))
    elif how == "nonfinite" and value.is_floating_point():
        result[key] = torch.full_like(value, data.draw(st.sampled_from([float("nan"), float("inf")])))
    elif how == "huge":
        result[key] = torch.zeros(data.draw(st.integers(33, 200)), *value.shape[1:], dtype=value.dtype)
    elif how == "truncate" and value.dim() > 0:
        result[key] = value[: data.draw(st.integers(0, len(value) - 1))]
    elif how == "other":
        result[key] = data.draw(st.sampled_from([None, 3, "x", [1, 2], {"fp16": torch.zeros(2)}]))
    return result


@FUZZ
@given(st.data())
def test_mutated_results_are_refused_or_usable(honest, data):
    algorithm = data.draw(st.sampled_from(sorted(FAMILIES)))
    checks, spec, args, result, experiment = honest[algorithm]
    verb = FAMILIES[algorithm][0]
    mutated = _mutate(data, result)
    try:
        checks.result(verb, spec, args, codec.decode(codec.encode(mutated)))
    except (Refused, codec.MessageError):
        return
    server = experiment.roles.server  # accepted: the server can use it, as the algorithm would
    if "smashed" in mutated:
        reply = server.train_step(mutated["smashed"], mutated["labels"])
        assert reply["cut_grad"].shape[0] == len(mutated["labels"])
    if "loss" in mutated:
        assert mutated["loss"].dim() == 0


def test_every_family_accepts_its_honest_result(honest):
    for algorithm, (checks, spec, args, result, _) in honest.items():
        checks.result(FAMILIES[algorithm][0], spec, args, codec.decode(codec.encode(result)))
