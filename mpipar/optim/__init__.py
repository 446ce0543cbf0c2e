"""What happens to gradients and parameters at the update.

    spec.py        OptimizerSpec: an optimizer's name, hyper-parameters, master dtype, state kinds
    optimizers.py  SGD, Adam and AdamW on flat pieces; learning-rate schedules
    clipping.py    clipping by the global norm of the whole model's gradient, in every layout
    tying.py       tied weights: two copies of one matrix kept equal by summing their gradients
    precision.py   half precision: master weights in full precision, dynamic loss scaling

Exercised by: python -m pytest tests/test_optim.py tests/test_clipping.py tests/test_precision.py
"""
