"""The role boundary: transports give identical results, messages are checked, algorithms keep to verbs."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from helpers import crash_before_round, global_weights, personal_weights, quick, train
from splitlab import codec
from splitlab.algorithms import algorithm_names, algorithms
from splitlab.algorithms.base import Algorithm
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.roles import Role
from splitlab.rundir import CHECKPOINT
from splitlab.transport import Transport, verb

ALGORITHMS = algorithm_names()


def weights(experiment) -> dict[str, torch.Tensor]:
    if experiment.algorithm.personal_models:
        return {f"{k}.{name}": t for k, state in personal_weights(experiment).items() for name, t in state.items()}
    return global_weights(experiment)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_serialized_transport_is_bit_identical_to_direct(algorithm):
    """Every message through bytes and back changes nothing: no algorithm shares objects across
    the boundary. Same weights, metrics and ledger; the envelope bytes are the only addition."""
    config = (
        quick(algorithm=algorithm, clients=4, local_epochs=2, align_interval=1)
        if algorithm == "fsl_sage"
        else quick(algorithm=algorithm, clients=4, local_epochs=2)
    )
    direct = train(2, **config)
    serialized = train(2, transport="serialized", **config)
    a, b = weights(direct), weights(serialized)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for slot, module in direct.roles.server.models.items():  # the server part, also where it is not global
        a, b = module.state_dict(), serialized.roles.server.models[slot].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert evaluate(direct) == evaluate(serialized)
    assert direct.algorithm.pop_train_loss() == serialized.algorithm.pop_train_loss()
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()
    assert direct.ledger.envelope_bytes == 0
    assert serialized.ledger.envelope_bytes > serialized.ledger.total_bytes


def test_serialized_run_writes_the_same_files_and_reports_envelope_bytes(tmp_path):
    config = quick(algorithm="cycle_sfl", rounds=2)
    direct = run({**config, "out": str(tmp_path / "direct")}, progress=False)
    serialized = run({**config, "transport": "serialized", "out": str(tmp_path / "serialized")}, progress=False)
    assert serialized.pop("envelope_bytes") > serialized["total_bytes"] and "envelope_bytes" not in direct
    for key in ("final_accuracy", "final_loss", "total_bytes", "comm_bytes_by_kind"):
        assert direct[key] == serialized[key]


# --- messages ---------------------------------------------------------------------------------------


def test_codec_round_trips_nested_messages_exactly():
    message = {
        "smashed": torch.randn(3, 4),
        "labels": torch.tensor([1, 2, 3]),
        "step": 7,
        "lr": 0.1,
        "inf": float("inf"),
        "ids": [1, 2],
        "pair": (1, "a"),
        "none": None,
        "flag": True,
        "optimizer": {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": [{"params": [0]}]},
        "$odd": "key",
        "shared": None,
    }
    base = torch.arange(10.0)
    message["shared"] = [base[:4], base[2:6]]  # views of one storage
    back = codec.decode(codec.encode(message))
    assert back.keys() == message.keys()
    assert torch.equal(back["smashed"], message["smashed"]) and back["labels"].dtype == torch.int64
    assert back["optimizer"]["state"][0]["step"].item() == 2.0 and back["pair"] == (1, "a")
    assert back["inf"] == float("inf") and back["none"] is None and back["flag"] is True
    assert torch.equal(back["shared"][1], torch.tensor([2.0, 3.0, 4.0, 5.0]))


def test_a_snapshot_streamed_to_a_file_keeps_the_values_it_was_taken_with(tmp_path):
    # checkpoints: copied in the loop, written in the background while training changes the tensors
    from splitlab.io import write_safetensors

    base = torch.arange(12.0)
    weight = torch.arange(6.0).reshape(2, 3)
    message = {"views": [base[:4], base[2:6]], "transposed": weight.t(), "step": torch.tensor(3)}
    tensors, metadata = codec.flatten(message, copy=True)
    base.add_(100.0), weight.mul_(-1.0), message["step"].add_(1)  # training goes on
    write_safetensors(tmp_path / "snapshot", tensors, metadata)
    back = codec.decode((tmp_path / "snapshot").read_bytes())
    assert torch.equal(back["views"][0], torch.arange(4.0)) and torch.equal(back["views"][1], torch.arange(2.0, 6.0))
    assert torch.equal(back["transposed"], torch.arange(6.0).reshape(2, 3).t()) and back["step"].item() == 3
    assert (tmp_path / "snapshot").read_bytes() == codec.encode(codec.decode((tmp_path / "snapshot").read_bytes()))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage",
        b"\xff" * 16,
        codec.encode({"a": torch.ones(3)})[:-4],
        codec.encode({"a": 1}).replace(b"splitlab.skeleton", b"splitlab.skeletoN"),
    ],
)
def test_malformed_messages_are_refused(data):
    with pytest.raises(codec.MessageError, match="not a splitlab message"):
        codec.decode(data)


def test_a_message_with_a_forged_structure_is_refused():
    from safetensors.torch import save

    loose = save({"0": torch.ones(2), "1": torch.ones(2)}, metadata={"splitlab.skeleton": '{"a": {"$t": "0"}}'})
    with pytest.raises(codec.MessageError, match="tensors outside its structure"):
        codec.decode(loose)
    twice = save({"0": torch.ones(2)}, metadata={"splitlab.skeleton": '[{"$t": "0"}, {"$t": "0"}]'})
    with pytest.raises(codec.MessageError, match="unknown entry"):
        codec.decode(twice)


def test_only_plain_data_is_encoded():
    with pytest.raises(TypeError, match="cannot encode a Linear"):
        codec.encode({"model": torch.nn.Linear(2, 2)})


# --- checkpoints ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"", lambda b: b"garbage" * 10])
def test_resume_refuses_a_damaged_checkpoint_in_one_line(tmp_path, monkeypatch, damage):
    config = quick(algorithm="sfl_v2", rounds=3, checkpoint_every=0, out=str(tmp_path))
    crash_before_round(2, config, monkeypatch)
    path = tmp_path / CHECKPOINT
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UserError, match="cannot resume from .*checkpoint is unreadable.*overwrite=true") as error:
        run({**config, "resume": True}, progress=False)
    assert "\n" not in str(error.value)


# --- the boundary -------------------------------------------------------------------------------------

#: What only a role holds: an orchestrator that names one of these reaches into a role.
ROLE_INTERNALS = {
    "models",
    "optimizers",
    "stash",
    "blueprint",
    "x",
    "y",
    "buffers",
    "aux_models",
    "roles",
    "model",
    "optimizer",
    "load_copy",
    "next_batch",
    "scratch",
}
#: What only an orchestrator holds: a role that names one of these reaches across the boundary.
ORCHESTRATION = {"ctx", "client", "server", "sync", "client_proxies"}


def classes_of_algorithm_files() -> list[type]:
    modules = {inspect.getmodule(cls) for cls in algorithms().values()}
    return [
        obj
        for module in modules
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if obj.__module__ == module.__name__
    ]


def attributes(cls: type) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_algorithm_files_keep_to_their_side_of_the_boundary():
    orchestrators = [c for c in classes_of_algorithm_files() if issubclass(c, Algorithm)]
    roles = [c for c in classes_of_algorithm_files() if issubclass(c, Role)]
    assert len(orchestrators) >= 14 and len(roles) >= 8
    for cls in orchestrators:
        assert not attributes(cls) & ROLE_INTERNALS, f"{cls.__name__} touches {attributes(cls) & ROLE_INTERNALS}"
    for cls in roles:
        assert not attributes(cls) & ORCHESTRATION, f"{cls.__name__} touches {attributes(cls) & ORCHESTRATION}"


def test_the_boundary_check_catches_a_reach_into_a_role():
    class Cheat(Algorithm):
        def train_round(self, rnd, clients):
            self.server.models["server_model"].zero_grad()

    assert attributes(Cheat) & ROLE_INTERNALS == {"models"}


def test_a_proxy_exposes_verbs_only():
    experiment = train(0, **quick(algorithm="sfl_v2"))
    with pytest.raises(AttributeError, match="UShapedServer.models is not a verb"):
        experiment.algorithm.server.models  # noqa: B018
    with pytest.raises(AttributeError, match="UShapedClient.x is not a verb"):
        experiment.algorithm.client(0).x  # noqa: B018


def test_a_tensor_through_a_verb_without_a_ledger_kind_is_refused():
    class Leaky(Role):
        @verb()
        def leak(self) -> torch.Tensor:
            return torch.ones(3)

    experiment = train(0, **quick(algorithm="sfl_v2"))
    proxy = Transport(experiment.ledger, torch.device("cpu")).connect(Leaky(experiment.blueprint), counted=True)
    with pytest.raises(TypeError, match="declares no ledger kind"):
        proxy.leak()


@pytest.mark.parametrize("transport", ["direct", "serialized"])
def test_a_key_a_verb_does_not_return_is_one_line_naming_the_verb(transport):
    """U-shaped, the labels stay with the client: reading them from forward's message says so."""
    from splitlab.engine import build
    from splitlab.transport import MessageKeyError

    experiment = build(quick(algorithm="sfl_v2", cut="1,2", transport=transport))
    algorithm, client_id = experiment.algorithm, experiment.clients[0].id
    algorithm.download(client_id)
    algorithm.client(client_id).begin_round(0)
    sent = algorithm.client(client_id).forward(0)
    with pytest.raises(MessageKeyError) as error:
        sent["labels"]
    assert str(error.value) == "UShapedClient.forward returns no 'labels': its message holds smashed"
