"""The trainer's XLA kernels keep torch's contracts (issue 39), checked with torch's own OpInfo database on real
torch_xla SPMD with 4 virtual CPU devices. tests/opinfo.py runs the OpInfo entries of every kernel and F patch
(opinfo.OPINFO_NAMES) on XLA against the CPU: forward values, shapes and dtypes, first and second gradients, vmap.
Each group of entries runs twice, on plain torch_xla and under the trainer's kernels: every sample plain torch_xla
gets right must stay right under the trainer. What the trainer fixes, and what neither gets right, is printed (-rA).
"""

import pytest

import child
import opinfo
import seamless_tpu as st

pytestmark = [pytest.mark.xla, child.requires("torch_xla", "expecttest")]  # op_db imports expecttest



def test_every_lowering_has_opinfo_entries():
    """A lowering added to _LOWERINGS (a kernel, or a function patched in F) is covered the day it lands:
    OPINFO_NAMES names it, with entries, and a group runs each entry."""
    assert set(opinfo.OPINFO_NAMES) == set(st._LOWERINGS)
    assert all(opinfo.OPINFO_NAMES.values())
    assert sorted(name for names in opinfo.GROUPS.values() for name in names) == opinfo.NAMES


@pytest.mark.parametrize("group", list(opinfo.GROUPS))
def test_every_sample_plain_torch_xla_gets_right_stays_right_under_the_trainer(group):
    """Per OpInfo sample (at most 10 an entry): the forward within 1e-5 with the CPU's shape and dtype, the gradient
    within 1e-5, the second gradient (wrt the inputs and the cotangents) within 1e-4 (a first gradient without the
    graph the CPU's has: "no second derivative"), vmap over a batch of two within 1e-5; a value beyond those only as
    close to the float64 answer as twice the CPU's own float32 one (opinfo.as_rounded). A sample that kills plain
    torch_xla's process (opinfo.CRASHES) is one the trainer lowers to get right. The two runs start together (a core
    each on CI)."""
    plain_stays_right(opinfo.GROUPS[group])


# The entries whose samples reach the trainer's dot (_xla_dot) through every product lowering: einsum itself, matmul's
# batched and > 2-D products, linear on > 2-D inputs, SDPA's two products, grouped convolutions' einsum
PRODUCTS = ["einsum", "matmul", "nn.functional.linear", "nn.functional.scaled_dot_product_attention",
            "nn.functional.conv2d"]


def test_the_products_keep_their_contract_at_the_highest_matmul_precision():
    """Issue 60: at set_mat_mul_precision("highest") (both runs) each dot of the trainer's products is a call of its
    own HLO, with the precision, rather than torch_xla's _xla_dot_general: the same contract, forward, both
    derivatives and vmap, as the test above checks at the default precision (~30 s: 47 samples)."""
    plain_stays_right(PRODUCTS, {opinfo.PRECISION_VAR: "highest"})


def plain_stays_right(names, extra=None):
    """Runs the OpInfo `names` on plain torch_xla and under the trainer (with `extra` env), side by side, and fails on
    a sample plain torch_xla gets right and the trainer does not; prints the rest."""
    # LLVM's optimisations off (child.XLA_ON_CPU): the tier compiles one graph per sample and process (~560), each
    # ~3x faster (19 graphs: 27-35 s to 11 s); all 279 samples' statuses on plain torch_xla are the same either way
    env = dict(child.XLA_ON_CPU, PYTHONUNBUFFERED="1", **(extra or {}))
    outs = child.run_together([(["tests/opinfo.py", mode, *names], child.env(drop=child.DEVICE_VARS, **env, **own))
                               for mode, own in (("plain", {}), ("trainer", {"SEAMLESS_TPU_DEVICE": "xla"}))],
                              timeout=580)
    plain, trainer = map(child.result, outs)
    assert plain.keys() == trainer.keys() == set(names)
    regressed, fixed, neither, counts = [], [], [], []
    for name in names:
        assert [s[:2] for s in plain[name]] == [s[:2] for s in trainer[name]]  # the same samples, in order
        skipped = [s for s in plain[name] if s[2].startswith("skipped")]  # the CPU itself rejects them
        before = len(regressed)
        for (i, shown, was), (_, _, now) in zip(plain[name], trainer[name]):
            line = f"{name} #{i} {shown}\n    trainer: {now}\n    plain:   {was}"
            if (was == "ok" or was.startswith("crashes")) and now != "ok":  # a crash plain: lowered to fix it
                regressed.append(line)
            elif was != "ok" and not was.startswith("skipped"):
                (fixed if now == "ok" else neither).append(line)
        ok = [sum(s[2] == "ok" for s in run[name]) for run in (plain, trainer)]
        counts.append(f"{name}: {len(plain[name])} samples ({len(skipped)} skipped), plain {ok[0]} ok, trainer "
                      f"{ok[1]} ok, {len(regressed) - before} regressed")
    for title, lines in (("per entry", counts), ("the trainer fixes", fixed), ("neither gets right", neither)):
        print(f"{title} ({len(lines)}):", *lines, sep="\n")
    assert not regressed, f"{len(regressed)} samples plain torch_xla gets right break under the trainer:\n" + \
        "\n".join(regressed)
