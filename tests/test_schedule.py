"""Schedules as data: strategies, the clock-free simulator, diagrams (no MPI)."""

import pytest
from click.testing import CliRunner

from mpipar.cli import cli
from mpipar.errors import ConfigError
from mpipar.schedule.simulate import simulate
from mpipar.schedule.strategies import (
    BACKWARD,
    FORWARD,
    Job,
    Shape,
    Strategy,
    depth_first,
    get_strategy,
    load_table,
    looped_worker,
    predecessor,
    register,
)


@pytest.mark.parametrize("workers,stages", [(2, 3), (4, 4), (6, 2)])
def test_ddp_runs_every_stage_of_its_micro_batch_with_no_transfers(workers, stages):
    timeline = simulate(get_strategy("ddp"), Shape(workers, stages, workers))
    assert timeline.latency == 2 * stages  # a forward and a backward unit per stage
    assert timeline.activation_receives() == timeline.weight_fetches() == [0] * workers
    assert timeline.peak_activations() == timeline.weights_owned() == [stages] * workers


@pytest.mark.parametrize("workers", [2, 4, 6])
def test_fsdp_fetches_every_stage_it_does_not_own(workers):
    timeline = simulate(get_strategy("fsdp-stage"), Shape(workers, workers, workers))
    assert timeline.latency == 2 * workers
    assert timeline.weight_fetches() == [2 * (workers - 1)] * workers  # forward and backward each fetch
    assert timeline.weights_owned() == [1] * workers
    assert timeline.activation_receives() == [0] * workers


@pytest.mark.parametrize("stages,batches", [(2, 2), (4, 8), (3, 7), (8, 4)])
def test_gpipe_and_1f1b_latency_is_b_plus_s_minus_1(stages, batches):
    for name in ("gpipe", "1f1b"):
        timeline = simulate(get_strategy(name), Shape(stages, stages, batches))
        assert timeline.latency == 2 * (batches + stages - 1), name
        inner = [2 * batches] * (stages - 2)
        assert timeline.activation_receives() == ([batches, *inner, batches] if stages > 1 else [0]), name
        assert timeline.weights_owned() == [1] * stages
    gpipe, one_f_one_b = (simulate(get_strategy(n), Shape(stages, stages, batches)) for n in ("gpipe", "1f1b"))
    assert gpipe.peak_activations() == [batches] * stages  # every forward before any backward
    assert one_f_one_b.peak_activations() == [min(batches, stages - w) for w in range(stages)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_recomputation_makes_each_backward_a_forward_longer_in_the_replay(name):
    """Seed 001's latency (B + S - 1)(F + B) with F = 1 and B = 2: a backward reruns its forward."""
    args = ["schedule", "show", "--scheme", name, "-W", "4", "-S", "4", "-B", "8"]
    assert "latency 22 time units" in CliRunner().invoke(cli, args).output
    result = CliRunner().invoke(cli, [*args, "--recompute", "stage"])
    assert result.exit_code == 0, result.output
    assert "latency 33 time units" in result.output and "a backward two" in result.output


@pytest.mark.parametrize("stages,batches", [(4, 8), (2, 6), (4, 4), (8, 16)])
def test_zb1_fills_1f1b_bubble_with_deferred_weight_gradients_at_the_same_activation_count(stages, batches):
    """The zero-bubble split: the same work (a backward of one unit is a B and a W of half a
    unit each), a smaller bubble than 1F1B's, no more micro-batches in flight, and every W
    after its B on the worker of its F."""
    one_f_one_b = simulate(get_strategy("1f1b"), Shape(stages, stages, batches))
    zb1 = simulate(get_strategy("zb1"), Shape(stages, stages, batches))
    busy = [sum(slot.end - slot.start for slot in slots) for slots in zb1.by_worker]
    assert busy == [sum(slot.end - slot.start for slot in slots) for slots in one_f_one_b.by_worker]
    assert zb1.latency < one_f_one_b.latency
    assert max(zb1.idle_fraction()) < min(one_f_one_b.idle_fraction())
    assert zb1.peak_activations() == one_f_one_b.peak_activations()
    end = {slot.job: (slot.worker, slot.end) for slot in zb1.slots}
    for slot in zb1.slots:
        if slot.job.direction == "W":
            worker, b_end = end[Job(slot.job.stage, slot.job.batch, BACKWARD)]
            assert worker == slot.worker == end[Job(slot.job.stage, slot.job.batch, FORWARD)][0]
            assert slot.start >= b_end


def test_zb1_shows_its_smaller_bubble_in_schedule_show():
    args = ["schedule", "show", "-W", "4", "-S", "4", "-B", "8"]
    one_f_one_b = CliRunner().invoke(cli, [*args, "--scheme", "1f1b"]).output
    zb1 = CliRunner().invoke(cli, [*args, "--scheme", "zb1"]).output
    assert "latency 22 time units" in one_f_one_b and " 27%" in one_f_one_b
    assert "latency 20.5 time units" in zb1 and " 22%" in zb1 and "W3b2: its weight gradient" in zb1
    assert "split into B and W of half that each" in zb1


def test_looped_placement_interpolates_between_gpipe_and_ddp():
    gpipe_like = Shape(workers=4, stages=4, micro_batches=6, loops=1)  # G = 1, R = W = S
    assert all(looped_worker(s, b, gpipe_like) == s for s in range(4) for b in range(6))
    ddp_like = Shape(workers=4, stages=5, micro_batches=4, loops=4)  # R = 1, W = B
    assert all(looped_worker(s, b, ddp_like) == b for s in range(5) for b in range(4))


@pytest.mark.parametrize("workers,stages,batches,loops", [(4, 8, 8, 2), (4, 8, 2, 2), (6, 6, 6, 2), (4, 4, 8, 2)])
def test_lpp_keeps_s_over_r_stages_per_worker_and_fslpp_shards_them(workers, stages, batches, loops):
    lpp = simulate(get_strategy("lpp"), Shape(workers, stages, batches, loops))
    r = workers // loops
    assert lpp.weights_owned() == [stages // r] * workers and lpp.weight_fetches() == [0] * workers
    assert lpp.latency >= 2 * stages * batches / workers  # no worker can beat its share of the work
    fslpp = simulate(get_strategy("fslpp"), Shape(workers, stages, batches, loops))
    owners = {looped_worker(s, s, fslpp.shape) for s in range(stages)}
    assert sum(fslpp.weights_owned()) == stages and {w for w, n in enumerate(fslpp.weights_owned()) if n} == owners
    assert sum(fslpp.weight_fetches()) > 0


@pytest.mark.parametrize("name,shape,constraint", [
    ("gpipe", Shape(4, 8, 4), "W = S"),
    ("1f1b", Shape(2, 3, 4), "W = S"),
    ("ddp", Shape(4, 4, 8), "W = B"),
    ("lpp", Shape(4, 5, 4, 2), "R = W/G = 2 must divide S = 5"),
    ("fslpp", Shape(4, 8, 4, 3), "loops G=3 to divide the workers W=4"),
])
def test_shapes_outside_a_strategy_are_refused_with_the_constraint(name, shape, constraint):
    with pytest.raises(ConfigError, match=constraint):
        simulate(get_strategy(name), shape)


def test_a_strategy_registered_from_python_runs():
    # GPipe mirrored: stage s on worker S-1-s
    mirrored = register(Strategy("mirrored-gpipe", lambda j, sh: (sh.stages - 1 - j.stage,) * 2, depth_first))
    timeline = simulate(get_strategy("mirrored-gpipe"), Shape(3, 3, 4))
    assert timeline.latency == 2 * (4 + 3 - 1) and mirrored.name == "mirrored-gpipe"
    assert {slot.job.stage for slot in timeline.by_worker[0]} == {2}


def test_a_strategy_from_a_table(tmp_path):
    rows = [f'[[job]]\nstage = {s}\nbatch = {b}\ndirection = "{d}"\nweights = {s}\ncompute = {s}\npriority = {p}\n'
            for p, (d, b, s) in enumerate((d, b, s) for d in "FB" for b in range(2) for s in range(2))]
    path = tmp_path / "two.toml"
    path.write_text('name = "hand-made"\nworkers = 2\nstages = 2\nmicro_batches = 2\n' + "".join(rows))
    strategy = load_table(str(path))
    assert simulate(strategy, Shape(2, 2, 2)).latency == 2 * (2 + 2 - 1)
    with pytest.raises(ConfigError, match="written for W=2 S=2 B=2"):
        simulate(strategy, Shape(2, 2, 4))
    path.write_text('workers = 2\nstages = 2\nmicro_batches = 2\n' + "".join(rows[:-1]))
    with pytest.raises(ConfigError, match="gives no placement for B1b1"):
        load_table(str(path))


def test_forward_and_backward_of_a_micro_batch_must_share_a_worker():
    split = Strategy("split", lambda j, sh: (0, 0 if j.direction == FORWARD else 1), depth_first)
    with pytest.raises(ConfigError, match="computed on different workers"):
        simulate(split, Shape(2, 2, 2))


def test_show_prints_the_diagram_and_the_costs():
    result = CliRunner().invoke(cli, ["schedule", "show", "--scheme", "1f1b", "-W", "4", "-S", "4", "-B", "6"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].startswith("W0  | F0b0 F0b1 F0b2 F0b3 .... .... .... B0b0 F0b4")
    assert "latency 18" in result.output
    assert str(Job(3, 5, BACKWARD)) == "B3b5"


def test_show_items_lists_each_worker_s_program_as_the_executor_runs_it():
    result = CliRunner().invoke(cli, ["schedule", "show", "--scheme", "1f1b", "-W", "2", "-S", "2", "-B", "2", "--items"])
    assert result.exit_code == 0, result.output
    worker_1 = result.output[result.output.index("worker 1, as the executor runs it:"):].splitlines()[1:]
    assert worker_1 == ["  Receive x(1, 0) from 0", "  Compute F1b0 of step 0 with w(1, 0)", "  Drop x(1, 0)",
                        "  Receive x(1, 1) from 0", "  Compute B1b0 of step 0 with w(1, 0), gradient from zero",
                        "  Send dy(0, 0) to 0", "  Drop dy(0, 0)", "  Compute F1b1 of step 0 with w(1, 0)",
                        "  Drop x(1, 1)", "  Compute B1b1 of step 0 with w(1, 0)", "  Send dy(0, 1) to 0",
                        "  Drop dy(0, 1)", "  -- the update: after the trainer has summed the loss",
                        "  Update stage 1 of step 0", "  Drop g(1, 0)", "  Drop w(1, 0)"]


# Seed 001's table, row by row. Units: one job (one stage of one micro-batch, one direction)
# takes one unit, so a latency L of the table (forward only, big-O) is 2L here with both
# passes; transfers are counted per job (forward and backward each), storage in (s, b)
# activations and in stages. Where the table's entry is big-O we check the exact figure
# it stands for and say so; the seed's own mechanical formulas are checked on every row.
def _seed_formulas_hold(strategy_name: str, shape: Shape):
    strategy, timeline = get_strategy(strategy_name), simulate(get_strategy(strategy_name), shape)
    place = {job: strategy.place(job, shape) for job in shape.jobs()}
    workers = range(shape.workers)
    receives = [sum(1 for j, (_, c) in place.items() if c == w and (before := predecessor(j, shape)) is not None
                    and place[before][1] != w) for w in workers]
    fetches = [sum(1 for j, (weights, c) in place.items() if c == w and weights != w) for w in workers]
    assert timeline.activation_receives() == receives
    assert timeline.weight_fetches() == fetches
    # "peak activation storage <= the items the worker processes"
    assert all(peak <= sum(1 for j, (_, c) in place.items() if c == w and j.direction == FORWARD)
               for w, peak in zip(workers, timeline.peak_activations()))
    return timeline


@pytest.mark.parametrize("workers,stages", [(2, 3), (4, 4), (3, 5)])
def test_seed_table_ddp_row(workers, stages):  # W = B: latency S, no transfers, storage S and S
    timeline = _seed_formulas_hold("ddp", Shape(workers, stages, workers))
    assert timeline.latency == 2 * stages
    assert timeline.peak_activations() == timeline.weights_owned() == [stages] * workers


@pytest.mark.parametrize("workers,stages", [(4, 4), (4, 3), (6, 5)])
def test_seed_table_fsdp_row(workers, stages):  # W = B >= S: latency S, S - 1 weight fetches, weight storage 1
    timeline = _seed_formulas_hold("fsdp-stage", Shape(workers, stages, workers))
    assert timeline.latency == 2 * stages and timeline.activation_receives() == [0] * workers
    owned = timeline.weights_owned()
    assert max(owned) == 1 and timeline.weight_fetches() == [2 * (stages - n) for n in owned]


@pytest.mark.parametrize("stages,batches", [(2, 4), (4, 8), (3, 7), (4, 2)])
def test_seed_table_gpipe_row(stages, batches):  # W = S: latency B + S - 1, 2B activation transfers, 1 stage
    timeline = _seed_formulas_hold("gpipe", Shape(stages, stages, batches))
    assert timeline.latency == 2 * (batches + stages - 1)
    # 2B on inner workers (B forward, B backward); the two ends receive in one direction only
    assert timeline.activation_receives() == [batches] + [2 * batches] * (stages - 2) + [batches]
    assert timeline.weights_owned() == [1] * stages
    assert timeline.peak_activations() == [batches] * stages  # the table's S is 1F1B's bound; GPipe keeps B


@pytest.mark.parametrize("workers,stages,batches,loops", [(4, 4, 8, 2), (6, 6, 12, 2), (8, 8, 16, 4), (9, 9, 9, 3),
                                                          (4, 8, 8, 2), (4, 8, 16, 2)])
def test_seed_table_lpp_first_row(workers, stages, batches, loops):  # B >= S >= W = GR
    r = workers // loops
    for name in ("lpp-breadth", "fslpp-breadth"):
        timeline = _seed_formulas_hold(name, Shape(workers, stages, batches, loops))
        # the table's B + S/G - 1 is the case S = W; in general each worker does S B / W jobs a pass
        # and the loop adds R - 1 of fill, both ways
        assert timeline.latency == 2 * (stages * batches // workers + r - 1), name
        assert sum(timeline.activation_receives()) == 2 * (stages - 1) * batches  # S - 1 hops each way
        if stages == workers:
            assert max(timeline.activation_receives()) <= 2 * batches
    assert simulate(get_strategy("lpp"), Shape(workers, stages, batches, loops)).weights_owned() == [stages // r] * workers


@pytest.mark.parametrize("workers,stages,batches,loops", [(4, 8, 2, 2), (4, 4, 2, 2), (8, 8, 4, 4), (6, 12, 3, 3)])
def test_seed_table_lpp_second_row(workers, stages, batches, loops):  # S >= W = GR >= B: latency S
    for name in ("lpp", "fslpp"):
        timeline = _seed_formulas_hold(name, Shape(workers, stages, batches, loops))
        assert timeline.latency == 2 * stages, name  # one micro-batch per loop: its S stages, there and back


@pytest.mark.parametrize("loops,stages,batches", [(2, 4, 8), (3, 9, 9), (2, 8, 8), (2, 2, 4)])
def test_seed_table_fslpp_rows(loops, stages, batches):  # W = G^2: weights on G workers, S/G stages each
    shape = Shape(loops * loops, stages, batches, loops)
    timeline = _seed_formulas_hold("fslpp", shape)
    owners = [w for w, n in enumerate(timeline.weights_owned()) if n]
    assert owners == [(loops + 1) * k for k in range(loops)]  # h(s, s) = (G + 1)(s mod G)
    assert all(timeline.weights_owned()[w] == stages // loops for w in owners)  # the table's 1 is S = G
    assert timeline.latency == simulate(get_strategy("lpp"), shape).latency  # compute placed as LPP
    non_owner = next(w for w in range(shape.workers) if w not in owners)
    assert timeline.weight_fetches()[non_owner] == len(timeline.by_worker[non_owner])  # fetches for every job


def test_schedule_show_refuses_zb1_where_train_does():
    args = ["schedule", "show", "--scheme", "zb1", "-W", "4", "-S", "2", "-B", "4"]
    replicated = CliRunner().invoke(cli, [*args, "--replicas", "2"])
    recomputed = CliRunner().invoke(cli, [*args[:-4], "-W", "2", "-S", "2", "--recompute", "stage"])
    assert "cannot yet run on stages shared by --replicas" in str(replicated.exception)
    assert "cannot yet run with --recompute stage" in str(recomputed.exception)


def test_show_with_tensor_parallelism_annotates_each_job_with_its_tensor_group_s_collectives():
    result = CliRunner().invoke(cli, ["schedule", "show", "--scheme", "1f1b", "-W", "4", "-S", "2", "-B", "2",
                                      "--tensor", "2", "--sequence-parallel", "--programs"])
    assert result.exit_code == 0, result.output
    assert "tensor group ranks [2, 3]" in result.output and "slice 1: ranks [1, 3]" in result.output
    forward = [line for line in result.output.splitlines() if line.strip().startswith("Forward F0b0")]
    assert forward == ["  Forward F0b0   | tensor group of 2: per split region (2 a block) all-gather the positions in, "
                       "reduce-scatter the output"]
    result = CliRunner().invoke(cli, ["schedule", "show", "-W", "6", "-S", "2", "--tensor", "4"])
    assert "--tensor 4 does not divide the 6 ranks" in str(result.exception)


@pytest.mark.parametrize("args,message", [
    (["-W", "4", "-S", "4096", "-B", "4"], "--stages 4096 is more than a diagram draws (at most 64 stages"),
    (["-W", "4", "-S", "4", "-B", "1000000000"],
     "--micro-batches 1000000000 is more than a diagram draws (at most 256 micro-batches"),
    (["--scheme", "1f1b", "-W", "4", "-S", "1", "-B", "2", "--replicas", "4", "--shard", "zero3", "--units",
      "100000000", "--items"], "--units 100000000 is more than a diagram draws (at most 64 units a stage"),
    (["--scheme", "ddp", "-W", "8192", "-S", "1", "-B", "8"], "--world-size 8192 is more than a diagram draws"),
    (["--scheme", "ddp", "-W", "128", "-S", "1", "-B", "128"], "a pipeline of 128 is more than a diagram draws"),
    (["--scheme", "gpipe", "-W", "8", "-S", "8", "-B", "200"],
     "--stages 8 x --micro-batches 200 = 1600 is more than a diagram draws (at most 1024 jobs"),
])
def test_show_refuses_a_step_larger_than_it_draws_in_one_sentence(args, message):
    result = CliRunner().invoke(cli, ["schedule", "show", *args])
    assert isinstance(result.exception, ConfigError) and message in str(result.exception)


def test_show_draws_the_largest_step_it_accepts():
    """64 workers and stages, 16 micro-batches (1,024 jobs): drawn, every worker a row."""
    result = CliRunner().invoke(cli, ["schedule", "show", "--scheme", "1f1b", "-W", "64", "-S", "64", "-B", "16"])
    assert result.exit_code == 0, result.output
    assert sum(line.startswith("W63 ") for line in result.output.splitlines()) == 2  # its diagram row and its costs


def test_show_s_help_states_the_bounds_it_draws_within():
    from mpipar.schedule import diagram

    help_text = " ".join(CliRunner().invoke(cli, ["schedule", "show", "--help"]).output.split())
    for bound in (diagram.DRAWN_WORKERS, diagram.DRAWN_MICRO_BATCHES, diagram.DRAWN_JOBS, diagram.DRAWN_RANKS,
                  diagram.DRAWN_UNITS):
        assert f" {bound} " in help_text


def greedy_by_scanning(strategy: Strategy, shape: Shape) -> list[tuple]:
    """The greedy rule of simulate.py written plainly: at every step scan every waiting job for
    those whose predecessor has finished and whose worker has room, and start the one ready
    first (then by priority, then by job). Returns (job, worker, start, end) in start order."""
    shape = strategy.shape(shape)
    place = {job: strategy.place(job, shape) for job in shape.jobs()}
    cap = [strategy.in_flight(w, shape) if strategy.in_flight else len(place) for w in range(shape.workers)]
    finish, free, held, slots = {}, [0.0] * shape.workers, [0] * shape.workers, []
    durations = {FORWARD: 1.0, BACKWARD: 1.0 if not shape.split else 0.5, "W": 0.5}

    def arrives(job):
        before = predecessor(job, shape)
        return job.direction == FORWARD and (before is None or place[before][1] != place[job][1])

    def departs(job):
        return job.direction == shape.last_use and (
            job.stage == 0 or place[Job(job.stage - 1, job.batch, BACKWARD)][1] != place[job][1])

    def ready_at(job):
        before = predecessor(job, shape)
        return max(free[place[job][1]], finish[before] if before is not None else 0.0)

    waiting = set(place)
    while waiting:
        ready = [job for job in waiting if (predecessor(job, shape) is None or predecessor(job, shape) in finish)
                 and not (arrives(job) and held[place[job][1]] >= cap[place[job][1]])]
        job = min(ready, key=lambda j: (ready_at(j), strategy.priority(j, shape), j))
        worker, start = place[job][1], ready_at(job)
        finish[job] = free[worker] = start + durations[job.direction]
        held[worker] += arrives(job) - departs(job)
        slots.append((job, worker, start, finish[job]))
        waiting.remove(job)
    return sorted(slots, key=lambda slot: (slot[2], slot[1]))


@pytest.mark.parametrize("name", ["ddp", "fsdp-stage", "gpipe", "1f1b", "zb1", "lpp", "fslpp", "lpp-breadth",
                                  "fslpp-breadth"])
def test_the_simulator_keeps_the_greedy_rule_of_scanning_every_waiting_job(name):
    """simulate.py keeps the jobs whose predecessor has finished as they finish, instead of scanning
    all that wait at every step (which made a step of 1,024 micro-batches take seconds): the same
    timelines, on every shape the strategy accepts."""
    compared = 0
    for workers, stages, batches, loops in [(1, 1, 3, 1), (2, 2, 5, 1), (4, 4, 8, 1), (4, 8, 8, 2), (2, 4, 6, 2),
                                            (8, 8, 12, 2), (4, 2, 4, 1), (4, 1, 4, 1), (9, 9, 9, 3)]:
        strategy, shape = get_strategy(name), Shape(workers, stages, batches, loops)
        try:
            strategy.validate(shape)
        except ConfigError:  # a shape the strategy refuses
            continue
        timeline = simulate(strategy, shape)
        assert [(s.job, s.worker, s.start, s.end) for s in timeline.slots] == greedy_by_scanning(strategy, shape)
        compared += 1
    assert compared
