"""dataset=hf_disk: folders written by `datasets`' save_to_disk give the same sequences as the same
rows in JSONL files; what is not such a folder is refused in one line."""

from __future__ import annotations

import json

import pytest

from splitlab.cli import main
from splitlab.data import load_dataset
from splitlab.errors import UserError

datasets = pytest.importorskip("datasets")

TRAIN = [{"prompt": f"{i} times 3 is", "completion": f" {3 * i}"} for i in range(12)]
TEST = [{"prompt": "7 times 3 is", "completion": " 21"}, {"prompt": "8 times 3 is", "completion": " 24"}]


def columns(rows: list[dict]) -> dict[str, list]:
    return {key: [row[key] for row in rows] for key in rows[0]}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def same(a, b) -> bool:
    return all(getattr(a, k).equal(getattr(b, k)) for k in ("train_x", "train_y", "test_x", "test_y"))


def test_a_dataset_dict_with_train_and_test_is_the_jsonl_files(tmp_path):
    folder = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(columns(TRAIN)), "test": datasets.Dataset.from_dict(columns(TEST))}
    ).save_to_disk(str(folder))
    from_disk = load_dataset("hf_disk", folder, seq_len=24)
    from_files = load_dataset(
        "jsonl",
        seq_len=24,
        data_file=jsonl(tmp_path / "train.jsonl", TRAIN),
        test_file=jsonl(tmp_path / "t.jsonl", TEST),
    )
    assert same(from_disk, from_files) and len(from_disk.test_y) == 2 and from_disk.name == "hf_disk"


def test_a_dataset_alone_holds_out_the_rows_a_jsonl_file_would(tmp_path):
    messages = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]] * 3
    rows = [{"text": f"line {i} of the text"} for i in range(12)]
    datasets.Dataset.from_dict(columns(rows)).save_to_disk(str(tmp_path / "plain"))
    assert same(
        load_dataset("hf_disk", tmp_path / "plain", seq_len=8),
        load_dataset("jsonl", seq_len=8, data_file=jsonl(tmp_path / "rows.jsonl", rows)),
    )
    datasets.Dataset.from_dict({"messages": messages}).save_to_disk(str(tmp_path / "chat"))
    with pytest.raises(UserError, match="this tokenizer has none"):  # rows read back as lists of dicts
        load_dataset("hf_disk", tmp_path / "chat", seq_len=8)


def test_what_is_not_a_save_to_disk_folder_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rows.jsonl").write_text('{"text": "a"}\n')
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "v"))
    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "body"))
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))  # saved as no data files
    empty_test = {
        "train": datasets.Dataset.from_dict({"text": ["a b", "c d"]}),
        "test": datasets.Dataset.from_dict({"text": []}),
    }
    datasets.DatasetDict(empty_test).save_to_disk(str(tmp_path / "empty_test"))
    capsys.readouterr()  # datasets' own progress bars
    cases = {
        "": "dataset=hf_disk needs data_dir=DIR",
        f"data_dir={tmp_path / 'none'}": "none is not a folder",
        f"data_dir={tmp_path / 'plain'}": "is not a folder written by datasets' save_to_disk",
        f"data_dir={tmp_path / 'v'}": "holds the splits validation; a train split is needed",
        f"data_dir={tmp_path / 'body'}": "row 0: a row needs the fields text | prompt + completion | messages; found",
        f"data_dir={tmp_path / 'empty'}": "empty holds no rows; every split needs rows",
        f"data_dir={tmp_path / 'empty_test'}": "empty_test (its test split) holds no rows",
    }
    for pair, match in cases.items():
        out = tmp_path / "out"
        argv = ["run", "dataset=hf_disk", "model=gpt", "layers=1", "width=8", "heads=2", f"out={out}", pair]
        assert main([a for a in argv if a]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err
        assert not out.exists()
