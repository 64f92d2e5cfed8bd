"""`splitlab generate` and `splitlab.generate` / `splitlab.export` from Python: a finished language
run's model continuing a prompt, through the client stages, then the server stages at the run's
cut, and written as a Hugging Face folder (the model read by splitlab.run_weights, with what
decoding needs from the run directory alone: no training data).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from splitlab.config import DecodingSettings
from splitlab.data.language import characters, encode_prompt
from splitlab.data.text_rows import checked_messages
from splitlab.errors import UserError
from splitlab.generation import decode
from splitlab.models import split
from splitlab.run_weights import export_hf, run_model


def _prompt_ids(tokenizer: Any, rows: str, prompt: str | list[dict]) -> list[int]:
    """The prompt encoded as the run's training rows began (splitlab.data.language.encode_prompt)."""
    if isinstance(tokenizer, str):  # characters (no chat template): outside them refused, not turned into spaces
        unknown = sorted({c for c in str(prompt) if c not in tokenizer})
        if unknown:
            raise UserError(f"prompt has characters outside the model's vocabulary: {''.join(unknown)!r}")
        return encode_prompt(characters(), rows, prompt)
    return encode_prompt(tokenizer, rows, prompt)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "".join(tokenizer[i] for i in ids) if isinstance(tokenizer, str) else tokenizer.decode(ids)


def read_messages(messages: str | list[dict]) -> list[dict]:
    """`messages=`: a list of messages, as JSON text or a file holding it (or a row `{"messages": [...]}`)."""
    if isinstance(messages, str):
        text, where = messages, "messages"
        if not messages.lstrip().startswith(("[", "{")):
            try:
                text, where = Path(messages).read_text(encoding="utf-8"), messages
            except OSError as error:
                raise UserError(f"messages={messages}: neither JSON nor a readable file ({error.strerror})") from None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"{where}: not JSON ({error.msg}); expected a list of messages") from None
        messages = value["messages"] if isinstance(value, dict) and "messages" in value else value
    return checked_messages(messages, "messages")


def generate(run_dir: str | Path, prompt: str = "", messages: str | list[dict] | None = None, **decoding: Any) -> str:
    """`prompt` continued, or with `messages` (a chat run's conversation: a list, JSON text or a
    file) the assistant's reply, as `decoding` (splitlab.config.DecodingSettings) says: encoded as
    the run's training rows were (the tokenizer's beginning-of-sequence token before a prompt +
    completion row's prompt, the chat template with the header of the assistant's reply), each
    token through the client stages, then the server stages at the run's cut, on the last `seq_len`
    tokens; the text ends early at the tokenizer's end-of-sequence token: model=hf's, or the newline
    that ends a completion (E2E's reference, a JSONL row) in model=gpt's characters."""
    config, model, tokenizer, record = run_model(run_dir)
    chat = record["rows"] == "messages"
    if (messages is not None) != chat or (prompt and messages is not None):
        given = "messages=" if messages is not None else "prompt="
        wanted = "messages=FILE_OR_JSON (its conversation)" if chat else "prompt=TEXT"
        raise UserError(f"{str(run_dir)!r} trained on {record['rows']} rows: give {wanted}, not {given}")
    asked: str | list[dict] = read_messages(messages) if messages is not None else prompt
    ids = _prompt_ids(tokenizer, record["rows"], asked)
    if not ids:
        raise UserError('prompt is empty; give prompt="some text"')
    client, server = split(model, config.run.cut)
    eos = (characters() if isinstance(tokenizer, str) else tokenizer).eos_token_id
    produced = decode(lambda t: server(client(t)), ids, DecodingSettings(**decoding), record["seq_len"], eos)
    return _decode(tokenizer, produced) if chat else prompt + _decode(tokenizer, produced)


def export(run_dir: str | Path, out: str | Path) -> dict[str, str]:
    """A finished run's model written to `out/hf` (a folder transformers loads, with its tokenizer)
    and, with LoRA, its adapters to `out/peft` (peft's format), as the run itself writes them when
    it ends; returns the folders written (none for a model with no Hugging Face form)."""
    config, model, _, record = run_model(run_dir)
    written = export_hf(config, list(split(model, config.run.cut)), record["vocabulary"], Path(out))
    if not written:
        raise UserError(f"model={config.run.model} has no Hugging Face form; model=gpt and model=hf runs export")
    return written


class GenerateSettings(DecodingSettings):
    """`splitlab generate RUN KEY=VALUE ...`"""

    prompt: str = Field("", description="the text to continue (a run on text or prompt + completion rows)")
    messages: str | None = Field(
        None, description="a chat run: the conversation whose reply to generate, as JSON or a JSON file"
    )
