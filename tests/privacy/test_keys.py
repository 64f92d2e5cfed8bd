"""Noise keys: a curious server that knows the whole config cannot regenerate the defenses' noise;
runs differ unless noise_key= is set; a resumed run continues with its own stored key."""

from __future__ import annotations

import shutil

import numpy as np
import torch
from safetensors.torch import load_file

from helpers import crash_before_round, global_weights, quick
from splitlab import codec
from splitlab.checkpoints import restore, role_states
from splitlab.engine import build, run
from splitlab.privacy import keys
from splitlab.rundir import CHECKPOINT

NOISE = 2.0  # a noise multiplier of 1 (noise:2 over the sensitivity 2C)
CONFIG = quick(algorithm="sfl_v2", rounds=1, defense=f"clip:1+noise:{NOISE}", record=8)


def first_release(run_dir) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Round 0's record and the clean (clipped, noise-free) activations of its samples: the first
    release of a client, made with the initial client part, which the test rebuilds from the seed."""
    record = load_file(run_dir / "record" / "round_0001.safetensors")
    client = build(CONFIG).blueprint.initial("client_model")
    with torch.no_grad():
        smashed = client(record["inputs"])
        clean = smashed * (1.0 / smashed.flatten(1).norm(dim=1).clamp_min(1e-12)).clamp(max=1.0).view(-1, 1)
    assert len(set(record["clients"].tolist())) == 1  # 8 samples: all from one release
    return record, clean


def regenerated(generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """The noise of the release's first `len(like)` samples (the release is a batch of 32)."""
    return NOISE * torch.randn((32, *like.shape[1:]), generator=generator)[: len(like)]


def test_a_curious_server_knowing_the_config_cannot_regenerate_the_noise(tmp_path):
    run({**CONFIG, "out": str(tmp_path / "run")}, progress=False)
    record, clean = first_release(tmp_path / "run")
    client_id, seed = int(record["clients"][0]), CONFIG["seed"]
    # the server's best guess: the stream splitlab used to key by (seed, round, purpose, client, release)
    guess_seed = int(np.random.default_rng([seed, 0, 6, client_id, 0]).integers(2**63))
    guess = regenerated(torch.Generator().manual_seed(guess_seed), clean)
    residual = record["smashed"] - guess - clean
    assert residual.std() > NOISE  # subtracting the guess adds noise instead of removing it (~ sqrt(2) NOISE)
    assert (record["smashed"] - clean).std() > 0.8 * NOISE  # the release is noised as configured


def test_with_a_noise_key_the_experimenter_regenerates_the_noise_exactly(tmp_path):
    """The control of the test above: with the key, subtraction recovers the clean activations."""
    run({**CONFIG, "noise_key": "shared", "out": str(tmp_path / "run")}, progress=False)
    record, clean = first_release(tmp_path / "run")
    secret = keys.from_setting("shared")
    noise = regenerated(keys.generator(secret, f"client {int(record['clients'][0])}", 0, 0, device=clean.device), clean)
    torch.testing.assert_close(record["smashed"] - noise, clean, atol=1e-5, rtol=0)
    summary = run({**CONFIG, "noise_key": "shared", "out": str(tmp_path / "run"), "resume": True}, progress=False)
    assert "assumes that key stays secret" in summary["privacy"]["noise_key"]


def test_same_seed_runs_release_different_noise_unless_a_noise_key_is_set(tmp_path):
    records = {}
    for name, extra in [("a", {}), ("b", {}), ("c", {"noise_key": "k"}), ("d", {"noise_key": "k"})]:
        run({**CONFIG, **extra, "out": str(tmp_path / name)}, progress=False)
        records[name] = load_file(tmp_path / name / "record" / "round_0001.safetensors")
    assert torch.equal(records["a"]["inputs"], records["b"]["inputs"])
    assert not torch.equal(records["a"]["smashed"], records["b"]["smashed"])
    assert torch.equal(records["c"]["smashed"], records["d"]["smashed"])


def test_a_run_resumes_with_its_own_private_key():
    config = quick(algorithm="sfl_v2", defense="clip:5+noise:0.3+gradnoise:0.5")
    first, resumed, stranger = build(config), build(config), build(config)
    for rnd in range(2):
        first.algorithm.run_round(rnd, first.clients)
    state = codec.decode(codec.encode(role_states(first)))
    restore(resumed, state)
    restore(stranger, {**state, "noise_secret": torch.zeros(keys.SECRET_BYTES, dtype=torch.uint8)})
    for experiment in (first, resumed, stranger):
        experiment.algorithm.run_round(2, experiment.clients)
    a, b, c = global_weights(first), global_weights(resumed), global_weights(stranger)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the key, not the seed, decides the noise


def test_the_key_is_kept_in_the_checkpoint_only_and_a_killed_run_resumes_bit_for_bit(tmp_path, monkeypatch):
    config = quick(algorithm="sfl_v2", rounds=3, defense="clip:5+noise:2", checkpoint_every=0)
    crash_before_round(2, {**config, "out": str(tmp_path / "a")}, monkeypatch)
    secret = bytes(codec.decode((tmp_path / "a" / CHECKPOINT).read_bytes())["noise_secret"].tolist())
    for name in ("config.yaml", "partition.json", "metrics.jsonl"):
        data = (tmp_path / "a" / name).read_bytes()
        assert secret not in data and secret.hex().encode() not in data
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for name in ("a", "b"):
        run({**config, "out": str(tmp_path / name), "resume": True}, progress=False)
    wa, wb = load_file(tmp_path / "a" / "weights.safetensors"), load_file(tmp_path / "b" / "weights.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    summary = (tmp_path / "a" / "summary.json").read_text()
    assert secret.hex() not in summary and "never sent or written where the server reads" in summary


def test_a_networked_client_derives_its_key_from_its_own_tls_key(tmp_path):
    """The server sends the config; the client's secret also needs its TLS private key, which the
    server never has: another certificate, or another config, gives another secret."""
    from splitlab.net.certs import make_certs
    from splitlab.net.client import ClientSettings, _build_node

    config = quick(algorithm="sfl_v2", defense="clip:1+noise:1")
    secrets = []
    for name in ("a", "b"):
        make_certs(tmp_path / name, clients=1, hosts=["localhost"])
        settings = ClientSettings(client_id=0, certs=tmp_path / name)
        secrets.append(_build_node(settings, config).blueprint.noise_secret)
    assert secrets[0] is not None and secrets[0] != secrets[1]
    other = _build_node(ClientSettings(client_id=0, certs=tmp_path / "a"), {**config, "rounds": 3})
    assert other.blueprint.noise_secret != secrets[0]
    fixed = _build_node(ClientSettings(client_id=0, certs=tmp_path / "a"), {**config, "noise_key": "k"})
    assert fixed.blueprint.noise_secret == keys.from_setting("k")
