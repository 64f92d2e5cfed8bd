"""Dropouts: a client that goes silent mid-round is dropped and the round completes without it,
FedAvg renormalised over those that finished (bit for bit what the engine does in process when
that client leaves at the same point); it may rejoin; below min_clients the run stops cleanly.
The server and its clients run in threads of this process (`ServerThread`: real gRPC, mutual TLS),
but for the client process killed with SIGKILL, which is what its test is about."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
from processes import NONE, ClientThread, Node, Rogue, ServerThread, credentials, seeded_one_at_a_time
from safetensors.torch import load_file

from helpers import DropsOut, quick
from splitlab.engine import run
from splitlab.errors import NonFiniteLoss
from splitlab.net.certs import make_certs
from splitlab.roles import ModelAverage


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_silent_client_is_dropped_the_round_completes_and_it_rejoins(tmp_path):
    config = quick(clients=3, rounds=2, train_subset=150, test_subset=50)
    make_certs(tmp_path / "certs", 3, [])
    keys = dict(heartbeat=0.5, rejoin_wait=60, join_timeout=60)
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", **keys)
    honest = [server.client(0), server.client(1)]
    silent = Rogue(server.address, credentials(tmp_path / "certs", "client-2"), 2)
    assert silent.first_reply().kind == 2  # WELCOME
    gone_quiet = threading.Event()

    def answer(call: Any) -> bytes:
        if call.verb == "forward":
            gone_quiet.set()
            threading.Event().wait()  # never answers, never sends a heartbeat
        return NONE

    threading.Thread(target=silent.serve, args=(answer,), daemon=True).start()
    server.wait_for_log("dropped client 2: no heartbeat")
    back = server.client(2)
    assert isinstance(server.wait(), dict) and honest == [[0], [0]] and back == [0], (server.ended, server.lines)

    run({**config, "out": str(tmp_path / "local")}, progress=False, transport=DropsOut.at_call(at=1))
    net, local = (
        load_file(tmp_path / "net" / "weights.safetensors"),
        load_file(tmp_path / "local" / "weights.safetensors"),
    )
    assert all(torch.equal(net[k], local[k]) for k in local)
    rows = [json.loads(line) for line in (tmp_path / "net" / "metrics.jsonl").read_text().splitlines()]
    local_rows = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [[[1, 2]], []]
    assert [r["comm_bytes_by_kind"] for r in rows] == [r["comm_bytes_by_kind"] for r in local_rows]


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def a_rogue_among_honest_clients(tmp_path, smashed: Callable[[torch.Tensor], torch.Tensor]) -> list[str]:
    """A one-round run of 3 clients over the network where certified client 2 answers every
    `forward` with `smashed(its smashed data)`: the honest clients must finish it (exit 0) with the
    weights of a run where client 2 left at that call; returns the server's lines."""
    config = quick(clients=3, rounds=1, train_subset=150, test_subset=50)
    make_certs(tmp_path / "certs", 3, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=1, join_timeout=60)
    honest = [server.client(0), server.client(1)]
    rogue = Rogue(server.address, credentials(tmp_path / "certs", "client-2"), 2)
    assert rogue.first_reply().kind == 2  # WELCOME
    rogue.serve_as_node(  # until the server ends its stream
        lambda verb, result: {**result, "smashed": smashed(result["smashed"])} if verb == "forward" else result
    )
    rogue.close()
    assert isinstance(server.wait(), dict) and honest == [[0], [0]], (server.ended, server.lines)
    rows = [json.loads(line) for line in (tmp_path / "net" / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [[[1, 2]]]
    run({**config, "out": str(tmp_path / "local")}, progress=False, transport=DropsOut.at_call(at=1))
    net, local = (load_file(tmp_path / d / "weights.safetensors") for d in ("net", "local"))
    assert net.keys() == local.keys() and all(torch.equal(net[k], local[k]) for k in local)
    return server.lines


def test_a_client_whose_data_makes_the_server_non_finite_is_dropped_not_the_run(tmp_path):
    """A certified client sends smashed data of 1e30: finite, so it passes the checks, but the
    server's gradient norm overflows. The server's step is refused before its optimizer steps, the
    client is dropped with one line and its stream ended; the honest clients finish the run with
    the weights of a run where it left at that call."""
    lines = a_rogue_among_honest_clients(tmp_path, lambda smashed: torch.full_like(smashed, 1e30))
    drops = [line for line in lines if "dropped client 2" in line]
    assert len(drops) == 1 and "train_step made the server's gradient norm inf" in drops[0], drops


def test_a_malformed_result_is_refused_before_use_and_the_honest_clients_end_as_if_it_left(tmp_path):
    """Issue 24: a certified client's malformed result (a NaN) is refused by the server's checks
    before anything uses it (the rogue-protocol fuzz test shows the same drop for every kind of
    malformed result): one line, and the honest clients' final weights are those of a run where it
    left at that call, bit for bit."""
    lines = a_rogue_among_honest_clients(
        tmp_path, lambda smashed: smashed.index_fill(0, torch.tensor([0]), float("nan"))
    )
    assert len([line for line in lines if "refused the result of forward from client 2" in line]) == 1


def test_when_no_client_is_left_after_such_a_drop_the_run_stops_as_diverged(tmp_path):
    config = quick(clients=1, rounds=2, train_subset=100, test_subset=50)
    make_certs(tmp_path / "certs", 1, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=1, join_timeout=60)
    rogue = Rogue(server.address, credentials(tmp_path / "certs", "client-0"), 0)
    assert rogue.first_reply().kind == 2  # WELCOME
    rogue.serve_as_node(
        lambda verb, result: {**result, "smashed": result["smashed"] * 1e30} if verb == "forward" else result
    )
    rogue.close()
    stopped = server.wait()  # what `splitlab server` prints as its one error line, exiting with its exit_code
    assert isinstance(stopped, NonFiniteLoss) and stopped.exit_code == 3 and "\n" not in str(stopped)
    assert str(stopped).startswith("round 1: no client is left: client(s) 0 dropped, their data made the server's loss")


def test_below_min_clients_the_run_stops_with_one_line(tmp_path, servers):
    """A `splitlab client` process killed (SIGKILL) mid-run: the server drops it, waits rejoin_wait
    for it, and stops with one line as `splitlab server` does (exit code 4), its other client told."""
    config = quick(clients=2, rounds=50, train_subset=400, test_subset=50, eval_every=50)
    make_certs(tmp_path / "certs", 2, [])
    server = servers({**config, "out": str(tmp_path / "net")}, min_clients=2, rejoin_wait=0.5, join_timeout=60)
    staying, killed = ClientThread(server, 0), server.client(1)
    server.wait_for_log("client 1 holds")
    killed.send_signal(signal.SIGKILL)
    assert server.process.wait() == 4
    waits = [
        float(m[1]) for line in server.lines() if (m := re.search(r"client 1 is not .* \(waited ([\d.]+) s", line))
    ]
    assert all(wait < 30 for wait in waits)  # both had joined: rejoin_wait, not join_timeout=60
    errors = [line for line in server.lines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(
        r"error: round \d+: only 1 of 2 clients finished \(dropped: 1\), fewer than min_clients=2", errors[0]
    )
    assert staying.wait() == 0  # told BYE


def test_an_average_missing_a_contribution_is_renormalised_over_the_others():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    average = ModelAverage()
    average.add(a, 0.2)
    average.add(b, 0.6)  # the third client (0.2) dropped out
    average.incomplete = True
    assert torch.allclose(average.result(a)["w"], torch.tensor([2.5, 5.0]))


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_psl_client_that_leaves_mid_round_rejoins_with_its_own_client_part(tmp_path):
    """PSL over the network: client 2 (a real node, answering by hand) leaves at its second
    forward of round 2, and a fresh `splitlab client` takes its place. The round completes without
    it (its server copy left out), and the new node gets client 2's part as checkpointed after
    round 1: the same metrics and ledger as in process (helpers.DropsOut)."""
    config = quick(algorithm="psl", clients=3, rounds=3, train_subset=150, test_subset=50, checkpoint_every=0)
    make_certs(tmp_path / "certs", 3, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=60, join_timeout=60)
    honest = [server.client(0), server.client(1)]
    leaving = Node(server.address, tmp_path / "certs", 2)
    leaving.answer_until("forward", round=1, nth=2)  # gone, without a reply
    leaving.leave()
    back = server.client(2)  # a fresh node in its place
    assert isinstance(server.wait(), dict) and honest == [[0], [0]] and back == [0], (server.ended, server.lines)

    run({**config, "out": str(tmp_path / "local")}, progress=False, transport=DropsOut.at_call(round=1, at=2))
    net, local = (
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("net", "local")
    )
    assert [row["dropped_clients"] for row in net] == [[], [[2, 2]], []]
    for key in ("test_accuracy", "test_loss", "test_f1", "test_mcc", "train_loss", "comm_bytes_by_kind"):
        assert [row[key] for row in net] == [row[key] for row in local]
    assert net[-1]["comm_bytes_by_kind"]["kept_state_down"] > 0


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_vertical_party_that_leaves_mid_round_rejoins_aligned_again(tmp_path):
    """A vertical run, one node per party: party 0 (a real node, answering by hand) leaves at its
    second embedding of round 2, and a fresh `splitlab client` takes its place. The server
    goes on with zeros for its embedding for the rest of the round; the new node gets party 0's
    state as checkpointed after round 1 and is aligned anew by PSI (counted): the metrics, ledger
    and weights of the same dropout in process (helpers.DropsOut building the party afresh)."""
    config = dict(
        setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", labels_at=1, device="cpu", seed=0
    )
    config.update(rounds=3, local_steps=3, checkpoint_every=0)
    make_certs(tmp_path / "certs", 2, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=60, join_timeout=60)
    leaving = Node(server.address, tmp_path / "certs", 0)
    labels = server.client(1)
    leaving.answer_until("forward", round=1, nth=2)
    leaving.leave()
    back = server.client(0)
    assert isinstance(server.wait(), dict) and back == [0] and labels == [0], (server.ended, server.lines)

    dropout = DropsOut.at_call(client=0, round=1, at=2, config=config)
    run({**config, "out": str(tmp_path / "local")}, progress=False, transport=dropout)
    net, local = (
        [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("net", "local")
    )
    assert [row["dropped_clients"] for row in net] == [[], [[2, 0]], []]
    for key in ("test_accuracy", "test_loss", "train_loss", "comm_bytes_by_kind"):
        assert [row[key] for row in net] == [row[key] for row in local], key
    # back for the evaluation after round 2 (which asks every party for its test embeddings): its
    # state given, then aligned again
    psi = [row["comm_bytes_by_kind"]["psi_up"] for row in net]
    kept = [row["comm_bytes_by_kind"].get("kept_state_down", 0) for row in net]
    assert psi[0] < psi[1] == psi[2] and kept[0] == 0 < kept[1] == kept[2]
    weights = [load_file(tmp_path / name / "weights.safetensors") for name in ("net", "local")]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
