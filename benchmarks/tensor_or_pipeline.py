"""Split a model over k ranks by tensor parallelism or by a pipeline? The cost model's answer, per network.

    python benchmarks/tensor_or_pipeline.py [--rate 200e12] [--intra 450GB/s] [--inter 25GB/s]

No MPI: the collectives' times are `mpipar simulate comm`'s alpha-beta model
(mpipar/comms/cost.py, the same schedules as the real ring), the compute a rate. For a
GPT of L blocks of width h, a micro-batch of b x s tokens, m micro-batches a step and
k ranks to split each copy of the model over (its memory falls by k either way):

    compute    C = 6 N b s + 12 L b s^2 h FLOPs a micro-batch (N: the blocks' 12 L h^2
               parameters), forward and backward, at --rate FLOP/s per rank
    tensor     T = k: m (C / k / rate + 4 L t_allreduce(b s h e bytes over k ranks))
               (Megatron's four all-reduces a block and micro-batch, on the critical path;
               with sequence parallelism the same bytes as all-gathers and reduce-scatters)
    pipeline   S = k, 1F1B: (m + S - 1) (C / k / rate + 2 t_send(b s h e bytes))
               (a stage's forward and backward per micro-batch, S - 1 of them idle at
               the ends: the bubble; one activation and one gradient sent per stage)

each with the k ranks inside one node (--intra per rank) or in k different nodes
(--inter per rank). It prints the step time of each and the winner: a table for
docs/tensor_parallel.md ("Tensor or pipeline").
"""

import argparse

from mpipar.comms.cost import Network, predict
from mpipar.units import format_seconds, parse_rate

parser = argparse.ArgumentParser()
parser.add_argument("--rate", type=float, default=200e12, help="FLOP/s a rank sustains (H100 bf16 at ~50%% MFU)")
parser.add_argument("--intra", type=parse_rate, default=parse_rate("450GB/s"), help="bandwidth per rank in a node")
parser.add_argument("--inter", type=parse_rate, default=parse_rate("25GB/s"), help="bandwidth per rank between nodes")
args = parser.parse_args()
ELEMENT = 2  # bytes: bf16 / fp16 activations
MODELS = {"GPT-2 medium (h 1024, L 24, s 1024, b 8)": (1024, 24, 1024, 8),
          "7B (h 4096, L 32, s 2048, b 1)": (4096, 32, 2048, 1)}
MICRO_BATCHES = 8


def network(k: int, inside_node: bool) -> Network:
    """k ranks in one node, or one rank in each of k nodes."""
    return Network(ranks=k, group_size=k if inside_node else 1, bw_intra=args.intra, bw_inter=args.inter)


def send_time(net: Network, nbytes: float, inside_node: bool) -> float:
    """One point-to-point message between neighbouring stages (alpha + bytes / beta)."""
    return (net.lat_intra + nbytes / net.bw_intra) if inside_node else (net.lat_inter + nbytes / net.bw_inter)


def step_times(h: int, blocks: int, s: int, b: int, k: int, inside_node: bool) -> tuple[float, float]:
    """(tensor parallelism's, the pipeline's) seconds per step of MICRO_BATCHES micro-batches."""
    flops = 6 * 12 * blocks * h * h * b * s + 12 * blocks * b * s * s * h
    compute = flops / k / args.rate
    activation = b * s * h * ELEMENT
    net = network(k, inside_node)
    tensor = MICRO_BATCHES * (compute + 4 * blocks * predict(net, "all-reduce", "ring", activation))
    pipeline = (MICRO_BATCHES + k - 1) * (compute + 2 * send_time(net, activation, inside_node))
    return tensor, pipeline


print(f"{MICRO_BATCHES} micro-batches a step, {args.rate / 1e12:g} TFLOP/s a rank, {ELEMENT}-byte activations; "
      f"in a node {args.intra / 1e9:g} GB/s a rank, between nodes {args.inter / 1e9:g} GB/s a rank")
print("| model | k | ranks | tensor (T = k) | pipeline (S = k, 1F1B) | faster |")
print("| --- | ---: | --- | ---: | ---: | --- |")
for name, (h, blocks, s, b) in MODELS.items():
    for k in (2, 4, 8):
        for inside_node in (True, False):
            tensor, pipeline = step_times(h, blocks, s, b, k, inside_node)
            faster = f"tensor, {pipeline / tensor:.2f}x" if tensor < pipeline else f"pipeline, {tensor / pipeline:.2f}x"
            print(f"| {name} | {k} | {'one node' if inside_node else f'{k} nodes'} | {format_seconds(tensor)} | "
                  f"{format_seconds(pipeline)} | {faster} |")
