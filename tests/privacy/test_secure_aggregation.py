"""secure_aggregation=true (splitlab.secure_aggregation): the sync server averages what it cannot
read, and gets the plain average to within the fixed point's bound; every phase is counted; a
client that drops after masking is still in the sum, one that drops before is left out."""

from __future__ import annotations

import pytest
import torch

from helpers import DropsOut, global_weights, max_abs_difference, quick
from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.resolve import resolve_config
from splitlab.roles import SyncServer
from splitlab.secure_aggregation import FRACTION_BITS, SEALED_BYTES, SHARE_BYTES, quantise

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


def test_what_the_sync_server_receives_does_not_correlate_with_the_client_parts(monkeypatch):
    received, parts = [], []
    original = SyncServer.add_masked

    def spy(self, slot, client_id, masked, alpha):
        received.append(masked.clone())
        return original(self, slot, client_id, masked, alpha)

    spy.__verb__ = original.__verb__  # type: ignore[attr-defined]
    monkeypatch.setattr(SyncServer, "add_masked", spy)
    experiment = one_round(algorithm="fedavg", secure_aggregation=True)
    for node, alpha in zip(experiment.roles.clients, experiment.algorithm.ctx.weights(experiment.clients)):
        parts.append(
            quantise(torch.cat([t.reshape(-1).double() for t in node.upload("client_model").values()]) * alpha)
        )
    assert len(received) == 3 and all(r.dtype == torch.int32 for r in received)
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
    algorithm.secure_setup(experiment.clients, "client_model")
    for client, alpha in zip(experiment.clients, algorithm.ctx.weights(experiment.clients)):
        algorithm.contribute(client.id, alpha)
    answer = algorithm.client(0).secagg_unmask("client_model", torch.tensor([0, 1, 2]), torch.tensor([]))
    with pytest.raises(
        UserError, match="1 of the round's 3 clients answered the unmasking, fewer than its threshold 2"
    ):
        experiment.roles.sync.unmask("client_model", {0: answer})
