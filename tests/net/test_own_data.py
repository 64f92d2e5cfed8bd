"""data=own: each client process reads only its own Fashion-MNIST files and reports what it holds;
the server reads only the test files. The run is bit for bit `splitlab run` on the same samples
as a partition; a client whose data does not fit the run is refused in one line, also when it
comes back to a resumed run with other samples."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import ServerThread, launch_in_threads, seeded_one_at_a_time
from safetensors.torch import load_file

from helpers import idx_bytes, quick
from splitlab.build import client_node
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused
from splitlab.net.launch import LaunchSettings
from splitlab.rundir import CHECKPOINT

CONFIG = dict(dataset="fashion_mnist", model="mlp", clients=2, rounds=2, batch_size=32, device="cpu", seed=0)
SKEWED = {"partition": "dirichlet:0.5"}  # how `run` splits the whole dataset: clients of unequal sizes


def write_fashion(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> Path:
    """`prefix` ("train" or "t10k") images and labels as Fashion-MNIST's IDX files, uncompressed."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{prefix}-images-idx3-ubyte").write_bytes(idx_bytes(images.astype(np.uint8)))
    (folder / f"{prefix}-labels-idx1-ubyte").write_bytes(idx_bytes(labels.astype(np.uint8)))
    return folder


@pytest.fixture
def dataset(tmp_path) -> dict[str, Path]:
    """A whole dataset (for `run`), its test files alone (the server's), and each client's
    partition of it written as that client's own training files."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 160)
    images = rng.integers(0, 60, (160, 28, 28)) + (labels[:, None, None] * 19)  # some signal per class
    whole = write_fashion(tmp_path / "whole", "train", images, labels)
    write_fashion(whole, "t10k", images[:40], labels[:40])
    write_fashion(tmp_path / "server", "t10k", images[:40], labels[:40])
    folders = {"whole": whole, "server": tmp_path / "server"}
    for k in range(2):
        node = client_node({**CONFIG, **SKEWED, "data_dir": str(whole)}, k)
        folders[f"client{k}"] = write_fashion(tmp_path / f"client-{k}", "train", node.x[:, 0].numpy(), node.y.numpy())
    return folders


def run_in_one_thread(config: dict) -> None:
    """`splitlab run`, with one torch thread like the processes (a matmul's sums in other orders
    differ in the last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(config, progress=False)
    finally:
        torch.set_num_threads(threads)


def identical_runs(one: Path, other: Path) -> bool:
    first, second = load_file(one / "weights.safetensors"), load_file(other / "weights.safetensors")
    keys = ("test_accuracy", "test_loss", "test_f1", "train_loss", "comm_bytes_by_kind")
    rows = [[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (one, other)]
    return (
        first.keys() == second.keys()
        and all(torch.equal(first[k], second[k]) for k in first)
        and [[row[k] for k in keys] for row in rows[0]] == [[row[k] for k in keys] for row in rows[1]]
        and json.loads((one / "partition.json").read_text()) == json.loads((other / "partition.json").read_text())
    )


def test_own_data_gives_what_run_gives_and_data_unlike_the_run_is_refused(tmp_path, dataset):
    """A client whose data is refused stops the server at once (one line naming it): the run
    cannot be planned without it. With the clients' true data, the run is `splitlab run`'s. (The
    server, the clients and `splitlab launch` in threads of this process; the next test's are
    processes.)"""
    make_certs(tmp_path / "certs", 2, [])
    own = {**CONFIG, "data": "own", "data_dir": str(dataset["server"])}
    refusing = ServerThread({**own, "out": str(tmp_path / "refused")}, tmp_path / "certs", join_timeout=120)
    small = write_fashion(tmp_path / "small", "train", np.zeros((20, 8, 8)), np.arange(20) % 10)
    refused = refusing.client(1, data="own", data_dir=str(small))
    ended = refusing.wait()
    why = "its data: its samples have shape [1, 8, 8]; fashion_mnist samples have [1, 28, 28]"
    assert isinstance(refused[0], UserError) and str(refused[0]) == f"the server refused client 1: {why}"
    assert isinstance(ended, UserError) and str(ended) == (
        f"client 1 was refused ({why}); with data=own the server needs every client's data before round 1"
    )
    out = tmp_path / "net"
    folders = LaunchSettings(data_dirs=f"{dataset['client0']},{dataset['client1']}")
    assert isinstance(launch_in_threads({**own, "out": str(out)}, {}, folders).ended[0], dict)
    run_in_one_thread({**CONFIG, **SKEWED, "data_dir": str(dataset["whole"]), "out": str(tmp_path / "run")})
    assert identical_runs(tmp_path / "run", out)
    sizes = json.loads((out / "partition.json").read_text())["sizes"]
    assert sum(sizes) == 160 and sizes[0] != sizes[1]  # FedAvg's weights |D_k| are the reported counts


def test_a_resumed_own_data_run_refuses_a_client_with_other_samples(tmp_path, dataset, servers):
    """A `splitlab server` process killed after its first checkpoint (its clients, in threads, give
    up on it at once: retry_seconds=0), resumed: a client with other samples is refused, and the
    run stops in one line; resumed again by what `splitlab launch` runs, in threads of this process,
    with the clients' true data: bit for bit `splitlab run`."""
    config = {**CONFIG, "rounds": 4}
    make_certs(tmp_path / "certs", 2, [])
    out = tmp_path / "net"
    own = {**config, "data": "own", "data_dir": str(dataset["server"]), "out": str(out)}
    first = servers(own)
    with seeded_one_at_a_time():
        clients = [
            threading.Thread(
                target=first.client_in_process,
                args=(k,),
                kwargs={"data": "own", "data_dir": str(dataset[f"client{k}"]), "retry_seconds": 0},
            )
            for k in range(2)
        ]
        for client in clients:
            client.start()
        while not (out / CHECKPOINT).exists():
            assert first.process.poll() is None
            time.sleep(0.05)
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait() == -signal.SIGKILL
        for client in clients:
            client.join()
    second = ServerThread({**own, "resume": True}, tmp_path / "certs")
    node = client_node({**CONFIG, **SKEWED, "data_dir": str(dataset["whole"])}, 1)
    fewer = write_fashion(tmp_path / "fewer", "train", node.x[1:, 0].numpy(), node.y[1:].numpy())
    refused = second.client(1, data="own", data_dir=str(fewer))
    ended = second.wait()  # at once, one line: the run cannot go on without client 1's data
    assert isinstance(refused[0], UserError) and str(refused[0]).startswith(
        f"the server refused client 1: its data: it holds {node.num_samples - 1} samples"
    )
    assert isinstance(ended, UserError) and str(ended).startswith(
        f"client 1 was refused (its data: it holds {node.num_samples - 1}"
    )
    folders = LaunchSettings(data_dirs=f"{dataset['client0']},{dataset['client1']}")
    assert isinstance(launch_in_threads({**own, "resume": True}, {}, folders).ended[0], dict)
    run_in_one_thread({**config, **SKEWED, "data_dir": str(dataset["whole"]), "out": str(tmp_path / "run")})
    assert identical_runs(tmp_path / "run", out)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"clients": "all"}, "clients=all cannot be used with data=own"),
        ({"train_subset": 50}, "train_subset=50 cannot be used with data=own"),
        ({"partition": "shards:2"}, "partition=shards:2 cannot be used with data=own"),
        ({"test_split": "client:0.2"}, "test_split=client:0.2 cannot be used with data=own"),
        ({"algorithm": "centralized"}, "algorithm=centralized pools the clients' samples in one node"),
        ({"dataset": "digits"}, "'digits' has no such files; allowed datasets: cifar10, cifar100, fashion_mnist"),
    ],
)
def test_a_server_refuses_what_data_own_cannot_do(tmp_path, keys, message):
    config = {**CONFIG, "data": "own", "out": str(tmp_path / "run"), **keys}
    with pytest.raises(UserError, match=message):
        build(config, transport=lambda ledger, device: pytest.fail("built a transport"))


@pytest.fixture(scope="module")
def checks() -> Checks:
    return Checks(build(quick(clients=2, train_subset=100)).blueprint)


GOOD = {"data": "partition", "input_shape": [1, 8, 8], "class_counts": [1, 0, 2, 0, 0, 0, 0, 0, 0, 3]}


@pytest.mark.parametrize(
    ("change", "expected", "message"),
    [
        ({"samples": 6}, None, "a report holds exactly data, input_shape and class_counts"),
        ({"data": "own"}, None, "the client was started with data='own'; this run has data=partition"),
        ({"input_shape": [1, 8]}, None, "its samples have shape [1, 8]; synthetic samples have [1, 8, 8]"),
        ({"input_shape": [1.0, 8, 8]}, None, "its samples have shape [1.0, 8, 8]"),
        ({"class_counts": [1] * 11}, None, "expected 10 counts (labels 0 to 9)"),
        ({"class_counts": [-1, 2] + [0] * 8}, None, "its class counts are [-1, 2,"),
        ({"class_counts": [True] + [0] * 9}, None, "its class counts are [True,"),
        ({"class_counts": [0] * 10}, None, "it holds no samples"),
        (
            {},
            {"class_counts": [1, 0, 2, 0, 0, 0, 0, 0, 1, 3]},
            "it holds 6 samples, [1, 0, 2, 0, 0, 0, 0, 0, 0, 3] by class; the run has 7",
        ),
    ],
)
def test_checks_refuse_reports_unlike_the_run(checks, change, expected, message):
    with pytest.raises(Refused, match=re.escape(message)):
        checks.report({**GOOD, **change}, expected)


def test_checks_accept_a_report_that_fits(checks):
    summary = {"class_counts": GOOD["class_counts"]}
    assert checks.report(GOOD, None) == checks.report(GOOD, summary) == summary
