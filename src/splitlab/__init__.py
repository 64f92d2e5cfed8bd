"""splitlab: split learning and split federated learning, exact and measurable.

Extending it from a module of your own (docs/extending.md): subclass `splitlab.algorithms.base.
Algorithm` with a `name`, and call `register_model` / `register_dataset` / `register_loss` /
`register_augmentation`; load the module with `plugins=MODULE` or the entry-point group
`splitlab.plugins`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from splitlab.logs import setup_logging

if TYPE_CHECKING:
    from splitlab.augment import register_augmentation
    from splitlab.config import RunConfig
    from splitlab.data import register_dataset
    from splitlab.engine import run
    from splitlab.losses import register_loss
    from splitlab.models import register_model
    from splitlab.runmodel import export, generate

__version__ = "0.1.0"

setup_logging()  # splitlab's messages go to stderr, one line each (splitlab.logs)

#: The API's names (docs/extending.md) and the modules that define them, imported when a name is
#: first asked for, so that `import splitlab` stays light (torch and pydantic take seconds to import).
_MODULE_OF = {
    "run": "splitlab.engine",
    "generate": "splitlab.runmodel",
    "export": "splitlab.runmodel",
    "RunConfig": "splitlab.config",
    "register_model": "splitlab.models",
    "register_dataset": "splitlab.data",
    "register_loss": "splitlab.losses",
    "register_augmentation": "splitlab.augment",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'splitlab' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)


__all__ = [
    "RunConfig",
    "__version__",
    "export",
    "generate",
    "register_augmentation",
    "register_dataset",
    "register_loss",
    "register_model",
    "run",
]
