"""seamless_tpu: one plain PyTorch training loop on TPU (XLA SPMD), GPU or CPU, and under Ray Train.

Usage (the optimizer may be created before the model moves, as most loops do):

    trainer = SeamlessTPUTrainer(model)          # picks TPU, then GPU, then CPU
    x, y = trainer.to_device(x, y)               # on XLA: batch dim sharded over the mesh
    loss_fn(model(x), y).backward(); optimizer.step()   # on XLA the step ends in torch_xla.sync()

Backends: "tpu" (torch_xla, PJRT_DEVICE=TPU), "xla" (torch_xla on another PJRT device, e.g.
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4), "gpu" (CUDA), "cpu". torch_xla and ray are imported only when
a code path needs them, so this file can be copied alone into a project that has neither.

Environment variables read: SEAMLESS_TPU_DEVICE (auto|tpu|xla|gpu|cpu), PJRT_DEVICE,
TPU_ACCELERATOR_TYPE, RANK / LOCAL_RANK (logging and CUDA device choice), TPU_VISIBLE_CHIPS (warning).
Set only where unset: PJRT_DEVICE when an XLA device is requested; and, by the Ray "xla_tpu" backend
on each worker, PJRT_DEVICE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES. torch_xla itself sets
XLA_USE_SPMD=1 when SPMD is enabled.
"""

__all__ = [
    "get_device",
    "device_type",
    "is_xla_backend",
    "to_device",
    "SeamlessTPUTrainer",
    "parse_topology",
    "mesh_shape_for",
    "create_xla_mesh",
    "get_xla_mesh",
    "TorchConfig",
    "TorchTrainer",
]

import contextlib
import dataclasses
import functools
import glob
import importlib
import importlib.util
import logging
import math
import os
import re
import socket
import sys
import weakref
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

logger = logging.getLogger(__name__)

# --- constants and flags -------------------------------------------------------------------------

ENV_DEVICE = "SEAMLESS_TPU_DEVICE"
DEVICE_KINDS = ("auto", "tpu", "xla", "gpu", "cpu")
XLA_KINDS = ("tpu", "xla")
XLA_BACKENDS = ("xla_tpu", "xla")
PRECISIONS = (None, "fp32", "bf16")
SPMD_CONFIG_KEYS = ("mesh_shape", "axis_names", "data_parallel_size", "model_parallel_size")
MODEL_AXES = ("model",)  # axes that carry model parallelism; an explicit mesh's other axes shard the batch
WARMUP_STEPS = 2  # step 1 compiles the step graph, step 2 the one with optimizer state; then stable
_INSTALL = {
    "torch_xla": "pip install 'torch_xla[tpu]==2.9.0' (XLA on CPU/GPU: pip install torch==2.9.0 torch_xla==2.9.0)",
    "ray": "pip install 'ray[train]'",
}
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips show up as PCI devices of this vendor on TPU VMs
_TOPOLOGY_RE = re.compile(r"^[0-9]+(x[0-9]+){1,2}$")

# --- lazy imports and probes ---------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _import(name):
    """Import torch_xla/ray (sub)modules on first use, with the install command on failure."""
    root = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"seamless_tpu needs {root} for this: {_INSTALL.get(root, 'pip install ' + root)}") from e


@functools.lru_cache(maxsize=None)
def _xla_installed():
    # find_spec does not execute torch_xla, whose import writes env defaults: detection stays pure.
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except ValueError:  # a module without __spec__ already sits in sys.modules (a stub or fake)
        return sys.modules.get("torch_xla") is not None


@functools.lru_cache(maxsize=None)
def _tpu_chip_count():
    count = 0
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                count += f.read().strip() == _GOOGLE_PCI_VENDOR
        except OSError:  # devices can vanish between glob and open; they are not ours to count
            continue
    return count


def _tpu_present():
    pjrt = os.environ.get("PJRT_DEVICE")
    if pjrt:
        return pjrt.upper() == "TPU"
    return _tpu_chip_count() > 0 or bool(os.environ.get("TPU_ACCELERATOR_TYPE"))


@functools.lru_cache(maxsize=None)
def _auto_kind():
    if _xla_installed():
        if _tpu_present():
            return "tpu"
        if os.environ.get("PJRT_DEVICE"):
            return "xla"
    if torch.cuda.is_available():
        return "gpu"
    return "cpu"


_CACHED_PROBES = (_import, _xla_installed, _tpu_chip_count, _auto_kind)

# --- device detection ----------------------------------------------------------------------------


def _resolve_kind(kind=None):
    """Turn a requested kind (or SEAMLESS_TPU_DEVICE, or auto) into one of tpu/xla/gpu/cpu, or raise."""
    if isinstance(kind, torch.device):
        if kind.type == "xla":
            return _auto_xla_kind()
        return "gpu" if kind.type == "cuda" else "cpu"
    requested = kind if kind is not None else (os.environ.get(ENV_DEVICE) or "auto")
    if not isinstance(requested, str) or requested.lower() not in DEVICE_KINDS:
        where = "device" if kind is not None else ENV_DEVICE
        raise ValueError(f"{where} must be one of {DEVICE_KINDS}, got {requested!r}")
    requested = requested.lower()
    if requested == "auto":
        return _auto_kind()
    if requested in XLA_KINDS and not _xla_installed():
        raise ImportError(f"device {requested!r} needs torch_xla, which is not installed: {_INSTALL['torch_xla']}")
    if requested == "tpu" and not _tpu_present():
        raise RuntimeError(
            "device 'tpu' was requested but no TPU is visible: PJRT_DEVICE="
            f"{os.environ.get('PJRT_DEVICE')!r}, TPU PCI devices found: {_tpu_chip_count()}. "
            "Run on a TPU VM (or set PJRT_DEVICE=TPU there), or ask for 'xla' / 'auto'."
        )
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("device 'gpu' was requested but torch.cuda.is_available() is False; use 'auto' or 'cpu'")
    return requested


def _auto_xla_kind():
    return "tpu" if _tpu_present() else "xla"


def device_type():
    """'tpu', 'xla', 'gpu' or 'cpu': what get_device() would use. Creates nothing, writes no env."""
    return _resolve_kind(None)


def is_xla_backend():
    return device_type() in XLA_KINDS


def get_device(kind=None):
    """The torch.device for `kind` (auto|tpu|xla|gpu|cpu; default SEAMLESS_TPU_DEVICE, else auto).

    A torch.device is passed through. On XLA this is the moment SPMD is switched on (before any
    XLA tensor can exist) and the process mesh is built.
    """
    if isinstance(kind, torch.device) and kind.type != "xla":
        return kind
    kind = _resolve_kind(kind)
    if kind in XLA_KINDS:
        device = _activate_xla(kind)
        if _MESH is None:
            create_xla_mesh()
        return device
    if kind == "gpu":
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) % torch.cuda.device_count() if local_rank else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def _torch_dist_ranks():
    """(world size, rank) of torch.distributed, or (1, 0) when it is not running."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _is_main_process():
    if _XLA is not None:
        return _import("torch_xla.runtime").process_index() == 0
    size, rank = _torch_dist_ranks()
    return rank == 0 if size > 1 else os.environ.get("RANK", "0") == "0"


def _log(msg, *args):
    """Rank 0 logs at info, the other ranks at debug, so N workers do not print N copies."""
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.DEBUG
    logger.log(level, msg, *args)


# --- moving data ---------------------------------------------------------------------------------


def _apply(obj, on_tensor, on_other=None):
    """Map `on_tensor` over every tensor in a nested batch; containers keep their types."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, Mapping):
        items = {k: _apply(v, on_tensor, on_other) for k, v in obj.items()}
        if isinstance(obj, defaultdict):
            return type(obj)(obj.default_factory, items)
        try:
            return type(obj)(items)
        except TypeError:  # mappings that cannot be built from a dict (e.g. MappingProxyType)
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_apply(v, on_tensor, on_other) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_apply(v, on_tensor, on_other) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _apply(getattr(obj, f.name), on_tensor, on_other) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if on_other is not None and callable(getattr(obj, "to", None)):
        return on_other(obj)
    return obj


def _mover(device, sharding=None):
    if _is_xla(device):
        return functools.partial(_to_xla, device=device, sharding=sharding)
    non_blocking = device.type == "cuda"  # async copies only help (and are only safe) host->CUDA
    return lambda t: t.to(device, non_blocking=non_blocking)


def _move(objs, device, sharding=None):
    on_tensor = _mover(device, sharding)
    moved = tuple(_apply(o, on_tensor, lambda m: m.to(device)) for o in objs)
    return moved[0] if len(moved) == 1 else moved


def to_device(*objs, device=None):
    """Move tensors, nested batches (dict, list, tuple, namedtuple, dataclass) and modules to `device`.

    One argument returns it moved; several return a tuple. On XLA with the default device, every
    tensor's dim 0 is sharded over the mesh's batch axes, so each device computes its own slice.
    """
    target = get_device(device)
    sharding = _batch_sharding() if _is_xla(target) else None
    return _move(objs, target, sharding)


# --- mesh and SPMD -------------------------------------------------------------------------------

_XLA = None  # the activated XLA device; None until get_device() first resolves to tpu/xla
_MESH = None  # the process mesh: get_xla_mesh()
_SHARDING = None  # how inputs are sharded over _MESH: dim 0 over its batch axes
_HOOKS = []  # global optimizer hooks installed on XLA activation


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def parse_topology(topology):
    """'2x2' -> (2, 2), '2x2x1' -> (2, 2, 1): a TPU slice's chip layout."""
    if not isinstance(topology, str):
        raise TypeError(f"topology must be a str like '2x2' or '2x2x1', got {topology!r} ({type(topology).__name__})")
    if not _TOPOLOGY_RE.match(topology):
        raise ValueError(f"topology must look like 'AxB' or 'AxBxC' with positive ints (e.g. '2x2', '4x4x4'), got {topology!r}")
    dims = tuple(int(d) for d in topology.split("x"))
    if 0 in dims:
        raise ValueError(f"topology dimensions must be positive, got {topology!r}")
    return dims


def _default_axis_names(ndim):
    names = {1: ("data",), 2: ("data", "model")}
    if ndim not in names:
        raise ValueError(f"a {ndim}-D mesh_shape needs explicit axis_names (one per dimension); defaults exist for 1-D and 2-D")
    return names[ndim]


def _mesh_from_config(config, num_devices):
    if not isinstance(config, Mapping):
        raise TypeError(f"xla_spmd_config must be a dict, got {config!r}")
    unknown = sorted(set(config) - set(SPMD_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"xla_spmd_config has unknown keys {unknown}; valid keys are {SPMD_CONFIG_KEYS}")
    dp, mp = config.get("data_parallel_size"), config.get("model_parallel_size")
    dp = None if dp is None else _positive_int("data_parallel_size", dp)
    mp = None if mp is None else _positive_int("model_parallel_size", mp)
    if config.get("mesh_shape") is not None:
        raw = config["mesh_shape"]
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise TypeError(f"mesh_shape must be a list of positive ints, got {raw!r}")
        shape = tuple(_positive_int("mesh_shape entry", d) for d in raw)
        if not shape:
            raise ValueError("mesh_shape must have at least one dimension, got []")
    elif dp is not None or mp is not None:
        if dp is None:
            dp = num_devices // mp if num_devices % mp == 0 else 0
        mp = mp if mp is not None else (num_devices // dp if num_devices % dp == 0 else 0)
        if dp * mp != num_devices:
            raise ValueError(
                f"data_parallel_size x model_parallel_size must equal the device count: "
                f"{config.get('data_parallel_size')} x {config.get('model_parallel_size')} != {num_devices} devices; "
                "pick sizes whose product is the device count"
            )
        shape = (dp, mp)
    else:
        shape = (num_devices,)
    names = config.get("axis_names")
    names = _default_axis_names(len(shape)) if names is None else tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"axis_names must name each mesh dimension: {len(names)} names {names!r} for mesh_shape {shape!r}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"axis_names must be unique non-empty strings, got {names!r}")
    if math.prod(shape) != num_devices:
        raise ValueError(
            f"mesh_shape {shape!r} holds {math.prod(shape)} devices but the runtime has {num_devices}; "
            "the product of mesh_shape must equal the device count"
        )
    sizes = dict(zip(names, shape))
    for key, axis, size in (("data_parallel_size", "data", dp), ("model_parallel_size", "model", mp)):
        if size is not None and axis in sizes and sizes[axis] != size:
            raise ValueError(f"xla_spmd_config contradicts itself: {key}={size} but mesh axis {axis!r} has size {sizes[axis]} in mesh_shape {shape!r}")
    if dp is not None and mp is not None and dp * mp != num_devices:
        raise ValueError(f"data_parallel_size x model_parallel_size must equal the device count: {dp} x {mp} != {num_devices}")
    return shape, names


def mesh_shape_for(num_devices, num_processes=1, *, topology=None, xla_spmd_config=None):
    """(mesh_shape, axis_names) for an SPMD mesh. Pure: needs no torch_xla.

    1 process x N devices -> (N,), ("data",); P processes x L devices each -> (P, L), ("data", "model").
    An explicit xla_spmd_config wins. A topology is checked against the device count, never trusted
    for it (a v7 chip holds 2 devices).
    """
    _positive_int("num_devices", num_devices)
    _positive_int("num_processes", num_processes)
    if num_devices % num_processes:
        raise ValueError(f"num_devices must be a multiple of num_processes: {num_devices} devices over {num_processes} processes")
    if topology is not None:
        chips = math.prod(parse_topology(topology))
        if num_devices % chips:
            raise ValueError(
                f"topology {topology!r} has {chips} chips but the runtime has {num_devices} devices; "
                "the device count must be the chip count (or a multiple: 2 devices per chip on v7). "
                "Check the slice you are on or drop the topology"
            )
    if xla_spmd_config:
        return _mesh_from_config(xla_spmd_config, num_devices)
    if num_processes == 1:
        return (num_devices,), ("data",)
    return (num_processes, num_devices // num_processes), ("data", "model")


def _enable_spmd():
    """Switch SPMD on. Must run before the first XLA tensor: one made earlier segfaults on use."""
    torch_xla = _import("torch_xla")
    xr = _import("torch_xla.runtime")
    if xr.is_spmd():
        return
    # A locked SPMD config means an XLA tensor already exists; torch_xla would "replicate" it,
    # which segfaulted on PJRT CPU (REFERENCE.md). Refuse instead.
    if torch_xla._XLAC._xla_get_spmd_config_is_locked():
        raise RuntimeError(
            "an XLA tensor was created before seamless_tpu switched on SPMD, and torch_xla cannot "
            "move it safely (it can segfault). Create the SeamlessTPUTrainer, or call "
            "seamless_tpu.get_device(), before creating any tensor on torch_xla.device()."
        )
    xr.use_spmd()


def _activate_xla(kind):
    """First XLA use in this process: SPMD on, autograd ready, optimizer hooks in. Idempotent."""
    global _XLA
    if _XLA is not None:
        return _XLA
    if "PJRT_DEVICE" not in os.environ:  # torch_xla would pick (and write) one itself
        os.environ["PJRT_DEVICE"] = "TPU" if kind == "tpu" else "CPU"
        _log("seamless_tpu: set PJRT_DEVICE=%s", os.environ["PJRT_DEVICE"])
    torch_xla = _import("torch_xla")
    xr = _import("torch_xla.runtime")
    _enable_spmd()
    # The device count must be known before the first backward on XLA, or autograd has no queue
    # for the device (INTERNAL ASSERT device_ready_queues_); the query also starts the runtime.
    xr.global_runtime_device_count()
    device = torch_xla.device()
    _check_autograd_ready(device)
    # model.to(xla) would otherwise make new Parameter objects and strand an optimizer built
    # before the move: the loop would run and silently never train.
    torch.__future__.set_swap_module_params_on_conversion(True)
    _HOOKS.append(register_optimizer_step_pre_hook(_xla_step_pre_hook))
    _HOOKS.append(register_optimizer_step_post_hook(_xla_step_post_hook))
    _XLA = device
    return device


def _check_autograd_ready(device):
    # Lazy: builds IR only, compiles and runs nothing.
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        probe.sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        raise RuntimeError(
            "a backward() ran on CPU in this process before XLA was initialised, and torch's "
            "autograd engine now has no queue for XLA devices, so every XLA backward would fail. "
            "Create the SeamlessTPUTrainer (or call seamless_tpu.get_device()) before the first "
            "CPU backward, e.g. before computing an eager reference in the same process."
        ) from e


def create_xla_mesh(num_devices=None, num_processes=None, *, topology=None, xla_spmd_config=None):
    """Build the torch_xla SPMD Mesh from the runtime's counts (checked against the arguments) and
    make it this process's mesh (get_xla_mesh())."""
    xr = _import("torch_xla.runtime")
    xs = _import("torch_xla.distributed.spmd")
    np = _import("numpy")  # a torch_xla dependency, so present whenever torch_xla is
    _activate_xla(_auto_xla_kind())
    runtime_devices = xr.global_runtime_device_count()
    if num_devices is not None and num_devices != runtime_devices:
        raise ValueError(f"num_devices={num_devices!r} does not fit the runtime, which has {runtime_devices} devices; omit num_devices or match it")
    processes = num_processes if num_processes is not None else xr.process_count()
    shape, names = mesh_shape_for(runtime_devices, processes, topology=topology, xla_spmd_config=xla_spmd_config)
    mesh = xs.Mesh(np.arange(runtime_devices), shape, names)
    _set_mesh(mesh, explicit=bool(xla_spmd_config))
    _log("seamless_tpu: XLA SPMD mesh %s axes %s (batch sharded over %s)", shape, names, _SHARDING.axes)
    return mesh


def _set_mesh(mesh, explicit):
    global _MESH, _SHARDING
    _MESH, _SHARDING = mesh, _BatchSharding.for_mesh(mesh, explicit)
    _import("torch_xla.distributed.spmd").set_global_mesh(mesh)


def get_xla_mesh():
    """The SPMD mesh in use in this process, or None (not on XLA, or not set up yet)."""
    return _MESH


def _clear_mesh():
    global _MESH, _SHARDING
    _MESH = _SHARDING = None


def _partition_spec(ndim, axes):
    if ndim == 0:
        return ()
    head = axes[0] if len(axes) == 1 else tuple(axes)
    return (head,) + (None,) * (ndim - 1)


class _BatchSharding:
    """A sharding spec for whole batches: dim 0 over the batch axes, whatever each tensor's rank.

    torch_xla's ShardingSpec fits one rank only and silently leaves the others replicated (a 1-D
    label tensor beside 2-D features, under MpDeviceLoader). send_cpu_data_to_device, which
    MpDeviceLoader calls, needs only `xla_spec(tensor)` and `minibatch`, so this delegates to one
    real ShardingSpec per rank.
    """

    def __init__(self, mesh, axes, minibatch=False):
        self.mesh, self.axes, self.minibatch = mesh, axes, minibatch
        self._by_rank = {}

    @classmethod
    def for_mesh(cls, mesh, explicit=True):
        """All axes of a mesh derived from the counts; all but the model axes of one the user chose."""
        names = tuple(mesh.axis_names or range(len(mesh.mesh_shape)))
        batch = tuple(n for n in names if n not in MODEL_AXES) if explicit else names
        # Multi-host SPMD: each host feeds only its slice of the global batch.
        return cls(mesh, batch or names, minibatch=_import("torch_xla.runtime").process_count() > 1)

    def spec_for(self, ndim):
        return _partition_spec(ndim, self.axes)

    def xla_spec(self, tensor):
        spec = self._by_rank.get(tensor.dim())
        if spec is None:
            xs = _import("torch_xla.distributed.spmd")
            spec = self._by_rank[tensor.dim()] = xs.ShardingSpec(self.mesh, self.spec_for(tensor.dim()), minibatch=self.minibatch)
        return spec.xla_spec(tensor)


def _batch_sharding(mesh=None):
    if mesh is None or mesh is _MESH:
        return _SHARDING
    return _BatchSharding.for_mesh(mesh)


def _to_xla(tensor, device, sharding):
    if sharding is None or tensor.dim() == 0:
        return tensor.to(device)
    if tensor.device.type == "cpu":
        # Sharded straight from host memory: no replicated copy to reshard later.
        return _import("torch_xla.core.xla_model").send_cpu_data_to_device(tensor, device, sharding)[0]
    tensor = tensor.to(device)
    _import("torch_xla.distributed.spmd").mark_sharding(tensor, sharding.mesh, sharding.spec_for(tensor.dim()))
    return tensor


# --- the training-loop helper --------------------------------------------------------------------


class _Watchdog:
    """Counts XLA compilations inside optimizer steps; warns once per process if, after each
    optimizer's warm-up, a step still compiles. Evaluation graphs between steps are not counted."""

    def __init__(self):
        self.steps = weakref.WeakKeyDictionary()  # optimizer -> steps taken on XLA
        self.warned = False
        self._before = 0

    def before_step(self, met):
        self._before = met.counter_value("UncachedCompile") or 0

    def after_step(self, optimizer, met):
        step = self.steps[optimizer] = self.steps.get(optimizer, 0) + 1
        compiled = (met.counter_value("UncachedCompile") or 0) - self._before
        if compiled and step > WARMUP_STEPS and not self.warned:
            self.warned = True
            logger.warning(
                "seamless_tpu: step %d compiled %d new XLA graph(s) after warm-up. Each recompile "
                "stalls training. Likely causes: input shapes that change between steps (a smaller "
                "last batch: use trainer.prepare_data_loader, which drops it), Python control flow "
                "on tensor values, or .item()/print(tensor) inside the step. PT_XLA_DEBUG=1 names the cause.",
                step, compiled,
            )


_WATCHDOG = _Watchdog()


def _is_xla(device):
    return _XLA is not None and device.type == _XLA.type


def _on_xla(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            return _is_xla(p.device)
    return False


def _xla_step_pre_hook(optimizer, args, kwargs):
    if _on_xla(optimizer):
        _WATCHDOG.before_step(_import("torch_xla.debug.metrics"))


def _xla_step_post_hook(optimizer, args, kwargs):
    if _on_xla(optimizer):
        # Sync point: compiles (first time) and runs forward+backward+step as one graph.
        _import("torch_xla").sync()
        _WATCHDOG.after_step(optimizer, _import("torch_xla.debug.metrics"))


def _move_optimizer_state(optimizer, device):
    for state in optimizer.state.values():
        for k, v in state.items():
            # Adam keeps a CPU scalar 'step' on purpose unless capturable/fused; leave 0-d tensors be.
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state[k] = v.to(device)


def _average_gradients(params):
    """All-reduce and average grads in one flat buffer: every rank ends with identical grads."""
    dist = torch.distributed
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


class SeamlessTPUTrainer:
    """Puts `model` on the best device and makes the user's plain loop correct there.

    - XLA: SPMD on, model replicated over the mesh, every optimizer.step() ends in torch_xla.sync()
      (gradient all-reduce is inserted by the compiler), recompilation watchdog.
    - GPU/CPU with torch.distributed initialised (Ray, torchrun): DDP, DistributedSampler.
    """

    def __init__(self, model, optimizer=None, *, device=None, mesh=None, xla_spmd_config=None, precision=None, drop_last=None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if mesh is not None and xla_spmd_config is not None:
            raise ValueError("pass either mesh= (a built Mesh) or xla_spmd_config= (to build one), not both")
        self.device = get_device(device)
        self.kind = _resolve_kind(self.device)
        self.precision = precision
        self.drop_last = drop_last
        self.mesh = None
        if _is_xla(self.device):
            if mesh is not None:
                _set_mesh(mesh, explicit=True)
            elif xla_spmd_config is not None:
                create_xla_mesh(xla_spmd_config=xla_spmd_config)
            self.mesh = get_xla_mesh()
        elif mesh is not None or xla_spmd_config is not None:
            raise ValueError(f"mesh/xla_spmd_config apply to XLA devices only, but the device is {self.device}")
        model.to(self.device)
        if optimizer is not None:
            _move_optimizer_state(optimizer, self.device)
        self.model = model
        self._ddp_forward_seen = False
        self._hook = None
        if not _is_xla(self.device) and _torch_dist_ranks()[0] > 1:
            self._wrap_ddp(model)

    def _wrap_ddp(self, model):
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model.register_forward_pre_hook(self._saw_ddp_forward)
        self._param_ids = {id(p) for p in model.parameters()}
        # The seed loops call the original module, which bypasses DDP's reducer; average the
        # gradients at the step instead so the ranks stay in lockstep either way.
        trainer = weakref.ref(self)

        def pre_step(optimizer, args, kwargs):
            t = trainer()
            if t is not None:
                t._sync_unreduced_grads(optimizer)

        self._hook = register_optimizer_step_pre_hook(pre_step)
        weakref.finalize(self, self._hook.remove)

    def _saw_ddp_forward(self, module, args):
        # DDP's reducer only runs for forwards that will be backpropagated (not eval, not no_sync).
        if torch.is_grad_enabled() and module.require_backward_grad_sync:
            self._ddp_forward_seen = True

    def _sync_unreduced_grads(self, optimizer):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if not params or id(params[0]) not in self._param_ids:
            return
        if not self._ddp_forward_seen:
            _average_gradients(params)
        self._ddp_forward_seen = False

    def to_device(self, *objs):
        """Like to_device(); on XLA every tensor's dim 0 is sharded over this trainer's mesh."""
        sharding = _batch_sharding(self.mesh) if _is_xla(self.device) else None
        return _move(objs, self.device, sharding)

    def prepare_data_loader(self, loader, drop_last=None):
        """Wrap `loader` so batches arrive on the device (sharded on XLA) and, with several
        workers, each rank reads a disjoint part of the dataset.

        On XLA the last incomplete batch is dropped by default: its new shape would compile a
        second graph (seconds to minutes on TPU). Pass drop_last=False (here or to the trainer)
        to keep it.
        """
        drop_last = self.drop_last if drop_last is None else drop_last
        drop_last = _is_xla(self.device) if drop_last is None else drop_last
        loader = _rebuild_loader(loader, drop_last, self.device)
        return _DeviceLoader(loader, self)

    def autocast(self):
        """Context for the forward pass: bf16 autocast when precision='bf16', else a no-op."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        device_type = "xla" if self.kind in XLA_KINDS else ("cuda" if self.kind == "gpu" else "cpu")
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def save(self, obj, path):
        """Sync, copy to CPU, write from process 0 only. The file loads on any device."""
        if _is_xla(self.device):
            _import("torch_xla").sync()
        cpu = _apply(_state_dicts(obj), lambda t: t.detach().to("cpu"))
        if _is_main_process():
            torch.save(cpu, path)
        if _torch_dist_ranks()[0] > 1:
            torch.distributed.barrier()  # nobody reads the file before it is complete
        return path

    def compile_stats(self):
        """XLA compiles, cached compiles, executions and device->host transfers (all 0 off XLA)."""
        if not _is_xla(self.device):
            return {"compiles": 0, "cached_compiles": 0, "executions": 0, "device_to_host_transfers": 0}
        met = _import("torch_xla.debug.metrics")
        transfers = met.metric_data("TransferFromDeviceTime")
        return {
            "compiles": met.counter_value("UncachedCompile") or 0,
            "cached_compiles": met.counter_value("CachedCompile") or 0,
            "executions": met.counter_value("ExecuteReplicated") or 0,
            "device_to_host_transfers": transfers[0] if transfers else 0,
        }


def _state_dicts(obj):
    """Modules and optimizers (also as values of a dict) become their state_dicts."""
    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        obj = obj.module
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return {k: _state_dicts(v) for k, v in obj.items()}
    return obj


def _rebuild_loader(loader, drop_last, device):
    data = torch.utils.data
    if not isinstance(loader, data.DataLoader):
        return loader
    if _is_xla(device):  # SPMD: one process per host, each loading its own slice
        xr = _import("torch_xla.runtime")
        replicas, rank = xr.process_count(), xr.process_index()
    else:
        replicas, rank = _torch_dist_ranks()
    if loader.batch_size is None:  # a custom batch_sampler: not ours to rebuild
        if replicas > 1:
            logger.warning("seamless_tpu: loader has a custom batch_sampler; it is used as is, without a DistributedSampler")
        return loader
    sampler = loader.sampler
    if replicas > 1:
        shuffle = isinstance(sampler, data.RandomSampler)
        sampler = data.DistributedSampler(loader.dataset, num_replicas=replicas, rank=rank, shuffle=shuffle)
    if replicas == 1 and drop_last == loader.drop_last:
        return loader
    per_epoch = len(sampler) if hasattr(sampler, "__len__") else None
    if drop_last and per_epoch is not None and per_epoch % loader.batch_size:
        _log("seamless_tpu: dropping the last %d of %d samples per epoch to keep batch shapes fixed "
             "(prepare_data_loader(loader, drop_last=False) keeps them)", per_epoch % loader.batch_size, per_epoch)
    kwargs = dict(
        batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers:
        kwargs.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    return data.DataLoader(loader.dataset, **kwargs)


class _DeviceLoader:
    """Iterates a loader with batches already on the trainer's device; advances sampler epochs
    (call set_epoch(n) when resuming at epoch n, so shuffles match an uninterrupted run)."""

    def __init__(self, loader, trainer):
        self.loader, self._trainer, self._epoch = loader, trainer, 0

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch):
        self._epoch = epoch

    def __iter__(self):
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch)
        self._epoch += 1
        trainer = self._trainer
        if _is_xla(trainer.device):
            pl = _import("torch_xla.distributed.parallel_loader")
            # Background host->device transfer, sharded on the way in.
            return iter(pl.MpDeviceLoader(self.loader, trainer.device, input_sharding=_batch_sharding(trainer.mesh)))
        return (trainer.to_device(batch) for batch in self.loader)


# --- the Ray hook --------------------------------------------------------------------------------


def _xla_worker_env(*, rank, world_size, local_rank, local_world_size, node_rank, master_addr, master_port, hostnames):
    """The env one Ray worker of the xla_tpu backend needs (one SPMD process per TPU host)."""
    return {
        "PJRT_DEVICE": "TPU",
        "MASTER_ADDR": str(master_addr),
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
        "TPU_WORKER_ID": str(rank),
        "TPU_WORKER_HOSTNAMES": ",".join(hostnames),
    }


def _setdefault_env(env):
    """Set what the user has not set; return what was set. User values always win."""
    applied = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def _check_tpu_scaling(num_workers, tpu_per_worker, topology):
    """Before any worker starts: the slice must hold exactly num_workers x TPU-per-worker chips."""
    if topology is None:
        return
    chips = math.prod(parse_topology(topology))
    requested = num_workers * tpu_per_worker
    if requested != chips:
        raise ValueError(
            f"ScalingConfig asks for num_workers={num_workers} x TPU per worker={tpu_per_worker} = "
            f"{requested:g} chips, but topology {topology!r} has {chips} chips. The xla_tpu backend runs "
            "one SPMD process per TPU host holding all of its chips: set num_workers to the number of "
            f"hosts and resources_per_worker={{'TPU': chips per host}} so they multiply to {chips}."
        )


def _train_context():
    return _import("ray.train").get_context()  # a new object per call: keep no state on it


def _node_ip():
    return _import("ray").util.get_node_ip_address()


def _rank0_address():
    with socket.socket() as s:
        s.bind(("", 0))  # a free port of our own: Ray's helper for this is private
        port = s.getsockname()[1]
    return _node_ip(), port


def _worker_rank_and_ip():
    return _train_context().get_world_rank(), _node_ip()


def _xla_worker_setup(master_addr, master_port, hostnames, xla_spmd_config):
    """Runs in each Ray worker: env (only where unset), SPMD, mesh. Safe to run again."""
    ctx = _train_context()
    env = _xla_worker_env(
        rank=ctx.get_world_rank(), world_size=ctx.get_world_size(), local_rank=ctx.get_local_rank(),
        local_world_size=ctx.get_local_world_size(), node_rank=ctx.get_node_rank(),
        master_addr=master_addr, master_port=master_port, hostnames=hostnames,
    )
    applied = _setdefault_env(env)
    _auto_kind.cache_clear()  # PJRT_DEVICE may be new: detection must see it
    logger.info("seamless_tpu: worker %s set %s", env["RANK"], applied)
    if os.environ.get("TPU_VISIBLE_CHIPS") and os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        logger.warning("seamless_tpu: TPU_VISIBLE_CHIPS=%s limits this SPMD worker to part of its host; "
                       "give each Ray worker all chips of its host", os.environ["TPU_VISIBLE_CHIPS"])
    _activate_xla(_auto_xla_kind())
    mesh = create_xla_mesh(xla_spmd_config=xla_spmd_config)
    return {"rank": ctx.get_world_rank(), "set": applied, "mesh_shape": tuple(mesh.mesh_shape)}


def _xla_worker_shutdown():
    _clear_mesh()


def _build_ray_classes():
    """Subclass Ray's TorchConfig/TorchTrainer on first use, so importing this module never imports ray."""
    ray_torch = _import("ray.train.torch")
    ray = _import("ray")
    Backend = _import("ray.train.backend").Backend

    class _XlaSpmdBackend(Backend):
        """Ray Train backend: one torch_xla SPMD process per TPU host. No torch.distributed
        process group: under SPMD the XLA compiler inserts the collectives."""

        def on_start(self, worker_group, backend_config):
            master_addr, master_port = worker_group.execute_single(0, _rank0_address)
            hostnames = [ip for _, ip in sorted(worker_group.execute(_worker_rank_and_ip))]
            reports = worker_group.execute(
                _xla_worker_setup, master_addr, master_port, hostnames, backend_config.xla_spmd_config
            )
            logger.info("seamless_tpu: xla_tpu backend started: %s", reports)

        def on_shutdown(self, worker_group, backend_config):
            try:
                worker_group.execute(_xla_worker_shutdown)
            except ray.exceptions.RayError as e:  # workers that already died hold no mesh
                logger.debug("seamless_tpu: shutdown skipped on dead workers: %s", e)

    @dataclasses.dataclass
    class TorchConfig(ray_torch.TorchConfig):
        """Ray's TorchConfig plus backend='xla_tpu' (alias 'xla') and xla_spmd_config."""

        xla_spmd_config: dict = None

        def __post_init__(self):
            getattr(super(), "__post_init__", lambda: None)()
            if self.xla_spmd_config is not None:
                if self.backend not in XLA_BACKENDS:
                    raise ValueError(f"xla_spmd_config needs backend='xla_tpu', got backend={self.backend!r}")
                _mesh_from_config(self.xla_spmd_config, _spmd_config_devices(self.xla_spmd_config))

        @property
        def backend_cls(self):
            return _XlaSpmdBackend if self.backend in XLA_BACKENDS else super().backend_cls

        @property
        def train_func_context(self):
            # Ray's context calls its torch_tpu device manager where TPUs exist; XLA needs nothing.
            return contextlib.nullcontext if self.backend in XLA_BACKENDS else super().train_func_context

    class TorchTrainer(ray_torch.TorchTrainer):
        """Ray's TorchTrainer; with ScalingConfig(use_tpu=True) and no torch_config it runs the
        torch_xla SPMD backend instead of Ray's torch_tpu one."""

        def __init__(self, train_loop_per_worker, *, torch_config=None, scaling_config=None, **kwargs):
            if torch_config is None and scaling_config is not None and getattr(scaling_config, "use_tpu", False):
                torch_config = TorchConfig(backend="xla_tpu")
            if torch_config is not None and torch_config.backend in XLA_BACKENDS and scaling_config is not None:
                _check_tpu_scaling(scaling_config.num_workers, scaling_config.num_tpus_per_worker, scaling_config.topology)
            super().__init__(train_loop_per_worker, torch_config=torch_config, scaling_config=scaling_config, **kwargs)

    # Picklable by reference (Ray ships configs to its controller): name them as module globals.
    for cls in (_XlaSpmdBackend, TorchConfig, TorchTrainer):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
        globals()[cls.__name__] = cls


def _spmd_config_devices(config):
    """A device count that an xla_spmd_config can be checked against before any device exists."""
    shape = config.get("mesh_shape")
    if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape):
        return math.prod(shape)  # anything else: _mesh_from_config names what is wrong with it
    dp, mp = config.get("data_parallel_size") or 1, config.get("model_parallel_size") or 1
    return dp * mp


def __getattr__(name):
    if name in ("TorchConfig", "TorchTrainer", "_XlaSpmdBackend"):
        _build_ray_classes()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reset_caches():
    """For tests: forget probes, the XLA activation, the mesh and the installed hooks."""
    global _XLA, _WATCHDOG
    for probe in _CACHED_PROBES:
        probe.cache_clear()
    while _HOOKS:
        _HOOKS.pop().remove()
    _XLA = None
    _WATCHDOG = _Watchdog()
    _clear_mesh()
