"""Configuration: defaults < TOML file < command line; every bad value is one clear sentence."""

import sys

import pytest

from mpipar.errors import ConfigError
from mpipar.train.config import TrainConfig, load_config


def test_file_then_command_line_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "cnn"\nmicro-batches = 2\nlr = 0.01\nhidden = [32, 16]\n')
    config = load_config(str(path), {"lr": "0.5", "model": None})
    assert config.model.model == "cnn" and config.training.micro_batches == 2 and config.model.hidden == (32, 16)
    assert config.optim.lr == 0.5  # the command line wins
    assert load_config(None, {"hidden": "512,512"}).model.hidden == (512, 512)
    assert load_config(None, {}) == TrainConfig.of()


@pytest.mark.parametrize("text,message", [
    ('modle = "cnn"', r"unknown option 'modle' in config file .*; valid options are: model, hidden"),
    ("epochs = 2.5", r"option 'epochs' in config file .* takes an integer, got the number 2.5"),
    ('lr = "fast"', r"option 'lr' in config file .* takes a number, got the string 'fast'"),
    ("epochs = true", r"option 'epochs' .* takes an integer, got the boolean True"),
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
    (dict(model="resnet"), r"--model: 'resnet' is neither a built-in model \(mlp, cnn, transformer\) nor FILE.py:FUNCTION"),
    (dict(dataset="cifar"), "unknown --dataset 'cifar'; choose one of: digits, mnist, fashion-mnist, kmnist"),
    (dict(optimizer="lion"), "unknown --optimizer 'lion'; choose one of: sgd, adam, adamw"),
    (dict(schedule="linear"), "unknown --schedule 'linear'; choose one of: constant, step, cosine"),
    (dict(dtype="float16"), "unknown --dtype 'float16'; choose one of: float32, float64"),
    (dict(device="tpu"), "unknown --device 'tpu'; choose one of: cpu, gpu"),
    (dict(batch_size=30, micro_batches=4), r"--batch-size 30 is not divisible by the 4 micro-batches = 4; use --batch-size 28 or 32"),
    (dict(lr=0.0), r"--lr must be in \(0, inf\), got 0.0"),
    (dict(epochs=0), "--epochs must be at least 1"),
    (dict(dropout=1.0), r"--dropout must be in \[0, 1\)"),
    (dict(model="transformer"), "--model transformer cannot train on --dataset digits"),
    (dict(model="transformer", dataset="text"), "--dataset text needs --text-file PATH"),
    (dict(model="transformer", dataset="text", text_file="t.txt", width=30, heads=4),
     "--width 30 is not divisible by --heads 4"),
    (dict(momentum=1.0), r"--momentum must be in \[0, 1\)"),
    (dict(gamma=0.0), "--gamma must be more than 0, got 0.0"),
    (dict(seed=-3), "--seed must be at least 0, got -3"),
    (dict(scheme="zero4"), "unknown --scheme 'zero4'; choose one of: ddp, zero1, zero2, zero3, mics"),
    (dict(shard="G,N,N"), "sharding G,N,N cannot work: each of P, G, OS must be sharded at least as finely"),
    (dict(shard="zero3"), "--shard takes three letters P,G,OS"),
    (dict(scheme="zero3", shard="G,G,G"), "give --scheme or --shard, not both"),
    (dict(scheme="zero3", collective="2d"), "--collective 2d is an all-reduce only"),
    (dict(group_size=3), "--group-size 3 does not divide the world size 1: choose one of 1"),
    (dict(scheme="cdp-v2", recompute="stage"), "--recompute stage is for pipelines and data parallelism"),
    (dict(recompute="every-0"), "--recompute: takes none, stage or every-K with K a number of layers >= 1"),
    (dict(scheme="zb1", stages=1), r"zb1 splits each backward into B and W jobs, which a stage shared by every rank "
                                   r"\(one stage: data parallelism\) cannot yet run"),
    (dict(collective="2d", ddp="allgather-activations"), "with --collective 2d"),
    (dict(scheme="zero3", ddp="allgather-activations"), "--ddp allgather-activations replaces the all-reduce of "
                                                         "plain data parallelism"),
])
def test_validation_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.of(**overrides).validate(world_size=1)


GPU_SCHEMES = [  # (world size, options): what the GPU issue asks every device to run
    *[(2, dict(scheme=scheme)) for scheme in ("ddp", "zero1", "zero2", "zero3", "mics", "zeropp")],
    *[(4, dict(scheme=scheme, group_size=2)) for scheme in ("paro-nig", "paro-iig", "paro-igg")],
    (2, dict(scheme="ddp", ddp="overlap")), (2, dict(scheme="ddp", ddp="allgather-activations")),
    *[(2, dict(scheme=scheme, stages=2, micro_batches=4)) for scheme in ("gpipe", "1f1b", "zb1")],
    *[(2, dict(scheme=scheme, stages=4, micro_batches=4)) for scheme in ("lpp", "fslpp")],
    (4, dict(scheme="1f1b", stages=2, shard="zero3", micro_batches=2)),
    (2, dict(scheme="cdp-v1", micro_batches=2)), (2, dict(scheme="cdp-v2", micro_batches=2)),
    (2, dict(scheme="zero3", recompute="every-2")), (2, dict(scheme="1f1b", stages=2, recompute="stage")),
]


@pytest.mark.parametrize("world_size, options", GPU_SCHEMES)
def test_every_scheme_validates_on_a_gpu(monkeypatch, world_size, options):
    monkeypatch.setenv("MPIPAR_GPU", "standin")  # the tests' device: no CuPy needed
    config = TrainConfig.of(device="gpu", **options)
    try:
        config.validate(world_size=world_size)
    except ConfigError as refusal:
        pytest.fail(f"{options} on {world_size} ranks is refused on a GPU: {refusal}")
    laid_out = config.for_world(world_size)
    assert laid_out.model.device == "gpu" and laid_out.parallel.scheme == options["scheme"]


def test_gpu_without_cupy_says_so_before_anything_else(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(ConfigError, match=r"--device gpu needs CuPy, which is not installed here: pip install"):
        TrainConfig.of(device="gpu", scheme="zero2").validate(world_size=1)


def test_automatic_micro_batches_fit_the_launch():
    assert TrainConfig.of().for_world(4).training.micro_batches == 1
    assert TrainConfig.of(scheme="1f1b", stages=4).for_world(4).training.micro_batches == 4
    assert TrainConfig.of(scheme="cdp-v2", cdp_layout="zero").for_world(3).training.micro_batches == 3
    assert TrainConfig.of(scheme="cdp-v2", cdp_layout="mp").for_world(6).training.micro_batches == 3
    TrainConfig.of(scheme="cdp-v2", cdp_layout="pp").validate(world_size=4)  # no --micro-batches needed
    assert TrainConfig.of(micro_batches=2).for_world(4).training.micro_batches == 2  # a given value is kept


@pytest.mark.parametrize("options, units", [
    (dict(), "bucketed"),
    (dict(scheme="zero2"), "bucketed"),  # P replicated: buckets keep the reductions few
    (dict(scheme="zero3"), "overlap"),  # P sharded: a gathered unit is memory every rank holds
    (dict(scheme="mics"), "overlap"),
    (dict(scheme="paro-iig"), "overlap"),
    (dict(scheme="zeropp"), "overlap"),
    (dict(scheme="1f1b", stages=2, shard="zero3"), "overlap"),
    (dict(scheme="zero3", ddp="bucketed"), "bucketed"),  # a given value is kept
    (dict(device="gpu"), "bucketed"),  # the same as on the CPU
    (dict(device="gpu", scheme="zero3"), "overlap"),
])
def test_automatic_units_keep_a_sharded_scheme_s_transient_to_one_layer(options, units):
    assert TrainConfig.of(**options).for_world(4).parallel.ddp == units


def test_batch_must_split_over_ranks():
    TrainConfig.of(batch_size=64).validate(world_size=4)
    with pytest.raises(ConfigError, match="not divisible by 3 ranks x 1 micro-batches = 3; use --batch-size 63 or 66"):
        TrainConfig.of(batch_size=64).validate(world_size=3)


def test_scheme_and_shard_name_the_scopes():
    assert TrainConfig.of().parallel.sharding().triple == ("N", "N", "N")
    assert TrainConfig.of(scheme="paro-iig").parallel.sharding().triple == ("I", "I", "G")
    assert TrainConfig.of(shard="n,i,g").parallel.sharding().triple == ("N", "I", "G")


def test_zb1_with_recomputation_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="zb1 keeps a stage's activations from its B to its W, and --recompute "
                                          "every-2 would rebuild them in B only"):
        TrainConfig.of(scheme="zb1", stages=2, micro_batches=2, recompute="every-2").validate(world_size=2)


def test_zb1_with_replicas_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="zb1 splits each backward into B and W jobs, which a stage shared by "
                                          "--replicas 2 cannot yet run"):
        TrainConfig.of(scheme="zb1", stages=1, replicas=2, micro_batches=2).validate(world_size=2)
