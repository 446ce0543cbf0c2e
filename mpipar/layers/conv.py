"""Conv2d (as im2col + one matmul) and MaxPool2d, on (N, C, H, W) arrays.

im2col copies every k x k patch of the padded input into a row, so the convolution
becomes one matrix product with the flattened kernels:

    cols[(c, i, j), (n, oh, ow)] = xpad[n, c, oh*s + i, ow*s + j]
    y = W cols + b                       (W: out_channels x (c, i, j))
    backward  dW += dy cols^T    db += sum dy    dcols = W^T dy
              dx = col2im(dcols): each patch's gradient added back where it came from

Both directions loop over the k*k kernel offsets (a handful of whole-array slices),
never over pixels. MaxPool2d keeps the argmax of each window and routes dy there.

Exercised by: python -m pytest tests/test_layers.py -k "Conv2d or MaxPool2d"
"""

from __future__ import annotations

import math

import numpy as np

from mpipar.backend import Array, array_module, matmul
from mpipar.cache import Context
from mpipar.layers.base import Layer, ParamSpec, uniform_init
from mpipar.layers.declared import Buffer, ShapeContext


def _out_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


class Conv2d(Layer):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, padding: int = 0) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel, self.stride, self.padding = kernel_size, stride, padding
        self.name = f"Conv2d({in_channels}->{out_channels}, k={kernel_size}, s={stride}, p={padding})"
        self.needs_input_grad = True

    def param_specs(self) -> list[ParamSpec]:
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel**2)
        return [ParamSpec("weight", (self.out_channels, self.in_channels, self.kernel, self.kernel),
                          uniform_init(bound), True),
                ParamSpec("bias", (self.out_channels,), uniform_init(bound), False)]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 3 or in_shape[0] != self.in_channels:
            raise self.shape_error(f"({self.in_channels}, H, W)", in_shape)
        oh = _out_size(in_shape[1], self.kernel, self.stride, self.padding)
        ow = _out_size(in_shape[2], self.kernel, self.stride, self.padding)
        if oh < 1 or ow < 1:
            raise self.shape_error(f"({self.in_channels}, H, W) with H, W >= {self.kernel - 2 * self.padding}",
                                   in_shape)
        return (self.out_channels, oh, ow)

    def flops(self, in_shape: tuple[int, ...]) -> int:
        _, oh, ow = self.output_shape(in_shape)
        return oh * ow * self.out_channels * self.in_channels * self.kernel**2

    def workspace(self, in_shape: tuple[int, ...]) -> int:
        """The padded input, and the gradient of cols (its backward's W^T dy), as large as cols."""
        c, h, w = in_shape
        _, oh, ow = self.output_shape(in_shape)
        return c * self.kernel**2 * oh * ow + c * (h + 2 * self.padding) * (w + 2 * self.padding)

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise self.shape_error(f"(batch, {self.in_channels}, H, W)", x.shape)
        xp = array_module(x)
        n, c, h, w = x.shape
        k, s, p = self.kernel, self.stride, self.padding
        oh, ow = _out_size(h, k, s, p), _out_size(w, k, s, p)
        # Channels first, (c, n, h, w), so every kernel offset below copies one
        # contiguous (n, oh, ow) block per channel into cols[(c, i, j), (n, oh, ow)].
        padded = xp.pad(x.transpose(1, 0, 2, 3), ((0, 0), (0, 0), (p, p), (p, p)))
        cols = xp.empty((c, k, k, n, oh, ow), dtype=x.dtype)
        for i in range(k):
            for j in range(k):
                cols[:, i, j] = padded[:, :, i:i + s * oh:s, j:j + s * ow:s]
        cols = cols.reshape(c * k * k, n * oh * ow)
        ctx.save(self, cols, x.shape)
        out = matmul(self.params["weight"].reshape(self.out_channels, -1), cols)
        out += self.params["bias"][:, None]
        return xp.ascontiguousarray(out.reshape(self.out_channels, n, oh, ow).transpose(1, 0, 2, 3))

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        n, c, _, _ = x.shape
        _, oh, ow = self.output_shape(x.shape[1:])
        ctx.save(self, x.fresh((c * self.kernel**2, n * oh * ow)))  # cols
        return x.fresh((n, self.out_channels, oh, ow))

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        cols, (n, c, h, w) = ctx.pop(self)
        xp = array_module(dy)
        k, s, p = self.kernel, self.stride, self.padding
        oh, ow = dy.shape[2], dy.shape[3]
        dy_cols = dy.transpose(1, 0, 2, 3).reshape(self.out_channels, -1)
        self.grad_matmul(self.grads["weight"].reshape(self.out_channels, -1), dy_cols, cols.T)
        self.grad_sum(self.grads["bias"], dy_cols, axis=1)
        if not self.needs_input_grad:
            return None
        dcols = matmul(self.params["weight"].reshape(self.out_channels, -1).T, dy_cols).reshape(c, k, k, n, oh, ow)
        dpadded = xp.zeros((c, n, h + 2 * p, w + 2 * p), dtype=dy.dtype)  # channels first, as in forward
        for i in range(k):
            for j in range(k):
                dpadded[:, :, i:i + s * oh:s, j:j + s * ow:s] += dcols[:, i, j]
        return xp.ascontiguousarray(dpadded[:, :, p:p + h, p:p + w].transpose(1, 0, 2, 3))


class MaxPool2d(Layer):
    def __init__(self, kernel_size: int, stride: int | None = None) -> None:
        super().__init__()
        self.kernel = kernel_size
        self.stride = kernel_size if stride is None else stride
        self.name = f"MaxPool2d(k={self.kernel}, s={self.stride})"

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 3 or min(in_shape[1:]) < self.kernel:
            raise self.shape_error(f"(C, H, W) with H, W >= {self.kernel}", in_shape)
        c, h, w = in_shape
        return (c, _out_size(h, self.kernel, self.stride, 0), _out_size(w, self.kernel, self.stride, 0))

    def workspace(self, in_shape: tuple[int, ...]) -> int:
        """Its forward's windows: every k x k window of every output position."""
        c, oh, ow = self.output_shape(in_shape)
        return c * oh * ow * self.kernel**2

    def forward(self, x: Array, ctx: Context) -> Array:
        if x.ndim != 4:
            raise self.shape_error("(batch, C, H, W)", x.shape)
        xp = array_module(x)
        n, c, h, w = x.shape
        k, s = self.kernel, self.stride
        oh, ow = _out_size(h, k, s, 0), _out_size(w, k, s, 0)
        windows = xp.empty((n, c, oh, ow, k * k), dtype=x.dtype)
        for i in range(k):
            for j in range(k):
                windows[..., i * k + j] = x[:, :, i:i + s * oh:s, j:j + s * ow:s]
        winner = windows.argmax(axis=-1)
        ctx.save(self, winner, x.shape)
        return xp.take_along_axis(windows, winner[..., None], axis=-1)[..., 0]

    def forward_shapes(self, x: Buffer, ctx: ShapeContext) -> Buffer:
        out = (x.shape[0], *self.output_shape(x.shape[1:]))
        ctx.save(self, x.fresh(out, np.intp))  # the winner of each window, an argmax
        return x.fresh(out)

    def backward(self, dy: Array, ctx: Context) -> Array | None:
        winner, shape = ctx.pop(self)
        xp = array_module(dy)
        k, s = self.kernel, self.stride
        oh, ow = dy.shape[2], dy.shape[3]
        dx = xp.zeros(shape, dtype=dy.dtype)
        for i in range(k):
            for j in range(k):
                dx[:, :, i:i + s * oh:s, j:j + s * ow:s] += dy * (winner == i * k + j)
        return dx
