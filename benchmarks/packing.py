"""Padded positions processed with and without packing (data/text_rows.py `pack`), on chat rows.

    .venv/bin/python benchmarks/packing.py                     # 300 generated conversations, seq_len 256
    .venv/bin/python benchmarks/packing.py --data_file F.jsonl --model_dir DIR --seq_len 512

Without a file it writes 300 conversations (a user turn of 10 to 100 characters, an assistant
reply of 10 to 80, from a seeded stream) and tokenises them as characters (model=gpt's
vocabulary) with a one-line chat template. A sequence position is padding where it holds no row
(after the row's last target in the loss: what follows it changes no loss); every model forward
processes all of them, so the padded ones are work spent on nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from splitlab.data.jsonl import read_jsonl
from splitlab.data.language import targets_of
from splitlab.data.shakespeare import VOCAB
from splitlab.data.text_rows import encode, lengths_in_loss, pack, pad_id
from splitlab.models.hf import char_tokenizer, load_tokenizer

#: `r: content` and a newline per message (r: the role's initial)
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role[0] }}: {{ m.content }}\n{% endfor %}"


def generated_chats(path: Path, rows: int = 300, seed: int = 0) -> None:
    stream = random.Random(seed)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"]

    def text(low: int, high: int) -> str:
        length, out = stream.randint(low, high), ""
        while len(out) < length:
            out += stream.choice(words) + " "
        return out[:length].strip()

    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": text(10, 100)},
                        {"role": "assistant", "content": text(10, 80)},
                    ]
                }
            )
            + "\n"
            for _ in range(rows)
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_file", type=Path, help="a JSONL file of chat or prompt + completion rows")
    parser.add_argument("--model_dir", help="the tokenizer's model folder (default: characters)")
    parser.add_argument("--seq_len", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data_file = args.data_file or Path(scratch) / "chats.jsonl"
        if args.data_file is None:
            generated_chats(data_file)
        tokenizer = load_tokenizer(args.model_dir) if args.model_dir else char_tokenizer(VOCAB, args.seq_len + 1)
        if args.model_dir is None:
            tokenizer.chat_template = CHAT_TEMPLATE
        x, y = targets_of(*encode(read_jsonl(data_file), tokenizer, args.seq_len, "tokenising"))
    in_rows = sum(lengths_in_loss(y))
    inputs, _, _ = pack(x, y, pad_id(tokenizer))
    print(f"{len(x)} rows, seq_len {args.seq_len}: {in_rows} positions hold a row")
    for name, sequences in (("unpacked", len(x)), ("packed", len(inputs))):
        positions = sequences * args.seq_len
        padded = positions - in_rows
        print(
            f"{name:>9}: {sequences:4} sequences, {positions:6} positions, {padded:6} padded ({padded / positions:.1%})"
        )


if __name__ == "__main__":
    main()
