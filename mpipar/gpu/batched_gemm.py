"""A batch of matrix products as cuBLAS takes it: one strided-batched GEMM call, worked out
from the arrays' shapes and strides.

    out[i] = op(a[i]) @ op(b[i])   for i < batch,   op(x) = x, or x^T where asked

Attention multiplies every head's matrices at once (q k^T, p v, and in the backward p^T do,
do v^T, ds k, ds^T q). CuPy's matmul first copies each operand that is not C-contiguous,
so p^T and ds^T, views of all the scores (N H, T, T), became full copies with scattered
writes, twice a block in every backward. cuBLAS reads a matrix in either orientation where
it lies; this module says how to ask it to.

cuBLAS reads matrices column by column. A C-order matrix of r rows and c columns whose rows
lie ld elements apart is, read that way, its own transpose: a c x r column-major matrix with
leading dimension ld. So the product is asked for transposed, out^T = op(b)^T op(a)^T:

    cuBLAS's A   b's memory;  transposed when b is to be transposed    lda = b's row stride
    cuBLAS's B   a's memory;  transposed when a is to be transposed    ldb = a's row stride
    cuBLAS's C   out's memory                                          ldc = out's row stride
    m, n, k      out's columns, out's rows, the shared dimension

Each operand is (batch, rows, columns) with unit stride along a row, and one stride between
its matrices (0 repeats one matrix for the whole batch). A product of two matrices is a batch
of one (`as_matrix_batch`). `cuda.batched_product` makes the
call; `twin.batched_product` reads the same numbers back into NumPy views of the memory, as
cuBLAS would, so the CPU tests check this arithmetic.

Exercised by: python -m pytest tests/test_standin.py -k batched_product
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StridedBatchedGemm:
    """One cublasGemmStridedBatchedEx call, in elements; `a` and `b` are cuBLAS's A and B."""

    transpose_a: bool
    transpose_b: bool
    m: int
    n: int
    k: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


def column_major_call(a, b, out, transpose_a: bool = False, transpose_b: bool = False) -> StridedBatchedGemm:
    """The call that writes op(a) @ op(b) into `out` (see the module's docstring), or a
    ValueError naming the operand cuBLAS cannot read where it lies."""
    shapes = {name: array.shape for name, array in (("a", a), ("b", b), ("out", out))}
    if any(len(shape) != 3 for shape in shapes.values()):
        raise ValueError(f"a batched product takes (batch, rows, columns) arrays, got shapes {shapes}")
    if not a.dtype == b.dtype == out.dtype:
        raise ValueError(f"a batched product of one type, got {a.dtype}, {b.dtype} into {out.dtype}")
    rows, inner = a.shape[1:][::-1] if transpose_a else a.shape[1:]
    inner_b, columns = b.shape[1:][::-1] if transpose_b else b.shape[1:]
    batch = out.shape[0]
    if inner != inner_b or out.shape[1:] != (rows, columns) or {a.shape[0], b.shape[0]} != {batch}:
        raise ValueError(f"shapes {shapes} do not make a batched product (transposed: a {transpose_a}, "
                         f"b {transpose_b})")
    strides = {name: _element_strides(array, name) for name, array in (("a", a), ("b", b), ("out", out))}
    return StridedBatchedGemm(transpose_a=transpose_b, transpose_b=transpose_a, m=columns, n=rows, k=inner,
                              lda=strides["b"][1], stride_a=strides["b"][0], ldb=strides["a"][1],
                              stride_b=strides["a"][0], ldc=strides["out"][1], stride_c=strides["out"][0],
                              batch=batch)


def as_matrix_batch(x) -> tuple[object, bool] | None:
    """A 2-D operand as a batch of one row-major matrix and whether cuBLAS is to transpose it: x
    itself, or x.T when x is the transposed view of a row-major matrix (x.T is read where it
    lies); None when neither is (the caller copies it)."""
    for matrix, transposed in ((x, False), (x.T, True)):
        if matrix.strides[1] == matrix.dtype.itemsize and matrix.strides[0] >= matrix.shape[1] * matrix.strides[1]:
            return matrix[None], transposed
    return None


def _element_strides(array, name: str) -> tuple[int, int]:
    """(between matrices, between rows) in elements: what cuBLAS can step by."""
    between, row, element = array.strides
    itemsize = array.dtype.itemsize
    if element != itemsize or row % itemsize or between % itemsize or row // itemsize < array.shape[2] \
            or between < 0:
        raise ValueError(f"{name} of shape {array.shape} and strides {array.strides} is not a batch of row-major "
                         "matrices (contiguous rows, one stride between matrices): cuBLAS cannot read it in place")
    return between // itemsize, row // itemsize
