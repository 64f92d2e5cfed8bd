"""Private set intersection of sample ids (ECDH, OpenMined's `openmined-psi`), as vertical parties
align their samples before training (docs/configurations.md, "Vertical").

Two holders of id sets find the ids both hold: the asking side sends its ids blinded by its secret
exponent (`PsiAsker.request`), the answering side blinds them again with its own and sends its own
ids blinded once (`answer`), and the asker, removing its blinding, sees which of its ids match
(`PsiAsker.intersect`). The asker learns the intersection and the size of the other's set; the
answerer learns the size of the asker's set, nothing else. Messages are bytes as uint8 tensors, so
the ledger counts them like any other tensor (`psi_up` / `psi_down`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError

from splitlab.errors import UserError

#: The answerer's ids travel as a raw list of blinded points: exact (no false positives, unlike
#: a Bloom filter), and their size depends only on the count (33 bytes a point, compressed).
_EXACT = 0.0


def _psi() -> Any:
    try:
        import private_set_intersection.python as psi
    except ImportError:
        raise UserError(
            "setting=vertical aligns samples with openmined-psi, which is not installed: "
            "pip install 'splitlab[vertical]'"
        ) from None
    return psi


def _as_tensor(message: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else torch.zeros(0, dtype=torch.uint8)


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.uint8).cpu().numpy().tobytes()


class PsiError(ValueError):
    """Bytes that are not the private set intersection message they stand for (a party's fault)."""


#: what the protobuf parser and the ECDH library raise on bytes that are not a message of theirs
_MALFORMED = (DecodeError, RuntimeError, ValueError, IndexError)


def _items(ids: np.ndarray) -> list[str]:
    return [str(int(i)) for i in ids]


class PsiAsker:
    """The asking side of one intersection: keeps its secret key between request and answer."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self._client = _psi().client.CreateWithNewKey(True)

    def request(self) -> torch.Tensor:
        """Our ids, blinded by our key."""
        return _as_tensor(self._client.CreateRequest(_items(self.ids)).SerializeToString())

    def intersect(self, answer: dict[str, torch.Tensor]) -> np.ndarray:
        """The ids of ours the answerer also holds, sorted."""
        psi = _psi()
        setup, response = psi.ServerSetup(), psi.Response()
        try:
            setup.ParseFromString(_as_bytes(answer["setup"]))
            response.ParseFromString(_as_bytes(answer["response"]))
            found = self._client.GetIntersection(setup, response)
            return np.sort(self.ids[np.asarray(sorted(found), dtype=np.int64)])
        except _MALFORMED as error:
            raise PsiError(f"not an answer to our request: {str(error).splitlines()[0][:120]}") from None


def answer(ids: np.ndarray, request: torch.Tensor) -> dict[str, torch.Tensor]:
    """The answer to an asker's `request`: its blinded ids blinded again, and ours blinded once."""
    psi = _psi()
    server = psi.server.CreateWithNewKey(True)
    asked = psi.Request()
    try:
        asked.ParseFromString(_as_bytes(request))
        setup = server.CreateSetupMessage(_EXACT, len(asked.encrypted_elements), _items(ids), psi.DataStructure.RAW)
        response = server.ProcessRequest(asked)
    except _MALFORMED as error:
        raise PsiError(f"not a request: {str(error).splitlines()[0][:120]}") from None
    return {"setup": _as_tensor(setup.SerializeToString()), "response": _as_tensor(response.SerializeToString())}
