"""What every algorithm shares: the orchestrator's view of a run, and the steps algorithms share.

An algorithm file subclasses `Algorithm` and says in `train_round` what one round does, as calls
of role verbs (splitlab.roles) through proxies: `self.client(k)`, `self.server`, `self.sync`.
It never holds a model, an optimizer or a sample; when it needs role-side behaviour of its own,
it subclasses a role in its file and names it in `Client`, `Server` or `Sync`. Loop,
evaluation, checkpoints and logging are the engine's.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
import threading
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Literal

import numpy as np
import torch
from pydantic import BaseModel
from torch import nn

from splitlab.config import NoParams, RunConfig
from splitlab.errors import NonFiniteStep, UserError
from splitlab.ledger import payload_bytes
from splitlab.random_streams import register_stream
from splitlab.roles import (
    SPLIT_MODELS,
    Blueprint,
    ClientNode,
    ParamsT,
    State,
    SyncServer,
    TrainingServer,
    random_stream,
    server_copy,
)
from splitlab.secure_aggregation import neighbourhoods
from splitlab.transport import ClientDropped, Proxy
from splitlab.u_shaped import UShapedClient
from splitlab.vectorized import Part, Together, Trained

STREAM_ORDER = register_stream("order", 2)
STREAM_SECAGG_GRAPH = register_stream("secagg.graph", 44)  # SecAgg+'s neighbours (secagg_neighbours)

PartKind = Literal["averaged", "server copy", "own", "fixed"]
"""How a part of the model that clients train together starts and ends (`Algorithm.train_together`)."""


@dataclass(frozen=True)
class ClientInfo:
    """What the orchestrator knows of a client: its id and how many samples it holds."""

    id: int
    num_samples: int


@dataclass
class Context:
    """The orchestrator's view: settings, the clients' ids and sizes, and proxies to the roles."""

    config: RunConfig
    params: BaseModel
    clients: list[ClientInfo]
    client_proxies: dict[int, Proxy]
    server: Proxy
    sync: Proxy
    #: how many clients may train at once (the transport's say: 1 in process, `workers` on Ray)
    concurrency: int = 1
    #: drops a client for good in its transport, with the reason (clients in other processes, that
    #: can drop out); None in process, where a non-finite server step means training diverged
    drop_client: Callable[[int, str], None] | None = None
    #: a client trains inside `lease(client_id)`: the transport's (a free worker on Ray), else nothing
    lease: Callable[[int], contextlib.AbstractContextManager[None]] = lambda client_id: contextlib.nullcontext()
    #: vectorize=true: this process's client nodes, trained a cohort at a time (splitlab.vectorized)
    together: Together | None = None

    def rng(self, rnd: int, stream: int, *keys: int) -> np.random.Generator:
        return random_stream(self.config.seed, rnd, stream, *keys)

    def local_steps(self, client: ClientInfo) -> int:
        return Blueprint.steps_per_round(self.config, client.num_samples)

    def interleaved(self, rnd: int, clients: list[ClientInfo]) -> Iterator[tuple[int, int]]:
        """(k, step) in SplitFed-v2's interleaved order (cut-layer paper, Algorithm 2): at every
        local step, the clients (positions k in `clients`) with batches left go in a fresh random order."""
        steps = [self.local_steps(c) for c in clients]
        for step in range(max(steps, default=0)):
            active = [k for k, n in enumerate(steps) if n > step]
            for k in self.rng(rnd, STREAM_ORDER, step).permutation(active):
                yield int(k), step

    def weights(self, clients: list[ClientInfo]) -> list[float]:
        """FedAvg weights alpha_k = |D_k| / sum of |D_i| over the round's clients."""
        total = sum(c.num_samples for c in clients)
        return [c.num_samples / total for c in clients]


@contextlib.contextmanager
def _pool(threads: int) -> Iterator[cf.ThreadPoolExecutor]:
    """A thread pool whose clients not yet started are dropped when the round stops on an error
    (a lost Ray actor): the engine replays the round, the others' work would be thrown away."""
    pool = cf.ThreadPoolExecutor(threads)
    try:
        yield pool
    finally:
        pool.shutdown(cancel_futures=True)


def holds_state(state: State) -> bool:
    """Whether a role's `state_dict` holds anything of its own: kept slots, a loss scale (fp16),
    SCAFFOLD's control variates or its optimizers' state (keep_client_optimizer)."""
    kept = state["models"] or state.get("controls", {}).get("own") or state.get("kept_optimizers")
    return bool(kept) or "loss_scale" in state


class Algorithm(Generic[ParamsT]):
    """Base class. Subclasses set `name`, their roles and models if not the defaults, and
    implement `train_round`; `Algorithm[MyParams]` declares the algorithm's own settings."""

    name: ClassVar[str]
    #: one sentence for `splitlab algorithms`, where the first of its module's docstring does not
    #: say which algorithm this is (a module holding several)
    description: ClassVar[str | None] = None
    Params: ClassVar[type[BaseModel]] = NoParams
    Client: ClassVar[type[ClientNode]] = ClientNode
    Server: ClassVar[type[TrainingServer]] = TrainingServer
    Sync: ClassVar[type[SyncServer]] = SyncServer
    #: slot -> how its initial model is built; every role builds its own from this table
    models: ClassVar[dict[str, Callable[[Blueprint], nn.Module]]] = SPLIT_MODELS
    #: dataset task -> why this algorithm cannot run it (one line)
    refused_tasks: ClassVar[dict[str, str]] = {}
    #: True when every client keeps its own client part (PSL, SGLR): there is no one global model,
    #: so evaluation averages over clients, each through `personal_model`.
    personal_models: ClassVar[bool] = False
    #: with personal models: client k's model is its client slot, then the training server's slot
    #: (evaluated where the clients are, on Ray: splitlab.ray_backend)
    personal_slots: ClassVar[tuple[str, str]] = ("client_model", "server_model")
    #: it runs U-shaped splits (`cut=A,B`): opted in by an algorithm whose server steps only through
    #: `split_step`, or that takes the round trip through the clients' tails itself (SGLR, CycleSL);
    #: `cut=A,B` is refused for any other (docs/extending.md)
    supports_u_shape: ClassVar[bool] = False
    #: why a built-in algorithm cannot run a U-shaped split (one line, said when `cut=A,B` is refused)
    not_u_shaped: ClassVar[str] = ""
    #: it runs precision=fp16: every backward pass of its roles goes through `Role.backward_pass` in a
    #: step, and every cut gradient it sends comes from that step (`TrainingServer.send_gradient`),
    #: so that each role's loss scale applies (splitlab.loss_scale); fp16 is refused for any other
    supports_fp16: ClassVar[bool] = False
    #: the client slots its sync server averages every round (its federated half): their local
    #: objectives take FedProx's term (`prox_mu`), their steps SCAFFOLD's correction (splitlab.strategies),
    #: and `secure_aggregation` masks them (splitlab.secure_aggregation)
    averaged: ClassVar[tuple[str, ...]] = ()
    #: without `averaged`: why nothing of the clients is averaged (one line, said when prox_mu,
    #: server_opt or scaffold is refused)
    not_averaged: ClassVar[str] = ""
    #: with `averaged`: why its clients do not start each round from the sync server's average, so that
    #: a server optimizer and SCAFFOLD do not apply (one line); empty: they do
    not_from_average: ClassVar[str] = ""
    #: clip_scope=global applies: every training step trains the whole model, in one role (centralized,
    #: FedAvg: as clip_scope=part) or through `split_step`, where the parts exchange their norms
    clips_whole_model: ClassVar[bool] = False
    #: keep_client_optimizer applies: a client receives a copy of its part every round (`download`),
    #: and may keep its optimizer's state for it
    can_keep_client_optimizer: ClassVar[bool] = False
    #: why a per-step schedule (warmup_steps, lr_decay) does not apply, where the training server's
    #: steps in a round are not known before it (`server_steps`)
    no_step_schedule: ClassVar[str] = ""
    #: the server trains a working copy of its part per client (`copy_server`), each its client's steps
    trains_server_copies: ClassVar[bool] = False
    #: it runs vectorize=true: its round's client-local steps, which do not depend on each other,
    #: go through `train_together` when `ctx.together` is set
    supports_vectorize: ClassVar[bool] = False
    #: it runs packing=true: every server step is `split_step`'s, which hands the server the
    #: batch's segment ids with its smashed data (no step of its own on a client's or a whole model)
    supports_packing: ClassVar[bool] = False

    @staticmethod
    def not_vectorized(params: Any) -> str:
        """With `supports_vectorize`: why the algorithm's own settings `params` leave no clients'
        steps to run together (one line); empty where they do."""
        return ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if getattr(cls, "name", None) and cls.supports_u_shape and not issubclass(cls.Client, UShapedClient):
            raise TypeError(
                f"{cls.__name__} declares supports_u_shape, but its Client {cls.Client.__name__} does not extend "
                f"splitlab.u_shaped.UShapedClient, which holds the tail"
            )
        for base in getattr(cls, "__orig_bases__", ()):
            (params, *_) = typing.get_args(base) or (None,)
            if isinstance(params, type) and issubclass(params, BaseModel):
                cls.Params = params

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.params: ParamsT = typing.cast(ParamsT, ctx.params)
        self.server = ctx.server
        self.sync = ctx.sync
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        #: clients that dropped out of the current round (over a network); the shared steps skip them
        self.dropped: set[int] = set()
        #: those of them whose data made the server's computation non-finite
        self.non_finite: set[int] = set()
        #: secure_aggregation: this round's neighbours of each client, by averaged slot (splitlab.secure_aggregation)
        self.secagg_graphs: dict[str, dict[int, list[int]]] = {}
        #: each client's kept slots as last checkpointed (`client_states`): what it gets back when it rejoins
        self._kept: dict[int, State] = {}
        #: clients reached through `client()` since their state was last kept: the only ones whose
        #: state can have changed (a checkpoint fetches nothing from the others: on Ray, O(sampled))
        self._touched: set[int] = set()
        self._training = threading.local()  # a client's tracked losses while it trains in a thread
        #: the training steps tracked in the run (each a client batch trained on, with its loss);
        #: the loop restores it on resume
        self.steps = 0
        #: called with each tracked step's loss and gradient norm (if the server gave one), in
        #: order: the loop's per-step log (log_every)
        self.on_step: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None

    @staticmethod
    def data_owners(indices: list[np.ndarray]) -> list[np.ndarray]:
        """The samples of each client node (the partition's clients; centralized: one owner)."""
        return indices

    def client(self, client_id: int) -> Any:
        self._touched.add(client_id)
        return self.ctx.client_proxies[client_id]

    # --- what a subclass provides ---------------------------------------------------------
    def round_batches(self, clients: list[ClientInfo]) -> int | None:
        """How many mini-batches the clients of a round draw (`ClientNode.next_batch`), for the
        progress within a round; None where they draw none of their own."""
        return sum(self.ctx.local_steps(c) for c in clients)

    def run_steps(self, clients: list[ClientInfo]) -> int:
        """The training steps of a round of `clients` (the run's clock): one per client batch (the
        parties of a vertical run take shared ones)."""
        return self.round_batches(clients) or max((self.ctx.local_steps(c) for c in clients), default=1)

    def server_steps(self, clients: list[ClientInfo]) -> dict[str, int]:
        """By slot, the optimizer steps the training server takes in a round of `clients` (their
        place in a per-step schedule): by default one per client batch, or with a copy per client
        (`trains_server_copies`) each its client's."""
        if self.trains_server_copies:
            return {server_copy(c.id): self.ctx.local_steps(c) for c in clients}
        return {"server_model": self.run_steps(clients)}

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        raise NotImplementedError

    def global_model(self) -> list[State] | None:
        """Weights of the one global model's parts, client side first; None if there is none."""
        return [self.sync.model_state("client_model"), self.server.snapshot("server_model")]

    def role_metrics(self) -> dict[str, float] | None:
        """Test metrics the roles compute among themselves (a vertical run: through its parties,
        splitlab.algorithms.vertical_sl); None: the engine evaluates the model it assembles."""
        return None

    def personal_model(self, client_id: int) -> list[State]:
        """Weights of the model client `client_id` would use; by default the global one."""
        model = self.global_model()
        if model is None:
            raise NotImplementedError(f"{self.name} must implement personal_model()")
        return model

    def shared_model(self) -> list[State] | None:
        """The parts every client's model shares, kept as `weights.safetensors` (under the unsplit
        model's names): the global model, or with personal client parts the server part alone."""
        return self.global_model()

    def client_weights(self) -> dict[str, torch.Tensor] | None:
        """Per-client (personalized) weights a finished run keeps, as `clients.safetensors`; None if none."""
        return None

    def state_dict(self) -> State:
        """The orchestrator's own state across rounds (most have none)."""
        return {}

    def load_state_dict(self, state: State) -> None:
        pass

    # --- the round, as the engine runs it ---------------------------------------------------
    def run_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.dropped, self.non_finite = set(), set()
        if self.ctx.config.lr_by_step:  # the server's rate follows its steps
            self.server.begin_round(rnd, self.server_steps(clients))
        elif self.ctx.config.lr_schedule != "none":  # ... or the round
            self.server.begin_round(rnd)
        for client in clients:
            self.unless_dropped(client.id, "begin_round", rnd)
        if self.ctx.config.secure_aggregation:
            for slot in self.averaged:
                self.secure_setup(rnd, clients, slot)
        self.train_round(rnd, clients)
        for client in clients:
            self.unless_dropped(client.id, "end_round")
        self.server.end_round()

    # --- shared steps ------------------------------------------------------------------------
    def unless_dropped(self, client_id: int, verb: str, *args: Any) -> Any:
        """Client `client_id`'s `verb(*args)`, unless the client dropped out of the round (None).
        A client that leaves (splitlab.transport.ClientDropped) is skipped for the rest of the round."""
        if client_id in self.dropped:
            return None
        try:
            return getattr(self.client(client_id), verb)(*args)
        except ClientDropped:
            self.dropped.add(client_id)
            return None

    def on_data_of(self, client_id: int, verb: str, *args: Any) -> Any:
        """The training server's `verb(*args)` on what client `client_id` sent. If that made the
        server's loss or gradients non-finite (checked before its optimizer steps: the server's
        model is untouched), the client is dropped as if it had left, and told so (None); in
        process, where every client's data is the run's own, training diverged: the run stops."""
        try:
            return getattr(self.server, verb)(*args)
        except NonFiniteStep as error:
            if self.ctx.drop_client is None:
                raise
            self.ctx.drop_client(client_id, f"its data in {verb} made the server's {error.what} {error.value}")
            self.dropped.add(client_id)
            self.non_finite.add(client_id)
            return None

    def finished(self, clients: list[ClientInfo]) -> list[ClientInfo]:
        """The clients that have not dropped out of the round (so far)."""
        return [client for client in clients if client.id not in self.dropped]

    def split_step(self, client_id: int, step: int, server_slot: str = "server_model") -> None:
        """One split-learning step: smashed data up, server step, cut-layer gradient down, client step."""
        sent = self.unless_dropped(client_id, "forward", step)
        if sent is None:
            return
        if self.ctx.config.tail_cut is None:
            reply = self.on_data_of(
                client_id, "train_step", sent["smashed"], sent["labels"], server_slot, sent.get("segments")
            )
        else:
            reply = self.u_shaped_server_step(client_id, step, sent["smashed"], server_slot)
        if reply is None:
            return
        norm = reply.get("grad_norm")  # the server part's (clip_scope=global, log_every)
        if self.ctx.config.clip_scope == "global":  # the norms of both parts cross before either steps
            whole = self.unless_dropped(client_id, "backward_whole", step, reply["cut_grad"], norm)
            own = None if whole is None else whole["grad_norm_up"]
            self.server.finish_step(server_slot, own)
            norm = None if own is None else torch.linalg.vector_norm(torch.stack([norm, own.to(norm.device)]))
        else:
            self.unless_dropped(client_id, "backward", step, reply["cut_grad"])
        self.track(self.step_loss(sent, reply), norm)

    def u_shaped_server_step(self, client_id: int, step: int, smashed: Any, server_slot: str) -> State | None:
        """The server's part of a U-shaped split step: its output at cut B down to the client's
        tail, which takes the loss on its labels; the gradient at B up; the server steps and
        replies the cut gradient at A, with the loss the client reported (None: the client dropped
        out, or its data made the server's step non-finite)."""
        output = self.on_data_of(client_id, "forward_middle", smashed, server_slot)
        tail = None if output is None else self.unless_dropped(client_id, "tail_step", step, output)
        if tail is None:
            return None
        reply = self.on_data_of(client_id, "backward_middle", tail["tail_grad"], server_slot)
        return None if reply is None else {**reply, "loss": tail["loss"]}

    def step_loss(self, sent: State, reply: State) -> torch.Tensor:
        """The training loss of a split step, from what the client sent and the server's reply."""
        return reply["loss"]

    def forwards(self, clients: list[ClientInfo], step: int) -> tuple[list[ClientInfo], list[State]]:
        """Every client's `forward(step)` (smashed data and labels up): the clients that sent, and
        what they sent; a client that dropped out is left out (the server works with the others)."""
        sent = [(client, self.unless_dropped(client.id, "forward", step)) for client in clients]
        return [c for c, message in sent if message is not None], [m for _, m in sent if m is not None]

    def local_step(self, client_id: int) -> None:
        """One ordinary local step of the client's whole model (FedAvg)."""
        reply = self.unless_dropped(client_id, "local_step")
        if reply is not None:
            self.track(reply["loss"])

    def download(self, client_id: int, slot: str = "client_model") -> None:
        """The sync server's global `slot` to the client (counted as `<slot>_down`); under SCAFFOLD
        its control variate c too (`control_down`)."""
        if client_id not in self.dropped:
            self.unless_dropped(client_id, "load", slot, self.sync.model_state(slot))
            if self.ctx.config.scaffold:
                self.unless_dropped(client_id, "load_control", slot, self.sync.control(slot))

    def contribute(self, client_id: int, alpha: float, slots: tuple[str, ...] = ("client_model",)) -> None:
        """The client is done for the round: its `slots` go up to the sync server (counted as
        `<slot>_up`) into the running averages with weight alpha, and its working copies go back
        to the pool (so that clients processed one after another need one copy at a time). A
        client that dropped out adds nothing: the averages are renormalised over those that did.
        Under SCAFFOLD its Delta c_i goes up too (`control_up`); under secure aggregation its slots go
        up masked (`upload_masked`), into a sum the sync server cannot read alone."""
        for slot in slots:
            if self.ctx.config.secure_aggregation:  # the sync server adds what it cannot read
                masked = self.unless_dropped(client_id, "upload_masked", slot, alpha)
                if masked is None:
                    self.sync.missing(slot)
                else:
                    self.sync.add_masked(slot, client_id, masked, alpha)
                continue
            state = self.unless_dropped(client_id, "upload", slot)
            control = self.unless_dropped(client_id, "upload_control", slot) if self.ctx.config.scaffold else None
            if state is None:
                self.sync.missing(slot)
            else:
                self.sync.add(slot, state, alpha)
            if control is not None:  # SCAFFOLD: c <- c + 1/N sum over the round's clients of Delta c_i
                self.sync.add_control(slot, control, 1 / len(self.ctx.clients))
        self.unless_dropped(client_id, "end_round")

    def secure_setup(self, rnd: int, clients: list[ClientInfo], slot: str) -> None:
        """Secure aggregation of `slot` (splitlab.secure_aggregation), phases 1 and 2: the clients'
        public keys to their neighbours, their encrypted shares to their holders, through the sync
        server; the neighbours from the round's seeded graph (secagg_neighbours; all others without)."""
        degree = self.ctx.config.secagg_neighbours
        if len(clients) < 3:  # clients=all: known only now
            raise UserError(
                f"secure_aggregation=true: a round of {len(clients)} client(s); the sum of fewer than 3 gives one away"
            )
        if degree is not None and degree >= len(clients):
            raise UserError(f"secagg_neighbours={degree}: a round of {len(clients)} clients; give fewer than that")
        advertised = {c.id: self.unless_dropped(c.id, "secagg_keys", slot) for c in clients}
        public = {str(k): key for k, key in advertised.items() if key is not None}
        graph = neighbourhoods([int(u) for u in public], degree, self.ctx.rng(rnd, STREAM_SECAGG_GRAPH))
        self.secagg_graphs[slot] = graph
        near = {u: {str(v): public[str(v)] for v in sorted([u, *graph[u]])} for u in graph}
        sealed = {k: self.unless_dropped(int(k), "secagg_shares", slot, near[int(k)]) for k in public}
        shared = {k: shares for k, shares in sealed.items() if shares is not None}
        self.sync.secagg_begin(slot, {k: public[k] for k in shared}, len(public))
        if degree is not None:  # SecAgg+: each one's secrets are its neighbours' and its own
            self.sync.secagg_graph(slot, {k: torch.tensor(graph[int(k)]) for k in shared})
        for k in shared:
            inbox = {u: shares[k] for u, shares in shared.items() if k in shares}
            self.unless_dropped(int(k), "secagg_receive", slot, inbox)

    def average(self, slot: str) -> None:
        """The sync server averages `slot`; under secure aggregation after the unmasking (phase 4):
        the clients still there send the shares that let it remove the masks from the sum, each
        asked only of its neighbours and itself."""
        if self.ctx.config.secure_aggregation:
            outcome, graph = self.sync.secagg_outcome(slot), self.secagg_graphs.pop(slot)
            survivors, dropped = outcome["survivors"].tolist(), outcome["dropped"].tolist()
            answers = {}
            for k in survivors:
                near = {k, *graph[k]}
                asked = [torch.tensor([v for v in ids if v in near]) for ids in (survivors, dropped)]
                answers[k] = self.unless_dropped(k, "secagg_unmask", slot, *asked)
            self.sync.unmask(slot, {k: answer for k, answer in answers.items() if answer is not None})
        self.sync.average(slot)

    def fold_server_copy(self, client_id: int, alpha: float) -> None:
        """The client's working copy of the server part into the round's average with weight alpha
        (`server.fold_copy`); the copy of a client that dropped out is left out and freed, and the
        average renormalised over the copies of those that finished."""
        if client_id in self.dropped:
            self.server.drop_copy(client_id)
        else:
            self.server.fold_copy(client_id, alpha)

    def federated_average(self, clients: list[ClientInfo], slot: str = "client_model") -> None:
        """Every client's `slot` averaged by the sync server with weights |D_k|."""
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self.contribute(client.id, alpha, (slot,))
        self.average(slot)

    def for_each_client(
        self,
        clients: list[ClientInfo],
        train: Callable[[ClientInfo], None],
        fold: Callable[[ClientInfo, float], None],
    ) -> None:
        """`train(client)` for every client, then `fold(client, alpha_k)` in client order (alpha_k:
        the FedAvg weights), for clients that are independent within a round.

        In process, clients go one after another (train, fold, next client): one working copy at
        a time. Where the transport runs clients at once (backend=ray), up to `concurrency` train
        in parallel threads, each on a free worker (`ctx.lease`); a client's fold waits for the
        folds of the clients before it, and the losses its training tracked are counted then, so
        every sum is added in the same order: the same results, bit for bit. At most 2 x
        `concurrency` clients are ahead of the folds, so memory stays flat in K."""
        alphas = self.ctx.weights(clients)
        if self.ctx.concurrency <= 1:
            for client, alpha in zip(clients, alphas):
                train(client)
                fold(client, alpha)
            return
        ahead = 2 * self.ctx.concurrency
        with _pool(self.ctx.concurrency) as pool:
            started = [pool.submit(self._train_tracked, train, client) for client in clients[:ahead]]
            for i, (client, alpha) in enumerate(zip(clients, alphas)):
                for value, norm in started[i].result():
                    self.track(value, norm)
                fold(client, alpha)
                if i + ahead < len(clients):
                    started.append(pool.submit(self._train_tracked, train, clients[i + ahead]))

    def train_together(
        self,
        rnd: int,
        clients: list[ClientInfo],
        parts: dict[str, PartKind],
        sends: Callable[[int], bool] | None = None,
    ) -> dict[tuple[int, int], State]:
        """vectorize=true: every client trains the model made of `parts` (by slot, the client's
        first) for its local steps, a cohort at a time (splitlab.vectorized). Each part starts and
        ends as its kind says, counted in the ledger as the verbs that would move it count:

        - averaged: the sync server's global slot, down to every client and up into its running
          average, with the client's FedAvg weight (`download`, `contribute`);
        - server copy: a copy of the training server's part for every client, folded into the
          average of the round's copies (`copy_server`, `fold_copy`); every step is then a split
          step: smashed data and labels up, their cut gradient down;
        - own: each client's own slot, trained with its own optimizer and given back (PSL's);
        - fixed: each client's own slot, held fixed (FSL-SAGE's auxiliary models).

        The losses of the clients' steps are the run's training losses, unless the clients send
        their smashed data to a server that learns from it at steps `sends(step)`: what they sent
        is returned by (client id, step), for the server to take in its own order."""
        together = typing.cast(Together, self.ctx.together)
        alphas = dict(zip((c.id for c in clients), self.ctx.weights(clients)))
        starts = {"averaged": self.sync.model_state, "server copy": self.server.snapshot}
        spec = [
            Part(slot, starts[kind](slot) if kind in starts else None, kind != "fixed") for slot, kind in parts.items()
        ]
        per_step = self.count_split_step if "server copy" in parts.values() else None
        sent: dict[tuple[int, int], State] = {}
        for trained in together.train(rnd, list(alphas), spec, per_step, sends):
            weights = [alphas[k] for k in trained.clients]
            for i, (part, kind) in enumerate(zip(spec, parts.values())):
                if kind == "averaged":
                    self.add_together(trained, alphas, i, part)
                elif kind == "server copy":
                    self.server.fold_state(trained.weighted_mean(weights, f"{i}."), sum(weights))
            if sends is None:
                for loss in (loss for losses in trained.losses for loss in losses):
                    self.track(loss)
            sent.update(trained.sent)
        return sent

    def interleaved_together(self, rnd: int, clients: list[ClientInfo]) -> None:
        """vectorize=true: SplitFed-v2's interleaved round (`ctx.interleaved`) of split steps on the
        training server's one server part, every client's client part from the sync server's and
        back into its running average (splitlab.vectorized's `train_split`); counted in the ledger
        and tracked as `download`, `split_step` and `contribute` would."""
        together = typing.cast(Together, self.ctx.together)
        alphas = dict(zip((c.id for c in clients), self.ctx.weights(clients)))
        start = self.sync.model_state("client_model")
        order = ((clients[k].id, step) for k, step in self.ctx.interleaved(rnd, clients))
        for trained in together.train_split(rnd, list(alphas), start, order, self.server_reply):
            self.add_together(trained, alphas, 0, Part("client_model", start))

    def server_reply(self, client_id: int, sent: State) -> Any:
        """The training server's step on what a client sent; its loss tracked, the cut gradient returned."""
        reply = self.on_data_of(client_id, "train_step", sent["smashed"], sent["labels"])
        self.track(self.step_loss(sent, reply), reply.get("grad_norm"))
        return reply["cut_grad"]

    def add_together(self, trained: Trained, alphas: dict[int, float], index: int, part: Part) -> None:
        """A cohort's weighted mean of the averaged part `index` into the sync server's running
        average, with the cohort's share of the weights; counted down and up for each client."""
        together = typing.cast(Together, self.ctx.together)
        weights = [alphas[k] for k in trained.clients]
        self.sync.add(part.slot, trained.weighted_mean(weights, f"{index}."), sum(weights))
        nbytes = payload_bytes(typing.cast(State, part.start))
        for k in trained.clients:
            together.count(f"{part.slot}_down", nbytes, k)
            together.count(f"{part.slot}_up", nbytes, k)

    def count_split_step(self, client_id: int, labels: torch.Tensor) -> None:
        """What a split step of vectorize=true sends: the smashed data and labels up, their cut gradient down."""
        together = typing.cast(Together, self.ctx.together)
        smashed = len(labels) * together.cut_bytes()
        together.count("smashed", smashed, client_id)
        together.count("labels", payload_bytes(labels), client_id)
        together.count("cut_grad", smashed, client_id)

    def interleaved_steps(
        self, rnd: int, clients: list[ClientInfo], step: Callable[[ClientInfo, int], State | None]
    ) -> Iterator[tuple[ClientInfo, State | None]]:
        """`step(client, i)` for every local step i of every client, whose steps depend on nothing
        the server sends back; the results come in SplitFed-v2's interleaved order (`ctx.interleaved`).

        In process each step is taken when its turn comes. Where clients run at once (backend=ray),
        each client takes its steps one after another in a thread, ahead of the order, and its
        results wait in the driver for their turn: what the server does with them, and in which
        order, is the same."""
        if self.ctx.concurrency <= 1:
            for k, i in self.ctx.interleaved(rnd, clients):
                yield clients[k], step(clients[k], i)
            return
        results: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in clients]

        def take_steps(k: int) -> None:
            try:
                with self.ctx.lease(clients[k].id):
                    for i in range(self.ctx.local_steps(clients[k])):
                        results[k].put(step(clients[k], i))
            except BaseException as error:  # raised in the driver's thread when its turn comes
                results[k].put(error)

        with _pool(self.ctx.concurrency) as pool:
            for k in range(len(clients)):
                pool.submit(take_steps, k)
            for k, _ in self.ctx.interleaved(rnd, clients):
                result = results[k].get()
                if isinstance(result, BaseException):
                    raise result
                yield clients[k], result

    # --- clients that drop out and come back (over a network) ----------------------------
    def client_states(self) -> dict[int, State]:
        """Every client's own state (`state_dict`: kept slots, their optimizers, its fp16 loss scale),
        for a checkpoint; a client holds one even when it keeps no slot (sfl_v2's, under fp16). A
        client that is away is checkpointed as it was last seen, and gets that state back when it
        rejoins (a transport whose clients can drop out delivers copies; in process nobody rejoins).
        Only the clients reached since the last call are asked: the others' state is as it was kept."""
        for client_id in sorted(self._touched):
            with contextlib.suppress(ClientDropped):
                self._kept[client_id] = self.ctx.client_proxies[client_id].state_dict()
                self._touched.discard(client_id)
        return {k: self._kept[k] for k in sorted(self._kept) if holds_state(self._kept[k])}

    def load_client_states(self, states: dict[int, State]) -> None:
        """A resumed run: every client gets its checkpointed state back."""
        self._kept = dict(states)
        for client_id, state in states.items():
            self.ctx.client_proxies[client_id].load_state_dict(state)

    def rejoined(self, client_id: int) -> None:
        """A client that dropped out is back as a fresh node: it gets its kept slots as last
        checkpointed (counted as `kept_state_down`), so that it goes on where it was, not from the
        initial weights. The transport calls this before anything else reaches the new node."""
        state = self._kept.get(client_id)
        if state is not None and holds_state(state):  # a client that holds nothing has nothing to get back
            self.client(client_id).rejoin(state)

    def _train_tracked(
        self, train: Callable[[ClientInfo], None], client: ClientInfo
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """`train(client)` in a worker thread; the losses (and norms) it tracked, in order."""
        self._training.losses = []
        try:
            with self.ctx.lease(client.id):
                train(client)
            return self._training.losses
        finally:
            del self._training.losses

    def track(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> None:
        """A training step's loss (and the gradient norm the server gave, if any)."""
        losses = getattr(self._training, "losses", None)
        if losses is not None:  # a client training in a thread: counted in client order by for_each_client
            losses.append((loss, grad_norm))
            return
        self._loss_sum = self._loss_sum + loss
        self._loss_count += 1
        self.steps += 1
        if self.on_step is not None:
            self.on_step(loss, grad_norm)

    def pop_train_loss(self) -> float | None:
        """Mean training loss over the steps since the last call (read once per round)."""
        if self._loss_count == 0:
            return None
        mean = float(self._loss_sum) / self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        return mean
