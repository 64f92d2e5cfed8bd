"""secure_aggregation=true over gRPC with mutual TLS: every phase's messages (public keys, sealed
shares, the masked input, the unmasking's shares) pass the server's checks and give bit for bit
what `splitlab run` gives; a client that leaves after sending its masked input is still in the sum;
a malformed message is refused in one line and its sender dropped."""

from __future__ import annotations

import json
import re

import pytest
import torch
from processes import Node, Rogue, ServerThread, credentials, launch_in_threads, seeded_one_at_a_time
from safetensors.torch import load_file

from helpers import DropsOut, quick
from splitlab import codec
from splitlab.engine import build, run
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused
from splitlab.secure_aggregation import KEYS_BYTES, SEALED_BYTES, SHARE_BYTES

CONFIG = quick(algorithm="fedavg", clients=3, rounds=2, train_subset=150, test_subset=50, secure_aggregation=True)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(tmp_path, sent_unanswered: dict[str, int] | None = None) -> list[dict]:
    """The runs in tmp_path/net and tmp_path/local: the same weights, metrics and ledger (but for the
    bytes a networked server sent `sent_unanswered` to a client it then dropped, which in process
    never leave: DropsOut drops the client before its call); the net one's rows."""
    net, local = (load_file(tmp_path / d / "weights.safetensors") for d in ("net", "local"))
    assert net.keys() == local.keys() and all(torch.equal(net[k], local[k]) for k in local)
    for a, b in zip(rows(tmp_path / "net"), rows(tmp_path / "local"), strict=True):
        for key in ("test_accuracy", "test_loss", "train_loss"):
            assert a[key] == b[key], key
        sent = {kind: count + (sent_unanswered or {}).get(kind, 0) for kind, count in b["comm_bytes_by_kind"].items()}
        assert a["comm_bytes_by_kind"] == sent
    return rows(tmp_path / "net")


@pytest.mark.parametrize(
    ("algorithm", "slots", "clients", "neighbours"), [("fedavg", 1, 3, 2), ("cse_fsl", 2, 3, 2), ("fedavg", 1, 5, 2)]
)
def test_secure_aggregation_over_grpc_is_bit_identical_to_run(tmp_path, algorithm, slots, clients, neighbours):
    """The masks cancel exactly in the ring, so the keys each side draws do not matter: the same
    weights as in process, and the same bytes by kind (2 rounds; CSE-FSL: its client part and its
    auxiliary model, each with a protocol of its own; 5 clients: SecAgg+'s graph, 2 neighbours each)."""
    config = {**CONFIG, "algorithm": algorithm, "clients": clients}
    if neighbours < clients - 1:
        config["secagg_neighbours"] = neighbours
    assert isinstance(launch_in_threads({**config, "out": str(tmp_path / "net")}).ended[0], dict)
    run({**config, "out": str(tmp_path / "local")}, progress=False)
    net = assert_same_run(tmp_path)
    assert [row["dropped_clients"] for row in net] == [[], []]
    kinds = net[-1]["comm_bytes_by_kind"]
    assert kinds["secagg_shares_up"] == slots * 2 * clients * neighbours * SEALED_BYTES  # slots x rounds x ...
    assert kinds["secagg_unmask_up"] == slots * 2 * clients * (neighbours + 1) * SHARE_BYTES
    assert "client_model_up" in kinds  # the masked inputs, counted as the slot's uploads


@pytest.mark.parametrize("sparse", [False, True])
@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_client_that_leaves_after_masking_over_grpc_is_in_the_sum(tmp_path, sparse):
    """Client 2 (a real node, answering by hand) sends its masked input, then its process is gone
    (at the round's end, before the unmasking): the others' shares rebuild its self-mask seed and
    the round completes with every part, as in process when client 2 leaves at that call. Sparse:
    4 clients with 2 neighbours each (SecAgg+), client 2's seed rebuilt from its two neighbours'."""
    config = {**CONFIG, "rounds": 1, **({"clients": 4, "secagg_neighbours": 2} if sparse else {})}
    clients = config["clients"]
    make_certs(tmp_path / "certs", clients, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=1, join_timeout=60)
    honest = [server.client(k) for k in range(clients) if k != 2]
    leaving = Node(server.address, tmp_path / "certs", 2)
    leaving.answer_until("end_round", round=0)  # its masked input sent; gone without a reply
    leaving.leave()
    assert isinstance(server.wait(), dict) and honest == [[0]] * (clients - 1), (server.ended, server.lines)
    run(
        {**config, "out": str(tmp_path / "local")},
        progress=False,
        transport=DropsOut.at_call(client=2, verbs=("end_round",)),
    )
    net = assert_same_run(tmp_path)
    assert net[0]["dropped_clients"] == [[1, 2]]
    # the others answered, each for itself and its 2 neighbours
    assert net[0]["comm_bytes_by_kind"]["secagg_unmask_up"] == (clients - 1) * 3 * SHARE_BYTES


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_malformed_secure_aggregation_message_is_refused_in_one_line(tmp_path):
    """A certified client's sealed shares one byte short: refused by the server's checks before
    anything uses them, its sender dropped in one line; the honest two finish the round masking
    with each other only, as in process when client 2 leaves at that call."""
    config = {**CONFIG, "rounds": 1}
    make_certs(tmp_path / "certs", 3, [])
    server = ServerThread({**config, "out": str(tmp_path / "net")}, tmp_path / "certs", rejoin_wait=1, join_timeout=60)
    honest = [server.client(0), server.client(1)]
    rogue = Rogue(server.address, credentials(tmp_path / "certs", "client-2"), 2)
    assert rogue.first_reply().kind == 2  # WELCOME
    rogue.serve_as_node(
        lambda verb, result: {k: sealed[:-1] for k, sealed in result.items()} if verb == "secagg_shares" else result
    )
    rogue.close()
    assert isinstance(server.wait(), dict) and honest == [[0], [0]], (server.ended, server.lines)
    refused = [line for line in server.lines if "refused the result of secagg_shares from client 2" in line]
    assert len(refused) == 1 and f"expected torch.uint8 ({SEALED_BYTES},)" in refused[0], server.lines
    run(
        {**config, "out": str(tmp_path / "local")},
        progress=False,
        transport=DropsOut.at_call(client=2, verbs=("secagg_shares",)),
    )
    unanswered = {"secagg_keys_down": 3 * KEYS_BYTES}  # the round's public keys, sent to client 2 before it was refused
    assert assert_same_run(tmp_path, unanswered)[0]["dropped_clients"] == [[1, 2]]


def test_each_phase_s_honest_message_passes_the_checks_and_its_malformed_forms_are_refused():
    """The server's checks of every secure aggregation message (as it crosses: encoded, decoded),
    against the honest result of a real node of a 3-client run."""
    experiment = build(quick(algorithm="fedavg", clients=3, train_subset=60, secure_aggregation=True))
    checks, nodes, slot = Checks(experiment.blueprint), experiment.roles.clients, "client_model"
    for node in nodes:
        node.begin_round(0)
    public = {str(node.id): node.secagg_keys(slot) for node in nodes}
    sealed = {node.id: node.secagg_shares(slot, public) for node in nodes}
    for node in nodes:
        node.secagg_receive(slot, {str(u): shares[str(node.id)] for u, shares in sealed.items() if u != node.id})
    survivors, dropped = torch.tensor([0, 1]), torch.tensor([2])
    elements = sum(t.numel() for t in experiment.blueprint.initial_state(slot).values())
    cases = {  # verb: (its arguments, client 0's honest result, malformed forms with the refusal each gets)
        "secagg_keys": (
            (slot,),
            public["0"],
            [(public["0"][:-1], "secagg_keys is torch.uint8 (63,), expected torch.uint8 (64,)")],
        ),
        "secagg_shares": (
            (slot, public),
            sealed[0],
            [
                ({**sealed[0], "0": sealed[0]["1"]}, "secagg_shares holds ['0', '1', '2'], expected ['1', '2']"),
                ({"1": sealed[0]["1"]}, "secagg_shares holds ['1'], expected ['1', '2']"),
                (
                    {**sealed[0], "1": sealed[0]["1"].int()},
                    f"secagg_shares.1 is torch.int32 ({SEALED_BYTES},), expected torch.uint8",
                ),
            ],
        ),
        "upload_masked": (
            (slot, 0.5),
            nodes[0].upload_masked(slot, 0.5),
            [
                (torch.zeros(elements, dtype=torch.int64), f"expected torch.int32 ({elements},)"),
                (torch.zeros(elements + 1, dtype=torch.int32), f"expected torch.int32 ({elements},)"),
                (torch.zeros(elements), f"expected torch.int32 ({elements},)"),
            ],
        ),
        "secagg_unmask": (
            (slot, survivors, dropped),
            nodes[0].secagg_unmask(slot, survivors, dropped),
            [
                ({"b2": torch.zeros(SHARE_BYTES, dtype=torch.uint8)}, "expected some of ['b0', 'b1', 's2']"),
                ({"b0": torch.zeros(SHARE_BYTES + 1, dtype=torch.uint8)}, f"expected torch.uint8 ({SHARE_BYTES},)"),
            ],
        ),
    }
    for verb, (args, result, malformed) in cases.items():
        spec = getattr(type(nodes[0]), verb).__verb__
        checks.result(verb, spec, args, codec.decode(codec.encode(result)), client_id=0)
        for bad, refusal in malformed:
            with pytest.raises(Refused, match=re.escape(refusal)):
                checks.result(verb, spec, args, codec.decode(codec.encode(bad)), client_id=0)
    with pytest.raises(Refused, match="secagg_keys of 'server_model', which the sync server does not average"):
        checks.result("secagg_keys", type(nodes[0]).secagg_keys.__verb__, ("server_model",), public["0"], client_id=0)
