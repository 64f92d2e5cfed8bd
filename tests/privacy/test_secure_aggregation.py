"""secure_aggregation=true (splitlab.secure_aggregation): the sync server averages what it cannot
read, and gets the plain average to within the fixed point's bound; every phase is counted; a
client that drops after masking is still in the sum, one that drops before is left out. With
secagg_neighbours=k (SecAgg+) the same over a seeded k-regular graph, a client's bytes growing with k."""

from __future__ import annotations

import pytest
import torch

from helpers import DropsOut, global_weights, max_abs_difference, quick
from splitlab.algorithms.base import STREAM_SECAGG_GRAPH
from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.resolve import resolve_config
from splitlab.roles import SyncServer, random_stream
from splitlab.secure_aggregation import FRACTION_BITS, SEALED_BYTES, SHARE_BYTES, neighbourhoods, quantise
from splitlab.transport import SerializedTransport

ONE_ROUND = quick(rounds=1, local_epochs=1)
#: the fixed point's bound on each element of a round's average: n clients' roundings of 2^-17 each
#: (float32's own rounding of the result is far below it)
BOUND = 3 * 2.0 ** -(FRACTION_BITS + 1) + 1e-6


def one_round(transport=None, **overrides):
    experiment = build({**ONE_ROUND, **overrides}, transport)
    experiment.algorithm.run_round(0, experiment.clients)
    return experiment


@pytest.mark.parametrize(("algorithm", "slots"), [("fedavg", 1), ("sfl_v2", 1), ("cse_fsl", 2)])
def test_the_average_is_the_plain_one_within_the_bound_and_every_phase_is_counted(algorithm, slots):
    plain = one_round(algorithm=algorithm)
    secure = one_round(algorithm=algorithm, secure_aggregation=True)
    assert 0 < max_abs_difference(global_weights(plain), global_weights(secure)) <= BOUND
    counted, n = secure.ledger.bytes_by_kind, 3
    assert counted["secagg_keys_up"] == slots * n * 64  # two X25519 public keys each
    assert counted["secagg_keys_down"] == slots * n * n * 64  # everyone's, to each
    assert counted["secagg_shares_up"] == counted["secagg_shares_down"] == slots * n * (n - 1) * SEALED_BYTES
    assert counted["secagg_unmask_down"] == slots * n * n * 8  # the survivors' ids
    assert counted["secagg_unmask_up"] == slots * n * n * SHARE_BYTES  # a share of each survivor's self-mask seed
    for kind in ("client_model_up", "aux_model_up"):  # the masked input: 4 bytes an element, as float32
        assert counted.get(kind) == plain.ledger.bytes_by_kind.get(kind)


@pytest.mark.parametrize("sparse", [{}, {"clients": 5, "secagg_neighbours": 2}])
def test_what_the_sync_server_receives_does_not_correlate_with_the_client_parts(monkeypatch, sparse):
    received, parts = [], []
    original = SyncServer.add_masked

    def spy(self, slot, client_id, masked, alpha):
        received.append(masked.clone())
        return original(self, slot, client_id, masked, alpha)

    spy.__verb__ = original.__verb__  # type: ignore[attr-defined]
    monkeypatch.setattr(SyncServer, "add_masked", spy)
    experiment = one_round(algorithm="fedavg", secure_aggregation=True, **sparse)
    for node, alpha in zip(experiment.roles.clients, experiment.algorithm.ctx.weights(experiment.clients)):
        parts.append(
            quantise(torch.cat([t.reshape(-1).double() for t in node.upload("client_model").values()]) * alpha)
        )
    assert len(received) == len(experiment.clients) and all(r.dtype == torch.int32 for r in received)
    for masked, part in zip(received, parts):
        ring = masked.to(torch.int64) % 2**32  # the ring's elements the server holds
        correlation = torch.corrcoef(torch.stack([ring.double(), part.double()]))[0, 1]
        assert abs(float(correlation)) < 0.05  # ~ 1 / sqrt(n) for n = 66,250 elements: about 0.004
        assert abs(float(ring.double().mean()) / 2**32 - 0.5) < 0.01  # uniform over the ring
        assert not torch.equal(ring, part)


def test_a_client_that_drops_after_masking_is_in_the_sum():
    """Client 2 sends its masked input, then leaves before the unmasking: the two others' shares (the
    threshold: 2 of 3) rebuild its self-mask seed, and the round's sum holds all three parts."""
    plain = one_round(algorithm="fedavg")
    dropped = one_round(
        DropsOut.at_call(client=2, verbs=("secagg_unmask",)), algorithm="fedavg", secure_aggregation=True
    )
    assert dropped.algorithm.dropped == {2}
    assert max_abs_difference(global_weights(plain), global_weights(dropped)) <= BOUND
    assert dropped.ledger.bytes_by_kind["secagg_unmask_up"] == 2 * 3 * SHARE_BYTES


def test_a_client_that_drops_before_masking_is_left_out_and_its_masks_removed():
    """Client 2 leaves at its masked upload: the others' shares of its mask key remove the pairwise
    masks it left in theirs, and the average is the survivors', renormalised (as without secure
    aggregation when client 2 leaves at its upload)."""
    plain = one_round(DropsOut.at_call(client=2, verbs=("upload",)), algorithm="sfl_v2")
    secure = one_round(
        DropsOut.at_call(client=2, verbs=("upload_masked",)), algorithm="sfl_v2", secure_aggregation=True
    )
    assert plain.algorithm.dropped == secure.algorithm.dropped == {2}
    assert max_abs_difference(global_weights(plain), global_weights(secure)) <= 1.5 * BOUND  # 2 roundings / (2/3)
    assert secure.ledger.bytes_by_kind["secagg_unmask_up"] == 2 * 3 * SHARE_BYTES  # b of 0 and 1, s of 2


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"algorithm": "psl"}, "every client keeps its own client part"),
        ({"algorithm": "fedavg", "scaffold": True, "optimizer": "sgd"}, "Delta c_i would reach"),
        ({"algorithm": "sfl_v1", "backend": "ray"}, "simulated in process"),
        ({"algorithm": "sfl_v2", "clients": 4, "participation": 0.5}, "a round of 2 client"),
    ],
)
def test_secure_aggregation_where_it_cannot_hold_is_refused_in_one_line(settings, refusal):
    with pytest.raises(UserError, match=f"secure_aggregation=true does not apply to algorithm=.*{refusal}"):
        resolve_config(quick(secure_aggregation=True, **settings))


def test_with_fewer_answers_than_the_threshold_the_round_stops_in_one_line():
    """A round driven by hand up to the unmasking, where only client 0 answers (t = 2 of 3)."""
    experiment = build({**ONE_ROUND, "algorithm": "fedavg", "secure_aggregation": True})
    algorithm = experiment.algorithm
    for client in experiment.clients:
        algorithm.client(client.id).begin_round(0)
    algorithm.secure_setup(0, experiment.clients, "client_model")
    for client, alpha in zip(experiment.clients, algorithm.ctx.weights(experiment.clients)):
        algorithm.contribute(client.id, alpha)
    answer = algorithm.client(0).secagg_unmask("client_model", torch.tensor([0, 1, 2]), torch.tensor([]))
    with pytest.raises(
        UserError, match="1 of the 3 holders of client 0's shares answered the unmasking, fewer than its threshold 2"
    ):
        experiment.roles.sync.unmask("client_model", {0: answer})


# --- SecAgg+: secagg_neighbours=k ------------------------------------------------------------
def secagg_bytes(secure, plain) -> dict[int, int]:
    """Each client's secagg_* bytes: all it sent and received, less the same run's without secure
    aggregation (its masked input counts as the plain upload's 4 bytes an element)."""
    return {u: secure.ledger.bytes_by_client[u] - plain.ledger.bytes_by_client[u] for u in plain.ledger.bytes_by_client}


def per_client_by_hand(neighbours: int) -> int:
    """One client's secagg_* bytes in a round without drops, one averaged slot: its keys up (64), those
    of its neighbours and its own down (64 each), a sealed pair of shares up and one down for each
    neighbour (176), the ids of itself and its neighbours down (8 each) and a share of each one's
    self-mask seed up (66)."""
    return 64 + 64 * (neighbours + 1) + 2 * SEALED_BYTES * neighbours + 8 * (neighbours + 1) + 66 * (neighbours + 1)


@pytest.mark.parametrize(("n", "k"), [(5, 2), (16, 4), (64, 6)])
def test_the_graph_is_k_regular_symmetric_connected_and_drawn_from_the_seed(n, k):
    clients = list(range(0, 2 * n, 2))  # ids need not be 0..n-1
    graph = neighbourhoods(clients, k, random_stream(0, 3, STREAM_SECAGG_GRAPH))
    assert graph == neighbourhoods(clients, k, random_stream(0, 3, STREAM_SECAGG_GRAPH))
    assert graph != neighbourhoods(clients, k, random_stream(1, 3, STREAM_SECAGG_GRAPH))
    assert sorted(graph) == clients
    assert all(len(set(near)) == k and u not in near and set(near) <= set(clients) for u, near in graph.items())
    assert all(u in graph[v] for u, near in graph.items() for v in near)
    reached, frontier = {clients[0]}, [clients[0]]
    while frontier:
        frontier = [v for u in frontier for v in graph[u] if v not in reached]
        reached |= set(frontier)
    assert reached == set(clients)
    complete = {u: [v for v in clients if v != u] for u in clients}
    assert neighbourhoods(clients, None, random_stream(0, 3, STREAM_SECAGG_GRAPH)) == complete
    assert neighbourhoods(clients, n - 1, random_stream(0, 3, STREAM_SECAGG_GRAPH)) == complete


def test_with_neighbours_the_sum_is_right_and_each_client_deals_with_its_neighbours_only():
    """8 clients, k = 4: the plain average within the bound, and bit for bit the same through bytes
    (the masks cancel exactly); each client held the keys of exactly its neighbours in the round's
    graph (from the run's seed) and its own."""
    plain = one_round(algorithm="fedavg", clients=8)
    secure = one_round(algorithm="fedavg", clients=8, secure_aggregation=True, secagg_neighbours=4)
    assert (
        0 < max_abs_difference(global_weights(plain), global_weights(secure)) <= 8 * 2.0 ** -(FRACTION_BITS + 1) + 1e-6
    )
    serialized = one_round(
        SerializedTransport, algorithm="fedavg", clients=8, secure_aggregation=True, secagg_neighbours=4
    )
    assert all(torch.equal(a, b) for a, b in zip(global_weights(secure).values(), global_weights(serialized).values()))
    assert serialized.ledger.bytes_by_kind == secure.ledger.bytes_by_kind
    graph = neighbourhoods(list(range(8)), 4, random_stream(0, 0, STREAM_SECAGG_GRAPH))
    assert graph != neighbourhoods(list(range(8)), None, random_stream(0, 0, STREAM_SECAGG_GRAPH))
    for node in secure.roles.clients:
        secrets = node._secure["client_model"]
        assert sorted(secrets.public) == sorted(secrets.received) == sorted([node.id, *graph[node.id]])


def test_a_client_s_bytes_grow_with_its_neighbours_not_with_the_round():
    """Hand-counted per client: with k = 4 the same 2,162 bytes among 8 clients as among 12; SecAgg's
    complete graph among 8 (k = 7) costs 3,632, among 12 (k = 11) 5,592."""
    counted = {}
    for n, k in [(8, 4), (12, 4), (8, None), (12, None)]:
        plain = one_round(algorithm="fedavg", clients=n)
        secure = one_round(algorithm="fedavg", clients=n, secure_aggregation=True, secagg_neighbours=k)
        counted[n, k] = secagg_bytes(secure, plain)
        assert counted[n, k] == {u: per_client_by_hand(n - 1 if k is None else k) for u in range(n)}
    assert per_client_by_hand(4) == 2162 and per_client_by_hand(7) == 3632 and per_client_by_hand(11) == 5592


@pytest.mark.parametrize("neighbours", [4, None])
@pytest.mark.parametrize(
    ("verb", "plain_drop"), [("secagg_unmask", None), ("upload_masked", "upload"), ("secagg_shares", "forward")]
)
def test_a_client_that_drops_is_recovered_by_its_neighbours(verb, plain_drop, neighbours):
    """8 clients, k = 4 or all 7 others: client 2 leaves after its masked input (its self-mask seed
    rebuilt from its neighbours' shares: in the sum), at it (its mask key rebuilt, the masks it left
    with its neighbours removed: the average renormalised over the others, as without secure
    aggregation when it leaves at its upload), or at its shares (it never trains: as when it leaves
    at its first step). Each of the 7 others answers for itself and its d neighbours, but none for
    a client that never shared its secrets."""
    d = 7 if neighbours is None else neighbours
    answered = 7 * (d + 1) - (d if verb == "secagg_shares" else 0)
    plain = one_round(plain_drop and DropsOut.at_call(client=2, verbs=(plain_drop,)), algorithm="sfl_v2", clients=8)
    secure = one_round(
        DropsOut.at_call(client=2, verbs=(verb,)),
        algorithm="sfl_v2",
        clients=8,
        secure_aggregation=True,
        secagg_neighbours=neighbours,
    )
    assert secure.algorithm.dropped == {2}
    left_out = plain_drop is not None  # 7 of 8 equal weights
    assert (
        max_abs_difference(global_weights(plain), global_weights(secure))
        <= 8 * 2.0 ** -(FRACTION_BITS + 1) * (8 / 7 if left_out else 1) + 1e-6
    )
    assert secure.ledger.bytes_by_kind["secagg_unmask_up"] == answered * SHARE_BYTES


def test_with_a_round_smaller_than_the_graph_s_degree_the_run_stops_in_one_line():
    """clients=all is known only at the round: a round of 4 with k = 4 stops before any key is drawn."""
    experiment = build(
        {**ONE_ROUND, "algorithm": "fedavg", "clients": 6, "secure_aggregation": True, "secagg_neighbours": 4}
    )
    with pytest.raises(UserError, match="^secagg_neighbours=4: a round of 4 clients; give fewer than that$"):
        experiment.algorithm.secure_setup(0, experiment.clients[:4], "client_model")


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"secagg_neighbours": 4}, "secagg_neighbours=4 does not apply here: .* needs secure_aggregation=true"),
        ({"secure_aggregation": True, "secagg_neighbours": 3, "clients": 8}, "secagg_neighbours=3 .* give an even K"),
        (
            {"secure_aggregation": True, "secagg_neighbours": 4, "clients": 8, "participation": 0.5},
            "secagg_neighbours=4 does not apply: a round has 4 clients .* give fewer neighbours than that",
        ),
        (
            {"secure_aggregation": True, "secagg_neighbours": 0, "clients": 8},
            "0 for secagg_neighbours: .* greater than or equal to 2",
        ),
    ],
)
def test_secagg_neighbours_where_it_cannot_hold_is_refused_in_one_line(settings, refusal):
    with pytest.raises(UserError, match=refusal) as refused:
        resolve_config(quick(algorithm="fedavg", **settings))
    assert "\n" not in str(refused.value)
