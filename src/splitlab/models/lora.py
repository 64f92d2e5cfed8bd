"""LoRA (Hu et al., 2021): a frozen linear layer plus a trainable low-rank update.

`LoraLinear` computes `W x + b + (alpha / r) * B A x` with `A` (r x in) drawn like a linear
layer's weight (Kaiming-uniform, from torch's global generator, so a seeded model build is
reproducible) and `B` (out x r) zero, so a freshly wrapped model computes exactly what its base
did. It keeps the base's parameter names (`weight`, `bias`) and adds `lora_A` and `lora_B` beside
them, as microsoft/LoRA's loralib does, so a LoRA model's state dict is its base's plus the
adapters, and `merge_lora` hands back the base's names with `W + (alpha / r) B A` folded in.

It wraps `nn.Linear` and transformers' `Conv1D` (GPT-2's projections), whose weight is stored
transposed (in x out); that one is recognised by its class name so this module does not import
transformers.

LoRA dropout (`lora_dropout=P`, as peft's): in training, the adapters see their input with each
element zeroed with probability P and the rest scaled 1 / (1 - P); the frozen path sees it whole.
No model may draw from torch's global random state (a client must compute the same in any
process), so the mask comes from a generator keyed by the run's seed, the layer's name and the
input's bytes (`KeyedDropout`, also what a checkpoint's own dropout layers become with
`hf_dropout=checkpoint`): a part and every copy of it (SFL-V1's server copies, FSL-SAGE's
auxiliary model) drop alike given the same input, and resuming needs no generator state. Hashing
the input costs a pass over it (and a copy to the host on a GPU) per dropout layer and step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.errors import UserError

#: Projections adapted when `lora_targets` is not given: GPT-2's fused query/key/value projection
#: (`c_attn`, which `model=gpt` names the same way) and the Llama layout's query and value
#: projections (Llama, Qwen2, Mistral, SmolLM), the choice of the LoRA paper (Section 7.1) and of
#: peft's defaults. Those a model lacks are skipped; a model with none of them needs `lora_targets`.
DEFAULT_TARGETS = ("c_attn", "q_proj", "v_proj")
#: `lora_targets=all-linear`: every linear layer but the output layer (`lm_head`), as peft's `all-linear`.
ALL_LINEAR, OUTPUT_LAYER = "all-linear", "lm_head"


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D`: a linear layer with its weight stored as (in, out)."""
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


class KeyedDropout(nn.Module):
    """Dropout whose mask, in training, comes from a generator keyed by `key` (the run's seed and the
    layer's name, set by `key_dropouts`) and the input's bytes (see the module docstring)."""

    def __init__(self, p: float, key: str = "") -> None:
        super().__init__()
        self.p, self.key = p, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        data = x.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        digest = hashlib.sha256(self.key.encode() + b"\0" + data).digest()
        generator = torch.Generator(x.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        keep = torch.rand(x.shape, generator=generator, device=x.device) >= self.p
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, key={self.key!r}"


def key_dropouts(model: nn.Module, seed: int) -> None:
    """Key every `KeyedDropout` of a freshly built `model` by `seed` and its name in the model, which
    every copy of a part keeps."""
    for name, module in model.named_modules():
        if isinstance(module, KeyedDropout):
            module.key = f"{seed}:{name}"


class LoraLinear(nn.Module):
    """A frozen linear layer (the base's own `weight` and `bias` tensors) plus `lora_A`, `lora_B`."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, key: str = "") -> None:
        super().__init__()
        self.transposed = _is_conv1d(base)  # Conv1D: y = x W + b with W of shape (in, out)
        self.weight: nn.Parameter = base.weight  # type: ignore[assignment]
        self.bias: nn.Parameter | None = base.bias  # type: ignore[assignment]
        out_features, in_features = self.weight.shape[::-1] if self.transposed else self.weight.shape
        self.lora_A = nn.Parameter(self.weight.new_empty(rank, in_features))
        self.lora_B = nn.Parameter(self.weight.new_zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # what nn.Linear does to its weight
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.lora_dropout = KeyedDropout(dropout, key)  # key: the run's seed and the layer's name

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped layer's own computation, operation for operation (so it is bit-identical)."""
        if self.transposed:
            assert self.bias is not None  # Conv1D always has one
            out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
            return out.view(*x.shape[:-1], out.shape[-1])
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapted = self.lora_dropout(x)
        return self.base_forward(x) + F.linear(F.linear(adapted, self.lora_A), self.lora_B) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """`W + (alpha / r) B A` in the base's layout."""
        delta = (self.lora_B @ self.lora_A) * self.scaling
        return self.weight + (delta.T if self.transposed else delta)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, transposed={self.transposed}"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    targets: Sequence[str] | None = None,
    dropout: float = 0.0,
    seed: int = 0,
) -> list[str]:
    """Freeze every parameter of `model`, then wrap in place each linear layer whose name is a
    target or ends with `.target` (`c_proj` matches both of GPT-2's, `attn.c_proj` only the
    attention's). `targets=None` takes the `DEFAULT_TARGETS` the model has; `all-linear` every
    linear layer but the output layer. `dropout` applies to
    the adapters' input in training, its masks keyed by `seed` and the layer's name. Returns the
    names of the wrapped layers, in module order (the order their `lora_A` are drawn in)."""
    if rank < 1 or alpha <= 0:
        raise UserError(f"lora={rank}:{alpha}: the rank must be at least 1 and alpha positive")
    linear = [name for name, module in model.named_modules() if _is_linear(module)]
    if targets is not None and list(targets) == [ALL_LINEAR]:
        targets = [name for name in linear if not _matches(name, OUTPUT_LAYER)]
    if targets is None:
        targets = [t for t in DEFAULT_TARGETS if any(_matches(name, t) for name in linear)]
        if not targets:
            raise UserError(
                f"the model has none of the default LoRA targets {', '.join(DEFAULT_TARGETS)}; "
                f"choose with lora_targets=, from: {', '.join(_short_names(linear))}"
            )
    for target in targets:
        if not any(_matches(name, target) for name in linear):
            raise UserError(
                f"lora_targets: {target!r} names no linear layer of this model; "
                f"available: {', '.join(_short_names(linear))}"
            )
    model.requires_grad_(False)
    wrapped = [name for name in linear if any(_matches(name, t) for t in targets)]
    for name in wrapped:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(getattr(parent, child), rank, alpha, dropout, f"{seed}:{name}"))
    return wrapped


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct short names (`c_attn`) of `model`'s linear layers, adapted or not: what
    `lora_targets` may name."""
    return _short_names([name for name, m in model.named_modules() if _is_linear(m) or isinstance(m, LoraLinear)])


def _short_names(names: list[str]) -> list[str]:
    """Distinct last components of module names (`h.0.attn.c_attn` -> `c_attn`), in first-seen order."""
    return list(dict.fromkeys(name.rpartition(".")[2] for name in names))


def merge_lora(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as its base would have it: each adapted weight replaced by
    `W + (alpha / r) B A` (a new tensor), the adapters dropped, every other entry the model's own
    tensor (detached, not copied)."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            prefix = f"{name}." if name else ""
            state[prefix + "weight"] = module.merged_weight().detach()
            del state[prefix + "lora_A"], state[prefix + "lora_B"]
    return state


ADAPTERS = (".lora_A", ".lora_B")


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s adapters (`...lora_A`, `...lora_B`) under its state-dict names."""
    return {name: t.detach() for name, t in model.state_dict().items() if name.endswith(ADAPTERS)}


def load_init(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Load `init=`'s weights into a freshly built `model`: a base's (`merge_lora`'s output), whose
    adapters then keep their initial values (B = 0: the model computes what the base did), or
    adapters alone (a peft folder), over the model's own base. UserError naming `source` if they
    do not fit."""
    adapters_only = all(name.endswith(ADAPTERS) for name in state)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        why = str(error).strip().splitlines()[-1].strip()[:160]
        raise UserError(f"{source}: its model does not fit this run's ({why})") from None
    missing = [name for name in missing if name.endswith(ADAPTERS) == adapters_only]
    if adapters_only and (missing or unexpected):
        mine = sorted({name.rpartition(".")[0].rpartition(".")[2] for name in adapter_state(model)})
        theirs = sorted({name.rpartition(".")[0].rpartition(".")[2] for name in state})
        raise UserError(
            f"{source}: its adapters do not fit this run's (theirs on {', '.join(theirs)}, this run's on "
            f"{', '.join(mine)}; missing {missing[:2]}, extra {unexpected[:2]})"
        )
    if missing or unexpected:
        raise UserError(f"{source}: its model does not fit this run's (missing {missing[:3]}, extra {unexpected[:3]})")
