"""The GPU path without a GPU: the stand-in device refuses the host, and every scheme runs on it.

The stand-in (mpipar/gpu/standin.py) is what makes these tests of residency: its arrays
refuse every implicit conversion to the host, MPI cannot read them unless the wire
stages them (or the CUDA-aware mode shows MPI their memory), and every crossing is
counted. tests/scripts/check_standin.py trains every scheme on it against the CPU.
"""

import ast
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import SCRIPTS, run_mpi
from mpipar.gpu import twin
from mpipar.gpu.standin import CROSSINGS, HostConversion, StandInArray, read_scalars
from mpipar.gpu.standin import module as xp
from mpipar.optim.optimizers import SGD, Adam

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def staged(monkeypatch):
    monkeypatch.delenv("MPIPAR_CUDA_AWARE", raising=False)
    CROSSINGS.reset()


@pytest.mark.parametrize("convert", [np.asarray, float, int, bool, lambda a: a.item(), lambda a: a.tolist(),
                                     lambda a: memoryview(a), lambda a: a.__array_interface__])
def test_every_implicit_way_to_the_host_is_refused(convert, staged):
    device = xp.ones(1)
    with pytest.raises((HostConversion, TypeError, AttributeError)):
        convert(device)
    assert CROSSINGS.to_host_bytes == 0


def test_a_host_array_among_device_arrays_is_refused(staged):
    with pytest.raises(HostConversion, match="host .NumPy. array of shape .3,. given with device arrays"):
        xp.ones(3) + np.ones(3)
    assert isinstance(xp.ones(3) + np.float64(2.0), StandInArray)  # scalars pass, as on CuPy


def test_the_named_ways_are_counted(staged):
    device = xp.asarray(np.arange(4.0))  # an explicit copy to the device
    assert np.array_equal(device.get(), np.arange(4.0))
    assert np.array_equal(read_scalars(device.sum()), 6.0)
    assert (CROSSINGS.to_device_bytes, CROSSINGS.to_host_bytes, CROSSINGS.syncs) == (32, 32 + 8, 1)


def test_a_result_sized_by_the_values_is_counted_as_a_host_sync(staged):
    """CuPy reads from the device how many elements a boolean index or nonzero selects before it
    can allocate the result: a synchronisation each, which the stand-in counts."""
    a = xp.arange(6.0)
    mask = a > 2.0
    sized = [lambda: a[mask], lambda: a.__setitem__(mask, 0.0), lambda: xp.flatnonzero(mask),
             lambda: np.nonzero(mask), lambda: mask.nonzero(), lambda: xp.where(mask), lambda: xp.unique(a),
             lambda: np.unique_values(a), lambda: xp.bincount(xp.arange(3)), lambda: np.add.at(a, mask, 1.0)]
    for count, make in enumerate(sized, start=1):
        make()
        assert CROSSINGS.size_reads == count
    fixed = [lambda: xp.where(mask, a, 0.0), lambda: a * mask, lambda: a[xp.arange(3)], lambda: a[1:]]
    for make in fixed:  # shapes the host knows without asking the device
        make()
    assert CROSSINGS.size_reads == len(sized)


def test_a_host_scalar_scattered_through_an_index_array_is_a_copy_to_the_device(staged):
    """CuPy copies the scalar of `a[indices] = 0.0` to the device before it scatters it; a view's
    fill (`a[1:] = 0.0`) and a device value copy nothing."""
    a = xp.zeros(4)
    a[1:] = 1.0
    a[xp.arange(2)] = a[2:]
    assert CROSSINGS.to_device_copies == 0
    a[xp.arange(2)] = 5.0
    assert (CROSSINGS.to_device_copies, CROSSINGS.to_device_bytes) == (1, 8)
    assert np.array_equal(a.get(), [5.0, 5.0, 1.0, 1.0])


def test_arrays_compute_as_numpy_and_stay_on_the_device(staged):
    a = xp.arange(6.0).reshape(2, 3)
    for result in (a @ a.T, a.sum(axis=0), np.einsum("ij->j", a), a[1:], a.T.copy(), xp.exp(a), a.max()):
        assert isinstance(result, StandInArray)
    assert np.array_equal((a @ a.T).get(), np.arange(6.0).reshape(2, 3) @ np.arange(6.0).reshape(2, 3).T)
    assert a[1:].base is a[:1].base  # one memory, one array: as CuPy's `base`


def test_mpi_cannot_read_a_stand_in_array_unless_cuda_aware(monkeypatch):
    monkeypatch.delenv("MPIPAR_CUDA_AWARE", raising=False)
    sent, received = xp.arange(4.0), xp.zeros(4)
    with pytest.raises((TypeError, BufferError)):
        MPI.COMM_SELF.Sendrecv(sent, 0, 0, received, 0, 0)
    monkeypatch.setenv("MPIPAR_CUDA_AWARE", "1")
    MPI.COMM_SELF.Sendrecv(sent, 0, 0, received, 0, 0)  # the CUDA-aware mode: MPI reads the memory itself
    assert np.array_equal(received.get(), np.arange(4.0))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_twins_updates_equal_the_cpus(momentum):
    rng = np.random.default_rng(0)
    p, g = rng.normal(size=70000), rng.normal(size=70000)  # more than one CPU chunk
    spans = [[(0, 30000), (40000, 70000)]]  # weight decay's kernels run span by span
    for make in (lambda params, grads: SGD(params, grads, spans, momentum=momentum, weight_decay=0.1),
                 lambda params, grads: Adam(params, grads, spans, weight_decay=0.1),
                 lambda params, grads: Adam(params, grads, spans, weight_decay=0.1, decoupled=True)):
        cpu, gpu = make([p.copy()], [g.copy()]), make([xp.asarray(p)], [xp.asarray(g)])
        for _ in range(3):
            cpu.step(0.01)
            gpu.step(0.01)
        assert np.array_equal(gpu.params[0].get(), cpu.params[0])


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6), (np.float16, 4e-3)])
def test_the_twins_gelu_and_layer_norm_equal_the_cpus(dtype, tolerance):
    from mpipar.cache import Context
    from mpipar.layers import GELU, LayerNorm

    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((4, 6, 32)).astype(dtype) * 3 for _ in range(2))
    gain, shift = (rng.standard_normal(32).astype(dtype) for _ in range(2))
    sides = []
    for asarray in (np.asarray, xp.asarray):
        norm = LayerNorm(32)
        norm.params = {"gain": asarray(gain), "shift": asarray(shift)}
        norm.grads = {"gain": asarray(np.zeros(32, dtype)), "shift": asarray(np.zeros(32, dtype))}
        outputs = []
        for layer in (GELU(), norm):
            ctx = Context(None, (0, 0))
            outputs += [layer.forward(asarray(x), ctx), layer.backward(asarray(dy), ctx)]
        sides.append([output if isinstance(output, np.ndarray) else output.get() for output in outputs])
    for cpu, stand_in in zip(*sides):
        assert np.max(np.abs(stand_in - cpu)) <= tolerance * np.max(np.abs(cpu))


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6), (np.float16, 1e-3)])
@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False), (True, True)])
def test_the_twins_batched_product_reads_each_operand_where_it_lies(transpose_a, transpose_b, dtype, tolerance):
    """The twin multiplies through the cuBLAS call that batched_gemm.py works out, reading the
    memory as cuBLAS would: wrong leading dimensions, strides or transposes give other numbers."""
    rng = np.random.default_rng(2)
    batch, rows, inner, columns = 5, 4, 3, 6

    def lying(shape, transposed):  # rows further apart than their length, in a wider buffer
        stored = shape[::-1] if transposed else shape
        wide = rng.standard_normal((batch, stored[0], stored[1] + 2)).astype(dtype)
        return wide, xp.asarray(wide)[:, :, :stored[1]]

    (a_host, a), (b_host, b) = lying((rows, inner), transpose_a), lying((inner, columns), transpose_b)
    out_buffer = xp.zeros((batch, rows, columns + 3), dtype=dtype)
    twin.batched_product(a, b, out_buffer[:, :, :columns], transpose_a=transpose_a, transpose_b=transpose_b)

    def op(host, transposed, width):
        x = host[:, :, :width].astype(np.float64)
        return x.swapaxes(1, 2) if transposed else x

    expected = op(a_host, transpose_a, rows if transpose_a else inner) @ op(b_host, transpose_b,
                                                                            inner if transpose_b else columns)
    got = out_buffer.get()
    assert np.max(np.abs(got[:, :, :columns] - expected)) <= tolerance * np.max(np.abs(expected))
    assert not got[:, :, columns:].any(), "the product wrote past the rows of its output"


@pytest.mark.parametrize("dtype, tolerance", [(np.float64, 1e-14), (np.float32, 1e-6), (np.float16, 1e-3)])
def test_the_twins_product_reads_transposed_views_where_they_lie_and_adds_when_asked(dtype, tolerance):
    """twin.product multiplies through the call cuda.product works out (batched_gemm.as_matrix_batch:
    x, or x.T read as the row-major matrix it views), into an output whose rows lie further apart
    than their length, written or added to; an operand that is neither is copied first."""
    rng = np.random.default_rng(4)
    host = {name: rng.standard_normal(shape).astype(dtype) for name, shape in
            (("x", (7, 5)), ("w", (6, 5)), ("strided", (5, 12)), ("out", (7, 9)))}
    x, w, strided, out_buffer = (xp.asarray(host[name]) for name in ("x", "w", "strided", "out"))
    wide = {name: array.astype(np.float64) for name, array in host.items()}
    cases = [  # (a, b, a @ b on the host)
        (x, w.T, wide["x"] @ wide["w"].T),  # a transposed view, read in place
        (w.T[:3], strided.T[:6], wide["w"].T[:3] @ wide["strided"].T[:6]),  # both; rows 12 apart
        (x, strided[:, ::2], wide["x"] @ wide["strided"][:, ::2]),  # neither row-major nor transposed: copied
    ]
    for a, b, expected in cases:
        got = twin.product(a, b).get().astype(np.float64)
        assert np.max(np.abs(got - expected)) <= tolerance * np.max(np.abs(expected))
    into = out_buffer[:, :6]  # rows 9 apart
    twin.product(x, w.T, into, accumulate=True)
    expected = wide["out"][:, :6] + wide["x"] @ wide["w"].T
    got = out_buffer.get().astype(np.float64)
    assert np.max(np.abs(got[:, :6] - expected)) <= tolerance * np.max(np.abs(expected))
    assert np.array_equal(got[:, 6:], wide["out"][:, 6:]), "the product wrote past the rows of its output"
    column_sums = xp.asarray(np.ones(5, dtype))
    twin.column_sum(x, column_sums, accumulate=True)
    expected = 1 + wide["x"].sum(axis=0)
    assert np.max(np.abs(column_sums.get().astype(np.float64) - expected)) <= 4 * tolerance * np.max(np.abs(expected))


def test_a_batched_product_refuses_an_operand_cublas_cannot_read_in_place():
    a = xp.ones((2, 3, 4))
    with pytest.raises(ValueError, match="cannot read it in place"):
        twin.batched_product(a.swapaxes(1, 2), a, xp.empty((2, 4, 4)))  # columns, not rows, contiguous


def test_the_twin_has_every_name_of_the_cuda_module():
    tree = ast.parse((ROOT / "mpipar" / "gpu" / "cuda.py").read_text())
    public = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
              and not node.name.startswith("_")}
    assert public - set(dir(twin)) == set()


# The runtime and the wire take their buffers from the run's array module: a bare NumPy
# allocation or a branch on NumPy there would send a device array down a host path.
FORBIDDEN = re.compile(r"np\.(empty|zeros|ones|full|empty_like|zeros_like|ascontiguousarray|asarray|array)\("
                       r"|xp is np|isinstance\([^)]*np\.ndarray")
HOST_ONLY = {  # (file, text of the line): why it is host memory by design
    ("runtime/executor.py", "self.totals, self.losses_computed = None, np.zeros(0, dtype=int)"):
        "a count of micro-batches per step, read by the host",
    ("runtime/executor.py", "self.losses_computed = np.zeros(steps, dtype=int)  # per step: micro-batches whose "
                            "loss is in totals"): "the same count",
    ("comms/liveness.py", "self._question = np.zeros(1, dtype=np.int64)"): "the side channel's own host messages",
    ("comms/comm.py", "one = np.ones(1, dtype=code)"): "the one-element sum that asks the library for a type",
    ("comms/liveness.py", "number = np.array([self._asked], dtype=np.int64)"): "the same",
    ("comms/liveness.py", "replies = {rank: np.zeros(1, dtype=np.int64) for rank in others}"): "the same",
    ("comms/timing.py", "self.full = np.zeros(count, dtype=dtype)  # the buffer, or the full input / output"):
        "mpipar bench comms times host buffers",
    ("comms/timing.py", "self.part = np.zeros(self.mine.stop - self.mine.start, dtype=dtype)"): "the same",
    ("comms/timing.py", "self.part = np.zeros(count, dtype=dtype)"): "the same",
    ("comms/timing.py", "times = np.empty(reps)"): "the same: timings",
}


def test_the_runtime_allocates_through_the_array_module():
    found = set()
    for folder in ("runtime", "comms"):
        for path in sorted((ROOT / "mpipar" / folder).glob("*.py")):
            for line in path.read_text().splitlines():
                if FORBIDDEN.search(line) and not line.strip().startswith(("#", '"')):
                    found.add((f"{folder}/{path.name}", line.strip()))
    unexplained = found - set(HOST_ONLY)
    assert not unexplained, "host allocations or NumPy branches in the runtime:\n  " + "\n  ".join(
        f"{file}: {line}" for file, line in sorted(unexplained))
    assert not set(HOST_ONLY) - found, f"allow-list rows that no longer exist: {set(HOST_ONLY) - found}"


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("wire", ["staged", "cuda-aware"])
def test_every_scheme_runs_on_the_stand_in_device(ranks, wire):
    environment = {"MPIPAR_GPU": "standin", "MPIPAR_CUDA_AWARE": "1" if wire == "cuda-aware" else "0"}
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_standin.py"), *([wire] if wire != "staged" else []),
                     timeout=600, env_extra=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stand-in device cases equal the CPU" in result.stdout


@pytest.mark.parametrize("ranks, cases", [(2, 34), (4, 12)])
def test_every_schemes_stand_in_pool_peak_is_within_10_percent_of_the_predicted_peak_in_float32_and_fp16(ranks,
                                                                                                         cases):
    environment = {"MPIPAR_GPU": "standin", "MPIPAR_HALF_ON_CPU": "1"}
    result = run_mpi(ranks, sys.executable, str(SCRIPTS / "check_standin_memory.py"), timeout=600,
                     env_extra=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{cases} stand-in pool peaks within 10% of the prediction on {ranks} ranks" in result.stdout
