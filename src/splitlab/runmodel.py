"""`splitlab generate`: a finished language run's model continuing a prompt, through the client
stages, then the server stages at the run's cut (the model read by splitlab.run_weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from splitlab.config import DecodingSettings
from splitlab.data.language import characters
from splitlab.errors import UserError
from splitlab.generation import decode
from splitlab.models import split
from splitlab.run_weights import run_model


def _encode(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, str):
        unknown = sorted({c for c in text if c not in tokenizer})
        if unknown:
            raise UserError(f"prompt has characters outside the model's vocabulary: {''.join(unknown)!r}")
        return [tokenizer.index(c) for c in text]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "".join(tokenizer[i] for i in ids) if isinstance(tokenizer, str) else tokenizer.decode(ids)


def generate(run_dir: str | Path, prompt: str, **decoding: Any) -> str:
    """`prompt` continued as `decoding` (splitlab.config.DecodingSettings) says, each token
    through the client stages, then the server stages at the run's cut, on the last `seq_len`
    tokens; the text ends early at the tokenizer's end-of-sequence token: model=hf's, or the newline
    that ends a completion (E2E's reference, a JSONL row) in model=gpt's characters."""
    config, model, tokenizer, window = run_model(run_dir)
    client, server = split(model, config.cut)
    ids = _encode(tokenizer, prompt)
    if not ids:
        raise UserError('prompt is empty; give prompt="some text"')
    eos = (characters() if isinstance(tokenizer, str) else tokenizer).eos_token_id
    produced = decode(lambda tokens: server(client(tokens)), ids, DecodingSettings(**decoding), window, eos)
    return prompt + _decode(tokenizer, produced)


class GenerateSettings(DecodingSettings):
    """`splitlab generate RUN KEY=VALUE ...`"""

    prompt: str = Field(description="the text to continue")
