"""Rows of text as causal-LM sequences: the row formats of `dataset=jsonl` and `dataset=hf_disk`.

Every row of a file has one format, that of its first row (the first of these whose fields it
has; other fields are ignored):

- `text`: plain language modelling. Each row's tokens are followed by the tokenizer's
  end-of-sequence token where it has one (LEAF's characters: a newline), the rows are joined into one stream and
  cut into sequences of `seq_len + 1` tokens that share one token with the next (the stream's end
  that fills no whole sequence is dropped, as transformers' run_clm does); every position is in
  the loss.
- `prompt` + `completion`: one sequence per row, `[bos] prompt completion [eos]`, each part
  tokenised on its own (so no token spans the two; no space is put between them), padded or cut
  to `seq_len + 1` tokens exactly as E2E's (data/e2e.py); the loss is on the completion and its
  end-of-sequence token only.
- `messages`: a conversation, `[{"role": "user", "content": "..."}, {"role": "assistant", ...}]`,
  rendered by the tokenizer's chat template (`apply_chat_template`) and tokenised whole as it
  would be at inference, padded or cut as above. The loss is on the assistant turns: the tokens
  that start inside what the template adds for an assistant message (its content and end-of-turn
  marker, not the header before it), found by rendering the conversation up to each assistant
  message with and without it. Where a template renders an earlier part of a conversation other
  than as the start of the whole (some drop earlier reasoning), that conversation is in the loss
  whole, and a warning says how many were. Roles are those of OpenAI's chat fine-tuning format
  (`ROLES`; another is refused, not rendered by a template that may not know it), and an assistant
  message with `"weight": 0` (that format's too) is context, not trained on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from splitlab.errors import UserError
from splitlab.lazy import torch
from splitlab.logs import LOGGER, progress
from splitlab.targets import IGNORED

#: format -> the fields a row of it needs
FORMATS = {"text": ("text",), "prompt/completion": ("prompt", "completion"), "messages": ("messages",)}
ALLOWED = "text | prompt + completion | messages"
#: the roles a message may have (OpenAI's chat fine-tuning format; every chat template knows them)
ROLES = ("system", "user", "assistant", "tool")
#: characters tokenised per call (at least a row), so that progress shows
_CHUNK = 1 << 18
#: the share of a corpus's characters that may lie outside a character vocabulary (each a warning)
#: before the corpus is refused: a few curly quotes pass, a text in another script does not
OUTSIDE_LIMIT = 0.01


def row_format(row: Any, where: str) -> str:
    """The format of `row` (a mapping), or a UserError naming `where` and the formats allowed."""
    if isinstance(row, dict):
        for name, fields in FORMATS.items():
            if all(field in row for field in fields):
                return name
    found = ", ".join(row) if isinstance(row, dict) and row else "no fields"
    raise UserError(f"{where}: a row needs the fields {ALLOWED}; found {found}")


def row_value(row: dict, form: str, where: str) -> Any:
    """The row's value in `form`: a string, a (prompt, completion) pair or a list of messages, checked."""
    if row_format(row, where) != form:
        raise UserError(
            f"{where}: a {row_format(row, where)} row where the first row is {form}; every row of a file "
            f"has the first row's format"
        )
    if form == "messages":
        messages = checked_messages(row["messages"], where)
        if not any(in_loss(m) for m in messages):
            raise UserError(
                f"{where}: a conversation without an assistant message (of weight 1) has nothing in the loss"
            )
        return messages
    values = tuple(row[field] for field in FORMATS[form])
    for field, value in zip(FORMATS[form], values):
        if not isinstance(value, str) or not value:
            raise UserError(f"{where}: {field} must be a non-empty string; found {value!r}")
    return values[0] if form == "text" else values


def checked_messages(messages: Any, where: str) -> list[dict]:
    """`messages` if it is a list of messages of the allowed `ROLES`, each weighted 0 or 1 where it
    is an assistant's and weighted at all; else one UserError line naming `where`."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise UserError(f'{where}: messages must be a list of {{"role": "...", "content": "..."}} objects')
    for m in messages:
        if m["role"] not in ROLES:
            raise UserError(f"{where}: unknown role {m['role']!r}; allowed: {', '.join(ROLES)}")
        weight = m.get("weight", 1)
        if isinstance(weight, bool) or weight not in (0, 1) or ("weight" in m and m["role"] != "assistant"):
            raise UserError(
                f"{where}: weight {weight!r} on a {m['role']} message; an assistant message may have "
                f"weight 0 (not trained on) or 1"
            )
    return messages


def in_loss(message: dict) -> bool:
    """An assistant message not marked `"weight": 0` (OpenAI's fine-tuning format) is trained on."""
    return message["role"] == "assistant" and message.get("weight", 1) == 1


class Rows(NamedTuple):
    """A file's rows: their format, their values (`row_value`) and where each is (for refusals)."""

    form: str
    values: list[Any]
    wheres: list[str]


def read_rows(rows: Iterable[tuple[str, Any]], source: str) -> Rows:
    """The `Rows` of `rows`, each (where it is, e.g. "data.jsonl, line 7"; the row)."""
    form, values, wheres = None, [], []
    for where, row in rows:
        form = form or row_format(row, where)
        values.append(row_value(row, form, where))
        wheres.append(where)
    if form is None:
        raise UserError(f"{source}: no rows; expected rows with the fields {ALLOWED}")
    return Rows(form, values, wheres)


def check_characters(parts: list[Rows], vocabulary: str) -> None:
    """Refuse text and prompt/completion rows whose characters lie outside `vocabulary` (model=gpt's
    characters, where each such character becomes a space) beyond OUTSIDE_LIMIT, naming the first
    row holding one, how many there are and which; fewer are a warning. Whitespace stays a space."""
    texts = [
        (where, text)
        for rows in parts
        if rows.form != "messages"
        for where, value in zip(rows.wheres, rows.values)
        for text in ([value] if rows.form == "text" else value)
    ]
    keep = str.maketrans("", "", vocabulary)
    outside: Counter[str] = Counter()
    first = None
    for where, text in texts:
        found = [c for c in text.translate(keep) if not c.isspace()]
        if found and first is None:
            first = where
        outside.update(found)
    if first is None:
        return
    count, total = sum(outside.values()), sum(len(text) for _, text in texts)
    often = ", ".join(f"{c!r} ({n})" for c, n in outside.most_common(5))
    said = f"{first}: {count} of {total} characters ({count / total:.1%}) are outside model=gpt's characters"
    if count > OUTSIDE_LIMIT * total:
        symbols = "".join(c for c in vocabulary if not c.isalnum() and not c.isspace())
        raise UserError(
            f"{said}, most often {often}, and would train as spaces; allowed: A-Z, a-z, 0-9, whitespace and "
            f"{symbols!r} (at most {OUTSIDE_LIMIT:.0%} others); use model=hf with a tokenizer that has them"
        )
    LOGGER.warning(f"{said} ({often}): they train as spaces")


def pad_id(tokenizer: Any) -> int:
    """What fills a sequence after its end (never a target)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def tokenize(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens added: every loader's one call of a tokenizer."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def tokenize_with_progress(tokenizer: Any, texts: list[str], title: str) -> list[list[int]]:
    """`tokenize`, about `_CHUNK` characters at a time, saying how far it is while it lasts."""
    ids: list[list[int]] = []
    with progress(title, sum(map(len, texts)), "characters") as advance:
        start = 0
        while start < len(texts):
            stop, size = start, 0
            while stop < len(texts) and (size < _CHUNK or stop == start):
                size += len(texts[stop])
                stop += 1
            ids += tokenize(tokenizer, texts[start:stop])
            advance(size)
            start = stop
    return ids


def prompt_ids(tokenizer: Any, form: str, prompts: list) -> list[list[int]]:
    """Prompts' token ids as training rows of `form` begin: `text` as it is, a prompt + completion
    row's prompt after the beginning-of-sequence token, a conversation (a list of messages) rendered
    by the chat template with the header of the assistant's reply after it; what `generate` and
    `eval_generate` continue."""
    if form == "messages":
        return tokenize(tokenizer, [render_chat(tokenizer, messages, generation_prompt=True) for messages in prompts])
    bos = [] if tokenizer.bos_token_id is None or form == "text" else [tokenizer.bos_token_id]
    return [bos + ids for ids in tokenize(tokenizer, prompts)]


def references(rows: Rows, tokenizer: Any) -> tuple[list[list[int]], list[list[str]]]:
    """(prompts, references) of test rows for `eval_generate`: a prompt + completion row's prompt
    (`prompt_ids`) and its completion; a conversation up to its last assistant message trained on,
    and that message. Text rows have none."""
    if rows.form == "prompt/completion":
        return prompt_ids(tokenizer, rows.form, [p for p, _ in rows.values]), [[c] for _, c in rows.values]
    if rows.form != "messages":
        return [], []
    lasts = [max(i for i, m in enumerate(messages) if in_loss(m)) for messages in rows.values]
    prompts = prompt_ids(tokenizer, rows.form, [messages[:last] for messages, last in zip(rows.values, lasts)])
    return prompts, [[messages[last]["content"]] for messages, last in zip(rows.values, lasts)]


def cut(ids: list, seq_len: int, truncation: str) -> tuple[list, int]:
    """(what of a row's `ids` a sequence of `seq_len + 1` tokens keeps, how many it drops before it):
    its start, or with truncation=left its end."""
    if truncation == "left" and len(ids) > seq_len + 1:
        return ids[-(seq_len + 1) :], len(ids) - seq_len - 1
    return ids[: seq_len + 1], 0


def masked_sequences(
    prefixes: list[list[int]], completions: list[list[int]], seq_len: int, pad: int, truncation: str = "refuse"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 (N, seq_len + 1), mask bool (N, seq_len)): each prefix then its completion,
    cut to seq_len + 1 tokens (`cut`) and padded with `pad`; `mask[i, j]` is true where the target
    `tokens[i, j + 1]` belongs to the completion (a row cut before its completion has none)."""
    tokens = np.full((len(prefixes), seq_len + 1), pad, dtype=np.int64)
    mask = np.zeros((len(prefixes), seq_len), dtype=bool)
    for i, (prefix, completion) in enumerate(zip(prefixes, completions)):
        sequence, dropped = cut(prefix + completion, seq_len, truncation)
        tokens[i, : len(sequence)] = sequence
        mask[i, max(len(prefix) - 1 - dropped, 0) : len(sequence) - 1] = True
    return torch.from_numpy(tokens), torch.from_numpy(mask)


def with_loss(
    tokens: torch.Tensor, mask: torch.Tensor, truncation: str, title: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of (`tokens`, `mask`) that truncation=left or right left something in the loss; a
    warning counts those dropped (truncation=refuse has refused them, naming each)."""
    kept = mask.any(dim=1)
    if bool(kept.all()):
        return tokens, mask
    if not bool(kept.any()):
        raise UserError(f"{title}: truncation={truncation} leaves no row anything in the loss; raise seq_len")
    LOGGER.warning(
        f"{title}: truncation={truncation} leaves {int((~kept).sum())} of {len(kept)} rows nothing in the loss at "
        f"this seq_len; they are dropped"
    )
    return tokens[kept], mask[kept]


def encode(
    rows: Rows, tokenizer: Any, seq_len: int, title: str, truncation: str = "refuse"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (N, seq_len + 1), loss mask (N, seq_len)) of `rows` (module docstring); `title`
    names the work in progress lines; `truncation` (refuse | left | right) says how a row longer than
    a sequence is cut."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    if rows.form == "text":
        ids = tokenize_with_progress(tokenizer, rows.values, title)
        stream = np.concatenate([np.array(row + eos, dtype=np.int64) for row in ids])
        n = (len(stream) - 1) // seq_len
        if n < 1:
            raise UserError(f"{title}: {len(stream)} tokens make no sequence of seq_len={seq_len}; lower seq_len")
        tokens = torch.from_numpy(stream[: n * seq_len + 1]).unfold(0, seq_len + 1, seq_len).contiguous()
        return tokens, torch.ones(n, seq_len, dtype=torch.bool)
    if rows.form == "messages":
        return _conversations(rows, tokenizer, seq_len, title, truncation)
    return completion_sequences(rows.values, rows.wheres, tokenizer, seq_len, title, truncation)


def completion_sequences(
    pairs: list[tuple[str, str]],
    wheres: list[str],
    tokenizer: Any,
    seq_len: int,
    title: str,
    truncation: str = "refuse",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_sequences` of `[bos] prompt completion [eos]` for each (prompt, completion) pair,
    the loss on the completion; with truncation=refuse a prompt that leaves no room for the
    completion is refused, naming where it is (`wheres`, one per pair)."""
    if tokenizer.eos_token_id is None:
        raise UserError("the model's tokenizer has no end-of-sequence token, which ends every completion")
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    ids = tokenize_with_progress(tokenizer, [text for pair in pairs for text in pair], title)
    prefixes, completions = [bos + p for p in ids[0::2]], [c + [tokenizer.eos_token_id] for c in ids[1::2]]
    longest = max(map(len, prefixes))
    if longest > seq_len and truncation == "refuse":
        row = next(i for i, p in enumerate(prefixes) if len(p) > seq_len)
        raise UserError(
            f"{wheres[row]}: seq_len={seq_len} leaves no room for the completion after a prompt of "
            f"{len(prefixes[row])} tokens; these rows need seq_len >= {longest}, or truncation=left"
        )
    tokens, mask = masked_sequences(prefixes, completions, seq_len, pad_id(tokenizer), truncation)
    return with_loss(tokens, mask, truncation, title)


def render_chat(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    """The chat template's text of `messages` (their role and content only), with the header of the
    assistant's next turn after them where `generation_prompt` (as at inference)."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(messages: list[dict], tokenizer: Any) -> tuple[str, list[tuple[int, int]] | None]:
    """(the rendering, the character spans of its assistant turns), the spans None where the
    template does not render each earlier part as the start of the later ones (module docstring)."""

    def render(upto: list[dict], generation_prompt: bool = False) -> str:
        return render_chat(tokenizer, upto, generation_prompt)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if not in_loss(message):
            continue
        try:
            before, through = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        except Exception:  # noqa: BLE001  (a template may refuse a conversation cut short: then no spans)
            return text, None
        if not (through.startswith(before) and text.startswith(through)):
            return text, None
        spans.append((len(before), len(through)))
    return text, spans


def _conversations(
    rows: Rows, tokenizer: Any, seq_len: int, title: str, truncation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    conversations = rows.values
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            "rows with messages are rendered by the tokenizer's chat template, and this tokenizer has none: "
            "use model=hf model_dir=DIR whose tokenizer has one, or rows with text | prompt + completion"
        )
    tokens = np.full((len(conversations), seq_len + 1), pad_id(tokenizer), dtype=np.int64)
    mask = np.zeros((len(conversations), seq_len), dtype=bool)
    whole = 0
    with progress(title, len(conversations), "conversations") as advance:
        for i, messages in enumerate(conversations):
            text, spans = assistant_spans(messages, tokenizer)
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, _ = cut(encoded["input_ids"], seq_len, truncation)
            offsets, _ = cut(encoded["offset_mapping"], seq_len, truncation)
            tokens[i, : len(ids)] = ids
            if spans is None:
                if not all(in_loss(m) for m in messages if m["role"] == "assistant"):
                    raise UserError(
                        f"{rows.wheres[i]}: an assistant message of weight 0, but the chat template does not render "
                        f"the conversation turn by turn, so its turns cannot be told apart in the loss"
                    )
                whole += 1
                mask[i, : len(ids) - 1] = True
            else:
                starts = np.array([start for start, _ in offsets[1:]], dtype=np.int64)
                for first, end in spans:
                    mask[i, : len(starts)] |= (starts >= first) & (starts < end)
            if truncation == "refuse" and not mask[i].any():
                raise UserError(
                    f"{rows.wheres[i]}: seq_len={seq_len} cuts the conversation before its first "
                    f"assistant token; raise seq_len, or truncation=left"
                )
            advance(1)
    if whole:
        LOGGER.warning(
            f"{title}: the chat template does not render {whole} of {len(conversations)} conversations turn by "
            f"turn as the start of the whole; those are in the loss whole, not only their assistant turns"
        )
    return with_loss(torch.from_numpy(tokens), torch.from_numpy(mask), truncation, title)


def lengths_in_loss(y: torch.Tensor) -> list[int]:
    """Each row of targets `y` up to its last target in the loss (what follows it changes no loss
    of a causal model): the positions `pack` gives it."""
    return (y.shape[1] - (y != IGNORED).flip(1).int().argmax(dim=1)).tolist()


def pack(x: torch.Tensor, y: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, segment ids), each (M, T), of the rows (`x`, `y`: inputs and targets (N, T),
    IGNORED where not in the loss) packed several to a sequence: each row (`lengths_in_loss`) goes,
    in data order, into the first sequence with room for it (first fit), else a new one. A
    sequence's rows have segment ids 0, 1, ... and the padding after them the next id (a row of
    its own, so that no position sees only others'); models/packed.py keeps attention and
    positions within each row."""
    used = lengths_in_loss(y)
    room: list[int] = []
    rows_of: list[list[int]] = []
    for i, length in enumerate(used):
        place = next((s for s, free in enumerate(room) if free >= length), len(room))
        if place == len(room):
            room.append(y.shape[1])
            rows_of.append([])
        room[place] -= length
        rows_of[place].append(i)
    shape = (len(rows_of), y.shape[1])
    inputs, targets = torch.full(shape, pad, dtype=x.dtype), torch.full(shape, IGNORED, dtype=y.dtype)
    segments = torch.empty(shape, dtype=torch.int64)
    for s, rows in enumerate(rows_of):
        start = 0
        for segment, i in enumerate(rows):
            end = start + used[i]
            inputs[s, start:end], targets[s, start:end] = x[i, : used[i]], y[i, : used[i]]
            segments[s, start:end] = segment
            start = end
        segments[s, start:] = len(rows)
    return inputs, targets, segments
