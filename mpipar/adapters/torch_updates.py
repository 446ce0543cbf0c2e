"""The optimizers' updates by torch's in-place kernels, for a run of torch stages on the CPU.

mpipar's own CPU update (mpipar/optim/optimizers.py) is a NumPy loop over chunks, on one thread.
In a run whose stages are torch modules, torch's intra-op threads are already there and
awake after the backward's matrix products, and torch's element-wise kernels use them:
the same update over the same NumPy buffers (torch.from_numpy shares their memory) took
0.9 ms of a step instead of 2.0 when this machine was slow, 0.4 instead of 0.66 when it
was quick (docs/performance.md). The operations are torch.optim's own, in its order
(`SGD` and `Adam` with foreach=False, which is torch's choice on the CPU), so a piece
updated here rounds as torch's optimizer rounds that parameter, bit for bit:

    SGD    g += wd p (decay spans);  v = v mu + g;  p += -lr v     (mu = 0: p += -lr g)
    Adam   g += wd p (decay spans, Adam);  p *= 1 - lr wd (decay spans, AdamW)
           m1 = lerp(m1, g, 1 - b1);  m2 = m2 b2 + (1 - b2) g g
           p += -(lr / (1 - b1^t)) m1 / (sqrt(m2) / sqrt(1 - b2^t) + eps)

Nothing parameter-sized is allocated: Adam's denominator is built chunk by chunk in the
optimizer's workspace, as the NumPy loop builds it.

Exercised by: python -m pytest tests/test_optim.py -k torch
"""

from __future__ import annotations

import numpy as np

from mpipar.adapters.framework import import_framework

torch = import_framework("torch")


def _spans(tensor, spans):
    return (tensor[start:stop] for start, stop in spans)


class TorchUpdates:
    """One piece's update, in place, by torch's kernels on the piece's NumPy buffers."""

    def sgd(self, p: np.ndarray, g: np.ndarray, v: np.ndarray | None, lr: float, momentum: float,
            weight_decay: float, decay_spans) -> None:
        p, g = torch.from_numpy(p), torch.from_numpy(g)
        if weight_decay:
            for g_span, p_span in zip(_spans(g, decay_spans), _spans(p, decay_spans)):
                g_span.add_(p_span, alpha=weight_decay)
        if v is not None:
            g = torch.from_numpy(v).mul_(momentum).add_(g)
        p.add_(g, alpha=-lr)

    def adam(self, p: np.ndarray, g: np.ndarray, m1: np.ndarray, m2: np.ndarray, workspace: np.ndarray, *,
             lr: float, betas: tuple[float, float], eps: float, step: int, weight_decay: float, decoupled: bool,
             decay_spans, chunks) -> None:
        p, g, m1, m2 = (torch.from_numpy(array) for array in (p, g, m1, m2))
        beta1, beta2 = betas
        if weight_decay:
            for g_span, p_span in zip(_spans(g, decay_spans), _spans(p, decay_spans)):
                if decoupled:
                    p_span.mul_(1 - lr * weight_decay)
                else:
                    g_span.add_(p_span, alpha=weight_decay)
        m1.lerp_(g, 1 - beta1)
        m2.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size, bias2_sqrt = lr / (1 - beta1**step), (1 - beta2**step) ** 0.5
        scratch = torch.from_numpy(workspace)
        for chunk in chunks:
            denominator = scratch[:chunk.stop - chunk.start]
            torch.sqrt(m2[chunk], out=denominator)
            denominator.div_(bias2_sqrt).add_(eps)
            p[chunk].addcdiv_(m1[chunk], denominator, value=-step_size)
