"""The server's start: a client that says HELLO while the run is still being built waits for the
run's clients to be registered, and is admitted whatever its id. The run registers them all at
once (Transport.connect_remote): one by one, a client admitted between two registrations was
refused as not belonging to the run, and the run then waited out join_timeout for it."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
from processes import Rogue, credentials

from helpers import quick
from splitlab.engine import build
from splitlab.net import protocol
from splitlab.net.audit import AuditLog
from splitlab.net.certs import make_certs
from splitlab.net.launch import _free_port
from splitlab.net.server import Hub, NetworkTransport, ServerSettings, client_config

VERTICAL = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", device="cpu", seed=0)


class AdmitsAfterEachRegistration(Hub):
    """A real hub that, after each registration of the run's clients, lets the waiting HELLO of
    the last client be decided before the run goes on: the interleaving that refused it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.decided = threading.Event()

    def expect(self, *args: Any, **kwargs: Any) -> None:
        super().expect(*args, **kwargs)
        assert self.decided.wait(60), "the early client's HELLO was never decided"


@pytest.mark.parametrize("config", [quick(clients=2), VERTICAL], ids=["vanilla", "vertical"])
def test_a_client_saying_hello_before_the_run_registers_its_clients_is_admitted(tmp_path, config):
    make_certs(tmp_path / "certs", 2, [])
    raw = {**config, "out": str(tmp_path / "run")}
    settings = ServerSettings(listen=f"127.0.0.1:{_free_port()}", certs=tmp_path / "certs", join_timeout=60)
    hub = AdmitsAfterEachRegistration(settings, client_config(raw), AuditLog(tmp_path / "connections.jsonl"))
    hub.start()
    first_replies: dict[int, Any] = {}
    answered = threading.Semaphore(0)

    def client(client_id: int) -> None:
        rogue = Rogue(settings.listen, credentials(tmp_path / "certs", f"client-{client_id}"), client_id)
        first_replies[client_id] = rogue.first_reply()
        answered.release()
        if client_id == 1:
            hub.decided.set()
        if first_replies[client_id].kind == protocol.WELCOME:
            rogue.serve_as_node(lambda verb, result: result)  # a vertical run aligns its parties as it is built
        rogue.close()

    clients = [threading.Thread(target=client, args=(k,)) for k in (1, 0)]
    for thread in clients:
        thread.start()
    try:
        build(raw, lambda ledger, device: NetworkTransport(ledger, device, hub))
        # a vanilla run is built without its clients: wait for both HELLOs to be decided before closing
        # (a HELLO still waiting when the server closes is refused, rightly)
        assert all(answered.acquire(timeout=120) for _ in range(2)), first_replies
    finally:
        hub.close()
        for thread in clients:
            thread.join()
    said = {
        k: reply.details() if isinstance(reply, grpc.RpcError) else reply.kind for k, reply in first_replies.items()
    }
    assert said == {0: protocol.WELCOME, 1: protocol.WELCOME}
