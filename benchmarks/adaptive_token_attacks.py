"""The token attacks of an adaptive adversary on what a split GPT's training server received
(issue 42; docs/privacy.md, "Token attacks on the recorded rounds").

Per `CUT:DEFENSE` row: `model=gpt` with its defaults (4 blocks of width 128), `dataset=shakespeare_lm`
(64 characters a sequence), SplitFed-v2, 4 clients, 3 rounds, 400 training and 300 test
sequences, seed 0, noise key a, `record=400`: every sequence's hidden states in every round,
with the client part each round started with. On the last recorded round (400 sequences, 25,600
positions), with the test split's first 200 sequences as the server's auxiliary text:
`targets_channel` (the next-token targets), `token_inversion` (decoder, 20 epochs),
`embedding_inversion` (nearest token, after the fitted map, and with d_chi: MAP with the unigram
prior), `linked_releases` (the three rounds' releases of each sequence linked and decoded
together), and the strongest of them (attack.json's `strongest`) beside the strongest on the
hidden states alone. `--advise` also runs the language advisor's must-hold case: `splitlab advise
dataset=shakespeare_lm model=gpt cuts=1 defense=dchi:30 max_recovery=0.25`. One torch thread;
prints Markdown tables.

    .venv/bin/python benchmarks/adaptive_token_attacks.py --rows 4:none 1:dchi:100 [--advise]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from splitlab.audit.run import attack_run
from splitlab.engine import run

RUN = dict(
    algorithm="sfl_v2", dataset="shakespeare_lm", model="gpt", clients=4, rounds=3, train_subset=400,
    test_subset=300, record=400, device="cpu", seed=0,
)  # fmt: skip
ATTACKS = ("targets_channel", "token_inversion", "embedding_inversion", "linked_releases")
HEADER = (
    "| cut | defense | test loss / accuracy | targets_channel | token_inversion | embedding_inversion "
    "nearest / mapped / prior | linked_releases one / linked / linked nearest | strongest on the hidden states "
    "| strongest (attack) |"
)


def attacked(cut: int, defense: str, out: Path) -> str:
    keyed = {} if defense == "none" else {"noise_key": "a"}
    summary = run({**RUN, "cut": cut, "defense": defense, **keyed, "out": str(out)}, progress=False)
    found = {name: attack_run(out, {"attack": name, "aux": 200, "epochs": 20}) for name in ATTACKS}
    print(json.dumps({name: _figures(result) for name, result in found.items()}), flush=True)
    (best,) = found[ATTACKS[-1]]["strongest"]
    hidden = max(result["accuracy"] for name, result in found.items() if name != "targets_channel")
    embedding, linked = found["embedding_inversion"], found["linked_releases"]
    prior = f" / {embedding['prior']:.1%}" if "prior" in embedding else ""
    return (
        f"| {cut} | {defense} | {summary['final_loss']:.3f} / {summary['final_accuracy']:.1%} "
        f"| {found['targets_channel']['accuracy']:.1%} | {found['token_inversion']['decoder']:.1%} "
        f"| {embedding['nearest']:.1%} / {embedding['mapped']:.1%}{prior} "
        f"| {linked['one_release']:.1%} / {linked['linked']:.1%} / {linked['linked_nearest']:.1%} "
        f"| {hidden:.1%} | {best['value']:.1%} ({best['attack']}) |"
    )


def advised(out: Path) -> str:
    from splitlab.audit.advise import advise

    settings = dict(dataset="shakespeare_lm", model="gpt", cuts="1", defense="dchi:30", max_recovery=0.25)
    result = advise({**settings, "device": "cpu", "out": str(out)})
    return result["markdown"]


def _figures(result: dict) -> dict:
    return {key: value for key, value in result.items() if isinstance(value, float)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=["4:none", "1:dchi:100"], help="CUT:DEFENSE")
    parser.add_argument("--advise", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        lines = []
        for row in args.rows:
            cut, defense = row.split(":", 1)
            lines.append(attacked(int(cut), defense, Path(scratch) / row.replace(":", "_")))
        print("\n".join([HEADER, "|---" * HEADER.count(" | ") + "|---|", *lines]))
        if args.advise:
            print(advised(Path(scratch) / "advise"))


if __name__ == "__main__":
    main()
