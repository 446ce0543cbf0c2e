"""The models: what a model is, the ones built in, and generating text from one.

    sequential.py  Sequential models, their cut into pipeline stages, flat parameter buffers
    builtin.py     the built-in models by name: an MLP, a LeNet-like CNN, a tiny character GPT
    decoder.py     the transformer's forward for generation, against cached keys and values
    generate.py    text from a trained transformer: load a checkpoint, sample token by token

Exercised by: python -m pytest tests/test_model.py tests/test_generate.py
"""
