"""U-shaped splits (`cut=A,B`, docs/configurations.md), in one place: the client keeps the stages
from B on (its tail) and the labels; the server holds only the stages between the cuts.

An algorithm opts in (`Algorithm.supports_u_shape`) with roles built on these: `UShapedClient`
keeps a step's labels back when it releases smashed data, takes the loss on the server's output
with its tail (`tail_step`) and steps head and tail together on `backward`; `UShapedServer`
returns its output at B (`forward_middle`) and steps on the gradient there (`backward_middle`).
With a single cut they behave as the plain roles. Algorithms whose server steps another way
(SGLR's lockstep, CycleSL's server task) add their own verbs on these roles.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from splitlab.loss_scale import outgoing, scaled, unscaled
from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import decode
from splitlab.roles import ClientNode, ParamsT, State, TrainingServer
from splitlab.transport import KEYED, verb


class UShapedClient(ClientNode[ParamsT]):
    """A client node that can hold a tail: in a U-shaped run its labels never leave it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: by step, the labels awaiting the server's output, then the tail's gradients
        self.tail_stash: dict[int, Any] = {}

    def release(
        self, x: torch.Tensor, y: torch.Tensor, smashed: torch.Tensor, step: int | None = None
    ) -> tuple[torch.Tensor, State]:
        """U-shaped, the labels stay: they wait (by step) for the server's output at the second cut."""
        defended, message = super().release(x, y, smashed, step)
        if self.blueprint.config.tail_cut is not None and step is not None:
            self.tail_stash[step] = message.pop("labels")
        return defended, message

    def server_output(self, output: Any, rows: int, what: str) -> torch.Tensor:
        """The server's output at the second cut, checked to be a batch of `rows` (`what` says of
        what, in the refusal), as the input of the tail's gradient."""
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or len(output) != rows:
            raise ValueError(f"the server's output {what}")
        return output.detach().requires_grad_()

    @verb(down="server_output", up=KEYED, keys=("tail_grad", "loss"))
    def tail_step(self, step: int, output: torch.Tensor) -> State:
        """The tail on the server's output at the second cut for the batch of `step`, the loss on
        the labels that never left; the gradient at that cut goes back up, the tail's own
        gradients wait for the head's (`backward`: one optimizer step for the whole client part)."""
        y = self.tail_stash.pop(step)
        output = self.server_output(output, len(y), f"for step {step} is not a batch of {len(y)} samples")
        model = cast(HeadAndTail, self.model("client_model"))
        with self.blueprint.timed("client"):
            value = self.blueprint.loss(model.tail(output), y)
            tail = model.tail_parameters()
            seed = value if self.loss_scale is None else self.loss_scale.seed(value, None)[0]
            grad, *tail_grads = torch.autograd.grad(seed, [output, *tail])
        self.tail_stash[step] = list(zip(tail, tail_grads))
        if self.loss_scale is None:
            tail_grad: Any = grad
        else:  # fp16: scaled, with the client's scale; an overflow here skips the step on both sides
            self.loss_scale.crossing([grad, *tail_grads])
            tail_grad = scaled(outgoing(grad, self.loss_scale), self.loss_scale.used, grad.device)
        if self.blueprint.recorder is not None:  # the gradient as the server reads it (fp16: unscaled)
            received = grad if self.loss_scale is None else unscaled(tail_grad)
            if received is not None:
                self.blueprint.recorder.received_tail(self.id, step, received)
        return {"tail_grad": tail_grad, "loss": value.detach()}

    def backpropagate(self, step: int, *pairs: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """With the tail's gradients of the step, if it took one (a weight the head shares, as GPT's
        tied embedding, adds both)."""
        super().backpropagate(step, *pairs)
        for parameter, tail_grad in self.tail_stash.pop(step, []):
            parameter.grad = tail_grad if parameter.grad is None else parameter.grad + tail_grad

    @verb()
    def end_round(self) -> None:
        self.tail_stash.clear()  # a step whose server reply never came (its data was refused)
        super().end_round()


class UShapedServer(TrainingServer[ParamsT]):
    """A training server that can hold only the middle of the model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: by slot, the smashed data and the output of the step awaiting the gradient at cut B
        self._middle: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @verb()
    def forward_middle(self, smashed: Any, slot: str = "server_model") -> torch.Tensor:
        """The server's stages on received smashed data: their output at the second cut, for the
        client's tail; the step waits for the gradient there (`backward_middle`)."""
        smashed = decode(smashed).requires_grad_()
        with self.blueprint.timed("server"):
            output = self.model(slot)(smashed)
        self._middle[slot] = smashed, output
        return output.detach()

    @verb()
    def backward_middle(self, tail_grad: Any, slot: str = "server_model") -> State:
        """Step `slot` on the client's gradient at the second cut; the cut gradient at the first,
        compressed as configured, goes back (checked finite first, as every server step). fp16:
        the gradient comes scaled with the client's scale; scale 0 (the client's tail overflowed)
        skips the step, and zeros with scale 0 go back."""
        smashed, output = self._middle.pop(slot)
        grad = tail_grad if self.loss_scale is None else unscaled(tail_grad)
        if grad is None and self.loss_scale is not None:
            self.loss_scale.skip()
            return {"cut_grad": self.send_gradient(torch.zeros_like(smashed))}
        with self.blueprint.timed("server"):
            self.step(slot, lambda: self.backward_pass((output, grad)), (smashed,))
        return {"cut_grad": self.send_gradient(cast(torch.Tensor, smashed.grad)), **self.held_norm(slot)}

    @verb()
    def end_round(self) -> None:
        self._middle.clear()  # a U-shaped step whose client dropped out before its tail replied
        super().end_round()
