"""Generation with and without the key/value cache, in alternating rounds (mpipar/models/generate.py).

    source .venv/bin/activate
    python benchmarks/generation.py

The model has nanoGPT's CPU recipe's shapes (4 blocks, 4 heads, width 128, context 64,
65 characters), float32, with its initial weights: what a token costs does not depend on
what the weights have learnt. Each round draws --tokens tokens after a one-character
prompt, once with the cache (a new token's forward runs over one position) and once
without (it runs over the whole current context, up to 64 positions); both follow the
same context rule, so they draw the same tokens, which the script checks. Figures are
medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mpipar.backend import make_backend
from mpipar.models.builtin import build_model
from mpipar.models.generate import LanguageModel, generate
from mpipar.models.sequential import build_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200, help="tokens drawn per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--width", type=int, default=128, help="the model's width")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    args = parser.parse_args()
    model = build_model("transformer", input_shape=(64,), num_classes=65, width=args.width, heads=args.heads,
                        blocks=args.blocks)
    (stage,) = build_stages(model, 1, make_backend("cpu", "float32"), 0)
    language_model = LanguageModel(stage, [chr(32 + i) for i in range(65)], 64, Path("initial weights"))
    seconds: dict[bool, list[float]] = {True: [], False: []}
    drawn: dict[bool, list[int]] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for kv_cache in ((True, False) if round_ % 2 else (False, True)):
            start = time.perf_counter()
            drawn[kv_cache] = generate(language_model, [0], args.tokens, seed=round_, kv_cache=kv_cache)
            if round_:
                seconds[kv_cache].append(time.perf_counter() - start)
        assert drawn[True] == drawn[False], "the cache changed the tokens drawn"
    cached, full = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"{args.tokens} tokens, context 64, {args.blocks} blocks of width {args.width}, {args.heads} heads, float32, "
          f"{args.rounds} rounds (medians)")
    print(f"  with the cache     {cached:.3f} s ({args.tokens / cached:,.0f} tokens/s)")
    print(f"  without the cache  {full:.3f} s ({args.tokens / full:,.0f} tokens/s)")
    print(f"  cached / full: {cached / full:.3f}")


if __name__ == "__main__":
    main()
