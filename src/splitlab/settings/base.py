"""What a setting is: a `Setting` plans a run (`plan`), builds one of its nodes in a process of its
own (`node_here`, `splitlab client`) and the roles a Ray actor holds (`host_nodes`,
`host_server`); its `Plan` knows the run's nodes and server, what each holds, what a node in
another process must report of its data, how the nodes are aligned once connected and how the
whole model is assembled. splitlab.build places any plan: in this process, on Ray actors, or
over the network.
"""

from __future__ import annotations

import abc
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.assembly import Assembler
from splitlab.config import ResolvedConfig, RunConfig
from splitlab.data import Dataset
from splitlab.roles import Blueprint, ClientNode, Role
from splitlab.transport import Proxy, Transport

#: the training server's key among a Ray actor's roles
SERVER = "server"
#: the reports of a run's n nodes in other processes of their data, once all have reported (data=own)
Reports = Callable[[int], dict[int, dict[str, Any]]]
#: what a role that holds no dataset needs of its shape to make the blueprint: input shape, classes, input dtype, task
DataShape = tuple[tuple[int, ...], int, torch.dtype, str]


class Plan(abc.ABC):
    """What a run derives from its config before any role exists, the same in every process that
    builds its roles; the builder asks it for the nodes and the server, wherever they are placed."""

    config: ResolvedConfig
    blueprint: Blueprint
    #: test_split=client: each node's held-out (x, y)
    client_test: list[tuple[torch.Tensor, torch.Tensor]] | None

    @property
    def algorithm_class(self) -> type[Algorithm]:
        return self.config.algorithm_class

    @property
    @abc.abstractmethod
    def node_count(self) -> int:
        """How many nodes (clients, or parties) the run has."""

    @abc.abstractmethod
    def node_class(self, k: int) -> type[ClientNode]:
        """Node `k`'s role class (its verbs, wherever it is)."""

    @property
    @abc.abstractmethod
    def server_class(self) -> type[Role]:
        """The training server's role class."""

    @abc.abstractmethod
    def node(self, k: int) -> ClientNode:
        """Node `k`, built in this process, holding only its own samples."""

    @abc.abstractmethod
    def server(self, remote: bool) -> Role:
        """The training server, built in this process; `remote`: its nodes are in other processes."""

    def sync(self) -> Any:
        return self.algorithm_class.Sync(self.blueprint)

    @abc.abstractmethod
    def expected_reports(self) -> dict[int, dict[str, Any] | None]:
        """What each node in another process must report of its data (None: what it first reports)."""

    def actor_loads(self, placed: list[list[int]]) -> list[Any]:
        """What each Ray client worker gets to build the nodes `placed[w]` (one object, put once,
        where all get the same); `Setting.host_nodes` builds them from it."""
        raise NotImplementedError

    def server_load(self) -> Any:
        """What the server's Ray actor gets to build the server (None: the data's shape alone)."""
        return None

    @abc.abstractmethod
    def clients(self, transport: Transport) -> tuple[list[ClientInfo], dict[str, Any]]:
        """Every node with its number of samples, as known before alignment (data=own: from the
        nodes' reports, waited for), and the run's partition.json."""

    def align(
        self, algorithm: Algorithm, proxies: dict[int, Proxy], clients: list[ClientInfo], report: dict[str, Any]
    ) -> tuple[list[ClientInfo], dict[str, Any]]:
        """The nodes' samples aligned once the algorithm reaches them, and what that leaves: the
        clients and partition.json (nothing to align: as they are)."""
        return clients, report

    @abc.abstractmethod
    def test_data(self) -> Dataset:
        """The run's test split, prepared (no training sample: those are in the nodes)."""

    def assembler(self) -> Assembler | None:
        """What assembles the whole model from role states (None: the split model's own)."""
        return None


@dataclasses.dataclass
class Hosted:
    """The roles a Ray actor holds, built there from what the driver sent it."""

    blueprint: Blueprint
    roles: dict[int | str, Role]
    #: a client that moves here, built afresh from its samples (None: nodes never move)
    new_node: Callable[[int], ClientNode] | None = None
    #: test_split=client: node k's held-out inputs, prepared
    held_out: Callable[[int], torch.Tensor] | None = None
    #: the test set, where personal models are evaluated on the actors
    test: tuple[torch.Tensor, torch.Tensor] | None = None


class Setting(abc.ABC):
    """A way of holding a run's samples: how it is planned and where its roles are built, and the
    keys of RunConfig it alone takes or cannot use (refused, given other than their default, by
    `check_keys`)."""

    #: each node holds whole samples, and a finished run is rebuilt whole (splitlab.finished_run);
    #: False: nodes hold parts of each sample, and the setting reads a finished run (vertical: load_final)
    whole_samples: ClassVar[bool] = True
    #: keys that only this setting takes -> why, said where another setting is given one
    own_keys: ClassVar[Mapping[str, str]] = {}
    #: keys of every run that this setting cannot use -> why
    refused_keys: ClassVar[Mapping[str, str]] = {}

    @abc.abstractmethod
    def check(self, config: ResolvedConfig) -> None:
        """UserError if `plan` would refuse the run (for a sweep, before its first run)."""

    @abc.abstractmethod
    def plan(self, config: ResolvedConfig, elsewhere: bool, reports: Reports) -> Plan:
        """Validate the run and derive its plan; UserError on bad input. `elsewhere`: the nodes
        are processes of their own that report their data (`splitlab server`); `reports(n)`: the
        n nodes' reports, once all have reported (with data=own the plan may come from them)."""

    def releasers(self, run: RunConfig) -> int:
        """How many parties release their own part of one sample each time it is used, each a
        mechanism of its own in the privacy accounting: one, the client holding the sample."""
        return 1

    @abc.abstractmethod
    def node_count(self, config: ResolvedConfig) -> int:
        """How many nodes the run has (without building them)."""

    @abc.abstractmethod
    def node_here(self, config: ResolvedConfig, k: int) -> ClientNode:
        """Node `k` built in its own process (`splitlab client`): the same samples and initial
        weights as the node the plan builds; with data=own, from the process's own files."""

    def host_nodes(
        self, config: ResolvedConfig, device: torch.device, load: Any, placed: list[int], shape: DataShape
    ) -> Hosted:
        """The nodes `placed` on a Ray actor, from `Plan.actor_loads`' load."""
        raise NotImplementedError

    def host_server(self, config: ResolvedConfig, device: torch.device, load: Any, shape: DataShape) -> Hosted:
        """The server on its Ray actor, from `Plan.server_load`'s load and the data's shape."""
        raise NotImplementedError


def as_arrays(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields`' tensors as numpy arrays, which Ray's object store maps into actors without copying."""
    return {name: value.numpy() if isinstance(value, torch.Tensor) else value for name, value in fields.items()}


def as_tensors(fields: dict[str, Any]) -> dict[str, Any]:
    """`as_arrays`' numpy arrays as tensors over the same (read-only) memory; the rest as they are."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for name, v in fields.items()}
