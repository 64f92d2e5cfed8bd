"""Secure aggregation (Bonawitz et al., CCS 2017; with `secagg_neighbours=k` the sparse graph of
SecAgg+, Bell et al., CCS 2020): the sync server learns the weighted sum of the round's client parts,
never one of them.

For each averaged slot and round, each client u deals with its neighbours N(u) only: in SecAgg every
other client of the round, in SecAgg+ its k neighbours in a k-regular graph (`neighbourhoods`: a
Harary graph on a ring of the round's clients in a seeded random order, each client joined to the
k/2 before and the k/2 after it). Its secrets' holders are N(u) and u itself, and any t of them
rebuild a secret, t a majority of the holders (`threshold`: floor(n/2) + 1 of the round's n in SecAgg,
k/2 + 1 of k + 1 in SecAgg+):

1. keys: every client makes two X25519 key pairs (c for encrypting shares, s for masks) and sends
   both public keys; the server hands each client those of N(u) and its own (`secagg_keys_up` / `_down`);
2. shares: every client draws a self-mask seed b_u, splits b_u and its s secret key into Shamir
   shares (threshold t, over the prime field of 2^521 - 1) and sends each neighbour its pair,
   AES-GCM-encrypted under a key agreed from the c keys, through the server (`secagg_shares_up` /
   `_down`), which cannot read them;
3. masked input: a client sends y_u = q_u + PRG(b_u) + sum_{v in N(u), v > u} PRG(s_uv) -
   sum_{v in N(u), v < u} PRG(s_uv) in the ring Z_{2^32} (counted as the slot's `<slot>_up`: 4 bytes an
   element, as float32), q_u its part times alpha_u in fixed point with 16 fractional bits, s_uv the
   seed agreed from u's and v's s keys, PRG ChaCha20's keystream;
4. unmasking: the server names to each client who of its holders' owners sent (U3) and who did not
   (the dropped); each client still there sends its shares of b_v for v in U3 and of s_v's secret key
   for the dropped (`secagg_unmask_down` / `_up`). With t of each the server rebuilds those secrets,
   removes the self masks of U3 and the pairwise masks the dropped left with their neighbours, and
   holds sum_{u in U3} q_u: the sum of the parts of the clients whose masked inputs arrived, also of
   those that dropped after sending it. No client's b and s key are both revealed.

So a client's bytes beyond its masked input grow with |N(u)|: n - 1 in SecAgg, k in SecAgg+ (docs/privacy.md).

Fixed point: every client rounds alpha_u x to a multiple of 2^-16, so the average differs from the
plain one by at most n 2^-17 (about 7.6e-6 n) per element and round, divided by the survivors'
share of the weights when some dropped before masking; every |sum alpha_u x| must stay below 2^15
(a client whose own part is out of range stops the run with one line). The cryptography is the
`cryptography` package's (X25519, HKDF-SHA256, AES-GCM, ChaCha20); Shamir's scheme is arithmetic
over the field.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from splitlab.errors import UserError

PRIME = 2**521 - 1  # Shamir's field: a Mersenne prime above any 32-byte secret
SHARE_BYTES = 66  # an element of that field
KEYS_BYTES = 64  # a client's two X25519 public keys
SEALED_BYTES = 12 + 16 + 2 * SHARE_BYTES + 16  # a sealed pair of shares: nonce, sender and holder ids, shares, tag
RING_BITS = 32
FRACTION_BITS = 16
RING = 1 << RING_BITS
LIMIT = 1 << (RING_BITS - FRACTION_BITS - 1)  # |sum alpha_u x| must stay below this
RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


def threshold(holders: int) -> int:
    """t: how many holders of a client's shares must answer the unmasking (a majority of them)."""
    return holders // 2 + 1


def neighbourhoods(clients: list[int], k: int | None, rng: np.random.Generator) -> dict[int, list[int]]:
    """Each client's neighbours N(u): with k (even) below len(clients) - 1, SecAgg+'s k-regular graph,
    the Harary graph H_{k,n} on a ring of `clients` in the order `rng` draws (each joined to the k/2
    before and the k/2 after it); else (k None) every other client, SecAgg's complete graph."""
    n = len(clients)
    if k is None or k >= n - 1:
        return {u: [v for v in clients if v != u] for u in clients}
    ring = [clients[i] for i in rng.permutation(n)]
    return {ring[i]: sorted(ring[(i + j) % n] for j in range(-(k // 2), k // 2 + 1) if j) for i in range(n)}


# --- the primitives ---------------------------------------------------------------------------
def _derive(secret: bytes, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"splitlab secagg " + purpose).derive(secret)


def _agree(private: X25519PrivateKey, public: bytes, purpose: bytes) -> bytes:
    return _derive(private.exchange(X25519PublicKey.from_public_bytes(public)), purpose)


def prg(seed: bytes, count: int) -> torch.Tensor:
    """`count` pseudo-random elements of Z_{2^32} (int64) from ChaCha20's keystream under `seed`."""
    encryptor = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    stream = encryptor.update(bytes(4 * count))
    return torch.from_numpy(np.frombuffer(stream, dtype="<u4").astype(np.int64))


def shamir_split(secret: bytes, holders: list[int], t: int) -> dict[int, int]:
    """Shares of `secret` for each of `holders` (x = holder + 1), any t of which rebuild it."""
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]

    def at(x: int) -> int:  # the polynomial at x, by Horner's rule
        y = 0
        for c in reversed(coefficients):
            y = (y * x + c) % PRIME
        return y

    return {h: at(h + 1) for h in holders}


def shamir_join(shares: Mapping[int, int]) -> bytes:
    """The secret from shares {holder: share} (Lagrange interpolation at 0)."""
    total = 0
    for h, y in shares.items():
        num, den = 1, 1
        for other in shares:
            if other != h:
                num, den = num * -(other + 1) % PRIME, den * (h - other) % PRIME
        total = (total + y * num * pow(den, -1, PRIME)) % PRIME
    return total.to_bytes(32, "big")


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def flat(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in state.values()])


def quantise(values: torch.Tensor) -> torch.Tensor:
    """Fixed point in Z_{2^32} (int64 holding 0 .. 2^32 - 1)."""
    return torch.round(values * (1 << FRACTION_BITS)).to(torch.int64) % RING


def dequantise(values: torch.Tensor) -> torch.Tensor:
    signed = torch.where(values >= RING // 2, values - RING, values)
    return signed.double() / (1 << FRACTION_BITS)


# --- a client's side of one slot's protocol in one round ---------------------------------------
@dataclass
class ClientSecrets:
    """What a client holds of one slot's protocol for the round: its keys, its self-mask seed,
    everyone's public keys, and the shares others sent it."""

    me: int
    encryption: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    masking: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    self_seed: bytes = field(default_factory=lambda: os.urandom(32))
    public: dict[int, bytes] = field(default_factory=dict)  # client -> c_pk + s_pk
    received: dict[int, tuple[int, int]] = field(default_factory=dict)  # from client -> (b share, s share)

    def keys(self) -> torch.Tensor:
        """c_pk and s_pk, KEYS_BYTES."""
        return _bytes_tensor(
            self.encryption.public_key().public_bytes(*RAW) + self.masking.public_key().public_bytes(*RAW)
        )

    def shares(self, public: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Everyone's public keys in; each other client's shares of b_u and s_u's secret key out, encrypted for it."""
        self.public = _byte_map(public)
        holders = sorted(self.public)
        t = threshold(len(holders))
        secret_key = self.masking.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        b, s = shamir_split(self.self_seed, holders, t), shamir_split(secret_key, holders, t)
        self.received[self.me] = b[self.me], s[self.me]
        out = {}
        for v in holders:
            if v != self.me:
                key = _agree(self.encryption, self.public[v][:32], b"shares")
                nonce = os.urandom(12)
                plain = self.me.to_bytes(8, "big") + v.to_bytes(8, "big") + _field(b[v]) + _field(s[v])
                out[str(v)] = _bytes_tensor(nonce + AESGCM(key).encrypt(nonce, plain, None))
        return out

    def receive(self, sealed: Mapping[str, torch.Tensor]) -> None:
        """The shares others encrypted for this client (a share not addressed to it is refused); it
        masks with those who shared (those who did not are out of the round's sum)."""
        messages = _byte_map(sealed)
        self.public = {u: key for u, key in self.public.items() if u in messages or u == self.me}
        for u, message in messages.items():
            key = _agree(self.encryption, self.public[u][:32], b"shares")
            plain = AESGCM(key).decrypt(message[:12], message[12:], None)
            if int.from_bytes(plain[:8], "big") != u or int.from_bytes(plain[8:16], "big") != self.me:
                raise ValueError(f"a share from client {u} was not meant for client {self.me}")
            self.received[u] = int.from_bytes(plain[16:82], "big"), int.from_bytes(plain[82:148], "big")

    def masked(self, values: torch.Tensor) -> torch.Tensor:
        """y_u as int32 (the ring's bits): the quantised values plus the self mask and the pairwise masks."""
        if values.numel() and float(values.abs().max()) >= LIMIT:
            raise UserError(
                f"secure aggregation: client {self.me}'s weighted part holds a value of magnitude "
                f"{float(values.abs().max()):.3g}, beyond the fixed-point ring's range ({LIMIT})"
            )
        y = quantise(values) + prg(self.self_seed, len(values))
        for v in self.public:
            if v != self.me:
                mask = prg(_agree(self.masking, self.public[v][32:], b"pairwise"), len(values))
                y = y + mask if self.me < v else y - mask
        return (y % RING).to(torch.int32)  # the ring's 32 bits, two's complement

    def unmask(self, survivors: list[int], dropped: list[int]) -> dict[str, torch.Tensor]:
        """Its shares of b_v for the survivors and of s_v's secret key for the dropped (never both for one v)."""
        if set(survivors) & set(dropped):
            raise ValueError("a client is named both as having sent its masked input and as dropped")
        return {
            **{f"b{v}": _bytes_tensor(_field(self.received[v][0])) for v in survivors if v in self.received},
            **{f"s{v}": _bytes_tensor(_field(self.received[v][1])) for v in dropped if v in self.received},
        }


def _field(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


# --- the server's side: the masked sum and its unmasking ----------------------------------------
class MaskedSum:
    """The sync server's running sum of one slot's masked inputs in Z_{2^32}, with the weights of
    those who sent, the public keys it relayed and the neighbours of each (to remove what dropped
    clients' masks left)."""

    def __init__(self, public: Mapping[str, torch.Tensor], holders: int) -> None:
        self.public = _byte_map(public)  # of those who shared their secrets
        self.holders = holders  # the clients that advertised keys: those of each one's secrets in SecAgg
        #: secagg_neighbours: N(v) of each of them as it split its secrets (among the clients that
        #: advertised keys); None: every other one (SecAgg's complete graph)
        self.neighbours: dict[int, set[int]] | None = None
        self.total: torch.Tensor | None = None
        self.sent: dict[int, float] = {}  # client -> alpha

    def add(self, client: int, masked: torch.Tensor, alpha: float) -> None:
        y = masked.to(torch.int64) % RING
        self.total = y if self.total is None else (self.total + y) % RING
        self.sent[client] = alpha

    def dropped(self) -> list[int]:
        return sorted(set(self.public) - set(self.sent))

    def unmasked(self, answers: Mapping[int, Mapping[str, torch.Tensor]]) -> torch.Tensor:
        """sum_{u in U3} alpha_u x_u (float64, flat) from the clients' `answers` to the unmasking."""
        if self.total is None:
            raise RuntimeError("nothing was added to the masked sum")
        total, count = self.total, len(self.total)
        for v in sorted(self.sent):  # their self masks
            total = total - prg(self._rebuilt(answers, "b", v), count)
        for v in self.dropped():  # the pairwise masks they left with their neighbours that sent
            key = X25519PrivateKey.from_private_bytes(self._rebuilt(answers, "s", v))
            for u in sorted(self._near(v) & set(self.sent)):
                mask = prg(_agree(key, self.public[u][32:], b"pairwise"), count)
                total = total - mask if u < v else total + mask
        return dequantise(total % RING)

    def _near(self, v: int) -> set[int]:
        """N(v): the clients v masked with, among those that shared."""
        return set(self.public) - {v} if self.neighbours is None else self.neighbours[v]

    def _rebuilt(self, answers: Mapping[int, Mapping[str, torch.Tensor]], secret: str, owner: int) -> bytes:
        """`owner`'s secret (b or s) from the shares of it among `answers`, or one line if fewer than t
        of its holders answered."""
        name = f"{secret}{owner}"
        shares = {u: _share(answer[name]) for u, answer in answers.items() if name in answer}
        holders = self.holders if self.neighbours is None else len(self.neighbours[owner]) + 1
        if len(shares) < threshold(holders):
            raise UserError(
                f"secure aggregation: {len(shares)} of the {holders} holders of client {owner}'s shares answered "
                f"the unmasking, fewer than its threshold {threshold(holders)}; the round's sum cannot be recovered"
            )
        return shamir_join(shares)


def _share(tensor: torch.Tensor) -> int:
    return int.from_bytes(tensor.numpy().tobytes(), "big")


def unflat(values: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A flat vector back into `like`'s names and shapes (as it is: float64)."""
    out, start = {}, 0
    for name, t in like.items():
        out[name] = values[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
    return out


def _byte_map(tensors: Mapping[str, torch.Tensor]) -> dict[int, bytes]:
    """{client id as text: uint8 tensor} as it crosses -> {client id: bytes}."""
    return {int(k): t.numpy().tobytes() for k, t in tensors.items()}
