"""A GPT's shape from its size: the published shapes, and the nearest one to a parameter count.

`mpipar plan --params 7e9` plans a GPT of about that many parameters. A decoder block of width
h holds about 12 h^2 parameters (attention's four h x h projections, the MLP's two h x 4h),
so a count fixes h^2 x blocks, not the shape; the published models fix the rest. These are
the shapes of GPT-3 (Brown et al., 2020, Table 2.1) and of Llama 2 70B (Touvron et al., 2023),
and the shape chosen is the one whose 12 h^2 L is nearest the count (by ratio). GPT-3 XL is
given 16 heads of 128: the paper's 24 heads do not divide its width of 2048.

Exercised by: python -m pytest tests/test_plan_cli.py
"""

from __future__ import annotations

import math

from mpipar.errors import ConfigError

# (name, width, heads, blocks)
SHAPES = (("GPT-3 Small", 768, 12, 12), ("GPT-3 Medium", 1024, 16, 24), ("GPT-3 Large", 1536, 16, 24),
          ("GPT-3 XL", 2048, 16, 24), ("GPT-3 2.7B", 2560, 32, 32), ("GPT-3 6.7B", 4096, 32, 32),
          ("GPT-3 13B", 5120, 40, 40), ("Llama 2 70B", 8192, 64, 80), ("GPT-3 175B", 12288, 96, 96))


def block_parameters(width: int, blocks: int) -> int:
    return 12 * width * width * blocks


def gpt_shape(parameters: float) -> tuple[int, int, int]:
    """(width, heads, blocks) of the published GPT nearest `parameters` in size."""
    if not parameters > 0:
        raise ConfigError(f"--params {parameters} is not a positive number of parameters")
    _, width, heads, blocks = min(SHAPES, key=lambda shape: abs(math.log(
        block_parameters(shape[1], shape[3]) / parameters)))
    return width, heads, blocks
