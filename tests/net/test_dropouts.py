"""Dropouts: a client that goes silent mid-round is dropped and the round completes without it,
FedAvg renormalised over those that finished (bit for bit what the engine does in process when
that client leaves at the same point); it may rejoin; below min_clients the run stops cleanly."""

from __future__ import annotations

import json
import re
import signal
import threading

import pytest
import torch
from processes import NONE, Rogue, credentials
from safetensors.torch import load_file

from helpers import quick
from splitlab.engine import run
from splitlab.errors import RoundFailed
from splitlab.net.certs import make_certs
from splitlab.roles import ClientNode, ModelAverage
from splitlab.transport import ClientDropped, Transport


class LeavesAtFirstForward(Transport):
    """In process: client 2 leaves at its first forward (as the silent client below does)."""

    left = False

    def call(self, method, spec, counted, *args, **kwargs):
        role = getattr(method, "__self__", None)
        if isinstance(role, ClientNode) and role.id == 2 and method.__name__ == "forward" and not self.left:
            type(self).left = True
            raise ClientDropped(2, "left")
        return super().call(method, spec, counted, *args, **kwargs)


def test_a_silent_client_is_dropped_the_round_completes_and_it_rejoins(tmp_path, servers):
    config = quick(clients=3, rounds=2, train_subset=150, test_subset=50)
    make_certs(tmp_path / "certs", 3, [])
    server = servers({**config, "out": str(tmp_path / "net")}, heartbeat=0.5, rejoin_wait=60, join_timeout=60)
    honest = [server.client(0), server.client(1)]
    silent = Rogue(server.address, credentials(tmp_path / "certs", "client-2"), 2)
    assert silent.first_reply().kind == 2  # WELCOME
    gone_quiet = threading.Event()

    def answer(verb: str) -> bytes:
        if verb == "forward":
            gone_quiet.set()
            threading.Event().wait()  # never answers, never sends a heartbeat
        return NONE

    threading.Thread(target=silent.serve, args=(answer,), daemon=True).start()
    server.wait_for_log("dropped client 2: no heartbeat")
    back = server.client(2)
    assert server.process.wait() == 0 and all(p.wait() == 0 for p in [*honest, back])

    LeavesAtFirstForward.left = False
    run({**config, "out": str(tmp_path / "local")}, progress=False, transport=LeavesAtFirstForward)
    net, local = (
        load_file(tmp_path / "net" / "weights.safetensors"),
        load_file(tmp_path / "local" / "weights.safetensors"),
    )
    assert all(torch.equal(net[k], local[k]) for k in local)
    rows = [json.loads(line) for line in (tmp_path / "net" / "metrics.jsonl").read_text().splitlines()]
    local_rows = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [[[1, 2]], []]
    assert [r["comm_bytes_by_kind"] for r in rows] == [r["comm_bytes_by_kind"] for r in local_rows]


def test_below_min_clients_the_run_stops_with_one_line(tmp_path, servers):
    config = quick(clients=2, rounds=50, train_subset=400, test_subset=50, eval_every=50)
    make_certs(tmp_path / "certs", 2, [])
    server = servers({**config, "out": str(tmp_path / "net")}, min_clients=2, rejoin_wait=0.5, join_timeout=60)
    staying, killed = server.client(0), server.client(1)
    server.wait_for_log("client 1 connected")
    killed.send_signal(signal.SIGKILL)
    assert server.process.wait() == 4
    errors = [line for line in server.lines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(
        r"error: round \d+: only 1 of 2 clients finished \(dropped: 1\), fewer than min_clients=2", errors[0]
    )
    staying.wait()


def test_an_average_missing_a_contribution_is_renormalised_over_the_others():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    average = ModelAverage()
    average.add(a, 0.2)
    average.add(b, 0.6)  # the third client (0.2) dropped out
    average.incomplete = True
    assert torch.allclose(average.result(a)["w"], torch.tensor([2.5, 5.0]))


def test_a_dropout_in_a_step_the_algorithm_cannot_skip_stops_the_run_in_one_line(tmp_path):
    LeavesAtFirstForward.left = False  # CycleSL's own `cycle` needs every client's batch
    config = quick(algorithm="cycle_sfl", clients=3, rounds=1, out=str(tmp_path / "run"))
    with pytest.raises(RoundFailed, match="round 1: client 2 dropped: left, in a step cycle_sfl cannot finish"):
        run(config, progress=False, transport=LeavesAtFirstForward)
