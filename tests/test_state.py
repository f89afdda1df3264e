"""Fast tier: what the module remembers between calls, and what each trainer keeps for itself.

One process-state object holds everything; _reset_caches() (the tests' one line) also undoes every
process-wide change to torch. A trainer keeps the mesh and batch sharding it started with, whatever
a later trainer or create_xla_mesh does to the process mesh.
"""

import dataclasses
import itertools
import math
import os
import pathlib
import signal
import sys

import pytest
import torch
from torch.optim import optimizer as optim_module

import scenarios
import seamless_tpu as st
from fake_torch_xla import FakeXLA

pytestmark = pytest.mark.fast

DEVICES = ",".join(map(str, range(16)))
ALL_16, ALL_16_1D = f"{{devices=[16,1]{DEVICES}}}", f"{{devices=[16]{DEVICES}}}"  # dim 0 over all 16 devices


def sharding(t):
    return sys.modules["torch_xla"]._XLAC._get_xla_sharding_spec(t)


@pytest.fixture
def four_hosts(monkeypatch, fresh):
    """The fake torch_xla as one of 4 SPMD processes of a 16-device slice."""
    FakeXLA(num_devices=16, process_count=4).install(monkeypatch)
    monkeypatch.setattr(st, "_agreement_group", lambda: None)  # its 3 peers do not exist (real: test_real_xla.py)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    return st


def batches_of(trainer):
    data = torch.utils.data.TensorDataset(torch.ones(64, 10), torch.ones(64))
    return next(iter(trainer.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=16))))


def replace_process_mesh(how):
    config = {"mesh_shape": [4, 4], "axis_names": ["data", "model"]}
    if how == "second trainer":
        st.SeamlessTPUTrainer(scenarios.mlp(), device="xla", xla_spmd_config=config, tp_plan=scenarios.MLP_PLAN)
    else:
        st.create_xla_mesh(xla_spmd_config=config)
    assert st.get_xla_mesh().axis_names == ("data", "model")  # the process mesh did change


@pytest.mark.parametrize("how", ["second trainer", "create_xla_mesh"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_later_mesh_leaves_an_earlier_trainers_batches_alone(four_hosts, how, strategy):
    """The default multi-host mesh splits the batch over all 16 devices; it stays so for trainer A
    after the process mesh becomes a data x model one (there the batch goes over `data` only)."""
    a = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla", strategy=strategy)
    assert sharding(a.to_device(torch.ones(16, 10))) == ALL_16
    replace_process_mesh(how)
    assert sharding(st.to_device(torch.ones(16, 10))).startswith("{devices=[4,1,4]"), (
        "to_device follows the process mesh"
    )
    x, y = a.to_device(torch.ones(16, 10), torch.ones(16))
    assert sharding(x) == ALL_16 and sharding(y) == ALL_16_1D
    x, y = batches_of(a)
    assert sharding(x) == ALL_16 and sharding(y) == ALL_16_1D


def test_a_user_mesh_with_a_model_axis_keeps_its_data_split(four_hosts):
    xs = sys.modules["torch_xla.distributed.spmd"]
    mesh = xs.Mesh(list(range(16)), (4, 4), ("data", "model"))
    a = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla", mesh=mesh, tp_plan=scenarios.MLP_PLAN)
    want = sharding(a.to_device(torch.ones(16, 10)))
    assert want.startswith("{devices=[4,1,4]") and want.endswith("last_tile_dim_replicate}")
    st.SeamlessTPUTrainer(scenarios.mlp(), device="xla", strategy="fsdp")  # the process mesh is now ("data", "fsdp")
    assert sharding(a.to_device(torch.ones(16, 10))) == want
    assert sharding(batches_of(a)[0]) == want


def test_a_trainers_batch_sharding_is_built_once(four_hosts, monkeypatch):
    a = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla")
    replace_process_mesh("create_xla_mesh")

    def refuse(*args, **kwargs):
        raise AssertionError("a batch sharding was built again after the trainer's own")

    monkeypatch.setattr(st._BatchSharding, "for_mesh", refuse)
    for _ in range(3):
        assert sharding(a.to_device(torch.ones(16, 10))) == ALL_16
    assert sharding(batches_of(a)[0]) == ALL_16


def test_default_ddp_mesh_has_no_model_axis_whatever_the_host_count(four_hosts):
    """A `model` axis carries the model; the default ddp mesh carries only the batch, so it has none."""
    trainer = st.SeamlessTPUTrainer(scenarios.mlp(), device="xla")
    assert (tuple(trainer.mesh.mesh_shape), tuple(trainer.mesh.axis_names)) == ((16,), ("data",))
    assert st.mesh_shape_for(16, 4) == ((16,), ("data",))
    assert st.mesh_shape_for(16, 4, strategy="fsdp") == ((4, 4), ("data", "fsdp"))


def kernels_at_autograd_xla():
    """The aten ops whose kernel for XLA tensors at their lowering's key (AutogradXLA, or XLA: addmm, average pooling,
    cdist, pdist) is ours: one registered from Python (torch_xla has its own C++ einsum, addmm, avg_pool2d, ... there
    once its library is loaded; torch's composites have none)."""
    def active(op):
        return torch._C._dispatch_dump(f"aten::{op}").partition(f"\n{st._LOWERINGS[op].key}: ")[2].partition("\n")[0]
    return {op for op in st._LOWERINGS if not st._LOWERINGS[op].functional and ".py:" in active(op)}


def kernels_at_autocast_xla():
    """The products whose AutocastXLA kernel is ours (7c's _autocast_cast; torch's own is C++)."""
    def active(op):
        return torch._C._dispatch_dump(f"aten::{op}").partition("\nAutocastXLA: ")[2].partition("\n")[0]
    return {op for op in st._AUTOCAST_CASTS if ".py:" in active(op)}


def aten_lowerings():
    return {op for op, lowering in st._LOWERINGS.items() if not lowering.functional}


def test_reset_undoes_every_process_wide_change(fake):
    ckpt, F = torch.utils.checkpoint, torch.nn.functional
    functionals = (F.multi_head_attention_forward, F.embedding_bag, F.gaussian_nll_loss)
    originals = (
        ckpt.CheckpointFunction,
        ckpt._CheckpointFrame.__init__,
        torch.__future__.get_swap_module_params_on_conversion(),
        *functionals,
        torch.nn.Module.to,
        torch.inference_mode.__enter__,
    )
    hooks = len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)
    assert kernels_at_autograd_xla() == set() and kernels_at_autocast_xla() == set()
    st.get_device()
    assert ckpt.CheckpointFunction is not originals[0] and ckpt._CheckpointFrame.__init__ is not originals[1]
    now = (F.multi_head_attention_forward, F.embedding_bag, F.gaussian_nll_loss)
    assert all(new is not old for new, old in zip(now, functionals)), "the batch-keeping functionals are not in"
    assert kernels_at_autograd_xla() == aten_lowerings(), "the batch-keeping kernels are not in"
    assert kernels_at_autocast_xla() == set(), "not before a weight is split by fsdp: ddp never pays for them"
    assert {"group_norm", "batch_norm", "matmul", "kl_div", "upsample_bilinear2d.vec", "conv2d"} <= aten_lowerings()
    assert not torch.__future__.get_swap_module_params_on_conversion(), "only inside a module's .to(xla)"
    assert torch.nn.Module.to is not originals[-2], "a module's .to(xla) keeps its Parameters"
    assert torch.inference_mode.__enter__ is not originals[-1], "inference_mode is no_grad on XLA"
    with torch.inference_mode():
        assert not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert not torch.ones(1).is_inference()
    assert hasattr(torch, "xla")
    assert len(optim_module._global_optimizer_pre_hooks) == hooks[0] + 1, "one pre-step hook"
    assert len(optim_module._global_optimizer_post_hooks) == hooks[1] + 1, "one post-step hook"
    state = st._STATE
    assert state.xla_device is not None and state.mesh is not None and len(state.torch_patches) == 9
    st.SeamlessTPUTrainer(scenarios.mlp(), strategy="fsdp")
    assert kernels_at_autocast_xla() == {"linear", "matmul", "einsum", "conv1d", "conv2d", "conv3d"}
    st._reset_caches()
    assert (
        ckpt.CheckpointFunction,
        ckpt._CheckpointFrame.__init__,
        torch.__future__.get_swap_module_params_on_conversion(),
        F.multi_head_attention_forward, F.embedding_bag, F.gaussian_nll_loss, torch.nn.Module.to,
        torch.inference_mode.__enter__,
    ) == originals
    with torch.inference_mode():
        assert torch.ones(1).is_inference(), "torch's own again"
    assert kernels_at_autograd_xla() == set(), "the dispatcher is back to torch's composite kernels"
    assert kernels_at_autocast_xla() == set(), "and to torch's autocast kernels"
    assert not hasattr(torch, "xla") and "torch.xla" not in sys.modules
    assert (len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)) == hooks
    assert st._STATE is not state and st._STATE.xla_device is None and st.get_xla_mesh() is None


def test_every_op_a_kernel_hands_back_to_torch_is_checked_for_a_composite_at_registration(fake, monkeypatch):
    """A kernel hands the inputs it leaves to torch to the op's composite (_torch_path), and .decompose() of an op
    without one returns NotImplemented: adaptive_max_pool2d's did, and AdaptiveMaxPool2d(1) crashed a conv net's first
    step with "Object of type 'NotImplementedType' is not an instance of 'sequence'". So a lowering declares in the
    table that it hands back, each such op is checked when the kernels are registered, and one that does not declare
    it cannot hand back."""
    with pytest.raises(RuntimeError, match="the lowering of adaptive_max_pool2d does not declare hands_back=True"):
        st._torch_path("adaptive_max_pool2d")
    with pytest.raises(RuntimeError, match="the lowering of softmax does not declare"):
        st._torch_path("softmax")
    assert st._torch_path("multi_head_attention_forward") is torch.nn.functional.multi_head_attention_forward
    for op in ("adaptive_max_pool2d", "glu"):
        monkeypatch.setitem(st._LOWERINGS, op, dataclasses.replace(st._LOWERINGS[op], hands_back=True))
    with pytest.raises(RuntimeError, match=r"no composite kernel for aten ops \['glu', 'adaptive_max_pool2d'\]|"
                                           r"no composite kernel for aten ops \['adaptive_max_pool2d', 'glu'\]"):
        st.get_device()
    assert kernels_at_autograd_xla() == set(), "nothing is registered when the check fails"


def test_the_lowering_table_is_the_header_s_and_the_docs_list(fresh):
    """_LOWERINGS is the one list of the trainer's lowerings: the header's list of process-wide changes names each
    family, and docs/design.md each family and each functional patch."""
    design = (pathlib.Path(__file__).parents[1] / "docs" / "design.md").read_text()
    families = {lowering.family for lowering in st._LOWERINGS.values()}
    assert families == {"products", "attention", "norms", "pointwise", "masks", "losses", "reductions", "pooling",
                        "windows", "resampling", "views"}
    for family in families:
        assert family in st.__doc__ and f"**{family}**" in design, family
    for op, lowering in st._LOWERINGS.items():
        assert lowering.why in ("batch", "cpu", "grad2", "crash", "refused"), op
        assert not lowering.functional or f"F.{op}" in st.__doc__ and f"F.{op}" in design, op


def test_activation_patches_torch_once_per_process_state(fake):
    """A second activation in a fresh state (the fake Ray worker group swaps states) wraps nothing twice."""
    st.get_device()
    routed, first = torch.utils.checkpoint.CheckpointFunction, st._STATE
    st._STATE = st._ProcessState()  # what a second fake worker sees; the first one's patches are still in
    try:
        linear = torch.nn.functional.linear
        st.get_device()
        assert torch.utils.checkpoint.CheckpointFunction is routed and torch.nn.functional.linear is linear
    finally:
        st._reset_caches()
        st._STATE = first  # _reset_caches (the fixture's) undoes the first state's patches and hooks too


def test_ray_classes_live_in_one_cache_not_in_module_globals(fresh):
    pytest.importorskip("ray.train.torch")
    config = st.TorchConfig(backend="xla_tpu")
    assert type(config) is st.TorchConfig and st.TorchTrainer is st._ray_classes()["TorchTrainer"]
    assert not {"TorchConfig", "TorchTrainer", "_XlaSpmdBackend"} & set(vars(st)), "the factory wrote module globals"
    assert type(config).__module__ == st.__name__ and type(config).__qualname__ == "TorchConfig"


# --- preemption: SIGTERM becomes trainer.preempted at the next optimizer step ----------------------


@pytest.fixture
def sigterm_restored():
    """The test process's SIGTERM handler, put back whatever the test does."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def one_step(model, optimizer):
    optimizer.zero_grad()
    model(torch.ones(2, 10)).sum().backward()
    optimizer.step()


def test_sigterm_chains_the_users_handler_and_preempts_at_the_next_step(no_xla, fresh, sigterm_restored):
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    one_step(model, optimizer)
    assert not trainer.preempted
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM], "the user's handler still runs"
    assert not trainer.preempted, "not before a step has ended"
    one_step(model, optimizer)
    assert trainer.preempted
    st._reset_caches()
    assert (
        signal.getsignal(signal.SIGTERM) is not None
        and signal.getsignal(signal.SIGTERM)(0, None) is None
        and seen[-1] == 0
    ), "reset puts the user's handler back"


def test_a_user_who_ignores_sigterm_keeps_ignoring_it(no_xla, fresh, sigterm_restored):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    st.SeamlessTPUTrainer(scenarios.mlp(), device="cpu")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_slice_without_a_process_group_agrees_over_its_hosts_addresses(monkeypatch, fresh):
    """Multi-host XLA with no torch.distributed group: the agreement's store is served by process 0 at the address
    the runtime names (MASTER_ADDR where the user set one), so each host needs nothing but the slice's own env.
    tests/test_real_xla.py runs the agreement itself on 2 real processes, and (scenarios.py
    runtime_answers_and_refuses_as_torch_xla_does) the address off TPU, where only MASTER_ADDR names it."""
    FakeXLA(num_devices=8, process_count=2, pjrt_device="TPU").install(monkeypatch)  # worker 0's address: TPU only
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert st._xla_processes() == (1, 0, None), "before XLA is in use, one process"
    st.get_device("xla")
    assert st._xla_processes() == (2, 0, "10.0.0.2")
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    assert st._xla_processes() == (2, 0, "10.9.9.9")


def test_sigterm_delays_the_default_exit_only_until_the_loop_saves(no_xla, fresh, sigterm_restored):
    """No handler of the user's: SIGTERM's default exit waits for the loop, and a loop that steps on past
    trainer.preempted is stopped there with the rule, never left running as if no signal had come."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    model = scenarios.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = st.SeamlessTPUTrainer(model, device="cpu")
    os.kill(os.getpid(), signal.SIGTERM)  # the process lives on
    one_step(model, optimizer)
    assert trainer.preempted
    with pytest.raises(RuntimeError) as info:
        one_step(model, optimizer)
    assert str(info.value) == (
        "seamless_tpu: SIGTERM reached this run and trainer.preempted turned True at optimizer step 1, but the loop "
        "stepped again. The trainer delays SIGTERM's exit only until the loop saves: after optimizer.step(), "
        "`if trainer.preempted: trainer.save_checkpoint(...); break` (under Ray, also ray.train.report(..., "
        "checkpoint=...)). To train on through a SIGTERM, install your own SIGTERM handler before creating the "
        "trainer; it is chained, and nothing is stopped")


def test_ray_workers_exit_is_held_while_a_trainer_can_save_and_the_attempt_then_fails(no_xla, fresh, sigterm_restored):
    """A Ray worker's own SIGTERM handler raises SystemExit at once. The backend catches SIGTERM on the
    worker's main thread before the loop starts: with no trainer yet, Ray's exit runs as before; with one,
    it waits for the loop, and a loop that saved and returned ends its attempt as failed, so that Ray
    restarts the run from the reported checkpoint instead of finishing it."""
    exits = []

    def ray_exit(signum, frame):
        exits.append(signum)

    ray_exit.__module__ = "ray._private.worker"  # Worker.main_loop's handler
    signal.signal(signal.SIGTERM, ray_exit)
    st._catch_sigterm()  # what _XlaSpmdBackend/_RayTorchBackend.on_start run on each worker
    os.kill(os.getpid(), signal.SIGTERM)
    assert exits == [signal.SIGTERM], "before a trainer exists, Ray's exit is not held"
    st._reset_caches()  # a new worker: that one has exited

    def loop(config):
        model = scenarios.mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = st.SeamlessTPUTrainer(model, device="cpu")
        for step in range(5):
            one_step(model, optimizer)
            if trainer.preempted:
                return step
            if config["signal"]:
                os.kill(os.getpid(), signal.SIGTERM)
        return config

    with pytest.raises(
        RuntimeError,
        match=r"preempted \(SIGTERM\) at optimizer step 2; the loop returned after it, so this "
        r"attempt ends as failed .*FailureConfig\(max_failures=N\)",
    ):
        st._RayTrainLoop(loop)({"signal": True})
    assert exits == [signal.SIGTERM], "held while the trainer could save"
    st._reset_caches()
    assert st._RayTrainLoop(loop)({"signal": False}) == {"signal": False}, (
        "a run not preempted returns the loop's value"
    )


BAD_INPUTS = {  # op -> arguments torch refuses (beside the first, the input, built from its shape)
    "glu": [((3, 5), -1)],
    "channel_shuffle": [((2, 5, 3), 2), ((2, 4, 3), 0)],
    "adaptive_max_pool2d": [((2, 3), [2, 2]), ((1, 0, 3, 3), [2, 2])],
    "adaptive_max_pool3d": [((2, 3, 4), [2, 2, 2]), ((1, 2, 3, 3, 3), [2, 2])],
    "im2col": [((2, 3), [2, 2], [1, 1], [0, 0], [1, 1]), ((1, 2, 3, 3), [5, 5], [1, 1], [0, 0], [1, 1])],
    "col2im": [((1, 7, 4), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1]),
               ((1, 8, 5), [4, 4], [2, 2], [1, 1], [0, 0], [1, 1])],
    "group_norm": [((2, 6, 4), 4), ((2, 6, 4), 0)],
    "upsample_nearest2d.vec": [((1, 2, 4, 4), [0, 3], None), ((1, 2, 4, 4), None, [0.1, 1.0])],
    "upsample_bilinear2d.vec": [((1, 2, 4), [3, 3], False, None)],
    "avg_pool2d": [((1, 2, 4, 4), [2], [], [2]), ((1, 2, 4, 4), [2], [], [0], False, True, 0), ((2, 3), [2])],
    "avg_pool3d": [((1, 2, 4, 4, 4), [2], [], [2]), ((2, 3), [2])],
    "grid_sampler": [((1, 2, 3, 3, 3), torch.zeros(1, 2, 2, 2, 3), 2, 0, False),  # bicubic is 2-D only
                     ((2, 2, 3, 3), torch.zeros(1, 2, 2, 2), 0, 0, False),
                     ((1, 2, 3, 3), torch.zeros(1, 2, 2, 3), 0, 0, False),
                     ((1, 2, 0, 3), torch.zeros(1, 2, 2, 2), 1, 0, False),
                     ((2, 3, 3), torch.zeros(2, 2, 2), 0, 0, False),
                     ((1, 2, 3, 3), torch.zeros(1, 2, 2, 2, dtype=torch.float64), 0, 0, False)],
}


@pytest.mark.parametrize("op, args", [(op, args) for op, cases in BAD_INPUTS.items() for args in cases],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_lowering_refuses_bad_input_with_torchs_own_error(op, args):
    """Issue 47: a kernel with no composite runs torch's own checks (its meta kernel, on a stand-in of the input's
    shape); one with a composite hands what it does not handle to torch's path. Either way the error is torch's own,
    type and message (until issue 47 group_norm, the resize kernels, im2col, col2im and adaptive_max_pool2d checked
    nothing: a bad input raised something else, or nothing). The kernels run here on CPU tensors; on XLA the same
    code runs. An input torch's path accepts (a scale that rounds a size to 0) gives torch's answer."""
    shape, *rest = args
    lowering = st._LOWERINGS[op]
    name, _, overload = op.partition(".")
    torchs = getattr(getattr(torch.ops.aten, name), overload or "default")
    reference = torchs.decompose if lowering.hands_back else torchs  # what torch itself runs for the op
    device = "cpu" if lowering.hands_back else "meta"
    try:
        answer = reference(torch.ones(shape, device=device), *rest)
    except Exception as e:  # torch refuses it: ours raises the same, type and first line (which may be empty)
        with pytest.raises(type(e)) as ours:
            lowering.kernel(torch.ones(shape), *rest)
        assert str(ours.value).partition("\n")[0] == str(e).partition("\n")[0]
    else:  # torch accepts it (a scale that rounds a size to 0: an empty result): ours gives the same
        assert torch.equal(lowering.kernel(torch.ones(shape), *rest), answer)


@pytest.mark.parametrize("output_size", [(0, 3), (2, 0), (7, 9), (3, 0, 2), (2, 4, 3), (5, 1, 7)])
def test_adaptive_max_pooling_to_any_size_torch_accepts(output_size):
    """An output size of 0 is valid in torch (an empty result, still in the graph); the kernel's windows divided by
    it (ZeroDivisionError). Values and indices equal torch's, and so does the input's gradient (an empty output's is
    zeros: torch's CPU backward refuses an empty grad_output). 3-D: the flat index over (D, H, W), ties included."""
    op = f"adaptive_max_pool{len(output_size)}d"
    x = torch.randn(2, 3, 5, 4, requires_grad=True) if len(output_size) == 2 else (
        torch.randint(0, 3, (2, 2, 5, 4, 6)).double().requires_grad_())  # ties: the first in row-major order wins
    want = getattr(torch.ops.aten, op)(x, list(output_size))
    got = st._LOWERINGS[op].kernel(x, list(output_size))
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and got[0].requires_grad
    grad = torch.autograd.grad(got[0].sum(), x)[0]
    assert torch.equal(grad, torch.autograd.grad(want[0].sum(), x)[0] if all(output_size) else torch.zeros_like(x))


AVG_POOLS = [  # (spatial dims, input shape, (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor))
    (2, (2, 3, 9, 9), ([3], [1], [1], True, False, 2)), (2, (1, 3, 9, 9), ([4, 4], [2, 3], [1], True, False, None)),
    (2, (3, 7, 6), ([3, 2], [], [1, 0], True, True, None)), (3, (1, 2, 4, 4, 4), ([2], [1], [1], True, False, None)),
    (3, (1, 1, 7, 5, 7), ([6, 3, 4], [2, 3, 2], [3, 1, 0], False, False, -2)),
    (3, (2, 5, 5, 5), ([2, 3, 4], [1, 2, 2], [0, 1, 2], True, True, None)),
]


@pytest.mark.parametrize("spatial, shape, options", AVG_POOLS)
def test_average_pooling_divides_as_torch(spatial, shape, options):
    """Issue 49: under ceil_mode a window may run past the padding (torch's divisor stops at the padding's end), and
    count_include_pad=False divides by the window's part in the input: the forward and its backward (the adjoint,
    one strided slice per offset) equal torch's, unbatched too."""
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(len(shape)))
    want = getattr(torch.ops.aten, f"avg_pool{spatial}d")(x, *options)
    torch.testing.assert_close(st._LOWERINGS[f"avg_pool{spatial}d"].kernel(x, *options), want)
    grad = torch.randn_like(want)
    torch.testing.assert_close(st._LOWERINGS[f"avg_pool{spatial}d_backward"].kernel(grad, x, *options),
                               getattr(torch.ops.aten, f"avg_pool{spatial}d_backward")(grad, x, *options))
    for op in (f"avg_pool{spatial}d", f"avg_pool{spatial}d_backward"):  # 3-D's meta kernels miss a zero divisor
        with pytest.raises(RuntimeError, match="divisor must be not zero"):
            st._LOWERINGS[op].kernel(*([grad] if "backward" in op else []), x, *options[:-1], 0)


MAX_POOLS = [  # (spatial dims, input shape, (kernel_size, stride, padding, dilation, ceil_mode))
    (2, (2, 3, 9, 8), ([3], [2], [1], [2], True)), (2, (3, 7, 6), ([3, 2], [], [1, 0], [1, 3], False)),
    (2, (1, 2, 5, 9), ([2, 3], [1, 2], [1, 1], [3, 2], True)), (3, (1, 2, 6, 5, 7), ([2], [1], [1], [2], True)),
    (3, (2, 7, 6, 5), ([3, 2, 2], [2, 1, 3], [1, 0, 1], [2, 3, 1], False)),
]


@pytest.mark.parametrize("spatial, shape, options", MAX_POOLS)
def test_dilated_max_pooling_is_torchs(spatial, shape, options):
    """Max pooling with a dilation (torch_xla ran it on the CPU): torch's values and flat indices (ties: the first in
    row-major order; padding never wins) and its backward, unbatched, ceil_mode and an empty stride too."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).mul(2).round()  # ties
    op = f"max_pool{spatial}d_with_indices"
    want = getattr(torch.ops.aten, op)(x, *options)
    got = st._LOWERINGS[op].kernel(x, *options)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    grad = torch.randn_like(want[0])
    torch.testing.assert_close(st._LOWERINGS[f"{op}_backward"].kernel(grad, x, *options, want[1]),
                               getattr(torch.ops.aten, f"{op}_backward")(grad, x, *options, want[1]))
    torch.testing.assert_close(st._LOWERINGS[f"max_pool{spatial}d"].kernel(x, *options), want[0])
    with pytest.raises(RuntimeError, match="pad should be at most half of effective kernel size"):
        st._LOWERINGS[op].kernel(x, options[0], options[1], [3], *options[3:])


def test_index_fill_and_masked_scatter_backward_are_torchs():
    """index_fill with a 0-d tensor value (repeated and negative indices, a 0-d input) and its gradients, and
    masked_scatter's backward (a broadcast mask, a source larger than the selection): torch's, with no shape from
    the values (torch_xla ran _unique and masked_select on the CPU)."""
    fill, g = st._LOWERINGS["index_fill.int_Tensor"].kernel, torch.Generator().manual_seed(0)
    for shape, dim, index in (((5, 4), -1, [0, 3, 3]), ((5, 4, 2), 1, [-1, 0]), ((), 0, [0]), ((3, 0, 2), 2, 1)):
        x, value = torch.randn(shape, generator=g, requires_grad=True), torch.tensor(1.5, requires_grad=True)
        wrapped = torch.tensor(index) % (x.shape[dim] if x.dim() else 1)  # torch's own backward refuses a negative one
        got, want = fill(x, dim, torch.tensor(index), value), torch.index_fill(x, dim, wrapped, value)
        torch.testing.assert_close(got, want)
        cot = torch.randn(want.shape, generator=g)
        torch.testing.assert_close(*(torch.autograd.grad(y, (x, value), cot) for y in (got, want)))
    with pytest.raises(IndexError, match="Expected dtype int64 for index"):
        fill(x, 0, torch.tensor([0], dtype=torch.int32), value)
    back = st._LOWERINGS["masked_scatter_backward"].kernel
    for grad_shape, mask_shape, sizes in (((5, 5), (5, 5), [5, 5]), ((4, 5), (5,), [30]), ((3, 2), (3, 1), [0])):
        grad, mask = torch.randn(grad_shape, generator=g), torch.rand(mask_shape, generator=g) < 0.5 * bool(sizes[0])
        torch.testing.assert_close(back(grad, mask, sizes), torch.ops.aten.masked_scatter_backward(grad, mask, sizes))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_distances_and_their_gradients_are_torchs(p):
    """Issue 49: cdist's and pdist's kernels and backwards (the XLA key's) give torch's numbers where its backward
    kernels have rules of their own: 0 at a zero distance, and for p < 1 at a zero coordinate difference; for p =
    inf every coordinate at the distance (ties: equal rows, shared coordinates). cdist's batch dims broadcast; p = 2
    with more than 25 rows takes the matrix-product form, as torch's; pdist's pairs are triu_indices' order."""
    g = torch.Generator().manual_seed(int(p * 10) if p < 10 else 99)
    x1, x2 = torch.randn(2, 1, 5, 3, generator=g, dtype=torch.float64), torch.randn(3, 6, 3, generator=g,
                                                                                       dtype=torch.float64)
    x1[..., 1, :], x1[..., 2, 0] = x2[0, 0], x2[0, 1, 0]
    for a, b in ((x1, x2), (x1.flatten(0, 2), x2.flatten(0, 1).repeat(2, 1)[:30])):  # 30 rows: matrix products
        want = torch.ops.aten._cdist_forward(a, b, p, None)
        torch.testing.assert_close(st._LOWERINGS["_cdist_forward"].kernel(a, b, p, None), want)
        grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(st._LOWERINGS["_cdist_backward"].kernel(grad, a, b, p, want),
                                   torch.ops.aten._cdist_backward(grad, a.expand(*want.shape[:-2], -1, -1).contiguous(),
                                                                  b.expand(*want.shape[:-2], -1, -1).contiguous(),
                                                                  p, want))
    x = x1.flatten(0, 2)
    want = torch.ops.aten._pdist_forward(x, p)
    torch.testing.assert_close(st._LOWERINGS["_pdist_forward"].kernel(x, p), want)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(st._LOWERINGS["_pdist_backward"].kernel(grad, x, p, want),
                               torch.ops.aten._pdist_backward(grad, x, p, want))
    assert all(torch.equal(torch.stack(st._pairs(n, "cpu")), torch.triu_indices(n, n, 1)) for n in (2, 3, 17, 64))


FRACTIONAL = [((2, 3, 9, 8), [3, 2], [4, 5]), ((3, 7, 7), [2, 2], [1, 6]), ((2, 2, 7, 6, 5), [2, 3, 2], [3, 2, 3]),
              ((0, 2, 5, 5, 5), [2, 2, 2], [2, 2, 2])]


@pytest.mark.parametrize("shape, kernel_size, output_size", FRACTIONAL)
def test_fractional_max_pooling_windows_are_torchs(shape, kernel_size, output_size):
    """Issue 49: given the samples (F draws them on the input's device), each plane's windows start where torch's
    kernel puts them (2-D's samples are (W, H), 3-D's (T, H, W)); values, indices (ties: the first in row-major
    order) and the gradient equal torch's, unbatched and for an empty batch too."""
    g, spatial = torch.Generator().manual_seed(len(shape)), len(kernel_size)
    x = torch.randint(0, 4, shape, generator=g).double().requires_grad_()
    samples = torch.rand(shape[0] if len(shape) == spatial + 2 else 1, shape[-spatial - 1], spatial, generator=g,
                         dtype=torch.float64)
    op = f"fractional_max_pool{spatial}d"
    want, got = (f(x, kernel_size, output_size, samples) for f in (getattr(torch.ops.aten, op),
                                                                    st._LOWERINGS[op].kernel))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[0].requires_grad
    grad = torch.randn(want[0].shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(got[0], x, grad)[0], torch.autograd.grad(want[0], x, grad)[0])


GRIDS = [  # (input, grid): 2-D and 3-D, a side of 1 (reflection with align_corners has no span), empty batch, channels
    ((2, 3, 5, 4), (2, 3, 4, 2)), ((1, 2, 1, 6), (1, 5, 2, 2)), ((2, 2, 3, 4, 5), (2, 2, 3, 2, 3)),
    ((1, 1, 1, 3, 2), (1, 4, 1, 2, 3)), ((0, 2, 3, 3), (0, 2, 2, 2)), ((2, 0, 3, 3), (2, 2, 2, 2))]


@pytest.mark.parametrize("shape, grid_shape", GRIDS)
def test_grid_sampling_is_torchs_in_every_mode_and_padding(shape, grid_shape):
    """The grid_sampler kernel (CPU tensors standing for XLA ones) against torch's CPU kernel in float64: bilinear,
    nearest and (2-D) bicubic, zeros, border and reflection padding (bicubic pads each tap), with and without
    align_corners, on a grid reaching past the image: values, and the input's and grid's gradients. Nearest on a
    grid of eighths, ties rounded half to even. (The OpInfo tier's 10 samples of grid_sample have no reflection.)"""
    g = torch.Generator().manual_seed(len(shape) + shape[0])
    x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    grid = (torch.rand(grid_shape, generator=g, dtype=torch.float64) * 5 - 2.5).requires_grad_()
    eighths = (torch.randint(-20, 21, grid_shape, generator=g) / 8).double().requires_grad_()
    for mode, padding, corners in itertools.product(range(3 if x.dim() == 4 else 2), range(3), (False, True)):
        at = eighths if mode == 1 else grid
        want = torch.grid_sampler(x, at, mode, padding, corners)
        got = st._LOWERINGS["grid_sampler"].kernel(x, at, mode, padding, corners)
        torch.testing.assert_close(got, want)
        cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
        for ours, torchs in zip(torch.autograd.grad(got, (x, at), cot), torch.autograd.grad(want, (x, at), cot)):
            torch.testing.assert_close(ours, torchs)


def test_grid_sampling_in_bf16_finds_pixels_past_256():
    """Positions in fp32 for half inputs: in bf16 a position past 256 is off by pixels (torch's CPU kernel's are,
    2.6 to 3.9 here), and the last pixel's rounded up out of range."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, 300, generator=g).bfloat16()
    grid = (torch.rand(1, 4, 20, 2, generator=g) * 2 - 1).bfloat16()
    for mode, padding in itertools.product(range(3), range(3)):
        got = st._LOWERINGS["grid_sampler"].kernel(x, grid, mode, padding, True)
        exact = torch.grid_sampler(x.double(), grid.double(), mode, padding, True)
        assert got.dtype == torch.bfloat16 and (got.double() - exact).abs().max() < 0.05


BAGS = [  # (mode, offsets, include_last_offset, padding_idx, per-sample weights) over 9 indices
    ("sum", [0, 2, 2, 7], False, None, True), ("mean", [0, 3, 3, 9], True, 1, False),
    ("max", [0, 4, 4], False, 2, False), ("max", [0, 1, 5, 9], True, None, False), ("mean", [0], False, None, False),
    ("sum", [0, 9, 9], False, 3, True),
]


@pytest.mark.parametrize("mode, offsets, last, padding_idx, weighted", BAGS)
def test_embedding_bags_by_offsets_are_torchs(monkeypatch, mode, offsets, last, padding_idx, weighted):
    """Issue 49: 1-D indices with offsets are reduced over a fixed number of bags (each index's bag counted from the
    bags' starts): empty bags (zeros), padding (out of sums, counts and maxima), per-sample weights, and an
    include_last_offset end give torch's bags and gradients (the kernel, on CPU tensors standing for XLA ones)."""
    monkeypatch.setattr(st, "_is_xla", lambda device: True)
    g = torch.Generator().manual_seed(len(offsets))
    ids, weight = torch.randint(0, 5, (9,), generator=g), torch.randn(5, 3, generator=g, requires_grad=True)
    scale = torch.randn(9, generator=g, requires_grad=True) if weighted else None
    options = dict(mode=mode, include_last_offset=last, padding_idx=padding_idx, per_sample_weights=scale)
    want = torch.nn.functional.embedding_bag(ids, weight, torch.tensor(offsets), **options)
    got = st._xla_embedding_bag(ids, weight, torch.tensor(offsets, dtype=torch.int32), **options)
    torch.testing.assert_close(got, want)
    grad, leaves = torch.randn(want.shape, generator=g), [weight] + ([scale] if weighted else [])
    for ours, torchs in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(ours, torchs)


MASKED = [  # (input shape, indices (a bool mask, or None for a full slice), value shape, accumulate)
    ((4, 5), [(4, 5)], (), False), ((4, 5), [(4,)], (5,), False), ((4, 5), [(4,)], (1, 5), True),
    ((3, 4, 5), [None, (4,)], (), False), ((3, 4, 5), [None, (4, 5)], (1,), True), ((3, 4, 5), [(3,)], (4, 1), False),
    ((2, 3, 4, 5), [None, (3, 4)], (2, 1, 5), False),
]


@pytest.mark.parametrize("shape, indices, value, accumulate", MASKED)
def test_boolean_mask_assignment_is_torch_where(shape, indices, value, accumulate):
    """Issue 49: x[mask] = v with one boolean mask (after full slices) and a value that does not depend on how many
    elements the mask selects is a where: torch's numbers, and its gradients for the input and the value."""
    g = torch.Generator().manual_seed(len(shape) + len(indices))
    x, v = torch.randn(shape, generator=g, requires_grad=True), torch.randn(value, generator=g, requires_grad=True)
    index = [None if i is None else torch.rand(i, generator=g) > 0.5 for i in indices]
    got, want = st._masked_where(x, index, v, accumulate), torch.ops.aten.index_put(x, index, v, accumulate)
    assert torch.equal(got, want)
    for ours, torchs in zip(torch.autograd.grad(got.square().sum(), (x, v)),
                            torch.autograd.grad(want.square().sum(), (x, v))):
        torch.testing.assert_close(ours, torchs, rtol=1e-6, atol=1e-6)  # a sum over the mask, in another order


def test_other_index_puts_are_left_to_torch():
    """A value per selected element, an integer or uint8 index, two masks, a dtype or a mask shape torch refuses: no
    where (None), so the kernel hands them to torch's own path."""
    x, mask = torch.zeros(4, 5), torch.tensor([True, False, True, True])
    assert st._masked_where(x, [mask], torch.ones(3, 5), False) is None
    assert st._masked_where(x, [torch.tensor([0, 2])], torch.ones(()), False) is None
    assert st._masked_where(x, [mask.to(torch.uint8)], torch.ones(()), False) is None
    assert st._masked_where(x, [mask, torch.ones(5, dtype=torch.bool)], torch.ones(()), False) is None
    assert st._masked_where(x, [mask], torch.ones((), dtype=torch.float64), False) is None
    assert st._masked_where(x, [torch.ones(3, dtype=torch.bool)], torch.ones(()), False) is None
    assert st._masked_where(x, [mask], torch.ones(2, 5), False) is None



def kernel(op):
    return st._LOWERINGS[op].kernel


def raises_as(reference, ours):
    """ours() raises what reference() raises: type and first line."""
    with pytest.raises(Exception) as want:
        reference()
    with pytest.raises(want.type) as got:
        ours()
    assert str(got.value).partition("\n")[0] == str(want.value).partition("\n")[0]


@pytest.mark.parametrize("a, b, dim", [((4, 3), (4, 3), -1), ((3, 5), (3, 1), 0), ((2, 3, 4), (2, 3, 4), 1),
                                       ((0, 3), (0, 3), 1)])
def test_cross_is_two_rolls_and_keeps_torch_s_errors(a, b, dim):
    """Issue 49: linalg_cross (so torch.cross) as rolls of its factors, broadcasting as torch; integers too."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a, generator=g), torch.randn(b, generator=g)
    torch.testing.assert_close(kernel("linalg_cross")(x, y, dim=dim), torch.linalg.cross(x, y, dim=dim))
    ints = (x * 10).long(), (y * 10).long()
    assert torch.equal(kernel("linalg_cross")(*ints, dim=dim), torch.linalg.cross(*ints, dim=dim))
    for shapes, dim, dtype in [(((4, 3), (4, 3)), -1, torch.float64), (((4, 2), (4, 2)), -1, None),
                               (((4, 3), (1, 4, 3)), -1, None), (((2, 3, 4), (2, 3, 2)), 1, None),
                               (((4, 3), (4, 3)), 2, None)]:
        bad = torch.ones(shapes[0]), torch.ones(shapes[1], dtype=dtype)
        device = "cpu" if dtype else "meta"  # torch's meta kernel checks the shapes, its CPU kernel the dtypes
        raises_as(lambda: torch.linalg.cross(*(t.to(device) for t in bad), dim=dim),
                  lambda: kernel("linalg_cross")(*bad, dim=dim))


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("delta", [0.5, 1.0, 2.5])
def test_huber_loss_and_its_backward_are_torch_s(reduction, delta):
    """Issue 49: huber_loss and huber_loss_backward (torch's derivative of it) as torch computes them, in the input's
    dtype (bfloat16 in fp32), with torch's errors (delta <= 0, integers, mixed dtypes in the backward)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 5, generator=g) * 2, torch.randn(5, generator=g) * 2
    x[0, :2] = y[:2] + delta  # at the boundary
    torch.testing.assert_close(kernel("huber_loss")(x, y, reduction, delta),
                               torch.ops.aten.huber_loss(x, y, reduction, delta))
    half = x.bfloat16()
    assert torch.equal(kernel("huber_loss")(half, y, reduction, delta), torch.ops.aten.huber_loss(half, y, reduction,
                                                                                                    delta))
    grad = torch.randn(() if reduction else (4, 5), generator=g)
    torch.testing.assert_close(kernel("huber_loss_backward")(grad, x, y.expand(4, 5), reduction, delta),
                               torch.ops.aten.huber_loss_backward(grad, x, y.expand(4, 5), reduction, delta))
    for bad in [(x, y, reduction, 0.0), (x.long(), y.long(), reduction, delta)]:
        raises_as(lambda: torch.ops.aten.huber_loss(*bad), lambda: kernel("huber_loss")(*bad))
    bad = (grad, x, y.expand(4, 5).double(), reduction, delta)
    raises_as(lambda: torch.ops.aten.huber_loss_backward(*bad), lambda: kernel("huber_loss_backward")(*bad))


@pytest.mark.parametrize("shape, dim", [((7,), 0), ((3, 17), 1), ((5, 4), 0), ((), 0), ((0, 4), 1), ((4, 1), -1)])
def test_logcumsumexp_is_a_parallel_prefix_with_torch_s_special_values(shape, dim):
    """Issue 49: the prefix's log-add-exp keeps torch's kernel's answers for -inf, inf and NaN, and for values far
    apart (a global max would underflow the early terms to -inf); torch's errors for a bad dim or an integer."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 30
    if x.numel() > 6:
        x.view(-1)[:6] = torch.tensor([-math.inf, -math.inf, math.inf, 3.0, math.nan, -500.0])
    torch.testing.assert_close(kernel("_logcumsumexp")(x, dim), torch.logcumsumexp(x, dim), equal_nan=True)
    assert kernel("_logcumsumexp")(x.float(), dim).dtype == torch.float32
    for bad in [(x, 2), (x.long(), dim)]:
        raises_as(lambda: torch.logcumsumexp(*bad), lambda: kernel("_logcumsumexp")(*bad))


@pytest.mark.parametrize("layout", ["padded", "concatenated"])
@pytest.mark.parametrize("lengths", [list, torch.tensor])
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_ctc_loss_and_its_gradient_are_torch_s(layout, lengths, reduction):
    """The CTC kernel against F.ctc_loss, values and gradients, on what the OpInfo samples miss: concatenated targets,
    list lengths with the mean, repeated labels, an empty target, an input length 0, a blank other than 0, an
    impossible alignment (an infinite loss; zero_infinity: 0 and no gradient), unbatched input; torch's errors."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 5, 6, generator=g, dtype=torch.float64).log_softmax(2)
    padded = torch.randint(0, 6, (5, 4), generator=g)
    padded[0, :3] = torch.tensor([2, 2, 3])
    ins, outs = [9, 7, 2, 0, 9], [3, 0, 4, 0, 4]  # the third cannot align: 4 labels in 2 steps
    targets = padded if layout == "padded" else torch.cat([padded[i, :k] for i, k in enumerate(outs)])
    for blank, zero_infinity in [(0, True), (5, True), (0, False)]:
        lp, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        args = (targets, lengths(ins), lengths(outs), blank, reduction, zero_infinity)
        want, got = torch.ctc_loss(ref, *args), kernel("ctc_loss.IntList")(lp, *args)
        torch.testing.assert_close(got, want)
        if zero_infinity:  # torch's gradient of an infinite loss is NaN
            cotangent = torch.randn(want.shape, generator=g, dtype=want.dtype)
            torch.testing.assert_close(torch.autograd.grad(got, lp, cotangent)[0],
                                       torch.autograd.grad(want, ref, cotangent)[0])
    one = (x[:, 0], padded[0, :3], lengths([9]), lengths([3]), 0, reduction, False)
    torch.testing.assert_close(kernel("ctc_loss.IntList")(*one), torch.ctc_loss(*one))
    if lengths is list:
        for bad in [([10, 7, 2, 0, 9], outs, 0), (ins, [3, 0, 9, 0, 4], 0), (ins, outs, 6), (ins, outs[:4], 0)]:
            args = (x, targets, *bad, reduction, False)
            raises_as(lambda: torch.ctc_loss(*args), lambda: kernel("ctc_loss.IntList")(*args))


MARGINS = [((4, 5), 1, 1.0, True), ((4, 5), 2, 0.5, False), ((5,), 2, 2.0, True), ((0, 3), 1, 1.0, False),
           ((), 1, 1.0, False)]  # (input shape, p, margin, a weight)


@pytest.mark.parametrize("shape, p, margin, weighted", MARGINS)
@pytest.mark.parametrize("reduction", [0, 1, 2])
def test_margin_losses_and_their_backwards_are_torch_s(shape, p, margin, weighted, reduction):
    """Issue 49: multi_margin_loss and multilabel_margin_loss (forward, is_target, and the backward torch's derivative
    calls) as torch's CPU kernels: the target's own class left out, targets up to the first -1, repeats counted."""
    g = torch.Generator().manual_seed(3)
    x, classes = torch.randn(shape, generator=g), max(shape[-1:] or (1,))
    target = torch.randint(classes, shape[:-1], generator=g)
    weight = torch.rand(classes, generator=g) if weighted else None
    args = (target, p, margin, weight, reduction)
    want = torch.ops.aten.multi_margin_loss(x, *args)
    if x.numel() == 0 and reduction:  # torch's CPU kernels return uninitialized memory: ours, a mean's NaN, a sum's 0
        want = torch.tensor(math.nan if reduction == 1 else 0.0)
    torch.testing.assert_close(kernel("multi_margin_loss")(x, *args), want, equal_nan=True)
    grad = torch.randn(want.shape, generator=g)
    torch.testing.assert_close(kernel("multi_margin_loss_backward")(grad, x, *args),
                               torch.ops.aten.multi_margin_loss_backward(grad, x, *args))
    labels = torch.randint(-1, classes, shape, generator=g)
    if labels.dim() == 2 and len(labels):
        labels[0], labels[1] = torch.arange(classes), 1  # every class a target; one class repeated
    want = torch.ops.aten.multilabel_margin_loss_forward(x, labels, reduction)
    got = kernel("multilabel_margin_loss_forward")(x, labels, reduction)
    torch.testing.assert_close(got[0], torch.tensor(math.nan if reduction == 1 else 0.0) if x.numel() == 0 and reduction
                               else want[0], equal_nan=True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(kernel("multilabel_margin_loss_backward")(grad, x, labels, reduction, want[1]),
                               torch.ops.aten.multilabel_margin_loss_backward(grad, x, labels, reduction, want[1]))
    for bad in [(target, 3, margin, weight, reduction), (target.reshape(-1)[:0] if x.numel() else target[None, None],
                                                          p, margin, weight, reduction)]:
        meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in (x, *bad)]  # torch's checks, its words
        raises_as(lambda: torch.ops.aten.multi_margin_loss(*meta), lambda: kernel("multi_margin_loss")(x, *bad))



@pytest.mark.parametrize("boundaries, values", [((7,), (3, 4)), ((3, 6), (3, 5)), ((0,), (4,)), ((5,), ()),
                                                ((1,), (2,)), ((8,), (0,))])
def test_searchsorted_and_bucketize_are_torch_s(boundaries, values):
    """Issue 49: a binary search in halving steps finds torch's index on either side, with repeats, NaN (values and
    boundaries: last), a sorter, integer boundaries and float values, Python scalars, int32 out; torch's errors."""
    g = torch.Generator().manual_seed(4)
    b = torch.randint(-3, 4, boundaries, generator=g).float().sort(-1).values
    if b.numel() > 2:
        b[..., -1] = math.nan
    v = torch.randint(-4, 5, values, generator=g).float() + torch.tensor([0.0, 0.5])[torch.randint(2, values,
                                                                                                      generator=g)]
    if v.numel() > 2:
        v.view(-1)[1] = math.nan
    sorter = torch.randperm(b.shape[-1], generator=g).expand(b.shape)
    shuffled = torch.empty_like(b).scatter_(-1, sorter, b)  # sorted by sorter
    for right in (False, True):
        for args, kwargs in [((b, v), {}), ((b.long(), v), {}), ((b, v), {"side": "right" if right else "left"}),
                             ((shuffled, v), {"sorter": sorter}), ((b, v), {"out_int32": True}),
                             *([((b, 0.5), {}), ((b.long(), 1), {})] if b.dim() == 1 else [])]:
            kwargs = {"right": right, **kwargs}
            want = torch.searchsorted(*args, **kwargs)
            got = kernel("searchsorted.Tensor")(*args, **kwargs)
            assert torch.equal(got, want) and got.dtype == want.dtype, (args, kwargs)
        if b.dim() == 1:
            assert torch.equal(kernel("bucketize.Tensor")(v, b, right=right), torch.bucketize(v, b, right=right))
    raises_as(lambda: torch.searchsorted(b, v, side="left", right=True),
              lambda: kernel("searchsorted.Tensor")(b, v, side="left", right=True))
    bad = (b.expand(2, *b.shape), v)  # torch's meta kernel checks the shapes, in its words
    raises_as(lambda: torch.searchsorted(*(t.to("meta") for t in bad)), lambda: kernel("searchsorted.Tensor")(*bad))



@pytest.mark.parametrize("shape, dim", [((5, 7), 1), ((6, 4), 0), ((3, 8), -1), ((9,), 0), ((), 0), ((0, 4), 1),
                                        ((2, 3, 4), 1)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_median_nanmedian_and_mode_are_torch_s(shape, dim, keepdim):
    """Issue 49: medians and mode by a sort: torch's values and indices with repeats (the tie torch's CPU kernel
    picks: the middle of equal medians, a mode's last occurrence up to 16 values), NaN (median: the first NaN;
    nanmedian: the rest's median), integers, 0-dim and empty inputs, and torch's errors. Not compared: the index of an
    all-NaN row's nanmedian and a mode among NaNs, which are where libstdc++'s nth_element and sort happen to leave
    NaNs."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, shape, generator=g).float()
    if x.dim() == 2 and x.numel() > 8:
        x[0, :3], x[1] = math.nan, math.nan
    for op in ("median", "nanmedian", "mode"):
        for t in (x.nan_to_num(0) if op == "mode" else x, x.long()):
            ours = kernel(op if op == "mode" else f"{op}.dim")
            want, got = getattr(torch, op)(t, dim, keepdim), ours(t, dim, keepdim)
            torch.testing.assert_close(got[0], want[0], equal_nan=True)
            same = torch.where(want[0].isnan(), 0, want[1]) if op == "nanmedian" else want[1]  # NaN: an all-NaN row
            assert torch.equal(torch.where(got[0].isnan(), 0, got[1]) if op == "nanmedian" else got[1], same)
        if op != "mode":
            for t in (x, x.long(), torch.ones(0), torch.ones(0, dtype=torch.long)):  # none: NaN, the lowest integer
                torch.testing.assert_close(kernel(op)(t), getattr(torch, op)(t), equal_nan=True)
    for op in ("median.dim", "mode"):
        for bad in [(x, 3), (torch.ones(2, 3, dtype=torch.complex64), 1), (torch.ones(0, 2), 0)]:
            name = op.partition(".")[0]
            raises_as(lambda: getattr(torch, name)(*bad), lambda: kernel(op)(*bad))



def test_mode_s_index_is_where_torch_s_cpu_kernel_sorts_it():
    """Issue 60: past 16 values, the index torch's CPU kernel gives a mode with ties is where libstdc++'s std::sort
    (an introsort: median-of-3 pivots, Hoare's partition, a final insertion sort) leaves the last of its equal values,
    not the last occurrence (torch_xla's own test_ops.py failed on 3000 values). Rows of 17 to 3000 values with 2 to
    50 distinct, in random, sorted, reversed and periodic orders, integers, floats and bools, along either dim."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, k, (r, n), generator=g) for n, k, r in
            [(17, 2, 3), (18, 3, 2), (33, 5, 4), (100, 7, 3), (257, 50, 2), (1000, 3, 1), (3000, 5, 1)]]
    rows += [t.sort(1).values for t in rows[2:5]] + [t.sort(1, descending=True).values for t in rows[2:5]]
    rows += [(torch.arange(n) % p)[None] for n, p in [(64, 3), (500, 11), (999, 2)]] + [rows[3].float(), rows[0] > 0]
    for x in rows:
        for dim, t in ((1, x), (0, x.T.contiguous())):
            want, got = torch.mode(t, dim), kernel("mode")(t, dim)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (t.shape, got[1], want[1])


@pytest.mark.parametrize("bins, low, high", [(10, 0, 0), (7, -1.0, 1.5), (3, 1, 1), (1, 0, 0), (50, -0.3, 0.2)])
def test_histc_is_torch_s(bins, low, high):
    """Issue 49: histc as torch's CPU kernel bins (its arithmetic, the max in the last bin, NaN and values outside
    left out, the data's own range when min == max, a range of one value widened by 1), in the input's dtype."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 40, generator=g)
    x[0, :4] = torch.tensor([math.inf if low == high else math.nan, 0.2, -0.3, 1.5])
    if low == high:  # the data's range: torch refuses one that is not finite (a host read), ours counts nothing
        with pytest.raises(RuntimeError, match="torch.histc: range of .* is not finite"):
            torch.histc(x, bins, low, high)
        for bad in (x, x.nan_to_num(posinf=math.nan)):
            assert torch.equal(kernel("histc")(bad, bins, low, high), torch.zeros(bins))
        x[0, 0] = 0.0
    for t in (x, x.double(), x.bfloat16(), torch.full((4,), 3.0), x[:0]):
        assert torch.equal(kernel("histc")(t, bins, low, high), torch.histc(t, bins, low, high)), t
    for bad in [(x, 0, low, high), (x, bins, 2, 1), (x > 0, bins, low, high), (x.to(torch.complex64), bins, 1, 2)]:
        raises_as(lambda: torch.histc(*bad), lambda: kernel("histc")(*bad))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_histc_counts_integers_as_torch_s_cuda_kernel(dtype):
    """transformers' MoE routing (grouped_mm experts, their default) counts tokens per expert with histc of int32
    ids off the CPU, whose kernel refuses integers: the trainer counts them as torch's CUDA kernel does, its bounds
    int64, bin (x - min) * bins // (max - min) with max in the last bin, out-of-range values left out, min == max the
    data's range (widened by 1 if one value), in the input's dtype. Held to the float kernel on values where the
    integer and float arithmetic agree, and to hand counts where they would not."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 8, (64,), generator=g, dtype=dtype)
    for bins, low, high in [(8, 0, 7), (4, 0, 7), (8, 0, 0), (3, 2, 5), (16, 0, 15)]:
        got = kernel("histc")(ids, bins, low, high)
        assert got.dtype == dtype and torch.equal(got.long(), torch.histc(ids.double(), bins, low, high).long())
    x = torch.tensor([0, 1, 1, 3, 3, 3, 5, 2], dtype=dtype)
    assert kernel("histc")(x, 3).tolist() == [3, 4, 1]  # range [0, 5]: (x * 3) // 5
    assert kernel("histc")(x, 6, 1.7, 4.2).tolist() == [2, 0, 1, 0, 3, 0]  # bounds 1 and 4, as int64
    assert kernel("histc")(torch.full((3,), 2, dtype=dtype), 4).tolist() == [0, 0, 3, 0]  # one value: [1, 3]


def _grouped(*shapes, offs=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes] + [
        None if offs is None else torch.tensor(offs, dtype=torch.int32)]


GROUPED = {"rows": ((12, 8), (4, 8, 8), [3, 3, 9, 12]), "k": ((8, 16), (16, 8), [3, 3, 9, 16]),
           "columns": ((4, 8, 8), (8, 16), [4, 8, 12, 16]), "batch": ((4, 8, 8), (4, 8, 8), None),
           "empty": ((0, 8), (4, 8, 8), [0, 0, 0, 0])}


@pytest.mark.parametrize("form", list(GROUPED))
def test_grouped_mm_is_torch_s_for_every_form_and_both_derivatives(form):
    """torch._grouped_mm (transformers' MoE experts): its four forms (rows, K or columns split by offsets, a batch),
    an empty group and no rows, fp32 and bf16, as torch's CPU kernel gives them; first and second derivatives
    against torch's own formula; under torch.func.vmap."""
    a_shape, b_shape, offs = GROUPED[form]
    for dtype in (torch.float32, torch.bfloat16):
        a, b, o = _grouped(a_shape, b_shape, offs=offs, dtype=dtype)
        assert torch.equal(kernel("_grouped_mm")(a, b, o), torch._grouped_mm(a, b, offs=o))
    a, b, o = (t if t is None else t.requires_grad_(t.is_floating_point()) for t in _grouped(a_shape, b_shape,
                                                                                             offs=offs))
    outs = []
    for f in (lambda a, b: torch._grouped_mm(a, b, offs=o), lambda a, b: kernel("_grouped_mm")(a, b, o)):
        y = f(a, b)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grads = torch.autograd.grad(y, (a, b), cot, create_graph=True)
        again = torch.autograd.grad([(g * g).sum() for g in grads], (a, b, cot), allow_unused=True)
        outs.append([y, *grads, *(torch.zeros(()) if t is None else t for t in again)])
    for ours, torchs in zip(outs[1], outs[0]):
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-5)
    batch = torch.stack([a.detach(), a.detach() + 1])
    torch.testing.assert_close(torch.func.vmap(lambda a: kernel("_grouped_mm")(a, b.detach(), o))(batch),
                               torch.stack([torch._grouped_mm(x, b.detach(), offs=o) for x in batch]))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_run_dense_with_transformers_numbers(family, cpu):
    """transformers' grouped_mm experts (its MoE default) sort the batch's tokens by expert, which GSPMD cannot split:
    on XLA inputs the trainer runs every expert on every token (_dense_experts), with grouped_mm's outputs and
    gradients. Its swap of transformers' entry hands other tensors to transformers' own; _reset_caches puts it back."""
    import transformers
    from transformers.integrations import moe

    config = {"mixtral": transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=4),
              "qwen3_moe": transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=32, num_experts=4)}[family]
    torch.manual_seed(0)
    experts = [m for m in transformers.AutoModelForCausalLM.from_config(config).modules()
               if type(m).__name__.endswith("Experts")][0]
    g = torch.Generator().manual_seed(0)
    x, logits = torch.randn(24, 32, generator=g, requires_grad=True), torch.randn(24, 4, generator=g)
    weights, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    weights.requires_grad_()
    outs = [f(experts, x, index, weights) for f in (moe.grouped_mm_experts_forward, st._dense_experts)]
    assert torch.equal(outs[0], outs[1])
    cot, wrt = torch.randn(outs[0].shape, generator=g), [x, weights, *experts.parameters()]
    for ours, theirs in zip(*(torch.autograd.grad(y, wrt, cot) for y in outs)):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    own = moe.ExpertsInterface._global_mapping["grouped_mm"]
    st._moe_experts_dense()
    swapped = moe.ExpertsInterface._global_mapping["grouped_mm"]
    assert swapped is not own and torch.equal(swapped(experts, x, index, weights), outs[0])  # CPU tensors: theirs
    st._reset_caches()
    assert moe.ExpertsInterface._global_mapping["grouped_mm"] is own


def test_grouped_mm_keeps_torch_s_errors_and_its_overlapping_offsets():
    """Each input torch's CPU kernel refuses, refused with its error (its meta kernel holds CUDA's: bf16 only); offsets
    that decrease, where two groups hold a row, give it the last group's product, as torch's kernel overwrites it."""
    a, b, o = _grouped((12, 8), (4, 8, 8), offs=[3, 5, 9, 12])
    bad = [(a.double(), b, o), (a, b.double(), o), (a, b.bfloat16(), o), (a[0], b, o), (a[None], b[None], o),
           (a[:, :4], b, o), (a, b, None), (b, b, o), (b, b[:3], None), (a, b, o.long()), (a, b, o[None]),
           (a, b, o[:3]), (a, torch.randn(4, 8, 6), o), (a[:, :6].contiguous(), b[:, :6].contiguous(), o)]
    for args in bad:
        raises_as(lambda: torch._grouped_mm(*args[:2], offs=args[2]), lambda: kernel("_grouped_mm")(*args))
    for kwargs in (dict(bias=torch.randn(4, 8)), dict(out_dtype=torch.float16)):
        raises_as(lambda: torch._grouped_mm(a, b, offs=o, **kwargs), lambda: kernel("_grouped_mm")(a, b, o, **kwargs))
    o = torch.tensor([5, 3, 9, 12], dtype=torch.int32)
    assert torch.equal(kernel("_grouped_mm")(a, b, o), torch._grouped_mm(a, b, offs=o))



class TorchXLAScatterReduce:
    """Stands for torch_xla's scatter_reduce kernel: what it lowers (torch's CPU kernel here), and nothing else."""

    def __call__(self, self_, dim, index, src, reduce, *, include_self):
        assert include_self and reduce != "mean", "torch_xla ran it on the CPU"
        return torch.ops.aten.scatter_reduce.two(self_, dim, index, src, reduce, include_self=include_self)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_reduce_is_torch_xla_s_own_kernel_or_made_of_it(monkeypatch, reduce, include_self, dtype):
    """Issue 49: scatter_reduce's mean and include_self=False, which torch_xla ran on the CPU, through its own kernel
    for the rest: torch's numbers (an integer mean rounds down), places nothing is scattered to kept, 0-dim too."""
    monkeypatch.setitem(st._STATE.xla_kernels, "scatter_reduce.two", TorchXLAScatterReduce())
    g = torch.Generator().manual_seed(7)
    x, src = (torch.randint(-5, 6, shape, generator=g).to(dtype) for shape in [(4, 6), (4, 5)])
    index = torch.randint(0, 4, (3, 5), generator=g)  # rows 0-3, some twice, some never; src larger than index
    for args in [(x, 0, index, src), (x[0, 0], 0, index[0, 0], src[0, 0]), (x[0, 0], 0, index[0, :1], src[0, :2]),
                 (x[0, 0], 0, index[0, :0], src[0, :1])]:
        want = torch.scatter_reduce(*args, reduce, include_self=include_self)
        assert torch.equal(kernel("scatter_reduce.two")(*args, reduce, include_self=include_self), want)



@pytest.mark.parametrize("shapes", [((4, 3), (4, 3)), ((4, 3), (4,)), ((4, 3), (4, 1)), ((5,), ()), ((2, 3), (3,))])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_gaussian_nll_loss_reads_no_value_unless_anomaly_mode(monkeypatch, shapes, reduction):
    """Issue 49: F.gaussian_nll_loss read torch.any(var < 0) to the host at each call. For a var on XLA ours does
    not (torch's checks of shapes and reduction stay; a negative var is clamped to eps) unless torch's anomaly mode is
    on; its numbers and gradients are torch's. Here a CPU tensor stands for an XLA one."""
    monkeypatch.setattr(st, "_is_xla", lambda device: True)
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(shapes[0], generator=g, requires_grad=True), torch.randn(shapes[0], generator=g)
    var = (torch.rand(shapes[1], generator=g) * 2 - 0.2).requires_grad_()  # some below eps (none below 0 for torch)
    torchs = st._torch_path("gaussian_nll_loss")
    if shapes[1] == (3,):
        raises_as(lambda: torchs(x, y, var.clamp(min=0), reduction=reduction),
                  lambda: kernel("gaussian_nll_loss")(x, y, var, reduction=reduction))
        return
    safe = var.detach().clamp(min=0).requires_grad_()
    for full in (False, True):
        want, got = torchs(x, y, safe, full, 1e-3, reduction), kernel("gaussian_nll_loss")(x, y, safe, full, 1e-3,
                                                                                        reduction)
        torch.testing.assert_close(got, want)
        for ours, torch_s in zip(torch.autograd.grad(got.sum(), (x, safe)), torch.autograd.grad(want.sum(), (x, safe))):
            torch.testing.assert_close(ours, torch_s)
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(t) or True)  # a host read of a tensor
    negative = kernel("gaussian_nll_loss")(x, y, var, reduction=reduction)
    assert not reads and negative.isfinite().all()
    monkeypatch.undo()
    monkeypatch.setattr(st, "_is_xla", lambda device: True)
    with torch.autograd.detect_anomaly(), pytest.raises(ValueError, match="var has negative entry/entries"):
        kernel("gaussian_nll_loss")(x, y, var - 1, reduction=reduction)
    raises_as(lambda: torchs(x, y, safe, reduction="avg"),
              lambda: kernel("gaussian_nll_loss")(x, y, safe, reduction="avg"))



def test_rrelu_in_training_draws_slopes_from_the_device_s_generator():
    """Issue 49: rrelu in training: each element <= 0 times its own slope from uniform(lower, upper), drawn where the
    tensor lives (here the CPU's generator stands for XLA's), and the gradient is the slope (1 above 0), as torch's
    derivative; eval is leaky_relu at the mean slope; in place too; a generator of the user's goes to torch's path."""
    x = torch.cat([-torch.rand(100000) - 0.01, torch.rand(10) + 0.01, torch.zeros(1)]).requires_grad_()
    y = kernel("rrelu")(x, 0.1, 0.4, True)
    slope = (y / x).detach()[:100000]
    assert 0.1 <= slope.min() and slope.max() <= 0.4 and slope.unique().numel() > 99000
    torch.testing.assert_close((slope.mean().item(), slope.var().item()), (0.25, 0.3 ** 2 / 12), rtol=0.01, atol=0)
    grad = torch.autograd.grad(y.sum(), x)[0]
    torch.testing.assert_close(grad[:100000], slope)  # y / x rounds
    assert torch.equal(grad[100000:-1], torch.ones(10)) and 0.1 <= grad[-1] <= 0.4
    assert torch.equal(kernel("rrelu")(x, 0.1, 0.4, False), torch.rrelu(x, 0.1, 0.4, False))
    z = x.detach().clone()
    assert kernel("rrelu_")(z, 0.1, 0.4, True) is z and torch.equal(z > 0, x > 0) and (z >= x * 0.4).all()
    g = torch.Generator().manual_seed(9)
    want = torch.rrelu(x, 0.1, 0.4, True, torch.Generator().manual_seed(9))
    assert torch.equal(kernel("rrelu")(x, 0.1, 0.4, True, g), want)


FIRST_STATES = {name: kind for name, kind in vars(torch.optim).items() if isinstance(kind, type)
                and issubclass(kind, torch.optim.Optimizer) and kind not in (torch.optim.Optimizer, torch.optim.LBFGS,
                                                                             torch.optim.SparseAdam)}


@pytest.mark.parametrize("name", sorted(FIRST_STATES))
def test_the_state_made_before_step_one_is_torchs_own(name):
    """Issue 49: _init_state makes an optimizer's state before its first step with torch's own _init_group; two
    steps from there give the weights and state (values, dtypes, devices) of two steps from none, exactly. Every
    torch.optim optimizer but LBFGS (no _init_group) and SparseAdam (sparse gradients)."""
    def two_steps(first):
        torch.manual_seed(0)
        weights = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4, 2))]  # Muon: matrices
        optimizer = FIRST_STATES[name](weights, lr=0.01, **({"momentum": 0.9} if name == "SGD" else {}))
        for step in range(2):
            weights[0].grad, weights[1].grad = torch.randn(3, 4), torch.randn(4, 2)
            if first and step == 0:
                st._init_state(optimizer)
                assert optimizer.state and all(optimizer.state[w] for w in weights), "no state made before step 1"
            optimizer.step()
        return weights, optimizer.state

    (made_first, state_first), (made_in_step, state) = two_steps(True), two_steps(False)
    assert all(torch.equal(a, b) for a, b in zip(made_first, made_in_step))
    for a, b in zip(made_first, made_in_step):
        assert state_first[a].keys() == state[b].keys()
        for key, value in state[b].items():
            assert torch.equal(state_first[a][key], value) and state_first[a][key].device == value.device, key


@pytest.mark.parametrize("dampening, decay, maximize", [(0.0, 0.0, False), (0.1, 0.0, False), (0.5, 0.01, True),
                                                       (1.0, 0.0, False)])
def test_sgd_momentum_made_first_gives_torchs_steps(dampening, decay, maximize):
    """SGD's first step copies the (decayed, maximized) gradient into its momentum buffer: zeros made before the cut
    stand for that copy without dampening, exactly; with dampening the buffer is made from the gradient after the
    cut (_momentum_first), to a rounding. Three steps from there are three steps from none."""
    def steps(first):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(3, 4))
        optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9, dampening=dampening, weight_decay=decay,
                                    maximize=maximize)
        for step in range(3):
            weight.grad = torch.randn(3, 4)
            if first and step == 0:
                st._init_state(optimizer)
                assert bool(optimizer.state[weight]) == (not dampening), "zeros stand for the copy only undamped"
                st._momentum_first(optimizer)
                assert optimizer.state[weight], "no buffer made before step 1"
            optimizer.step()
        return weight, optimizer.state[weight]["momentum_buffer"]

    (weight, buf), (want_weight, want_buf) = steps(True), steps(False)
    tol = {"atol": 0, "rtol": 0} if not dampening else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(weight, want_weight, **tol)
    torch.testing.assert_close(buf, want_buf, **tol)


@pytest.mark.parametrize("beta, alpha", [(1, 1), (0.2, 0.6), (-4.7, 2.0), (0, 0.5), (1, 3)])
def test_addmm_with_any_beta_and_alpha_gives_torchs_numbers(beta, alpha):
    """The addmm kernel (at the XLA key, where torch_xla ran beta or alpha other than 1 on the CPU) on CPU tensors:
    torch's values; beta 0 ignores the input, NaNs included (at 1 and 1, on XLA, torch_xla's own kernel)."""
    g = torch.Generator().manual_seed(0)
    bias, a, b = torch.randn(5, generator=g), torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
    bias[0] = float("nan") if beta == 0 else bias[0]
    got = st._LOWERINGS["addmm"].kernel(bias, a, b, beta=beta, alpha=alpha)
    torch.testing.assert_close(got, torch.addmm(bias, a, b, beta=beta, alpha=alpha), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("p, dim", [(2, []), (0, []), (2, [1]), (0, [0]), (3, [0, 1])])
def test_norm_with_no_dims_is_over_every_dim(p, dim):
    """torch.norm's dim=[] (x.norm(), which Muon's Newton-Schulz step divides by) is every dim: the kernel passed it to
    vector_norm as given, which reduced none on XLA (NaN from Muon's first step on)."""
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    got = st._LOWERINGS["norm.ScalarOpt_dim"].kernel(x, p, dim)
    torch.testing.assert_close(got, torch.ops.aten.norm.ScalarOpt_dim(x, p, dim))


def test_mix32_is_lowbias32_on_int32_tensors():
    """The loop's hash (9d): Wellons' lowbias32, whose unsigned 32-bit values the int32 tensors hold in two's
    complement (multiplications wrap; the masked shifts are logical)."""
    def lowbias32(x):
        x ^= x >> 16
        x = x * 0x7FEB352D & 0xFFFFFFFF
        x ^= x >> 15
        x = x * 0x846CA68B & 0xFFFFFFFF
        return x ^ x >> 16

    values = [0, 1, 2, 12345, 2**31 - 1, -1, -(2**31), 0x7FFF1234]
    got = st._mix32(torch.tensor(values, dtype=torch.int32)).tolist()
    assert [g & 0xFFFFFFFF for g in got] == [lowbias32(v & 0xFFFFFFFF) for v in values]


def test_the_loops_uniforms_are_uniform_independent_and_determined_by_seed_counter_and_index():
    """_uniform: [0, 1) with 24 bits, mean 1/2, chi-square over 16 bins at the 0.1% level (37.7 for 15 degrees of
    freedom), no correlation between neighbouring elements (along either dimension), seeds or counters, and the
    same numbers for the same (seed, counter, shape)."""
    def uniform(seed, counter, shape=(256, 1024)):
        return st._uniform(torch.tensor(seed, dtype=torch.int32), counter, shape, "cpu")

    u = uniform(12345, 1)
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.002
    assert torch.equal(u * 2**24, (u * 2**24).floor()) and len(u.unique()) > 0.98 * u.numel()
    counts, expected = torch.histc(u, 16, 0, 1), u.numel() / 16
    assert ((counts - expected) ** 2 / expected).sum() < 37.7
    bound = 4 / u.numel() ** 0.5  # 4 standard deviations of a correlation of independent samples
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, uniform(12346, 1)), (u, uniform(12345, 2)),
                 (u, uniform(0, 1)), (uniform(0, 1), uniform(1, 1))):
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < bound
    assert torch.equal(u, uniform(12345, 1)) and torch.equal(uniform(7, 3, (5,)), uniform(7, 3, (5,)))


def test_the_loops_random_ops_draw_dropouts_masks_from_the_seed_and_refuse_others():
    """_RandomOps (9d) on CPU tensors: dropout (native_dropout, and dropout1d's bernoulli_ on channels) keeps 1-p,
    scaled by 1/(1-p), the same for the same seed, other masks for another seed or the next draw; another random
    op, or dropout with no seed (eval mode), raises _NotALoop with its name."""
    x, p = torch.ones(64, 256, 32), 0.1

    def masks(seed):
        with st._RandomOps(torch.tensor(seed, dtype=torch.int32)):
            return (torch.ops.aten.native_dropout(x, p, True), torch.nn.functional.dropout(x, p),
                    torch.nn.functional.dropout1d(x, p))

    (out, mask), second, channels = masks(5)
    tolerance = 4 * (p * (1 - p) / x.numel()) ** 0.5
    assert mask.dtype == torch.bool and abs(mask.double().mean().item() - (1 - p)) < tolerance
    assert torch.equal(out, mask / (1 - p)) and not torch.equal(second, out)
    assert torch.equal(channels.unique(), torch.tensor([0, 1 / (1 - p)])) and (channels == channels[..., :1]).all()
    assert all(torch.equal(a, b) for a, b in zip(masks(5)[0] + masks(5)[1:], (out, mask, second, channels)))
    assert not torch.equal(masks(6)[0][1], mask)
    with pytest.raises(st._NotALoop, match=r"random numbers \(randn"), st._RandomOps(torch.tensor(5)):
        torch.randn_like(x)
    with pytest.raises(st._NotALoop, match="native_dropout"), st._RandomOps(None):
        torch.ops.aten.native_dropout(x, p, True)
