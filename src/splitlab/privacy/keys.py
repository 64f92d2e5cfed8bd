"""Noise keys: every randomised defense draws from a secret of the party that applies it.

A defense's noise protects only if the party it is meant to stop cannot predict it. Streams keyed
by the run's seed are not enough: the training server holds the run's config, seed included, and
could regenerate the noise and subtract it. So each party's noise comes from a 32-byte secret:

- a run in one process (the experimenter plays every party) draws it from the OS's secure
  generator (`secrets`) and keeps it in the run's checkpoint (resume continues the same noise);
  it is never written to config.yaml, summary.json, metrics.jsonl or partition.json;
- a networked client derives it from its TLS private key, which never leaves it, and the run's
  config (a new client certificate or config gives new noise); nothing of it is sent;
- `noise_key=` fixes it for reproducible experiments: the guarantee then holds only while that
  key stays secret from the server (it is in the config, so a server that has the config has it).

Each release's generator is seeded from SHA-256 of (secret, party, counters): streams of
different parties, rounds and releases are unrelated, and without the secret none is predictable.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

import torch

SECRET_BYTES = 32


def fresh() -> bytes:
    """A new secret from the OS's secure generator."""
    return secrets.token_bytes(SECRET_BYTES)


def from_setting(noise_key: str) -> bytes:
    """The secret an experimenter fixed with `noise_key=`."""
    return hashlib.sha256(b"splitlab noise_key\0" + noise_key.encode()).digest()


def for_run(noise_key: str | None) -> bytes:
    """A run's noise secret: the one `noise_key=` fixes, else a fresh one."""
    return from_setting(noise_key) if noise_key is not None else fresh()


def from_private_key(private_key: bytes, config: Mapping[str, Any]) -> bytes:
    """A networked client's secret: its TLS private key (which the server never sees) and the run's config."""
    canonical = json.dumps(dict(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(b"splitlab client noise\0" + private_key + b"\0" + canonical).digest()


def generator(secret: bytes | None, party: str, *counters: int, device: torch.device) -> torch.Generator:
    """The generator of one release of `party` (e.g. "client 3", round, release)."""
    if secret is None:
        raise RuntimeError(f"{party} applies a randomised defense but holds no noise key")
    material = b"\0".join([secret, party.encode(), *(str(c).encode() for c in counters)])
    seed = int.from_bytes(hashlib.sha256(material).digest()[:8], "little") >> 1  # torch seeds are < 2**63
    return torch.Generator(device).manual_seed(seed)


def content_counter(tensor: torch.Tensor) -> int:
    """A counter from a tensor's bytes: the training server keys a gradient's noise by the gradient
    itself, so its stream needs no state that resume would have to restore."""
    return int.from_bytes(
        hashlib.sha256(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).digest()[:8],
        "little",
    )
