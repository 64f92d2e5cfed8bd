"""Message kinds, and the ledger that counts every byte that reaches or leaves a client.

A message is a kind (what it is) plus a payload (tensors, possibly nested in dicts and lists).
Bytes are numel x element size of every tensor in the payload, so the figures follow from tensor
shapes alone. Verbs declare the kinds of their tensors and transports count them
(splitlab.transport).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

#: kind -> direction. "up" is client -> server, "down" is server -> client.
KINDS: dict[str, str] = {
    "smashed": "up",  # activations at the cut
    "labels": "up",  # the labels that go with them
    "segments": "up",  # packing=true: which row of its sequence each position of them holds
    "cut_grad": "down",  # gradient of the loss at the cut
    "server_output": "down",  # U-shaped: the server's output at the second cut, for the client's tail
    "tail_grad": "up",  # U-shaped: gradient of the loss at the second cut, from the client's tail
    "grad_norm_down": "down",  # clip_scope=global: the norm of the server part's gradients of a step
    "grad_norm_up": "up",  # ... and of the client part's, for the server's clipping
    "client_model_down": "down",  # (part of the) model a client trains, from the sync server
    "client_model_up": "up",  # ... and back for averaging
    "client_model_relay": "peer",  # vanilla SL: client model handed to the next client
    "aux_model_down": "down",  # auxiliary heads / models (CSE-FSL, FSL-SAGE, SplitGP)
    "aux_model_up": "up",
    "control_down": "down",  # SCAFFOLD: the server's control variate c of a client part, with the model
    "control_up": "up",  # ... and the client's Delta c_i back, with the model
    "secagg_keys_up": "up",  # secure aggregation: a client's two public keys (64 bytes)
    "secagg_keys_down": "down",  # ... everyone's, relayed to each client
    "secagg_shares_up": "up",  # ... its Shamir shares, encrypted for each other client
    "secagg_shares_down": "down",  # ... the shares the others encrypted for it, relayed
    "secagg_unmask_down": "down",  # ... who sent a masked input and who did not
    "secagg_unmask_up": "up",  # ... its shares of the survivors' self-mask seeds and the dropped's mask keys
    "kept_state_down": "down",  # a client's kept slots given back when it rejoins after dropping out
    "psi_up": "up",  # vertical: private set intersection messages (blinded ids), party -> server
    "psi_down": "down",  # ... server -> party (relayed from another party, or the server's own)
    # Telemetry: what the simulation reads from roles and a deployment would not send, or not
    # as training traffic. Never counted.
    "loss": "telemetry",  # a training loss, for the round's mean train loss
    "evaluation": "telemetry",  # a model fetched by the engine to evaluate it
    "checkpoint": "telemetry",  # a role's state, saved or restored by the engine
}

#: Ledger conventions: the message kinds each one leaves uncounted. `splitlab` (the default)
#: counts every byte that crosses. `fsl_sage` reproduces the FSL-SAGE authors' code
#: (srijith1996/FSL-SAGE), which does not count labels; its other rules (smashed data and cut
#: gradients as sent, 2 x client model per client per round, CSE-FSL's aux heads both ways, the
#: aligned aux model once down) coincide with ours. See docs/fsl.md.
LEDGER_CONVENTIONS: dict[str, frozenset[str]] = {
    "splitlab": frozenset(),
    "fsl_sage": frozenset({"labels"}),
}


#: what a verb's arguments and results hold besides tensors and their nests: never counted
SCALARS = (str, int, float, bool, bytes, type(None))


def payload_bytes(payload: object) -> int:
    """numel x element size of every tensor in a nest of tensors, dicts, lists and tuples."""
    if isinstance(payload, torch.Tensor):
        return payload.nbytes
    if isinstance(payload, dict):  # dict first: an ABC's check is slow
        values: Iterable[object] = payload.values()
    elif isinstance(payload, (list, tuple)):
        values = payload
    elif isinstance(payload, SCALARS) or not isinstance(payload, Mapping):
        return 0
    else:
        values = payload.values()
    total = 0
    for value in values:  # tensors and scalars here, not through another call: a verb's are many
        if isinstance(value, torch.Tensor):
            total += value.nbytes
        elif not isinstance(value, SCALARS):
            total += payload_bytes(value)
    return total


class Ledger:
    """Cumulative bytes by message kind and by client, and (serialized transport) the encoded
    messages' bytes.

    `uncounted` holds the kinds a ledger convention leaves out; telemetry is never counted.
    `bytes_by_client` splits the same figures by the client they reached or left (a vertical
    run's parties; what goes from client to client is the sender's), so its values add up to
    `total_bytes`."""

    def __init__(self, convention: str = "splitlab") -> None:
        self.bytes_by_kind: dict[str, int] = {}
        self.bytes_by_client: dict[int, int] = {}
        self.envelope_bytes = 0
        self.wire_bytes = 0  # over a network: every protobuf message sent or received (splitlab.net)
        self.uncounted = LEDGER_CONVENTIONS[convention]

    def add(self, kind: str, nbytes: int, client: int) -> None:
        """`nbytes` of `kind` reached or left client `client`."""
        direction = KINDS.get(kind)
        if direction is None:
            raise ValueError(f"unknown message kind {kind!r}; known: {', '.join(KINDS)}")
        if direction != "telemetry" and kind not in self.uncounted:
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes
            self.bytes_by_client[client] = self.bytes_by_client.get(client, 0) + nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    def state_dict(self) -> dict[str, int]:
        return dict(self.bytes_by_kind)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.bytes_by_kind = dict(state)
