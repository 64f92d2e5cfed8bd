"""A synthetic stand-in for the E2E NLG release: files in its format, made from its public slots and values.

No E2E files are here (nothing is downloaded), so the CPU version of FSL-SAGE's Fig. 5
(experiments/cpu/fsl_sage_e2e.yaml) fine-tunes on files this script writes: `trainset.csv`,
`devset.csv` and `testset_w_refs.csv`, CSV with the header `mr,ref`, every field quoted, one row
per reference. A meaning representation (MR) names a venue and 2 or 3 more of E2E's seven other
slots, with the values the real data uses; its references are realised from templates, each slot
by one of a few phrasings, the clauses after the first in a random order. The real set's
references are crowd-sourced and far more varied: BLEU on these files measures how well a model
learns the templates, not how it would do on E2E.

    python experiments/e2e_synthetic.py data/e2e_synthetic [--train 1500] [--test 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

NAMES = [
    "The Eagle", "The Mill", "Loch Fyne", "Bibimbap House", "Alimentum", "Aromi", "Blue Spice", "Browns Cambridge",
    "Clowns", "Cocum", "Cotto", "Fitzbillies", "Giraffe", "Green Man", "Midsummer House", "Strada",
    "Taste of Cambridge", "The Cambridge Blue", "The Cricketers", "The Dumpling Tree", "The Golden Curry",
    "The Golden Palace", "The Olive Grove", "The Phoenix", "The Plough", "The Punter", "The Rice Boat",
    "The Twenty Two", "The Vaults", "The Waterman", "Wildwood", "Zizzi",
]  # fmt: skip
VALUES = {
    "eatType": ["coffee shop", "pub", "restaurant"],
    "food": ["Chinese", "English", "Fast food", "French", "Indian", "Italian", "Japanese"],
    "priceRange": ["cheap", "less than £20", "£20-25", "moderate", "high", "more than £30"],
    "customer rating": ["1 out of 5", "3 out of 5", "5 out of 5", "low", "average", "high"],
    "area": ["city centre", "riverside"],
    "familyFriendly": ["yes", "no"],
    "near": [
        "Café Adriatic", "Café Brazil", "Café Rouge", "Café Sicilia", "Clare Hall", "Crowne Plaza Hotel",
        "Express by Holiday Inn", "Rainbow Vegetarian Café", "Raja Indian Cuisine", "Ranch", "The Portland Arms",
        "The Sorrento", "All Bar One", "Avalon", "Burger King",
    ],
}  # fmt: skip
#: E2E's slot order in a meaning representation
SLOTS = ["name", "eatType", "food", "priceRange", "customer rating", "area", "familyFriendly", "near"]
#: phrasings of a slot as a clause after the first sentence ({v}: its value)
CLAUSES = {
    "food": ["It serves {v} food.", "They offer {v} food.", "{v} food is served there."],
    "priceRange": ["Its price range is {v}.", "Prices are {v}.", "It has a {v} price range."],
    "customer rating": ["It has a customer rating of {v}.", "Customers rate it {v}.", "Its rating is {v}."],
    "area": ["It is in the {v}.", "It is located in the {v} area.", "You can find it in the {v}."],
    "near": ["It is near {v}.", "It is close to {v}.", "It is located near {v}."],
    "familyFriendly": ["It is family friendly.", "Children are welcome.", "It is kid friendly."],
    "not familyFriendly": ["It is not family friendly.", "It is not for children.", "It is not kid friendly."],
}
OPENINGS = ["{name} is a {kind}.", "There is a {kind} called {name}.", "{name} is a {kind} you can visit."]


def meaning_representation(rng: random.Random) -> dict[str, str]:
    """A venue's name and 2 or 3 more slots (E2E's MRs hold 3 to 8 in all; fewer keep a character
    model's sequences short), with E2E's values."""
    chosen = rng.sample(SLOTS[1:], rng.randint(2, 3))
    return {"name": rng.choice(NAMES)} | {slot: rng.choice(VALUES[slot]) for slot in SLOTS[1:] if slot in chosen}


def mr_text(mr: dict[str, str]) -> str:
    """E2E's notation: `name[The Eagle], eatType[coffee shop], ...`."""
    return ", ".join(f"{slot}[{value}]" for slot, value in mr.items())


def reference(mr: dict[str, str], rng: random.Random) -> str:
    """One realisation: an opening naming the venue (and its eatType), then a clause per other slot."""
    kind = mr.get("eatType", "place")
    clauses = []
    for slot, value in mr.items():
        if slot in ("name", "eatType"):
            continue
        key = "not familyFriendly" if slot == "familyFriendly" and value == "no" else slot
        clauses.append(rng.choice(CLAUSES[key]).format(v=value))
    rng.shuffle(clauses)
    opening = rng.choice(OPENINGS).format(name=mr["name"], kind=kind)
    return " ".join([opening, *clauses])


def rows(count: int, references: int, rng: random.Random) -> list[tuple[str, str]]:
    """`count` meaning representations, each on `references` rows with a different realisation."""
    out = []
    for _ in range(count):
        mr = meaning_representation(rng)
        out += [(mr_text(mr), reference(mr, rng)) for _ in range(references)]
    return out


def write(folder: Path, train: int, test: int, seed: int) -> None:
    """The release's three files in `folder`: train and dev with 2 references per MR, test with 3."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    splits = {
        "trainset.csv": rows(train, 2, rng),
        "devset.csv": rows(test, 2, rng),
        "testset_w_refs.csv": rows(test, 3, rng),
    }
    for name, content in splits.items():
        with (folder / name).open("w", newline="", encoding="utf-8") as file:
            csv.writer(file, quoting=csv.QUOTE_ALL).writerows([("mr", "ref"), *content])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--train", type=int, default=1500, help="training meaning representations (2 rows each)")
    parser.add_argument("--test", type=int, default=60, help="test (and dev) meaning representations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.folder, args.train, args.test, args.seed)


if __name__ == "__main__":
    main()
