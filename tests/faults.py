"""The tests' fault-injection seams, named once: a checkpoint commit that is slow, held, failing or never
comes (st._commit_checkpoint, the step that makes a save the checkpoint), and a SIGTERM that lands at a known
point of a run. A plain module, not a test module: tests use it in-process, child scripts (tests/preempt.py,
tests/async_saves.py, ...) and `python -c` snippets import it the same way.

    with faults.slow_commit(1):                     # every commit in the block takes a second more
    with faults.slow_commit(until=path, started=flag):  # writes `flag`, then commits once `path` exists
    with faults.held_commit(gate):                  # commits once the threading.Event `gate` is set
    with faults.failing_commit(OSError(28, "No space left on device"), after=1):
    faults.await_sigterm(ready)                     # writes `ready`, returns once SIGTERM reached this process

A save with blocking=False commits on a thread after the call returns: keep the block open until its Future is
done (or, for a save in flight at exit, never close it: contextlib.ExitStack().enter_context(...)).
"""

import os
import time

import seamless_tpu as st

WAIT_S = 120  # no fault waits longer: a test that never sends what it waits for fails, it does not hang


def _touch(path):
    open(path, "w").close()


def _wait_for(done, what):
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S} s for {what}")
        time.sleep(0.01)


class _commit_replaced:
    """st._commit_checkpoint replaced by make(real commit) for the block, put back after it. A class, not a
    generator: one entered and never exited stays in place even once nothing refers to it (a generator's
    finally would run when it is collected, putting the real commit back under a save still in flight)."""

    def __init__(self, make):
        self.make = make

    def __enter__(self):
        self.real = st._commit_checkpoint
        st._commit_checkpoint = self.make(self.real)

    def __exit__(self, *exc):
        st._commit_checkpoint = self.real


def slow_commit(seconds=0.0, *, started=None, until=None):
    """Each commit first writes the file `started` (if given), then waits `seconds`, then (if given) until the
    file `until` exists, and then commits: every shard is on disk, and the save is not yet the checkpoint."""

    def make(commit):
        def slow(*args):
            if started is not None:
                _touch(started)
            time.sleep(seconds)
            if until is not None:
                _wait_for(lambda: os.path.exists(until), f"{until} before committing")
            return commit(*args)
        return slow

    return _commit_replaced(make)


def held_commit(gate):
    """Each commit waits (at most WAIT_S) for the threading.Event `gate`, then commits."""

    def make(commit):
        def held(*args):
            if not gate.wait(WAIT_S):
                raise TimeoutError(f"the commit was held {WAIT_S} s and never released")
            return commit(*args)
        return held

    return _commit_replaced(make)


def failing_commit(error, *, after=0.0):
    """Each commit raises `error` after `after` seconds: a full disk, a lost mount, found once every shard is
    written."""

    def make(commit):
        def failing(*args):
            time.sleep(after)
            raise error
        return failing

    return _commit_replaced(make)


def sigterm_reached():
    """True once SIGTERM has reached this process's trainer (its handler ran)."""
    return st._STATE.preemption.sigterm


def await_sigterm(ready):
    """Write the file `ready` (the test's cue to send SIGTERM), then return once the signal has reached this process:
    it lands here, at a known point of the run, whatever the machine's speed."""
    _touch(ready)
    _wait_for(sigterm_reached, f"SIGTERM after writing {ready}")
