"""A PyTorch module as mpipar layers: its parameters live in mpipar's flat buffers.

`torch_layers(module)` turns an `nn.Sequential` into one TorchLayer per child with
parameters, with the parameterless children after it (so the pipeline partitioner can
cut between them), and any other module into one TorchLayer.
A TorchLayer is an ordinary mpipar Layer (docs/adapters.md):

    forward   y = functional_call(module, {name: view of mpipar's buffer}, x)
              under autograd, with saved-tensor hooks that keep what autograd saves
              in the micro-batch's Context (so the activation cache counts it)
    backward  (dx, grads) = torch.autograd.grad(y, (x, params), dy); grads are added
              into mpipar's gradient views

The parameters are never copied: every forward wraps the views mpipar has bound at that
moment with `torch.from_dlpack`, so sharded schemes that gather a unit, use it and
release it work unchanged. Autograd's graph would keep the forward's parameter
buffers alive until backward (a whole ZeRO-3 model). It does not, for two reasons.
The saved-tensor hooks record a parameter as a *reference* (name, size, stride), and
backward reads the views bound then. After forward the graph's leaf tensors are pointed
at empty storage. The same holds for the input, which the cache already keeps.

After the engine is built, the module's own parameters are views of mpipar's buffer
where this rank holds them whole (so `module(x)` uses the trained weights), and empty
where the rank holds a shard. Refused, each with its reason: modules with buffers (batch-norm statistics would
differ per rank), and parameters shared between children (tied weights need one
owner).

Exercised by: python -m pytest tests/test_adapters.py -k torch
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mpipar.adapters.framework import import_framework, initial_stream
from mpipar.backend import Array, array_module
from mpipar.cache import Context
from mpipar.errors import ConfigError
from mpipar.layers.base import Init, Layer, ParamSpec

torch = import_framework("torch")
# Autograd imports torch.fx and sympy the first time it is handed an output gradient, as
# every backward here is (about 33 MB of Python objects). One such call now puts them with
# torch's own imports, before a run's memory baseline.
_unit = torch.ones(1, requires_grad=True)
torch.autograd.grad(_unit * 1, _unit, torch.ones(1))
del _unit


def to_torch(array: Array):
    """`array` as a torch tensor sharing its memory (read-only arrays, such as a data set's, are copied)."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        return torch.from_numpy(array.copy())
    return torch.from_dlpack(array)


def from_torch(tensor, like: Array) -> Array:
    """`tensor` as an array of `like`'s module (NumPy or CuPy), sharing its memory."""
    return array_module(like).from_dlpack(tensor.detach())


def _storage(tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@dataclass
class _Saved:
    """One micro-batch's forward, kept in its Context until backward."""

    output: object  # the output tensor, the root of the graph
    leaves: list  # the tensors gradients are asked for: the input (if it needs one), then the parameters
    input: Array  # the forward's input array, which packed references to it read
    tensors: list = field(default_factory=list)  # what autograd saved that is neither input nor parameter


class TorchLayer(Layer):
    """One torch module; its parameters are mpipar parameters of the same names and shapes."""

    def __init__(self, module) -> None:
        super().__init__()
        buffers = [name for name, _ in module.named_buffers()]
        if buffers:
            raise ConfigError(f"torch module {type(module).__name__} has buffers {buffers[:3]} (batch-norm running "
                              "statistics, say), which each rank would update from its own samples; use a norm "
                              "without them (GroupNorm, LayerNorm, or BatchNorm with track_running_stats=False)")
        self.module = module
        self.name = f"torch {type(module).__name__}"
        self.needs_input_grad = True
        self._initial = {name: parameter.detach() for name, parameter in module.named_parameters()}
        self._specs = [ParamSpec(name, tuple(parameter.shape), self._initial_stream(name), parameter.ndim > 1)
                       for name, parameter in module.named_parameters()]
        self._call = torch.func.functional_call

    def param_specs(self) -> list[ParamSpec]:
        return self._specs

    def _initial_stream(self, name: str) -> Init:
        return initial_stream(self.name, lambda: None if self._initial is None else self._initial[name].reshape(-1))

    def release_initial(self) -> None:
        """Free the module's own parameter storage. Where this rank holds the whole parameter
        (DDP, ZeRO-1/2) the module's parameters become views of mpipar's buffer, so the module
        itself sees every update; elsewhere they are empty (read the model with
        Trainer.full_parameters)."""
        self._initial = None
        for name, parameter in self.module.named_parameters():
            view = self.params.get(name)
            parameter.data = to_torch(view) if view is not None else torch.empty(0, dtype=parameter.dtype)

    def _probe(self, in_shape: tuple[int, ...]):
        """A zero sample of `in_shape` where the module's parameters are, in their dtype."""
        first = next(self.module.parameters(), None)
        return torch.zeros((1, *in_shape), dtype=first.dtype if first is not None else torch.get_default_dtype(),
                           device=first.device if first is not None else "cpu")

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        with torch.no_grad():
            return tuple(self.module(self._probe(in_shape)).shape[1:])

    def flops(self, in_shape: tuple[int, ...]) -> int:
        """Multiply-adds per sample for the pipeline partitioner: a Linear's or a convolution's
        output elements times the inputs each one reads, every other leaf module's output
        elements. Counted by forward hooks on one probe sample: torch's FlopCounterMode would
        also see matmuls written inline, but it imports torch._dynamo (some 70 MB of Python
        objects in every rank)."""
        total = 0

        def count(module, inputs, output) -> None:
            nonlocal total
            if isinstance(module, torch.nn.Linear):
                total += output.numel() * module.in_features
            elif isinstance(module, torch.nn.modules.conv._ConvNd):
                total += output.numel() * module.in_channels // module.groups * math.prod(module.kernel_size)
            elif isinstance(output, torch.Tensor):
                total += output.numel()
        leaves = [module for module in self.module.modules() if not list(module.children())]
        hooks = [module.register_forward_hook(count) for module in leaves]
        try:
            with torch.no_grad():
                out = self.module(self._probe(in_shape))
        finally:
            for hook in hooks:
                hook.remove()
        return max(total, math.prod(out.shape[1:]))

    def forward(self, x: Array, ctx: Context) -> Array:
        params = {name: to_torch(view) for name, view in self.params.items()}
        x_tensor = to_torch(x)
        if self.module.training != ctx.training:
            self.module.train(ctx.training)
        if not ctx.training:
            with torch.no_grad():
                return from_torch(self._call(self.module, params, (x_tensor,)), like=x)
        for tensor in params.values():
            tensor.requires_grad_(True)
        wants_input = self.needs_input_grad and x_tensor.is_floating_point()
        x_tensor.requires_grad_(wants_input)
        saved = _Saved(None, ([x_tensor] if wants_input else []) + list(params.values()), x)
        by_storage = {_storage(tensor): name for name, tensor in params.items()}
        input_storage = _storage(x_tensor)

        def pack(tensor):
            storage = _storage(tensor)
            where = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
            if storage in by_storage:
                return ("parameter", by_storage[storage], *where)
            if storage == input_storage:
                return ("input", None, *where)
            saved.tensors.append(tensor)
            return ("tensor", len(saved.tensors) - 1)

        def unpack(packed):
            if packed[0] == "tensor":
                return saved.tensors[packed[1]]
            kind, name, shape, stride, offset = packed
            base = to_torch(self.params[name] if kind == "parameter" else saved.input)
            return base.as_strided(shape, stride, offset)

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            saved.output = self._call(self.module, params, (x_tensor,))
        for leaf in saved.leaves:  # the graph keeps its leaves: let go of the buffers behind them
            leaf.data = torch.empty(0, dtype=leaf.dtype)
        y = from_torch(saved.output, like=x)
        output_storage = _storage(saved.output)
        # The cache counts what autograd saved, each buffer once: the output as the array
        # returned (the next layer may keep the same array), the rest as themselves.
        kept = {output_storage: y} if any(_storage(t) == output_storage for t in saved.tensors) else {}
        for tensor in saved.tensors:
            kept.setdefault(_storage(tensor), from_torch(tensor, like=x))
        ctx.save(self, saved, x, *kept.values())
        return y

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        saved = ctx.pop(self)[0]
        if not saved.leaves:  # no parameters, and no one below wants an input gradient
            return None
        gradients = torch.autograd.grad(saved.output, saved.leaves, to_torch(dy), allow_unused=True)
        input_gradient = gradients[0] if len(saved.leaves) > len(self.params) else None
        # torch's in-place ops run on its intra-op threads, NumPy's on one
        for name, gradient in zip(self.params, gradients[len(gradients) - len(self.params):]):
            target = to_torch(self.grads[name])
            if gradient is None:
                if self.fresh_grads:
                    target.zero_()
            elif self.fresh_grads:
                target.copy_(gradient)
            else:
                target.add_(gradient)
        return None if input_gradient is None else from_torch(input_gradient, like=dy)


def torch_layers(module) -> list[Layer]:
    """An nn.Sequential as one TorchLayer per child with parameters, together with the children
    without any that follow it (activations, pooling: one autograd call fewer each); any other
    module as one TorchLayer."""
    if not isinstance(module, torch.nn.Sequential):
        return [TorchLayer(module)]
    owners: dict[int, int] = {}
    groups, leading = [], []
    for position, child in enumerate(module.children()):
        parameters = list(child.parameters())
        for parameter in parameters:
            if owners.setdefault(id(parameter), position) != position:
                raise ConfigError(f"torch children {owners[id(parameter)]} and {position} share a parameter "
                                  "(tied weights); wrap them in one module so that one layer owns it")
        if parameters:
            groups.append(leading + [child])
            leading = []
        elif groups:
            groups[-1].append(child)
        else:
            leading.append(child)
    if leading:
        groups.append(leading)
    return [TorchLayer(group[0] if len(group) == 1 else torch.nn.Sequential(*group)) for group in groups]


class TorchLoss:
    """A torch loss `fn(output, target) -> the mean over the batch` as an mpipar loss: scaled by the
    micro-batch's share of the global batch, so micro-batch gradients add up to the mean's."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.name = f"torch {getattr(fn, '__name__', type(fn).__name__)}"

    def forward(self, logits: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        rows = logits.shape[0]
        if not ctx.training:
            with torch.no_grad():
                return float(self.fn(to_torch(logits), to_torch(targets))) * rows / global_batch
        logits_tensor = to_torch(logits).requires_grad_(True)
        with torch.enable_grad():
            loss = self.fn(logits_tensor, to_torch(targets)) * (rows / global_batch)
        (gradient,) = torch.autograd.grad(loss, logits_tensor)
        ctx.save(self, gradient, logits)
        return float(loss.detach())

    def backward(self, ctx: Context) -> Array:
        gradient, logits = ctx.pop(self)
        return from_torch(gradient, like=logits)
