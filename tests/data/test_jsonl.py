"""dataset=jsonl: rows of text, prompt + completion or messages -> sequences and loss masks, counted
by hand; the held-out test rows; every bad file refused in one line before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

from hf_helpers import tiny_hf_model, tiny_tokenizer
from splitlab.cli import main
from splitlab.data import load_dataset
from splitlab.data.language import HELD_OUT
from splitlab.data.shakespeare import VOCAB, CharacterTokenizer
from splitlab.data.text_rows import assistant_spans, encode, read_rows
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.targets import IGNORED

#: renders a conversation as `<|role|>content<eos>`, then `<|assistant|>` to prompt a reply
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY = dict(model="gpt", layers=2, heads=2, width=16, context=32, device="cpu", seed=0)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def ids(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def rows_of(values: list) -> object:
    return read_rows(((f"line {i + 1}", row) for i, row in enumerate(values)), "rows")


def test_prompt_completion_rows_have_the_loss_on_the_completion_and_its_end_only():
    rows = rows_of([{"prompt": "ab:", "completion": "cd"}, {"prompt": "e:", "completion": "fghij", "id": 7}])
    tokens, mask = encode(rows, CharacterTokenizer(), seq_len=6, title="t")
    nl = VOCAB.index("\n")  # the characters' end of sequence, also their padding
    assert tokens.tolist() == [ids("ab:cd") + [nl, nl], ids("e:fghij")]  # the second cut at 7 tokens
    # targets tokens[1:]: row 0 = b : c d \n pad -> c, d and \n in the loss; row 1 = : f g h i j -> f..j
    assert mask.tolist() == [[False, False, True, True, True, False], [False] + [True] * 5]
    assert int(mask.sum()) == 3 + 5
    with pytest.raises(UserError, match=r"line 2: seq_len=1 leaves no room for the completion after a prompt of 2"):
        encode(
            rows_of([{"prompt": "a", "completion": "b"}, {"prompt": "ab", "completion": "c"}]),
            CharacterTokenizer(),
            1,
            "t",
        )


def test_text_rows_are_joined_with_an_end_and_cut_into_overlapping_sequences():
    tokens, mask = encode(rows_of([{"text": "ab"}, {"text": "cde"}]), CharacterTokenizer(), seq_len=3, title="t")
    assert tokens.tolist() == [ids("ab\nc"), ids("cde\n")]  # a b \n c d e \n: two sequences of 3 + 1 sharing c
    assert mask.all() and mask.shape == (2, 3)
    assert encode(rows_of([{"text": "ab"}, {"text": "cde"}]), CharacterTokenizer(), seq_len=6, title="t")[0].shape == (
        1,
        7,
    )
    with pytest.raises(UserError, match="7 tokens make no sequence of seq_len=7; lower seq_len"):
        encode(rows_of([{"text": "ab"}, {"text": "cde"}]), CharacterTokenizer(), seq_len=7, title="t")


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_conversations_have_the_loss_on_the_assistant_turns_only():
    tokenizer = chat_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "To be?"},
        {"role": "assistant", "content": "Or not to be."},
        {"role": "user", "content": "Whether?"},
        {"role": "assistant", "content": "Tis nobler."},
    ]
    text, spans = assistant_spans(messages, tokenizer)
    assert [text[a:b] for a, b in spans] == ["Or not to be.<|endoftext|>", "Tis nobler.<|endoftext|>"]
    tokens, mask = encode(rows_of([{"messages": messages}]), tokenizer, seq_len=96, title="t")
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]  # tokenised whole, as at inference
    assert tokens[0].tolist() == rendered + [tokenizer.eos_token_id] * (97 - len(rendered))  # eos pads
    targets = tokens[0, 1:]
    in_loss = mask[0].nonzero().flatten()
    pieces = torch.tensor_split(targets[in_loss], torch.nonzero(in_loss.diff() > 1).flatten() + 1)
    assert [tokenizer.decode(p) for p in pieces] == ["Or not to be.<|endoftext|>", "Tis nobler.<|endoftext|>"]


def test_a_template_that_rewrites_earlier_turns_puts_the_whole_conversation_in_the_loss(caplog):
    tokenizer = chat_tokenizer()  # earlier assistant turns shown without their content: not a prefix
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "{{ m.content }}", "{% if not loop.last and m.role == 'assistant' %}...{% else %}{{ m.content }}{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "x"},
    ]
    assert assistant_spans(messages, tokenizer)[1] is None
    tokens, mask = encode(rows_of([{"messages": messages}]), tokenizer, seq_len=40, title="t")
    length = len(tokenizer(tokenizer.apply_chat_template(messages, tokenize=False))["input_ids"])
    assert mask[0, : length - 1].all() and not mask[0, length - 1 :].any()
    assert "are in the loss whole" in caplog.text


def test_conversations_need_a_chat_template_and_an_assistant():
    rows = rows_of([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(UserError, match="rendered by the tokenizer's chat template, and this tokenizer has none"):
        encode(rows, CharacterTokenizer(), 16, "t")
    with pytest.raises(UserError, match="line 1: a conversation without an assistant message"):
        rows_of([{"messages": [{"role": "user", "content": "Hi"}]}])


def test_a_file_trains_end_to_end_with_held_out_rows_fixed_across_seeds(tmp_path):
    rows = [{"prompt": f"{i} {i}:", "completion": str(2 * i)} for i in range(20)]  # characters of model=gpt
    data_file = write_jsonl(tmp_path / "sums.jsonl", rows)
    data = load_dataset("jsonl", seq_len=12, data_file=data_file)
    assert data.task == "language" and data.num_classes == len(VOCAB) and data.vocabulary == VOCAB
    assert len(data.test_y) == round(HELD_OUT * 20) == 2 and len(data.train_y) == 18
    completions = sorted(len(str(2 * i)) + 1 for i in range(20))  # digits and the end, each row in the loss
    in_loss = sorted(int(n) for n in (torch.cat([data.train_y, data.test_y]) != IGNORED).sum(1))
    assert in_loss == completions
    assert load_dataset("jsonl", seed=5, seq_len=12, data_file=data_file).test_x.equal(data.test_x)
    test_file = write_jsonl(tmp_path / "test.jsonl", rows[:3])
    with_test = load_dataset("jsonl", seq_len=12, data_file=data_file, test_file=test_file)
    assert len(with_test.train_y) == 20 and len(with_test.test_y) == 3
    summary = run(
        dict(algorithm="sfl_v2", dataset="jsonl", data_file=str(data_file), seq_len=12, clients=2, rounds=1,
             batch_size=4, out=str(tmp_path / "run"), **TINY),
        progress=False,
    )  # fmt: skip
    assert summary["rounds_completed"] == 1 and summary["final_perplexity"] > 1


def test_an_hf_tokenizer_gives_bos_and_eos_around_each_row(tmp_path):
    model_dir = tiny_hf_model(tmp_path / "model")
    data_file = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "To be", "completion": " or not"}] * 4)
    data = load_dataset("jsonl", seq_len=16, tokenizer_dir=str(model_dir), data_file=data_file)
    tokenizer = tiny_tokenizer()
    row = data.train_x[0].tolist()
    assert row[0] == tokenizer.bos_token_id and tokenizer.decode(row[1:]).startswith("To be or not<|endoftext|>")
    assert tokenizer.decode(data.train_y[0][data.train_y[0] != IGNORED]) == " or not<|endoftext|>"


def refused(capsys, tmp_path, *pairs: str, match: str) -> None:
    out = tmp_path / "out"
    argv = ["run", "dataset=jsonl", "model=gpt", "layers=1", "width=8", "heads=2", "seq_len=8", f"out={out}", *pairs]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert not out.exists()


def test_bad_files_are_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "to be or not to be"}] * 4)
    refused(capsys, tmp_path, match="dataset=jsonl needs data_file=PATH")
    refused(capsys, tmp_path, f"data_file={tmp_path / 'none.jsonl'}", match="none.jsonl: no such file")
    (tmp_path / "empty.jsonl").write_text("\n")
    refused(capsys, tmp_path, f"data_file={tmp_path / 'empty.jsonl'}", match="empty.jsonl: no rows; expected rows")
    write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"txt": "b", "id": 1}])
    refused(
        capsys, tmp_path, f"data_file={tmp_path / 'bad.jsonl'}",
        match="bad.jsonl, line 2: a row needs the fields text | prompt + completion | messages; found txt, id",
    )  # fmt: skip
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n\n{"text": \n')
    broken = "broken.jsonl, line 3: not valid JSON (Expecting value at column 10)"
    refused(capsys, tmp_path, f"data_file={tmp_path / 'broken.jsonl'}", match=broken)
    write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"prompt": "b", "completion": "c"}])
    refused(capsys, tmp_path, f"data_file={tmp_path / 'mixed.jsonl'}", match="line 2: a prompt/completion row where")
    write_jsonl(tmp_path / "number.jsonl", [{"prompt": "b", "completion": 3}])
    refused(capsys, tmp_path, f"data_file={tmp_path / 'number.jsonl'}", match="completion must be a non-empty string")
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "b", "completion": "c"}])
    refused(
        capsys, tmp_path, f"data_file={good}", f"test_file={tmp_path / 'pairs.jsonl'}",
        match="pairs.jsonl, line 1: prompt/completion rows, where the training rows are text",
    )  # fmt: skip
    write_jsonl(tmp_path / "one.jsonl", [{"text": "to be or not to be"}])
    refused(capsys, tmp_path, f"data_file={tmp_path / 'one.jsonl'}", match="one row cannot be split")
    refused(capsys, tmp_path, f"data_file={good}", f"data_dir={tmp_path}", match="data_dir=")
    assert main(["run", "dataset=digits", f"data_file={good}", f"out={tmp_path / 'out'}"]) == 2
    assert "data_file is read by dataset=jsonl" in capsys.readouterr().err


def test_a_checkpoints_chat_template_renders_messages_rows(tmp_path):
    model_dir = tiny_hf_model(tmp_path / "model")
    chat_tokenizer().save_pretrained(model_dir)  # writes chat_template.jinja beside tokenizer.json
    chat = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "Or not."}]
    data_file = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat}] * 3)
    data = load_dataset("jsonl", seq_len=32, tokenizer_dir=str(model_dir), data_file=data_file)
    assert len(data.train_y) == 2 and len(data.test_y) == 1
    for targets in torch.cat([data.train_y, data.test_y]):
        assert chat_tokenizer().decode(targets[targets != IGNORED]) == "Or not.<|endoftext|>"


def test_unknown_roles_are_refused_and_weight_0_turns_are_not_trained_on():
    tokenizer = chat_tokenizer()
    with pytest.raises(UserError, match=r"line 1: unknown role 'human'; allowed: system, user, assistant, tool$"):
        rows_of([{"messages": [{"role": "human", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}])
    for bad in ({"role": "assistant", "content": "Yo", "weight": 0.5}, {"role": "user", "content": "Hi", "weight": 0}):
        with pytest.raises(UserError, match="line 1: weight .* an assistant message may have weight 0"):
            rows_of([{"messages": [bad, {"role": "assistant", "content": "Yo"}]}])
    with pytest.raises(UserError, match="an assistant message \\(of weight 1\\)"):
        rows_of(
            [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "weight": 0}]}]
        )
    messages = [
        {"role": "user", "content": "To be?"},
        {"role": "assistant", "content": "Or not to be.", "weight": 0},
        {"role": "user", "content": "Whether?"},
        {"role": "assistant", "content": "Tis nobler.", "weight": 1},
    ]
    tokens, mask = encode(rows_of([{"messages": messages}]), tokenizer, seq_len=96, title="t")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]  # the template sees no weights
    assert tokenizer.decode(tokens[0]).startswith(tokenizer.apply_chat_template(plain, tokenize=False))
    assert tokenizer.decode(tokens[0, 1:][mask[0]]) == "Tis nobler.<|endoftext|>"


def test_truncation_keeps_a_rows_start_or_end_and_refuse_is_the_default(caplog):
    rows = rows_of([{"prompt": "abcdef", "completion": "xy"}, {"prompt": "ab", "completion": "xy"}])
    with pytest.raises(UserError, match="line 1: seq_len=5 leaves no room .* seq_len >= 6, or truncation=left$"):
        encode(rows, CharacterTokenizer(), seq_len=5, title="t")
    tokens, mask = encode(rows, CharacterTokenizer(), seq_len=5, title="t", truncation="left")
    assert tokens.tolist() == [ids("defxy\n"), ids("abxy\n\n")]  # the first row's end; \n ends and pads
    assert mask.tolist() == [[False, False, True, True, True], [False, True, True, True, False]]  # x, y, \n
    tokens, mask = encode(rows, CharacterTokenizer(), seq_len=5, title="t", truncation="right")
    assert tokens.tolist() == [ids("abxy\n\n")] and "leaves 1 of 2 rows nothing in the loss" in caplog.text
    long = [{"role": "user", "content": "To be, or not to be? " * 8}, {"role": "assistant", "content": "Yes."}]
    with pytest.raises(UserError, match="cuts the conversation before its first assistant token"):
        encode(rows_of([{"messages": long}]), chat_tokenizer(), seq_len=12, title="t")
    tokens, mask = encode(rows_of([{"messages": long}]), chat_tokenizer(), seq_len=12, title="t", truncation="left")
    assert chat_tokenizer().decode(tokens[0, 1:][mask[0]]) == "Yes.<|endoftext|>"
    whole = chat_tokenizer()(chat_tokenizer().apply_chat_template(long, tokenize=False), add_special_tokens=False)
    assert tokens[0].tolist() == whole["input_ids"][-13:]  # the conversation's last seq_len + 1 tokens
