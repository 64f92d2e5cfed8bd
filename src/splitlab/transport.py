"""How an algorithm reaches a role: through a proxy that only knows the role's verbs.

A verb is a role method marked with `@verb`, which also says what its tensors are for the
communication ledger: `down` names the kind of every tensor in the call's arguments (client
bound), `up` the kind of every tensor in its result (client -> server), or `KEYED` when the
result is a dict whose keys are the kinds; `down` may also be a tuple, the kind of each positional
argument in turn (None: no tensor). Kinds may name a positional argument, as in
`"{0}_down"` for a verb whose first argument is the slot; what goes from client to client
is counted once, by the sender's verb (`COUNTED_BY_SENDER` on the receiver's). Only calls to clients are counted:
the training and sync servers sit on the same side of the network.

Transports:

- `direct`: the role's method is called with the very objects passed (zero-copy).
- `serialized`: every call and every result is encoded to bytes without pickle
  (splitlab.codec) and decoded on the other side, as a network would; the encoded sizes are the
  ledger's `envelope_bytes`. Same results, bit for bit, which proves no algorithm shares
  objects across the boundary.
- `network` (splitlab.net.server): client nodes in other processes, reached over gRPC; a client
  that leaves raises `ClientDropped`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from splitlab import codec
from splitlab.ledger import Ledger, payload_bytes

KEYED = "<result keys>"
COUNTED_BY_SENDER = "<counted by the sending client's verb>"  # client to client (vanilla SL's relay)

F = TypeVar("F", bound=Callable[..., Any])


class ClientDropped(RuntimeError):
    """A client left: it disconnected or missed a deadline (a network transport). The algorithm's
    shared steps skip it for the rest of the round (splitlab.algorithms.base)."""

    def __init__(self, client_id: int, reason: str) -> None:
        super().__init__(f"client {client_id} dropped: {reason}")
        self.client_id = client_id


@dataclass(frozen=True)
class VerbSpec:
    down: str | tuple[str | None, ...] | None = None
    up: str | None = None
    #: a KEYED result's keys, exactly, or a function of the call's arguments that says them (what a
    #: server checks a client's result against: splitlab.net.checks)
    keys: tuple[str, ...] | Callable[..., tuple[str, ...]] = ()

    def result_keys(self, args: tuple) -> tuple[str, ...]:
        return self.keys(*args) if callable(self.keys) else self.keys


def verb(
    down: str | tuple[str | None, ...] | None = None,
    up: str | None = None,
    keys: tuple[str, ...] | Callable[..., tuple[str, ...]] = (),
) -> Callable[[F], F]:
    """Mark a role method as callable through a transport, with the ledger kinds of its tensors
    (and, for a KEYED result, its keys)."""

    def mark(method: F) -> F:
        method.__verb__ = VerbSpec(down, up, keys)  # type: ignore[attr-defined]
        return method

    return mark


class Proxy:
    """A role as the algorithm sees it: its verbs, called through the transport, nothing else."""

    def __init__(self, transport: Transport, role: object, counted: bool, role_class: type | None = None) -> None:
        self._transport, self._role, self._counted = transport, role, counted
        #: the role's class, whose verbs the proxy exposes (a role in another process has a stand-in)
        self._class = role_class or type(role)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = getattr(getattr(self._class, name, None), "__verb__", None)
        if spec is None:
            raise AttributeError(
                f"{self._class.__name__}.{name} is not a verb; roles are reached only through their verbs"
            )
        call: Callable[..., Any] = functools.partial(
            self._transport.call, getattr(self._role, name), spec, self._counted
        )
        if spec.up == KEYED:
            call = functools.partial(_keyed, f"{self._class.__name__}.{name}", call)
        setattr(self, name, call)  # looked up once per verb
        return call


def _keyed(verb_name: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return as_message(verb_name, call(*args, **kwargs))


class MessageKeyError(LookupError):
    """A key read from a verb's result that the verb does not return: an algorithm's mistake."""


class Message(dict):
    """A keyed verb's result (`@verb(up=KEYED, keys=...)`) as the algorithm reads it: a key it does
    not hold is one line naming the verb and what it returns, never a bare KeyError."""

    def __init__(self, verb_name: str, result: dict[str, Any]) -> None:
        super().__init__(result)
        self.verb_name = verb_name

    def __missing__(self, key: str) -> Any:
        raise MessageKeyError(f"{self.verb_name} returns no {key!r}: its message holds {', '.join(sorted(self))}")


def as_message(verb_name: str, result: Any) -> Any:
    return Message(verb_name, result) if isinstance(result, dict) else result


def client_of(method: Callable[..., Any]) -> int | None:
    """The id of the client whose verb `method` is; None for a role without one (only calls to
    clients are counted: a tensor counted for such a role is refused)."""
    client = getattr(getattr(method, "__self__", None), "id", None)
    return None if client is None else int(client)


class Transport:
    """Delivers verb calls to roles and counts, in the ledger, the tensors that reach or leave a client."""

    name = "direct"
    #: client nodes live in other processes, reached by id (`connect_remote`); they may drop out
    remote: ClassVar[bool] = False
    #: the fewest clients that must finish a round (only a transport whose clients can drop sets it)
    min_clients = 1
    #: how many clients may train at once (algorithms.base.Algorithm.for_each_client)
    concurrency = 1

    def __init__(self, ledger: Ledger, device: torch.device) -> None:
        self.ledger, self.device = ledger, device
        #: called with a client's id before the first call to its node after it dropped out and
        #: connected again as a fresh node (a transport whose clients can drop calls it); the
        #: engine gives the node its kept state back there (Algorithm.rejoined)
        self.on_rejoin: Callable[[int], None] = lambda client_id: None

    def connect(self, role: object, counted: bool) -> Proxy:
        return Proxy(self, role, counted)

    def lease(self, client_id: int) -> contextlib.AbstractContextManager[None]:
        """Client `client_id` trains (a stretch of its round's work) inside this: a transport
        that runs clients on a pool of workers gives it a free one (backend=ray); here, nothing."""
        return contextlib.nullcontext()

    def install_noise_secret(self, blueprint: Any, secret: bytes) -> None:
        """Give the parties this process plays the run's noise secret (splitlab.privacy.keys); a
        transport whose roles live in other processes started by this one gives it to them too."""
        blueprint.noise_secret = secret

    def connect_remote(
        self, role_classes: Mapping[int, type], blueprint: Any, summaries: Mapping[int, dict[str, Any] | None]
    ) -> dict[int, Proxy]:
        """Proxies to every client of the run at once (client k: a `role_classes[k]` node built in
        another process, which must report holding the data `summaries[k]` describes, `data_summary`;
        None: whatever it holds, data=own). All at once, so that no client is turned away as not
        belonging to the run while the others are still being announced."""
        raise NotImplementedError(f"the {self.name} transport reaches only roles in this process")

    def reported_counts(self) -> list[list[int]]:
        """The class counts every remote client reported, once all have (data=own)."""
        raise NotImplementedError(f"the {self.name} transport reaches only roles in this process")

    def reports_to_plan(self, nodes: int) -> dict[int, dict[str, Any]]:
        """What each of a run's `nodes` nodes reports of its own files (data=own), once all have,
        before any role is built: for a setting whose plan depends on them (the vertical parties'
        columns)."""
        raise NotImplementedError(f"the {self.name} transport reaches only roles in this process")

    def drop(self, client_id: int, reason: str) -> None:
        """Drop client `client_id` (a transport whose clients can drop out): it is disconnected and
        left out of the round; it may come back as a fresh node."""
        raise NotImplementedError(f"the {self.name} transport's clients cannot drop out")

    def close(self) -> None:
        """Let go of what the transport started (nothing, in process)."""

    def hand_over(self) -> list[Any]:
        """After a lost role, what the run's rebuild may take over instead of starting it again; it
        leaves this transport, whose close() lets go of the rest (backend=ray: the actors still
        alive; nothing here)."""
        return []

    def pop_seconds(self) -> dict[str, float]:
        """Compute seconds by phase spent since the last call by roles in other processes (Ray actors)."""
        return {}

    def pop_telemetry(self) -> dict[str, Any]:
        """The transport's own figures since the last call, for metrics.jsonl (Ray: driver-actor bytes)."""
        return {}

    def call(self, method: Callable[..., Any], spec: VerbSpec, counted: bool, *args: Any, **kwargs: Any) -> Any:
        if not counted:
            return method(*args, **kwargs)
        client = client_of(method)
        if spec.down is not None or args or kwargs:  # (nothing sent: nothing to count or refuse)
            self._count(spec.down, args, (args, kwargs), client)
        result = method(*args, **kwargs)
        if spec.up is not None or result is not None:
            self._count(spec.up, args, result, client)
        return result

    def _count(self, kind: str | tuple[str | None, ...] | None, args: tuple, payload: Any, client: int | None) -> None:
        if isinstance(kind, tuple):  # a kind per positional argument
            for arg_kind, arg in zip(kind, args):
                self._count(arg_kind, args, arg, client)
        elif kind == KEYED:
            for key, value in payload.items():
                self._add(key, payload_bytes(value), client)
        elif kind == COUNTED_BY_SENDER:
            return
        elif kind is not None:
            self._add(kind.format(*args), payload_bytes(payload), client)
        elif payload_bytes(payload):
            raise TypeError("a tensor crossed to or from a client through a verb that declares no ledger kind")

    def _add(self, kind: str, nbytes: int, client: int | None) -> None:
        if client is None:
            raise TypeError(f"{kind} was counted for a role that is not a client (it has no client id)")
        self.ledger.add(kind, nbytes, client)


class SerializedTransport(Transport):
    """Every call and result goes through bytes, as over a network, but in this process."""

    name = "serialized"

    def call(self, method: Callable[..., Any], spec: VerbSpec, counted: bool, *args: Any, **kwargs: Any) -> Any:
        request = self._carry({"args": list(args), "kwargs": kwargs})
        args, kwargs = tuple(request["args"]), request["kwargs"]
        if counted:
            self._count(spec.down, args, (args, kwargs), client_of(method))
        result = self._carry(method(*args, **kwargs))
        if counted:
            self._count(spec.up, args, result, client_of(method))
        return result

    def _carry(self, message: Any) -> Any:
        data = codec.encode(message)
        self.ledger.envelope_bytes += len(data)
        return codec.decode(data, self.device)


TRANSPORTS: dict[str, type[Transport]] = {"direct": Transport, "serialized": SerializedTransport}
