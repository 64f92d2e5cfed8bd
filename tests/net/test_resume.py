"""A server killed with SIGKILL and started again with resume=true continues from its last
checkpoint (every round over a network); its clients reconnect; the weights are those of `run`."""

from __future__ import annotations

import signal
import time

import torch
from safetensors.torch import load_file

from helpers import quick
from splitlab import codec
from splitlab.engine import run
from splitlab.net.certs import make_certs
from splitlab.rundir import CHECKPOINT


def test_a_killed_server_resumes_and_its_clients_reconnect(tmp_path, servers):
    config = quick(clients=2, rounds=6, train_subset=300, test_subset=50)
    make_certs(tmp_path / "certs", 2, [])
    out = tmp_path / "net"
    first = servers({**config, "out": str(out)})
    clients = [first.client(0), first.client(1)]
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
        assert first.process.poll() is None
        time.sleep(0.05)
    first.process.send_signal(signal.SIGKILL)
    assert first.process.wait() == -signal.SIGKILL
    resumed_at = codec.decode((out / CHECKPOINT).read_bytes())["loop"]["round"]
    before = (out / "metrics.jsonl").read_text().splitlines()
    second = servers({**config, "out": str(out)}, address=first.address, resume=True)
    assert second.process.wait() == 0 and all(client.wait() == 0 for client in clients)
    after = (out / "metrics.jsonl").read_text().splitlines()
    assert 1 <= resumed_at < 6 and len(after) == 6
    assert after[:resumed_at] == before[:resumed_at]  # rows (wall times too) from the checkpoint: not run again

    run({**config, "out": str(tmp_path / "run")}, progress=False)
    net, local = load_file(out / "weights.safetensors"), load_file(tmp_path / "run" / "weights.safetensors")
    assert all(torch.equal(net[k], local[k]) for k in local)
