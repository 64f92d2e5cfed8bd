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
`gradnoise:S`) and noise key, a row: the test accuracy, every attack `label_leak` reports (Li et
al.'s norm and direction, the defense-aware cluster and residual attacks: pooled on the last
recorded round, and the median of their per-batch AUCs over every recorded batch; the linked
attack over the recorded rounds), the strongest per-batch median and which attack it was, and
with `marvell:kl=K` the mean power scale its bound chose per batch (`--kl-rule reference`: the
scale found by the reference code's rule instead of splitlab's smallest, for comparison).

`--part noise`: digits, the CNN cut at 1, SplitFed-v2, 4 clients, 3 rounds, every training sample
recorded every round; per defense (`noise:S`, `clip:C+noise:S`, `clip:C+dp:epsilon=E`), noise key
a, `inversion` (decoder, 20 epochs) on the last round's releases and on each sample's releases
over the 3 rounds averaged (splitlab.audit.inversion.averaged_inversion), with accuracy and epsilon.

One torch thread; prints a Markdown table.

    .venv/bin/python benchmarks/defended_attacks.py --part tokens --defenses none dchi:300 noise:0.5
    .venv/bin/python benchmarks/defended_attacks.py --part labels --defenses none marvell label_dp:1
    .venv/bin/python benchmarks/defended_attacks.py --part noise --defenses noise:0.5 clip:10+noise:0.5
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


def labels(defense: str, keys: list[str], seed: int, out: Path) -> list[str]:
    config = dict(
        dataset="breast_cancer", model="mlp", algorithm="sl", clients=2, rounds=5, record=200, device="cpu", seed=seed
    )
    rows = []
    for key in keys if defense != "none" else keys[:1]:
        chosen.clear()
        summary = run({**config, "defense": defense, **_key(defense, key), "out": str(out / key)}, progress=False)
        leak = attack_run(out / key, {"attack": "label_leak"})
        scale = format(sum(chosen) / len(chosen), ".2f") if chosen else "-"
        batches = leak["per_batch"]
        best = max(LABEL_ATTACKS, key=lambda name: batches[f"{name}_auc_median"])
        pooled = " / ".join(format(leak[f"{name}_auc"], ".3f") for name in LABEL_ATTACKS)
        medians = " / ".join(format(batches[f"{name}_auc_median"], ".2f") for name in LABEL_ATTACKS)
        rows.append(
            f"| {defense} | {key if defense != 'none' else '-'} | {summary['final_accuracy']:.1%} | {pooled} "
            f"| {leak['linked']['auc']:.3f} | {medians} | {batches['residual_auc_mean']:.2f} "
            f"| {best} {batches[f'{best}_auc_median']:.2f} | {scale} |"
        )
    return rows


#: label_leak's attacks in the order of the table's columns
LABEL_ATTACKS = ("norm", "direction", "cluster", "residual")
LABELS_HEADER = (
    "| defense | key | accuracy | pooled AUC: norm / direction / cluster / residual | linked AUC "
    "| per batch, median AUC: norm / direction / cluster / residual | residual, mean per batch "
    "| strongest per batch (median) | mean scale per batch |"
)


def releases(defense: str, out: Path) -> str:
    """`--part noise`: input reconstruction from one release and from each sample's releases averaged."""
    config = dict(
        algorithm="sfl_v2", dataset="digits", model="cnn", cut=1, clients=4, rounds=3, train_subset=1437,
        record=1437, device="cpu", seed=0, defense=defense,
    )  # fmt: skip
    summary = run({**config, **_key(defense, "a"), "out": str(out)}, progress=False)
    found = attack_run(out, {"attack": "inversion", "epochs": 20})
    averaged = found.get("averaged")
    deployed = summary.get("final_accuracy_deployed")
    epsilon = summary.get("privacy", {}).get("epsilon")
    both = (
        f"{averaged['ssim']:.3f} / {averaged['psnr']:.2f} ({averaged['attacker']}, {averaged['releases_mean']:.1f})"
        if averaged
        else "- (no noise to average)"
    )
    return (
        f"| {defense} | {summary['final_accuracy']:.1%} / {'=' if deployed is None else format(deployed, '.1%')} "
        f"| {'-' if epsilon is None else format(epsilon, '.1f')} "
        f"| {found['ssim']:.3f} / {found['psnr']:.2f} ({found['attacker']}) "
        f"| {both} | {found['baseline']['ssim']:.3f} |"
    )


NOISE_HEADER = (
    "| defense | accuracy / deployed | epsilon | one release: SSIM / PSNR | averaged releases: SSIM / PSNR "
    "(attacker, releases a sample) | floor SSIM |"
)


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
    parser.add_argument("--part", choices=("tokens", "labels", "noise"), required=True)
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
    elif args.part == "labels":
        print(
            f"breast_cancer mlp sl, 2 clients, 5 rounds, record=200, seed {args.seed}; keys {' / '.join(args.keys)}; "
            f"marvell:kl=K's scale: {args.kl_rule}"
        )
        print(LABELS_HEADER)
        print("|---|---|---|---|---|---|---|---|---|")
        search = _reference_kl_scale if args.kl_rule == "reference" else defenses.marvell_kl_scale
        defenses.marvell_kl_scale = _recording(search)
    else:
        print("digits cnn sfl_v2 cut=1, 4 clients, 3 rounds, all 1,437 training samples recorded every round, key a")
        print(NOISE_HEADER)
        print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, defense in enumerate(args.defenses):
            out = Path(tmp) / str(i)
            if args.part == "tokens":
                print(tokens(defense, args.cut, out), flush=True)
            elif args.part == "labels":
                print("\n".join(labels(defense, args.keys, args.seed, out)), flush=True)
            else:
                print(releases(defense, out), flush=True)


if __name__ == "__main__":
    main()
