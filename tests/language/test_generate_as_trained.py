"""Generation as trained (issue 43): `splitlab generate` encodes a prompt as the run's training rows
began ([bos] prompt; a conversation through the chat template with the assistant's header), reads
no training data (the run folder alone, from any working directory), and gives transformers'
greedy tokens on `out/hf`; `eval_generate` scores jsonl prompt + completion and chat rows."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import splitlab
from hf_helpers import tiny_hf_model
from splitlab.cli import main
from splitlab.errors import UserError

#: renders a conversation as `<|role|>content<eos>`, then `<|assistant|>` to prompt a reply
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
RUN = dict(algorithm="sfl_v2", model="hf", clients=1, rounds=1, local_steps=2, batch_size=4, seq_len=40, device="cpu")


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def transformers_greedy(folder, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens after `ids` on the exported model, up to its end of sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=0)
    new = out[0, len(ids) :].tolist()
    return new[: new.index(0)] if 0 in new else new


def test_generate_on_a_prompt_completion_run_is_transformers_greedy_with_bos_without_the_data(tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir = tiny_hf_model(tmp_path / "gpt2")
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    rows = [{"prompt": f"name[Place {i}] ||", "completion": f" Place {i} serves food."} for i in range(12)]
    write_jsonl(work / "rows.jsonl", rows)
    cwd = os.getcwd()
    try:
        os.chdir(work)  # the data file named relative to the run's working directory, as a user would
        summary = splitlab.run(
            dict(RUN, dataset="jsonl", data_file="rows.jsonl", model_dir=str(model_dir), out="run", eval_generate=4),
            progress=False,
        )
        assert summary["eval_generate"] == 1  # the held-out tenth of 12 rows: one prompt
        assert 0 <= summary["bleu"] <= 100 and 0 <= summary["rouge_l"] <= 1
        generated = [json.loads(line) for line in (work / "run" / "generations.jsonl").read_text().splitlines()]
        assert generated[0]["prompt"].startswith("<|endoftext|>name[Place ")  # bos, then the row's prompt
        assert generated[0]["references"] == [rows[int(generated[0]["prompt"].split()[1][:-1])]["completion"]]
        (work / "rows.jsonl").unlink()
        os.chdir(elsewhere)
        prompt = "name[Place 3] ||"
        assert main(["generate", str(work / "run"), f"prompt={prompt}", "max_new_tokens=8"]) == 0
    finally:
        os.chdir(cwd)
    printed = capsys.readouterr().out.removesuffix("\n")
    tokenizer = AutoTokenizer.from_pretrained(work / "run" / "hf")
    with_bos = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = transformers_greedy(work / "run" / "hf", with_bos, 8)
    assert expected and printed == prompt + tokenizer.decode(expected)
    assert splitlab.generate(work / "run", prompt, max_new_tokens=8) == printed
    with pytest.raises(UserError, match="trained on prompt/completion rows: give prompt=TEXT, not messages="):
        splitlab.generate(work / "run", messages=[{"role": "user", "content": "Hi"}])
    written = splitlab.export(work / "run", tmp_path / "exported")
    assert written == {"hf_export": str(tmp_path / "exported" / "hf")}
    assert transformers_greedy(tmp_path / "exported" / "hf", with_bos, 8) == expected


def test_a_chat_run_generates_the_assistants_reply_and_scores_its_held_out_conversations(tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir = tiny_hf_model(tmp_path / "gpt2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    chats = [
        {"messages": [{"role": "user", "content": f"To be {i}?"}, {"role": "assistant", "content": f"Or not {i}."}]}
        for i in range(10)
    ]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    out = tmp_path / "run"
    config = dict(RUN, dataset="jsonl", data_file=str(tmp_path / "chats.jsonl"), model_dir=str(model_dir))
    summary = splitlab.run(dict(config, out=str(out), eval_generate=4), progress=False)
    assert summary["eval_generate"] == 1 and "bleu" in summary and "rouge_l" in summary
    generated = json.loads((out / "generations.jsonl").read_text().splitlines()[0])
    asked = generated["prompt"]
    held_out = re.fullmatch(r"<\|user\|>To be (\d)\?<\|endoftext\|><\|assistant\|>", asked)  # the header ends it
    assert held_out is not None and generated["references"] == [f"Or not {held_out[1]}."]
    conversation = [{"role": "user", "content": "To be 3?"}]
    assert main(["generate", str(out), f"messages={json.dumps(conversation)}", "max_new_tokens=6"]) == 0
    reply = capsys.readouterr().out.removesuffix("\n")
    ids = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))
    assert reply == tokenizer.decode(transformers_greedy(out / "hf", ids["input_ids"], 6))
    (tmp_path / "conversation.json").write_text(json.dumps({"messages": conversation}))
    assert splitlab.generate(out, messages=str(tmp_path / "conversation.json"), max_new_tokens=6) == reply
    assert main(["generate", str(out), "prompt=To be", "max_new_tokens=2"]) == 2
    assert "trained on messages rows: give messages=FILE_OR_JSON" in capsys.readouterr().err
    assert main(["generate", str(out), 'messages=[{"role": "human", "content": "x"}]']) == 2
    assert "unknown role 'human'; allowed: system, user, assistant, tool" in capsys.readouterr().err
