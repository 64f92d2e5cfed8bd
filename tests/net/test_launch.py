"""`splitlab launch`: a server and its clients over loopback gRPC with mutual TLS give bit for bit
what `splitlab run` gives, and the wire figures sit beside the ledger's. One case launches real
processes (`launch`); the others run what it runs in threads of this process (`launch_in_threads`:
the same server, clients, certificates and checks, without three processes' start-up each)."""

from __future__ import annotations

import json

import pytest
from processes import launch_in_threads
from safetensors.torch import load_file

from helpers import quick
from splitlab.engine import run
from splitlab.net.launch import LaunchSettings, launch


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("algorithm", "defense", "server_keys"),
    [
        # chunk_kib=4: the model, the smashed data and the gradients of SFL-V1 all go in chunks (a
        # batch of the MLP's cut activations, 32 x 200 float32, is over 4 KiB: whole, it is refused)
        ("sfl_v1", "none", {"chunk_kib": 4}),
        ("fedavg", "none", {}),
        ("fsl_sage", "none", {}),
        # SFL-V2's messages compressed: the compressed forms pass the server's checks (plain ones: the
        # cases above)
        ("sfl_v2", "clip:5+noise:2+topk:0.5+quantize:int8", {}),
    ],
    ids=["sfl_v1-chunked", "fedavg", "fsl_sage", "sfl_v2-compressed"],
)
def test_launch_is_bit_identical_to_run(tmp_path, algorithm, defense, server_keys):
    config = quick(algorithm=algorithm, clients=2, train_subset=160, test_subset=100, defense=defense)
    if defense != "none":  # a run's own noise keys differ from run to run: fixed here to compare the two
        config["noise_key"] = "fixed"
    if algorithm == "fsl_sage":
        config["align_interval"] = 1
    # SFL-V1 in chunks in real processes: `splitlab server` and `splitlab client` as launch starts them
    assert_launch_equals_run(tmp_path, config, server_keys, processes=algorithm == "sfl_v1")


@pytest.mark.parametrize(("algorithm", "precision"), [("psl", "fp16"), ("cycle_sfl", "fp16")])
def test_u_shaped_launch_is_bit_identical_to_run(tmp_path, algorithm, precision):
    """The two extra messages of a U-shaped step (the server's output down, the gradient at the
    second cut up; CycleSL: its tails' shares of the server task and ServerGrad) pass the
    server's checks; no labels cross. (U-shaped cycle_sfl stands for vanilla cycle_sfl too: the
    same client verbs and more, at the cost of one launch.) In fp16: float16 hidden states both
    ways, both gradients scaled with their scales (CycleSL's tails' too), each role's loss scale,
    over gRPC as in process."""
    config = quick(algorithm=algorithm, cut="1,2", clients=2, train_subset=160, test_subset=100, precision=precision)
    kinds = assert_launch_equals_run(tmp_path, config)
    models = {"client_model_down", "client_model_up"} if algorithm == "cycle_sfl" else set()
    assert set(kinds) == {"smashed", "server_output", "tail_grad", "cut_grad", *models}


def test_global_clipping_a_kept_optimizer_and_a_step_schedule_over_grpc_are_bit_identical_to_run(tmp_path):
    """The norms across the cut (grad_norm_down, grad_norm_up: each checked) and the clients' kept
    optimizer states (checkpointed every round: checked) over gRPC, with a per-step schedule."""
    config = quick(
        algorithm="sfl_v2", clients=2, train_subset=160, test_subset=100, max_grad_norm=0.1, clip_scope="global",
        keep_client_optimizer=True, warmup_steps=3, lr_decay="cosine", checkpoint_every=0,
    )  # fmt: skip
    kinds = assert_launch_equals_run(tmp_path, config)
    assert kinds["grad_norm_down"] == kinds["grad_norm_up"] == 4 * 2 * 3 * 2  # 4 bytes, 2 clients x 3 steps x 2 rounds


def assert_launch_equals_run(
    tmp_path, config: dict, server_keys: dict | None = None, processes: bool = False
) -> dict[str, int]:
    """`launch` (its server with `server_keys`; in processes, or in threads of this one) and `run`
    of `config` agree bit for bit; the ledger's bytes by kind."""
    run({**config, "out": str(tmp_path / "run")}, progress=False)
    net = {**config, "out": str(tmp_path / "net")}
    if processes:
        assert launch(net, server_keys or {}, LaunchSettings(), progress=False) == 0
    else:
        assert isinstance(launch_in_threads(net, server_keys).ended[0], dict)
    here, there = (
        load_file(tmp_path / "run" / "weights.safetensors"),
        load_file(tmp_path / "net" / "weights.safetensors"),
    )
    assert here.keys() == there.keys() and all((here[k] == there[k]).all() for k in here)
    for a, b in zip(rows(tmp_path / "run"), rows(tmp_path / "net"), strict=True):
        for key in ("test_accuracy", "test_loss", "test_f1", "train_loss", "comm_bytes_by_kind"):
            assert a[key] == b[key]
        assert b["dropped_clients"] == [] and "wire_bytes" not in a
    summary = json.loads((tmp_path / "net" / "summary.json").read_text())
    here_summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["comm_bytes_by_client"] == here_summary["comm_bytes_by_client"]  # counted by client id alike
    assert sum(summary["comm_bytes_by_client"].values()) == summary["total_bytes"]
    # every tensor the ledger counts crossed, inside codec messages inside protobuf envelopes
    assert summary["wire_bytes"] > summary["envelope_bytes"] > summary["total_bytes"]
    return summary["comm_bytes_by_kind"]


def test_vertical_launch_is_bit_identical_to_run(tmp_path):
    """A vertical run with one process per party: the private set intersection's messages (party 1,
    the label holder, asking party 0 and answering it), each party's embeddings of its own shape,
    the labels and the gradients pass the server's checks, and give what one process gives."""
    config = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", labels_at=1)
    kinds = assert_launch_equals_run(tmp_path, {**config, "rounds": 2, "local_steps": 2, "device": "cpu", "seed": 0})
    assert set(kinds) == {"psi_up", "psi_down", "smashed", "labels", "cut_grad"}


def test_the_federated_strategies_over_the_network_are_bit_identical_to_run(tmp_path):
    """FedAdam in the sync server's averaging, FedProx in the clients' steps, SCAFFOLD's control
    variates down and up (each checked by the server) and in the clients' checkpointed state."""
    config = quick(algorithm="sfl_v2", clients=2, train_subset=160, test_subset=100, optimizer="sgd", lr=0.05)
    config.update(server_opt="adam", server_opt_lr=0.01, prox_mu=0.1, scaffold=True)
    kinds = assert_launch_equals_run(tmp_path, config)
    assert kinds["control_down"] == kinds["control_up"] == kinds["client_model_down"]
