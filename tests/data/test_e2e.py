"""E2E NLG: CSV files in the release's format -> padded token sequences with a completion-only mask."""

from __future__ import annotations

import csv

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_helpers import tiny_tokenizer
from splitlab.data.e2e import FILES, SEPARATOR, encode_pairs, load_e2e, read_pairs
from splitlab.data.text_rows import pad_id
from splitlab.errors import UserError

TRAIN = [
    ("name[The Eagle], eatType[coffee shop], food[French]", "The Eagle is a French coffee shop."),
    ("name[Alimentum], area[city centre]", 'Alimentum, in the city centre, is "nice".'),
]
TEST = [  # one row per reference, the meaning representation repeated
    ("name[Blue Spice], priceRange[cheap]", "Blue Spice is cheap."),
    ("name[Blue Spice], priceRange[cheap]", "A cheap place: Blue Spice."),
    ("name[Cotto], food[Italian]", "Cotto serves Italian food."),
]


def write_e2e(folder, rows_by_file=None):
    """The release's layout: a header `mr,ref`, every field quoted (they hold commas)."""
    rows_by_file = rows_by_file or {"trainset.csv": TRAIN, "devset.csv": TRAIN[:1], "testset_w_refs.csv": TEST}
    for name, rows in rows_by_file.items():
        with (folder / name).open("w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file, quoting=csv.QUOTE_ALL)
            writer.writerow(["mr", "ref"])
            writer.writerows(rows)
    return folder


def word_tokenizer():
    """Words and punctuation runs as tokens with known ids; an end-of-sequence and a pad token, no bos."""
    words = ["<eos>", "<pad>", "name", "[", "A", "]", "||", "Hi", "there"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


def test_a_sample_by_hand_padded_and_cut():
    assert SEPARATOR == " ||"
    pairs = [("name[A]", "Hi there")]  # name [ A ] || | Hi there <eos>  = 2 3 4 5 6 | 7 8 0
    tokens, mask = encode_pairs(pairs, word_tokenizer(), seq_len=10)
    assert tokens.dtype == torch.int64 and mask.dtype == torch.bool
    assert tokens.tolist() == [[2, 3, 4, 5, 6, 7, 8, 0, 1, 1, 1]]
    # targets tokens[1:] = 3 4 5 6 7 8 0 1 1 1: only Hi, there and <eos> are in the loss
    assert mask.tolist() == [[False] * 4 + [True] * 3 + [False] * 3]
    tokens, mask = encode_pairs(pairs, word_tokenizer(), seq_len=5)  # cut: the completion keeps one token
    assert tokens.tolist() == [[2, 3, 4, 5, 6, 7]] and mask.tolist() == [[False] * 4 + [True]]
    with pytest.raises(
        UserError, match=r"sample 1: seq_len=4 leaves no room.*of 5 tokens; these rows need seq_len >= 5"
    ):
        encode_pairs(pairs, word_tokenizer(), seq_len=4)


def test_the_release_files_with_a_byte_level_bpe(tmp_path):
    tokenizer = tiny_tokenizer()
    write_e2e(tmp_path)
    tokens, mask = load_e2e(tmp_path, "test", tokenizer, seq_len=96)
    assert tokens.shape == (3, 97) and mask.shape == (3, 96)
    assert pad_id(tokenizer) == tokenizer.eos_token_id == tokenizer.bos_token_id == 0
    for row, (mr, ref) in zip(range(3), TEST):
        assert tokens[row, 0] == tokenizer.bos_token_id
        targets = tokens[row, 1:][mask[row]].tolist()
        assert tokenizer.decode(targets) == " " + ref + "<|endoftext|>"
        context = tokens[row, 1 : 1 + int(mask[row].int().argmax())].tolist()
        assert tokenizer.decode(context) == mr + SEPARATOR
    assert read_pairs(tmp_path / FILES["train"]) == TRAIN, "quoted commas and quotes survive"
    assert load_e2e(tmp_path, "dev", tokenizer, seq_len=96)[0].shape == (1, 97)


def test_bad_files_are_refused_in_one_line_naming_them(tmp_path):
    with pytest.raises(UserError, match="trainset.csv: no such file"):
        load_e2e(tmp_path, "train", tiny_tokenizer(), 32)
    (tmp_path / "trainset.csv").write_text("meaning,text\nname[A],Hi\n")
    with pytest.raises(UserError, match=r"trainset.csv: expected a header with the columns mr and ref; found \['mea"):
        read_pairs(tmp_path / "trainset.csv")
    (tmp_path / "trainset.csv").write_text("mr,ref\nname[A],Hi\nname[B]\n")
    with pytest.raises(UserError, match="trainset.csv, line 3: a row without its mr or ref"):
        read_pairs(tmp_path / "trainset.csv")
    (tmp_path / "trainset.csv").write_text("mr,ref\n")
    with pytest.raises(UserError, match="trainset.csv: no rows"):
        read_pairs(tmp_path / "trainset.csv")
