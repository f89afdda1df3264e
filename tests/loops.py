"""Loops that no optimizer.step() ends, in the shapes real scripts have (tests/test_real_xla.py drives them).

    python tests/loops.py NAME [K] [reads]   # reports (child.report) {"losses": [...], "compiles": [...], ...}

Run with SEAMLESS_TPU_DEVICE=cpu it is the eager reference (a separate process, as XLA needs), with
SEAMLESS_TPU_DEVICE=xla the same loop through the shim. Each loop records its losses on the device and
reads them once at the end, so any device->host transfer per step is the shim's ("reads": each loss is also read
to the host the ways loops log it, .item() to print, which must not warn). "compiles" is the compile count
after each iteration (always 0 on the CPU); "compile_s" the seconds XLA spent compiling.

    accumulate K   # an 8-layer MLP, AdamW, K micro-batches (K backwards) per optimizer.step()
    accumulate_lm K  # the same with a tiny transformers Qwen3 LM and its own loss
    manual_rnn     # pytorch/examples word_language_model: an LSTM LM, SGD by hand (p.data.add_), the
                   # hidden state carried across batches, then a no-grad evaluation that carries it too
    lbfgs          # pytorch/examples time_sequence_prediction: LSTM cells, LBFGS with a closure
    inference      # forwards only, under no_grad, outputs summed on the device
    inference_mode # an eval loop under torch.inference_mode() (context and decorator) through a transformer
    masked         # x[mask] = v each step (labels[labels < 8] = -100, scores[x < -1] = -5): a where, one graph
    sliced         # manual_rnn fed by slicing a device tensor at a moving offset: recompiles, and says why
    gan_eval [two|ema]  # DCGAN's order (D on real and fake, then G), two optimizers, a no-grad eval each
                   # epoch; "two": the discriminator gets a trainer of its own too; "ema": an EMA of G (as
                   # StyleGAN keeps) is what the eval samples, so no forward cuts the eval: it joins the next step
    ema_eval       # AdamW steps, an EMA copy updated by hand under no_grad after each, both evaluated each epoch
    ema_copy       # ema_eval with the EMA made by copy.deepcopy of the placed model after the trainer (timm's
                   # ModelEmaV2, Lightning's EMA callbacks): the copy carries the trainer's hooks, inert there
    functional     # the step's forward through torch.func.functional_call(model, params and buffers, x)
    distill_eval   # a frozen teacher's no-grad forward + the student's step, the student evaluated each epoch
    distill_eval grow  # the same with a new batch size every step: recompiles, and the watchdog must say so
The epoch loops add "epochs" (the compile count after each epoch) and "warnings" (the watchdog's).
"""

import copy
import logging
import sys

import torch
import torch.nn.functional as F

import child
import seamless_tpu as st

STEPS = 6  # warm-up (2 graphs) and 4 iterations that must compile nothing
EPOCHS, EPOCH_STEPS = 5, 3  # the epoch loops: with 3 steps an epoch, the "step 7" opens epoch 3


HOST_READS = False  # the "reads" argument: logged() reads each loss to the host


def logged(loss):
    """`loss` detached, as the loops record it; with HOST_READS, first read to the host each way loops log it."""
    if HOST_READS:
        print(loss.item(), float(loss), loss.tolist(), bool(loss > 0), f"{loss:.4f}", loss, file=sys.stderr)
    return loss.detach()


def stats(trainer):
    return trainer.compile_stats() if st.is_xla_backend() else {"compiles": 0, "device_to_host_transfers": 0}


def mlp(seed=0, width=64, depth=8):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def accumulate(k, lm=False):
    """lm: a tiny transformers Qwen3 (tests/workloads.py) on token batches, its own loss, instead of the MLP."""
    g = torch.Generator().manual_seed(1)
    if lm:
        import workloads

        model = workloads.tiny_lm()
        data = [
            torch.randint(0, workloads.LM_VOCAB, (workloads.LM_BATCH, workloads.LM_SEQ), generator=g) for _ in range(k)
        ]
        data = [(ids, ids) for ids in data]
    else:
        model = mlp()
        data = [(torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)) for _ in range(k)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model)
    batches = [trainer.to_device(x, y) for x, y in data]
    losses, compiles, transfers = [], [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        for x, y in batches:
            loss = (model(input_ids=x, labels=y).loss if lm else F.mse_loss(model(x), y)) / k
            loss.backward()
            losses.append(logged(loss))
        optimizer.step()
        compiles.append(stats(trainer)["compiles"])
        transfers.append(stats(trainer)["device_to_host_transfers"])
    return losses, compiles, transfers


class RNNModel(torch.nn.Module):
    """word_language_model's RNNModel (LSTM): encoder, LSTM, decoder."""

    def __init__(self, ntoken=50, ninp=16, nhid=16, nlayers=2):
        super().__init__()
        self.encoder, self.rnn, self.decoder = (
            torch.nn.Embedding(ntoken, ninp),
            torch.nn.LSTM(ninp, nhid, nlayers),
            torch.nn.Linear(nhid, ntoken),
        )
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, inputs, hidden):
        output, hidden = self.rnn(self.encoder(inputs), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid)


def corpus(bsz=4, length=200):
    """word_language_model's batchify: a token stream cut into bsz columns, on the host."""
    data = torch.randint(0, 50, (length,), generator=torch.Generator().manual_seed(2))
    return data[: length // bsz * bsz].view(bsz, -1).t().contiguous()


def manual_rnn(sliced=False, bptt=5, lr=0.5):
    torch.manual_seed(0)
    model = RNNModel()
    trainer = st.SeamlessTPUTrainer(model)
    source = corpus()
    if sliced:  # what the script does: the whole corpus on the device, sliced at i each batch
        source = trainer.to_device(source)
    hidden = model.init_hidden(4)
    losses, compiles, transfers = [], [], []

    def batches():
        for i in range(0, STEPS * bptt, bptt):
            x, y = source[i:i + bptt], source[i + 1:i + 1 + bptt].reshape(-1)
            yield (x, y) if sliced else trainer.to_device(x, y)

    for x, y in batches():
        hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
        model.zero_grad()
        output, hidden = model(x, hidden)
        loss = F.nll_loss(output.view(-1, 50), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(logged(loss))
        compiles.append(stats(trainer)["compiles"])
        transfers.append(stats(trainer)["device_to_host_transfers"])
    if sliced:  # its training half already shows the recompiles; an evaluation would only add more
        return losses, compiles, transfers
    with torch.no_grad():  # evaluate(): the hidden state carried, no optimizer, no backward
        hidden = model.init_hidden(4)
        for x, y in batches():
            output, hidden = model(x, hidden)
            losses.append(logged(F.nll_loss(output.view(-1, 50), y)))
            compiles.append(stats(trainer)["compiles"])
            transfers.append(stats(trainer)["device_to_host_transfers"])
    return losses, compiles, transfers


class Sequence(torch.nn.Module):
    """time_sequence_prediction's model: two LSTM cells and a linear head over a sine wave."""

    def __init__(self):
        super().__init__()
        self.lstm1, self.lstm2, self.linear = torch.nn.LSTMCell(1, 8), torch.nn.LSTMCell(8, 8), torch.nn.Linear(8, 1)

    def forward(self, inputs):
        h1 = c1 = h2 = c2 = inputs.new_zeros(inputs.size(0), 8)
        outputs = []
        for t in inputs.split(1, dim=1):
            h1, c1 = self.lstm1(t, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            outputs.append(self.linear(h2))
        return torch.cat(outputs, dim=1)


def lbfgs():
    torch.manual_seed(0)
    model = Sequence().double()
    # history_size bounds LBFGS's two-loop recursion, which XLA traces unrolled: until the history is
    # full, each inner iteration is a new graph (the script's default of 100 means 100 graphs)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2, history_size=1)
    trainer = st.SeamlessTPUTrainer(model)
    wave = torch.sin(
        torch.arange(8 * 5, dtype=torch.float64).view(8, 5) / 4.0 + torch.arange(8.0, dtype=torch.float64)[:, None]
    )
    x, y = trainer.to_device(wave[:, :-1], wave[:, 1:])
    losses, compiles, transfers = [], [], []
    for _ in range(STEPS):
        def closure():
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        losses.append(logged(optimizer.step(closure)))
        compiles.append(stats(trainer)["compiles"])
        transfers.append(stats(trainer)["device_to_host_transfers"])
    return losses, compiles, transfers


def inference():
    model = mlp()
    trainer = st.SeamlessTPUTrainer(model)
    g = torch.Generator().manual_seed(1)
    total, losses, compiles, transfers = None, [], [], []
    with torch.no_grad():
        for _ in range(STEPS):
            out = model(trainer.to_device(torch.randn(16, 64, generator=g))).sum()
            total = out if total is None else total + out
            losses.append(logged(total))
            compiles.append(stats(trainer)["compiles"])
            transfers.append(stats(trainer)["device_to_host_transfers"])
    return losses, compiles, transfers


def inference_mode():
    """An evaluation loop under torch.inference_mode() (the context and the decorator), as loops and libraries write
    it, through a transformer: linear, attention, layer norm. On torch_xla 2.9 each view raised "Cannot set
    version_counter for inference tensor"; once XLA is in use the trainer makes it no_grad."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                torch.nn.Linear(32, 8)).eval()
    trainer = st.SeamlessTPUTrainer(model)
    g = torch.Generator().manual_seed(1)

    @torch.inference_mode()
    def score(x):
        return model(x).softmax(-1).mean()

    run = Epochs(trainer)
    for step in range(STEPS):
        x = trainer.to_device(torch.randn(8, 6, 32, generator=g))
        if step % 2:
            run.step(score(x))
        else:
            with torch.inference_mode():
                run.step(model(x).square().mean())
    return run.losses, run.compiles, run.transfers


def masked():
    """Loops write x[mask] = v at every step: labels[labels == pad] = -100 before a cross entropy, scores[~valid] = -5
    before a softmax. On plain torch_xla each is nonzero on the CPU (a transfer) and a graph per count of True."""
    model = torch.nn.Sequential(*mlp(depth=4)[:-1], torch.nn.Linear(64, 64))  # 64 classes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model)
    g = torch.Generator().manual_seed(1)
    run = Epochs(trainer)
    for _ in range(STEPS):
        x, labels = trainer.to_device(torch.randn(16, 64, generator=g), torch.randint(0, 64, (16,), generator=g))
        labels[labels < 8] = -100  # padding, ignored by the loss
        scores = model(x)
        scores[x < -1.0] = -5.0  # invalid classes, a different count each step
        loss = F.cross_entropy(scores, labels, ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss)
    return run.losses, run.compiles, run.transfers


class Epochs:
    """The epoch loops' record: losses on the device, compiles after each step and each epoch; and, given draw(),
    their data: EPOCH_STEPS batches it draws once, moved to the device, the same every epoch."""

    def __init__(self, trainer, draw=None):
        self.trainer, self.losses, self.compiles, self.transfers, self.epochs = trainer, [], [], [], []
        self.batches = [trainer.to_device(*draw()) for _ in range(EPOCH_STEPS)] if draw else None

    def step(self, *losses):
        self.losses += [logged(loss) for loss in losses]
        self.compiles.append(stats(self.trainer)["compiles"])
        self.transfers.append(stats(self.trainer)["device_to_host_transfers"])

    def epoch(self, *evals):
        self.losses += [logged(e) for e in evals]
        self.epochs.append(stats(self.trainer)["compiles"])
        return self.losses, self.compiles, self.transfers


def gan_eval(two=False, ema=False):
    """pytorch/examples dcgan's step order on MLPs: D on real and on G's detached fake (one backward
    each), D's step, then G through D, G's step; each epoch a no-grad evaluation of G's samples scored
    by D. With `ema`: of G's EMA, and the score summed over the epochs on the device (epoch 2's sum,
    of two device values, is a graph of its own: the issue's one-off at step 7)."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    gen_ema = copy.deepcopy(gen).requires_grad_(False)
    disc = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    trainer = st.SeamlessTPUTrainer(gen)
    if two:
        st.SeamlessTPUTrainer(disc)
    else:
        disc.to(trainer.device)
    gen_ema.to(trainer.device)
    total = 0
    g = torch.Generator().manual_seed(1)
    centre = torch.tensor([2.0, -1.0])
    record = Epochs(trainer, lambda: (centre + 0.3 * torch.randn(8, 2, generator=g), torch.randn(8, 8, generator=g)))
    ones, zeros, eval_z = trainer.to_device(torch.ones(8, 1), torch.zeros(8, 1), torch.randn(16, 8, generator=g))
    for _ in range(EPOCHS):
        for real, z in record.batches:
            opt_d.zero_grad()
            d_real = F.binary_cross_entropy_with_logits(disc(real), ones)
            d_real.backward()
            fake = gen(z)
            d_fake = F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
            d_fake.backward()
            opt_d.step()
            opt_g.zero_grad()
            g_loss = F.binary_cross_entropy_with_logits(disc(fake), ones)
            g_loss.backward()
            opt_g.step()
            if ema:
                ema_update(gen_ema, gen, 0.9)
            record.step(d_real + d_fake, g_loss)
        gen.eval()
        with torch.no_grad():
            samples = (gen_ema if ema else gen)(eval_z)
            score = torch.sigmoid(disc(samples)).mean()
            total = total + score if ema else score
        gen.train()
        losses, compiles, transfers = record.epoch(samples.mean(), total)
    return losses, compiles, transfers, record.epochs


def ema_update(ema, model, decay):
    """timm's ModelEmaV2 update, by hand, as loops write it after optimizer.step()."""
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), model.parameters()):
            p_ema.mul_(decay).add_(p, alpha=1 - decay)


def ema_eval(decay=0.9, copy_after=False):
    """A model and its exponential moving average (timm's ModelEmaV2, by hand): each step ends with
    p_ema.mul_(d).add_(p, alpha=1 - d) under no_grad; each epoch both are evaluated, no grad. copy_after: the EMA is
    a deep copy of the model the trainer placed (on the device, its hook dicts copied with it)."""
    model = mlp()
    ema = None if copy_after else copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = st.SeamlessTPUTrainer(model)
    ema = copy.deepcopy(model).requires_grad_(False) if copy_after else ema.to(trainer.device)
    g = torch.Generator().manual_seed(1)
    record = Epochs(trainer, lambda: (torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)))
    x_val, y_val = trainer.to_device(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g))
    for _ in range(EPOCHS):
        for x, y in record.batches:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            ema_update(ema, model, decay)
            record.step(loss)
        with torch.no_grad():
            losses, compiles, transfers = record.epoch(F.mse_loss(model(x_val), y_val), F.mse_loss(ema(x_val), y_val))
    return losses, compiles, transfers, record.epochs


def functional(steps=STEPS):
    """torch.func.functional_call of the trainer's model with its own parameters and buffers, as meta-learning and
    EMA-by-parameters loops call it: the trainer's hooks run on the module itself, as in a plain forward."""
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = st.SeamlessTPUTrainer(model)
    g = torch.Generator().manual_seed(1)
    x, y = trainer.to_device(torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g))
    losses, compiles, transfers = [], [], []
    for _ in range(steps):
        optimizer.zero_grad()
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        loss = F.mse_loss(torch.func.functional_call(model, params, (x,)), y)
        loss.backward()
        optimizer.step()
        losses.append(logged(loss))
        compiles.append(stats(trainer)["compiles"])
        transfers.append(stats(trainer)["device_to_host_transfers"])
    return losses, compiles, transfers


def distill_eval(grow=False):
    """Knowledge distillation: a frozen teacher's forward under no_grad, then the student's step on
    the teacher's soft targets and the labels; each epoch the student is evaluated, no grad.
    grow: batch n of the run has 4 + n rows, a new shape (a new graph) every step."""
    teacher = mlp(seed=3).eval().requires_grad_(False)
    student = mlp(depth=3)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-2, momentum=0.9)
    trainer = st.SeamlessTPUTrainer(student)
    teacher.to(trainer.device)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 64, generator=g), torch.randn(16, 1, generator=g)) for _ in range(EPOCH_STEPS)]
    batches = [trainer.to_device(x, y) for x, y in data]
    x_val, y_val = trainer.to_device(torch.randn(32, 64, generator=g), torch.randn(32, 1, generator=g))
    record = Epochs(trainer)
    for epoch in range(EPOCHS):
        for i, (x, y) in enumerate(batches):
            if grow:
                n = 4 + epoch * EPOCH_STEPS + i
                x, y = trainer.to_device(torch.cat([data[i][0]] * 2)[:n], torch.cat([data[i][1]] * 2)[:n])
            with torch.no_grad():
                soft = teacher(x)
            optimizer.zero_grad()
            out = student(x)
            loss = F.mse_loss(out, soft) + 0.5 * F.mse_loss(out, y)
            loss.backward()
            optimizer.step()
            record.step(loss)
        with torch.no_grad():
            losses, compiles, transfers = record.epoch(F.mse_loss(student(x_val), y_val))
    return losses, compiles, transfers, record.epochs


class Caught(logging.Handler):
    """seamless_tpu's warnings during the run."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(name, *args):
    global HOST_READS
    HOST_READS, args = args[-1:] == ("reads",), args[:-1] if args[-1:] == ("reads",) else args
    st.get_device()  # XLA first: a CPU backward before it would break XLA's autograd
    run = {"accumulate": lambda: accumulate(int(args[0])), "accumulate_lm": lambda: accumulate(int(args[0]), lm=True),
           "manual_rnn": manual_rnn, "lbfgs": lbfgs, "inference": inference, "inference_mode": inference_mode,
           "masked": masked, "sliced": lambda: manual_rnn(sliced=True),
           "gan_eval": lambda: gan_eval(two="two" in args, ema="ema" in args), "ema_eval": ema_eval,
           "ema_copy": lambda: ema_eval(copy_after=True), "functional": functional,
           "distill_eval": lambda: distill_eval(grow="grow" in args)}[name]
    caught = Caught()
    logging.getLogger(st.__name__).addHandler(caught)
    losses, compiles, transfers, *epochs = run()
    compile_s = 0.0
    if st.is_xla_backend():
        import torch_xla.debug.metrics as met

        compile_s = (met.metric_data("CompileTime") or (0, 0))[1] / 1e9
    child.report({"losses": torch.stack([loss.float() for loss in losses]).cpu().tolist(),
                  "compiles": compiles, "transfers": transfers, "compile_s": compile_s,
                  "epochs": epochs[0] if epochs else None, "warnings": caught.messages})


if __name__ == "__main__":
    main(*sys.argv[1:])
