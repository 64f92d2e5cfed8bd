"""Decoding (greedy, top-k / top-p sampling, beam search) against hand loops and transformers' own,
`splitlab generate`'s keys from the CLI, and `eval_generate`'s BLEU / ROUGE-L against sacrebleu and
rouge-score on known strings and in an E2E run's summary.json."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.generation import DecodingSettings, beam_search, decode, filtered, text_scores
from splitlab.models import split
from splitlab.run_weights import run_model

COMMON = dict(model="gpt", layers=2, heads=2, width=16, context=32, seq_len=16, batch_size=8, device="cpu")


@pytest.fixture(scope="module")
def finished(plays, tmp_path_factory) -> str:
    """A 2-block GPT trained centrally on the plays for a few steps."""
    out = tmp_path_factory.mktemp("runs") / "run"
    torch.set_num_threads(1)
    config = dict(COMMON, dataset="shakespeare_lm", data_dir=plays, algorithm="centralized", clients=1)
    run(dict(config, rounds=1, local_steps=4, out=str(out)), progress=False)
    return str(out)


def the_model(run_dir: str):
    """(logits of token ids, prompt ids of "To be") of a finished run, as `generate` computes them."""
    config, model, vocabulary, _ = run_model(run_dir)
    client, server = split(model, config.run.cut)
    return (lambda tokens: server(client(tokens))), [vocabulary.index(c) for c in "To be"]


@torch.no_grad()
def greedy_by_hand(model, prompt: list[int], steps: int, window: int) -> list[int]:
    """`generate`'s greedy loop before sampling and beams were added."""
    produced: list[int] = []
    for _ in range(steps):
        produced.append(int(model(torch.tensor([(prompt + produced)[-window:]]))[0, -1].argmax()))
    return produced


def test_greedy_top_k_1_and_one_beam_are_the_greedy_continuation(finished):
    model, prompt = the_model(finished)
    expected = greedy_by_hand(model, prompt, 24, window=16)  # longer than the window: it slides
    assert decode(model, prompt, DecodingSettings(max_new_tokens=24), 16) == expected
    for seed in (0, 1):
        top1 = DecodingSettings(max_new_tokens=24, temperature=0.7, top_k=1, seed=seed)
        assert decode(model, prompt, top1, 16) == expected
    assert decode(model, prompt, DecodingSettings(max_new_tokens=24, top_p=1e-6, temperature=1.0), 16) == expected
    assert beam_search(model, prompt, num_beams=1, max_new_tokens=24, window=16) == expected


def test_sampling_is_reproducible_by_seed_and_differs_between_seeds(finished):
    model, prompt = the_model(finished)

    def sampled(seed: int, **keys) -> list[int]:
        return decode(model, prompt, DecodingSettings(max_new_tokens=30, temperature=1.5, seed=seed, **keys), 16)

    assert sampled(0) == sampled(0) and sampled(0) != sampled(1)
    assert sampled(3, top_k=5, top_p=0.9) == sampled(3, top_k=5, top_p=0.9) != sampled(4, top_k=5, top_p=0.9)


def test_generation_stops_at_the_end_of_sequence_token():
    def model(tokens: torch.Tensor) -> torch.Tensor:  # token 2 after two tokens, else token 1
        logits = torch.zeros(len(tokens), tokens.shape[1], 4)
        logits[:, -1, 2 if tokens.shape[1] >= 3 else 1] = 1.0
        return logits

    assert decode(model, [0], DecodingSettings(max_new_tokens=5), 8) == [1, 1, 2, 2, 2]
    assert decode(model, [0], DecodingSettings(max_new_tokens=5), 8, eos=2) == [1, 1]
    assert beam_search(model, [0], 2, 5, 8, eos=2) == [1, 1]


def test_top_k_and_top_p_keep_what_transformers_keeps():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(40, generator=generator) * 3
        for k in (1, 3, 40):
            expected = TopKLogitsWarper(k)(None, logits[None].clone())[0]
            assert torch.equal(filtered(logits, k, None), expected)
        for p in (0.05, 0.5, 0.9, 1.0):
            expected = TopPLogitsWarper(p)(None, logits[None].clone())[0]
            assert torch.equal(filtered(logits, None, p).isinf(), expected.isinf()), p


def test_beam_search_is_transformers_beam_search_on_the_exported_model(plays, tmp_path):
    """Without an end-of-sequence token every beam has the same length, so both keep the sequence of
    highest summed log-probability; within the window (here 16 tokens) both see the same context."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    config = dict(COMMON, dataset="shakespeare_lm", data_dir=plays, algorithm="sfl_v2", clients=2)
    run(dict(config, rounds=1, local_steps=3, out=str(out)), progress=False)
    model, prompt = the_model(str(out))
    exported = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True).eval()
    for beams in (2, 4):
        ours = beam_search(model, prompt, num_beams=beams, max_new_tokens=10, window=16)
        theirs = exported.generate(
            torch.tensor([prompt]), num_beams=beams, do_sample=False, max_new_tokens=10, pad_token_id=0,
            eos_token_id=None, length_penalty=0.0,
        )  # fmt: skip
        assert ours == theirs[0, len(prompt) :].tolist()


def test_generate_from_the_cli(finished, capsys):
    model, prompt = the_model(finished)
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12"]) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    assert greedy == "To be" + "".join(run_model(finished)[2][i] for i in greedy_by_hand(model, prompt, 12, 16))
    outputs = []
    for keys in (["num_beams=3"], ["temperature=0.8", "top_k=10", "top_p=0.9", "seed=7"]):
        assert main(["generate", finished, "prompt=To be", "max_new_tokens=12", *keys]) == 0
        outputs.append(capsys.readouterr().out.rstrip("\n"))
        assert outputs[-1].startswith("To be") and len(outputs[-1]) == len("To be") + 12


@pytest.mark.parametrize(
    "key, message",
    [
        ("top_p=1.5", "invalid value 1.5 for top_p: Input should be less than or equal to 1"),
        ("top_k=0", "invalid value 0 for top_k: Input should be greater than or equal to 1"),
        ("num_beams=0", "invalid value 0 for num_beams: Input should be greater than or equal to 1"),
        ("top_k=5", "top_k and top_p restrict sampling: give them with temperature > 0"),
        ("num_beams=2 temperature=1", "num_beams > 1 is beam search, which does not sample"),
    ],
)
def test_bad_decoding_keys_are_one_line_exit_2(finished, capsys, key, message):
    assert main(["generate", finished, "prompt=To be", *key.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_scores_are_sacrebleus_and_rouge_scores_on_known_strings():
    same = text_scores(["the cat sat on the mat"], [["the cat sat on the mat"]])
    assert same == {"bleu": pytest.approx(100.0, abs=1e-9), "rouge_l": 1.0}
    # by hand: n-gram precisions 5/6, 3/5, 2/4, 1/3, equal lengths (no brevity penalty); the
    # longest common subsequence "the cat sat on mat" is 5 of 6 words either way
    scores = text_scores(["the cat sat on the mat"], [["the cat sat on a mat"]])
    assert scores["bleu"] == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-9)
    assert scores["rouge_l"] == pytest.approx(5 / 6, abs=1e-12)
    # every reference of a prompt counts, and prompts may have different numbers of them
    two = text_scores(
        ["Blue Spice is cheap.", "Cotto serves Italian food."],
        [["A cheap place: Blue Spice.", "Blue Spice is cheap."], ["Cotto serves Italian food."]],
    )
    assert two == {"bleu": pytest.approx(100.0), "rouge_l": pytest.approx(1.0)}


def write_e2e(folder: Path) -> Path:
    """The release's three files: header mr,ref, every field quoted; the test set has two
    references for one meaning representation."""
    rows = [(f"name[Place {i}], food[{food}]", f"Place {i} serves {food} food.") for i, food in enumerate("ABCDEF")]
    test = rows[:3] + [(rows[0][0], f"{rows[0][1][:-1]}, it is said.")]
    for name, content in (("trainset.csv", rows), ("devset.csv", rows[:2]), ("testset_w_refs.csv", test)):
        with (folder / name).open("w", newline="", encoding="utf-8") as file:
            csv.writer(file, quoting=csv.QUOTE_ALL).writerows([("mr", "ref"), *content])
    return folder


def test_eval_generate_writes_bleu_and_rouge_l_of_an_e2e_run(tmp_path):
    """model=gpt reads E2E by characters; the test set's 3 meaning representations are decoded and
    scored against all their references, exactly as text_scores scores generations.jsonl."""
    data = write_e2e(tmp_path)
    config = dict(
        COMMON, seq_len=40, context=48, dataset="e2e", data_dir=str(data), algorithm="sfl_v2", clients=2,
        rounds=2, local_steps=2, eval_generate=10, out=str(tmp_path / "run"),
    )  # fmt: skip
    summary = run(config, progress=False)
    stored = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert stored["eval_generate"] == summary["eval_generate"] == 3  # every prompt, each once
    examples = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [e["prompt"] for e in examples] == [f"name[Place {i}], food[{f}]   " for i, f in enumerate("ABC")]
    assert examples[0]["references"] == ["Place 0 serves A food.", "Place 0 serves A food, it is said."]
    rescored = text_scores([e["generated"] for e in examples], [e["references"] for e in examples])
    assert stored["bleu"] == rescored["bleu"] and stored["rouge_l"] == rescored["rouge_l"]
    assert 0 <= stored["bleu"] <= 100 and 0 <= stored["rouge_l"] <= 1 and math.isfinite(stored["bleu"])


@pytest.mark.parametrize(
    "keys", [dict(eval_num_beams=3), dict(eval_temperature=1.0, eval_top_k=5), dict(eval_temperature=1.0, eval_seed=9)]
)
def test_eval_generate_decodes_as_its_eval_keys_say(tmp_path, keys):
    """The run's generations are splitlab.generation's decoding of its final model with the same
    settings (beam search; sampling seeded by the run's seed unless eval_seed is given), up to the
    newline that ends a reference; sampling changes them from greedy's."""
    out = tmp_path / "run"
    config = dict(COMMON, seq_len=40, context=48, dataset="e2e", data_dir=str(write_e2e(tmp_path)), algorithm="sl")
    run(dict(config, clients=1, rounds=1, local_steps=2, seed=2, eval_generate=3, out=str(out), **keys), progress=False)
    model, _ = the_model(str(out))
    vocabulary = run_model(out)[2]
    decoding = {key.removeprefix("eval_"): value for key, value in keys.items()}
    for example in map(json.loads, (out / "generations.jsonl").read_text().splitlines()):
        prompt = [vocabulary.index(c) for c in example["prompt"]]
        room = 40 - len(prompt) + 1
        chosen = DecodingSettings(max_new_tokens=room, **{"seed": 2, **decoding})
        expected = decode(model, prompt, chosen, 40, eos=vocabulary.index("\n"))
        assert example["generated"] == "".join(vocabulary[i] for i in expected).strip()
        if "eval_temperature" in keys:
            greedy = decode(model, prompt, DecodingSettings(max_new_tokens=room), 40, eos=vocabulary.index("\n"))
            assert expected != greedy


@pytest.mark.parametrize(
    "keys, message",
    [
        ("eval_num_beams=2", "eval_num_beams=2 does not apply here: eval_num_beams is how eval_generate decodes; "
         "it needs eval_generate=N"),
        ("eval_generate=2 eval_top_k=5", "eval_top_k and eval_top_p restrict sampling: give them with "
         "eval_temperature > 0"),
        ("eval_generate=2 eval_num_beams=2 eval_temperature=1", "eval_num_beams > 1 is beam search, which does not"),
        ("eval_generate=2 eval_top_p=0", "invalid value 0 for eval_top_p: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_bad_eval_decoding_keys_are_one_line_exit_2(tmp_path, capsys, keys, message):
    args = ["run", "dataset=e2e", f"data_dir={tmp_path}", "model=gpt", *keys.split(), f"out={tmp_path}/run"]
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and not (tmp_path / "run").exists()


def test_generate_on_a_character_model_stops_at_the_newline_that_ends_a_reference(tmp_path):
    """model=gpt's E2E references end with a newline, its end of sequence: with a head that makes the
    newline the most likely token whatever the input (final norm's output = its bias, all ones; only
    the newline's row of the LM head nonzero), nothing follows the prompt (before, 5 newlines did)."""
    from safetensors.torch import load_file, save_file

    from splitlab.runmodel import generate

    out = tmp_path / "run"
    config = dict(COMMON, seq_len=40, context=48, dataset="e2e", data_dir=str(write_e2e(tmp_path)), algorithm="sl")
    run(dict(config, clients=1, rounds=1, local_steps=1, out=str(out)), progress=False)
    weights = load_file(out / "weights.safetensors")
    head = torch.zeros_like(weights["head.lm_head.weight"])
    head[run_model(out)[2].index("\n")] = 1.0
    norm = {"head.ln_f.weight": torch.zeros(16), "head.ln_f.bias": torch.ones(16)}
    save_file({**weights, **norm, "head.lm_head.weight": head}, out / "weights.safetensors")
    for keys in ({}, {"num_beams": 2}):
        assert generate(out, "name[Place 0]", max_new_tokens=5, **keys) == "name[Place 0]"


def test_eval_generate_is_refused_without_references(plays):
    from helpers import train

    with pytest.raises(UserError, match=r"^eval_generate=4: shakespeare_lm has no reference texts.*: e2e, and jsonl"):
        train(0, **dict(COMMON, dataset="shakespeare_lm", data_dir=plays, algorithm="sfl_v2", eval_generate=4))
