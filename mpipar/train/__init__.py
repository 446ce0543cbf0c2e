"""Training: the configuration, the scheme it names as set up, and the loop.

    config/           TrainConfig: the configuration in validated groups (one module each), from defaults,
                      TOML and the command line
    scheme.py         the scheme a run trains with, as the trainer sets it up: one class per family
    trainer.py        the training loop around the executor: data, steps, evaluation, checkpoints
    cdp_reference.py  Cyclic Data Parallelism's update rules as a plain single-process loop: the
                      oracle the cyclic engine must equal (the rule's formula sits with its
                      compiler, in schedule/cyclic.py)

Exercised by: mpiexec -n 2 mpipar train;  python -m pytest tests/test_trainer.py tests/test_config.py
"""
