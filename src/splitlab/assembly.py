"""The parts of a run that every process holding its roles makes alike: the dataset, the device,
the blueprint, the client nodes and the test set; the `Experiment` they make up and the
`Assembler` of its evaluated model.

They sit below the engine, the settings (splitlab.settings) and the places that build roles
elsewhere (Ray actors: splitlab.ray_backend), so that those build from the same functions
without importing the engine that drives them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.augment import check_augment
from splitlab.config import ResolvedConfig
from splitlab.data import Dataset, load_dataset
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.models import joined, load_shared, split
from splitlab.privacy.record import Recorder
from splitlab.process_settings import training_device
from splitlab.roles import Blueprint, ClientNode, State, SyncServer, TrainingServer
from splitlab.transport import Transport


@dataclasses.dataclass
class Roles:
    """The role objects themselves: the engine's (deployment's) to build and hold, never an algorithm's."""

    clients: list[ClientNode]
    server: TrainingServer
    sync: SyncServer


@dataclasses.dataclass
class Experiment:
    """A fully built run, nothing written yet."""

    config: ResolvedConfig
    data: Dataset  # the test split (the training samples live in the client nodes)
    clients: list[ClientInfo]
    algorithm: Algorithm
    partition_report: dict
    roles: Roles | None  # None: the roles live in other processes (backend=ray)
    blueprint: Blueprint
    transport: Transport
    #: test_split=client: each client's held-out (x, y)
    client_test: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    _assembler: Assembler | None = None

    @property
    def out(self) -> Path:
        return self.config.out_dir

    @property
    def ledger(self) -> Ledger:
        return self.transport.ledger

    @property
    def assembler(self) -> Assembler:
        if self._assembler is None:
            self._assembler = Assembler(self.blueprint)
        return self._assembler

    def assemble(self, states: list[State]) -> nn.Module:
        return self.assembler(states)

    def full_state(self, states: list[State]) -> dict[str, torch.Tensor]:
        return self.assembler.full_state(states)


class Assembler:
    """The evaluated model from role states (the whole model, or client part then server part),
    loaded into modules made once."""

    def __init__(self, blueprint: Blueprint) -> None:
        self.blueprint = blueprint
        self._parts: list[nn.Module] = []

    def _made(self, count: int) -> list[nn.Module]:
        """The whole model (count 1), or client part then server part (count 2)."""
        if len(self._parts) != count:
            model = self.blueprint.new_model()
            cuts = self.blueprint.config.cut, self.blueprint.config.tail_cut
            self._parts = [model] if count == 1 else list(split(model, *cuts))
            for part in self._parts:
                part.eval()
        return self._parts

    def __call__(self, states: list[State]) -> nn.Module:
        for part, state in zip(self._made(len(states)), states):
            load_shared(part, state)
        return joined(self._parts)

    def server_state(self, state: State) -> dict[str, torch.Tensor]:
        """The server part's whole state (a frozen base included) from what its role holds."""
        server = self._made(2)[1]
        load_shared(server, state)
        return dict(server.state_dict())

    @property
    def parts(self) -> list[nn.Module]:
        """The modules last assembled: the whole model, or client part then server part."""
        return self._parts

    def full_state(self, states: list[State]) -> dict[str, torch.Tensor]:
        """The whole model of role states under the unsplit model's names, a frozen base included."""
        self(states)
        return {name: t for part in self._parts for name, t in part.state_dict().items()}


def test_set(config: ResolvedConfig, data: Dataset, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples every evaluation uses, prepared once: the test split, or its seeded `test_subset`."""
    run = config.run
    test = seeded_subset(len(data.test_y), run.test_subset, run.seed, "test_subset")
    return data.inputs(data.test_x[test].to(device)), data.test_y[test].to(device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
    return training_device(torch.device(name))


def seeded_subset(size: int, subset: int | None, seed: int, what: str) -> np.ndarray:
    """Sorted indices of a seeded choice of `subset` out of `size` samples (all if None)."""
    if subset is None:
        return np.arange(size)
    if subset > size:
        raise UserError(f"{what}={subset} is more than the {size} samples the dataset has")
    return np.sort(np.random.default_rng([seed, size]).choice(size, subset, replace=False))


def make_blueprint(
    config: ResolvedConfig, data: Dataset, device: torch.device, init_state: Mapping[str, torch.Tensor] | None
) -> Blueprint:
    """The run's blueprint, the same in every process that builds roles for it; `init_state`: the
    weights `init=` names (splitlab.run_weights.init_state, a layer above this one)."""
    check_augment(config.run.augment, data.name, data.input_shape, data.task)
    return blueprint_of(
        config, device, data.input_shape, data.num_classes, data.inputs(data.train_x[:1]).dtype, data.task, init_state
    )


def blueprint_of(
    config: ResolvedConfig,
    device: torch.device,
    input_shape: tuple[int, ...],
    num_classes: int,
    input_dtype: torch.dtype,
    task: str,
    init_state: Mapping[str, torch.Tensor] | None,
    builders: Mapping[str, Callable[[Blueprint], nn.Module]] | None = None,
    recorder: Recorder | None = None,
) -> Blueprint:
    """The run's blueprint from what it needs of the data: a role that holds no samples (the
    training server on Ray) gets these from the driver and never loads the dataset. `builders` and
    `recorder`: the algorithm's models and the vanilla recorder unless given (a vertical run's)."""
    run = config.run
    return Blueprint(
        run,
        config.params,
        device,
        input_shape,
        num_classes,
        input_dtype,
        task,
        builders=builders or config.algorithm_class.models,
        averaged=config.algorithm_class.averaged,
        model_settings=config.model_settings(),
        recorder=recorder or (Recorder(run.record) if run.record else None),
        init_state=init_state,
    )


def client_nodes(
    blueprint: Blueprint, data: Dataset, owners: Mapping[int, np.ndarray], Client: type[ClientNode]
) -> list[ClientNode]:
    """A `Client` node per data owner k holding only its samples `owners[k]`, as stored (uint8
    images are prepared batch by batch), and with packing=true their segment ids."""
    device = blueprint.device
    segments = data.train_segments
    return [
        Client(
            blueprint,
            k,
            data.train_x[idx].to(device),
            data.train_y[idx].to(device),
            data.prepare,
            None if segments is None else segments[idx].to(device),
        )
        for k, idx in owners.items()
    ]


def load_data(config: ResolvedConfig) -> Dataset:
    """The run's dataset (a language dataset at its `seq_len`, tokenised by model=hf's tokenizer if any)."""
    run = config.run
    return load_dataset(
        run.dataset,
        run.data_dir,
        seed=run.seed,
        seq_len=run.seq_len,
        tokenizer_dir=config.model_dir,
        data_file=run.data_file,
        test_file=run.test_file,
        truncation=run.truncation,
        packing=run.packing,
    )


def personal_metrics(
    assemble: Callable[[list[State]], nn.Module],
    states: list[State],
    x: torch.Tensor,
    y: torch.Tensor,
    blueprint: Blueprint,
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]],
) -> dict[str, float]:
    """The test metrics of one client's personal model (in the driver, or in the Ray actor holding it)."""
    return metrics(blueprint.logits(assemble(states), x), y)
