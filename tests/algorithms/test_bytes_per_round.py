"""Communication bytes of one round, against hand computation from tensor shapes.

Setup: synthetic data (1x8x8 inputs, 10 classes), 300 training samples over 3 IID clients of 100,
the MLP 64-200-200-10 in float32. Parameters: fc1 64*200+200 = 13,000; fc2 200*200+200 = 40,200;
out 200*10+10 = 2,010; all 55,210. At cut 1 the client holds fc1 (52,000 bytes) and sends 200
floats (800 bytes) and an int64 label (8 bytes) per sample; the cut gradient is 800 bytes.
"""

from __future__ import annotations

import pytest

from helpers import quick, train

SAMPLES, CLIENTS = 300, 3
CLIENT_PART = 13_000 * 4
FULL_MODEL = 55_210 * 4
SMASHED, LABEL = 200 * 4, 8


def bytes_of_round(algorithm: str, **extra) -> dict[str, int]:
    experiment = train(1, **quick(algorithm=algorithm, clients=CLIENTS, train_subset=SAMPLES, cut=1, **extra))
    owners = [[300]] if algorithm == "centralized" else [[100, 100, 100]]  # centralized: one data owner
    assert [c.num_samples for c in experiment.clients] in owners
    return experiment.ledger.state_dict()


SPLIT_FED = {
    "smashed": SAMPLES * SMASHED,  # 240,000
    "labels": SAMPLES * LABEL,  # 2,400
    "cut_grad": SAMPLES * SMASHED,  # 240,000
    "client_model_down": CLIENTS * CLIENT_PART,  # 156,000
    "client_model_up": CLIENTS * CLIENT_PART,
}


@pytest.mark.parametrize(
    "algorithm,extra", [("sfl_v1", {}), ("sfl_v2", {}), ("sfl_v2", {"server_schedule": "sequential"})]
)
def test_splitfed_round(algorithm, extra):
    assert bytes_of_round(algorithm, **extra) == SPLIT_FED


def test_local_epochs_multiply_activation_traffic_only():
    ledger = bytes_of_round("sfl_v1", local_epochs=2)
    assert ledger["smashed"] == 2 * SAMPLES * SMASHED and ledger["cut_grad"] == 2 * SAMPLES * SMASHED
    assert ledger["client_model_down"] == CLIENTS * CLIENT_PART


def test_fedavg_round_moves_the_full_model_down_and_up_per_client():
    assert bytes_of_round("fedavg") == {
        "client_model_down": CLIENTS * FULL_MODEL,
        "client_model_up": CLIENTS * FULL_MODEL,
    }


def test_sl_relays_the_client_part_between_consecutive_clients():
    # Round 0: client 0 starts with the model, hands it to 1, who hands it to 2: two relays.
    assert bytes_of_round("sl") == {
        "smashed": SAMPLES * SMASHED,
        "labels": SAMPLES * LABEL,
        "cut_grad": SAMPLES * SMASHED,
        "client_model_relay": 2 * CLIENT_PART,
    }
    # Round 1 adds three more (2 -> 0, 0 -> 1, 1 -> 2).
    experiment = train(2, **quick(algorithm="sl", clients=CLIENTS, train_subset=SAMPLES))
    ledger = experiment.ledger.state_dict()
    assert ledger["client_model_relay"] == 5 * CLIENT_PART


def test_centralized_communicates_nothing():
    assert bytes_of_round("centralized") == {}


def test_cnn_cut_bytes_follow_the_activation_shape():
    # LEAF CNN on 8x8 inputs: after conv2 + pool the activation is 64 x 2 x 2 = 256 floats.
    experiment = train(1, **quick(algorithm="sfl_v1", model="cnn", cut=2, clients=CLIENTS, train_subset=SAMPLES))
    client_params = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64)
    assert experiment.ledger.state_dict() == {
        "smashed": SAMPLES * 256 * 4,
        "labels": SAMPLES * LABEL,
        "cut_grad": SAMPLES * 256 * 4,
        "client_model_down": CLIENTS * client_params * 4,
        "client_model_up": CLIENTS * client_params * 4,
    }


@pytest.mark.parametrize(
    "algorithm,extra", [("sfl_v1", {}), ("sfl_v2", {}), ("cse_fsl", {"server_update_interval": 1})]
)
def test_local_steps_caps_the_batches_a_client_sends(algorithm, extra):
    # 100 samples per client in batches of 32 would be 4 batches (32+32+32+4); the cap keeps 2.
    ledger = bytes_of_round(algorithm, local_steps=2, **extra)
    assert ledger["smashed"] == CLIENTS * 2 * 32 * SMASHED
