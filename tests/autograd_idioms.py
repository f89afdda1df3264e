"""Autograd beyond one backward (issue 39): idioms that differentiate a derivative, transform a model with torch.func,
or call ops in the forms torch documents but training loops seldom reach, each a few steps of a tiny model.

    python tests/autograd_idioms.py NAME         # on XLA under the trainer, the batch split over the 4 devices
    python tests/autograd_idioms.py eager NAME   # the same code eagerly on the CPU (SEAMLESS_TPU_DEVICE=cpu)

tests/test_autograd.py runs both in separate processes and compares them. Each idiom reports (child.report)
{"first": {...}, "second": {...}, "shapes": {...}}: lists of numbers made of values and first derivatives (losses,
weights, gradients), lists made of second derivatives (Hessian-vector products, a penalty's gradient), and shapes.

    wgan_gp           a WGAN-GP critic (LayerNorm, as the paper has it) and a generator, Adam, 2 critic steps per
                      generator step; the penalty differentiates autograd.grad(..., create_graph=True)
    wgan_gp_blocks    the same with a critic made of a stack of residual blocks, one loop on XLA
    gpt_second_order  a Hessian-vector product through transformers' GPT-2 (its blocks one loop on XLA), and SGD on its
                      loss plus a gradient-norm penalty
    hvp               torch.autograd.functional.hvp of a LayerNorm MLP's loss wrt its parameters: a damped Newton step
                      along the gradient, its length from the curvature there
    per_sample_grads  DP-SGD: vmap(grad(loss)) over the batch through functional_call, each sample's gradient clipped,
                      averaged (no noise: deterministic), an SGD step by hand
    jvp_conv          torch.func.jvp of a conv net (a grouped conv, GroupNorm, adaptive average pooling)
                      wrt its input, along a random tangent: a Jacobian-norm regulariser trained by backward
    global_max_pool   a conv net ending in nn.AdaptiveMaxPool2d(1), SGD
    einsum_twice      second derivatives of torch.einsum ("bij,jk->bik", "bhtd,bhsd->bhts", "ij,j->i") and of a 3-D
                      matmul (which the trainer lowers to an einsum) by create_graph
    unbatched_fold    F.unfold of an unbatched (C, H, W) image and F.fold of an unbatched (C*K, L) input, a weight
                      between them trained by SGD
    hessians          torch.func.hessian over slices of the batch-split input, all of it, per sample (vmap) and
                      wrt a weight (functional_call)
    fsdp_conv         1-, 2- and 3-D convolutions under strategy="fsdp" (their split weights gathered in order), SGD on
                      a loss with an input-gradient penalty, and torch.func.jvp of the net
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import child
import seamless_tpu as st

B = 8  # samples per batch: 2 a device


def batches(steps, *shapes, seed=1):
    """`steps` tuples of standard-normal tensors of `shapes`, drawn on the host (the same in both processes)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(shape, generator=g) for shape in shapes) for _ in range(steps)]


def flat(tensors):
    """Tensors as one flat float tensor, on their device: main() reads every idiom's numbers in one transfer."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def ln_mlp(d_in=8, width=16, d_out=1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, d_out))


class Residual(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + F.leaky_relu(self.linear(self.norm(x)), 0.2)


class StackCritic(nn.Module):
    """A critic made of a stack of residual blocks, which the trainer runs as one loop on XLA."""

    def __init__(self, depth=3, width=32):
        super().__init__()
        self.inp, self.out = nn.Linear(2, width), nn.Linear(width, 1)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def looped():
    """On XLA, that the trainer ran every stack as one loop: each body it traced, none it fell back from."""
    if st.device_type() == "xla":
        bodies = [b for s in st._STATE.loops.stacks.values() for b in s.bodies.values()]
        if not bodies or not all(isinstance(b, st._Body) for b in bodies):
            raise AssertionError(f"the stacks did not run as loops: {bodies}")


def wgan_gp_blocks():
    """wgan_gp with a critic made of a stack of blocks, one loop on XLA: the penalty's create_graph backward through
    it recomputes the blocks one by one. SGD: Adam turns the last bits of its near-zero gradients (the residual
    blocks' LayerNorm biases) into steps of its full learning rate, which took the unrolled XLA run 5e-4 from eager's
    weights as it took the looped one (the two runs 1.2e-7 apart)."""
    out = wgan_gp(critic=StackCritic, optimizer=lambda params: torch.optim.SGD(params, lr=1e-2))
    looped()
    return out


def wgan_gp(gen_steps=3, n_critic=2, gp_weight=10.0, critic=None, optimizer=None):
    """Gulrajani et al.'s Algorithm 1 on 2-D points: the critic's gradient at points between real and fake samples
    is pushed to norm 1; its own gradient wrt the critic's weights is a second derivative."""
    torch.manual_seed(0)
    critic = critic() if critic else nn.Sequential(
        nn.Linear(2, 32), nn.LayerNorm(32), nn.LeakyReLU(0.2), nn.Linear(32, 32), nn.LayerNorm(32), nn.LeakyReLU(0.2),
        nn.Linear(32, 1))
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    opt_c = optimizer(critic.parameters()) if optimizer else torch.optim.Adam(critic.parameters(), lr=1e-3,
                                                                                 betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.9))
    trainer = st.SeamlessTPUTrainer(critic)
    st.SeamlessTPUTrainer(gen)
    data = [trainer.to_device(real + torch.tensor([2.0, -1.0]), z, torch.sigmoid(eps))
            for real, z, eps in batches(gen_steps * n_critic, (B, 2), (B, 4), (B, 1))]
    zs = [trainer.to_device(z) for (z,) in batches(gen_steps, (B, 4), seed=2)]
    losses, penalties, penalty_grads = [], [], None
    for step in range(gen_steps):
        for real, z, eps in data[step * n_critic:(step + 1) * n_critic]:
            opt_c.zero_grad()
            fake = gen(z).detach()
            interp = (eps * real + (1 - eps) * fake).requires_grad_(True)
            score = critic(interp)
            (grad,) = torch.autograd.grad(score, interp, grad_outputs=torch.ones_like(score), create_graph=True)
            penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            if penalty_grads is None:  # the penalty's own gradient at the first step: made of second derivatives
                penalty_grads = torch.autograd.grad(penalty, list(critic.parameters()), retain_graph=True,
                                                    materialize_grads=True)  # the last bias's: 0
            loss = critic(fake).mean() - critic(real).mean() + gp_weight * penalty
            loss.backward()
            opt_c.step()
            losses.append(loss.detach())
            penalties.append(penalty.detach())
        opt_g.zero_grad()
        g_loss = -critic(gen(zs[step])).mean()
        g_loss.backward()
        opt_g.step()
        losses.append(g_loss.detach())
    return {"first": {"losses": flat(losses), "penalties": flat(penalties), "critic": flat(critic.parameters()),
                      "generator": flat(gen.parameters())},
            "second": {"penalty_grads": flat(penalty_grads)}}


def hvp(steps=3, damping=1.0):
    """Sharpness-aware and second-order optimizers' core: the loss's Hessian times a direction, here the gradient's
    unit vector v, by torch.autograd.functional.hvp (double backward: three passes). The step moves along -v by
    |g| / (v.Hv + damping), a damped Newton step along the gradient."""
    model = ln_mlp()
    trainer = st.SeamlessTPUTrainer(model)
    x, y = trainer.to_device(*batches(1, (B, 8), (B, 1))[0])
    names = [name for name, _ in model.named_parameters()]

    def loss_of(*params):
        return F.mse_loss(torch.func.functional_call(model, dict(zip(names, params)), (x,)), y)

    losses, products, curvatures = [], [], []
    for _ in range(steps):
        params = tuple(p.detach() for p in model.parameters())
        loss = loss_of(*model.parameters())
        grads = torch.autograd.grad(loss, list(model.parameters()))
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        v = tuple(g / norm for g in grads)
        _, hv = torch.autograd.functional.hvp(loss_of, params, v)
        curvature = sum((a * b).sum() for a, b in zip(v, hv))
        with torch.no_grad():
            for p, d in zip(model.parameters(), v):
                p.sub_(norm / (curvature + damping) * d)
        losses.append(loss.detach())
        products += hv
        curvatures.append(curvature.detach())
    return {"first": {"losses": flat(losses), "weights": flat(model.parameters())},
            "second": {"hvp": flat(products), "curvature": flat(curvatures)}}


def gpt_second_order(steps=2, lr=0.05, penalty=0.1):
    """A small causal GPT (transformers' GPT-2 from its config, its defaults but eager attention, whose CPU kernel
    differentiates twice; its blocks one loop on XLA): a Hessian-vector product of its loss wrt its parameters, along
    ones, and SGD on the loss plus a gradient-norm penalty, whose gradient differentiates the loss's gradient."""
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager"))
    trainer = st.SeamlessTPUTrainer(model)
    ids = trainer.to_device(torch.randint(64, (B, 16), generator=torch.Generator().manual_seed(1)))
    params = list(model.parameters())
    grads = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params, create_graph=True)
    hvp = torch.autograd.grad(sum(g.sum() for g in grads), params)
    optimizer, losses = torch.optim.SGD(params, lr=lr), []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        grads = torch.autograd.grad(loss, params, create_graph=True)
        total = loss + penalty * sum(g.square().sum() for g in grads)
        total.backward()
        optimizer.step()
        losses.append(total.detach())
    looped()
    return {"first": {"losses": flat(losses)}, "second": {"hvp": flat(hvp), "weights": flat(params)}}


def per_sample_grads(steps=3, clip=0.5, lr=0.1):
    """Opacus-style DP-SGD without noise: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0)) gives every
    sample's gradient, each clipped to norm `clip`, then averaged into an SGD step by hand."""
    model = ln_mlp()
    trainer = st.SeamlessTPUTrainer(model)
    x, y = trainer.to_device(*batches(1, (B, 8), (B, 1))[0])

    def loss_fn(params, sample, target):
        return F.mse_loss(torch.func.functional_call(model, params, (sample[None],)), target[None])

    per_sample = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))
    losses, factors = [], []
    for _ in range(steps):
        with torch.no_grad():
            losses.append(F.mse_loss(model(x), y))
        grads = per_sample({name: p.detach() for name, p in model.named_parameters()}, x, y)
        norm = torch.sqrt(sum(g.flatten(1).square().sum(1) for g in grads.values()))  # (B,): one per sample
        scale = (clip / (norm + 1e-6)).clamp(max=1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                g = grads[name]
                p.sub_(lr * (g * scale.view((-1,) + (1,) * (g.dim() - 1))).mean(0))
        factors.append(scale)
    return {"first": {"losses": flat(losses), "clip_factors": flat(factors), "weights": flat(model.parameters())},
            "second": {}}


def jvp_conv(steps=3, weight=0.1, lr=0.05):
    """A Jacobian-norm regulariser (robustness, contractive penalties): torch.func.jvp of the net at x along a
    random tangent t gives J(x) t with the output, and |J t|^2 joins the loss that backward trains: reverse mode
    through forward mode, through convolutions (one grouped), GroupNorm and adaptive average pooling to a size that
    does not divide the input's (7 to 3: the trainer's own lowering). Not BatchNorm: eager torch 2.9 differentiates
    batch_norm's JVP wrongly wrt the input in training mode (gradcheck fails; pytorch/pytorch#196699 is its nested-JVP
    twin), so eager would be no reference; the trainer's composite kernel gives the right number there."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.GroupNorm(4, 8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(3), nn.Flatten(), nn.Linear(8 * 9, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    trainer = st.SeamlessTPUTrainer(net)
    data = [trainer.to_device(x, t, (y.abs() * 2).long().clamp(max=3))
            for x, t, y in batches(steps, (B, 3, 7, 7), (B, 3, 7, 7), (B,))]
    losses, penalties = [], []
    for x, tangent, y in data:
        optimizer.zero_grad()
        out, jt = torch.func.jvp(net, (x,), (tangent,))
        penalty = jt.square().mean()
        loss = F.cross_entropy(out, y) + weight * penalty
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        penalties.append(penalty.detach())
    return {"first": {"losses": flat(losses), "penalties": flat(penalties), "weights": flat(net.parameters())},
            "second": {}}


def global_max_pool(steps=3, lr=0.1):
    """A conv net whose head is global max pooling (nn.AdaptiveMaxPool2d(1), as in many classifiers), trained by
    SGD."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    trainer = st.SeamlessTPUTrainer(net)
    data = [trainer.to_device(x, (y.abs() * 2).long().clamp(max=3)) for x, y in batches(steps, (B, 3, 6, 6), (B,))]
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"first": {"losses": flat(losses), "weights": flat(net.parameters())}, "second": {}}


def frozen_bn(steps=3, lr=0.1):
    """Fine-tuning with BatchNorm frozen (model.eval(): the running statistics, as detection and transfer learning
    do), and the input's gradient taken too (saliency, adversarial examples): torch_xla 2.9's eval batch_norm raised
    in its backward ("The size of mean should be compatible with feature count")."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(8, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    trainer = st.SeamlessTPUTrainer(net)
    data = [trainer.to_device(x, (y.abs() * 2).long().clamp(max=3)) for x, y in batches(steps + 1, (B, 3, 6, 6), (B,))]
    with torch.no_grad():  # running statistics from one batch, then frozen
        net(data[0][0])
    net.eval()
    losses, input_grads = [], []
    for x, y in data[1:]:
        optimizer.zero_grad()
        x = x.clone().requires_grad_()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        input_grads.append(x.grad)
    return {"first": {"losses": flat(losses), "input_grads": flat(input_grads), "weights": flat(net.parameters()),
                      "running_var": flat([net[1].running_var])}, "second": {}}


# (equation, the shapes of its operands that come with the batch, the shape of its weight or None); "@" is matmul
CONTRACTIONS = [("bij,jk->bik", [(B, 4, 5)], (5, 3)), ("bhtd,bhsd->bhts", [(B, 2, 3, 4), (B, 2, 6, 4)], None),
                ("ij,j->i", [(B, 5)], (5,)), ("@", [(B, 4, 5)], (5, 3))]


class Contract(nn.Module):
    """A layer that contracts its input with its weight: by torch.einsum(equation, ...), or by matmul for "@" (on
    XLA the trainer lowers a 3-D matmul to an einsum)."""

    def __init__(self, equation, shape):
        super().__init__()
        self.equation, self.weight = equation, nn.Parameter(torch.randn(shape) / shape[0] ** 0.5)

    def forward(self, x):
        return x @ self.weight if self.equation == "@" else torch.einsum(self.equation, x, self.weight)


def einsum_twice():
    """For each product: L = sum(sin(product)); its gradients wrt every operand by create_graph, then the Hessian
    times a random direction by differentiating <gradients, direction>, as gradient penalties, MAML's inner step and
    Hessian-free methods do. Attention's two operands both come with the batch; the others meet a weight."""
    torch.manual_seed(0)
    model = nn.ModuleList([Contract(equation, weight) for equation, _, weight in CONTRACTIONS if weight])
    trainer = st.SeamlessTPUTrainer(model)
    layers = iter(model)
    first, second = {}, {}
    for i, (equation, shapes, weight) in enumerate(CONTRACTIONS):
        inputs = [trainer.to_device(t / 2).requires_grad_(True) for t in batches(1, *shapes, seed=i + 1)[0]]
        if weight:
            layer = next(layers)
            product, operands = layer(*inputs), [*inputs, layer.weight]
        else:
            product, operands = torch.einsum(equation, *inputs), inputs
        directions = [u.to(trainer.device) for u in batches(1, *(t.shape for t in operands), seed=9)[0]]
        loss = torch.sin(product).sum()
        grads = torch.autograd.grad(loss, operands, create_graph=True)
        products = torch.autograd.grad(sum((g * u).sum() for g, u in zip(grads, directions)), operands)
        first[equation] = flat([loss, *grads])
        second[equation] = flat(products)
    return {"first": first, "second": second}


def einsum_twice_highest():
    """einsum_twice with torch_xla's matmul precision at "highest" on XLA (issue 60): each dot a call of its own HLO,
    the precision in it, through forward, create_graph and the Hessian-vector product. Eager has no such setting."""
    if st.device_type() == "xla":
        import torch_xla.backends

        torch_xla.backends.set_mat_mul_precision("highest")
    return einsum_twice()


class Patches(nn.Module):
    """An unbatched image cut into its 2x2 patches (F.unfold: (C*4, L)), mixed by a weight, put back (F.fold)."""

    def __init__(self, channels, side):
        super().__init__()
        self.side = side
        self.weight = nn.Parameter(torch.eye(channels * 4) + 0.1 * torch.randn(channels * 4, channels * 4))

    def forward(self, image):
        return F.fold(self.weight @ F.unfold(image, 2), (self.side, self.side), 2)


def unbatched_fold(steps=3, lr=0.1):
    """torch documents F.unfold for (C, H, W) and F.fold for (C*K, L) inputs (no batch dimension): the shapes, the
    values and the gradients of both, and a weight between them trained by SGD. Without a batch dimension there is
    nothing to split: the tensors go to the device by .to(), replicated."""
    torch.manual_seed(0)
    model = Patches(3, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = st.SeamlessTPUTrainer(model)
    image, columns, target = (t.to(trainer.device) for t in batches(1, (3, 6, 6), (12, 25), (3, 6, 6))[0])
    image.requires_grad_(True)
    columns.requires_grad_(True)
    unfolded, folded = F.unfold(image, 2), F.fold(columns, (6, 6), 2)
    shapes = {"unfold": list(unfolded.shape), "fold": list(folded.shape)}
    grads = torch.autograd.grad(unfolded.square().sum() + folded.square().sum(), [image, columns])
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(image.detach()), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"first": {"unfold": flat([unfolded]), "fold": flat([folded]), "grads": flat(grads),
                      "losses": flat(losses), "weights": flat(model.parameters())},
            "second": {}, "shapes": shapes}


def hessians():
    """torch.func.hessian of a tanh MLP's output: over one sample, a slice of the batch-split input (x[0], x[1:3],
    x[::2]), over the whole split input, per sample by vmap, and wrt the first layer's weight by functional_call.
    REFERENCE.md's seventh round measured the first abort torch_xla 2.9 SPMD (a CHECK in spmd_partitioner_util.h:127);
    none of these forms does now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    trainer = st.SeamlessTPUTrainer(model)
    x = trainer.to_device(batches(1, (B, 4))[0][0])

    def f(v):
        return model(v).square().sum()

    def of_weight(w):
        return torch.func.functional_call(model, {"0.weight": w}, (x,)).square().sum()

    hessian = torch.func.hessian
    out = {"slice": hessian(f)(x[0]), "slices": hessian(f)(x[1:3]), "strided": hessian(f)(x[::2]),
           "whole": hessian(f)(x), "per_sample": torch.func.vmap(hessian(f))(x),
           "weight": hessian(of_weight)(model[0].weight.detach())}
    return {"first": {}, "second": {k: flat([v]) for k, v in out.items()},
            "shapes": {k: list(v.shape) for k, v in out.items()}}


def fsdp_conv(steps=3, lr=0.1, gp_weight=0.1):
    """Convolutions under strategy="fsdp", whose split weights the trainer gathers for each product in order (an
    autograd.Function of its own, _GatheredConv): 3-D, 2-D with and without bias, stride, padding and dilation, and
    1-D, trained by SGD on a loss with an input-gradient penalty (create_graph: the penalty's gradient differentiates
    the convolutions' backward), and torch.func.jvp of the net along a random tangent (transforms take torch's
    path)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.Flatten(1, 2), nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(8, 8, 3, stride=2, padding=2, dilation=2, bias=False), nn.Tanh(), nn.Flatten(2),
                        nn.Conv1d(8, 8, 2), nn.Flatten(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    trainer = st.SeamlessTPUTrainer(net, strategy="fsdp")
    convs = [m.weight for m in net if isinstance(m, nn.modules.conv._ConvNd)]
    if st.device_type() == "xla" and not all(map(st._gathered, convs)):  # else the test would not test it
        raise AssertionError("the convolutions' weights are not split by fsdp")
    data = [trainer.to_device(x, t, (y.abs() * 2).long().clamp(max=3))
            for x, t, y in batches(steps, (B, 2, 4, 6, 6), (B, 2, 4, 6, 6), (B,))]
    losses, input_grads, tangents = [], [], []
    for x, tangent, y in data:
        optimizer.zero_grad()
        x.requires_grad_(True)
        out = net(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        loss = F.cross_entropy(out, y) + gp_weight * grad.square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        input_grads.append(grad.detach())
        tangents.append(torch.func.jvp(net, (x.detach(),), (tangent,))[1])
    return {"first": {"losses": flat(losses), "input_grads": flat(input_grads), "jvp": flat(tangents)},
            "second": {"weights": flat(net.parameters())}}


IDIOMS = {f.__name__: f for f in (wgan_gp, hvp, per_sample_grads, jvp_conv, global_max_pool, frozen_bn, einsum_twice,
                                  einsum_twice_highest, unbatched_fold, hessians, fsdp_conv, wgan_gp_blocks,
                                  gpt_second_order)}


def main(*args):
    eager = args[0] == "eager"
    name = args[-1]
    st.get_device()  # XLA first: a CPU backward before it would break XLA's autograd
    want = "cpu" if eager else "xla"
    if st.device_type() != want:
        raise SystemExit(f"{' '.join(args)} needs SEAMLESS_TPU_DEVICE={want}, got device {st.device_type()!r}")
    out = IDIOMS[name]()
    keys = [(order, key) for order in ("first", "second") for key in out[order]]
    numbers = torch.cat([out[order][key] for order, key in keys]).cpu()  # one graph, one transfer: not one each
    sizes = [out[order][key].numel() for order, key in keys]
    report = {"first": {}, "second": {}, "shapes": out.get("shapes", {})}
    for (order, key), values in zip(keys, numbers.split(sizes)):
        report[order][key] = values.tolist()
    child.report(report)


if __name__ == "__main__":
    main(*sys.argv[1:])
