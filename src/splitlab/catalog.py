"""What `splitlab models` and `splitlab algorithms` print, kept in catalog.json so that listing
answers without importing torch (which alone takes seconds).

The file is generated from the live registries (`python -m splitlab.catalog`) and a test fails
when it is out of date, so it cannot drift from the code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PATH = Path(__file__).with_name("catalog.json")


def load() -> dict[str, list[list[str]]]:
    return json.loads(PATH.read_text())


def generate() -> dict[str, list[list[str]]]:
    """The rows of both tables, computed from the models and algorithms themselves."""
    from splitlab.algorithms import algorithms
    from splitlab.errors import UserError
    from splitlab.models import MODELS, build_model

    models = []
    for name in sorted(MODELS):
        try:
            model, note = build_model(name, (1, 28, 28), 10), ""
        except UserError:  # lstm and gpt take token sequences: shown for LEAF Shakespeare's shape
            try:
                model, note = build_model(name, (80,), 80), " (80 tokens in, 80 classes)"
            except UserError:  # hf: a checkpoint's, from model_dir
                models.append([name, "1 to its blocks", "the checkpoint's (model_dir=DIR)"])
                continue
        parameters = f"{sum(p.numel() for p in model.parameters()):,}{note}"
        models.append([name, ", ".join(map(str, model.valid_cuts)), parameters])
    rows = []
    for name, cls in sorted(algorithms().items()):
        own = ", ".join(f"{k}={_yaml_scalar(f.default)}" for k, f in cls.Params.model_fields.items())
        paragraph = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
        rows.append([name, own or "-", first_sentence(" ".join(paragraph.split()))])
    return {"models": models, "algorithms": rows}


def _yaml_scalar(value: Any) -> str:
    """A default as it is written in a config file (None -> null, True -> true)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not "et al." or "e.g." or one inside brackets)."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "." and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            word = text[:i].rsplit(" ", 1)[-1]
            if word not in ("al", "e.g", "i.e", "cf", "etc", "vs") and not word[-1:].isdigit():
                return text[: i + 1]
    return text


if __name__ == "__main__":
    PATH.write_text(json.dumps(generate(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {PATH}")
