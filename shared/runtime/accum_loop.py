"""A step's micro-steps as one XLA While loop, traced once and reused: the host never waits for the device here.

Adapted from torch_xla's `torch_xla/experimental/gradient_accumulation.py` (pytorch/xla v2.9.0, Apache License 2.0,
Copyright the PyTorch/XLA authors; the same file in 2.8.0). What differs, and why:

- torch_xla's helper calls `xm.wait_device_ops()` (L197) and syncs the first micro-batch's slice (L176, a small graph
  whose launch waits for the device lock) on every step, then lowers the whole forward+backward to HLO again and
  rebuilds the While loop in Python: all of it with the device idle. Here the body is traced and lowered on the first
  call only; later calls with the same shapes reuse the built loop, so a step costs the host one IR node (plus the
  gradients' zeros), and the host traces step N+1 while the device still runs step N.
- The body is traced on a placeholder slice (zeros sent from the host, no graph run) instead of a synced slice of
  the real tokens (torch_xla's own TODO at L174).
- The loop's counter and loss start from traced zeros, not `torch.tensor(0, device=...)`: no host-to-device
  transfer per step.

- The body is the micro-step's forward and backward of its own loss, and the loop divides the summed loss and
  gradients by A once after it; torch_xla's divides each micro-step's loss by A before its backward. The same sums
  (exactly, where A is a power of two), but with no multiply between a gradient's all-reduce and its accumulator,
  XLA can move the gradients' all-reduces out of the loop: once a step instead of A times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch


@dataclass
class _BuiltLoop:
    computation: object  # the While loop's XLA computation
    graph_to_body: list[int | None]  # per loop input after the gradients: body input index, or None (hoisted)
    hoisted: list[torch.Tensor | None]  # device data the body reads that is no body input (constants), or None
    seed_slots: set[int]  # loop inputs that are the RNG seed: a fresh (A,) seed vector per call
    num_grads: int


class AccumulationLoop:
    """`loop(tokens)` with tokens (A, B, T+1) on the device: runs `micro_step(batch) -> loss` on each of the A
    micro-batches inside one While loop, leaves the summed gradients of loss / A in the parameters' `.grad`
    (added to any there) and returns the mean loss. Built (traced, lowered) once per token shape."""

    def __init__(self, micro_step: Callable[[torch.Tensor], torch.Tensor], params: list[torch.Tensor],
                 place_slice: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 grad_apart: Callable[[], AbstractContextManager[tuple[torch.Tensor, torch.Tensor]]] | None = None):
        """grad_apart: a context manager (the model's `embedding_grad_apart`) inside which part of a parameter's
        gradient goes to a leaf of its own, yielded as (parameter, leaf): the loop sums that part apart and adds
        it to the parameter's after the loop."""
        self.micro_step, self.place_slice, self.grad_apart = micro_step, place_slice, grad_apart
        self.params = [p for p in params if p.requires_grad]
        self.grad_targets = list(self.params)  # the parameter each accumulated gradient goes to (set at build)
        self._built: dict[tuple, _BuiltLoop] = {}
        self.builds = 0  # how many times a body was traced and lowered (1 per token shape)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        key = (tuple(tokens.shape), tokens.dtype)
        built = self._built.get(key)
        if built is None:
            built = self._built[key] = self._build(tokens)
        return self._run(built, tokens)

    def _body(self, batch: torch.Tensor) -> list[torch.Tensor]:
        """The micro-step's loss and its gradients, leaving `.grad` as it was. Unscaled: the loop divides the sums
        by A after it (below)."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        with self.grad_apart() if self.grad_apart else contextlib.nullcontext() as apart:
            loss = self.micro_step(batch)
            loss.backward()
        grads = [p.grad for p in self.params]
        self.grad_targets = list(self.params)
        if apart is not None:
            grads.append(apart[1].grad)
            self.grad_targets.append(apart[0])
        for p, grad in zip(self.params, saved, strict=True):
            p.grad = grad
        return [loss, *grads]

    def _build(self, tokens: torch.Tensor) -> _BuiltLoop:
        import torch_xla
        import torch_xla.core.xla_builder as xb

        xlac = torch_xla._XLAC
        accum, device = tokens.shape[0], tokens.device
        if any(xlac._check_tensor_need_materialization(self.params)):  # the body's inputs must be device data
            xlac._xla_sync_multi(self.params, devices=[], wait=False, sync_xla_data=False)
        placeholder = self.place_slice(torch.zeros(tokens.shape[1:], dtype=tokens.dtype).to(device))
        body_inputs = [placeholder, *self.params]
        body_result = self._body(placeholder)
        if any(xlac._check_tensor_need_materialization(body_inputs)):
            raise RuntimeError("the micro-step changed its inputs in place; the loop body must be pure")
        ids, values = xlac._get_tensors_xla_device_data_node(body_result, body_inputs)
        body = xb.computation_from_module_proto("bodycomputation", xlac._get_xla_tensors_hlo_proto(body_result))
        del body_result
        index_of = {xlac._xla_get_tensor_id(t): i for i, t in enumerate(body_inputs)}
        seed_id = xlac._get_seed_info_id()
        graph_to_body = [index_of.get(tid) for tid in ids]
        hoisted = [None if index_of.get(tid) is not None else value for tid, value in zip(ids, values, strict=True)]
        seed_slots = {i for i, tid in enumerate(ids) if tid == seed_id}
        num_grads = len(self.grad_targets)

        builder = xb.create_builder("grad_acc")
        example = self._loop_inputs(_BuiltLoop(None, graph_to_body, hoisted, seed_slots, num_grads), tokens)
        ops = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(example)]

        def dynamic_slice(xs, idx):
            sizes = list(xs.shape().sizes)
            sliced = xs.dynamic_slice([idx] + [idx.zeros_like() for _ in sizes[1:]], [1] + sizes[1:])
            return sliced.reshape(sizes[1:])

        def body_fn(it, loss, *args):
            grads, graph_inputs = list(args[:num_grads]), list(args[num_grads:])
            call_inputs = list(graph_inputs)
            for slot, body_index in enumerate(graph_to_body):
                if slot in seed_slots or body_index == 0:  # this iteration's seed, or micro-batch
                    call_inputs[slot] = dynamic_slice(graph_inputs[slot], it)
            result = xb.Op.call(body, call_inputs)
            loss = loss + result.get_tuple_element(0)
            grads = [g + result.get_tuple_element(i + 1) for i, g in enumerate(grads)]
            return (it + xb.Op.scalar(it.builder(), 1, dtype=xb.Type.S32), loss, *grads, *graph_inputs)

        def cond_fn(it, *args):
            return it < xb.Op.scalar(it.builder(), accum, dtype=xb.Type.S32)

        # The sums are divided by A after the loop, not each micro-step's loss before its backward: a multiply
        # between a gradient's all-reduce and its accumulator keeps XLA from moving the all-reduce out of the loop
        # (WhileLoopAllReduceCodeMotion sinks one only through adds), so it would run A times a step, not once.
        loop = xb.Op.mkwhile(ops, cond_fn, body_fn)
        results = [loop.get_tuple_element(i) for i in range(len(example))]
        for i in range(1, 2 + num_grads):  # the loss, then the gradients
            results[i] = results[i] * results[i].scalar_like(1.0 / accum)
        computation = xb.Op.tuple(results).build("grad_acc_loop_torch_func")
        self.builds += 1
        return _BuiltLoop(computation, graph_to_body, hoisted, seed_slots, num_grads)

    def _loop_inputs(self, built: _BuiltLoop, tokens: torch.Tensor) -> list[torch.Tensor]:
        """The loop's inputs for these tokens: counter, loss, zero gradients, then the body's inputs in its order."""
        import torch_xla

        device, accum = tokens.device, tokens.shape[0]
        grads = []
        for p in self.grad_targets:
            grad = torch.zeros_like(p)
            sharding = torch_xla._XLAC._get_xla_op_sharding(p)
            if sharding:  # the gradient laid out as its parameter (as torch_xla's helper does)
                torch_xla._XLAC._xla_mark_sharding(grad, sharding)
            grads.append(grad)
        body_inputs = [tokens, *self.params]
        inputs = []
        for slot, body_index in enumerate(built.graph_to_body):
            if slot in built.seed_slots:
                inputs.append(torch.randint(0, (1 << 63) - 1, (accum,), device=device))
            else:
                inputs.append(body_inputs[body_index] if body_index is not None else built.hoisted[slot])
        return [torch.zeros((), dtype=torch.int32, device=device), torch.zeros((), device=device), *grads, *inputs]

    def _run(self, built: _BuiltLoop, tokens: torch.Tensor) -> torch.Tensor:
        import torch_xla

        _, loss, *outputs = torch_xla._XLAC._xla_user_computation(
            "xla::_op_grad_acc_loop", self._loop_inputs(built, tokens), built.computation)
        for p, grad in zip(self.grad_targets, outputs[:built.num_grads], strict=True):
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        return loss
