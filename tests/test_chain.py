"""ChainQueue: later collectives of chains start in posting order, whatever finishes first."""

from mpipar.comms.chain import ChainQueue


class FakeHandle:
    """A collective that completes when the test says so."""

    def __init__(self, name, log):
        self.name, self.complete = name, False
        log.append(f"start {name}")

    def test(self):  # Handle's polling method (not a test): complete yet?
        return self.complete

    def wait(self):
        self.complete = True


def two_step_chain(name, log, handles):
    first = FakeHandle(f"{name}.1", log)
    handles[f"{name}.1"] = first
    yield first
    log.append(f"work {name}")
    second = FakeHandle(f"{name}.2", log)
    handles[f"{name}.2"] = second
    yield second
    log.append(f"done {name}")


def test_a_later_chain_whose_first_collective_finished_first_waits_for_the_head():
    log, handles, queue = [], {}, ChainQueue()
    queue.post(two_step_chain("a", log, handles))
    queue.post(two_step_chain("b", log, handles))
    assert log == ["start a.1", "start b.1"]  # first collectives start when posted
    handles["b.1"].complete = True  # b's first step finishes first on this rank...
    queue.poll()
    assert "start b.2" not in log  # ...but b may not start its second collective before a does
    handles["a.1"].complete = True
    queue.poll()
    assert log[2:] == ["work a", "start a.2"]  # a moved on; b is still behind it
    handles["a.2"].complete = True
    queue.poll()
    assert log[4:] == ["done a", "work b", "start b.2"]
    queue.drain()
    assert log[-1] == "done b" and len(queue) == 0


def test_a_chain_without_collectives_runs_at_once():
    log, queue = [], ChainQueue()

    def local_only():
        log.append("ran")
        return
        yield

    queue.post(local_only())
    assert log == ["ran"] and len(queue) == 0
