"""A certified rogue client over the real protocol: the server of `splitlab server` (in this
process), loopback gRPC with mutual TLS, an honest `splitlab client` (its code, in a thread) and a
rogue holding client 0's key (`Rogue`). Per algorithm family, the rogue answers one call of every
verb the family calls on a client with a malformed reply drawn by hypothesis: a key dropped,
added or renamed, a tensor reshaped, retyped or made non-finite, the result nested or emptied, the
payload truncated, garbage, nested too deep or over `max_message_mib`, the envelope of another
call, an earlier call, another run, protocol or kind, or an ERROR. It reconnects after each (the
server drops it). Every malformed reply must end its connection before any further call or BYE
(the server used nothing of it), with one log line and one audit row each; the server never traces
back or hangs, and the honest client sees the run end (BYE). A personal model the rogue corrupts
at an evaluation ends the run with one line (docs/deployment.md), so that verb comes last."""

from __future__ import annotations

import json
import logging
import random
import re
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from processes import Rogue, credentials
from safetensors.torch import save

from helpers import quick
from splitlab import codec
from splitlab.build import client_node
from splitlab.engine import serve
from splitlab.errors import RoundFailed
from splitlab.net import protocol
from splitlab.net.certs import make_certs
from splitlab.net.checks import tensors
from splitlab.net.client import ClientSettings, run_client
from splitlab.net.launch import _free_port
from splitlab.net.server import MIB, ServerSettings

SPLIT = ("begin_round", "load", "forward", "backward", "upload", "end_round", "state_dict")
PERSONAL = ("begin_round", "forward", "backward", "end_round", "rejoin", "state_dict", "snapshot")
AUX = ("begin_round", "load", "local_aux_step", "upload", "end_round", "state_dict")
FAMILIES = {  # algorithm -> every verb the server calls on a client (rejoin: on a reconnection)
    "sl": ("begin_round", "forward", "backward", "hand_over", "take_over", "end_round", "state_dict"),
    "sfl_v1": SPLIT,
    "sfl_v2": SPLIT,
    "cycle_sfl": SPLIT,
    "fedavg": ("begin_round", "load", "local_step", "upload", "end_round", "state_dict"),
    "psl": PERSONAL,
    "sglr": PERSONAL,
    "cse_fsl": AUX,
    "fsl_sage": (*AUX, "rejoin"),
    "splitgp": (*SPLIT, "mix", "rejoin", "snapshot"),
    "language": SPLIT,  # sfl_v2 of a tiny GPT on plays (the `lm` fixture): targets (B, T), hidden states (B, T, D)
}
LAST = "snapshot"  # refused at an evaluation of personal models, it ends the run (with one line)

PAYLOAD = ("drop", "add", "rename", "reshape", "retype", "nonfinite", "nest", "empty")
WIRE = ("truncate", "garbage", "deep", "huge")
ENVELOPE = ("other_call", "earlier_call", "error", "other_kind", "other_run", "other_version")
MALFORMED = PAYLOAD + WIRE + ENVELOPE
ONE_RUN_EACH = (Phase.explicit, Phase.reuse, Phase.generate)  # a run takes seconds: no shrinking
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)


def _nth_tensor(value: Any, index: int, change: Any, counter: list[int]) -> Any:
    """`value` with its `index`-th tensor (in `tensors` order) replaced by `change(tensor)`."""
    if isinstance(value, torch.Tensor):
        counter[0] += 1
        return change(value) if counter[0] - 1 == index else value
    if isinstance(value, dict):
        return {key: _nth_tensor(item, index, change, counter) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_nth_tensor(item, index, change, counter) for item in value)
    return value


def _malformed_result(result: Any, how: str, n: int) -> Any:
    """`result` changed by `how` so that no honest client would send it (`n` picks where)."""
    if how == "nest":
        return [result]
    if how == "empty":
        return {} if result is None else None
    every = [tensor for _, tensor in tensors(result)]
    floating = [i for i, t in enumerate(every) if t.is_floating_point() and t.numel()]
    if how == "reshape" and every:
        return _nth_tensor(result, n % len(every), lambda t: t.reshape(-1) if t.dim() != 1 else t[None], [0])
    if how == "retype" and every:

        def retype(t: torch.Tensor) -> torch.Tensor:
            others = [d for d in DTYPES if d != t.dtype]
            return t.to(others[n % len(others)])

        return _nth_tensor(result, n % len(every), retype, [0])
    if how == "nonfinite" and floating:

        def poison(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            t.view(-1)[n % t.numel()] = (float("nan"), float("inf"), -float("inf"))[n % 3]
            return t

        return _nth_tensor(result, floating[n % len(floating)], poison, [0])
    if isinstance(result, dict) and result and how in ("drop", "rename"):
        key = sorted(result, key=str)[n % len(result)]
        changed = {k: v for k, v in result.items() if k != key}
        return changed if how == "drop" else {**changed, f"{key}_": result[key]}
    extra = {"extra": torch.zeros(1 + n % 64)}  # "add", and whatever has nothing of that kind to change
    return {**result, **extra} if isinstance(result, dict) else extra


def _malformed_reply(call: Any, result: Any, how: str, n: int, earlier: tuple[int, bytes] | None) -> Any:
    """The envelope a rogue sends for `call` in place of the RESULT holding `result`."""
    payload = codec.encode(result)
    fields: dict[str, Any] = {"kind": protocol.RESULT, "run_id": call.run_id, "seq": call.seq, "payload": payload}
    if how in PAYLOAD:
        fields["payload"] = codec.encode(_malformed_result(result, how, n))
    elif how == "truncate":
        fields["payload"] = payload[: n % len(payload)]
    elif how == "garbage":
        fields["payload"] = random.Random(n).randbytes(1 + n % 512)
    elif how == "deep":
        depth = 65 + n % 5000
        skeleton = "[" * depth + '{"$t":"0"}' + "]" * depth
        fields["payload"] = save({"0": torch.zeros(1)}, metadata={"splitlab.skeleton": skeleton})
    elif how == "huge":
        fields["payload"] = bytes(MIB + 1 + n % 4096)  # over max_message_mib=1
    elif how == "other_call":
        fields["seq"] = call.seq + 1 + n % 100
    elif how == "earlier_call":
        fields["seq"], fields["payload"] = earlier or (0, payload)
    elif how == "error":
        fields.update(kind=protocol.ERROR, payload=b"", error="x" * (n % 400))
    elif how == "other_kind":
        fields["kind"] = (protocol.HELLO, protocol.WELCOME, protocol.CALL, protocol.BYE, protocol.REPORT, 9, 2**31)[
            n % 7
        ]
    elif how == "other_run":
        fields["run_id"] = uuid.UUID(int=n).hex
    return protocol.Envelope(version=protocol.PROTOCOL_VERSION + (how == "other_version") * (1 + n % 5), **fields)


class Plan:
    """What the rogue sends: per verb, one malformed reply (`how`, `n`), each on its own connection."""

    def __init__(self, malformed: dict[str, tuple[str, int]]) -> None:
        self.pending = dict(malformed)
        self.sent: list[tuple[str, str]] = []  # (verb, how), in order
        self.answered_after: list[str] = []  # a CALL or BYE that came after a malformed reply: must stay empty
        self.calls: list[list[str]] = []  # the verbs called, by connection (to tell what happened)

    def due(self, verb: str, answered: list[str]) -> bool:
        """Whether to send `verb`'s malformed reply now, `answered` on this connection (after the first)
        honestly so far. A client that keeps state is sent it back (rejoin) only once a checkpoint
        kept some: until then, a new connection first trains a round and is checkpointed."""
        if verb not in self.pending or (verb == LAST and len(self.pending) > 1):
            return False
        if verb == "rejoin" or "rejoin" not in self.pending or len(self.calls) == 1:
            return True
        return "end_round" in answered and "state_dict" in answered[answered.index("end_round") :]


def _rogue(address: str, creds: grpc.ChannelCredentials, plan: Plan, over: threading.Event) -> None:
    """Client 0, honest but for one malformed reply per connection, until the run is over."""
    while not over.is_set():
        rogue = Rogue(address, creds, 0)
        if not isinstance(rogue.first_reply(within=10), protocol.Envelope):  # the server is starting or stopping
            rogue.close()
            time.sleep(0.05)
        elif _connection(rogue, plan):
            return


def _connection(rogue: Rogue, plan: Plan) -> bool:
    """One welcomed connection, until its stream ends; whether the run is over (BYE)."""
    node, earlier, malformed = client_node(rogue.config, 0), None, False
    plan.calls.append([])

    def answer(call: Any) -> Any:
        nonlocal earlier, malformed
        if malformed:
            plan.answered_after.append(call.verb)
        request = codec.decode(bytes(call.payload))
        result = codec.decode(codec.encode(getattr(node, call.verb)(*request["args"], **request["kwargs"])))
        due = not malformed and plan.due(call.verb, plan.calls[-1])
        plan.calls[-1].append(call.verb)
        if not due:
            earlier = (call.seq, codec.encode(result))
            return earlier[1]
        how, n = plan.pending.pop(call.verb)
        plan.sent.append((call.verb, how))
        malformed = True
        return _malformed_reply(call, result, how, n, earlier)

    rogue.serve(answer)
    rogue.close()
    if rogue.finished and malformed:
        plan.answered_after.append("BYE")
    return rogue.finished


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder, 2, [])
    return folder


@pytest.fixture
def recorded(monkeypatch) -> tuple[Records, list[BaseException]]:
    """Every log record (the server's lines, gRPC's errors) and every exception a thread died of."""
    records, died = Records(), []
    loggers = logging.getLogger(), logging.getLogger("splitlab")  # splitlab's lines do not propagate
    for logger in loggers:
        logger.addHandler(records)
    monkeypatch.setattr(threading, "excepthook", lambda hook: died.append(hook.exc_value))
    yield records, died
    for logger in loggers:
        logger.removeHandler(records)


def _listening(address: str) -> None:
    host, port = address.rsplit(":", 1)
    for _ in range(600):
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)


@pytest.mark.parametrize("algorithm", sorted(FAMILIES))
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, phases=ONE_RUN_EACH)
@given(data=st.data())
def test_a_rogue_with_a_valid_certificate_is_dropped_at_every_malformed_reply(
    algorithm, data, certs, recorded, tmp_path, lm
):
    records, died = recorded
    records.records.clear()
    verbs = FAMILIES[algorithm]
    shift = sorted(FAMILIES).index(algorithm) * len(verbs)  # the simplest example of each family: other kinds
    kinds = data.draw(st.permutations(MALFORMED[shift % len(MALFORMED) :] + MALFORMED[: shift % len(MALFORMED)]))
    where = data.draw(st.lists(st.integers(0, 2**16), min_size=len(verbs), max_size=len(verbs)))
    plan = Plan({verb: (how, n) for verb, how, n in zip(verbs, kinds, where)})
    out = tmp_path / uuid.uuid4().hex
    rounds = len(plan.pending) + 5  # one malformed reply a round at least, a round before rejoin, some slack
    family = lm if algorithm == "language" else quick(algorithm=algorithm, clients=2, train_subset=100, test_subset=50)
    config = {**family, "rounds": rounds, "out": str(out)}
    config["eval_every"] = rounds  # personal models are evaluated (snapshot) once, at the end: LAST
    address = f"127.0.0.1:{_free_port()}"
    settings_ = ServerSettings(
        listen=address, certs=certs, max_message_mib=1, heartbeat=30, call_timeout=30, rejoin_wait=10, join_timeout=60
    )
    ended: list[Any] = []

    def server() -> None:
        try:
            ended.append(serve(config, settings_, progress=False))
        except RoundFailed as stopped:
            ended.append(stopped)

    threads = [threading.Thread(target=server, name="server", daemon=True)]
    threads[0].start()
    _listening(address)
    over, honest = threading.Event(), []
    honest_settings = ClientSettings(connect=address, client_id=1, certs=certs, retry_seconds=30)
    threads.append(
        threading.Thread(target=lambda: honest.append(run_client(honest_settings)), name="honest client", daemon=True)
    )
    rogue_args = (address, credentials(certs, "client-0"), plan, over)
    threads.append(threading.Thread(target=_rogue, args=rogue_args, name="rogue"))
    for thread in threads[1:]:
        thread.start()
    threads[0].join(timeout=300)
    over.set()
    for thread in threads[1:]:
        thread.join(timeout=60)
    hung = [thread for thread in threads if thread.is_alive()]
    if hung:  # what happened last and where each hung thread waits, whole (an assert's message is cut short)
        frames = sys._current_frames()
        stacks = [f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident])[-8:])}" for t in hung if t.ident]
        said = [f"{r.relativeCreated / 1000:.1f} s {r.getMessage()}" for r in records.records[-30:]]
        pytest.fail("\n".join(["the server or a client hangs", f"sent {plan.sent}", f"died {died}", *said, *stacks]))
    assert died == [] and honest == [0], (died, honest)
    assert [r.getMessage() for r in records.records if r.exc_info or r.levelno >= logging.ERROR] == []

    # Every verb got its malformed reply; each ended its connection before anything else came.
    assert sorted(verb for verb, _ in plan.sent) == sorted(FAMILIES[algorithm]), f"{plan.sent} {plan.calls}"
    assert plan.answered_after == [], (plan.sent, plan.answered_after)
    if isinstance(ended[0], RoundFailed):  # a personal model refused at an evaluation: one line
        assert plan.sent[-1][0] == LAST and "\n" not in str(ended[0]) and "0" in str(ended[0])
    lines = [r.getMessage() for r in records.records if r.name.startswith("splitlab.net")]
    drops = [line for line in lines if re.search(r"(refused the result of \w+ from|dropped) client 0\b", line)]
    assert len(drops) == len(plan.sent), "\n".join(lines)
    assert not any(re.search(r"(refused|dropped|left).* client 1\b", line) for line in lines)
    audit = [json.loads(line) for line in (out / "connections.jsonl").read_text().splitlines()]
    ends = [row for row in audit if row["event"] in ("drop", "refusal") and row["client"] == 0]
    assert len([row for row in ends if row["reason"] != "the server is shutting down"]) == len(plan.sent), ends
    if (out / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert {client for row in rows for _, client in row["dropped_clients"]} <= {0}
