#!/usr/bin/env bash
# Every sharding scheme on the same run: by default the Fashion-MNIST CNN of
# fashion_cnn.toml on 4 ranks in 2 groups of 2. Extra arguments go to every run.
# Run it inside the environment (source .venv/bin/activate first):
#   bash examples/every_scheme.sh --epochs 1 --micro-batches 2
#   RANKS=8 GROUP_SIZE=4 bash examples/every_scheme.sh --config examples/digits_mlp.toml
set -euo pipefail
if ! command -v mpipar >/dev/null || ! command -v mpiexec >/dev/null; then
    echo "every_scheme.sh: mpipar or mpiexec is not on PATH; run 'source .venv/bin/activate' first" >&2
    exit 2
fi
ranks=${RANKS:-4}
group_size=${GROUP_SIZE:-2}
here=$(dirname "$0")
for scheme in ddp zero1 zero2 zero3 mics paro-nig paro-iig paro-igg; do
    echo "== mpiexec -n $ranks mpipar train --scheme $scheme --group-size $group_size $*"
    mpiexec -n "$ranks" mpipar train --config "$here/fashion_cnn.toml" --scheme "$scheme" \
        --group-size "$group_size" "$@" | grep -E "^(done|model state)"
done
