"""A PyTorch module as mpipar layers: its parameters live in mpipar's flat buffers.

`torch_layers(module)` turns an `nn.Sequential` into one TorchLayer per child with
parameters, with the parameterless children after it (so the pipeline partitioner can
cut between them), and any other module into one TorchLayer.
A TorchLayer is an ordinary mpipar Layer (docs/adapters.md):

    forward   y = module(x) with each parameter swapped for a view of mpipar's buffer (what
              torch.func.functional_call does, without its generic machinery)
              under autograd, with saved-tensor hooks that keep what autograd saves
              in the micro-batch's Context (so the activation cache counts it)
    backward  (dx, grads) = torch.autograd.grad(y, (x, params), dy); grads are added
              into mpipar's gradient views. An nn.Linear's weight and bias gradients are
              not asked of autograd: it gives the gradient at the Linear's output, g, and
              the adapter writes g^T a (a: the Linear's input) and g summed over rows
              straight into the views (torch.mm with out=, or addmm_), where autograd
              would first make a fresh tensor the size of the weight

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
from mpipar.layers.losses import Loss

torch = import_framework("torch")
# Autograd imports torch.fx and sympy the first time it is handed an output gradient, as
# every backward here is (about 33 MB of Python objects). One such call now puts them with
# torch's own imports, before a run's memory baseline.
_unit = torch.ones(1, requires_grad=True)
torch.autograd.grad(_unit * 1, _unit, torch.ones(1))
del _unit


def to_torch(array: Array):
    """`array` as a torch tensor sharing its memory (read-only arrays, such as a data set's, are
    copied). NumPy's go through torch.from_numpy, a few times cheaper than DLPack's capsule,
    which matters at some thirty calls a step."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array if array.flags.writeable else array.copy())
    return torch.from_dlpack(array)


def from_torch(tensor, like: Array) -> Array:
    """`tensor` as an array of `like`'s module (NumPy or CuPy), sharing its memory."""
    if isinstance(like, np.ndarray):
        return tensor.detach().numpy()
    return array_module(like).from_dlpack(tensor.detach())


_EMPTY: dict = {}  # (dtype, device) -> one empty tensor, which any number of tensors may point at


def _empty_like(tensor):
    """An empty tensor to point `tensor` at, on its device: a graph leaf moved to another device
    is no longer the tensor autograd was asked about, and gets no gradient (seen on CUDA)."""
    key = (tensor.dtype, tensor.device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return _EMPTY[key]


def _storage(tensor) -> int:
    """Where `tensor`'s storage starts (what untyped_storage().data_ptr() gives, without making
    a storage object)."""
    return tensor.data_ptr() - tensor.storage_offset() * tensor.element_size()


@dataclass
class _DirectLinear:
    """An nn.Linear called once in a forward, whose weight and bias gradients the adapter
    writes itself from `output`'s gradient and the Linear's input."""

    weight: str  # mpipar's names of its parameters (bias: None without one)
    bias: str | None
    output: object  # the Linear's output tensor, a node of the graph (its storage may be let go)
    input: object  # its input tensor, or a packed reference (see forward's pack) into the layer's input


@dataclass
class _Saved:
    """One micro-batch's forward, kept in its Context until backward."""

    output: object  # the output tensor, the root of the graph
    wants_input: bool  # the input's gradient is asked for (it is leaves[0])
    leaves: list  # the tensors gradients are asked for: the input, then `parameters`, then each direct Linear's output
    parameters: list  # names of the parameters whose gradients autograd gives
    direct: list  # the _DirectLinear's
    input: Array  # the forward's input array, which packed references to it read
    tensors: list = field(default_factory=list)  # what autograd saved that is neither input nor parameter
    group: list | None = None  # the _Saved's of a chain's layers in this micro-batch, bottom up (TorchChain)
    gradients: list | None = None  # the gradients of `leaves`, when the chain's top layer has taken them

    def keep_gradients(self, gradients: list) -> None:
        """The gradients of `leaves`, which the chain's top layer took for every layer of it."""
        self.gradients = gradients

    def let_go(self) -> None:
        """Hold the graph no more (backward is over)."""
        self.output, self.leaves, self.direct, self.tensors = None, [], [], []
        self.group = self.gradients = None


class TorchChain:
    """Consecutive TorchLayers of a stage whose micro-batch forms one autograd graph, as in
    torch alone: a layer's input is the tensor the layer below returned, and one
    `torch.autograd.grad` from the top (the top layer's output, or a TorchLoss on it)
    takes every gradient of the chain; each layer then writes its own from it in its own
    backward. One call instead of one per layer saves about 0.1 ms each in a step. The
    trainer chains layers only where nothing happens between two layers of a step: one
    process, no sharding units, no recomputation, no split backward."""

    def __init__(self) -> None:
        self.last: dict = {}  # Context key -> (output array, _Saved) of the chain's last forward

    def take_gradients(self, top: _Saved, root, root_gradient, first: tuple = ()) -> list:
        """One autograd call from `root` for `first` and every leaf of the chain that ends
        with `top` (kept in each layer's _Saved); returns the gradients of `first`."""
        leaves = [leaf for member in top.group for leaf in member.leaves]
        gradients = torch.autograd.grad(root, [*first, *leaves], root_gradient, allow_unused=True)
        start = len(first)
        for member in top.group:
            member.keep_gradients(list(gradients[start:start + len(member.leaves)]))
            start += len(member.leaves)
        return list(gradients[:len(first)])


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
        self.chain: TorchChain | None = None  # see join_chain
        self._initial = {name: parameter.detach() for name, parameter in module.named_parameters()}
        self._specs = [ParamSpec(name, tuple(parameter.shape), self._initial_stream(name), parameter.ndim > 1)
                       for name, parameter in module.named_parameters()]
        # where each parameter sits: (submodule, attribute, mpipar's name)
        self._slots = [(module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], name)
                       for name, _ in module.named_parameters()]
        # The Linears whose gradients the adapter writes: plain nn.Linear (a subclass may compute
        # otherwise). Their hooks note each call while a training forward runs.
        self._linear_calls: list | None = None
        for prefix, child in module.named_modules():
            if type(child) is torch.nn.Linear:
                names = (f"{prefix}.weight" if prefix else "weight",
                         (f"{prefix}.bias" if prefix else "bias") if child.bias is not None else None)
                child.register_forward_hook(self._noting(names))

    def _noting(self, names: tuple[str, str | None]):
        def note(module, inputs, output) -> None:
            if self._linear_calls is not None:
                self._linear_calls.append((names, inputs[0], output))
        return note

    def _call(self, params: dict, x):
        """The module on `x`, its parameters swapped for `params` for the call."""
        originals = [submodule._parameters[attribute] for submodule, attribute, _ in self._slots]
        try:
            for submodule, attribute, name in self._slots:
                submodule._parameters[attribute] = params[name]
            return self.module(x)
        finally:
            for (submodule, attribute, _), original in zip(self._slots, originals):
                submodule._parameters[attribute] = original

    def join_chain(self, chain: TorchChain) -> None:
        """Form one autograd graph per micro-batch with the other layers of `chain` (TorchChain: the
        trainer chains a stage's torch layers where nothing happens between two of them)."""
        self.chain = chain

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
        below = self.chain.last.get(ctx.key) if self.chain is not None and ctx.training else None
        chained = below is not None and below[0] is x  # x is what the chain's layer below returned
        x_tensor = below[1].output if chained else to_torch(x)
        if self.module.training != ctx.training:
            self.module.train(ctx.training)
        if not ctx.training:
            with torch.no_grad():
                return from_torch(self._call(params, x_tensor), like=x)
        for tensor in params.values():
            tensor.requires_grad_(True)
        wants_input = chained or (self.needs_input_grad and x_tensor.is_floating_point())
        if not chained:
            x_tensor.requires_grad_(wants_input)
        saved = _Saved(None, wants_input, [], [], [], x)
        by_storage = {_storage(tensor): name for name, tensor in params.items()}
        input_storage = _storage(x_tensor)

        def reference(tensor):
            """A tensor in a parameter's or the input's storage as (kind, name, shape, stride, offset)."""
            storage = _storage(tensor)
            where = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
            if storage in by_storage:
                return ("parameter", by_storage[storage], *where)
            return ("input", None, *where) if storage == input_storage else None

        def pack(tensor):
            packed = reference(tensor)
            if packed is None:
                saved.tensors.append(tensor)
                packed = ("tensor", len(saved.tensors) - 1)
            return packed

        calls = self._linear_calls = []  # (Linear's names, input, output) of every call of a Linear
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, self._unpack(saved)):
                saved.output = self._call(params, x_tensor)
        finally:
            self._linear_calls = None
        once = [call for call in calls if [names for names, _, _ in calls].count(call[0]) == 1]
        saved.direct = [_DirectLinear(weight, bias, output, reference(a) or a) for (weight, bias), a, output in once]
        direct_names = {name for linear in saved.direct for name in (linear.weight, linear.bias)}
        saved.parameters = [name for name in params if name not in direct_names]
        saved.leaves = [x_tensor] * wants_input + [params[name] for name in saved.parameters]
        # the graph keeps its leaves: let go of the buffers behind them
        for leaf in [x_tensor] * (wants_input and not chained) + list(params.values()):
            leaf.data = _empty_like(leaf)
        y = from_torch(saved.output, like=x)
        output_storage = _storage(saved.output)
        kept_storages = {_storage(tensor) for tensor in saved.tensors} | {output_storage}
        for linear in saved.direct:  # only its place in the graph is needed, unless something else keeps it
            if _storage(linear.output) not in kept_storages:
                linear.output.data = _empty_like(linear.output)
            saved.leaves.append(linear.output)
        # The cache counts what autograd saved, each buffer once: the output as the array
        # returned (the next layer may keep the same array), the rest as themselves.
        kept = {output_storage: y} if any(_storage(t) == output_storage for t in saved.tensors) else {}
        for tensor in saved.tensors:
            kept.setdefault(_storage(tensor), from_torch(tensor, like=x))
        ctx.save(self, saved, x, *kept.values())
        if self.chain is not None:
            saved.group = below[1].group + [saved] if chained else [saved]
            self.chain.last[ctx.key] = (y, saved)
        return y

    def _unpack(self, saved: _Saved):
        def unpack(packed):
            if packed[0] == "tensor":
                return saved.tensors[packed[1]]
            kind, name, shape, stride, offset = packed
            base = to_torch(self.params[name] if kind == "parameter" else saved.input)
            return base.as_strided(shape, stride, offset)
        return unpack

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        saved = ctx.pop(self)[0]
        if self.chain is not None:  # the micro-batch's forward is over: hold nothing for it
            self.chain.last.pop(ctx.key, None)
        if saved.gradients is None and saved.group is not None and len(saved.group) > 1:
            if saved.group[-1] is not saved:
                raise RuntimeError(f"{self.name}: backward of a chain began below its top layer")
            self.chain.take_gradients(saved, saved.output, to_torch(dy))
        if not saved.leaves:  # no parameters, and no one below wants an input gradient
            return None
        gradients = saved.gradients if saved.gradients is not None else list(
            torch.autograd.grad(saved.output, saved.leaves, to_torch(dy), allow_unused=True))
        input_gradient = gradients.pop(0) if saved.wants_input else None
        # torch's in-place ops run on its intra-op threads, NumPy's on one
        for name, gradient in zip(saved.parameters, gradients):
            target = to_torch(self.grads[name])
            if gradient is None:
                if self.fresh_grads:
                    target.zero_()
            elif self.fresh_grads:
                target.copy_(gradient)
            else:
                target.add_(gradient)
        unpack = self._unpack(saved)
        for linear, gradient in zip(saved.direct, gradients[len(saved.parameters):]):
            self._linear_gradients(linear, gradient, unpack)
        # A Linear whose gradient was taken at its output never ran its own backward node, which
        # still holds its saved tensors' hooks, which hold `saved`, which holds tensors whose
        # graph leads back to that node: a cycle through C++ that Python cannot collect.
        # Letting go of the graph here breaks it.
        saved.let_go()
        return None if input_gradient is None else from_torch(input_gradient, like=dy)

    def _linear_gradients(self, linear: _DirectLinear, output_gradient, unpack) -> None:
        """A Linear's dW = g^T a and db = sum of g's rows, written into (or added to) mpipar's views."""
        weight = to_torch(self.grads[linear.weight])
        bias = to_torch(self.grads[linear.bias]) if linear.bias else None
        if output_gradient is None:  # the Linear's output did not reach the loss
            if self.fresh_grads:
                weight.zero_()
                if bias is not None:
                    bias.zero_()
            return
        g = output_gradient.reshape(-1, weight.shape[0])
        # an input made inside the module (another Linear's activation) is a node of the graph
        a = (unpack(linear.input) if isinstance(linear.input, tuple) else linear.input.detach()).reshape(
            -1, weight.shape[1])
        if self.fresh_grads:
            torch.mm(g.t(), a, out=weight)
        else:
            weight.addmm_(g.t(), a)
        if bias is not None:
            if self.fresh_grads:
                torch.sum(g, dim=0, out=bias)
            else:
                bias.add_(g.sum(dim=0))


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


class TorchLoss(Loss):
    """A torch loss `fn(output, target) -> the mean over the batch` as an mpipar loss: scaled by the
    micro-batch's share of the global batch, so micro-batch gradients add up to the mean's."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.name = f"torch {getattr(fn, '__name__', type(fn).__name__)}"
        self._shares: dict = {}  # (share, dtype, device) -> the share as a 0-d tensor, the loss's output gradient
        self.chain: TorchChain | None = None  # the last stage's, where the trainer chains its layers

    def join_chain(self, chain: TorchChain) -> None:
        """Take the loss's gradient and that of `chain`'s layers (the last stage's) in one autograd call."""
        self.chain = chain

    def forward(self, logits: Array, targets: Array, ctx: Context, global_batch: int) -> Array:
        rows = logits.shape[0]
        if not ctx.training:
            with torch.no_grad():
                return float(self.fn(to_torch(logits), to_torch(targets))) * rows / global_batch
        below = self.chain.last.get(ctx.key) if self.chain is not None else None
        top = below[1] if below is not None and below[0] is logits else None  # the logits are the chain's top
        logits_tensor = top.output if top is not None else to_torch(logits).requires_grad_(True)
        share = rows / global_batch
        with torch.enable_grad():
            loss = self.fn(logits_tensor, to_torch(targets))
        # the share enters as the output gradient: one graph node fewer than multiplying the loss
        key = (share, loss.dtype, loss.device)
        if key not in self._shares:
            self._shares[key] = torch.full((), share, dtype=loss.dtype, device=loss.device)
        if top is not None:  # backward takes the loss's gradient and the chain's in one call
            ctx.save(self, (loss, self._shares[key], top), logits)
        else:
            (gradient,) = torch.autograd.grad(loss, logits_tensor, self._shares[key])
            ctx.save(self, gradient, logits)
        return loss.item() * share

    def backward(self, ctx: Context) -> Array:
        gradient, logits = ctx.pop(self)
        if isinstance(gradient, tuple):
            loss, share, top = gradient
            (gradient,) = self.chain.take_gradients(top, loss, share, first=(top.output,))
        return from_torch(gradient, like=logits)
