"""A server killed with SIGKILL and started again with resume=true continues from its last
checkpoint (every round over a network); its clients reconnect; the weights are those of `run`,
also for a vertical run (one node per party, aligned anew on resume). The servers are `splitlab
server` processes (killed); of their clients, one `splitlab client` process reconnects, the others
run `splitlab client`'s code in threads of this process (`ClientThread`), which reconnects alike."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import torch
from processes import ClientThread, Node, seeded_one_at_a_time
from safetensors.torch import load_file
from test_vertical_own import CONFIG as OWN
from test_vertical_own import run_joined, write_tables

from helpers import held_plugin, quick
from splitlab import codec
from splitlab.engine import run
from splitlab.net.certs import make_certs
from splitlab.rundir import CHECKPOINT

VERTICAL = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", device="cpu", seed=0)


def test_a_killed_server_resumes_and_its_clients_reconnect(tmp_path, servers, monkeypatch):
    """Killed once round 1 is checkpointed (the run, a plugin's copy of sfl_v2, waits before round
    2 until the test lets it go on), resumed at round 2 with the same clients, reconnected."""
    held, hold = held_plugin(tmp_path, "sfl_v2")
    monkeypatch.chdir(tmp_path)  # the plugin, for the processes started here
    monkeypatch.syspath_prepend(str(tmp_path))  # and for the client in this process
    config = quick(clients=2, rounds=3, train_subset=300, test_subset=50, **held)
    make_certs(tmp_path / "certs", 2, [])
    out = tmp_path / "net"
    first = servers({**config, "out": str(out)})
    clients = [first.client(0), ClientThread(first, 1)]
    before = killed_after_round_one(first, out)
    hold.unlink()
    second = servers({**config, "out": str(out)}, address=first.address, resume=True)
    assert second.process.wait() == 0 and all(client.wait() == 0 for client in clients)
    after = (out / "metrics.jsonl").read_text().splitlines()
    assert len(before) == 1 and len(after) == 3 and after[0] == before[0]  # (wall times too) not run again

    run({**config, "out": str(tmp_path / "run")}, progress=False)
    net, local = load_file(out / "weights.safetensors"), load_file(tmp_path / "run" / "weights.safetensors")
    assert all(torch.equal(net[k], local[k]) for k in local)


def killed_after_round_one(server, out: Path) -> list[str]:
    """SIGKILL `server` once round 1's checkpoint is written (round 2 held up); the metrics rows it
    wrote."""
    while not (out / CHECKPOINT).exists():  # written in the background after round 1
        assert server.process.poll() is None
        time.sleep(0.05)
    server.process.send_signal(signal.SIGKILL)
    assert server.process.wait() == -signal.SIGKILL
    assert codec.decode((out / CHECKPOINT).read_bytes())["loop"]["round"] == 1
    return (out / "metrics.jsonl").read_text().splitlines()


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_vertical_run_resumes_over_the_network_as_run(tmp_path, servers):
    """One process per party: the server is killed while party 0 (answering by hand) holds up round
    2, after round 1's checkpoint; resumed, it aligns the parties anew (party 1 reconnected by
    itself, party 0 a fresh `splitlab client`), gives them their checkpointed state, and ends with
    the weights, ledger and loss of one uninterrupted `run`."""
    config = dict(VERTICAL, rounds=3, local_steps=2, labels_at=1)
    make_certs(tmp_path / "certs", 2, [])
    out = tmp_path / "net"
    first = servers({**config, "out": str(out)}, join_timeout=60)
    party = Node(first.address, tmp_path / "certs", 0)
    labels = ClientThread(first, 1)
    party.answer_until("begin_round", round=1)
    before = killed_after_round_one(first, out)
    party.leave()
    second = servers({**config, "out": str(out)}, address=first.address, resume=True, join_timeout=60)
    party_again = ClientThread(second, 0)
    assert second.process.wait() == 0 and party_again.wait() == 0 and labels.wait() == 0
    after = (out / "metrics.jsonl").read_text().splitlines()
    assert len(before) == 1 and len(after) == 3 and after[0] == before[0]  # round 1 was not run again

    straight = run({**config, "out": str(tmp_path / "run")}, progress=False)
    resumed = json.loads((out / "summary.json").read_text())
    for key in ("comm_bytes_by_kind", "comm_bytes_by_client", "final_loss"):
        assert resumed[key] == json.loads(json.dumps(straight[key])), key
    net, local = load_file(out / "weights.safetensors"), load_file(tmp_path / "run" / "weights.safetensors")
    assert net.keys() == local.keys() and all(torch.equal(net[k], local[k]) for k in local)


@seeded_one_at_a_time()  # the nodes' seeded initialisations as in processes of their own
def test_a_vertical_run_of_own_files_resumes_over_the_network_as_run(tmp_path, servers):
    """As above with data=own: the resumed server plans the run again from the parties' reports
    (party 1 reconnected by itself, party 0, the label holder, a fresh `splitlab client` reading
    its own file) and ends with the weights, metrics and ledger of `run` on the table that joins
    their files."""
    tables = write_tables(tmp_path, 0)
    config = {**OWN, "rounds": 3, "device": "cpu"}
    make_certs(tmp_path / "certs", 2, [])
    out = tmp_path / "net"
    first = servers({**config, "data": "own", "out": str(out)}, join_timeout=60)
    party = Node(first.address, tmp_path / "certs", 0, data="own", data_dir=str(tables["party0"]))
    other = ClientThread(first, 1, data="own", data_dir=str(tables["party1"]))
    party.answer_until("begin_round", round=1)
    before = killed_after_round_one(first, out)
    party.leave()
    second = servers({**config, "data": "own", "out": str(out)}, address=first.address, resume=True, join_timeout=60)
    party_again = ClientThread(second, 0, data="own", data_dir=str(tables["party0"]))
    assert second.process.wait() == 0, second.log.read_text()
    assert party_again.wait() == 0 and other.wait() == 0

    run_joined(tables, config, tmp_path / "run")
    net, local = load_file(out / "weights.safetensors"), load_file(tmp_path / "run" / "weights.safetensors")
    assert net.keys() == local.keys() and all(torch.equal(net[k], local[k]) for k in local)
    keys = ("test_accuracy", "test_loss", "test_f1", "train_loss", "comm_bytes_by_kind")
    after, straight = ((folder / "metrics.jsonl").read_text().splitlines() for folder in (out, tmp_path / "run"))
    assert len(before) == 1 and len(after) == 3 and after[0] == before[0]  # round 1 was not run again
    assert [[json.loads(row)[k] for k in keys] for row in after] == [
        [json.loads(row)[k] for k in keys] for row in straight
    ]
    resumed, whole_run = (json.loads((folder / "summary.json").read_text()) for folder in (out, tmp_path / "run"))
    for key in ("comm_bytes_by_kind", "comm_bytes_by_client", "final_loss"):
        assert resumed[key] == whole_run[key], key
