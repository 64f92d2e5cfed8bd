"""`splitlab advise` on a language dataset (model=gpt, or model=hf with lora=): every cut of the
model, and the U-shaped splits that keep the last stages on the client, side by side.

Per candidate, a short probe run (OUT/cut<c>, or OUT/cut<a>_<b> for cut=A,B) gives the bytes that
crossed per training token per round by kind (from the run's ledger), the client's share of the
model's FLOPs per token, the loss, perplexity and next-token accuracy after the probe, and the
token attacks of the registry that probes take (`Attack.advised`) against its final model: the
strongest one's recovery (the fraction of the client's text it rebuilds) beside the floor, with a
few reconstructed lines. The attacks include the targets channel (`targets_channel`): in a
vanilla split the next-token targets reach the server, the text shifted by one token, so the
text recovered there is the targets' share at least, whatever the hidden states hide, and
`max_recovery` is checked against it. A U-shaped split keeps the next-token targets on the
client: no `labels` reach the server, and the table shows what that removes (`hidden states`:
the strongest attack on the hidden states alone). A probe whose next-token accuracy is at its
floor (the most frequent target everywhere, within FLOOR_MARGIN) has not learnt from its input:
its attacks measure an untrained model, so it is flagged "not trained enough to rank" and kept
off the front and the pick.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitlab.audit.probes import FLOOR_MARGIN, front_and_pick, heading, probe_sizes, table, written
from splitlab.audit.settings import AdviseSettings
from splitlab.errors import UserError
from splitlab.models.staged import UShaped

#: language probes' sizes when not given (train, test, aux, targets; sequences): small, so that a CPU
#: probes every cut in minutes
DEFAULTS = (400, 300, 200, 100)
#: the attacker that reads the targets, not the hidden states
TARGETS = "targets_channel"


def linear_flops(client: nn.Module, server: nn.Module, tokens: torch.Tensor) -> tuple[float, float]:
    """(client's, whole model's) FLOPs per token (2 x multiply-adds of the linear layers, the
    projections of attention and MLP; embedding lookups, attention's score products and
    normalisation are not counted), by one dry run of `tokens` (B, T) through the whole split model."""
    whole = UShaped(client, server) if hasattr(client, "tail") else nn.Sequential(client, server)
    on_client = {id(m) for m in client.modules()}
    counted = {"client": 0.0, "all": 0.0}

    def count(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        weight = typing.cast(torch.Tensor, module.weight)  # Linear: (out, in); transformers' Conv1D: (in, out)
        rows = output.numel() / output.shape[-1]
        flops = 2 * weight.numel() * rows / tokens.numel()
        counted["all"] += flops
        if id(module) in on_client:
            counted["client"] += flops

    linear = [m for m in whole.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    handles = [m.register_forward_hook(count) for m in linear]
    try:
        with torch.no_grad():
            whole(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return counted["client"], counted["all"]


def candidates(settings: AdviseSettings, valid: list[int]) -> list[tuple[int, int | None]]:
    """The cuts to probe: `cuts=` or every valid cut, then U-shaped (c, last cut) for each c before
    the last (the client keeps the model's head and the targets)."""
    chosen = valid if settings.cuts is None else [int(c) for c in settings.cuts.split(",")]
    wrong = [c for c in chosen if c not in valid]
    if wrong:
        raise UserError(f"cuts={settings.cuts}: {wrong[0]} is not a cut of model={settings.model}; valid: {valid}")
    u_shaped = [(c, valid[-1]) for c in chosen if c < valid[-1]] if settings.u_shaped else []
    return [*((c, None) for c in chosen), *u_shaped]


def label(cut: int, tail: int | None) -> str:
    return str(cut) if tail is None else f"{cut},{tail}"


def advise_language(settings: AdviseSettings, probe: dict[str, Any], out: Path) -> dict[str, Any]:
    """Probe every candidate cut of a language model (settings checked before any trains); write
    OUT/advise.md, advise.json and advise.png; return the rows."""
    from splitlab.assembly import load_data
    from splitlab.audit.attack import attacks
    from splitlab.audit.run import attack_run
    from splitlab.engine import run
    from splitlab.finished_run import final_states, load_run
    from splitlab.models import build_model
    from splitlab.resolve import resolve_config

    resolved = resolve_config(probe)
    data = load_data(resolved)
    sizes = probe_sizes(settings, len(data.train_y), len(data.test_y), DEFAULTS)
    model = build_model(settings.model, data.input_shape, data.num_classes, **resolved.model_settings())
    cuts = candidates(settings, model.valid_cuts)
    probe = {**probe, "train_subset": sizes["train_subset"], "test_subset": sizes["test_subset"]}
    for cut, tail in cuts:
        resolve_config({**probe, "cut": label(cut, tail)})  # every probe valid before any trains
    token_attacks = [name for name, cls in attacks().items() if "tokens" in cls.inputs and cls.advised]
    attack = {
        "aux": sizes["aux"],
        "targets": sizes["targets"],
        "epochs": settings.epochs,
        "seed": settings.seed,
        "device": settings.device,
    }
    rows = []
    for cut, tail in cuts:
        run_dir = out / ("cut" + label(cut, tail).replace(",", "_"))
        summary = run({**probe, "cut": label(cut, tail), "out": str(run_dir), "overwrite": True}, progress=False)
        experiment = load_run(run_dir, settings.device)
        client, server = typing.cast(nn.Sequential, experiment.assemble(final_states(experiment)))
        sample = experiment.data.test_x[:2].long()
        client_flops, all_flops = linear_flops(client, server, sample)
        # every client passes its sequences once a round
        per_round = settings.rounds * sizes["train_subset"] * sample.shape[1]
        found = {name: attack_run(run_dir, {**attack, "attack": name}) for name in token_attacks}
        best = max(found, key=lambda name: found[name]["accuracy"])
        hidden = max((name for name in found if name != TARGETS), key=lambda name: found[name]["accuracy"])
        floor = accuracy_floor(experiment.data.test_y)
        rows.append(
            {
                "cut": label(cut, tail),
                "u_shaped": tail is not None,
                "targets_at_server": summary["comm_bytes_by_kind"].get("labels", 0) > 0,
                "client_parameters": sum(p.numel() for p in client.parameters()),
                "client_share": client_flops / all_flops,
                "bytes_per_token": {k: v / per_round for k, v in summary["comm_bytes_by_kind"].items()},
                "loss": summary["final_loss"],
                "perplexity": summary["final_perplexity"],
                "accuracy": summary["final_accuracy"],
                "accuracy_floor": floor,
                "ranked": summary["final_accuracy"] > floor + FLOOR_MARGIN,
                "attack": best,
                "recovery": found[best]["accuracy"],
                "hidden_attack": hidden,
                "hidden_recovery": found[hidden]["accuracy"],
                "floor": found[best]["baseline"],
                "attacks": {name: found[name]["accuracy"] for name in token_attacks},
                "examples": found[best].get("examples", []),
            }
        )
    result = {"settings": settings.model_dump(), "sizes": sizes, "rows": rows, **recommend(settings, rows)}
    answer = written(out, result, markdown(settings, sizes, rows, result), "advise.png")
    _plot(out / "advise.png", settings, rows)
    return answer


def accuracy_floor(targets: torch.Tensor) -> float:
    """The next-token accuracy of answering the most frequent target everywhere (ignored positions
    left out, as the accuracy leaves them)."""
    from splitlab.targets import IGNORED

    kept = targets[targets != IGNORED]
    return float(torch.bincount(kept).max()) / len(kept)


def _plot(file: Path, settings: AdviseSettings, rows: list[dict[str, Any]]) -> None:
    """Per candidate: bytes up per token (relative to the largest), the client's FLOPs share, the
    text the strongest attack recovers and its floor, next-token accuracy."""
    from splitlab.experiments.plots import plot_per_cut

    def column(key: str) -> list[float]:
        return [row[key] for row in rows]

    plot_per_cut(
        file,
        f"{settings.model} on {settings.dataset}",
        [row["cut"] for row in rows],
        {"bytes up per token (rel.)": [bytes_up(row) for row in rows]},
        {
            "client FLOPs share": column("client_share"),
            "text recovered": column("recovery"),
            "floor": column("floor"),
            "next-token accuracy": column("accuracy"),
        },
    )


def bytes_up(row: dict[str, Any]) -> float:
    from splitlab.ledger import KINDS

    return sum(v for kind, v in row["bytes_per_token"].items() if KINDS[kind] == "up")


def trade_offs(row: dict[str, Any]) -> tuple[float, ...]:
    """What the Pareto front weighs, each lower is better: loss, text recovered, targets at the
    server, bytes up per token."""
    return (row["loss"], row["recovery"], float(row["targets_at_server"]), bytes_up(row))


def recommend(settings: AdviseSettings, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The Pareto front and the pick: among the front's candidates within `max_recovery`, the lowest
    loss (then the least recovered); None if none meets the budget."""
    budget = settings.max_recovery
    within = lambda row: budget is None or row["recovery"] <= budget  # noqa: E731
    return front_and_pick(rows, trade_offs, within, lambda row: (row["loss"], row["recovery"]))


COLUMNS = (
    ("cut", "cut", "{}"),
    ("client_parameters", "client params", "{:,}"),
    ("client_share", "client FLOPs share", "{:.1%}"),
    ("up", "bytes up/token/round", "{}"),
    ("down", "bytes down/token/round", "{}"),
    ("targets_at_server", "targets at server", "{}"),
    ("attack", "strongest attack", "{}"),
    ("recovery", "text recovered", "{:.1%}"),
    ("hidden_recovery", "hidden states", "{:.1%}"),
    ("floor", "floor", "{:.1%}"),
    ("loss", "loss", "{:.3f}"),
    ("perplexity", "perplexity", "{:.2f}"),
    ("accuracy", "next-token accuracy", "{:.1%}"),
    ("ranked", "trained enough to rank", "{}"),
)


def _by_kind(row: dict[str, Any], direction: str) -> str:
    from splitlab.ledger import KINDS

    kinds = [(kind, v) for kind, v in row["bytes_per_token"].items() if KINDS[kind] == direction]
    return ", ".join(f"{kind} {v:.3g}" for kind, v in kinds) or "0"


def markdown(
    settings: AdviseSettings, sizes: dict[str, int], rows: list[dict[str, Any]], advice: dict[str, Any]
) -> str:
    head = heading(settings, sizes, sequences=True) + (
        "*text recovered* is the fraction of the "
        "targets' tokens the strongest token attack rebuilds from what the server receives: the final model's "
        "hidden states at the cut and, in a vanilla split, the next-token targets (the text shifted by one); "
        "*hidden states* the strongest attack on the hidden states alone, *floor* what always answering the most "
        "frequent token gets (docs/privacy.md); a probe whose next-token accuracy is within "
        f"{FLOOR_MARGIN:.0%} of its floor is not trained enough to rank. Bytes per training "
        "token per round, by kind; cut A,B is U-shaped (the client keeps the stages from B on and the targets).\n\n"
    )
    cells = [{**row, "up": _by_kind(row, "up"), "down": _by_kind(row, "down")} for row in rows]
    lines = table(COLUMNS, cells, _cell)
    examples = ["", "Reconstructions by the strongest attack, first targets:"]
    for row in rows:
        examples += [
            f"- cut {row['cut']}: true {e['original']!r}, recovered {e['reconstructed']!r}" for e in row["examples"]
        ]
    return head + "\n".join(lines) + "\n" + "\n".join(examples) + "\n\n" + words(settings, rows, advice) + "\n"


def words(settings: AdviseSettings, rows: list[dict[str, Any]], advice: dict[str, Any]) -> str:
    """The recommendation in a few sentences: the front, the pick and what it leaks or why there is
    none, the probes not ranked, what U-shape removes."""
    by_cut = {row["cut"]: row for row in rows}
    front = ", ".join(advice["pareto_front"]) or "none"
    said = [f"Pareto front (loss, text recovered, targets at server, bytes up): cuts {front}."]
    if advice["unranked"]:
        said.append(
            f"Not trained enough to rank (next-token accuracy at its floor, so its attacks measure an untrained "
            f"model): cut{'s' * (len(advice['unranked']) > 1)} {', '.join(advice['unranked'])}; probe longer "
            f"(rounds=, train_subset=)."
        )
    pick = advice["pick"]
    if pick is None:
        said.append(no_pick(settings, rows))
    else:
        row = by_cut[pick]
        budget = f" within max_recovery={settings.max_recovery:g}" if settings.max_recovery is not None else ""
        said.append(
            f"Pick cut {pick} (the lowest loss on the front{budget}): there a curious server rebuilds "
            f"{row['recovery']:.1%} of the client's text ({row['attack']}; floor {row['floor']:.1%})"
            + ("; the next-token targets reach it in the clear." if row["targets_at_server"] else ".")
        )
        if row["recovery"] > row["floor"] + 0.1:
            said.append("No depth measured here hides the text: add a defense at the cut to bring it to the floor.")
    for row in rows:
        if row["u_shaped"]:
            plain = by_cut.get(row["cut"].split(",")[0])
            extra = f" for {bytes_up(row) - bytes_up(plain):+.3g} bytes up per token" if plain else ""
            removed = (
                f": text recovered {plain['recovery']:.1%} at cut {plain['cut']}, {row['recovery']:.1%} here"
                if plain
                else ""
            )
            said.append(
                f"U-shaped cut {row['cut']} keeps the next-token targets on the client (no labels reach the "
                f"server){extra}{removed}; the hidden states at the first cut still cross."
            )
            break
    return " ".join(said)


def no_pick(settings: AdviseSettings, rows: list[dict[str, Any]]) -> str:
    """Why no cut was picked: the vanilla cuts' targets over the budget, what the ranked U-shaped
    cuts' hidden states still give, the probes not ranked."""
    budget, why = settings.max_recovery, []
    vanilla = [row["recovery"] for row in rows if row["targets_at_server"]]
    if budget is not None and vanilla and min(vanilla) > budget:
        why.append(
            f"every vanilla cut sends the server the next-token targets, the text shifted by one token "
            f"({min(vanilla):.1%} of it or more recovered, no attack needed)"
        )
    u_shaped = [row for row in rows if not row["targets_at_server"]]
    ranked = [row for row in u_shaped if row["ranked"]]
    if ranked:
        least = min(ranked, key=lambda row: row["recovery"])
        why.append(f"the U-shaped cuts' hidden states still give {least['recovery']:.1%} or more ({least['attack']})")
    elif not u_shaped:
        why.append("no U-shaped cut was probed (u_shaped=true adds them)")
    if not any(row["ranked"] for row in rows):
        why.append("no probe trained enough to rank")
    within = f" keeps the recovered text within max_recovery={budget:g}" if budget is not None else " is picked"
    return (
        f"No cut{within}: {'; '.join(why)}. Keep the targets on the client (a U-shaped cut) and add a defense "
        f"at the cut (e.g. dchi, noise), or relax the budget."
    )


def _cell(fmt: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt.format(value)
