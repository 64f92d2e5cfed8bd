"""Each defense against the attacks it targets, with what it costs the model (docs/privacy.md).

`--part tokens`: a split GPT (model=gpt's defaults: 4 blocks of width 128) on shakespeare_lm,
SplitFed-v2 at `--cut` (1), 4 clients, 2 rounds, 400 training and 300 test sequences,
`record=100` of the last round; per defense (`dchi:E` on the token embeddings, `noise:S` on the
hidden states at the cut) the token attacks on the recorded sequences with the 300 test
sequences' first 200 as the server's auxiliary text: `token_inversion` (decoder, 20 epochs) and
`embedding_inversion` (nearest token, raw or after the fitted map), each the stronger of the
attack and the floor (the most frequent token everywhere); the cost: test loss and next-token
accuracy on the undefended path, and as deployed (the noise applied).

`--part labels`: Li et al.'s binary setting (vanilla split learning, breast_cancer, mlp, 2
clients, 5 rounds, `record=200`); per defense (`marvell:S`, `marvell:kl=K`, `label_dp:E`,
`gradnoise:S`) and noise key, the norm and direction AUCs of `label_leak` on the last recorded
round, the test accuracy, how many runs have both AUCs within 0.1 of 0.5, and with `marvell:kl=K`
the mean power scale its bound chose per batch (`--kl-rule reference`: the scale found by the
reference code's rule instead of splitlab's smallest, for comparison).

One torch thread; prints a Markdown table.

    .venv/bin/python benchmarks/defended_attacks.py --part tokens --defenses none dchi:300 noise:0.5
    .venv/bin/python benchmarks/defended_attacks.py --part labels --defenses none marvell:1 marvell:kl=0.25
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from splitlab.audit.run import attack_run
from splitlab.engine import run
from splitlab.privacy import defenses

TOKENS_HEADER = (
    "| defense | test loss | next-token accuracy / deployed | token_inversion | embedding_inversion | floor |"
)


def tokens(defense: str, cut: int, out: Path) -> str:
    config = dict(
        algorithm="sfl_v2", dataset="shakespeare_lm", model="gpt", cut=cut, clients=4, rounds=2,
        train_subset=400, test_subset=300, record=100, device="cpu", seed=0, defense=defense,
    )  # fmt: skip
    summary = run({**config, **_key(defense, "a"), "out": str(out)}, progress=False)
    decoder = attack_run(out, {"attack": "token_inversion", "aux": 200, "epochs": 20})
    nearest = attack_run(out, {"attack": "embedding_inversion", "aux": 200})
    deployed = summary.get("final_accuracy_deployed")
    return (
        f"| {defense} | {summary['final_loss']:.3f} | {summary['final_accuracy']:.1%} / "
        f"{'=' if deployed is None else format(deployed, '.1%')} | {decoder['accuracy']:.1%} ({decoder['attacker']}) "
        f"| {nearest['accuracy']:.1%} ({nearest['attacker']}) | {decoder['baseline']:.1%} |"
    )


def labels(defense: str, keys: list[str], seed: int, out: Path) -> str:
    config = dict(
        dataset="breast_cancer", model="mlp", algorithm="sl", clients=2, rounds=5, record=200, device="cpu", seed=seed
    )
    found = []
    for key in keys if defense != "none" else keys[:1]:
        chosen.clear()
        summary = run({**config, "defense": defense, **_key(defense, key), "out": str(out / key)}, progress=False)
        leak = attack_run(out / key, {"attack": "label_leak"})
        scale = format(sum(chosen) / len(chosen), ".2f") if chosen else "-"
        batches = leak["per_batch"]
        per_batch = f"{batches['direction_auc_median']:.2f}, {batches['direction_auc_q95']:.2f}"
        found.append((summary["final_accuracy"], leak["norm_auc"], leak["direction_auc"], scale, per_batch))
    formats = (".1%", ".3f", ".3f", "", "")
    cells = [" / ".join(format(values[i], fmt) for values in found) for i, fmt in enumerate(formats)]
    held = sum(abs(row[1] - 0.5) < 0.1 and abs(row[2] - 0.5) < 0.1 for row in found)
    return f"| {defense} | " + " | ".join(cells[:3]) + f" | {held} of {len(found)} | {cells[3]} | {cells[4]} |"


#: the scales `marvell:kl=K` chose in the current run, one per batch (recorded around the search)
chosen: list[float] = []


def _reference_kl_scale(u: float, v: float, d: int, g: float, p: float, bound: float) -> float:
    """`--kl-rule reference`: the scale as the paper's reference code's dynamic mode finds it (as
    its documentation and loop read): 1, then x 1.5 until the optimum meets the bound."""
    scale = 1.0
    while defenses.marvell_sum_kl(defenses.marvell_variances(u, v, d, g, p, scale * g), u, v, d, g) > bound:
        scale *= 1.5
    return scale


def _recording(search: Callable[..., float]) -> Callable[..., float]:
    def recorded(*args: float) -> float:
        chosen.append(search(*args))
        return chosen[-1]

    return recorded


def _key(defense: str, key: str) -> dict:
    """A fixed noise key for a randomised defense (the runs are then reproducible), none otherwise."""
    return {} if defense == "none" or defense.startswith("nopeek") else {"noise_key": key}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("tokens", "labels"), required=True)
    parser.add_argument("--defenses", nargs="+", default=["none"])
    parser.add_argument("--cut", type=int, default=1, help="tokens: the GPT's cut")
    parser.add_argument("--keys", nargs="+", default=["a", "b", "c"], help="labels: noise keys per defense")
    parser.add_argument("--seed", type=int, default=0, help="labels: the runs' seed (data order, initial weights)")
    parser.add_argument(
        "--kl-rule",
        choices=("smallest", "reference"),
        default="smallest",
        help="labels: marvell:kl=K's scale, splitlab's (the smallest) or the reference code's (1, x 1.5 until met)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part == "tokens":
        print(f"model=gpt shakespeare_lm sfl_v2 cut={args.cut}, 4 clients, 2 rounds, 400/300 sequences, record=100")
        print(TOKENS_HEADER)
        print("|---|---|---|---|---|---|")
    else:
        print(
            f"breast_cancer mlp sl, 2 clients, 5 rounds, record=200, seed {args.seed}; keys {' / '.join(args.keys)}; "
            f"marvell:kl=K's scale: {args.kl_rule}"
        )
        print(
            "| defense | accuracy | norm AUC | direction AUC | both within 0.1 of 0.5 | mean scale per batch "
            "| per batch: direction AUC median, 95% quantile |"
        )
        print("|---|---|---|---|---|---|---|")
        search = _reference_kl_scale if args.kl_rule == "reference" else defenses.marvell_kl_scale
        defenses.marvell_kl_scale = _recording(search)
    with tempfile.TemporaryDirectory() as tmp:
        for i, defense in enumerate(args.defenses):
            out = Path(tmp) / str(i)
            if args.part == "tokens":
                print(tokens(defense, args.cut, out), flush=True)
            else:
                print(labels(defense, args.keys, args.seed, out), flush=True)


if __name__ == "__main__":
    main()
