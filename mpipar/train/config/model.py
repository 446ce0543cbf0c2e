"""The model group: which network, its sizes, its floating-point type, precision and device.

Exercised by: python -m pytest tests/test_config.py
"""

from __future__ import annotations

from dataclasses import dataclass

import click

from mpipar.backend import DEVICES, DTYPES
from mpipar.errors import ConfigError
from mpipar.gpu import gpu_array_module
from mpipar.models.builtin import MODELS
from mpipar.optim.precision import PRECISIONS, Precision, check_loss_scale, check_precision
from mpipar.options import FloatRange, IntListType, ModelType
from mpipar.train.config.option import POSITIVE, OptionGroup, option


@dataclass
class ModelOptions(OptionGroup):
    model: str = option("mlp", "the network: a built-in one, or FILE.py:FUNCTION returning a PyTorch module, "
                        "a JAX (apply, params) pair or mpipar layers, and optionally a loss (docs/adapters.md)",
                        ModelType(MODELS), "model")
    hidden: tuple[int, ...] = option((128, 128), "hidden widths of the mlp, e.g. 512,512", IntListType(), "model")
    width: int = option(64, "model width d_model (transformer)", POSITIVE, "model")
    heads: int = option(4, "attention heads (transformer)", POSITIVE, "model")
    blocks: int = option(2, "transformer blocks", POSITIVE, "model")
    dropout: float = option(0.0, "dropout probability after each hidden layer or block",
                            FloatRange(0.0, 1.0, max_open=True), "model")
    tie_embeddings: bool = option(False, "the transformer's output layer uses the token embedding's matrix (a "
                                         "copy kept equal to it: their gradients are summed each step)",
                                  click.BOOL, "model")
    dtype: str = option("float32", "floating-point type of parameters and activations (with --precision fp16: "
                                   "of the master weights and optimizer state)", click.Choice(DTYPES), "model")
    precision: str = option("fp32", "arithmetic of forward and backward: fp32 (--dtype throughout; CPU and GPU) "
                                    "or fp16 (half precision with --dtype master weights and loss scaling; GPU "
                                    "only); bf16 is refused everywhere, as neither NumPy nor CuPy has bfloat16 "
                                    "(docs/precision.md)", click.Choice(PRECISIONS), "model")
    loss_scale: float | None = option(None, "with --precision fp16: a fixed loss scale, e.g. 1024 (default: a "
                                            "dynamic one, from 65536, halved on an overflow; Cyclic Data "
                                            "Parallelism needs a fixed one)", FloatRange(0.0, min_open=True), "model")
    device: str = option("cpu", "where the arrays live (gpu needs CuPy: pip install 'mpipar[gpu]')",
                         click.Choice(DEVICES), "model")
    cuda_graph: bool = option(False, "with --device gpu on one rank: capture a step's forward and backward once as "
                                     "a CUDA graph and replay it each step, so that Python launches none of its "
                                     "kernels (docs/gpu.md)", click.BOOL, "model")

    def validate(self) -> None:
        """Refuse in one sentence a model that cannot be built as asked."""
        if self.device == "gpu":
            try:
                gpu_array_module()
            except ImportError:
                raise ConfigError("--device gpu needs CuPy, which is not installed here: pip install "
                                  "'mpipar[gpu]' (or the cupy-cudaXXx wheel matching your CUDA)") from None
        check_precision(self.precision, self.device)
        if self.cuda_graph and self.device != "gpu":
            raise ConfigError(f"--cuda-graph captures GPU work; --device {self.device} has none: give --device gpu")
        if self.loss_scale is not None and self.precision != Precision.FP16:
            raise ConfigError(f"--loss-scale scales the gradients of --precision fp16; --precision {self.precision} "
                              "has no loss scale")
        check_loss_scale(self.loss_scale)
        if self.model == "transformer" and self.width % self.heads:
            raise ConfigError(f"--width {self.width} is not divisible by --heads {self.heads}")
        if self.tie_embeddings and self.model != "transformer":
            raise ConfigError(f"--tie-embeddings ties the transformer's output layer to its token embedding; "
                              f"--model {self.model} has no token embedding")
