"""The server's start: a client that says HELLO while the run is still being built waits for the
run's clients to be registered, and is admitted whatever its id. The run registers them all at
once (Transport.connect_remote): one by one, a client admitted between two registrations was
refused as not belonging to the run, and the run then waited out join_timeout for it."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from processes import Rogue, credentials

from helpers import quick
from splitlab.engine import build
from splitlab.net import protocol
from splitlab.net.audit import AuditLog
from splitlab.net.certs import SERVER, make_certs, read_pair
from splitlab.net.client import ClientSettings, run_client
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


def test_a_client_whose_server_never_welcomes_it_retries_and_gives_up(tmp_path, caplog):
    """A real TLS gRPC server that takes every stream and never answers (a hung server, or a call
    gRPC never completes): each connection waits welcome_seconds, then the client tries again, and
    it gives up (exit 1) once retry_seconds have passed without a WELCOME; it never waits for ever."""
    make_certs(tmp_path / "certs", 1, [])
    ca, cert, key = read_pair(tmp_path / "certs", SERVER)
    streams, over = [], threading.Event()

    def silent(requests: Any, context: grpc.ServicerContext) -> Any:
        streams.append(next(requests).kind)  # the HELLO, then nothing
        over.wait(30)
        return iter(())

    service, method = protocol.METHOD.split("/")[1:]
    handler = grpc.method_handlers_generic_handler(
        service,
        {method: grpc.stream_stream_rpc_method_handler(silent, request_deserializer=protocol.Envelope.FromString)},
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=8), handlers=[handler])
    address = f"127.0.0.1:{_free_port()}"
    server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)], root_certificates=ca))
    server.start()
    try:
        with caplog.at_level(logging.INFO, logger="splitlab"):
            settings = ClientSettings(
                connect=address, client_id=0, certs=tmp_path / "certs", retry_seconds=1, welcome_seconds=0.5
            )
            assert run_client(settings) == 1
    finally:
        over.set()
        server.stop(grace=None)
    assert streams[:2] == [protocol.HELLO, protocol.HELLO]  # it said HELLO, waited, and tried again
    lines = [record.getMessage() for record in caplog.records]
    assert f"splitlab client 0: cannot reach {address} (no WELCOME within welcome_seconds=0.5 s); retrying" in lines
    assert lines[-1] == f"splitlab client 0: no server at {address} for 1 s; giving up"
