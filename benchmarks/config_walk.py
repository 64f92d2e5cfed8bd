"""Follow a run's config from `splitlab.engine.run` through the code, as a reader would.

A tiny real run (one round) is traced with `sys.setprofile`: every call of a splitlab
function that receives the config as an argument is a step, recorded as (file, function). The
config is the settings mapping (a dict naming `algorithm` and `dataset`, as given or rebuilt), the
RunConfig and the ResolvedConfig; a config class's own methods (the config only as `self`) are it
being read, not passed on, and do not count; nor do comprehensions. Consecutive steps in one
file are one visit.

Reported: steps, rooms (files visited), per file the visits (how many separate times the walk
enters it), and two kinds of going back up the layers of benchmarks/import_layers.py:
- climbs: a visit to a file of a higher layer than the one before it, which includes coming back
  up from a helper below (the walk is a sequence of calls, so a return shows as the next call);
- calls up: a call whose caller's file is of a lower layer than the callee's (a lower layer calling
  into a higher one with the config: should be none).
Issue 34 asks that no file be entered more than 4 times.

With --holders, an object carrying the config as its `config` attribute (the Experiment, a plan)
counts as the config too: the wider walk, through the loop and the checkpoints.

    python benchmarks/config_walk.py [--run NAME] [--list] [--holders]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
_spec = importlib.util.spec_from_file_location("import_layers", Path(__file__).with_name("import_layers.py"))
assert _spec is not None and _spec.loader is not None
import_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_layers)

TINY = dict(dataset="synthetic", model="mlp", clients=2, rounds=1, batch_size=32, device="cpu", train_subset=64, seed=0)

#: the runs followed: each a tiny real run of one path through the code
RUNS: dict[str, dict[str, Any]] = {
    "sfl_v2": dict(TINY, algorithm="sfl_v2"),
    "vertical": {**{k: v for k, v in TINY.items() if k != "clients"}, "algorithm": "sl", "setting": "vertical"},
    "serialized": dict(TINY, algorithm="sfl_v2", transport="serialized"),
}


@dataclass
class Walk:
    steps: list[tuple[str, str]] = field(default_factory=list)  # (module, function) per step
    calls_up: list[tuple[str, str, str]] = field(default_factory=list)  # (caller, callee, function)

    def visits(self) -> list[str]:
        """The files in the order the walk enters them, consecutive steps in one file collapsed."""
        return [m for i, (m, _) in enumerate(self.steps) if i == 0 or self.steps[i - 1][0] != m]

    def entered(self) -> Counter[str]:
        return Counter(self.visits())

    def climbs(self) -> int:
        visits = self.visits()
        return sum(import_layers.layer(b) > import_layers.layer(a) for a, b in zip(visits, visits[1:]))

    def returns(self) -> int:
        """Visits to a file the walk was in before."""
        return len(self.visits()) - len(set(self.visits()))


def is_config(value: Any) -> bool:
    from splitlab.config import ResolvedConfig, RunConfig

    if isinstance(value, ResolvedConfig | RunConfig):
        return True
    return isinstance(value, Mapping) and "algorithm" in value and "dataset" in value


@functools.cache
def _module(filename: str) -> str | None:
    """The splitlab module of a source file (None outside the package)."""
    path = Path(filename)
    if not path.is_relative_to(SRC / "splitlab"):
        return None
    return import_layers.module_name(path)


def _holds_config(value: Any) -> bool:
    """An object that carries the config as its `config` (an Experiment, a plan): --holders counts it."""
    try:
        return is_config(getattr(value, "config", None))
    except Exception:  # a property that cannot be read here
        return False


def _receives_config(frame: types.FrameType, holders: bool) -> bool:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    names = code.co_varnames[:count]
    values = [frame.f_locals.get(name) for name in names]
    if names and names[0] == "self" and (is_config(values[0]) or (holders and _holds_config(values[0]))):
        values = values[1:]  # the config's (or its holder's) own methods read it, pass nothing on
    for value in values:
        if is_config(value) or (holders and _holds_config(value)):
            return True
        if isinstance(value, tuple | list) and any(is_config(v) for v in value):
            return True
        if isinstance(value, dict) and not is_config(value) and any(is_config(v) for v in value.values()):
            return True
    return False


def follow(config: Mapping[str, Any], holders: bool = False) -> Walk:
    """Run `config` with `splitlab.engine.run` (in a temporary out folder) and record its walk;
    `holders`: objects carrying the config as their `config` count as the config too."""
    from splitlab.engine import run

    walk = Walk()
    started: dict[int, types.FrameType] = {}  # generator frames already entered (a resume is a call too)

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_name.startswith("<"):
            return
        module = _module(frame.f_code.co_filename)
        if module is None or not _receives_config(frame, holders):
            return
        if frame.f_code.co_flags & 0x2A0:  # generator, coroutine, async generator
            if started.get(id(frame)) is frame:
                return
            started[id(frame)] = frame
        caller = frame.f_back
        while caller is not None and _module(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None:
            above = _module(caller.f_code.co_filename)
            assert above is not None
            if import_layers.layer(module) > import_layers.layer(above):
                walk.calls_up.append((above, module, frame.f_code.co_qualname))
        walk.steps.append((module, frame.f_code.co_qualname))

    with tempfile.TemporaryDirectory() as out:
        sys.setprofile(profile)
        try:
            run({**config, "out": out}, progress=False)
        finally:
            sys.setprofile(None)
    return walk


def report(name: str, walk: Walk, show: bool) -> None:
    entered = walk.entered()
    print(
        f"{name}: {len(walk.steps)} steps through {len(entered)} rooms, {len(walk.visits())} visits, "
        f"{walk.climbs()} climbs back up, {walk.returns()} returns to a room, {len(walk.calls_up)} calls up; "
        f"most entered: " + ", ".join(f"{m} {n}" for m, n in entered.most_common(5))
    )
    if show:
        for module, function in walk.steps:
            print(f"  {module}.{function}")
        for caller, callee, function in walk.calls_up:
            print(f"  call up: {caller} -> {callee}.{function}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", choices=sorted(RUNS), action="append", help="the runs to follow (default: all)")
    parser.add_argument("--list", action="store_true", help="list every step and call up")
    parser.add_argument("--holders", action="store_true", help="follow objects carrying the config as theirs too")
    args = parser.parse_args()
    for name in args.run or RUNS:
        report(name, follow(RUNS[name], args.holders), args.list)


if __name__ == "__main__":
    main()
