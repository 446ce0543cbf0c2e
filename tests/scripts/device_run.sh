#!/usr/bin/env bash
# The GPU checks of check_gpu.py in one call, most telling first, each part under its own time
# limit and its output in OUT/<part>.txt, so that a device lent for minutes yields what it can.
#
#     mkdir -p .gpu-data && cp ../shared/data/tinyshakespeare.txt .gpu-data/     (here, once)
#     bash tests/scripts/device_run.sh "$OUT" [PART ...]                          (on the device)
#
# kernels: every kernel of mpipar/gpu/cuda.py and its cuBLAS products against NumPy (if these
# fail, nothing after means much), cuBLAS products captured in a CUDA graph, and a replayed
# graph of the step against steps launched from Python; speed: tokens/s against
# torch eager and torch.compile, float32 and fp16, --cuda-graph beside them, kernels a step;
# schemes: every scheme of device_cases.py on 2 ranks sharing the GPU against the CPU; profile:
# where a step goes; fp16-memory and memory: the pool peak against the prediction. Named PARTs
# run alone. The limits add up to 580 s, within one call of the device tool (600 s).
set -u
out=$(realpath "${1:-${OUT:-/tmp/device-run}}")
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$root PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MPIPAR_CHECK_TEXT=${MPIPAR_CHECK_TEXT:-$root/.gpu-data/tinyshakespeare.txt}
launcher=$(command -v mpirun || command -v mpiexec || echo "no-mpi-launcher")
passed_on=()  # Open MPI's launcher passes on only the variables named; MPICH's passes on all
if "$launcher" --version 2>&1 | grep -q "Open MPI"; then
    passed_on=(-x PYTHONPATH -x PYTHONUNBUFFERED -x MPIPAR_CHECK_TEXT)
fi
cd "$root/tests/scripts"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/device.txt" 2>&1
python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" >> "$out/device.txt" 2>&1
echo "launcher $launcher" >> "$out/device.txt"
cat "$out/device.txt"

part() {  # part NAME SECONDS RANKS: check_gpu.py NAME on RANKS ranks, at most SECONDS
    local name=$1 seconds=$2 ranks=$3
    local command=(python3 check_gpu.py "$name")
    if [ "$ranks" -gt 1 ]; then
        command=("$launcher" "${passed_on[@]}" -n "$ranks" "${command[@]}")
    fi
    timeout "$seconds" "${command[@]}" > "$out/$name-$ranks.txt" 2>&1
    echo "exit status $?" >> "$out/$name-$ranks.txt"
    echo "== $name on $ranks rank(s)"
    grep -v "^ " "$out/$name-$ranks.txt" | grep -E "rank\(s\)|exit status" | cut -c1-1500
}

declare -A limit=([kernels]=90 [speed]=200 [schemes]=130 [profile]=60 [fp16-memory]=60 [memory]=40)
declare -A ranks=([kernels]=1 [speed]=1 [schemes]=2 [profile]=1 [fp16-memory]=2 [memory]=1)
shift $(( $# > 0 ? 1 : 0 ))
for name in "${@:-kernels speed schemes profile fp16-memory memory}"; do
    for one in $name; do
        part "$one" "${limit[$one]}" "${ranks[$one]}"
    done
done
