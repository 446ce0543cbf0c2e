"""From-scratch layers and losses, each with its backward written beside its forward."""

from mpipar.layers.activations import GELU, ReLU, Tanh
from mpipar.layers.attention import CausalSelfAttention
from mpipar.layers.base import Layer, ParamSpec
from mpipar.layers.conv import Conv2d, MaxPool2d
from mpipar.layers.dropout import Dropout
from mpipar.layers.embedding import Embedding, PositionEmbedding, TiedOutput
from mpipar.layers.linear import Linear
from mpipar.layers.losses import MSE, SoftmaxCrossEntropy
from mpipar.layers.norm import LayerNorm
from mpipar.layers.residual import Residual
from mpipar.layers.shape import Flatten, GlobalAvgPool

__all__ = [
    "CausalSelfAttention", "Conv2d", "Dropout", "Embedding", "Flatten", "GELU", "GlobalAvgPool",
    "Layer", "LayerNorm", "Linear", "MSE", "MaxPool2d", "ParamSpec", "PositionEmbedding", "ReLU", "TiedOutput",
    "Residual", "SoftmaxCrossEntropy", "Tanh",
]
