"""save_checkpoint(..., blocking=False) and whatever reads the checkpoint next, on the device the env picks
(test_seamless_tpu.py runs it on the CPU, tests/test_real_xla.py on 4 XLA devices).

    python tests/async_saves.py DIR   # reports {...} (child.report) and exits while a failing save nobody asked
                                      # about is in flight: the exit must report it on stderr and leave no attempt

Each commit is held back a second (faults.slow_commit), so that every reader runs while the save it must wait for
is still in flight.
"""

import contextlib
import os
import re
import sys

import torch

import child
import faults
import seamless_tpu as st


def attempts(directory):
    return sorted(name for name in os.listdir(directory) if name.startswith("save-"))


def main(directory):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    trainer = st.SeamlessTPUTrainer(model, strategy="fsdp")
    result = {}
    with faults.slow_commit(1):
        trainer.save_checkpoint(directory, model=model, epoch=1)
        trainer.save_checkpoint(directory, blocking=False, model=model, epoch=2)
        result["consolidated"] = st.consolidate_checkpoint(directory)["epoch"]  # waits for epoch 2's commit
        trainer.save_checkpoint(directory, blocking=False, model=model, epoch=3)
        result["loaded"] = trainer.load_checkpoint(directory, model=model)["epoch"]  # waits for epoch 3's commit
    # never closed: the last save below is still committing when main returns
    contextlib.ExitStack().enter_context(faults.failing_commit(OSError(28, "No space left on device"), after=1))
    future = trainer.save_checkpoint(directory, blocking=False, model=model, epoch=4)
    try:
        future.result(timeout=120)
    except OSError as e:
        result["asked"] = str(e)
    result["attempts_after_failure"] = len(attempts(directory))  # the committed one only
    not_a_directory = os.path.join(directory, "LATEST", "ckpt")  # under a file
    try:
        trainer.save_checkpoint(not_a_directory, blocking=False, model=model, epoch=5)
    except OSError as e:  # raised at the call: nothing was captured, nothing is in flight
        result["bad_path"] = type(e).__name__
    child.report(result)
    trainer.save_checkpoint(directory, blocking=False, model=model, epoch=6)  # fails, and nobody asks


def run(directory, env):
    """This script on the device `env` picks: its report, and what its exit printed on stderr."""
    out = child.run(["tests/async_saves.py", directory], env=child.env(**env), timeout=300)
    return child.result(out.stdout), out.stderr


def check(directory, result, stderr):
    """Readers waited for the save in flight, a failed save left no attempt, a bad path raised at the call, and
    the failure nobody asked about was reported at exit, the checkpoint before it still the one that loads."""
    assert result == {"consolidated": 2, "loaded": 3, "asked": "[Errno 28] No space left on device",
                      "attempts_after_failure": 1, "bad_path": "NotADirectoryError"}, result
    assert re.search(r"save_checkpoint\(\.\.\., blocking=False\) to '.*save-[0-9]+-[0-9]+' failed, and nothing asked "
                     r"its Future: OSError: \[Errno 28\] No space left on device\. That attempt was "
                     r"removed", stderr), stderr
    assert attempts(directory) and len(attempts(directory)) == 1, os.listdir(directory)
    assert st.consolidate_checkpoint(directory)["epoch"] == 3


if __name__ == "__main__":
    main(sys.argv[1])
