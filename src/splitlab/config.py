"""Run configuration: one flat set of KEY=VALUE settings, validated before anything runs.

Keys common to every run live in `RunConfig`; each algorithm declares its own hyperparameters as
a `Params` model next to its code, so a key is valid exactly when the chosen algorithm uses it.
Every problem becomes a one-line `UserError` naming the bad value and what is allowed.

Two rules hold for every key, and a test generated from the schema checks them (tests/test_config_schema.py):
every number has a range (`ge`/`gt` and `le`/`lt` on its Field), and every key of RunConfig says
where it applies: in `EVERYWHERE`, or in `ONLY_WHEN` with the test for the settings it applies
to. A key given a value other than its default where it does not apply is refused, naming why.
"""

from __future__ import annotations

import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict

from splitlab.errors import UserError, not_a_file, one_line, unknown_key
from splitlab.json_text import MAX_FILE_DEPTH, check_depth

#: The concerns RunConfig's keys are grouped by (in `run --help` and docs/cli.md), each field tagged
#: with its own; the command line stays one flat set of KEY=VALUE.
GROUPS = ("data", "model", "training", "privacy", "deployment")
DATA, MODEL, TRAINING, PRIVACY, DEPLOYMENT = (typing.cast(JsonDict, {"group": group}) for group in GROUPS)


class DecodingSettings(BaseModel):
    """How a continuation is chosen (splitlab.generation): the keys `splitlab generate` takes besides
    the prompt, and a run's `eval_generate` as its `eval_*` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_new_tokens: int = Field(100, ge=1, le=100_000, description="tokens to generate (fewer if the text ends)")
    temperature: float = Field(
        0.0, ge=0, le=100, description="0: greedy or beam search; else sample from softmax(logits / T)"
    )
    top_k: int | None = Field(None, ge=1, le=10_000_000, description="sampling: only the k most likely tokens")
    top_p: float | None = Field(
        None, gt=0, le=1, description="sampling: only the fewest most likely tokens whose probability reaches p"
    )
    num_beams: int = Field(1, ge=1, le=1000, description="beam search with this many beams (temperature 0)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the sampling (temperature > 0)")

    @model_validator(mode="after")
    def _one_method(self) -> DecodingSettings:
        if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
            raise ValueError("top_k and top_p restrict sampling: give them with temperature > 0 (e.g. temperature=1)")
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError("num_beams > 1 is beam search, which does not sample: leave temperature at 0")
        return self


def eval_decoding(key: str, default: Any = None, default_said: str = "") -> Any:
    """RunConfig's `eval_<key>`: DecodingSettings' `key` (its type's bounds) for eval_generate."""
    field = DecodingSettings.model_fields[key]
    description = f"with eval_generate: {field.description}{default_said}"
    return FieldInfo.merge_field_infos(field, default=default, description=description, json_schema_extra=TRAINING)


#: Keys of RunConfig written in a small language of their own, each checked by its parser (_form_parsers);
#: partition= and defense= too, by splitlab.resolve (their parsers sit with the datasets and the defenses).
WRITTEN_IN_A_FORM = ("lr_schedule", "loss", "augment", "test_split", "train_range")


class RunConfig(BaseModel):
    """Settings shared by all algorithms; under each key, its description (as `run --help` shows it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    plugins: str | None = Field(None, json_schema_extra=DEPLOYMENT)
    """modules of your own to import first, comma-separated (algorithms, models, datasets; docs/extending.md)"""
    algorithm: str = Field("sfl_v2", json_schema_extra=TRAINING)
    """the algorithm (see `splitlab algorithms`; a plugin's too)"""
    dataset: str = Field("fashion_mnist", json_schema_extra=DATA)
    """the dataset (see `splitlab datasets`)"""
    data_dir: str | None = Field(None, json_schema_extra=DATA)
    """directory with the dataset's files, if not the default"""
    data_file: str | None = Field(None, json_schema_extra=DATA)
    """dataset=jsonl: a JSON Lines file of rows with text | prompt + completion | messages (docs/data.md)"""
    test_file: str | None = Field(None, json_schema_extra=DATA)
    """dataset=jsonl: its test rows, in the same format (default: a fixed random tenth of data_file's rows)"""
    data: Literal["partition", "own"] = Field("partition", json_schema_extra=DATA)
    """partition: clients are a seeded partition of the dataset | own: each client brings the training samples in its
    own data_dir (a vertical party: a CSV of its own columns; splitlab server only)"""
    model: str = Field("cnn", json_schema_extra=MODEL)
    """the model (see `splitlab models`)"""
    init: str | None = Field(None, json_schema_extra=MODEL)
    """start from the model of this finished run's directory (same model and sizes; e.g. pretrained centrally, then
    fine-tuned split with lora)"""
    seq_len: int | None = Field(None, ge=1, le=1_048_576, json_schema_extra=DATA)
    """language datasets: tokens per sequence (default: the dataset's, 64 for shakespeare_lm, 128 for e2e, jsonl and
    hf_disk), at most the model's context"""
    truncation: Literal["refuse", "left", "right"] = Field("refuse", json_schema_extra=DATA)
    """rows of prompt + completion or messages (jsonl, hf_disk, e2e) longer than seq_len + 1 tokens: refuse (a row whose
    prompt leaves no completion token in the loss is refused; a longer completion is cut at its end) | right (each row
    keeps its first seq_len + 1 tokens) | left (its last: the prompt's start is dropped); with right or left, a row left
    with nothing in the loss is dropped, a warning saying how many"""
    packing: bool = Field(False, json_schema_extra=DATA)
    """rows of prompt + completion or messages (jsonl, hf_disk, e2e): several training rows to a sequence, each row's
    attention, positions and loss kept to itself (fewer padded positions; test rows stay one a sequence)"""
    lora: str | None = Field(None, json_schema_extra=MODEL)
    """R:ALPHA: freeze the model and train rank-R LoRA adapters scaled ALPHA/R, e.g. 8:16 (docs/language.md)"""
    lora_targets: str | None = Field(None, json_schema_extra=MODEL)
    """with lora: comma-separated names of the projections to adapt (default: the model's), or all-linear: every
    linear layer but the output layer, as peft's"""
    lora_dropout: float = Field(0.0, ge=0, lt=1, json_schema_extra=MODEL)
    """with lora: dropout on the adapters' input in training, as peft's lora_dropout"""
    cut: int = Field(1, ge=0, le=1000, json_schema_extra=MODEL)
    """cut layer, in the model's numbering (see `splitlab models`); cut=A,B: a U-shaped split, cut A and tail_cut B"""
    tail_cut: int | None = Field(None, ge=1, le=1000, json_schema_extra=MODEL)
    """U-shaped split (also written cut=A,B): the client also holds the stages from this second cut on, with the labels
    and the loss; the server only those between (docs/configurations.md)"""
    clients: Annotated[int, Field(ge=1, le=1_000_000)] | Literal["all"] = Field(10, json_schema_extra=DATA)
    """number of clients K (1 to 1,000,000); 'all' = one per natural user"""
    setting: Literal["vanilla", "vertical"] = Field("vanilla", json_schema_extra=DATA)
    """vanilla (clients hold samples) | vertical (parties hold different features of shared samples, aligned by private
    set intersection; algorithm=sl; docs/configurations.md)"""
    parties: int = Field(2, ge=1, le=64, json_schema_extra=DATA)
    """setting=vertical: parties holding features"""
    features: str | None = Field(None, json_schema_extra=DATA)
    """setting=vertical: each party's feature columns, / between parties, ranges and commas within, e.g. 0-13/14-27
    (default: `parties` contiguous groups of image or table columns)"""
    labels_at: Annotated[int, Field(ge=0, le=63)] | Literal["server"] = Field("server", json_schema_extra=DATA)
    """setting=vertical: who holds the labels: server | a party's index"""
    combine: Literal["concat", "sum", "mean"] = Field("concat", json_schema_extra=MODEL)
    """setting=vertical: how the server combines the parties' embeddings at the cut"""
    participation: float = Field(1.0, gt=0, le=1, json_schema_extra=TRAINING)
    """fraction C of clients sampled per round"""
    rounds: int = Field(10, ge=1, le=10_000_000, json_schema_extra=TRAINING)
    """training rounds"""
    local_epochs: int = Field(1, ge=1, le=100_000, json_schema_extra=TRAINING)
    """passes over its samples a client makes per round"""
    local_steps: int | None = Field(None, ge=1, le=1_000_000_000, json_schema_extra=TRAINING)
    """cap on a client's mini-batches per round (after local_epochs); none = all of them"""
    batch_size: int = Field(64, ge=1, le=1_000_000, json_schema_extra=TRAINING)
    """samples per mini-batch"""
    optimizer: Literal["sgd", "adam", "adamw"] = Field("adam", json_schema_extra=TRAINING)
    """sgd | adam | adamw, for every part of the model (adamw: weight_decay decoupled, as Loshchilov & Hutter; with sgd
    and adam it is an L2 penalty added to the gradient)"""
    grad_accum: int = Field(1, ge=1, le=4096, json_schema_extra=TRAINING)
    """micro-batches of batch_size per optimizer step: a step takes grad_accum x batch_size samples, and every role
    computes its loss micro-batch by micro-batch (docs/performance.md)"""
    max_grad_norm: float | None = Field(None, gt=0, le=1e9, json_schema_extra=TRAINING)
    """clip the gradients of what each role trains, slot by slot, to this total L2 norm before its optimizer steps; none
    = no clipping"""
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", json_schema_extra=TRAINING)
    """fp32 | bf16 | fp16: every role's forward and loss under torch's autocast in that dtype, weights and optimizers in
    float32; hidden states and cut gradients cross the cut in it (fp16: each role scales its loss dynamically, and a
    cut gradient crosses scaled, with its scale)"""
    base_dtype: Literal["float32", "bfloat16"] = Field("float32", json_schema_extra=TRAINING)
    """with lora and precision=bf16: the dtype the frozen base is held in (bfloat16: half the memory); what trains stays
    float32"""
    gradient_checkpointing: bool = Field(False, json_schema_extra=TRAINING)
    """keep only each stage's input during the forward pass and recompute the stage in the backward: less activation
    memory, about one more forward pass of time; same results"""
    vectorize: bool = Field(False, json_schema_extra=DEPLOYMENT)
    """run the clients of a round that do not depend on each other as one computation over their stacked weights
    (torch.func's vmap; FedAvg and SFL-V1, in process): equal to one client at a time within float rounding, faster for
    many small clients (docs/performance.md)"""
    cohort_size: int | None = Field(None, ge=1, le=1_000_000, json_schema_extra=DEPLOYMENT)
    """with vectorize: clients per batched computation, which bounds its memory; none = as many as fit 1 GiB of
    stacked weights, gradients and optimizer state"""
    deterministic: bool = Field(True, json_schema_extra=DEPLOYMENT)
    """device=cuda: deterministic kernels, cuDNN's autotuner off (runs repeat bit for bit; slower, docs/performance.md);
    false: torch's fastest kernels. The CPU's are deterministic"""
    lr: float = Field(1e-3, gt=0, le=1e6, json_schema_extra=TRAINING)
    """learning rate"""
    lr_schedule: str = Field("none", json_schema_extra=TRAINING)
    """the learning rate by round, as factors of lr joined by +: step:<every>:<gamma> | cosine | warmup:<rounds> (e.g.
    warmup:5+cosine); none = lr throughout"""
    # per-step schedules and logging, whole-model clipping, adapter checkpoints (docs/language.md)
    warmup_steps: int = Field(0, ge=0, le=10**9, json_schema_extra=TRAINING)
    """a linear warm-up of the learning rate over the first N optimizer steps each role takes, from 0 (as the
    Trainer's; docs/language.md); 0: none"""
    warmup_ratio: float = Field(0.0, ge=0, lt=1, json_schema_extra=TRAINING)
    """the warm-up as a share of each role's optimizer steps in the run (rounded up), instead of warmup_steps"""
    lr_decay: Literal["none", "linear", "cosine"] = Field("none", json_schema_extra=TRAINING)
    """none | linear | cosine: after the warm-up, the learning rate decays per optimizer step to 0 at the run's
    last step (each role's own steps), as the Trainer's lr_scheduler_type; multiplies lr_schedule's factor"""
    clip_scope: Literal["part", "global"] = Field("part", json_schema_extra=TRAINING)
    """with max_grad_norm: part clips each part a role trains on its own | global clips the whole model one step
    trains (client and server parts) by their joint norm, one scalar per part crossing the cut (grad_norm_down,
    grad_norm_up), as the Trainer's max_grad_norm"""
    keep_client_optimizer: bool = Field(False, json_schema_extra=TRAINING)
    """a client keeps its optimizer's state (Adam's moments) from round to round for the client part it receives,
    instead of a fresh optimizer each round (checkpointed with the client)"""
    log_every: int = Field(0, ge=0, le=10**9, json_schema_extra=DEPLOYMENT)
    """every N training steps, a row of the mean loss, lr, gradient norm and tokens/s to steps.jsonl and the
    trackers; 0: none"""
    save_every: int = Field(0, ge=0, le=10**9, json_schema_extra=DEPLOYMENT)
    """at the end of the first round reaching each N training steps, the global model to
    OUT/checkpoints/step-S (peft: the LoRA adapters; hf: where the whole model trains); 0: none"""
    keep_best: Literal["none", "eval_loss"] = Field("none", json_schema_extra=DEPLOYMENT)
    """with save_every: eval_loss keeps only the step folder with the lowest test loss (evaluated at each save),
    named in summary.json; none keeps every one"""
    loss: str = Field("cross_entropy", json_schema_extra=TRAINING)
    """the training loss: cross_entropy | label_smoothing:<eps> | focal:<gamma> (or a plugin's); evaluation reports
    cross-entropy"""
    augment: str = Field("none", json_schema_extra=DATA)
    """augment clients' training batches, +-joined in order: flip | crop:<pad> (or a plugin's; e.g. crop:4+flip); images
    only; none = as stored"""
    momentum: float = Field(0.0, ge=0, lt=1, json_schema_extra=TRAINING)
    """SGD momentum"""
    weight_decay: float = Field(0.0, ge=0, le=1e3, json_schema_extra=TRAINING)
    """sgd, adam: an L2 penalty on the gradient; adamw: decoupled weight decay"""
    prox_mu: float = Field(0.0, ge=0, le=1e6, json_schema_extra=TRAINING)
    """FedProx: mu of the proximal term mu/2 ||w - w_round||^2 added to the local objective of every client part the
    sync server averages (w_round: the weights the client started the round from); 0 = none"""
    server_opt: Literal["avg", "avgm", "adam", "yogi", "adagrad"] = Field("avg", json_schema_extra=TRAINING)
    """FedOpt: how the sync server steps from the clients' weighted mean, as a pseudo-gradient: avg (x + server_opt_lr x
    (mean - x); at server_opt_lr=1 FedAvg) | avgm (momentum) | adam | yogi | adagrad (Reddi et al. 2021)"""
    server_opt_lr: float = Field(1.0, gt=0, le=1e6, json_schema_extra=TRAINING)
    """the sync server's learning rate (eta of FedOpt; SCAFFOLD's global step size)"""
    server_opt_momentum: float = Field(0.9, ge=0, lt=1, json_schema_extra=TRAINING)
    """server_opt=avgm: momentum of the pseudo-gradient"""
    server_opt_betas: list[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.99], json_schema_extra=TRAINING)
    """server_opt=adam, yogi, adagrad: beta_1,beta_2 (adagrad uses beta_1 only)"""
    server_opt_tau: float = Field(1e-3, gt=0, le=1e6, json_schema_extra=TRAINING)
    """server_opt=adam, yogi, adagrad: tau, the adaptivity (v starts at tau^2)"""
    scaffold: bool = Field(False, json_schema_extra=TRAINING)
    """SCAFFOLD: control variates correct every client part's steps (option II; optimizer=sgd without momentum)"""
    secure_aggregation: bool = Field(False, json_schema_extra=PRIVACY)
    """the sync server learns only the sum of the round's client parts (SecAgg: X25519 pairwise masks, self masks,
    Shamir shares for clients that drop; fixed point, 16 fractional bits in a 32-bit ring); in process and over gRPC"""
    secagg_neighbours: int | None = Field(None, ge=2, le=10**6, json_schema_extra=PRIVACY)
    """secure_aggregation with SecAgg+'s sparse graph: each client masks with and shares its secrets among K
    neighbours (even, below the round's clients) in a seeded random K-regular graph, not every other client; none =
    the complete graph (SecAgg)"""
    partition: str = Field("iid", json_schema_extra=DATA)
    """iid | dirichlet:<alpha> | shards:<shards per client>"""
    seed: int = Field(0, ge=0, le=2**32 - 1, json_schema_extra=TRAINING)
    """random seed (0 to 2**32-1, what numpy and torch both accept)"""
    device: Literal["cpu", "cuda", "auto"] = Field("auto", json_schema_extra=DEPLOYMENT)
    """cpu | cuda | auto (cuda when there is one)"""
    eval_every: int = Field(1, ge=1, le=10_000_000, json_schema_extra=TRAINING)
    """evaluate every N rounds (and after the last)"""
    train_subset: int | None = Field(None, ge=1, le=10**10, json_schema_extra=DATA)
    """use only N training samples (seeded choice)"""
    train_range: str | None = Field(None, json_schema_extra=DATA)
    """A:B, fractions 0 <= A < B <= 1: only that stretch of the training samples in the dataset's order (shakespeare_lm:
    play by play), e.g. 0:0.5 to pretrain and 0.5:1 to fine-tune on the rest"""
    test_subset: int | None = Field(None, ge=1, le=10**10, json_schema_extra=DATA)
    """evaluate on only N test samples (seeded choice)"""
    comm_budget_gib: float | None = Field(None, gt=0, le=1e9, json_schema_extra=TRAINING)
    """stop once this much has been communicated"""
    eval_generate: int = Field(0, ge=0, le=10**7, json_schema_extra=TRAINING)
    """language datasets with references (e2e; jsonl and hf_disk rows of prompt + completion or messages): at the final
    evaluation, continue N test prompts (greedily unless the eval_* keys say otherwise) and write BLEU and ROUGE-L to
    summary.json (docs/language.md); 0: none"""
    eval_max_new_tokens: int | None = eval_decoding(
        "max_new_tokens", None, " (default: as many as the training sequences hold, seq_len + 1 tokens in all)"
    )
    eval_temperature: float = eval_decoding("temperature", 0.0)
    eval_top_k: int | None = eval_decoding("top_k")
    eval_top_p: float | None = eval_decoding("top_p")
    eval_num_beams: int = eval_decoding("num_beams", 1)
    eval_seed: int | None = eval_decoding("seed", None, " (default: the run's seed)")
    test_split: str = Field("global", json_schema_extra=DATA)
    """global (the dataset's test set) | client:<fraction> (each client holds out that fraction of its own samples)"""
    target_accuracy: float | None = Field(None, gt=0, le=1, json_schema_extra=TRAINING)
    """summary reports the first evaluated round (and GiB) reaching this accuracy"""
    ledger: Literal["splitlab", "fsl_sage"] = Field("splitlab", json_schema_extra=DEPLOYMENT)
    """byte-counting convention: splitlab counts everything; fsl_sage leaves labels out, as the FSL-SAGE authors' code
    does"""
    logger: Literal["none", "csv", "tensorboard", "mlflow", "wandb"] = Field("none", json_schema_extra=DEPLOYMENT)
    """also log every evaluated round to: csv (OUT/metrics.csv) | tensorboard (OUT/tensorboard) | mlflow (OUT/mlruns) |
    wandb (offline, OUT/wandb); all but csv need their package (docs/cli.md)"""
    out: str | None = Field(None, json_schema_extra=DEPLOYMENT)
    """run directory; default runs/<algorithm>_<dataset>_<model>_cut<cut>_seed<seed>"""
    transport: Literal["direct", "serialized"] = Field("direct", json_schema_extra=DEPLOYMENT)
    """how roles exchange messages: direct (in-process, zero-copy) | serialized (every message encoded to bytes and
    back, as over a network; same results)"""
    backend: Literal["local", "ray"] = Field("local", json_schema_extra=DEPLOYMENT)
    """where roles live: local (this process) | ray (clients on `workers` Ray actors, the training server on its own;
    every message as bytes; same results; docs/ray.md)"""
    workers: int = Field(2, ge=1, le=10_000, json_schema_extra=DEPLOYMENT)
    """backend=ray: Ray actors holding the client nodes"""
    cpus_per_client: int = Field(1, ge=1, le=1024, json_schema_extra=DEPLOYMENT)
    """backend=ray: CPUs (torch threads) of every actor: each client worker, which trains one client at a time, and the
    training server's (results equal in-process ones run with as many threads)"""
    gpus_per_client: float = Field(0.0, ge=0, le=64, json_schema_extra=DEPLOYMENT)
    """backend=ray: GPUs of every actor (fractions share one: 0.25 puts four actors on a GPU); with device=auto an actor
    uses CUDA when Ray gave it a GPU that torch there can use, else the CPU"""
    max_restarts: int = Field(3, ge=0, le=1000, json_schema_extra=DEPLOYMENT)
    """backend=ray: times a run whose Ray actor (or node) was lost builds its roles again and replays from its last
    checkpoint, before it stops with a resume hint"""
    checkpoint_every: float = Field(60.0, ge=0, le=10**8, json_schema_extra=DEPLOYMENT)
    """seconds between checkpoints (0: after every round; never sooner than 50x the last snapshot's in-loop time); a
    resumed run replays from the last one"""
    defense: str = Field("none", json_schema_extra=PRIVACY)
    """defenses at the cut, +-joined: clip:<C> noise:<sigma> dp:epsilon=<E> gradnoise:<scale> nopeek:<alpha>
    quantize:int8|fp16 topk:<fraction> marvell[:<scale>] marvell:kl=<sumKL bound> label_dp:<epsilon> dchi:<epsilon>;
    none = no defense (docs/privacy.md)"""
    record: int = Field(0, ge=0, le=10**7, json_schema_extra=PRIVACY)
    """record what the server saw at the cut, up to N samples per round, for attacks"""
    noise_key: str | None = Field(None, min_length=1, json_schema_extra=PRIVACY)
    """fix the defenses' noise (reproducible); the guarantee then assumes this key stays secret from the server
    (default: each party draws its own secret key)"""
    resume: bool = Field(False, json_schema_extra=DEPLOYMENT)
    """continue the run in `out` from its checkpoint"""
    overwrite: bool = Field(False, json_schema_extra=DEPLOYMENT)
    """replace a finished or partial run in `out`"""

    @field_validator("out", "data_dir", "data_file", "test_file")
    @classmethod
    def _expand_home(cls, value: str | None) -> str | None:
        """`~` and `~user` as a shell would expand them (a folder literally named `~` is never meant)."""
        return None if value is None else os.path.expanduser(value)

    @field_validator("server_opt_betas")
    @classmethod
    def _two_betas(cls, value: list[float]) -> list[float]:
        if len(value) != 2:
            raise ValueError("expected two numbers beta_1,beta_2 in [0, 1), e.g. 0.9,0.99")
        return value

    @field_validator(*WRITTEN_IN_A_FORM)
    @classmethod
    def _check_form(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A key written in a small language of its own is read by its parser, whose ValueError says what is allowed."""
        if value is not None:
            _form_parsers()[typing.cast(str, info.field_name)](value)
        return value

    @field_validator("lora", mode="before")
    @classmethod
    def _check_lora(cls, value: Any) -> str | None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError("expected R:ALPHA as a string; in a YAML file, quote it: lora: '8:16'")
        if value is not None:
            parse_lora(value)
        return value

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        """`RunConfig(...)` from Python: a key it does not hold is one line (the Trainer's name for
        one of its keys, or where a model's or algorithm's key goes), not pydantic's traceback."""
        if not isinstance(data, Mapping):
            return data
        unknown = sorted(set(data) - set(cls.model_fields))
        if not unknown:
            return data
        key = unknown[0]
        raise UserError(
            other_name(key)
            or f"unknown key {key!r} for RunConfig, which holds the keys every run shares: a model's or an "
            f"algorithm's own key goes beside them in one mapping, splitlab.run({{..., {key!r}: ...}}) (which "
            f"names the closest key if it is a typo), or in its params model, splitlab.run(config, *params)"
        )

    @property
    def lr_by_step(self) -> bool:
        """Whether the learning rate follows a per-step schedule (warm-up or decay; splitlab.schedules)."""
        return bool(self.warmup_steps or self.warmup_ratio) or self.lr_decay != "none"

    def adapters(self) -> dict[str, Any]:
        """The LoRA settings that were given, as `splitlab.models.build_model` takes them."""
        lora = {"lora": parse_lora(self.lora)} if self.lora is not None else {}
        targets = {"lora_targets": tuple(self.lora_targets.split(","))} if self.lora_targets is not None else {}
        dropout = {"lora_dropout": self.lora_dropout} if self.lora_dropout else {}
        return {**lora, **targets, **dropout}

    def decoding(self, room: int) -> DecodingSettings:
        """How eval_generate continues a prompt with `room` tokens left in a training sequence's
        length (the default of eval_max_new_tokens): the eval_* keys, one UserError line if they
        contradict each other."""
        try:
            return DecodingSettings(
                max_new_tokens=self.eval_max_new_tokens or room,
                temperature=self.eval_temperature,
                top_k=self.eval_top_k,
                top_p=self.eval_top_p,
                num_beams=self.eval_num_beams,
                seed=self.seed if self.eval_seed is None else self.eval_seed,
            )
        except ValidationError as err:
            why = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise UserError(re.sub(r"\b(top_k|top_p|temperature|num_beams)\b", r"eval_\1", why)) from None


def _form_parsers() -> dict[str, Callable[[str], object]]:
    """The parser of each key in WRITTEN_IN_A_FORM (imported when a value is checked)."""
    from splitlab.augment import parse_augment
    from splitlab.losses import parse_loss
    from splitlab.schedules import parse_lr_schedule

    return {
        "lr_schedule": parse_lr_schedule,
        "loss": parse_loss,
        "augment": parse_augment,
        "test_split": parse_test_split,
        "train_range": parse_train_range,
    }


def _colon_pair(value: str, first: Callable[[str], Any], second: Callable[[str], Any]) -> tuple[Any, Any] | None:
    """`A:B` read as (first(A), second(B)); None where either does not read."""
    a, _, b = str(value).partition(":")
    try:
        return first(a), second(b)
    except ValueError:
        return None


def parse_train_range(value: str) -> tuple[float, float]:
    """`A:B` -> (A, B) with 0 <= A < B <= 1."""
    parsed = _colon_pair(value, float, float)
    if parsed is None or not 0 <= parsed[0] < parsed[1] <= 1:
        raise ValueError("expected A:B with fractions 0 <= A < B <= 1, e.g. 0:0.5")
    return parsed


def parse_lora(value: str) -> tuple[int, float]:
    """`R:ALPHA` -> (rank >= 1, alpha > 0)."""
    parsed = _colon_pair(value, int, float)
    if parsed is None or parsed[0] < 1 or not (math.isfinite(parsed[1]) and parsed[1] > 0):
        raise ValueError("expected R:ALPHA with an integer rank R >= 1 and a number ALPHA > 0, e.g. 8:16")
    return parsed


#: The names transformers' Trainer and peft give settings splitlab also has, answered with splitlab's
#: own (`learning_rate=0.1` -> "splitlab calls it lr"). They are hints, not aliases: config.yaml keeps
#: one name per setting (a rerun or a sweep compares keys), and several do not mean the same thing
#: (peft's r and lora_alpha are one key here; num_train_epochs counts passes over all the data, where
#: splitlab counts rounds of local_epochs each); a name in the table that a key takes is never asked.
OTHER_NAMES = {
    "learning_rate": "lr",
    "gradient_accumulation_steps": "grad_accum",
    "per_device_train_batch_size": "batch_size (per client)",
    "num_train_epochs": "rounds (each round, every sampled client makes local_epochs passes over its rows)",
    "max_steps": "rounds and local_steps (optimizer steps per client per round)",
    "bf16": "precision=bf16",
    "fp16": "precision=fp16",
    "r": "lora=R:ALPHA (peft's r and lora_alpha in one key, e.g. lora=8:16)",
    "lora_r": "lora=R:ALPHA (peft's r and lora_alpha in one key, e.g. lora=8:16)",
    "lora_alpha": "lora=R:ALPHA (peft's r and lora_alpha in one key, e.g. lora=8:16)",
    "target_modules": "lora_targets (comma-separated, or all-linear)",
    "optim": "optimizer (sgd | adam | adamw)",
    "lr_scheduler_type": "lr_schedule",
    "output_dir": "out",
    "max_seq_length": "seq_len",
    "max_length": "seq_len",
    "model_name_or_path": "model=hf model_dir=DIR",
    "eval_steps": "eval_every (rounds)",
    "truncation_mode": "truncation (right keeps a row's start, left its end)",
    "report_to": "logger",
}


def other_name(key: str) -> str | None:
    """One line for a key given by the Trainer's or peft's name (OTHER_NAMES), else None."""
    ours = OTHER_NAMES.get(key)
    return None if ours is None else f"unknown key {key!r}: splitlab calls it {ours}"


#: Algorithms whose model is not split: nothing crosses a cut (no smashed data to record or attack).
UNSPLIT_ALGORITHMS = ("fedavg", "centralized")


#: Datasets of rows that `truncation` cuts (one sequence per row) and `packing` packs.
ROW_DATASETS = frozenset({"jsonl", "hf_disk", "e2e"})

#: Datasets that read no files (bundled or generated): `data_dir` does not apply to them.
WITHOUT_FILES = frozenset({"digits", "synthetic", "breast_cancer"})


#: Keys of RunConfig that apply to every run, but where a setting refuses them (splitlab.settings:
#: `Setting.refused_keys`; the keys that only one setting takes are its `own_keys`).
EVERYWHERE = frozenset(
    {"algorithm", "dataset", "data", "model", "cut", "clients", "participation", "rounds", "local_epochs"}
    | {"local_steps", "batch_size", "optimizer", "lr", "weight_decay", "seed", "device", "eval_every"}
    | {"test_subset", "comm_budget_gib", "test_split", "target_accuracy", "ledger", "logger", "out"}
    | {"backend", "checkpoint_every", "defense", "overwrite", "setting"}
    | {"init", "seq_len", "lr_schedule", "noise_key", "plugins", "loss", "augment"}
    | {"max_grad_norm", "precision", "gradient_checkpointing", "grad_accum", "vectorize"}
    | {
        "prox_mu",
        "server_opt",
        "server_opt_lr",
        "scaffold",
        "secure_aggregation",
    }  # the sync server's: splitlab.resolve
    | {"warmup_steps", "lr_decay", "keep_client_optimizer", "log_every"}
)

EVAL_GENERATE_WHY = (
    "eval_generate continues the test prompts of a language dataset with references with the global model"
)
U_SHAPE_WHY = (
    "a U-shaped split needs clients that hold whole samples (not setting=vertical) and an algorithm that runs one "
    "(docs/configurations.md)"
)


class Applies(typing.NamedTuple):
    """Where a key of RunConfig applies: `when` the resolved config says so; `why` not, said in the
    refusal; `example`: settings where it does not apply (the schema test runs them)."""

    when: Callable[[RunConfig], bool]
    why: str
    example: dict[str, Any]


#: Keys of RunConfig that apply only to some settings. Given a value other than its default where
#: it does not apply, the key is refused in one line rather than silently ignored.
ONLY_WHEN: dict[str, Applies] = {
    "momentum": Applies(lambda r: r.optimizer == "sgd", "momentum is SGD's; it needs optimizer=sgd", {"momentum": 0.9}),
    "workers": Applies(lambda r: r.backend == "ray", "workers are Ray actors; they need backend=ray", {"workers": 4}),
    "transport": Applies(
        lambda r: r.backend == "local",
        "with backend=ray every message travels as bytes, whatever transport says",
        {"backend": "ray", "transport": "serialized"},
    ),
    "partition": Applies(
        lambda r: r.clients != "all",
        "with clients=all each natural user is a client; nothing is partitioned",
        {"clients": "all", "partition": "dirichlet:1"},
    ),
    "train_subset": Applies(
        lambda r: r.clients != "all",
        "with clients=all every natural user's samples are used",
        {"clients": "all", "train_subset": 100},
    ),
    "train_range": Applies(
        lambda r: r.clients != "all",
        "with clients=all every natural user's samples are used",
        {"clients": "all", "train_range": "0:0.5"},
    ),
    "data_dir": Applies(
        lambda r: r.dataset not in WITHOUT_FILES and r.dataset != "jsonl",
        "this dataset reads no folder (bundled, generated, or dataset=jsonl's data_file)",
        {"dataset": "digits", "data_dir": "/tmp"},
    ),
    **{
        key: Applies(lambda r: r.dataset == "jsonl", f"{key} is read by dataset=jsonl", {key: "/tmp/rows.jsonl"})
        for key in ("data_file", "test_file")
    },
    "truncation": Applies(
        lambda r: r.dataset in ROW_DATASETS,
        "truncation cuts rows of prompt + completion or messages (dataset=jsonl, hf_disk, e2e)",
        {"dataset": "digits", "truncation": "left"},
    ),
    "packing": Applies(
        lambda r: r.dataset in ROW_DATASETS,
        "packing packs rows of prompt + completion or messages (dataset=jsonl, hf_disk, e2e)",
        {"dataset": "digits", "packing": True},
    ),
    "record": Applies(
        lambda r: r.algorithm not in UNSPLIT_ALGORITHMS,
        "this algorithm does not split the model: nothing crosses a cut to record",
        {"algorithm": "fedavg", "record": 10},
    ),
    "eval_generate": Applies(lambda r: r.data == "partition", EVAL_GENERATE_WHY, {"data": "own", "eval_generate": 4}),
    **{
        f"eval_{key}": Applies(
            lambda r: r.eval_generate > 0,
            f"eval_{key} is how eval_generate decodes; it needs eval_generate=N",
            {f"eval_{key}": example},
        )
        for key, example in (
            ("max_new_tokens", 10),
            ("temperature", 0.7),
            ("top_k", 5),
            ("top_p", 0.9),
            ("num_beams", 2),
            ("seed", 3),
        )
    },
    "lora": Applies(
        lambda r: r.model == "hf" or r.init is not None,
        "LoRA fine-tunes a pretrained model's weights, and this one starts from random ones: give init=RUN_DIR "
        "(a finished run of this model) or model=hf model_dir=DIR",
        {"model": "mlp", "lora": "4:8"},
    ),
    "lora_targets": Applies(
        lambda r: r.lora is not None, "lora_targets needs lora=R:ALPHA", {"lora_targets": "c_attn"}
    ),
    "lora_dropout": Applies(lambda r: r.lora is not None, "lora_dropout needs lora=R:ALPHA", {"lora_dropout": 0.1}),
    **{
        key: Applies(
            lambda r: r.backend == "ray", f"{key} sets the Ray actors' resources; it needs backend=ray", example
        )
        for key, example in (
            ("cpus_per_client", {"cpus_per_client": 2}),
            ("gpus_per_client", {"gpus_per_client": 0.5}),
            ("max_restarts", {"max_restarts": 1}),
        )
    },
    "tail_cut": Applies(  # which split algorithms run one: splitlab.resolve.check_u_shape, which comes first
        lambda r: r.algorithm not in UNSPLIT_ALGORITHMS, U_SHAPE_WHY, {"algorithm": "fedavg", "tail_cut": 3}
    ),
    "base_dtype": Applies(
        lambda r: r.lora is not None and r.precision == "bf16",
        "only a LoRA model has a frozen base, which computes in bfloat16 under autocast: base_dtype needs "
        "lora=R:ALPHA and precision=bf16",
        {"base_dtype": "bfloat16"},
    ),
    "deterministic": Applies(
        lambda r: r.device != "cpu",
        "the CPU's kernels are deterministic; deterministic=false needs device=cuda or auto",
        {"device": "cpu", "deterministic": False},
    ),
    "secagg_neighbours": Applies(
        lambda r: r.secure_aggregation,
        "secagg_neighbours is secure aggregation's graph of neighbours; it needs secure_aggregation=true",
        {"secagg_neighbours": 4},
    ),
    "server_opt_momentum": Applies(
        lambda r: r.server_opt == "avgm", "server_opt_momentum is server_opt=avgm's", {"server_opt_momentum": 0.5}
    ),
    **{
        key: Applies(
            lambda r: r.server_opt in ("adam", "yogi", "adagrad"),
            f"{key} is server_opt=adam, yogi and adagrad's",
            example,
        )
        for key, example in (
            ("server_opt_betas", {"server_opt_betas": "0.5,0.9"}),
            ("server_opt_tau", {"server_opt_tau": 0.1}),
        )
    },
    "warmup_ratio": Applies(
        lambda r: r.warmup_steps == 0,
        "warmup_steps and warmup_ratio both give the warm-up's length; give one",
        {"warmup_steps": 10, "warmup_ratio": 0.1},
    ),
    "clip_scope": Applies(
        lambda r: r.max_grad_norm is not None,
        "clip_scope says how max_grad_norm clips; it needs max_grad_norm=N",
        {"clip_scope": "global"},
    ),
    "save_every": Applies(
        lambda r: r.model in ("gpt", "hf"),
        "save_every writes the model's Hugging Face folders (hf, peft), which only model=gpt and model=hf have",
        {"model": "mlp", "save_every": 10},
    ),
    "keep_best": Applies(
        lambda r: r.save_every > 0,
        "keep_best chooses among the saved steps; it needs save_every=N",
        {"keep_best": "eval_loss"},
    ),
    "cohort_size": Applies(
        lambda r: r.vectorize, "cohort_size is how many clients vectorize=true runs together", {"cohort_size": 10}
    ),
    "resume": Applies(
        lambda r: not r.overwrite,
        "overwrite=true replaces the run that resume=true would continue",
        {"overwrite": True, "resume": True},
    ),
}


def field_bounds(field: Any) -> tuple[Any, Any] | None:
    """A numeric field's lower (Ge or Gt) and upper (Le or Lt) bounds, None where one is missing;
    None for a field that takes no number."""
    import annotated_types as at

    def numeric(annotation: Any) -> bool:  # a number, or a union with one (not a list of numbers)
        if annotation in (int, float):
            return True
        if typing.get_origin(annotation) is list:
            return False
        return any(numeric(arg) for arg in typing.get_args(annotation) if arg is not bool)

    if not numeric(field.annotation):
        return None
    constraints = list(field.metadata)
    for arg in typing.get_args(field.annotation):  # Annotated[int, Field(ge=...)] | Literal[...]
        constraints += [c for inner in getattr(arg, "__metadata__", ()) for c in getattr(inner, "metadata", [inner])]
    lower = next((c for c in constraints if isinstance(c, (at.Ge, at.Gt))), None)
    upper = next((c for c in constraints if isinstance(c, (at.Le, at.Lt))), None)
    return lower, upper


def bound_value(bound: Any) -> Any:
    """The number of a Ge, Gt, Le or Lt bound."""
    return next(getattr(bound, name) for name in ("ge", "gt", "le", "lt") if hasattr(bound, name))


def check_applicable(run: RunConfig, given: Mapping[str, Any]) -> None:
    """UserError for the first key in `given` set (to other than its default) where it does not apply."""
    for key, rule in ONLY_WHEN.items():
        if key in given and getattr(run, key) != RunConfig.model_fields[key].default and not rule.when(run):
            raise UserError(f"{key}={given[key]} does not apply here: {rule.why}")


def check_finite(settings: BaseModel | Mapping[str, Any]) -> None:
    """UserError for a non-finite number among `settings`, given (checked first, so that the message
    says what is wrong) or parsed (pydantic reads the text 'inf' as a number)."""
    values = settings.model_dump() if isinstance(settings, BaseModel) else settings
    for key, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, float) and not math.isfinite(item):
                raise UserError(f"invalid value {item!r} for {key}: expected a finite number")


def check_no_booleans(fields: Mapping[str, Any], raw: Mapping[str, Any]) -> None:
    """true/false where a number is expected (pydantic would read True as 1) is refused."""
    for key, value in raw.items():
        if key in fields and isinstance(value, bool) and not accepts(fields[key].annotation, bool):
            raise UserError(f"invalid value {value!r} for {key}: expected a number or name, not a boolean")


def parse_test_split(value: str) -> float | None:
    """`global` -> None; `client:<fraction>` -> the fraction each client holds out (0 < f < 1)."""
    kind, _, fraction = value.partition(":")
    if kind == "global" and not fraction:
        return None
    try:
        held_out = float(fraction) if kind == "client" else None
    except ValueError:
        held_out = None
    if held_out is None or not 0 < held_out < 1:
        raise ValueError("expected global or client:<fraction> with 0 < fraction < 1, e.g. client:0.1")
    return held_out


class NoParams(BaseModel):
    """For algorithms without hyperparameters of their own."""

    model_config = ConfigDict(extra="forbid", frozen=True)


#: Keys that say how to run, not what to compute: they may differ between a run and its resume.
RUN_CONTROL_KEYS = (
    "resume",
    "overwrite",
    "device",
    "out",
    "logger",
    "transport",
    "checkpoint_every",
    "backend",
    "workers",
    "cpus_per_client",
    "gpus_per_client",
    "max_restarts",
    "deterministic",
)
#: Keys that say how the trained model is evaluated, not how it trains: a resumed run may change them
#: too (one whose final evaluation failed goes on with `eval_temperature=0`; config.yaml records them).
EVALUATION_KEYS = tuple(key for key in RunConfig.model_fields if key.startswith("eval_"))


@dataclass(frozen=True)
class ResolvedConfig:
    """A run's settings validated: those of every run, the algorithm's own and the model's own."""

    run: RunConfig
    params: BaseModel
    #: the algorithm's class (a splitlab.algorithms.base.Algorithm, which this module sits below),
    #: looked up once by splitlab.resolve
    algorithm_class: Any
    model_params: BaseModel = NoParams()

    def as_dict(self) -> dict[str, Any]:
        return {**self.run.model_dump(), **self.params.model_dump(), **self.model_params.model_dump()}

    def defaults(self) -> dict[str, Any]:
        """Every key at its default value, for this algorithm and model."""
        return {
            **RunConfig(algorithm=self.run.algorithm, model=self.run.model).model_dump(),
            **type(self.params)().model_dump(),
            **type(self.model_params)().model_dump(),
        }

    def model_settings(self) -> dict[str, Any]:
        """What `splitlab.models.build_model` takes beyond the data: the model's own keys and LoRA's."""
        return {**self.model_params.model_dump(), **self.run.adapters()}

    @property
    def model_dir(self) -> str | None:
        """model=hf's folder, where its weights and tokenizer are read (None for other models)."""
        return self.model_params.model_dump().get("model_dir") if self.run.model == "hf" else None

    @property
    def out_dir(self) -> Path:
        r = self.run
        cut = r.cut if r.tail_cut is None else f"{r.cut}-{r.tail_cut}"
        return Path(r.out or f"runs/{r.algorithm}_{r.dataset}_{r.model}_cut{cut}_seed{r.seed}")


Settings = typing.TypeVar("Settings", bound=BaseModel)


def parse_settings(cls: type[Settings], raw: Mapping[str, Any]) -> Settings:
    """KEY=VALUE settings of a command -> its settings model; a mistake is one UserError line."""
    unknown = sorted(set(raw) - set(cls.model_fields))
    if unknown:
        raise unknown_key(unknown[0], cls.model_fields)
    raw = from_text(cls.model_fields, raw)
    check_no_booleans(cls.model_fields, raw)
    check_finite(raw)
    try:
        settings = cls(**raw)
    except ValidationError as err:
        raise UserError(one_line(err)) from None
    check_finite(settings)
    return settings


def flat_settings(config: BaseModel | Mapping[str, Any], *params: BaseModel) -> dict[str, Any]:
    """A run's settings as the flat KEY: VALUE mapping they are resolved from (splitlab.resolve):
    `config` a RunConfig (the keys it was given) or a mapping; `params` the algorithm's Params and
    the model's params models, typed, their given keys added."""
    flat = config.model_dump(exclude_unset=True) if isinstance(config, BaseModel) else dict(config)
    for own in params:
        flat.update(own.model_dump(exclude_unset=True))
    return flat


def parse_overrides(items: list[str]) -> dict[str, str]:
    """KEY=VALUE strings -> {KEY: VALUE}, each value the exact text typed: the settings model reads
    it by its field's type (`from_text`), so that a string such as `ROMEO:` or `yes` stays a string."""
    parsed: dict[str, str] = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"expected KEY=VALUE, got {item!r}")
        key = key.strip()
        if key in parsed:
            raise UserError(f"key {key!r} is given twice ({given[key]} and {item}); give it once")
        given[key] = item
        parsed[key] = value
    return parsed


#: Texts that mean "no value" for a field that takes none but takes no text either (`local_steps=none`).
NO_VALUE = ("", "none", "null")


def from_text(fields: Mapping[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Settings whose values may be text (the command line's KEY=VALUE) read by their field's type:
    a string field keeps the exact text; an empty value unsets a field that may be unset; `none` or
    `null` unsets one that takes no text; `a,b` (or `[a,b]`) is a list for a list field; numbers and
    booleans are left to the schema to convert (pydantic). Values that are not text (a YAML file's,
    Python's) and keys of no field are kept as they are."""
    return {
        key: _read_text(fields[key].annotation, value) if key in fields and isinstance(value, str) else value
        for key, value in raw.items()
    }


def _read_text(annotation: Any, text: str) -> Any:
    unset = not text.strip() or (text.strip().lower() in NO_VALUE and not accepts(annotation, str))
    if unset and accepts(annotation, type(None)):
        return None
    if accepts(annotation, str):
        return text
    if accepts(annotation, list):
        items = text.strip().removeprefix("[").removesuffix("]")
        return [item.strip() for item in items.split(",")] if items.strip() else []
    return text


def accepts(annotation: Any, kind: type) -> bool:
    """Whether a field's type admits values of `kind` (a union or Annotated type: any of its members)."""
    if annotation is kind or typing.get_origin(annotation) is kind:
        return True
    if typing.get_origin(annotation) is Literal:
        return False
    return any(accepts(arg, kind) for arg in typing.get_args(annotation))


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {str(path)!r}: {not_a_file(path)}")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"config file {str(path)!r} is not a UTF-8 text file of KEY: VALUE lines") from None
    try:
        check_depth(text, MAX_FILE_DEPTH)  # before the parser recurses through it (seconds to a RecursionError)
        content = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except ValueError as err:  # check_depth's
        raise UserError(f"config file {str(path)!r}: {err}") from None
    except _DuplicateKey as err:
        raise UserError(f"config file {str(path)!r}: {err}") from None
    except RecursionError:  # nested by indentation
        raise UserError(f"config file {str(path)!r} nests deeper than YAML can be read") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise UserError(f"config file {str(path)!r} must hold a mapping of KEY: VALUE, not {type(content).__name__}")
    return content


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load, except that a key given twice in one mapping is an error, not the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(f"key {key!r} is given twice (line {key_node.start_mark.line + 1}); give it once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
