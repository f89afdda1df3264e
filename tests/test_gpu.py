"""The GPU path on a CUDA host (the gpu tier, `./dev.sh test -m gpu`; every test skips without CUDA, so CI stays
green): the trainer's loop is bitwise the plain loop (fp32, bf16 autocast), runs with no host sync per step
(trainer.log included), counts FLOPs and MFU as by hand, saves asynchronously the state at the call through one
reused set of pinned buffers, runs torch.compile'd models, describes its memory, and runs 2 gloo ranks on one GPU.
Timings (the save's return time, the step during a save) are the bench's: bench/bench.py's checkpoints section."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import child
import seamless_tpu as st

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
STEPS = 8
FP32 = contextlib.nullcontext  # the plain loop's fp32 "autocast"


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.LayerNorm(256), torch.nn.GELU(), torch.nn.Linear(256, 1))


def batches(n, device="cuda"):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 64, generator=g).to(device), torch.randn(32, 1, generator=g).to(device))
            for _ in range(n)]


def train(model, data, autocast, call=None):
    """The plain loop: AdamW, forward under `autocast`, backward, step; the losses (on the device) and weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for x, y in data:
        with autocast():
            loss = F.mse_loss((call or model)(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).cpu(), [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_trainer_trains_bitwise_as_the_plain_loop(fresh, precision):
    data = batches(STEPS)
    plain_autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" else FP32
    want = train(mlp().cuda(), data, plain_autocast)
    model = mlp()
    trainer = st.SeamlessTPUTrainer(model, device="gpu", precision=precision)
    assert trainer.device == torch.device("cuda", torch.cuda.current_device()) and st.device_type() == "gpu"
    got = train(model, data, trainer.autocast)
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_no_host_sync_in_a_step_with_trainer_log_and_its_lines_hold_the_losses(fresh):
    """torch.cuda.set_sync_debug_mode('error') raises at any synchronizing call of the training thread; the log's
    values are read on its own thread, from copies queued behind each step."""
    lines, model = [], mlp()
    trainer = st.SeamlessTPUTrainer(model, device="gpu", log_every=4, log_to=lines.append, progress=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, losses = batches(3 + 8), []
    for step, (x, y) in enumerate(data, 1):
        if step == 4:  # the first steps allocate optimizer state and warm the allocator
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            trainer.log(step, loss=loss)
            losses.append(loss.detach())
        finally:
            if step == len(data):
                torch.cuda.set_sync_debug_mode(0)
    st._STATE.run_log.close()  # the lines in flight are written
    means = [torch.stack(losses[i:i + 4]).mean().item() for i in (0, 4)]
    assert [line["step"] for line in lines] == [4, 8] and [line["loss"] for line in lines] == pytest.approx(means)


def test_stats_count_the_first_steps_matmuls_and_mfu_against_the_device_peak(fresh):
    model = mlp()
    trainer = st.SeamlessTPUTrainer(model, device="gpu")
    train(model, batches(STEPS), FP32)
    stats = trainer.stats()
    # each Linear: 2 x batch x its weights forward, as much for the weights' gradient, and (but the first, whose
    # input needs none) for its input's: torch's FLOP counter on the first step's kernels
    by_hand = 2 * 32 * (64 * 256 * 2 + 256 * 256 * 3 + 256 * 1 * 3)
    assert (stats["steps"], stats["samples"], stats["flops_from"]) == (STEPS, STEPS * 32, "flop_counter")
    assert stats["flops_per_device"] == by_hand
    name, peak = torch.cuda.get_device_name(), st._peak_flops("gpu")
    if "H100 80GB HBM3" in name:  # the SXM card REFERENCE.md measured
        assert peak == 989e12, (name, peak)
    if peak is None:
        assert stats["mfu"] is None, (name, stats)
    else:
        assert stats["mfu"] == pytest.approx(by_hand / stats["step_time_s"] / peak), stats


@pytest.mark.parametrize("room", [True, False], ids=["gpu-copy-first", "no-room-for-it"])
def test_async_save_is_the_state_at_the_call_through_one_reused_set_of_pinned_buffers(tmp_path, fresh, monkeypatch,
                                                                                      room):
    """Three asynchronous saves, each followed at once by steps that write the parameters and AdamW's state in
    place: each checkpoint holds the state at its call, bitwise, and all three copied into the same pinned buffers;
    through a copy on the GPU first, and where the GPU has no room for one (the steps wait for the host copies)."""
    if not room:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 40))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    model = mlp()
    trainer = st.SeamlessTPUTrainer(model, device="gpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = batches(3)

    def steps():
        for x, y in data:
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    steps()
    pointers = []
    for i in range(3):
        at_call = {k: v.detach().clone() for k, v in model.state_dict().items()}
        adam_at_call = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
        future = trainer.save_checkpoint(tmp_path / f"ckpt{i}", blocking=False, model=model, optimizer=optimizer)
        steps()  # queued right behind the copies: they must not overtake them
        buffers = st._STATE.saves.staging.buffers
        assert buffers and all(b.is_pinned() for b in buffers) and st._STATE.saves.staging.on_gpu == room
        pointers.append([b.data_ptr() for b in buffers])
        assert future.result(timeout=120) == str(tmp_path / f"ckpt{i}")
        loaded = mlp(seed=5).cuda()
        loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
        trainer.load_checkpoint(tmp_path / f"ckpt{i}", model=loaded, optimizer=loaded_opt)
        assert all(torch.equal(v, at_call[k]) for k, v in loaded.state_dict().items()), f"save {i}"
        state = loaded_opt.state[loaded[0].weight]
        assert all(torch.equal(state[k].to(v.device), v) for k, v in adam_at_call.items()), f"save {i}"
        assert not torch.equal(model[0].weight, at_call["0.weight"]), "the loop trained meanwhile"
    assert pointers[0] == pointers[1] == pointers[2], "one set of staging buffers, reused"


def test_torch_compile_under_the_trainer_trains_as_the_compiled_plain_loop(fresh):
    data = batches(4)
    plain = mlp().cuda()
    want = train(plain, data, FP32, call=torch.compile(plain))
    model = mlp()
    st.SeamlessTPUTrainer(model, device="gpu")
    got = train(model, data, FP32, call=torch.compile(model))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_describe_and_memory_stats_count_the_parameters_and_adam_state_on_the_gpu(fresh):
    model = mlp()
    trainer = st.SeamlessTPUTrainer(model, device="gpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, batches(1), FP32)  # its own AdamW: not this one's state
    x, y = batches(1)[0]
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert trainer.memory_stats(optimizer) == {"per_device": [3 * params], "replica": 3 * params}  # + exp_avg(_sq)
    text = trainer.describe(optimizer)
    assert text.splitlines()[0].startswith("cuda"), text
    size = st._fmt_bytes(params)
    assert f"parameters: {size} per device of {size} in one replica (1.00)" in text, text


def test_two_gloo_ranks_on_one_gpu_average_like_eager_with_no_ddp_warning(tmp_path):
    """tests/dist_ranks.py's unused_parameters on cuda:0 for both ranks: DDP keeps find_unused_parameters off and
    prints nothing about it when every parameter is used, and turns it on when rank 1 leaves a head out."""
    for case, find_unused in (("all", False), ("skips", True)):
        env = child.env(cuda=True, SEAMLESS_TPU_DEVICE="gpu", UNUSED_CASE=case)
        outs = child.run_together([(["tests/dist_ranks.py", "unused_parameters", rank, 2, tmp_path / f"store-{case}",
                                     tmp_path], env) for rank in range(2)], timeout=300, stderr=True)
        ranks = [child.result(out) for out, _ in outs]
        for rank, (seen, (_, err)) in enumerate(zip(ranks, outs)):
            assert (seen["find_unused_before"], seen["find_unused_after"]) == (False, find_unused), (case, rank, seen)
            assert seen["weights_diff"] <= 1e-4 and seen["norms_diff"] <= 1e-4, (case, rank, seen)
            assert seen["weights"] == ranks[0]["weights"], f"{case}: the ranks diverged"
            if case == "all":
                assert "find_unused_parameters" not in err, (rank, err[-2000:])
