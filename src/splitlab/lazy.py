"""`torch` imported on first use, so commands that only print tables (`splitlab datasets`) start in
a fraction of a second instead of paying torch's import (about 1.5 s)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule(ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


torch: Any = _LazyModule("torch")
