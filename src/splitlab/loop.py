"""The round loop every algorithm shares: sampling, training, evaluation, the loop's callbacks
and the summary at the end.

Every random choice is drawn from a stream keyed by (seed, round, purpose), so a run resumed
from its last checkpoint replays the rounds since and ends bit for bit where an uninterrupted one
would.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
import typing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from splitlab.algorithms.base import ClientInfo
from splitlab.assembly import Experiment, personal_metrics
from splitlab.callbacks import Callback, CommBudget, MetricsFile, ProgressBar, RecorderFlush, StepLog
from splitlab.checkpoints import Checkpointer
from splitlab.errors import NonFiniteLoss, NonFiniteStep, RoundFailed
from splitlab.generation import decode, text_scores
from splitlab.io import save_safetensors, write_json, write_jsonl, write_yaml
from splitlab.loggers import make_logger
from splitlab.metrics import TASK_METRICS
from splitlab.models import HeadAndTail
from splitlab.privacy.accounting import privacy_summary
from splitlab.privacy.defenses import token_distances
from splitlab.random_streams import register_stream
from splitlab.roles import Blueprint, State, random_stream
from splitlab.run_weights import decoding_record, export_hf
from splitlab.rundir import DECODING
from splitlab.settings import setting_of
from splitlab.transport import ClientDropped
from splitlab.units import GIB, to_target

STREAM_SAMPLING = register_stream("sampling", 0)


def sample_clients(clients: list[ClientInfo], participation: float, rng: np.random.Generator) -> list[ClientInfo]:
    """round(C*K) clients (at least one), in id order."""
    count = max(1, round(participation * len(clients)))
    chosen = np.sort(rng.choice(len(clients), count, replace=False))
    return [clients[k] for k in chosen]


def evaluate(experiment: Experiment) -> dict[str, float]:
    """Test metrics of the model assembled from the roles' states (fetched through the transport,
    as telemetry). With test_split=client, every client's model is run on its own held-out
    samples and the metrics are computed on all of them pooled (accuracy and loss are then the
    test-size-weighted means of the per-client values). On the global test set, algorithms with
    personal client models get the unweighted mean over clients of each client's model's metrics.
    An algorithm whose roles evaluate among themselves (`role_metrics`: vertical) gives its own.
    The model runs in the run's precision (`Blueprint.logits`: under autocast, as it trained)."""
    data, algorithm, blueprint = experiment.data, experiment.algorithm, experiment.blueprint
    by_roles = algorithm.role_metrics()
    if by_roles is not None:
        return by_roles
    metrics = TASK_METRICS[data.task]
    if experiment.client_test is not None:
        held = [(k, x, y) for k, (x, y) in enumerate(experiment.client_test) if len(y)]
        where_they_are = getattr(experiment.transport, "personal_logits", None)  # backend=ray: on the actors
        logits = (
            where_they_are(algorithm, [k for k, _, _ in held])
            if where_they_are is not None and algorithm.personal_models
            else [blueprint.logits(experiment.assemble(algorithm.personal_model(k)), x) for k, x, _ in held]
        )
        return metrics(torch.cat(logits), torch.cat([y for _, _, y in held]))
    if algorithm.personal_models:
        ids = [c.id for c in experiment.clients]
        where_they_are = getattr(experiment.transport, "personal_metrics", None)  # backend=ray: on the actors
        per_client = (
            where_they_are(algorithm, ids)
            if where_they_are is not None
            else [
                personal_metrics(
                    experiment.assemble, algorithm.personal_model(k), data.test_x, data.test_y, blueprint, metrics
                )
                for k in ids
            ]
        )
        return {key: float(np.mean([m[key] for m in per_client])) for key in per_client[0]}
    model = algorithm.global_model()
    if model is None:
        raise NotImplementedError(f"{algorithm.name} has no global model and no personal models")
    return metrics(blueprint.logits(experiment.assemble(model), data.test_x), data.test_y)


DEPLOYED_NOTE = (
    "final_accuracy: the model without the defense at the cut (undefended path); "
    "final_accuracy_deployed: with the defense applied at the cut, as deployed"
)


def evaluate_deployed(experiment: Experiment, rnd: int) -> dict[str, float]:
    """`test_accuracy_deployed`: a defended global split model's test accuracy with the defense
    applied at the cut as deployed (clipping, noise, compression); `test_accuracy` is the
    undefended path. Empty where the defense leaves the forward pass as it is. Called right after
    `evaluate`, whose global model it reuses (assembled there: not fetched twice)."""
    defense, parts = experiment.blueprint.defense, experiment.assembler.parts
    if not defense.changes_forward or len(parts) != 2 or experiment.algorithm.personal_models:
        return {}
    client, server = parts
    generator = torch.Generator(experiment.blueprint.device).manual_seed(experiment.config.run.seed * 1_000_003 + rnd)
    deployed = defense.deployed(client, server, generator)
    if isinstance(client, HeadAndTail):  # U-shaped: the client's tail after the server's stages
        deployed = nn.Sequential(deployed, client.tail_part())
    logits = experiment.blueprint.logits(deployed, experiment.data.test_x)
    metrics = TASK_METRICS[experiment.data.task](logits, experiment.data.test_y)
    return {"test_accuracy_deployed": metrics["accuracy"]}


def _callbacks(experiment: Experiment, show_progress: bool, extra: Sequence[Callback]) -> list[Callback]:
    """The loop's callbacks, in the order they are called: files first, then trackers, progress,
    the caller's."""
    cfg, out, ledger = experiment.config.run, experiment.out, experiment.ledger
    callbacks: list[Callback] = [MetricsFile(out)]
    if experiment.blueprint.recorder is not None:
        callbacks.append(RecorderFlush(experiment.blueprint.recorder, out))
    if cfg.comm_budget_gib is not None:
        callbacks.append(CommBudget(ledger, cfg.comm_budget_gib))
    tracker = make_logger(cfg.logger, out, experiment.config.as_dict())
    if tracker is not None:
        callbacks.append(tracker)
    if show_progress:
        callbacks.append(ProgressBar(f"{cfg.algorithm} rounds", cfg.rounds, ledger, experiment.blueprint))
    callbacks = [*callbacks, *extra]
    if cfg.log_every:
        steps = _step_log(experiment, callbacks)
        callbacks.insert(0, steps)  # (its round's state before the others')
    return callbacks


def _step_log(experiment: Experiment, listeners: list[Callback]) -> StepLog:
    """log_every's `StepLog`, told of every step the algorithm tracks."""
    cfg, blueprint, algorithm = experiment.config.run, experiment.blueprint, experiment.algorithm
    batches: dict[int, int] = {}

    def lr_at(rnd: int, step: int) -> float:
        """The run's clock: a step of the round's client batches (as the training server's steps)."""
        if rnd not in batches:
            batches.clear()
            clients = sample_clients(
                experiment.clients, cfg.participation, random_stream(cfg.seed, rnd, STREAM_SAMPLING)
            )
            batches[rnd] = algorithm.run_steps(clients)
        return cfg.lr * blueprint.lr_factor(rnd, step, batches[rnd])

    per_step = _per_sample(experiment) * Blueprint.step_batch(cfg)
    log = StepLog(experiment.out, cfg.log_every, lr_at, _unit(experiment), per_step, listeners)
    algorithm.on_step = lambda loss, norm: log.step(algorithm.steps, loss, norm)
    return log


def _unit(experiment: Experiment) -> str:
    """What the throughput figures count: tokens (a language dataset) or samples."""
    return "tokens" if experiment.data.task == "language" else "samples"


def _per_sample(experiment: Experiment) -> int:
    """Tokens per sample (a language dataset's sequence length), else 1: what tokens_seen counts."""
    data = experiment.data
    return data.input_shape[0] if data.task == "language" else 1


def _round_samples(experiment: Experiment, clients: list[ClientInfo]) -> int:
    """The samples a round's clients train on (vertical: the parties' shared rows, once)."""
    cfg = experiment.config.run
    if experiment.algorithm.round_batches(clients) is None:
        clients = clients[:1]
    return sum(Blueprint.samples_per_round(cfg, c.num_samples) for c in clients)


def run_rounds(experiment: Experiment, show_progress: bool, extra: Sequence[Callback] = ()) -> dict[str, Any]:
    cfg = experiment.config.run
    algorithm, out = experiment.algorithm, experiment.out
    checkpoints = Checkpointer(experiment)
    state: dict[str, Any] = checkpoints.load() or {
        "round": 0,
        "metrics": [],
        "wall_seconds": 0.0,
        "stopped_by": "rounds",
    }
    state.setdefault("steps", 0)
    state.setdefault("samples", 0)
    algorithm.steps = state["steps"]
    if state["round"] == 0:
        write_yaml(out / "config.yaml", experiment.config.as_dict())
        write_json(out / "partition.json", experiment.partition_report)
        if experiment.data.task == "language":
            write_json(out / DECODING, decoding_record(experiment.data))

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(checkpoints.join)
        callbacks = _callbacks(experiment, show_progress, extra)
        for callback in callbacks:
            callback.on_run_start(state)
            cleanup.callback(callback.on_run_end, state)
        while state["round"] < cfg.rounds and state["stopped_by"] == "rounds":
            rnd = state["round"]
            torch.manual_seed(cfg.seed * 1_000_003 + rnd)  # dropout etc. depend on (seed, round) only
            clients = sample_clients(
                experiment.clients, cfg.participation, random_stream(cfg.seed, rnd, STREAM_SAMPLING)
            )
            for callback in callbacks:
                callback.on_round_start(state, algorithm.round_batches(clients))
            started = time.perf_counter()
            try:
                with _needs_the_client(cfg.algorithm, rnd + 1, checkpoints):
                    algorithm.run_round(rnd, clients)
            except NonFiniteStep as step:  # in process, or no one client to blame: training diverged
                _check_finite(step.value, f"server's {step.what}", rnd + 1, cfg.defense)
            _check_enough_finished(experiment, clients, rnd + 1, checkpoints)
            state.setdefault("dropped", []).extend([rnd + 1, k] for k in sorted(algorithm.dropped))
            train_loss = algorithm.pop_train_loss()
            _check_finite(train_loss, "training loss", rnd + 1, cfg.defense)
            compute_seconds = experiment.blueprint.pop_seconds()
            for phase, seconds in experiment.transport.pop_seconds().items():  # roles in other processes
                compute_seconds[phase] = compute_seconds.get(phase, 0.0) + seconds
            state["wall_seconds"] += time.perf_counter() - started
            state["round"] = rnd + 1
            saved_through, state["steps"] = state["steps"], algorithm.steps
            state["samples"] += _round_samples(experiment, clients)
            stops = [reason for callback in callbacks if (reason := callback.on_round_trained(state)) is not None]
            if stops:
                state["stopped_by"] = stops[0]
            row = None
            if state["round"] % cfg.eval_every == 0 or state["round"] == cfg.rounds or stops:
                with _needs_the_client(cfg.algorithm, rnd + 1, checkpoints):  # personal models are fetched from clients
                    row = _metrics_row(experiment, state, train_loss, compute_seconds)
                _check_finite(row["test_loss"], "test loss", state["round"], cfg.defense)
                state["metrics"].append(row)
            if cfg.save_every and state["steps"] // cfg.save_every > saved_through // cfg.save_every:
                _save_step(experiment, state, row)
            for callback in callbacks:
                callback.on_round_end(state, row)
            if state["round"] < cfg.rounds and state["stopped_by"] == "rounds":
                checkpoints.maybe_save(state)
    checkpoints.wait()
    with checkpoints.kept_on_failure(state):
        summary = _finish(experiment, state, checkpoints)
    checkpoints.remove()
    return summary


def _dchi_scale(summary: dict[str, Any], experiment: Experiment, model: list[State]) -> None:
    """`dchi:E`: the epsilon between nearest tokens of the final embedding table, in the summary."""
    tokens = summary.get("privacy", {}).get("tokens")
    if tokens is not None:
        client = list(typing.cast(nn.Sequential, experiment.assemble(model)))[0]
        epsilon, count = tokens["epsilon_per_token"], tokens["releases_per_token"]
        tokens.update(token_distances(client, experiment.blueprint.num_classes, epsilon, count))


def _save_step(experiment: Experiment, state: dict[str, Any], row: dict[str, Any] | None) -> None:
    """save_every: the global model as it is at the end of this round to OUT/checkpoints/step-S (S
    the training steps so far): its LoRA adapters (peft), else the whole model (hf), as the final
    export. keep_best=eval_loss: only the step with the lowest test loss stays (this round's, its
    evaluation if it had one), named in the loop's state."""
    cfg, out = experiment.config.run, experiment.out
    name = f"checkpoints/step-{state['steps']}"
    model = experiment.algorithm.global_model()
    assert model is not None, "refused when resolved (personal models)"
    experiment.assemble(model)  # (the parts export_hf reads)
    export_hf(experiment.config, experiment.assembler.parts, experiment.data.vocabulary, out / name, whole=False)
    if cfg.keep_best != "eval_loss":
        return
    loss = row["test_loss"] if row is not None else evaluate(experiment)["loss"]
    best = state.get("best_checkpoint")
    if best is not None and best["eval_loss"] <= loss:
        shutil.rmtree(out / name)
        return
    if best is not None:
        shutil.rmtree(out / best["folder"], ignore_errors=True)
    state["best_checkpoint"] = {"folder": name, "step": state["steps"], "eval_loss": loss}


def _export_hf(experiment: Experiment) -> dict[str, str]:
    """out/hf: the global model as a Hugging Face folder, for models that have that form (model=gpt,
    hf), and out/peft: its LoRA adapters in peft's format; the folders written."""
    parts = experiment.assembler.parts  # full_state assembled the model
    return export_hf(experiment.config, parts, experiment.data.vocabulary, experiment.out)


#: How many generations `eval_generate` writes beside their references (generations.jsonl).
EXAMPLES = 20


def _eval_generate(experiment: Experiment, states: list) -> dict[str, Any]:
    """BLEU and ROUGE-L of the global model's continuations of the first `eval_generate` test
    prompts (splitlab.generation), decoded as the eval_* keys say (greedily by default, each at most
    as long as the training sequences allow); the first EXAMPLES of them beside their references in
    generations.jsonl."""
    references, window = experiment.data.references, experiment.data.input_shape[0]
    assert references is not None, "refused when built"
    model, device = experiment.assemble(states), experiment.blueprint.device
    tokenizer, count = references.tokenizer, min(experiment.config.run.eval_generate, len(references.prompts))

    def logits(tokens: torch.Tensor) -> torch.Tensor:
        with experiment.blueprint.autocast():  # as it trained, as `evaluate`
            return model(tokens.to(device)).float().cpu()

    texts = []
    for prompt in references.prompts[:count]:
        settings = experiment.config.run.decoding(room=max(1, window - len(prompt) + 1))
        texts.append(tokenizer.decode(decode(logits, prompt, settings, window, tokenizer.eos_token_id)).strip())
    examples = [
        {"prompt": tokenizer.decode(prompt), "generated": text, "references": refs}
        for prompt, text, refs in zip(references.prompts, texts, references.texts[:EXAMPLES])
    ]
    write_jsonl(experiment.out / "generations.jsonl", examples)
    return {**text_scores(texts, references.texts[:count]), "eval_generate": count}


@contextlib.contextmanager
def _needs_the_client(algorithm: str, round_number: int, checkpoints: Checkpointer) -> Iterator[None]:
    """A client dropped out of a step that cannot go on without it (the evaluation of its personal
    model, SplitGP's final per-client weights): the run stops with one line."""
    try:
        yield
    except ClientDropped as dropped:
        raise RoundFailed(
            f"round {round_number}: {dropped}, in a step {algorithm} cannot finish without it; "
            f"restart the client and {checkpoints.again()}"
        ) from None


def _check_finite(loss: float | None, what: str, round_number: int, defense: str) -> None:
    """A non-finite figure stops the run, naming what to change: the defense where one is applied
    at the cut (its noise or clipping can be what made the loss non-finite), else lr."""
    if loss is not None and not math.isfinite(loss):
        change = "lower lr (or use optimizer=adam)" if defense == "none" else f"weaken defense={defense} or lower lr"
        raise NonFiniteLoss(
            f"the {what} became {loss} in round {round_number}: training diverged; {change} and start again "
            f"with overwrite=true"
        )


def _metrics_row(
    experiment: Experiment, state: dict, train_loss: float | None, compute_seconds: dict[str, float]
) -> dict[str, Any]:
    ledger = experiment.ledger
    test = evaluate(experiment)
    return {
        "round": state["round"],
        **{f"test_{key}": value for key, value in test.items()},
        **evaluate_deployed(experiment, state["round"]),
        "train_loss": train_loss,
        "comm_bytes": ledger.total_bytes,
        "comm_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        **_envelope(experiment),
        "wall_seconds": state["wall_seconds"],
        "round_compute_seconds": compute_seconds,
        **experiment.transport.pop_telemetry(),
        **_dropouts(experiment, state),
    }


def _throughput(experiment: Experiment, state: dict[str, Any]) -> dict[str, Any]:
    """The training steps taken (each a client batch; an optimizer step of the model it trains), the
    samples (language: tokens, seq_len a sample, padding included, as the Trainer's
    num_input_tokens_seen) trained on and their rate over the training time (wall_seconds)."""
    unit, seen = _unit(experiment), state["samples"] * _per_sample(experiment)
    rate = seen / state["wall_seconds"] if state["wall_seconds"] > 0 else None
    return {"optimizer_steps": state["steps"], f"{unit}_seen": seen, f"{unit}_per_second": rate}


def _envelope(experiment: Experiment) -> dict[str, int]:
    """The serialized transport's encoded bytes (every message, server-side ones included); over a
    network, also the bytes of every protobuf message sent or received (`wire_bytes`)."""
    ledger, transport = experiment.ledger, experiment.transport
    figures = {"envelope_bytes": ledger.envelope_bytes} if transport.name != "direct" else {}
    return {**figures, "wire_bytes": ledger.wire_bytes} if transport.remote else figures


def _dropouts(experiment: Experiment, state: dict) -> dict[str, Any]:
    """Over a network: the clients that dropped out since the last row, as [round, client id] pairs."""
    if not experiment.transport.remote:
        return {}
    dropped, state["dropped"] = state.get("dropped", []), []
    return {"dropped_clients": dropped}


def _check_enough_finished(
    experiment: Experiment, clients: list[ClientInfo], round_number: int, checkpoints: Checkpointer
) -> None:
    """Fewer than `min_clients` (or all sampled, if fewer) finished the round: the run stops there."""
    dropped = experiment.algorithm.dropped
    needed = min(experiment.transport.min_clients, len(clients))
    finished = sum(c.id not in dropped for c in clients)  # (vanilla SL's holder may be of an earlier round)
    non_finite = experiment.algorithm.non_finite
    if finished == 0 and non_finite:
        others = ", the others left" if len(non_finite) < len(clients) else ""
        raise NonFiniteLoss(
            f"round {round_number}: no client is left: client(s) {', '.join(map(str, sorted(non_finite)))} "
            f"dropped, their data made the server's loss or gradients non-finite{others}; if every "
            f"client's did, training diverged: lower lr (or use optimizer=adam) and start again"
        )
    if finished < needed:
        raise RoundFailed(
            f"round {round_number}: only {finished} of {len(clients)} clients finished "
            f"(dropped: {', '.join(map(str, sorted(dropped)))}), fewer than min_clients={needed}; "
            f"restart the clients and {checkpoints.again()}"
        )


def _finish(experiment: Experiment, state: dict, checkpoints: Checkpointer) -> dict[str, Any]:
    cfg, out = experiment.config.run, experiment.out
    rows = state["metrics"]
    best = max(rows, key=lambda row: row["test_accuracy"])
    ledger = experiment.ledger
    summary = {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "cut": cfg.cut,
        **({"tail_cut": cfg.tail_cut} if cfg.tail_cut is not None else {}),
        "seed": cfg.seed,
        "partition": cfg.partition,
        "clients": len(experiment.clients),
        "rounds_completed": state["round"],
        "final_accuracy": rows[-1]["test_accuracy"],
        "best_accuracy": best["test_accuracy"],
        "best_round": best["round"],
        **{
            f"final_{key[5:]}": value
            for key, value in rows[-1].items()
            if key.startswith("test_") and key != "test_accuracy"
        },
        "total_bytes": ledger.total_bytes,
        "total_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        "comm_bytes_by_client": {str(k): n for k, n in sorted(ledger.bytes_by_client.items())},
        **_envelope(experiment),
        "wall_seconds": state["wall_seconds"],
        **_throughput(experiment, state),
        "stopped_by": state["stopped_by"],
        "target_accuracy": cfg.target_accuracy,
        **dict(zip(("rounds_to_target", "gib_to_target"), to_target(rows, cfg.target_accuracy))),
        **privacy_summary(cfg, setting_of(experiment.config).releasers(cfg)),
    }
    if "best_checkpoint" in state:
        summary["best_checkpoint"] = str(out / state["best_checkpoint"]["folder"])
        summary["best_checkpoint_eval_loss"] = state["best_checkpoint"]["eval_loss"]
    if "test_accuracy_deployed" in rows[-1]:
        summary["final_accuracy_deployed"] = rows[-1]["test_accuracy_deployed"]
        summary["accuracy_paths"] = DEPLOYED_NOTE
    model = experiment.algorithm.shared_model()
    if model is not None:  # with personal client parts, the server part alone
        personal = experiment.algorithm.personal_models
        weights = experiment.assembler.server_state(model[-1]) if personal else experiment.full_state(model)
        save_safetensors(out / "weights.safetensors", weights)
        if not personal:  # one global model to export
            summary.update(_export_hf(experiment))
            _dchi_scale(summary, experiment, model)
        if cfg.eval_generate:  # (personal models refused when built)
            summary.update(_eval_generate(experiment, model))
    with _needs_the_client(cfg.algorithm, state["round"], checkpoints):  # SplitGP's are fetched from the clients
        client_weights = experiment.algorithm.client_weights()
    if client_weights is not None:
        save_safetensors(out / "clients.safetensors", client_weights)
    write_json(out / "summary.json", summary)
    return summary
