"""Messages larger than the chunk size go in chunks, joined again with checks (a whole run in
chunks, bit for bit the same: test_launch's SFL-V1 case), and a peer whose chunks do not add up is
dropped with one line saying why."""

from __future__ import annotations

import pytest
from processes import Rogue, ServerThread, credentials

from helpers import quick
from splitlab import codec
from splitlab.build import client_node
from splitlab.net import protocol
from splitlab.net.certs import make_certs
from splitlab.net.checks import data_report


def _message(size: int) -> object:
    return protocol.envelope(protocol.RESULT, "run", seq=7, verb="upload", payload=bytes(range(256)) * (size // 256))


def _pieces(size: int, chunk: int) -> list:
    return list(protocol.chunked(_message(size), chunk))


def test_chunks_join_into_the_message_sent():
    whole = _message(2560)
    pieces = list(protocol.chunked(whole, 1000))
    assert [len(p.payload) for p in pieces] == [1000, 1000, 560]
    assert [(p.chunk, p.chunks, p.total) for p in pieces] == [(0, 3, 2560), (1, 3, 2560), (2, 3, 2560)]
    assembler = protocol.Assembler(2560, "max_message_mib=1")
    assert [assembler.add(p) for p in pieces[:2]] == [None, None]
    assert assembler.add(pieces[2]) == whole
    assert assembler.add(pieces[0]) is None  # ready for the next message
    assert list(protocol.chunked(whole, 2560)) == [whole]  # what fits goes whole


def _refusal(pieces: list, limit: int = 1 << 20) -> str:
    assembler = protocol.Assembler(limit, "max_message_mib=1")
    with pytest.raises(protocol.ChunkError) as error:
        for piece in pieces:
            assembler.add(piece)
    return str(error.value)


def _edited(piece, **fields):
    copy = protocol.Envelope()
    copy.CopyFrom(piece)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_chunks_that_do_not_make_one_message_are_refused_in_one_line():
    a, b, c = _pieces(2560, 1000)
    heartbeat = protocol.envelope(protocol.HEARTBEAT, "run")
    cases = {
        "over the limit": ([a], 2000, "announces 2560 bytes, over max_message_mib=1"),
        "duplicate index": ([a, b, b], None, "chunk 1 of RESULT 7 in 3 chunks again"),
        "out of order": ([a, c], None, "chunk 2 of RESULT 7 in 3 chunks while chunk 1 was due"),
        "no chunk 0": ([b], None, "chunk 1 of RESULT 7 in 3 chunks before its chunk 0"),
        "overflow": ([a, b, _edited(c, payload=bytes(561))], None, "goes past the 2560 bytes announced"),
        "wrong count": ([a, b, _edited(c, payload=bytes(100))], None, "ends at 2100 bytes, 2560 announced"),
        "count past the size": ([_edited(a, chunks=3000)], None, "announces 2560 bytes in 3000 chunks"),
        "another call's": ([a, _edited(b, seq=8)], None, "does not match chunk 0"),
        "another message between": ([a, heartbeat], None, "a HEARTBEAT inside the chunks of RESULT 7"),
        "empty": ([a, _edited(b, payload=b"")], None, "chunk 1 of RESULT 7 in 3 chunks is empty"),
    }
    for name, (pieces, limit, line) in cases.items():
        refusal = _refusal(pieces, limit or 1 << 20)
        assert line in refusal and "\n" not in refusal, name
    unchunked = protocol.Assembler(1 << 20, "max_message_mib=1", chunk_bytes=1000)
    with pytest.raises(protocol.ChunkError, match="a RESULT of 2560 bytes in one envelope, over the chunk size 1000"):
        unchunked.add(_message(2560))


def _join(address: str, creds, client_id: int) -> tuple[Rogue, object]:
    """A client that joins as the protocol says, joining the server's chunks, up to its first CALL."""
    rogue = Rogue(address, creds, client_id)
    assembler = protocol.Assembler(1 << 30, "test")
    for piece in rogue.replies:
        message = assembler.add(piece)
        if message is None:
            continue
        if message.kind == protocol.WELCOME:
            config = codec.decode(bytes(message.payload))["config"]
            report = codec.encode(data_report(client_node(config, client_id), "partition"))
            rogue.outgoing.put(protocol.envelope(protocol.REPORT, message.run_id, payload=report))
        elif message.kind == protocol.CALL:
            return rogue, message
    raise AssertionError("the server ended the stream before calling")


def test_a_client_whose_chunks_do_not_add_up_is_dropped_with_one_line(tmp_path):
    config = quick(clients=3, rounds=1, train_subset=120, test_subset=50, out=str(tmp_path / "run"))
    make_certs(tmp_path / "certs", 3, [])
    server = ServerThread(config, tmp_path / "certs", chunk_kib=1, join_timeout=60, rejoin_wait=60)
    answer = codec.encode({"result": bytes(3000).hex()})  # any payload over a chunk

    def pieces(call) -> list:
        return list(
            protocol.chunked(protocol.envelope(protocol.RESULT, call.run_id, seq=call.seq, payload=answer), 1024)
        )

    bad = {
        0: ("wrong count", lambda p: [_edited(q, chunks=len(p) - 1) for q in p]),
        1: ("overflow", lambda p: [*p[:-1], _edited(p[-1], payload=bytes(len(p[-1].payload) + 1))]),
        2: ("duplicate index", lambda p: [p[0], p[1], p[1]]),
    }
    expected = {
        0: " chunks ends at ",
        1: "goes past the",
        2: "chunk 1 of RESULT",
    }
    rogues = []
    for client_id, (_, tamper) in bad.items():
        rogue, call = _join(server.address, credentials(tmp_path / "certs", f"client-{client_id}"), client_id)
        for piece in tamper(pieces(call)):
            rogue.outgoing.put(piece)
        server.wait_for_log(f"dropped client {client_id}: ")
        rogues.append(rogue)
    for client_id, text in expected.items():
        drops = [line for line in server.lines if f"dropped client {client_id}: " in line]
        assert len(drops) == 1 and text in drops[0], drops
    for rogue in rogues:
        rogue.close()
    assert "round 1: only 0 of 3 clients finished (dropped: 0, 1, 2)" in str(server.wait())  # it ends at once
