"""Configuration: defaults < TOML file < command line; every bad value is one clear sentence."""

import pytest

from mpipar.config import TrainConfig, load_config
from mpipar.errors import ConfigError


def test_file_then_command_line_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "cnn"\nmicro-batches = 2\nlr = 0.01\nhidden = [32, 16]\n')
    config = load_config(str(path), {"lr": "0.5", "model": None})
    assert config.model == "cnn" and config.micro_batches == 2 and config.hidden == (32, 16)
    assert config.lr == 0.5  # the command line wins
    assert load_config(None, {"hidden": "512,512"}).hidden == (512, 512)
    assert load_config(None, {}) == TrainConfig()


@pytest.mark.parametrize("text,message", [
    ('modle = "cnn"', r"unknown option 'modle' in config file .*; valid options are: model, hidden"),
    ("epochs = 2.5", r"option 'epochs' in config file .* must be int, got 2.5"),
    ('lr = "fast"', r"option 'lr' in config file .* must be float, got 'fast'"),
    ("epochs = true", r"option 'epochs' .* must be int, got True"),
    ("model = [", r"is not valid TOML"),
])
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), {})


def test_missing_file():
    with pytest.raises(ConfigError, match="cannot read config file /nonexistent.toml"):
        load_config("/nonexistent.toml", {})


@pytest.mark.parametrize("overrides,message", [
    (dict(model="resnet"), "unknown model 'resnet'; valid models are: cnn, mlp, transformer"),
    (dict(dataset="cifar"), "unknown data set 'cifar'; valid data sets are: digits, fashion-mnist, kmnist"),
    (dict(optimizer="lion"), "unknown optimizer 'lion'; valid optimizers are: adam, adamw, sgd"),
    (dict(schedule="linear"), "unknown schedule 'linear'; valid schedules are: constant, cosine, step"),
    (dict(dtype="float16"), "unknown dtype 'float16'; valid dtypes are: float32, float64"),
    (dict(device="tpu"), "unknown device 'tpu'; valid devices are: cpu, gpu"),
    (dict(batch_size=30, micro_batches=4), r"--batch-size 30 must be divisible by ranks x micro-batches"),
    (dict(lr=0.0), "--lr must be a positive finite number"),
    (dict(epochs=0), "--epochs must be at least 1"),
    (dict(dropout=1.0), r"--dropout must be in \[0, 1\)"),
    (dict(model="transformer"), "--model transformer cannot train on --dataset digits"),
    (dict(model="transformer", dataset="text"), "--dataset text needs --text-file PATH"),
    (dict(model="transformer", dataset="text", text_file="t.txt", width=30, heads=4),
     "--width 30 is not divisible by --heads 4"),
    (dict(momentum=1.0), r"--momentum must be in \[0, 1\)"),
    (dict(gamma=0.0), "--gamma must be positive"),
    (dict(seed=-3), "--seed must not be negative"),
    (dict(scheme="zero4"), "unknown scheme 'zero4'; valid schemes are: ddp, mics, paro-igg, paro-iig"),
    (dict(shard="G,N,N"), "sharding G,N,N cannot work: each of P, G, OS must be sharded at least as finely"),
    (dict(shard="zero3"), "--shard takes three letters P,G,OS"),
    (dict(scheme="zero3", shard="G,G,G"), "give --scheme or --shard, not both"),
    (dict(scheme="zero3", collective="2d"), "--collective 2d is an all-reduce only"),
    (dict(device="gpu", scheme="zero2", ddp="naive"), "on a GPU use --scheme ddp --ddp naive"),
    (dict(device="gpu"), "on a GPU use --scheme ddp --ddp naive"),
])
def test_validation_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**overrides).validate(world_size=1)


def test_batch_must_split_over_ranks():
    TrainConfig(batch_size=64).validate(world_size=4)
    with pytest.raises(ConfigError, match="= 3 x 1 = 3"):
        TrainConfig(batch_size=64).validate(world_size=3)


def test_scheme_and_shard_name_the_scopes():
    assert TrainConfig().sharding().triple == ("N", "N", "N")
    assert TrainConfig(scheme="paro-iig").sharding().triple == ("I", "I", "G")
    assert TrainConfig(shard="n,i,g").sharding().triple == ("N", "I", "G")
