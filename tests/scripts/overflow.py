"""One rank's float16 gradient overflows: every rank must skip that step (check_precision.py and
check_pipeline_precision.py share it).

`one_overflow(trainer, world)` trains four steps; at the third the last rank alone writes an inf
into its first piece of the summed gradient. It returns the failures seen on this rank: the
step with the overflow changed a parameter, a step without one changed none, or the loss
scaler did not count one skipped step and halve its scale to 2^15.
"""

import numpy as np


def one_overflow(trainer, world) -> list[str]:
    engine = trainer.parts.engine
    finish = engine.finish_gradients

    def overflow_on_the_last_rank() -> None:
        finish()
        engine.whole_model.gradient_pieces(engine.updated_stages())[0].array[0] = np.inf

    snapshots = []
    for step in range(4):
        if step == 2 and world.rank == world.size - 1:
            engine.finish_gradients = overflow_on_the_last_rank
        snapshots.append(engine.whole_model.full_parameters().copy())
        trainer.train_step(step)
        engine.finish_gradients = finish
    snapshots.append(engine.whole_model.full_parameters().copy())
    failures, scaler = [], trainer.parts.loss_scaler
    if not np.array_equal(snapshots[2], snapshots[3]):
        changed = int((snapshots[2] != snapshots[3]).sum())
        failures.append(f"rank {world.rank}: the step with the last rank's overflow changed {changed} parameters")
    if np.array_equal(snapshots[3], snapshots[4]) or np.array_equal(snapshots[1], snapshots[2]):
        failures.append(f"rank {world.rank}: a step without overflow left the parameters as they were")
    if scaler.skipped != 1 or scaler.scale != 2.0**15:
        failures.append(f"rank {world.rank}: {scaler.skipped} step(s) skipped, loss scale {scaler.scale:g}; "
                        "expected 1 and 32768")
    return failures
