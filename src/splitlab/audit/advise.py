"""`splitlab advise dataset=... model=...`: every cut of a model side by side, to pick one with
the trade-off in view: what the client holds and computes, what crosses the cut, SplitGP's
latency model, what a curious server recovers after a short training, and that training's accuracy.

Each cut gets a short probe run (OUT/cut<c>, a normal run directory) and both attacks against its
final model (splitlab.audit.run). OUT gets advise.md (the table), advise.json and advise.png.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitlab import rundir
from splitlab.audit.probes import FLOOR_MARGIN, front_and_pick, heading, probe_sizes, table, written
from splitlab.audit.settings import AdviseSettings
from splitlab.errors import UserError
from splitlab.ledger import payload_bytes
from splitlab.models import build_model, output_shape, split
from splitlab.resolve import resolve_config

#: the probe's sizes when not given (train, test, aux, targets): these, or what the split holds where
#: it is smaller (the table says which)
DEFAULTS = (2000, 1500, 1000, 300)


def client_flops(client: nn.Module, input_shape: tuple[int, ...]) -> int:
    """FLOPs (2 x multiply-adds) of the client part's convolutions and linear layers for one sample
    (activations, pooling and normalisation are not counted: they are a small share). The dry run
    calls every layer once, on a batch, and each layer counts one sample's output."""
    total = 0

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
            total += 2 * per_output * output[0].numel()
        elif isinstance(module, nn.Linear):
            total += 2 * module.in_features * module.out_features
        elif isinstance(module, (nn.LSTM, nn.Embedding)):
            raise UserError(f"FLOPs of {type(module).__name__} are not counted; advise covers conv and linear models")

    handles = [m.register_forward_hook(count) for m in client.modules()]
    try:
        output_shape(client, input_shape)  # a dry run of two samples
    finally:
        for handle in handles:
            handle.remove()
    return total


def cut_costs(settings: AdviseSettings, input_shape: tuple[int, ...], num_classes: int) -> list[dict[str, Any]]:
    """Per valid cut: client parameters and FLOPs, bytes per sample up and down (as the defense
    sends them), and SplitGP's per-sample latency (Table I)."""
    from splitlab.privacy.defenses import parse_defense
    from splitlab.splitgp_latency import split_sizes, table_one

    defense = parse_defense(settings.defense)
    model = build_model(settings.model, input_shape, num_classes, seed=settings.seed)
    rows = []
    for cut in model.valid_cuts:
        client, _ = split(model, cut)
        cut_shape = output_shape(client, input_shape)
        batch = torch.randn(64, *cut_shape)
        sizes = split_sizes(settings.model, cut, input_shape, num_classes)
        latency = table_one(sizes, settings.client_power, settings.server_power, settings.rate, settings.beta)
        rows.append(
            {
                "cut": cut,
                "client_parameters": sum(p.numel() for p in client.parameters()),
                "client_flops": client_flops(client, input_shape),
                "up_bytes": payload_bytes(defense.encode(batch)) / 64 + 8,  # smashed data + an int64 label
                "down_bytes": payload_bytes(defense.encode(batch)) / 64,
                "splitgp_latency": latency["splitgp"]["latency"],
            }
        )
    return rows


def advise(raw: dict) -> dict[str, Any]:
    """Probe every cut; write OUT/advise.md, advise.json, advise.png; return the rows. Every setting
    is checked, and the sizes fixed, before the first probe trains."""
    from splitlab.algorithms import get_algorithm
    from splitlab.audit.run import attack_run
    from splitlab.config import parse_settings
    from splitlab.data import SEQUENCE_DATASETS, load_dataset
    from splitlab.engine import run

    settings = parse_settings(AdviseSettings, raw)
    algorithm = get_algorithm(settings.algorithm)
    if "server_model" not in algorithm.models or algorithm.personal_models:
        raise UserError(
            f"advise compares the cuts of one global split model; algorithm={settings.algorithm} has none "
            f"(use e.g. sfl_v2, sfl_v1 or sl)"
        )
    if settings.dataset in SEQUENCE_DATASETS:
        from splitlab.audit.advise_language import advise_language

        return advise_language(settings, _probe(settings), _out(settings))
    for key in ("cuts", "max_recovery"):
        if getattr(settings, key) is not None:
            raise UserError(f"{key}= applies to language datasets; dataset={settings.dataset} probes every cut")
    out = _out(settings)
    data = load_dataset(settings.dataset, settings.data_dir, settings.seed)
    sizes = probe_sizes(settings, len(data.train_y), len(data.test_y), DEFAULTS)
    rows = cut_costs(settings, data.input_shape, data.num_classes)
    probe = _probe(settings) | {"train_subset": sizes["train_subset"], "test_subset": sizes["test_subset"]}
    for row in rows:
        resolve_config({**probe, "cut": row["cut"]})  # every probe's settings valid before any trains
    attack = {"aux": sizes["aux"], "targets": sizes["targets"], "epochs": settings.epochs, "seed": settings.seed}
    floor = float(torch.bincount(data.test_y).max()) / len(data.test_y)  # always the most frequent class
    for row in rows:
        run_dir = out / f"cut{row['cut']}"
        summary = run({**probe, "cut": row["cut"], "out": str(run_dir), "overwrite": True}, progress=False)
        inversion = attack_run(run_dir, {**attack, "attack": "inversion", "device": settings.device})
        leak = attack_run(run_dir, {**attack, "attack": "label_leak", "device": settings.device})
        row.update(
            accuracy=summary["final_accuracy"],
            epsilon=summary.get("privacy", {}).get("epsilon"),
            ssim=inversion["ssim"],
            floor_ssim=inversion["baseline"]["ssim"],
            psnr=inversion["psnr"],
            direction_auc=leak["direction_auc"],
            norm_auc=leak["norm_auc"],
            label_auc=strongest_label_auc(leak),
            accuracy_floor=floor,
            ranked=summary["final_accuracy"] > floor + FLOOR_MARGIN,
        )
    result = {"settings": settings.model_dump(), "sizes": sizes, "rows": rows, **recommend(settings, rows)}
    answer = written(out, result, markdown(settings, sizes, rows, result), "advise.png")
    _plot(out / "advise.png", settings, rows)
    return answer


def _out(settings: AdviseSettings) -> Path:
    out = Path(settings.out or f"runs/advise_{settings.dataset}_{settings.model}")
    rundir.check_out_dir(out)
    return out


def _probe(settings: AdviseSettings) -> dict[str, Any]:
    """The probe runs' settings: the run keys of `settings`, the model's own where given."""
    given = ("layers", "heads", "width", "context", "seq_len", "model_dir", "lora", "init")
    probe = settings.model_dump(
        include={"dataset", "data_dir", "model", "algorithm", "defense", "clients", "rounds"}
        | {"batch_size", "lr", "seed", "device"}
    )
    return probe | {key: getattr(settings, key) for key in given if getattr(settings, key) is not None}


def strongest_label_auc(leak: dict[str, Any]) -> float:
    """The highest pooled AUC of every label attack label_leak ran (Li et al.'s and, on a binary task,
    the defense-aware ones): what the server gets, not what its weakest attack gets."""
    figures = [leak[key] for key in leak if key.endswith("_auc") and isinstance(leak[key], float)]
    return max(figures + [leak.get("linked", {}).get("auc") or 0.0])


def trade_offs(row: dict[str, Any]) -> tuple[float, ...]:
    """What the Pareto front weighs, each lower is better: accuracy (negated), inversion SSIM,
    the strongest label-leak AUC, bytes up."""
    return (-row["accuracy"], row["ssim"], row["label_auc"], row["up_bytes"])


def recommend(settings: AdviseSettings, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The Pareto front and the pick: among the front's cuts within the `max_ssim` / `max_auc`
    budgets, the most accurate (then the least leaking); None if no cut meets the budgets."""

    def within(row: dict[str, Any]) -> bool:
        return (settings.max_ssim is None or row["ssim"] <= settings.max_ssim) and (
            settings.max_auc is None or row["label_auc"] <= settings.max_auc
        )

    return front_and_pick(rows, trade_offs, within, lambda row: (-row["accuracy"], row["ssim"]))


COLUMNS = (
    ("cut", "cut", "{}"),
    ("client_parameters", "client params", "{:,}"),
    ("client_flops", "client FLOPs/sample", "{:,}"),
    ("up_bytes", "bytes up/sample", "{:,.0f}"),
    ("down_bytes", "bytes down/sample", "{:,.0f}"),
    ("splitgp_latency", "SplitGP latency/sample", "{:,.4g}"),
    ("epsilon", "probe epsilon", "{}"),
    ("ssim", "inversion SSIM", "{:.3f}"),
    ("floor_ssim", "floor SSIM (mean image)", "{:.3f}"),
    ("psnr", "inversion PSNR (dB)", "{:.2f}"),
    ("direction_auc", "label leak AUC (direction)", "{:.3f}"),
    ("norm_auc", "label leak AUC (norm)", "{:.3f}"),
    ("label_auc", "label leak AUC (strongest)", "{:.3f}"),
    ("accuracy", "probe accuracy", "{:.2%}"),
    ("ranked", "trained enough to rank", "{}"),
)


def markdown(
    settings: AdviseSettings, sizes: dict[str, int], rows: list[dict[str, Any]], advice: dict[str, Any]
) -> str:
    head = heading(settings, sizes) + (
        "SSIM is the better of the decoder and the floor. "
        f"Latency: SplitGP's model (Table I) with P_C={settings.client_power:g}, P_S={settings.server_power:g}, "
        f"R={settings.rate:g}, beta={settings.beta:g}. Attacks against the final model "
        f"(docs/privacy.md): lower SSIM/PSNR and AUC nearer 0.5 leak less.\n\n"
    )
    lines = table(COLUMNS, rows, _cell)
    budgets = ", ".join(
        f"{name}={value:g}"
        for name, value in (("max_ssim", settings.max_ssim), ("max_auc", settings.max_auc))
        if value is not None
    )
    pick, unranked = advice["pick"], advice["unranked"]
    if pick is not None:
        ranked = " of those trained enough to rank" if unranked else ""
        verdict = f"pick cut {pick} (the most accurate{ranked}" + (f" within {budgets})" if budgets else ")")
    elif len(unranked) == len(rows):
        verdict = "no cut picked: no probe trained enough to rank"
    else:
        verdict = f"no cut on the front meets {budgets}: add a defense or relax the budgets"
    tail = f"\n\nPareto front (accuracy, SSIM, label-leak AUC, bytes up): cuts {advice['pareto_front']}; {verdict}.\n"
    if unranked:
        tail += (
            f"Not trained enough to rank (probe accuracy within {FLOOR_MARGIN:.0%} of the most frequent class's "
            f"share, so its attacks measure an untrained model): cuts {unranked}; probe longer "
            "(rounds=, train_subset=).\n"
        )
    return head + "\n".join(lines) + tail


def _cell(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if fmt == "{}" and isinstance(value, float) else fmt.format(value)


def _plot(file: Path, settings: AdviseSettings, rows: list[dict[str, Any]]) -> None:
    """Per cut: client FLOPs and bytes up (relative to the largest), inversion SSIM, direction AUC, accuracy."""
    from splitlab.experiments.plots import plot_per_cut

    def column(key: str) -> list[float]:
        return [row[key] for row in rows]

    plot_per_cut(
        file,
        f"{settings.model} on {settings.dataset}",
        [str(row["cut"]) for row in rows],
        {"client FLOPs (rel.)": column("client_flops"), "bytes up (rel.)": column("up_bytes")},
        {"inversion SSIM": column("ssim"), "label leak AUC": column("direction_auc"), "accuracy": column("accuracy")},
    )
