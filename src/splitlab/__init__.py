"""splitlab: split learning and split federated learning, exact and measurable.

Extending it from a module of your own (docs/extending.md): subclass `splitlab.algorithms.base.
Algorithm` with a `name`, and call `register_model` / `register_dataset` / `register_loss` /
`register_augmentation`; load the module with `plugins=MODULE` or the entry-point group
`splitlab.plugins`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitlab.logs import setup_logging

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from pathlib import Path
    from typing import Any

    from pydantic import BaseModel

    from splitlab.augment import Augmentation
    from splitlab.config import RunConfig
    from splitlab.data import Dataset
    from splitlab.losses import Loss
    from splitlab.models import ModelBuilder

__version__ = "0.1.0"

setup_logging()  # splitlab's messages go to stderr, one line each (splitlab.logs)


def run(config: RunConfig | Mapping[str, Any], *params: BaseModel, **options: Any) -> dict[str, Any]:
    """Run (or resume) one experiment and return its summary (splitlab.engine.run): `config` a
    `RunConfig` or a mapping of KEY: VALUE settings, `params` the algorithm's `Params` and the
    model's params, typed (docs/extending.md)."""
    from splitlab.engine import run

    return run(config, *params, **options)


def __getattr__(name: str) -> Any:
    """`splitlab.RunConfig`, imported when first asked for (pydantic takes a second to import)."""
    if name == "RunConfig":
        from splitlab.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'splitlab' has no attribute {name!r}")


def register_model(
    name: str,
    builder: ModelBuilder,
    params: type[BaseModel] | None = None,
    inputs: Iterable[str] | None = None,
) -> None:
    """`model=name` builds `builder(input_shape, num_classes, **params)`, a StagedModel; `params`: a
    pydantic model of its own keys; `inputs`: the kinds of samples it takes (splitlab.models)."""
    from splitlab.models import register_model

    register_model(name, builder, params, inputs)


def register_dataset(
    name: str,
    loader: Callable[[Path | None, int], Dataset],
    *,
    split_loader: Callable[[Path | None, str], Dataset] | None = None,
    locator: Callable[[Path | None], str] | None = None,
    samples: str | None = None,
) -> None:
    """`dataset=name` loads `loader(data_dir, seed)`, a splitlab.data.Dataset (splitlab.data.datasets);
    `samples`: what one sample is (images, features or tokens)."""
    from splitlab.data import register_dataset

    register_dataset(name, loader, split_loader=split_loader, locator=locator, samples=samples)


def register_loss(name: str, make: Callable[..., Loss], form: str | None = None) -> None:
    """`loss=name[:a[:b...]]` trains with `make(a, b, ...)` (floats), a `splitlab.losses.Loss` built from
    per-target terms; `form` shows its arguments in messages, e.g. "mine:<alpha>"."""
    from splitlab.losses import register_loss

    register_loss(name, make, form)


def register_augmentation(name: str, make: Callable[..., Augmentation], form: str | None = None) -> None:
    """`augment=name[:a...]` applies `make(a, ...)` (floats), a `splitlab.augment.Augmentation`, to
    clients' training batches; `form` shows its arguments in messages, e.g. "noise:<sigma>"."""
    from splitlab.augment import register_augmentation

    register_augmentation(name, make, form)


__all__ = [
    "RunConfig",
    "__version__",
    "register_augmentation",
    "register_dataset",
    "register_loss",
    "register_model",
    "run",
]
