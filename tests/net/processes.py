"""Processes of a networked run for the tests: a server, clients, a client misbehaving by hand, and
a real client node answering by hand until a chosen call."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from splitlab import codec
from splitlab.build import client_count, client_node
from splitlab.config import parse_overrides
from splitlab.engine import serve
from splitlab.net import protocol
from splitlab.net.certs import client_name, make_certs
from splitlab.net.checks import data_report
from splitlab.net.client import ClientSettings, _answer, _heartbeats, run_client
from splitlab.net.launch import LaunchSettings, _free_port, _own_folders
from splitlab.net.server import ServerSettings, split_settings
from splitlab.resolve import resolve_config

SPLITLAB = [sys.executable, "-m", "splitlab"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Server:
    """`splitlab server` in a subprocess, its log in a file."""

    def __init__(self, tmp: Path, config: dict, address: str | None = None, **keys: Any) -> None:
        self.address = address or f"127.0.0.1:{_free_port()}"
        self.certs, self.log = tmp / "certs", tmp / f"server-{self.address.rsplit(':')[1]}-{time.time_ns()}.log"
        items = {**config, **keys, "listen": self.address, "certs": self.certs}
        self.process = subprocess.Popen(
            [*SPLITLAB, "server", *(f"{k}={v}" for k, v in items.items()), "--no-progress"],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )
        self.wait_for_log("listening on")

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines()

    def wait_for_log(self, text: str, count: int = 1) -> None:
        while sum(text in line for line in self.lines()) < count:
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.1)

    def client(self, client_id: int, stderr: Any = subprocess.DEVNULL, **keys: Any) -> subprocess.Popen:
        """`splitlab client` for `client_id`, with `keys` (data=own, data_dir=...) of its own."""
        own = [f"{k}={v}" for k, v in keys.items()]
        return subprocess.Popen(
            [*SPLITLAB, "client", f"connect={self.address}", f"client_id={client_id}", f"certs={self.certs}", *own],
            env=ENV,
            stderr=stderr,
            text=True,
        )

    def client_in_process(self, client_id: int, **keys: Any) -> int:
        """What `splitlab client` runs, here, until the run ends (0) or the server refuses it
        (UserError, which the command prints in one line): a client without a process's start-up
        (seconds), for the tests that need no process of its own."""
        return run_client(ClientSettings(connect=self.address, client_id=client_id, certs=self.certs, **keys))


def started(work: Callable[[], Any], result: list[Any]) -> threading.Thread:
    """`work` in a started daemon thread, what it returns or raises appended to `result`."""

    def target() -> None:
        try:
            result.append(work())
        except Exception as error:  # noqa: BLE001 (the test looks at it)
            result.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


class ServerThread(logging.Handler):
    """`splitlab server` in a thread of this process, its clients in threads too (`client`), its
    lines recorded: a run without processes' start-up, for tests that also patch the server."""

    def __init__(self, config: dict, certs: Path, **keys: Any) -> None:
        super().__init__()
        self.address, self.certs = f"127.0.0.1:{_free_port()}", certs
        self.lines: list[str] = []
        self.ended: list[Any] = []  # the run's summary, or the exception it ended with
        self.threads: list[threading.Thread] = []
        logging.getLogger("splitlab").addHandler(self)  # splitlab's lines do not propagate
        settings = ServerSettings(listen=self.address, certs=certs, **keys)
        self._start(lambda: serve(config, settings, progress=False), self.ended)
        self.wait_for_log("listening on")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def _start(self, work: Callable[[], Any], result: list[Any]) -> None:
        self.threads.append(started(work, result))

    def wait_for_log(self, pattern: str) -> None:
        while not any(re.search(pattern, line) for line in self.lines):
            assert not self.ended, (self.ended, self.lines)
            time.sleep(0.02)

    def client(self, client_id: int, **keys: Any) -> list[Any]:
        """`splitlab client` for `client_id` in a thread; what it ends with: 0, 1 or a UserError."""
        settings = ClientSettings(connect=self.address, client_id=client_id, certs=self.certs, **keys)
        result: list[Any] = []
        self._start(lambda: run_client(settings), result)
        return result

    def wait(self) -> Any:
        """What the server ended with, once it and every client have ended."""
        for thread in self.threads:
            thread.join()
        logging.getLogger("splitlab").removeHandler(self)
        return self.ended[0]


@contextlib.contextmanager
def seeded_one_at_a_time() -> Iterator[None]:
    """torch's seeded initialisations (`fork_rng`, then `manual_seed`, then draws) one thread at a
    time: as in separate processes, where each has its own generator, a server and its clients in
    threads of one process then draw the same initial weights (else one's seed may reset the
    generator in the middle of another's draws)."""
    fork_rng, lock = torch.random.fork_rng, threading.RLock()

    @contextlib.contextmanager
    def one_at_a_time(*args: Any, **kwargs: Any) -> Iterator[None]:
        with lock, fork_rng(*args, **kwargs):
            yield

    torch.random.fork_rng = one_at_a_time
    try:
        yield
    finally:
        torch.random.fork_rng = fork_rng


def launch_in_threads(
    raw: dict, server_keys: dict | None = None, settings: LaunchSettings | None = None
) -> ServerThread:
    """What `splitlab launch` runs, in threads of this process (real gRPC and mutual TLS over
    loopback, without processes' start-up): the run's certificates made in OUT/certs, the server
    given the run's and `server_keys` as KEY=VALUE text, one `run_client` per client with the keys
    launch gives it (data=own: `data_dirs`, its own folder each). The ServerThread, ended: `ended[0]`
    the run's summary or the exception it ended with (a UserError: exit code 2), `lines` what the
    server and the clients said; after a summary, every client has ended with 0 (told BYE)."""
    settings = settings or LaunchSettings()
    config = resolve_config(raw)
    own = _own_folders(config.run.data, settings.data_dirs)
    clients = client_count(raw)
    certs = config.out_dir / "certs"
    make_certs(certs, clients, [], overwrite=True)
    typed = parse_overrides([f"{k}={v}" for k, v in {**raw, **(server_keys or {})}.items() if v is not None])
    keys, run_config = split_settings(typed, ServerSettings)
    mine = [{"data": "own", "data_dir": str(folder)} for folder in own] or [
        {"data_dir": config.run.data_dir} if config.run.data_dir else {} for _ in range(clients)
    ]
    with seeded_one_at_a_time():
        server = ServerThread(run_config, certs, **keys.model_dump(exclude_defaults=True))
        nodes = [server.client(k, threads=settings.threads, **mine[k]) for k in range(clients)]
        ended = server.wait()
    if isinstance(ended, dict):
        assert all(node == [0] for node in nodes), nodes
    return server


def credentials(certs: Path, name: str | None, own: Path | None = None) -> grpc.ChannelCredentials:
    """Trusting the CA in `certs`, presenting `name`'s certificate (from `own`, default `certs`) or none."""
    ca = (certs / "ca.pem").read_bytes()
    if name is None:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    own = own or certs
    key, cert = (own / f"{name}.key").read_bytes(), (own / f"{name}.pem").read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


class NoReply(grpc.RpcError):
    """No first reply came within the wait (a call begun as the server shut down may never complete)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no reply within {seconds:g} s")
        self.seconds = seconds

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no reply within {self.seconds:g} s"


class Rogue:
    """A client speaking the protocol by hand: HELLO, then `answer(verb) -> result` to every CALL."""

    def __init__(
        self, address: str, creds: grpc.ChannelCredentials, client_id: int, hello_payload: bytes = b""
    ) -> None:
        self.channel = grpc.secure_channel(address, creds)
        self.client_id = client_id
        self.outgoing: queue.Queue = queue.Queue()
        self.outgoing.put(protocol.envelope(protocol.HELLO, client_id=client_id, payload=hello_payload))
        connect = self.channel.stream_stream(
            protocol.METHOD,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=protocol.Envelope.FromString,
        )
        self.replies = connect(self._requests())

    def _requests(self) -> Iterator[Any]:
        while (message := self.outgoing.get()) is not None:
            yield message

    def first_reply(self, report: dict | None = None, within: float = 60.0, **own: Any) -> Any:
        """The server's first message (WELCOME), or the RpcError that refused this client, or
        `NoReply` when none came within `within` seconds (as `splitlab client`'s welcome_seconds; gRPC
        may never complete a call begun as the server shut down, nor end it when it is cancelled).
        After a WELCOME it REPORTs its data: `report`, or that of `node`, the node a client of the
        run builds (with `own` keys of its own, as `splitlab client data=own data_dir=...`)."""
        arrived: list[Any] = []

        def wait() -> None:
            try:
                arrived.append(next(self.replies))
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                arrived.append(error)

        # in a thread of its own: a call gRPC never completes is not ended by cancelling it either
        waiter = threading.Thread(target=wait, name=f"first reply to client {self.client_id}", daemon=True)
        waiter.start()
        waiter.join(within)
        if not arrived:
            self.replies.cancel()
            return NoReply(within)
        reply = arrived[0]
        if isinstance(reply, grpc.RpcError):
            return reply
        if isinstance(reply, BaseException):
            raise reply
        if reply.kind == protocol.WELCOME:
            self.config = codec.decode(bytes(reply.payload))["config"]
            if report is None:
                self.node = client_node({**self.config, **own}, self.client_id)
                report = data_report(self.node, own.get("data", "partition"))
            self.outgoing.put(protocol.envelope(protocol.REPORT, reply.run_id, payload=codec.encode(report)))
        return reply

    def serve(self, answer: Callable[[Any], Any], quiet: bool = True) -> None:
        """Answer calls, `answer(call)` each (the payload of a RESULT, or a whole envelope to send),
        until the server ends the stream (with an error, raised unless `quiet`); `finished`: it
        said BYE."""
        self.finished = False
        try:
            for message in self.replies:
                if message.kind == protocol.CALL:
                    reply = answer(message)
                    if isinstance(reply, bytes):
                        reply = protocol.envelope(protocol.RESULT, message.run_id, seq=message.seq, payload=reply)
                    self.outgoing.put(reply)
                self.finished |= message.kind == protocol.BYE
        except grpc.RpcError:
            if not quiet:
                raise

    def serve_as_node(self, tamper: Callable[[str, Any], Any]) -> None:
        """Answer calls as the run's client node would, each result passed through `tamper(verb,
        result)` (after `first_reply` with the node's own report), until the server ends the stream."""

        def answer(message: Any) -> bytes:
            request = codec.decode(bytes(message.payload))
            return codec.encode(
                tamper(message.verb, getattr(self.node, message.verb)(*request["args"], **request["kwargs"]))
            )

        self.serve(answer)

    def close(self) -> None:
        self.outgoing.put(None)
        self.channel.close()


class Node:
    """A client node as `splitlab client` builds it, connected by hand: it answers the server's
    calls and sends heartbeats until the call `answer_until` names, which gets no reply; `leave`
    then ends its heartbeats and its connection, as a process that dies."""

    def __init__(self, address: str, certs: Path, client_id: int, **own: Any) -> None:
        self.rogue = Rogue(address, credentials(certs, client_name(client_id)), client_id)
        self.welcome = self.rogue.first_reply(**own)
        assert self.welcome.kind == protocol.WELCOME, self.welcome
        settings = codec.decode(bytes(self.welcome.payload))
        self.node = self.rogue.node
        self.beating = threading.Event()
        _heartbeats(self.rogue.outgoing, self.welcome.run_id, settings["heartbeat"], self.beating)

    def answer_until(self, verb: str, round: int, nth: int = 1) -> None:
        """Answer every call up to the `nth` call of `verb` in round `round` (from 0: the rounds
        counted by the node's begin_round calls), which is left without a reply."""
        rounds, calls = -1, 0
        for message in self.rogue.replies:
            rounds += message.verb == "begin_round"
            calls += rounds == round and message.verb == verb
            if calls == nth:
                return
            self.rogue.outgoing.put(_answer(self.node, message, self.welcome.run_id))
        raise AssertionError(f"the server ended the stream before call {nth} of {verb} in round {round}")

    def leave(self) -> None:
        self.beating.set()
        self.rogue.close()


NONE = codec.encode(None)


class ClientThread:
    """What `splitlab client` runs, in a thread of this process, for a server anywhere (a
    `Server` process that may be killed and started again: it reconnects as the command does);
    `wait()` as a process's: what it ended with, 0, 1 or the UserError the command prints."""

    def __init__(self, server: Server, client_id: int, **keys: Any) -> None:
        settings = ClientSettings(connect=server.address, client_id=client_id, certs=server.certs, **keys)
        self.ended: list[Any] = []
        self.thread = started(lambda: run_client(settings), self.ended)

    def wait(self) -> Any:
        self.thread.join()
        return self.ended[0]
