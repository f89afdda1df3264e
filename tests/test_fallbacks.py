"""The trainer runs no op on the CPU (issue 49, ask 4) but those whose output's shape depends on the values, checked
over torch's own OpInfo database on real torch_xla SPMD with 4 virtual CPU devices. tests/fallbacks.py runs
SAMPLES samples of each entry of ENTRIES (op_db's nn.functional.* and the common tensor ops) forward and backward,
and reads which of torch_xla's aten:: CPU-fallback counters grow. Each group of entries runs twice, on plain
torch_xla and under the trainer's kernels, side by side. The counts of both are printed (-s).
"""

import json
import signal
import subprocess

import pytest

import child
import fallbacks

pytestmark = [pytest.mark.xla, child.requires("torch_xla", "expecttest")]  # op_db imports expecttest

N_GROUPS = 12  # ~15 entries a process (~1 s each for op_db and the device, warm); round-robin spreads the pools
GROUPS = {f"g{i}": fallbacks.ENTRIES[i::N_GROUPS] for i in range(N_GROUPS)}
MODES = {"plain": {}, "trainer": {"SEAMLESS_TPU_DEVICE": "xla"}}
TIMEOUT = 300  # per process


def start(mode, names):
    env = child.env(drop=child.DEVICE_VARS, **child.XLA_ON_CPU, PYTHONUNBUFFERED="1", **MODES[mode])
    return child.popen(["tests/fallbacks.py", mode, *names], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)


def finish(proc, log):
    """The process's exit code and {name: outcome} of the entries it ended (its ENTRY lines); its stderr goes to
    `log`."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log.extend(err.splitlines())
    done = {}
    for line in out.splitlines():
        if line.startswith("ENTRY "):
            done.update(json.loads(line[len("ENTRY "):]))
    if proc.returncode == 0:
        assert child.result(out) == done
    else:  # a signal (SIGSEGV, SIGFPE, SIGABRT) is an entry's crash; an exit code is the script's own error
        assert proc.returncode < 0, f"tests/fallbacks.py exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    return proc.returncode, done


def collect(mode, names, proc, log):
    """{name: outcome} of `names` from `proc`, which runs them in order. Where it died, the entry it died in runs
    alone ("crashed: SIGSEGV" if that dies too) and the entries after it in a process of their own: a crash costs
    one entry, not the group."""
    returncode, done = finish(proc, log)
    if returncode == 0:
        return done
    died_in, rest = names[len(done)], names[len(done) + 1:]
    returncode, alone = finish(start(mode, [died_in]), log)
    done[died_in] = alone[died_in] if returncode == 0 else [f"crashed: {signal.Signals(-returncode).name}"]
    if rest:
        done.update(collect(mode, rest, start(mode, rest), log))
    return done


def on_cpu(outcome):
    return {x for x in outcome if x.startswith("aten::")}


def test_the_lists_name_entries_once():
    """DYNAMIC and STILL_ON_CPU name entries of ENTRIES, each once and in one list; every entry is in one group."""
    listed = fallbacks.DYNAMIC + fallbacks.STILL_ON_CPU
    assert len(set(listed)) == len(listed) and set(listed) <= set(fallbacks.ENTRIES)
    assert sorted(name for names in GROUPS.values() for name in names) == fallbacks.ENTRIES
    assert len(fallbacks.ENTRIES) == len(set(fallbacks.ENTRIES)) == 179


@pytest.mark.parametrize("group", list(GROUPS))
def test_the_trainer_runs_on_the_cpu_only_what_is_listed(group):
    """Per entry of the group, the aten:: counters its samples grow on plain torch_xla and under the trainer (the two
    processes start together: a core each on CI). Under the trainer: (a) an entry falls back only if DYNAMIC (its
    output's shape depends on the values) or STILL_ON_CPU lists it; (b) every listed entry still falls back, so a
    lowering that lands takes its entry off the list; (c) no counter grows that does not grow on plain torch_xla;
    (d) no entry raises or crashes that plain torch_xla runs (crashes, on both: roll of a (0, 0, 0) tensor, SIGFPE;
    nll_loss of an unbatched input, shape (C,) with a 0-d target, SIGSEGV in the forward)."""
    names = GROUPS[group]
    procs, logs = {mode: start(mode, names) for mode in MODES}, {mode: [] for mode in MODES}
    try:
        plain, trainer = (collect(mode, names, proc, logs[mode]) for mode, proc in procs.items())
    finally:  # the other one, when one failed
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert plain.keys() == trainer.keys() == set(names)
    fell_back = {mode: sorted(name for name, outcome in run.items() if on_cpu(outcome))
                 for mode, run in (("plain", plain), ("trainer", trainer))}
    counts = (f"{group}, {len(names)} entries: plain torch_xla runs {len(fell_back['plain'])} partly on the CPU; the "
              f"trainer {len(fell_back['trainer'])}")
    print(counts, *(f"  {name}: plain {plain[name]}, trainer {trainer[name]}" for name in names
                    if plain[name] or trainer[name]), sep="\n")
    # first: a crash under the trainer hides what else the entry would run on the CPU
    broken = {name: trainer[name] for name in names if set(trainer[name]) - set(plain[name]) - on_cpu(trainer[name])}
    assert not broken, f"{counts}. Under the trainer these raise or crash, not on plain torch_xla: {broken}\n" + \
        "\n".join(line for line in logs["trainer"] if line.startswith(tuple(f"{name}: " for name in broken)))
    listed = set(fallbacks.DYNAMIC) | set(fallbacks.STILL_ON_CPU)
    unlisted = {name: trainer[name] for name in fell_back["trainer"] if name not in listed}
    assert not unlisted, f"{counts}. Under the trainer these run on the CPU, and no list names them: {unlisted}"
    stale = sorted(name for name in listed & set(names) if not on_cpu(trainer[name]))
    assert not stale, f"{counts}. These no longer run on the CPU under the trainer: take them off their list: {stale}"
    worse = {name: sorted(on_cpu(trainer[name]) - on_cpu(plain[name])) for name in names
             if not any(x.startswith("crashed") for x in plain[name]) and on_cpu(trainer[name]) - on_cpu(plain[name])}
    assert not worse, f"{counts}. Under the trainer these run ops on the CPU that plain torch_xla does not: {worse}"
