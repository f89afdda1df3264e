"""seamless_tpu: one plain PyTorch training loop on TPU (XLA SPMD), GPU or CPU, and under Ray Train.

    trainer = SeamlessTPUTrainer(model)          # TPU, then GPU, then CPU; the optimizer may predate it
    x, y = trainer.to_device(x, y)               # on XLA: the batch dim split over the mesh's batch axes
    loss_fn(model(x), y).backward(); optimizer.step()   # on XLA: the forward+backward a graph, the step another
Backends "tpu" (PJRT_DEVICE=TPU), "xla" (other PJRT devices), "gpu", "cpu"; torch_xla and ray load when used. README.md
is the manual; `python -m seamless_tpu` reports the environment. Env read: SEAMLESS_TPU_DEVICE, _SIGTERM_GRACE,
_COMPILE_CACHE, _UNTESTED, _PORT; PJRT_DEVICE (the user's), TPU_ACCELERATOR_TYPE, RANK, LOCAL_RANK, TPU_VISIBLE_CHIPS,
MASTER_ADDR. Written where unset, and logged: PJRT_DEVICE; on TPU XLA_PERSISTENT_CACHE_*; on Ray "xla_tpu" workers
MASTER_*, RANK, *WORLD_SIZE, *_RANK, TPU_WORKER_*. Process-wide changes, none at import, each undone by _reset_caches
(docs/design.md says why none is narrower):
- first XLA use: SPMD on (one-way); xs.set_global_mesh; torch.xla; for XLA inputs _LOWERINGS' kernels (products,
  attention, norms, pointwise, masks, losses, reductions, pooling, windows, resampling, views), torch.utils.checkpoint's
  CheckpointFunction and frame, F.multi_head_attention_forward, F.embedding_bag, F.gaussian_nll_loss; without jax
  torch_xla's scan backward, GRU; Module.to to XLA keeps Parameters, loops a moved module's stacks;
  torch.inference_mode() is no_grad. The first fsdp weight: autocast's products, one gate ordering every model's.
- first XLA use or trainer: one pre- and one post-step optimizer hook (in an XLA step torch_xla's special scalars off;
  in a first or pinned step a function mode, the lr tagged). Each trainer: forward and post-accumulate-grad hooks on
  its model, first-step FLOP modes; log(): a thread, step closures. A looped stack: its container's class; in its
  body's trace its blocks' differing attributes unreadable, gradient_checkpointing off; while its While is built
  torch_xla's _xla_user_computation recorded. A model to XLA: transformers' grouped_mm experts, dense there.
- first trainer (main thread) or Ray backend start: a SIGTERM handler chaining the user's, an exit held for
  trainer.preempted's save (a daemon thread); processes: a gloo group (over process 0's TCPStore without
  torch.distributed), an atexit. save_checkpoint(blocking=False): a thread a save, an atexit report, a gloo group,
  a CUDA stream and pinned copy. Ray: xla_tpu workers' gloo group; fit(use_tpu) may ray.init()."""
__all__ = [
    "get_device", "device_type", "is_xla_backend", "to_device", "SeamlessTPUTrainer", "parse_topology",
    "mesh_shape_for", "create_xla_mesh", "get_xla_mesh", "consolidate_checkpoint", "TorchConfig", "TorchTrainer",
    "environment_report",
]

import argparse
import ast
import atexit
import collections
import contextlib
import concurrent.futures
import copy
import ctypes
import dataclasses
import datetime
import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import itertools
import logging
import math
import operator
import os
import random
import re
import shutil
import signal
import socket
import string
import sys
import tempfile
import textwrap
import threading
import time
import types
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_in_torch_dispatch_mode

logger = logging.getLogger(__name__)

# --- 1. constants ---------------------------------------------------------------------------------
_TESTED_WITH = {"torch": "2.9.0", "torch_xla": "2.9.0", "ray": "2.60.0", "transformers": "5.23.0", "peft": "0.21.2"}
# Private APIs used where those versions have no public one, each with when it can go:
# - torch_xla._XLAC: _get_xla_sharding_spec, _get_xla_op_sharding, _xla_mark_sharding, _get_local_shards,
#   _global_tensor_from_cpu_shards, _xla_get_runtime_devices, _get_xla_tensor_debug_info,
#   _xla_get_spmd_config_is_locked. TODO(remove when torch_xla exposes specs, shards and the SPMD lock)
# - _XLAC._xla_dot_general, torch._C._are_functorch_transforms_active. TODO(remove when XLA einsum is twice diff.)
# - _XLAC._get_xla_tensors_hlo_proto, _xla_user_computation, HloInstructionProto's fields. TODO(remove when
#   _xla_dot_general takes a precision)
# - _XLAC._xla_sync_multi, _get/_set_xla_handle_special_scalars, _xla_tensors_from_aten; torch._functionalize_sync,
#   _has_data_mutation, torch._C._len_torch_function_stack, _get_function_stack_at (the first step, a step's graph).
#   TODO(remove when optimizers have an init and torch_xla's graphs ignore scalar values)
# - torch._C._functions.DelayedError: scan's backward is not differentiable (ctc_loss). TODO(remove when it is)
# - torch._C.DispatchKeySet: the key set a kernel that replaced torch_xla's calls its kernel with (get_kernel).
#   TODO(remove when torch_xla lowers addmm for any beta, scatter_reduce's mean and avg_pool's backward)
# - torch_xla.experimental.distributed_checkpoint._helpers: _cpu_shards_from_tensors, _CpuShards.
#   TODO(remove when torch_xla's SPMDSavePlanner saves partially replicated tensors)
# - torch_xla.experimental.scan._backward_shard_alike, replaced where jax is missing (torch_xla[pallas] brings it).
#   TODO(remove when torch_xla's scan backward runs under SPMD without jax)
# - functorch.compile's partitioners, given a rewritten joint graph; node.meta["memory_budget"] (their min-cut's budget
#   per graph). TODO(remove when torch_xla's scan saves stacked parameters by reference and takes a remat policy)
# - torch._register_device_module("xla"), torch.utils.checkpoint._CheckpointFrame.
#   TODO(remove when torch_xla registers torch.xla and supports use_reentrant=False)
# - torch.distributed.checkpoint: FileSystemReader.storage_data and _slice_file, _traverse.set_element, and
#   torch.distributed._shard._utils.narrow_tensor_by_index. TODO(remove when DCP's reader reads a chunk once)
# - torch.utils._python_dispatch: TorchDispatchMode, is_in_torch_dispatch_mode (the FLOP count; torch's public
#   FlopCounterMode decomposes ops it has no formula for). TODO(remove when torch makes them public)
# - ray.train.torch.config._TorchBackend; ray._private.worker, the module of Ray's SIGTERM handler.
#   TODO(remove when Ray Train has a public backend hook and a preemption callback)
# - transformers.integrations.moe.ExpertsInterface._global_mapping, its grouped_mm entry (MoE experts, dense on XLA).
#   TODO(remove when transformers' experts keep a batch's split under GSPMD)
UNTESTED_ENV = "SEAMLESS_TPU_UNTESTED"  # "1": on other torch/torch_xla versions, run what rests on their private APIs
ENV_DEVICE = "SEAMLESS_TPU_DEVICE"
COMPILE_CACHE_ENV = "SEAMLESS_TPU_COMPILE_CACHE"  # off, or the root of the per-host TPU compile caches
DEVICE_KINDS = ("auto", "tpu", "xla", "gpu", "cpu")
XLA_DEVICE_KINDS = ("tpu", "xla")  # device kinds that run on torch_xla
RAY_XLA_BACKENDS = ("xla_tpu", "xla")  # TorchConfig(backend=...) names that pick the torch_xla backend
PRECISIONS = (None, "fp32", "bf16")
STRATEGIES = ("ddp", "fsdp")  # replicate the parameters, or shard them over FSDP_AXIS
SPMD_CONFIG_KEYS = ("mesh_shape", "axis_names", "data_parallel_size", "model_parallel_size")
FSDP_AXIS = "fsdp"
MODEL_AXIS = "model"  # the axis a tensor-parallel plan splits weights over; batches split over every other axis
# Tensor-parallel styles (Hugging Face's plan strings, torch's ParallelStyle class names) -> the features of a Linear
# split over MODEL_AXIS ("out": colwise, "in": rowwise; an Embedding's dim, its vocabulary), or None: kept whole.
TP_STYLES = {**dict.fromkeys(("colwise", "colwise_rep", "colwise_gather_output", "local_colwise", "packed_colwise",
                              "ColwiseParallel"), "out"),
             **dict.fromkeys(("rowwise", "rowwise_rep", "rowwise_split_input", "local_rowwise", "packed_rowwise",
                              "local_packed_rowwise", "embedding_rowwise", "RowwiseParallel"), "in"),
             **dict.fromkeys(("replicated_with_grad_allreduce", "replicate", "gather", "local", "sequence_parallel",
                              "isolate", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput"), None)}
CHECKPOINT_POINTER = "LATEST"  # names the committed save attempt; a save that never wrote it never happened
CHECKPOINT_HISTORY = "HISTORY"  # the committed attempts kept (save_checkpoint(..., keep_last=K)), oldest first
SAVE_ATTEMPT = re.compile(r"save-[0-9]+-[0-9]+")  # save-<pid>-<ns>: one save_checkpoint call's directory
ATTEMPT_MARKER = ".seamless_tpu_attempt"  # in every attempt a save creates: the only folders a later save removes
PLAIN_VALUES = "values.pt"  # the plain values (epoch, step, ...) of a checkpoint, pickled
OBJECT_STATES = "objects.pt"  # state_dicts of the other stateful objects (schedulers, scalers, ...) and RNG states
RELEASE_EVERY = 4 << 20  # bytes a checkpoint load handles between handing freed host memory back to the OS
WARMUP_STEPS = 2  # runs of a graph (cut to cut) that may compile: the first, the one with state a step made
INPUT_CHECKS = 3  # forwards whose inputs the replicated-batch guard reads, then it removes itself
SIGTERM_GRACE_S = 15.0  # SIGTERM's exit waits this long for a save (a spot VM's or pod's SIGKILL comes at 30 s)
AGREE_EVERY_S, AGREE_MAX_STEPS = 0.25, 16  # processes agree on SIGTERM this often, and every 16 steps at least (the
# interval at most doubles): an all-reduce a step cost 2 gloo ranks +43% of a 2.5 ms step; every 16, A/A noise (bench)
SETTLE_S = 60  # at exit, how long the agreement in flight may wait for a peer (they start it at one step)
AGREEMENT_PORT = 8548  # process 0's gloo store for SIGTERM agreement with no process group (XLA coordinator's: 8547)
LATE_COMPILES_TO_WARN = 2  # by one pair of cuts in a row: one is a one-off (a short last batch), two mean shapes change
_INSTALL = {"ray": "pip install 'ray[train]'", "torch_xla": "pip install 'torch_xla[tpu]==2.9.0' (XLA on CPU/GPU: "
            "pip install torch==2.9.0 torch_xla==2.9.0)"}
MAX_TOPOLOGY_CHIPS = 65536  # the largest TPU slices hold under 10k chips; more is a typo
_TOPOLOGY_RE = re.compile(r"[0-9]{1,5}(x[0-9]{1,5}){1,2}")  # fullmatch ('$' passes "\n"); {1,5}: int()'s 4300-digit cap

# --- 2. process state -----------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _ProcessState:
    """All the module remembers between calls; _STATE, the one instance, is made once every room's class exists."""

    xla_device: torch.device = None  # the activated XLA device; None until first XLA use
    xla_kind: str = None  # "tpu" or "xla": what it was activated as
    mesh: object = None  # the process's SPMD mesh: get_xla_mesh()
    batch_sharding: object = None  # how to_device() splits batches over `mesh`
    user_pjrt_values: set = dataclasses.field(default_factory=set)  # PJRT_DEVICE seen before torch_xla loaded
    env_we_set: dict = dataclasses.field(default_factory=dict)  # written on the user's behalf, never over theirs
    group_we_started: bool = False  # the Ray xla_tpu hook started the process group, so it may end it
    optimizer_hooks: dict = dataclasses.field(default_factory=dict)  # "pre", "post" -> handle of the step hook (8)
    torch_patches: list = dataclasses.field(default_factory=list)  # undo functions of the header's changes
    xla_kernels: dict = dataclasses.field(default_factory=dict)  # op -> torch_xla's kernel ours replaced, callable (7b)
    steps: object = dataclasses.field(default_factory=weakref.WeakKeyDictionary)  # optimizer -> _StepRecord (8)
    rebinding: bool = False  # FSDP2 or tensor parallelism replaced parameters: optimizers follow before a step (9b)
    warned: set = dataclasses.field(default_factory=set)  # one-time messages already given
    activation_lock: object = dataclasses.field(default_factory=threading.RLock)  # first use may come from threads
    cuts: object = dataclasses.field(default_factory=lambda: _GraphCuts())  # 8. graph cuts and the watchdog
    work_check: object = dataclasses.field(default_factory=lambda: _WorkCheck())  # 14b. the first forward's work
    loops: object = dataclasses.field(default_factory=lambda: _Loops())  # 9c-9d. repeated blocks as one loop
    meta_init: object = dataclasses.field(default_factory=lambda: _MetaInit())  # 10. models built on meta
    preemption: object = dataclasses.field(default_factory=lambda: _Preemption())  # 12. SIGTERM -> trainer.preempted
    meter: object = dataclasses.field(default_factory=lambda: _Meter())  # 14. what the steps cost
    run_log: object = dataclasses.field(default_factory=lambda: _RunLog())  # 14. trainer.log()'s values in flight
    profile: object = None  # 14. the trace trainer.profile() is writing
    saves: object = dataclasses.field(default_factory=lambda: _Saves())  # 15a. saves in flight


def _once(key):
    """True the first time `key` is asked for in this process: one-time warnings."""
    first = key not in _STATE.warned
    _STATE.warned.add(key)
    return first


def _log(msg, *args, main=None):
    """Rank 0 (or `main`) logs at info, the other ranks at debug, so N workers do not print N copies."""
    level = logging.INFO if (_is_main_process() if main is None else main) else logging.DEBUG
    logger.log(level, msg, *args)


def _owned(module, hook):
    """`hook` for `module` alone: a deep copy (an EMA, the layer scan_layers runs) copies the hook dicts, and there
    it does nothing (it raised KeyError at their first forward). functional_call runs the module itself."""
    owner = weakref.ref(module)

    @functools.wraps(hook)  # keeps its name for whoever lists a module's hooks
    def owned(mod, *args):
        return hook(mod, *args) if mod is owner() else None
    owned.seamless_tpu = True  # ours: no reason to run a stack of blocks one by one (9c)
    return owned


def _patch(owner, name, value):
    """owner.name = value for this process, remembering how to undo it (_reset_caches)."""
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    _STATE.torch_patches.append(lambda: setattr(owner, name, old))


def _reset_caches():
    """For tests: let a save in flight end, undo every process-wide change (patches newest first), start afresh."""
    global _STATE
    if _STATE.saves.in_flight is not None:
        concurrent.futures.wait([_STATE.saves.in_flight])
    _STATE.run_log.close()
    if _STATE.profile is not None:
        _STATE.profile.stop()
    if _STATE.meter.counting is not None and _STATE.meter.counting.thread == threading.get_ident():
        _STATE.meter.counting.stop()  # a first step that never ended: its modes leave torch's stacks
    hooks, patches = _STATE.optimizer_hooks.values(), reversed(_STATE.torch_patches)
    for undo in [*(probe.cache_clear for probe in _CACHED_PROBES), *(hook.remove for hook in hooks), *patches,
                 _step_scalars_off]:
        undo()
    _STATE = _ProcessState()

# --- 3. lazy imports and probes -------------------------------------------------------------------


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
def _tpu_chips():
    """Evidence of TPU chips on this host, as (what, count); (None, 0) if there is none."""
    count = 0
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(path) as f:
                count += f.read().strip() == "0x1ae0"  # Google's PCI vendor id: TPU chips on TPU VMs
        except OSError:  # devices can vanish between glob and open; they are not ours to count
            continue
    if count:
        return "Google PCI devices", count
    # Containers may hide /sys but pass the chips through: v2-v4 as /dev/accel*, later as VFIO groups.
    for pattern in ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*"):
        nodes = glob.glob(pattern)
        if nodes:
            return pattern, len(nodes)
    return None, 0


@functools.lru_cache(maxsize=None)
def _peak_flops(kind):
    """Dense bf16 FLOP/s of one device of a `kind` run (PEAK_FLOPS), or None: CPU, XLA:CPU, an unknown chip."""
    if kind == "tpu":
        name = os.environ.get("TPU_ACCELERATOR_TYPE") or _import("torch_xla.core.xla_model").xla_device_kind()
    else:
        name = torch.cuda.get_device_name() if kind == "gpu" else ""
    return next((peak for pattern, peak in PEAK_FLOPS if re.search(pattern, name.lower())), None) if name else None


@functools.lru_cache(maxsize=None)
def _untested():
    """The installed torch and torch_xla that are not the versions _TESTED_WITH names, as "name version"."""
    found = []
    for name in ("torch", "torch_xla"):
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # torch_xla absent: nothing of it runs
            continue
        if version.partition("+")[0] != _TESTED_WITH[name]:
            found.append(f"{name} {version}")
    return tuple(found)


def _private_apis():
    """Whether the mechanisms that rest on torch's and torch_xla's private APIs (repeated blocks as one loop, the
    optimizer step's scalars) run: on the tested versions, or where the user opts in (UNTESTED_ENV=1). A patch
    release can move what they call unchecked; otherwise the trainer runs without them and says so once."""
    untested, on = _untested(), os.environ.get(UNTESTED_ENV) == "1"
    if untested and _once("untested"):
        warnings.warn(f"seamless_tpu was tested with torch {_TESTED_WITH['torch']} and torch_xla "
                      f"{_TESTED_WITH['torch_xla']}, found {' and '.join(untested)}: "
                      + (f"running what rests on their private APIs anyway ({UNTESTED_ENV}=1)" if on else
                         "repeated blocks run one by one and the optimizer step's scalars are torch_xla's, as both "
                         f"rest on private APIs of the tested versions; {UNTESTED_ENV}=1 runs them anyway"),
                      stacklevel=3)
    return not untested or on


def _tpu_chip_count():
    return _tpu_chips()[1]


@functools.lru_cache(maxsize=None)
def _initial_environ():
    """The environment this process started with (Linux), which no library import can have edited."""
    try:
        with open("/proc/self/environ", "rb") as f:
            pairs = [item.partition(b"=") for item in f.read().split(b"\0") if item]
    except OSError:  # not Linux: fall back to what _note_user_pjrt saw before torch_xla loaded
        return {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def _note_user_pjrt():
    if "torch_xla" not in sys.modules and os.environ.get("PJRT_DEVICE"):
        _STATE.user_pjrt_values.add(os.environ["PJRT_DEVICE"])


def _user_pjrt_device():
    """PJRT_DEVICE as the user chose it, or None ('' counts as unset). Importing torch_xla (transformers does, when it
    is installed) writes torch_xla's guess, so a value counts only if it was there before torch_xla was imported."""
    _note_user_pjrt()
    value = os.environ.get("PJRT_DEVICE") or None
    if value is None or "torch_xla" not in sys.modules:
        return value
    if (value in _STATE.user_pjrt_values or _STATE.env_we_set.get("PJRT_DEVICE") == value
            or _initial_environ().get("PJRT_DEVICE") == value):
        return value
    return None


def _torch_dist_ranks():
    """(world size, rank) of torch.distributed, or (1, 0) when it is not running."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _is_main_process():
    """Rank 0 of torch.distributed, else of torch_xla's processes, else of RANK."""
    size, rank = _torch_dist_ranks()
    if size > 1:
        return rank == 0
    if _STATE.xla_device is not None:
        return _import("torch_xla.runtime").process_index() == 0
    return os.environ.get("RANK", "0") in ("0", "")


_CACHED_PROBES = (_import, _xla_installed, _tpu_chips, _initial_environ, _peak_flops, _untested)

# --- 4. device detection --------------------------------------------------------------------------


def _tpu_present():
    pjrt = _user_pjrt_device()
    return pjrt.upper() == "TPU" if pjrt else _tpu_chip_count() > 0


def _auto_xla_kind():
    if _STATE.xla_device is not None:
        return _STATE.xla_kind
    return "tpu" if _tpu_present() else "xla"


def _as_request(kind):
    """A kind name stays a name; any other string torch.device accepts ('cuda:0', 'cpu') becomes a device."""
    if not isinstance(kind, str) or kind.lower() in DEVICE_KINDS:
        return kind
    try:
        return torch.device(kind)
    except (RuntimeError, ValueError):  # torch's own 'Expected one of cpu, cuda, ...' error
        return kind  # _resolve_kind names the rule


def _resolve_kind(kind=None):
    """Turn a requested kind (or SEAMLESS_TPU_DEVICE, or auto) into one of tpu/xla/gpu/cpu, or raise."""
    where = "device" if kind is not None else ENV_DEVICE
    kind = _as_request(kind if kind is not None else (os.environ.get(ENV_DEVICE) or "auto"))
    if isinstance(kind, torch.device):
        if kind.type == "xla":
            return _auto_xla_kind()
        requested, name = ("gpu" if kind.type == "cuda" else "cpu"), str(kind)
    elif isinstance(kind, str) and kind.lower() in DEVICE_KINDS:
        requested = name = kind.lower()
    else:
        raise ValueError(f"{where} must be one of {DEVICE_KINDS} or a torch.device string like 'cuda:0', got {kind!r}")
    if requested == "auto":  # not cached: the answer must follow the user's env, and it costs a few dict lookups
        if _STATE.xla_device is not None or (_xla_installed() and (_tpu_present() or _user_pjrt_device())):
            return _auto_xla_kind()
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested in XLA_DEVICE_KINDS and not _xla_installed():
        raise ImportError(f"device {requested!r} needs torch_xla, which is not installed: {_INSTALL['torch_xla']}")
    if requested == "tpu" and not _tpu_present():
        hint = os.environ.get("TPU_ACCELERATOR_TYPE")
        fix = ("TPU_ACCELERATOR_TYPE names a TPU, but this host has no chip: run on the TPU VM itself" if hint
               else "Run on a TPU VM")
        raise RuntimeError(f"device 'tpu' was requested but no TPU chip is visible (PJRT_DEVICE={_user_pjrt_device()!r}"
                           f", TPU_ACCELERATOR_TYPE={hint!r}; no Google PCI device, /dev/accel* or /dev/vfio/* found). "
                           f"{fix}, or ask for 'xla' / 'auto'.")
    if requested == "gpu" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} was requested but torch.cuda.is_available() is False; use 'auto' or 'cpu'")
    return requested


def device_type():
    """'tpu', 'xla', 'gpu' or 'cpu': what get_device() would use. Creates nothing, writes no env."""
    return _resolve_kind(None)


def is_xla_backend():
    return device_type() in XLA_DEVICE_KINDS


def get_device(kind=None):
    """The torch.device for `kind` (auto|tpu|xla|gpu|cpu; default SEAMLESS_TPU_DEVICE, else auto); a torch.device
    passes through. On XLA this switches SPMD on (before any XLA tensor can exist) and builds the process mesh."""
    request = _as_request(kind if kind is not None else os.environ.get(ENV_DEVICE) or None)
    kind = _resolve_kind(kind)
    if isinstance(request, torch.device) and request.type != "xla":
        return request
    if kind in XLA_DEVICE_KINDS:
        device = _activate_xla(kind)
        if _STATE.mesh is None:
            create_xla_mesh()
        return device
    if kind == "gpu":
        local_rank = os.environ.get("LOCAL_RANK")
        index = int(local_rank) % torch.cuda.device_count() if local_rank else torch.cuda.current_device()
        return torch.device("cuda", index)
    return torch.device("cpu")


def _is_xla(device):
    return _STATE.xla_device is not None and device.type == _STATE.xla_device.type

# --- 5. moving data -------------------------------------------------------------------------------


def _map_tensors(obj, on_tensor, on_other=None):
    """Map `on_tensor` over every tensor in a nested batch, never changing what the batch means. Mappings are walked
    even when they have their own .to (HF BatchEncoding), so each tensor is split over the mesh. Other objects with
    their own .to go to `on_other` (when given), never rebuilt from their parts: PackedSequence, modules, user classes.
    Containers keep their types where they can be rebuilt. All else passes unchanged."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    recurse = functools.partial(_map_tensors, on_tensor=on_tensor, on_other=on_other)
    if isinstance(obj, Mapping):
        return _rebuilt_mapping(obj, {k: recurse(v) for k, v in obj.items()})
    if on_other is not None and callable(getattr(obj, "to", None)) and not isinstance(obj, type):
        moved = on_other(obj)
        return obj if moved is None else moved  # in-place movers (.to returns None) stay themselves
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        values = [recurse(v) for v in obj]
        try:
            return type(obj)(*values)
        except TypeError:  # a namedtuple subclass with its own constructor
            return tuple(values)
    if isinstance(obj, (list, tuple)):
        return _rebuild(type(obj), [recurse(v) for v in obj], list if isinstance(obj, list) else tuple)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)  # no __init__: __post_init__, InitVar and init=False fields stay as they are
        for name in _cached_values(new):
            del vars(new)[name]  # computed from the old fields; the next access computes it from the moved ones
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, recurse(getattr(obj, f.name)))  # frozen ones too
        return new
    return obj


def _cached_values(obj):
    """Names in obj's instance dict that a caching descriptor of its class wrote there: a non-data
    descriptor that is no method (functools.cached_property, and the many built like it)."""
    def caches(attr):
        return (hasattr(type(attr), "__get__") and not hasattr(type(attr), "__set__")
                and not isinstance(attr, (types.FunctionType, staticmethod, classmethod)))
    return [name for name in getattr(obj, "__dict__", ()) if caches(inspect.getattr_static(type(obj), name, None))]


def _rebuilt_mapping(obj, items):
    """`obj`'s type holding `items`, its other attributes kept (a BatchEncoding keeps its encodings)."""
    if isinstance(obj, collections.UserDict):
        new = copy.copy(obj)  # UserDict.__copy__: the instance dict, without __init__
        vars(new)["data"] = items
        return new
    if isinstance(obj, defaultdict):
        return type(obj)(obj.default_factory, items)
    return _rebuild(type(obj), items, dict)


def _rebuild(cls, items, plain):
    """cls(items), or the plain container when cls cannot be built from the moved items alone (a
    subclass whose constructor needs other arguments). MappingProxyType(dict) rebuilds itself."""
    if cls is plain:
        return plain(items)
    try:
        return cls(items)
    except TypeError:
        return plain(items)


def _mover(device, sharding=None):
    if _is_xla(device):
        return functools.partial(_to_xla, device=device, sharding=sharding)
    non_blocking = device.type == "cuda"  # async copies only help (and are only safe) host->CUDA
    return lambda t: t.to(device, non_blocking=non_blocking)


def _move(objs, device, sharding=None):
    on_tensor = _mover(device, sharding)
    moved = tuple(_map_tensors(o, on_tensor, lambda obj: _move_by_own_to(obj, device)) for o in objs)
    return moved[0] if len(moved) == 1 else moved


def _move_by_own_to(obj, device):
    if _is_xla(device) and not isinstance(obj, torch.nn.Module) and _once("own_to"):
        logger.warning("seamless_tpu: %s is moved by its own .to(), so its tensors are replicated on every "
                       "device instead of split over the mesh (each device computes the whole batch); pass its "
                       "tensors in a dict, tuple or dataclass to have them sharded", type(obj).__name__)
    return obj.to(device)


def to_device(*objs, device=None):
    """Move tensors, nested batches (dict, list, tuple, namedtuple, dataclass) and modules to `device`
    (default: get_device()'s choice). One argument returns it moved; several return a tuple. On XLA,
    every tensor's batch dimension (that of the last trainer built; else 0) is split over the process mesh's batch
    axes: each device computes its slice."""
    target = get_device(device)
    sharding = _STATE.batch_sharding if _is_xla(target) else None
    return _move(objs, target, sharding)

# --- 6. pure validation: mesh config, tensor-parallel plans ---------------------------------------


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _shown(value, limit=80):
    """repr(value), cut to `limit` characters: a message must not quote 5,000 characters back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_topology(topology):
    """'2x2' -> (2, 2), '2x2x1' -> (2, 2, 1): a TPU slice's chip layout."""
    if not isinstance(topology, str):
        raise TypeError(f"topology must be a str like '2x2' or '2x2x1', got {_shown(topology)} "
                        f"({type(topology).__name__})")
    dims = tuple(int(d) for d in topology.split("x")) if _TOPOLOGY_RE.fullmatch(topology) else ()
    if not dims or 0 in dims:
        raise ValueError(f"topology must look like 'AxB' or 'AxBxC' with positive ints of at most 5 digits "
                         f"(e.g. '2x2', '4x4x4'), got {_shown(topology)}")
    if math.prod(dims) > MAX_TOPOLOGY_CHIPS:
        raise ValueError(f"topology {topology!r} has {math.prod(dims)} chips, more than any TPU slice (at most "
                         f"{MAX_TOPOLOGY_CHIPS}); check the string")
    return dims


def _mesh_from_config(config, num_devices, strategy="ddp"):
    if not isinstance(config, Mapping):
        raise TypeError(f"xla_spmd_config must be a dict like {{'mesh_shape': [2, 2]}}, got {config!r} "
                        f"({type(config).__name__})")
    unknown = [key for key in config if key not in SPMD_CONFIG_KEYS]
    if unknown:  # a key that is no string (1, b"mesh_shape") is a TypeError
        error = ValueError if all(isinstance(key, str) for key in unknown) else TypeError
        raise error(f"xla_spmd_config has unknown keys {sorted(unknown, key=repr)}; valid keys are the strings "
                    f"{SPMD_CONFIG_KEYS}")
    dp, mp = (None if config.get(key) is None else _positive_int(key, config[key])
              for key in ("data_parallel_size", "model_parallel_size"))
    if config.get("mesh_shape") is not None:
        raw = config["mesh_shape"]
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise TypeError(f"mesh_shape must be a list of positive ints, got {raw!r}")
        shape = tuple(_positive_int("mesh_shape entry", d) for d in raw)
        if not shape:
            raise ValueError("mesh_shape must have at least one dimension, got []")
    elif dp or mp:
        shape = (dp or num_devices // mp, mp or num_devices // dp)
        if math.prod(shape) != num_devices:
            raise ValueError(f"data_parallel_size x model_parallel_size must equal the device count: {dp} x {mp} != "
                             f"{num_devices} devices; pick sizes whose product is the device count")
    else:
        shape = (num_devices,)
    names = config.get("axis_names")
    if isinstance(names, (str, bytes)) or (names is not None and not hasattr(names, "__iter__")):
        raise TypeError(f"axis_names must be a list of strings, one per mesh dimension (e.g. ['data', 'model']), got "
                        f"{names!r}")
    default = {1: ("data",), 2: (FSDP_AXIS if strategy == "fsdp" else "data", MODEL_AXIS)}.get(len(shape))
    if names is None and default is None:
        raise ValueError(f"a {len(shape)}-D mesh_shape needs explicit axis_names (one per dimension); defaults exist "
                         "for 1-D and 2-D")
    names = default if names is None else tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"axis_names must name each mesh dimension: {len(names)} names {names!r} for mesh_shape "
                         f"{shape!r}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"axis_names must be unique non-empty strings, got {names!r}")
    if math.prod(shape) != num_devices:
        raise ValueError(f"mesh_shape {shape!r} holds {math.prod(shape)} devices but the runtime has {num_devices}; "
                         "the product of mesh_shape must equal the device count")
    # The sizes describe the mesh as the trainer uses it: the axis named MODEL_AXIS holds the model, others the batch.
    model = math.prod(n for name, n in zip(names, shape) if name == MODEL_AXIS)
    for key, size, actual in (("data_parallel_size", dp, num_devices // model), ("model_parallel_size", mp, model)):
        if size is not None and size != actual:
            raise ValueError(f"xla_spmd_config contradicts itself: {key}={size}, but mesh_shape {shape!r} with "
                             f"axis_names {names!r} is {num_devices // model}-way data parallel and {model}-way model "
                             f"parallel (over the axis {MODEL_AXIS!r}); drop {key} or fix the mesh")
    return shape, names


def mesh_shape_for(num_devices, num_processes=1, *, topology=None, xla_spmd_config=None, strategy="ddp"):
    """(mesh_shape, axis_names) for an SPMD mesh, without torch_xla. "ddp": (N,), ("data",) however many processes
    hold the N devices. "fsdp": (N,), ("fsdp",), or over P processes (P, N/P), ("data", "fsdp"): data parallel across
    hosts, parameters sharded within one. An explicit xla_spmd_config wins (for "fsdp" it needs an "fsdp" axis).
    A topology is checked against the device count, never trusted for it (a v7 chip holds 2 devices)."""
    _check_strategy(strategy)
    _positive_int("num_devices", num_devices)
    _positive_int("num_processes", num_processes)
    if num_devices % num_processes:
        raise ValueError(f"num_devices must be a multiple of num_processes: {num_devices} devices over {num_processes} "
                         "processes")
    if topology is not None:
        chips = math.prod(parse_topology(topology))
        if num_devices % chips:
            raise ValueError(f"topology {topology!r} has {chips} chips but the runtime has {num_devices} devices; "
                             "it must be the chip count or a multiple (2 per chip on v7): check the slice or drop it")
    if xla_spmd_config is not None:
        shape, names = _mesh_from_config(xla_spmd_config, num_devices, strategy)
        if strategy == "fsdp":
            _check_fsdp_axis(names, "xla_spmd_config")
        return shape, names
    if strategy == "fsdp" and num_processes > 1:
        return (num_processes, num_devices // num_processes), ("data", FSDP_AXIS)
    return (num_devices,), ("data" if strategy == "ddp" else FSDP_AXIS,)


def _check_strategy(strategy):
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def _check_fsdp_axis(names, where):
    names = tuple(names or ())
    if FSDP_AXIS not in names:
        raise ValueError(f"strategy='fsdp' shards parameters over a mesh axis named {FSDP_AXIS!r}, but {where} has "
                         f"axes {names!r}; name one axis {FSDP_AXIS!r} (e.g. axis_names=['data', 'fsdp']) or use "
                         "strategy='ddp'")


def _check_trainer_args(model, mesh, xla_spmd_config, precision, strategy):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    _check_strategy(strategy)
    if strategy == "fsdp" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("strategy='fsdp' shards the parameters itself and cannot work inside DDP; pass the "
                         "plain module (model.module), or use strategy='ddp' to keep your DDP wrapper")
    if mesh is not None and xla_spmd_config is not None:
        raise ValueError("pass either mesh= (a built Mesh) or xla_spmd_config= (to build one), not both")


def _spmd_config_devices(config):
    """A device count to check an xla_spmd_config against before any device exists (any, if it is malformed)."""
    config = config if isinstance(config, Mapping) else {}
    shape = config.get("mesh_shape")
    if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape):
        return math.prod(shape)
    return (config.get("data_parallel_size") or 1) * (config.get("model_parallel_size") or 1)


def _batch_dim(model, batch_dim):
    """Which dimension of a batch tensor holds its samples: `batch_dim` when given (it wins: a model may transpose its
    input), else where the model's RNNs and attention say they take it (all batch_first=False: 1), else 0."""
    if batch_dim is not None:
        if not isinstance(batch_dim, int) or isinstance(batch_dim, bool) or batch_dim < 0:
            raise ValueError(f"batch_dim must be a dimension index >= 0 (0 for (B, T, ...) batches, 1 for (T, B, "
                             f"...)), got {_shown(batch_dim)}")
        return batch_dim
    said = {}  # batch_first -> the first module saying it
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.RNNBase, torch.nn.MultiheadAttention)):
            said.setdefault(bool(module.batch_first), name)
    if len(said) == 2:
        raise ValueError(f"the model's modules disagree on where the batch is: {said[True]!r} takes it first "
                         f"(batch_first=True), {said[False]!r} second (batch_first=False); pass batch_dim=0 for (B, "
                         "T, ...) batches or batch_dim=1 for (T, B, ...) ones to SeamlessTPUTrainer")
    return 1 if set(said) == {False} else 0


def _model_tp_plan(model):
    """The tensor-parallel plan a transformers model carries, with full module names ({} for other models): the
    instance's merged _tp_plan (transformers 5), else config.base_model_tp_plan under the base model's prefix."""
    inner = _peft_inner(model)
    if inner:  # before the attributes below, which a PeftModel forwards inward (its names lack the wrapper's path)
        return {f"{inner[0]}.{k}": v for k, v in _model_tp_plan(inner[1]).items()}
    plan = vars(model).get("_tp_plan")  # the instance's: the class attribute holds the head's entries only
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module) else ""
    return {**{prefix + k: v for k, v in base.items()}, **(getattr(type(model), "_tp_plan", None) or {})}


def _peft_inner(model):
    """(path, module) of the model a peft PeftModel wraps (its get_base_model()), else None."""
    get = getattr(type(model), "get_base_model", None)  # the class's: a PeftModel forwards unknown attributes inward
    inner = get(model) if callable(get) else None
    return next(((name, m) for name, m in model.named_modules() if name and m is inner), None)  # "": the model


def _class_path(obj):
    """The full name of obj's class: peft's LoRA layer is a `Linear` too, and is no torch.nn.Linear."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tp_specs(model, plan, axis_sizes, xla=True):
    """{parameter: partition spec} of the weights `plan` splits over MODEL_AXIS (and their other dim over an fsdp
    axis), every entry and split checked before anything moves. A planned peft tuner layer splits its base_layer."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"tp_plan must be a dict of module-name pattern -> style (e.g. "
                        f"{{'layers.*.mlp.up_proj': 'colwise'}}), got {_shown(plan)} ({type(plan).__name__})")
    modules = dict(model.named_modules())
    names = {m: n for n, m in modules.items()}
    inner = _peft_inner(model)
    model_size, fsdp_size = axis_sizes.get(MODEL_AXIS, 1), axis_sizes.get(FSDP_AXIS, 1)
    layers = []  # (Linear or Embedding, "out" or "in": the features that split)
    for pattern, style in plan.items():
        name = style if isinstance(style, str) else type(style).__name__
        if name not in TP_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}] = {_shown(style)} is not a style seamless_tpu knows; use one of "
                             f"{sorted(TP_STYLES)}")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        matched = [m for m in modules if regex.fullmatch(m)]
        if not matched:
            prefix = f"{inner[0]}." if inner else "\0"  # "\0" starts no module name
            inside = any(regex.fullmatch(m[len(prefix):]) for m in modules if m.startswith(prefix))
            raise ValueError(f"tp_plan entry {pattern!r} matches no module of {type(model).__name__} (names look like "
                             f"{[m for m in modules if m][:4]}; '*' stands for one name part, e.g. a layer index)"
                             + (f"; it names a module of the model the peft wrapper holds: write '{prefix}{pattern}'"
                                if inside else ""))
        split = TP_STYLES[name]
        for module_name in matched if split else ():
            module = base = modules[module_name]
            while isinstance(getattr(base, "base_layer", None), torch.nn.Module):  # peft tuner layers, nested or not
                base = base.base_layer
            if not isinstance(base, (torch.nn.Linear, torch.nn.Embedding)):
                what = _class_path(base) if base is module else f"{_class_path(module)} around a {_class_path(base)}"
                raise ValueError(f"tp_plan splits {module_name!r} ({name}), a {what}; colwise and rowwise split the "
                                 "weights of torch.nn.Linear and torch.nn.Embedding modules (or a peft tuner layer's "
                                 "base_layer) only: leave this module out of the plan")
            parent = modules.get(module_name.rpartition(".")[0])
            if not xla and (base is not module or getattr(parent, "base_layer", None) is module):
                role = "a peft tuner layer" if base is not module else "the base_layer of a peft tuner layer"
                raise NotImplementedError(
                    f"tp_plan[{pattern!r}] = {name!r} plans {module_name!r}, {role} "
                    f"({_class_path(module if base is not module else parent)}); off XLA, torch's parallelize_module "
                    "splits torch.nn.Linear and torch.nn.Embedding modules only, and a split base_layer would add its "
                    "split output to the adapters' whole one. Run on XLA (tensor parallelism works through peft "
                    "there), merge the adapters first (model.merge_and_unload()), or leave the adapted modules out "
                    "of tp_plan (e.g. plan only the MLP when LoRA targets attention)")
            # LoRA's B (beside a split output) and A (beside a split input) split as the base does, so neither
            # gathers the whole: exact either way on XLA, and A, B are r-thin, so this saves reshards, not memory.
            lora = getattr(module, "lora_B" if split == "out" else "lora_A", None) if base is not module else None
            lora = lora.values() if isinstance(lora, torch.nn.ModuleDict) else ()
            adapters = [m for m in lora if isinstance(m, torch.nn.Linear)]
            layers += [(layer, split) for layer in (base, *adapters)]
    specs = {}
    for module, split in layers:
        embedding = isinstance(module, torch.nn.Embedding)
        for param_name, param in module.named_parameters(recurse=False):
            dim = {"weight": {"out": 1 if embedding else 0, "in": 0 if embedding else 1}[split],
                   "bias": 0 if split == "out" else None}.get(param_name)
            if dim is None:
                continue
            if param.shape[dim] % model_size:
                raise ValueError(f"tp_plan splits {names[module]}.{param_name} (shape {tuple(param.shape)}) along dim "
                                 f"{dim} over the '{MODEL_AXIS}' axis of size {model_size}, which does not divide "
                                 f"{param.shape[dim]}; pick a model_parallel_size that divides it, or leave this "
                                 "module out of the plan")
            across = FSDP_AXIS if fsdp_size > 1 else None  # the other dim (XLA pads one the fsdp axis does not divide)
            specs[param] = tuple(MODEL_AXIS if d == dim else across for d in range(param.dim()))
    return specs

def _check_torch_tp_plan(plan, sizes):
    """What torch.distributed cannot do right with a tensor-parallel plan, refused before any work."""
    if FSDP_AXIS not in sizes:
        raise NotImplementedError("tensor parallelism off XLA runs with strategy='fsdp' (FSDP2 over the other mesh "
                                  "dimension); with 'ddp', torch 2.9's replicate() over a tensor-parallel sub-mesh "
                                  "trains wrong weights (measured on gloo), so use strategy='fsdp'")
    for pattern, style in plan.items():
        if isinstance(style, str) and TP_STYLES[style] is None:  # its gradient needs an all-reduce over the group
            raise NotImplementedError(f"tp_plan[{pattern!r}] = {style!r} off XLA: only the splitting styles "
                                      "(colwise, rowwise and their variants) are built for torch.distributed so far; "
                                      "on XLA every style works")


# --- 7. XLA activation and torch patches ----------------------------------------------------------


def _activate_xla(kind):
    """First XLA use: SPMD on, autograd ready, torch patched, step hooks in. Idempotent, across threads too."""
    with _STATE.activation_lock:
        if _STATE.xla_device is not None:
            return _STATE.xla_device
        if _user_pjrt_device() is None:  # unset, '', or torch_xla's own guess: ours to choose
            pjrt = "TPU" if kind == "tpu" else (os.environ.get("PJRT_DEVICE") or "CPU")
            _STATE.env_we_set["PJRT_DEVICE"] = os.environ["PJRT_DEVICE"] = pjrt
            _log("seamless_tpu: set PJRT_DEVICE=%s", pjrt)
        torch_xla = _import("torch_xla")
        # _xla_dot's user computations call it, as it is now: 9d's _scan records the module's while a loop is built
        _STATE.xla_kernels["_xla_user_computation"] = getattr(torch_xla._XLAC, "_xla_user_computation", None)
        _init_compile_cache(kind)  # before the runtime starts
        _enable_spmd()
        # The device count must be known before the first backward on XLA, or autograd has no
        # queue for the device (INTERNAL ASSERT device_ready_queues_); the query starts the runtime.
        _import("torch_xla.runtime").global_runtime_device_count()
        device = torch_xla.device()
        _check_autograd_ready(device)
        _patch_torch_for_xla()
        _STATE.cuts.watchdog = _CompileWatchdog()
        _install_step_hooks()
        _STATE.xla_device, _STATE.xla_kind = device, kind
        return device


def _enable_spmd():
    torch_xla = _import("torch_xla")
    xr = _import("torch_xla.runtime")
    if xr.is_spmd():
        return
    # Measured on torch_xla 2.9 (PJRT CPU, 4 devices): a tensor made before use_spmd() segfaults
    # on use, and so does a bare torch_xla.device() call (accelerate's PartialState() makes one):
    # the next MLP backward dies with exit 139. Both lock the SPMD config; the counter says which.
    if torch_xla._XLAC._xla_get_spmd_config_is_locked():
        created = _import("torch_xla.debug.metrics").counter_value("CreateXlaTensor") or 0
        what = ("XLA tensors were created" if created else
                "an XLA device was requested (torch_xla.device(), or the deprecated xla_device of "
                "xla_model; accelerate's PartialState() and Accelerator() call it)")
        raise RuntimeError(f"{what} before seamless_tpu switched on SPMD. torch_xla 2.9 cannot switch to SPMD after "
                           "that: training then segfaults. Create the SeamlessTPUTrainer, or call "
                           "seamless_tpu.get_device(), first, before anything touches an XLA device.")
    xr.use_spmd()


def _check_autograd_ready(device):
    # Lazy: builds IR only, compiles and runs nothing.
    probe = torch.zeros(1, device=device, requires_grad=True)
    try:
        probe.sum().backward()
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        raise RuntimeError("a backward() ran on CPU in this process before XLA was initialised, and torch's "
                           "autograd engine now has no queue for XLA devices, so every XLA backward would fail. "
                           "Create the SeamlessTPUTrainer (or call seamless_tpu.get_device()) before the first "
                           "CPU backward, e.g. before computing an eager reference in the same process.") from e


def _to_keeping_parameters(module_to):
    """nn.Module.to, which keeps the Parameter objects when it moves a module to XLA (swapped in place; torch_xla
    makes new ones, stranding an optimizer built before the move, the user's own `disc.to(xla)` beside a trainer's
    model included). torch's swap_module_params_on_conversion only around that call: on for the process, every
    load_state_dict swapped too and raised on any RNN ("Cannot swap t1 because it has weakref associated with it")."""
    @functools.wraps(module_to)
    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device.type != "xla":
            return module_to(self, *args, **kwargs)  # not to XLA: torch's as it is
        if torch.__future__.get_swap_module_params_on_conversion():
            moved = module_to(self, *args, **kwargs)  # the user's own setting, as it is
        else:
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                moved = module_to(self, *args, **kwargs)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
        _moe_experts_dense()
        _loops_of_moved(moved)
        return moved
    to.keeps_parameters = True
    return to


def _inference_as_no_grad(enter):
    """torch.inference_mode(), once XLA is in use, is no_grad, as Lightning's evaluation on XLA: under it a view of a
    plain XLA tensor raised "Cannot set version_counter for inference tensor" (torch_xla makes each view a tensor of
    its own, an inference tensor there, which autograd cannot give its base's version counter): nn.Linear, x @ w.t(),
    layer norm and attention failed. No graph is recorded either way; tensors made inside are plain ones (CPU ones
    too), which later autograd may use. inference_mode(False) stays torch's."""
    @functools.wraps(enter)
    def __enter__(self):
        if not self.mode:
            return enter(self)
        self._inference_mode_context = torch.no_grad()  # what torch's __exit__ leaves
        self._inference_mode_context.__enter__()
    __enter__.no_grad = True
    return __enter__


def _patch_torch_for_xla():
    """The header's torch changes, each undone by _reset_caches. torch.utils.checkpoint needs a torch.xla module (the
    RNG state: ours restores the XLA seed, so a recomputed dropout draws the same mask). XLA's CSE merges a plain
    recomputation back into the forward: use_reentrant=True goes to torch_xla's CheckpointFunction, whose barrier also
    covers the incoming gradients (39% less memory on a 4-block MLP); use_reentrant=False gets the barrier on its
    recompute inputs. CPU/GPU inputs stay on torch's path. TODO(remove when torch_xla registers torch.xla and
    supports use_reentrant=False)"""
    xm = _import("torch_xla.core.xla_model")
    if not hasattr(torch, "xla"):
        module = types.ModuleType("torch.xla")  # the RNG state is the XLA seed, an unsigned 64-bit int
        module.__dict__.update(  # torch saves a device's RNG state only for an _initialized module
            _initialized=True, is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
            device=lambda device=None: contextlib.nullcontext(), get_rng_state=lambda device=None: xm.get_rng_state(),
            set_rng_state=lambda state, device=None: xm.set_rng_state(state))
        torch._register_device_module("xla", module)
        _STATE.torch_patches.append(lambda: (delattr(torch, "xla"), sys.modules.pop("torch.xla", None)))
    _register_lowerings()
    _scan_backward_without_jax()
    if not getattr(torch.nn.Module.to, "keeps_parameters", False):  # not patched by an earlier process state
        _patch(torch.nn.Module, "to", _to_keeping_parameters(torch.nn.Module.to))
    inference = torch.autograd.grad_mode.inference_mode
    if not getattr(inference.__enter__, "no_grad", False):
        _patch(inference, "__enter__", _inference_as_no_grad(inference.__enter__))
    ckpt = importlib.import_module("torch.utils.checkpoint")
    if getattr(ckpt.CheckpointFunction, "routes_xla", False):  # patched by an earlier process state
        return

    def is_xla(t):
        return isinstance(t, torch.Tensor) and t.device.type == "xla"

    torch_function, xla_function = ckpt.CheckpointFunction, _import("torch_xla.utils.checkpoint").CheckpointFunction

    class RoutedCheckpointFunction:  # checkpoint() looks the name up per call: transformers' bound copy too
        routes_xla = True

        @staticmethod
        def apply(function, preserve_rng_state, *args):
            chosen = xla_function if any(map(is_xla, args)) else torch_function
            return chosen.apply(function, preserve_rng_state, *args)

    frame_init = ckpt._CheckpointFrame.__init__

    def init_with_barrier(self, recompute_fn, *args, **kwargs):
        def recompute(kwargs_of_fn, *inputs):
            inputs = [t.detach().requires_grad_(t.requires_grad) if is_xla(t) else t for t in inputs]
            if any(map(is_xla, inputs)):
                xm.optimization_barrier_([t for t in inputs if is_xla(t)])
            return recompute_fn(kwargs_of_fn, *inputs)
        frame_init(self, recompute, *args, **kwargs)

    _patch(ckpt, "CheckpointFunction", RoutedCheckpointFunction)
    _patch(ckpt._CheckpointFrame, "__init__", init_with_barrier)


def _scan_backward_without_jax():
    """torch_xla's scan (its nn.GRU replacement, scan_layers) gives its SPMD backward's gradients the inputs'
    shardings with jax's shard_alike: without jax every such backward raised ModuleNotFoundError. Without jax, GSPMD
    propagates them (the numbers are the same), and torch_xla's GRU steps as torch's own, its parent class."""
    scan, scan_gru = (sys.modules.get(f"torch_xla.experimental.{name}") for name in ("scan", "gru"))
    if scan is not None and scan_gru is not None and importlib.util.find_spec("jax") is None:
        _patch(scan, "_backward_shard_alike", lambda carry, x, backward, init, xs: backward(carry, x))
        _patch(scan_gru.GRU, "forward", torch.nn.modules.rnn.GRU.forward)

# --- 7b. the lowerings: one table, and the contract every kernel keeps ------------------------------
# @_lowering registers each kernel beside its definition in _LOWERINGS, the one table that registration, the
# hand-back check, the header, the OpInfo tier (tests/opinfo.py) and docs/design.md read. A kernel replaces torch's
# for every XLA tensor in the process, so it keeps its op's whole contract (tests/test_opinfo.py, test_autograd.py):
# forward, both derivatives, torch.func, every input torch accepts, and torch's own error for bad ones: checked by
# torch's meta kernel (_torch_checks), or handed back to torch's own path (_torch_path: the op's composite, checked
# at registration). Under torch.func and forward-mode AD the kernels use plain ops (_transformed).


@dataclasses.dataclass(frozen=True)
class _Lowering:
    kernel: object  # stands for aten `op` at the dispatch `key`, or for torch.nn.functional's `op` (functional)
    family: str  # products, attention, norms, pointwise, masks, losses, reductions, pooling, windows, resampling, views
    why: str  # torch_xla's: "batch" (lost its split), "cpu" (ran there), "grad2" (lost it), "crash", "refused"
    hands_back: bool = False  # some inputs go to torch's own path, _torch_path(op)
    functional: object = None  # torch.nn.functional's own function, which a functional lowering replaces
    key: str = "AutogradXLA"  # or "XLA": below autograd, which keeps torch's own derivative


_LOWERINGS = {}  # op -> _Lowering, in definition order


def _lowering(*ops, family, why, hands_back=False, functional=False, key="AutogradXLA"):
    """Registers the decorated kernel in _LOWERINGS for each of `ops` (aten op names, with their overload: "glu",
    "upsample_nearest2d.vec"; or torch.nn.functional names when `functional`)."""
    def register(kernel):
        for op in ops:
            if op in _LOWERINGS:
                raise RuntimeError(f"seamless_tpu bug: two lowerings of {op}")
            own = getattr(torch.nn.functional, op) if functional else None
            _LOWERINGS[op] = _Lowering(kernel, family, why, hands_back or functional, own, key)
        return kernel
    return register


def _register_lowerings():
    """The table's kernels at their keys (AutogradXLA, or XLA) and its functional patches, once per process (undone by
    _reset_caches); first, that torch has the path each hand-back takes (a composite kernel: .decompose() of an op
    with none returns NotImplemented, and the kernel would fail on what it leaves to torch)."""
    F, aten = torch.nn.functional, {op: low for op, low in _LOWERINGS.items() if not low.functional}
    if any(getattr(F, op) is low.kernel for op, low in _LOWERINGS.items() if low.functional):
        return  # registered by an earlier process state
    lost = [op for op, low in aten.items() if low.hands_back and not torch._C._dispatch_has_kernel_for_dispatch_key(
        f"aten::{op}", "CompositeImplicitAutograd")]
    if lost:
        raise RuntimeError(f"torch {torch.__version__} has no composite kernel for aten ops {lost}, to which "
                           f"seamless_tpu's XLA lowerings hand the inputs they leave to torch; it was tested with "
                           f"torch {_TESTED_WITH['torch']}: install that version.")
    for op, low in aten.items():  # torch_xla's own kernel of an op ours replaces at its key: ours may call it
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", low.key):
            own = torch.library.get_kernel(f"aten::{op}", low.key)  # with its key set made once (addmm: every call)
            _STATE.xla_kernels[op] = functools.partial(own.call_boxed, torch._C.DispatchKeySet(
                getattr(torch._C.DispatchKey, low.key)))
    _impl_kernels((op, low.kernel, low.key) for op, low in aten.items())
    for op, low in _LOWERINGS.items():
        if low.functional:
            _patch(F, op, low.kernel)


def _impl_kernels(kernels):
    """Each (aten op, kernel, dispatch key) registered; _reset_caches destroys the library, and the dispatcher goes
    back to the kernels ours replaced (torch's composites, torch_xla's, torch's autocast)."""
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns once that ours replaces a kernel (torch_xla's einsum): it is meant to
        warnings.simplefilter("ignore")
        for op, kernel, key in kernels:
            library.impl(op, kernel, key)
    _STATE.torch_patches.append(library._destroy)


def _torch_path(op):
    """torch's own path for the inputs the lowering of `op` leaves to torch (rare ones, torch.func, bad ones: torch's
    own error): the op's composite kernel, or torch.nn.functional's own function."""
    low = _LOWERINGS.get(op)
    if low is None or not low.hands_back:
        raise RuntimeError(f"seamless_tpu bug: the lowering of {op} does not declare hands_back=True, so nothing "
                           "checked that torch has a path to hand its inputs to")
    if low.functional:
        return low.functional
    name, _, overload = op.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default").decompose


def _torch_xla_path(op):
    """torch_xla's own kernel of aten `op`, which a lowering replaced at its key, for the inputs it lowers well; None
    where there is none (a fake torch_xla, the kernels run on CPU tensors in the fast tests)."""
    return _STATE.xla_kernels.get(op)


def _torch_checks(op, *args, **kwargs):
    """torch's own preconditions of aten `op` and their errors, for a kernel with no composite to hand back to: its
    meta kernel run on stand-ins of its tensors (shapes only: no compute, nothing in the graph; under a tracing mode,
    which would record the stand-ins, the op's own tracing checks)."""
    if not is_in_torch_dispatch_mode():
        getattr(torch.ops.aten, op)(*(torch.empty(t.shape, dtype=t.dtype, device="meta")
                                      if isinstance(t, torch.Tensor) else t for t in args), **kwargs)


def _transformed(*tensors):
    """torch.func, forward-mode AD or a tracing mode (scan_layers' AOT trace: no real XLA tensors) is at work: an
    autograd.Function called from a dispatcher kernel has no functorch rule there (custom_function_call has no
    AutogradXLA kernel), so the kernels use plain ops instead."""
    return torch._C._are_functorch_transforms_active() or is_in_torch_dispatch_mode() or any(
        t is not None and torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _computation_dtype(x):
    """fp32 for half-precision inputs, as torch's kernels compute them; any other dtype kept (float64 too)."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype

# --- 7c. lowerings: products and attention --------------------------------------------------------
# torch_xla folds matmul's (T, B, E) into (T*B, E) and (B, H, T, d) into (B*H, T, d), where GSPMD kept one split of
# two; GSPMD all-gathered a grouped convolution's batch; attention viewed (T, B, H, d) as (T*B, E); embedding bags,
# cdist's and pdist's backwards ran on the CPU; einsum's C++ backward had no second derivative (silently 0). Ours
# keep every dimension, and torch_xla's matmul precision (issue 60: _xla_dot and the protobuf editor that
# _xla_dot_general's missing precision costs, 72 lines over the budget and 2 in room 1; they go with its TODO).


@_lowering("matmul", family="products", why="batch", hands_back=True)
def _xla_matmul(input, other):
    """Batched (equal batch shapes) or > 2-D by a matrix: our einsum kernel (called directly: through torch.einsum,
    2x the tracing), where torch folds the batch dims into one: a (B, H, T, d) attention product became (B*H, T, d),
    of which GSPMD kept one of two splits (Qwen3 on 2 x 2 devices: 1/2 of attention's products per device), a (T, B,
    E) input T*B rows. Batch-first too, where the fold keeps the split: one lowering for every layout. 2-D by 2-D
    where fsdp splits either (the einsum gathers it in order: _in_order)."""
    if other.dim() >= 2 and input.shape[-1:] == other.shape[-2:-1] and input.dtype == other.dtype and (
            input.dim() >= 3 or input.dim() == other.dim() == 2 and (_gathered(input) or _gathered(other))):
        if other.dim() == 2:
            return _xla_einsum("...n,nm->...m", (input, other))
        if input.shape[:-2] == other.shape[:-2]:
            return _xla_einsum("...ij,...jk->...ik", (input, other))
    return _torch_path("matmul")(input, other)  # and torch's error, not einsum's


@_lowering("linear", family="products", why="batch", hands_back=True)
def _xla_linear(input, weight, bias=None):
    """> 2-D inputs: one dot contracting the weight's dim 1, then the bias (torch's composite transposed the weight
    for the matmul kernel: 2x the tracing a call, which a LoRA model's many Linears pay each step). 2-D: addmm,
    unless fsdp splits the weight (the einsum gathers it in order: _in_order)."""
    if (input.dim() < 2 or input.dim() == 2 and not _gathered(weight) or weight.dim() != 2
            or input.shape[-1] != weight.shape[1] or weight.dtype != input.dtype
            or bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != input.dtype)):  # torch's error
        return _torch_path("linear")(input, weight, bias)
    y = _xla_einsum("...n,mn->...m", (input, weight))
    return y if bias is None else y + bias


@_lowering("addmm", family="products", why="cpu", key="XLA")
def _xla_addmm(self, mat1, mat2, *, beta=1, alpha=1):
    """Below autograd, so torch's derivative stays: torch_xla ran addmm on the CPU unless beta and alpha are 1 (torch's
    Muon: a graph cut at each of its Newton-Schulz steps). The dot and sum its own kernel builds, each scaled; at 1
    and 1 torch_xla's kernel (a 2-D Linear's forward traced in 57 us, 75 through here, 121 as two ops)."""
    own = _torch_xla_path("addmm")
    if own and beta == 1 and alpha == 1:
        return own(self, mat1, mat2)
    if not (self.dtype == mat1.dtype == mat2.dtype and mat1.dim() == mat2.dim() == 2 and self.dim() <= 2
            and mat1.shape[1] == mat2.shape[0]):
        _torch_checks("addmm", self, mat1, mat2, beta=beta, alpha=alpha)  # shapes; the meta kernel skips dtypes
        torch._check(self.dtype == mat1.dtype == mat2.dtype, lambda: "addmm: self, mat1 and mat2 must have the same "
                     f"dtype, but got {self.dtype}, {mat1.dtype} and {mat2.dtype}")
    out = torch.mm(mat1, mat2) * alpha
    return out if beta == 0 else out + (self if beta == 1 else self * beta)  # beta 0: self ignored, NaNs too


@_lowering("_grouped_mm", family="products", why="crash")
def _xla_grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None):
    """Each group's rows, split by `offs`, times its weights (MoE experts; transformers' run dense on XLA instead,
    _dense_experts): torch_xla 2.9 runs torch's CPU kernel, which reads offs from device memory (SIGSEGV). Here each
    group's rows (columns, or K) are a mask made on the device, a place in two groups (offsets that decrease) the
    last's as torch's, and the products one dot over (group, K): G x the rows' own FLOPs, static shapes; rows past
    offs[-1] (undefined in torch's) are 0. Above autograd, so a loop's trace (where the meta kernel allows bf16 only)
    and both derivatives go through these plain ops."""
    a, b = self, mat2
    _grouped_mm_checks(a, b, offs, bias, out_dtype)
    if offs is None:  # 3-D x 3-D: a batch of products
        return torch.bmm(a, b)
    groups, split = len(offs), (a.shape[0] if a.dim() == 2 and b.dim() == 3 else b.shape[-1] if a.dim() == 3
                                else a.shape[1])  # what offs splits: the rows of a, the columns of b, or K
    at, ends = torch.arange(split, device=offs.device), torch.unsqueeze_copy(offs.long(), 1)
    inside = (at >= torch.cat([ends.new_zeros(1, 1), ends[:-1]])) & (at < ends)  # (G, split)
    later = torch.flip(torch.cumsum(torch.flip(inside, (0,)), 0), (0,)) > inside.long()  # a later group holds it too
    member = torch.unsqueeze_copy(inside & ~later, -1)
    k = a.shape[-1] if b.dim() == 3 else b.shape[0]
    if a.dim() == 2 and b.dim() == 3:  # (S, K) rows by group, x (G, K, N): (S, N)
        masked = torch.permute_copy(torch.where(member, a, 0), (1, 0, 2))  # (S, G, K)
        return torch.mm(torch.reshape(masked, (split, groups * k)), torch.reshape(b, (groups * k, b.shape[-1])))
    if a.dim() == 3:  # (G, M, K) x (K, N) columns by group: (M, N)
        masked = torch.where(torch.permute_copy(member, (0, 2, 1)), b, 0)  # (G, K, N)
        return torch.mm(torch.reshape(torch.permute_copy(a, (1, 0, 2)), (a.shape[1], groups * k)),
                        torch.reshape(masked, (groups * k, split)))
    masked = torch.where(torch.permute_copy(member, (0, 2, 1)), a, 0)  # (M, K) x (K, N), K by group: (G, M, N)
    m = a.shape[0]
    return torch.reshape(torch.mm(torch.reshape(masked, (groups * m, split)), b), (groups, m, b.shape[-1]))


def _grouped_mm_checks(a, b, offs, bias, out_dtype):
    """torch's own checks of _grouped_mm and their errors, as its CPU kernel makes them (its meta kernel holds CUDA's,
    bf16 only). Strides as the tensors report them (XLA's: contiguous)."""
    for name, t in (("mat_a", a), ("mat_b", b)):
        torch._check(t.dtype in (torch.float32, torch.bfloat16, torch.float16), lambda: f"Expected {name} to be "
                     f"Float32, BFloat16 or Float16 matrix, got {_dtype_name(t.dtype)}")
    for name, t in (("mat_a", a), ("mat_b", b)):
        torch._check(t.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")
    torch._check(a.shape[-1] == b.shape[-2] or a.dim() == b.dim() == 2,
                 lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is None) == (a.dim() == b.dim() == 3), lambda: "Have to provide offsets if there is a 2d "
                 "matrix, or no offset if both matrices are 3d")
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    groups = [len(t) for t in (a, b) if t.dim() == 3] + ([] if offs is None else [len(offs)])
    torch._check(len(set(groups)) <= 1, lambda: "matrix batch sizes have to match" if offs is not None else
                 "batched dimension has to match")
    torch._check(bias is None, lambda: "Bias not supported yet")
    torch._check(out_dtype in (None, a.dtype), lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    torch._check(all(s * t.element_size() % 16 == 0 for t in (a, b) for s in t.stride() if s != 1),
                 lambda: "strides should be multiple of 16 bytes")
    cpp = lambda d: "float" if d == torch.float32 else f"c10::{_dtype_name(d)}"  # noqa: E731  C++'s names
    torch._check(a.dtype == b.dtype, lambda: f"expected m1 and m2 to have the same dtype, but got: {cpp(a.dtype)} != "
                 f"{cpp(b.dtype)}")


def _moe_experts_dense():
    """For XLA inputs, transformers' grouped_mm experts (its MoE default) run every expert on every token, weighted by
    the routing's weight where chosen and 0 elsewhere (_dense_experts); others go to transformers' own. Once a process
    whose transformers has them (checked at each placement: a model may be built after XLA's first use)."""
    moe = sys.modules.get("transformers.integrations.moe")
    mapping = getattr(getattr(moe, "ExpertsInterface", None), "_global_mapping", {})
    own = mapping.get("grouped_mm")
    if own is None or getattr(own, "seamless_tpu", False):
        return

    def grouped_mm(self, hidden_states, top_k_index, top_k_weights):
        if not _is_xla(hidden_states.device) or self._is_expert_parallel:
            return own(self, hidden_states, top_k_index, top_k_weights)
        return _dense_experts(self, hidden_states, top_k_index, top_k_weights)
    grouped_mm.seamless_tpu = True
    mapping["grouped_mm"] = grouped_mm
    _STATE.torch_patches.append(lambda: mapping.__setitem__("grouped_mm", own))


def _dense_experts(experts, x, top_k_index, top_k_weights):
    """transformers' grouped_mm experts' math, (N, H) tokens to (N, H): each token's chosen experts' outputs times
    their weights, summed. grouped_mm sorts the batch's tokens by expert, a sort GSPMD cannot split, so each device
    ran the whole batch's experts (a 4-device Mixtral step: 0.47 of its dot FLOPs a device). Here every expert runs
    on every token, which stays on its device: E/k x the experts' FLOPs, each device its share."""
    e, transposed = experts.num_experts, experts.is_transposed
    up, bias = ((experts.gate_up_proj, "gate_up_proj_bias") if experts.has_gate else (experts.up_proj, "up_proj_bias"))
    h = torch.einsum("nh,ehi->eni" if transposed else "nh,eih->eni", x, up)  # (E, N, 2I or I)
    h = h + getattr(experts, bias)[:, None] if experts.has_bias else h
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    y = torch.einsum("eni,eih->enh" if transposed else "eni,ehi->enh", h, experts.down_proj)
    y = y + experts.down_proj_bias[:, None] if experts.has_bias else y
    y = experts.post_expert_norm(y) if experts.has_post_expert_norm else y
    chosen = torch.zeros((x.shape[0], e), dtype=torch.bool, device=x.device).scatter(1, top_k_index, True).T
    weights = torch.zeros((x.shape[0], e), dtype=top_k_weights.dtype, device=x.device).scatter(
        1, top_k_index, top_k_weights).T
    return torch.where(chosen[..., None], y * weights[..., None], 0).sum(0).to(x.dtype)  # 0, not 0 x inf


def _norms(diff, p):
    """torch's p-norm (p >= 0) of each row of diff over its last dimension, as cdist's and pdist's kernels."""
    a = diff.abs()
    if p == 0:
        return (a != 0).to(diff.dtype).sum(-1)
    if p == 1:
        return a.sum(-1)
    if p == 2:
        return a.square().sum(-1).sqrt()
    return a.amax(-1) if math.isinf(p) else a.pow(p).sum(-1).pow(1 / p)


def _norm_grads(diff, grad, dist, p):
    """Each row of diff's gradient through its p-norm `dist`, times its `grad`: the formulas of torch's cdist and
    pdist backward kernels (0 where the distance is 0; for p < 1 where the coordinate's difference is, too; for
    p = inf every coordinate whose |difference| is the distance)."""
    grad, dist, sign = torch.unsqueeze_copy(grad, -1), torch.unsqueeze_copy(dist, -1), diff.sign()
    if p == 0:
        return torch.zeros_like(diff)
    if p == 1:
        return grad * sign
    if math.isinf(p):
        return grad * sign * (diff.abs() == dist).to(diff.dtype)
    if p < 2:
        out = sign * diff.abs().pow(p - 1) * grad / dist.pow(p - 1)
        out = out.masked_fill(diff == 0, 0) if p < 1 else out
    else:
        out = diff * grad / dist if p == 2 else diff * diff.abs().pow(p - 2) * grad / dist.pow(p - 1)
    return out.masked_fill(dist == 0, 0)


def _pair_diffs(x1, x2):  # (*batch, r1, r2, m): every row of x1 minus every row of x2, the batch dims broadcast
    return torch.unsqueeze_copy(x1, -2) - torch.unsqueeze_copy(x2, -3)


@_lowering("_cdist_forward", family="products", why="cpu", key="XLA")
def _xla_cdist_forward(x1, x2, p, compute_mode=None):
    """Below autograd (torch's derivative: _cdist_backward, ours): torch_xla's raised on batch dims that broadcast
    (and so under vmap) and ran the backward on the CPU. Every pair of rows' difference, normed; p = 2 with
    compute_mode's matrix products goes to _euclidean_dist, as torch's kernel does. Below autograd the tensors are
    torch_xla's own: every step a copy, never a view (see _avg_pool)."""
    _torch_checks("_cdist_forward", x1, x2, p, compute_mode)
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    (r1, m), r2 = x1.shape[-2:], x2.shape[-2]
    if not (r1 and r2 and m and math.prod(batch)):  # empty, as torch's (no rows: empty; no columns: zeros)
        return x1.new_zeros((*batch, r1, r2))
    if p == 2 and (compute_mode == 1 or not compute_mode and (r1 > 25 or r2 > 25)):
        return torch._euclidean_dist(torch.expand_copy(x1, (*batch, r1, m)), torch.expand_copy(x2, (*batch, r2, m)))
    return _norms(_pair_diffs(x1, x2), p)


@_lowering("_cdist_backward", family="products", why="cpu", key="XLA")
def _xla_cdist_backward(grad, x1, x2, p, cdist):
    """x1's gradient, over the broadcast batch as torch's (autograd sums it back to x1's shape)."""
    _torch_checks("_cdist_backward", grad, x1, x2, p, cdist)
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    if not (x1.shape[-2] and x2.shape[-2] and x1.shape[-1] and math.prod(batch)):
        return torch.zeros_like(x1)
    return _norm_grads(_pair_diffs(x1, x2), grad, cdist, p).sum(-2)


def _pairs(n, device):
    """(i, j) of pdist's pairs, i < j in row-major order, computed on the device (torch_xla's triu_indices runs on
    the CPU): pair k's row is the last i whose first pair, i * (2n - i - 1) / 2, is at most k (a binary search)."""
    k = torch.arange(n * (n - 1) // 2, device=device)
    low, high = torch.zeros_like(k), torch.full_like(k, n - 2)
    for _ in range(max(1, (n - 1).bit_length())):
        mid = (low + high + 1) // 2
        fits = mid * (2 * n - mid - 1) // 2 <= k
        low, high = torch.where(fits, mid, low), torch.where(fits, high, mid - 1)
    return low, k - low * (2 * n - low - 1) // 2 + low + 1


@_lowering("_pdist_forward", family="products", why="cpu", key="XLA")
def _xla_pdist_forward(input, p=2):
    """Below autograd (torch's derivative: _pdist_backward, ours): torch_xla's gave wrong distances for p = 0 and
    p = inf, and ran the backward on the CPU. Each pair's rows gathered, their difference normed."""
    _torch_checks("_pdist_forward", input, p)
    n, m = input.shape
    if n < 2 or m == 0:
        return input.new_zeros(n * (n - 1) // 2)
    i, j = _pairs(n, input.device)
    return _norms(input.index_select(0, i) - input.index_select(0, j), p)


@_lowering("_pdist_backward", family="products", why="cpu", key="XLA")
def _xla_pdist_backward(grad, input, p, pdist):
    """Each pair's gradient added to its first row and taken from its second (index_add: a scatter-add)."""
    _torch_checks("_pdist_backward", grad, input, p, pdist)
    n, m = input.shape
    if n < 2 or m == 0:
        return torch.zeros_like(input)
    i, j = _pairs(n, input.device)
    g = _norm_grads(input.index_select(0, i) - input.index_select(0, j), grad, pdist, p)
    return torch.zeros_like(input).index_add(0, i, g).index_add(0, j, -g)


@_lowering("einsum", family="products", why="grad2", hands_back=True)
def _xla_einsum(equation, tensors, *, path=None):
    """Two operands: torch_xla's einsum (one dot that keeps every batch dim), with a backward of einsums, so that it
    differentiates again (torch_xla's backward is a C++ function: a second derivative through it was silently 0).
    Three or more, a subscript twice in an operand, broadcasting, torch.func: torch's composite (its bmm folds the
    batch dims)."""
    subs = (len(tensors) == 2 and tensors[0].dtype == tensors[1].dtype and not _transformed(*tensors)
            and _einsum_subscripts(equation, tensors[0].shape, tensors[1].shape))
    if not subs:
        return _torch_path("einsum")(equation, tensors, path=path)
    return _Einsum.apply(subs, *tensors)


@functools.lru_cache(maxsize=4096)  # per equation and shapes: parsing took a fifth of an einsum's tracing time
def _einsum_subscripts(equation, a, b):
    """((subscripts of an operand of shape a, of b), of the output), ellipses spelled out, if each operand's
    subscripts match its dims, none repeats within one, and a shared one has one size; else None, and torch's path
    decides (or raises)."""
    inputs, arrow, out = equation.replace(" ", "").partition("->")
    subs = inputs.split(",")
    spare = [c for c in string.ascii_letters if c not in equation]
    if len(subs) != 2 or "..." in out and "..." not in inputs:
        return None
    widths = [len(t) - len(s.replace("...", "")) for s, t in zip(subs, (a, b))]
    n = max(widths)
    subs = [s.replace("...", "".join(spare[n - w:n])) for s, w in zip(subs, widths)]
    if not arrow:  # implicit: the ellipsis, then the subscripts used once, sorted
        out = "".join(spare[:n]) + "".join(sorted(c for c in inputs if inputs.count(c) == 1 and c != "."))
    out = out.replace("...", "".join(spare[:n]))
    if not all(c in string.ascii_letters for c in "".join(subs) + out):
        return None
    sizes = {}
    for s, t in zip(subs, (a, b)):
        if len(s) != len(t) or len(set(s)) < len(s) or any(sizes.setdefault(c, m) != m for c, m in zip(s, t)):
            return None
    return (tuple(subs), out) if len(set(out)) == len(out) and set(out) <= set(sizes) else None


class _Einsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, subs, a, b):
        ctx.subs, ctx.gathered = subs, (_gathered(a), _gathered(b))  # a saved cast comes back unmarked
        ctx.save_for_backward(a, b)
        ga, gb = ctx.gathered
        return _dot_general(subs, _in_order(b, a, "forward") if ga else a, _in_order(a, b, "forward") if gb else b)

    @staticmethod
    def backward(ctx, grad):
        a, b = (_in_order(grad, t, "backward") if g else t for t, g in zip(ctx.saved_tensors, ctx.gathered))
        (sa, sb), out = ctx.subs
        return (None, _einsum_grad(grad, out, b, sb, a, sa) if ctx.needs_input_grad[1] else None,
                _einsum_grad(grad, out, a, sa, b, sb) if ctx.needs_input_grad[2] else None)


def _in_order(now, w, kind):
    """`w`, a weight fsdp splits (_gathered), gathered for this product no earlier than the last such product's input
    (`now` then) of this pass: without it XLA gathered every layer's weight at the program's start and kept each to
    its backward (a flat Sequential of Linear layers: 2.75x the model per device). Adds a 0 made from that input
    (_zero_after): a pass over the shard and a 4-byte all-reduce a product."""
    if _STATE.loops.tracing:  # a loop's body gathers one block's weights
        return w
    cuts = _STATE.cuts
    gate, cuts.gates[kind] = cuts.gates.get(kind), now
    return w if gate is None or not gate.numel() else w + _zero_after([gate], w.dtype)


def _zero_after(tensors, dtype):
    """A 0 of `dtype` that XLA computes only once every tensor (none empty) is: added to a value, it orders that
    value's work after theirs. One element of each (a reshape of a tensor split on dim 1 gathered it whole) equal to
    itself, 1 or 0, never NaN; times 0, which XLA does not fold for floats (it does for ints)."""
    ones = [(t[(0,) * t.dim()] == t[(0,) * t.dim()]).to(dtype) for t in tensors]
    return sum(ones[1:], ones[0]) * 0


def _gathered(w):  # ids outlive tensors: a new one may have a dead fsdp parameter's; or autocast's cast of one
    return getattr(w, _CAST_OF_GATHERED, False) or (
        id(w) in _STATE.cuts.gathered and isinstance(w, torch.nn.Parameter) and _is_split(w))


_CAST_OF_GATHERED = "_seamless_tpu_cast_of_gathered"
_AUTOCAST_CASTS = ("linear", "matmul", "einsum", "conv1d", "conv2d", "conv3d")  # the products _in_order orders


def _register_autocast_casts():
    """_autocast_cast at AutocastXLA for autocast's products, once a trainer's fsdp splits a weight on XLA (undone by
    _reset_caches): ddp never pays for them."""
    if not _STATE.cuts.autocast_casts:
        _impl_kernels((op, _autocast_cast(op), "AutocastXLA") for op in _AUTOCAST_CASTS)
        _STATE.cuts.autocast_casts = True


def _autocast_cast(op):
    """aten `op` at AutocastXLA: torch's lower-precision policy for it (every floating XLA input but float64 cast to
    the autocast dtype, then the op with autocast off), with a weight fsdp splits marked as its cast, which the
    product below then gathers in order (_in_order). Cast by autocast's own kernel it reached the product as another
    tensor: under bf16 autocast a flat Sequential of Linear layers peaked at 2.75x the model per device, 0.63x in
    fp32. Costs ~18 us a product traced (a Linear: 68 us against 50 with torch's kernel), under autocast with fsdp
    only."""
    aten = getattr(torch.ops.aten, op).default

    def kernel(*args, **kwargs):  # tensors come positional; einsum's as a list
        dtype = torch.get_autocast_dtype("xla")
        args = [[_autocast(t, dtype) for t in a] if isinstance(a, list) else _autocast(a, dtype) for a in args]
        torch.set_autocast_enabled("xla", False)
        try:
            return aten(*args, **kwargs)
        finally:
            torch.set_autocast_enabled("xla", True)
    return kernel


def _autocast(t, dtype):
    """`t` as torch's autocast casts an input of a lower-precision op (a floating XLA tensor but float64), the cast of
    a weight fsdp splits marked for _in_order."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and _is_xla(t.device)):
        return t
    out = t.to(dtype)
    if out is not t and _gathered(t):
        setattr(out, _CAST_OF_GATHERED, True)
    return out


def _dot_general(subs, a, b):
    """A two-operand einsum as one XLA dot (what torch_xla's lowering builds; torch_xla keeps that lowering at the
    AutogradXLA key, which ours replaces, and the XLA key's einsum is torch's folding composite): subscripts in both
    operands and the output are its batch dims, in both only its contracted dims; one operand's own are summed
    first where the output lacks them."""
    sum_a, sum_b, dims, order = _dot_plan(subs)
    y = _xla_dot(a.sum(sum_a) if sum_a else a, b.sum(sum_b) if sum_b else b, dims)
    # Not a view: a Function's output that is one refuses in-place ops (matmul's squeeze_ of a vector's product)
    return y if order is None else y.permute(order).clone()


def _xla_dot(a, b, dims):
    """XLA's dot of a and b over dims ([contracted of a, of b], [batch of a, of b]) at torch_xla's matmul precision
    (torch_xla.backends.set_mat_mul_precision), which its mm, bmm and convolutions carry and its _xla_dot_general drops
    (its binding refuses one): at "high" or "highest" a TPU ran such a dot in one bf16 pass. At "default" (read per
    call: 0.2 us), _xla_dot_general. Else the same dot with the precision in its HLO, called as a user computation (as
    torch_xla's call_jax calls jax's), which XLA inlines before GSPMD partitions it: every batch dim kept. bmm carries
    the precision but folds the batch dims into one, of which GSPMD kept one split of two (Qwen3's tp plan on 2 x 2
    devices: 0.271 of the step's dot FLOPs per device, this dot 0.25; docs/design.md). Traced in ~8 us against 4.5,
    and ~0.4 ms once per shapes (_precise_dot)."""
    xlac = _import("torch_xla")._XLAC
    precision = xlac._xla_get_mat_mul_precision()
    if precision == "default":
        return xlac._xla_dot_general(a, b, dims)
    dot, swapped = _precise_dot(a.shape, a.dtype, b.shape, b.dtype, repr(dims), _MATMUL_PRECISIONS[precision])
    return _STATE.xla_kernels["_xla_user_computation"]("xla::dot_general", [b, a] if swapped else [a, b], dot)[0]


_MATMUL_PRECISIONS = {"high": 1, "highest": 2}  # torch_xla's setting -> XLA's PrecisionConfig.Precision


@functools.lru_cache(maxsize=1024)
def _precise_dot(a_shape, a_dtype, b_shape, b_dtype, dims, precision):
    """(computation, swapped): the computation of XLA's dot of a and b at `precision`, of [a, b] or, if swapped, [b, a]:
    the HLO module torch_xla traces for _xla_dot_general of two placeholders, its dot given a precision_config in
    protobuf's wire format (a trace: nothing compiles or runs)."""
    torch_xla, xb = _import("torch_xla"), _import("torch_xla.core.xla_builder")
    a, b = xb.create_placeholder_tensor(a_shape, a_dtype), xb.create_placeholder_tensor(b_shape, b_dtype)
    dot = torch_xla._XLAC._xla_dot_general(a, b, ast.literal_eval(dims))
    params, lhs = {}, []

    def edit(number, proto):  # HloModuleProto's computations (its field 3), their instructions (a computation's 2)
        if number == 3:
            return b"".join(_proto_field(2, edit(2, v)) if n == 2 else raw for n, v, raw in _proto_fields(proto))
        fields = {n: v for n, v, _ in _proto_fields(proto)}  # 2: opcode, 35: id, 9: parameter_number, 36: operand ids
        if fields.get(2) == b"parameter":
            params[fields.get(35, 0)] = fields.get(9, 0)
        elif fields.get(2) == b"dot":  # 51: its PrecisionConfig, whose 1 is each operand's precision, packed
            lhs.append(_varint(fields[36], 0)[0])
            return proto + _proto_field(51, _proto_field(1, bytes([precision] * 2)))
        return proto
    module = torch_xla._XLAC._get_xla_tensors_hlo_proto([dot])
    module = b"".join(_proto_field(3, edit(3, v)) if n == 3 else raw for n, v, raw in _proto_fields(module))
    computation = xb.computation_from_module_proto("dot_general", module)
    return computation, params[lhs[0]] == 1  # torch_xla numbers the placeholders as it finds them


def _proto_fields(buf):
    """A protobuf message's fields, from its wire format: (number, payload bytes or varint, the field's own bytes)."""
    i = 0
    while i < len(buf):
        key, j = _varint(buf, i)
        wire = key & 7  # 0: a varint, 1: 64 bits, 2: length-delimited, 5: 32 bits
        value, end = _varint(buf, j) if wire in (0, 2) else (None, j + (8 if wire == 1 else 4))
        value, end = (buf[end:end + value], end + value) if wire == 2 else (value, end)
        yield key >> 3, value, buf[i:end]
        i = end


def _varint(buf, i):  # (the varint at buf[i], the index after it)
    value = shift = 0
    while buf[i] & 0x80:
        value, i, shift = value | (buf[i] & 0x7F) << shift, i + 1, shift + 7
    return value | buf[i] << shift, i + 1


def _proto_field(number, payload):  # a length-delimited field
    return _varint_bytes(number << 3 | 2) + _varint_bytes(len(payload)) + payload


def _varint_bytes(n):
    return bytes([n & 0x7F | 0x80]) + _varint_bytes(n >> 7) if n > 0x7F else bytes([n])


@functools.lru_cache(maxsize=4096)
def _dot_plan(subs):
    """For _dot_general: each operand's dims summed first, the dot's dims, the permutation to the output's order."""
    (sa, sb), out = subs
    sum_a, sa = _summed_out(sa, sb + out)
    sum_b, sb = _summed_out(sb, sa + out)
    batch, contracted = [c for c in sa if c in sb and c in out], [c for c in sa if c in sb and c not in out]
    dims = (([sa.index(c) for c in contracted], [sb.index(c) for c in contracted]),
            ([sa.index(c) for c in batch], [sb.index(c) for c in batch]))
    got = "".join(batch) + "".join(c for c in sa if c not in sb) + "".join(c for c in sb if c not in sa)
    return sum_a, sum_b, dims, None if got == out else [got.index(c) for c in out]


def _summed_out(subs, others):
    return [i for i, c in enumerate(subs) if c not in others], "".join(c for c in subs if c in others)


def _einsum_grad(grad, out, other, other_subs, target, subs):
    """The gradient of an operand: an einsum of the output's gradient with the other operand (which is _Einsum
    again), spread along the subscripts that only this operand had (their sum's gradient is the same everywhere)."""
    kept = "".join(c for c in subs if c in out + other_subs)
    if torch.is_grad_enabled() or _transformed(grad, other):  # create_graph, vmap: an einsum that differentiates
        g = torch.einsum(f"{out},{other_subs}->{kept}", grad, other)
    else:  # the dot alone: no graph to build (a third of the tracing time)
        g = _dot_general(((out, other_subs), kept), grad, other)
    return g if kept == subs else g.reshape([m if c in kept else 1 for c, m in zip(subs, target.shape)]).expand_as(
        target)


def _grouped_conv(spatial):
    """A grouped convolution as one einsum over its windows (the same FLOPs): GSPMD all-gathered the batch of a
    feature_group_count convolution and ran it whole on each device. An ungrouped one whose weight fsdp splits:
    _GatheredConv; the rest, torch's."""
    def kernel(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        stride, padding, dilation = ([v] * spatial if isinstance(v, int) else list(v) * (spatial // len(v))
                                     for v in (stride, padding, dilation))
        if groups == 1 and _gathered(weight) and input.dim() == spatial + 2 and not _transformed(input, weight, bias):
            return _GatheredConv.apply(input, weight, bias, stride, padding, dilation)
        if groups == 1:
            return _torch_path(f"conv{spatial}d")(input, weight, bias, stride, padding, dilation, groups)
        unbatched = input.dim() == spatial + 1
        x = _windows(input[None] if unbatched else input, list(weight.shape[2:]), dilation, padding, stride)
        x = x.unflatten(1, (groups, -1))  # (N, G, C/G, K, *out)
        w = weight.flatten(2).unflatten(0, (groups, -1))  # (G, O/G, C/G, K)
        if _gathered(weight):  # our einsum then gathers it in order, as it would the parameter
            setattr(w, _CAST_OF_GATHERED, True)
        out = torch.einsum("ngck...,gock->ngo...", x, w).flatten(1, 2)
        out = out if bias is None else out + bias.view((-1,) + (1,) * spatial)
        return out[0] if unbatched else out
    return kernel


for _spatial in (1, 2, 3):
    _lowering(f"conv{_spatial}d", family="products", why="batch", hands_back=True)(_grouped_conv(_spatial))


class _GatheredConv(torch.autograd.Function):
    """A convolution whose weight fsdp splits, gathered in order (_in_order) for the forward and again for the
    backward: torch's saved the gathered weight between the two, and XLA gathered every layer's at the program's
    start (an unrolled CNN: 2.6x the model per device, where torch_xla by hand held 1.4x)."""

    @staticmethod
    def forward(ctx, input, weight, bias, stride, padding, dilation):
        ctx.save_for_backward(input, weight)
        ctx.conv = stride, padding, dilation, bias is not None
        return torch.ops.aten.convolution(input, _in_order(input, weight, "forward"), bias, stride, padding,
                                          dilation, False, [0] * len(stride), 1)

    @staticmethod
    def backward(ctx, grad):
        (input, weight), (stride, padding, dilation, bias) = ctx.saved_tensors, ctx.conv
        weight = _in_order(grad, weight, "backward")
        return *torch.ops.aten.convolution_backward(
            grad, input, weight, weight.shape[:1] if bias else None, stride, padding, dilation, False,
            [0] * len(stride), 1, ctx.needs_input_grad[:3]), None, None, None


_MHA_SIGNATURE = inspect.signature(torch.nn.functional.multi_head_attention_forward)


@_lowering("multi_head_attention_forward", family="attention", why="batch", functional=True)
def _xla_attention(*args, **kwargs):  # torch's (T, B, E) layout in and out, batch-first inside
    F = torch.nn.functional
    a = _MHA_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    a = types.SimpleNamespace(**a.arguments)
    query, key, value, heads = a.query, a.key, a.value, a.num_heads
    if (query.device.type != "xla" or query.dim() != 3 or a.bias_k is not None or a.add_zero_attn
            or a.static_k is not None or a.static_v is not None or (a.is_causal and a.attn_mask is None)):
        return _torch_path("multi_head_attention_forward")(*args, **kwargs)  # unbatched, rare options, its error
    (t, b, _), s = query.shape, key.shape[0]
    weights = ((a.q_proj_weight, a.k_proj_weight, a.v_proj_weight) if a.use_separate_proj_weight
               else a.in_proj_weight.chunk(3))
    biases = (None,) * 3 if a.in_proj_bias is None else a.in_proj_bias.chunk(3)
    q, k, v = (F.linear(x.transpose(0, 1), w, bias).unflatten(-1, (heads, -1)).transpose(1, 2)
               for x, w, bias in zip((query, key, value), weights, biases))  # (B, heads, T or S, head dim)
    mask = F._canonical_mask(mask=a.attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                             target_type=q.dtype, check_other=False)
    mask = mask.view(b, heads, t, s) if mask is not None and mask.dim() == 3 else mask
    pad = F._canonical_mask(mask=a.key_padding_mask, mask_name="key_padding_mask", target_type=q.dtype,
                            other_type=F._none_or_dtype(a.attn_mask), other_name="attn_mask")
    if pad is not None:
        mask = pad.view(b, 1, 1, s) if mask is None else mask + pad.view(b, 1, 1, s)
    dropout = a.dropout_p if a.training else 0.0
    if a.need_weights:  # as torch: scores scaled before the product, weights returned after dropout
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        probs = torch.softmax(scores if mask is None else scores + mask, -1)
        probs = F.dropout(probs, dropout) if dropout > 0 else probs
        out, probs = probs @ v, probs.mean(1) if a.average_attn_weights else probs
    else:
        out, probs = F.scaled_dot_product_attention(q, k, v, mask, dropout), None
    out = F.linear(out.transpose(1, 2).flatten(2), a.out_proj_weight, a.out_proj_bias)
    return out.transpose(0, 1), probs


@_lowering("embedding_bag", family="attention", why="cpu", functional=True)
def _xla_embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
                       mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
                       padding_idx=None):
    """(B, L) bags as an embedding and a reduction over L; 1-D indices with offsets as a reduction over a fixed
    number of bags, each index's bag the count of the bags' starts up to it (a scatter of ones and a cumulative sum):
    sums and means an index_add, maxima a scatter_reduce. torch flattens (B, L) bags into offsets for aten's
    embedding_bag, which torch_xla runs on the CPU (two transfers a step, and the batch came back whole). max_norm,
    sparse, and whatever torch refuses (it checks before its own kernel runs) take torch's path; offsets that do not
    start at 0 or decrease (torch's CPU kernel reads them on the host to refuse them) are not checked."""
    bags = input.dim() == 2 and offsets is None or (
        input.dim() == 1 and isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and _is_xla(offsets.device)
        and offsets.dtype in (torch.int32, torch.int64) and len(offsets) > include_last_offset)
    if not (_is_xla(input.device) and bags and max_norm is None and not sparse
            and not input.is_nested and not input.is_floating_point() and weight.dim() == 2
            and mode in ("sum", "mean", "max") and not (mode == "max" and scale_grad_by_freq)
            and (per_sample_weights is None or mode == "sum" and per_sample_weights.shape == input.shape)
            and (padding_idx is None or -len(weight) <= padding_idx < len(weight))):
        return _torch_path("embedding_bag")(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq, mode,
                                            sparse, per_sample_weights, include_last_offset, padding_idx)
    rows = torch.nn.functional.embedding(input, weight, scale_grad_by_freq=scale_grad_by_freq)  # (..., L, E)
    keep = torch.ones_like(input, dtype=torch.bool) if padding_idx is None else input != padding_idx % len(weight)
    weights = keep.to(rows.dtype) if per_sample_weights is None else per_sample_weights * keep
    if input.dim() == 2:
        if mode == "max":  # an empty bag is zeros, as torch's
            return rows.masked_fill(~keep[..., None], -math.inf).amax(1).where(keep.any(1, keepdim=True), 0)
        total = (rows * weights[..., None]).sum(1)
        return total / keep.sum(1, keepdim=True).clamp(min=1).to(rows.dtype) if mode == "mean" else total
    n, count = len(offsets), len(offsets) - include_last_offset  # include_last_offset: indices past its end dropped
    starts = torch.zeros(len(input) + 1, dtype=torch.long, device=input.device).index_add(
        0, offsets.long().clamp(0, len(input)), torch.ones_like(offsets, dtype=torch.long))
    bag = starts.cumsum(0)[:-1] - 1  # (L,): each index's bag, in [0, n)
    size = torch.zeros(n, dtype=rows.dtype, device=input.device).index_add(0, bag, keep.to(rows.dtype))[:count, None]
    if mode == "max":
        peak = rows.new_full((n, rows.shape[1]), -math.inf).scatter_reduce(
            0, bag[:, None].expand(rows.shape), rows.masked_fill(~keep[:, None], -math.inf), "amax")
        return peak[:count].where(size > 0, 0)
    total = rows.new_zeros((n, rows.shape[1])).index_add(0, bag, rows * weights[:, None])[:count]
    return total / size.clamp(min=1) if mode == "mean" else total

# --- 7d. lowerings: norms, pointwise ops and masks ------------------------------------------------
# torch_xla's layer_norm, training batch_norm (so instance_norm) and group_norm are one op over the batch (a GroupNorm
# conv net ran 0.32-0.61 of its convolutions per device): ours reduce over the normalized dims, with eager's unbiased
# running variance. glu, channel_shuffle, cross and rrelu ran on the CPU; for XLA tensors autograd differentiates the
# ops ours are made of (cross: below autograd, torch's derivative). kl_div: torch's decomposition (torch_xla's kernel
# warned "an autograd kernel was not registered"). x[mask] = v: a where. roll of an empty tensor killed the process.
# Slices (family views, issue 61): torch's bounds where torch_xla refused them, 50 lines over the budget.
# TODO(remove when torch_xla's slice clamps its bounds as torch's)


def _statistics(x, dims, eps):
    """(x in the computation dtype, its mean over `dims`, 1 / sqrt(var + eps)), as torch's kernels compute them."""
    x = x.to(_computation_dtype(x))
    var, mean = torch.var_mean(x, dims, correction=0, keepdim=True)  # one op on XLA (as mean, square, mean: 4)
    return x, mean, torch.rsqrt(var + eps)


def _normalized(x, dims, eps):
    x, mean, rstd = _statistics(x, dims, eps)
    return (x - mean) * rstd


def _affine(y, weight, bias, shape, dtype):
    # A view only where the shapes differ: each op traced costs ~20-50 us a call on every step
    y = y if weight is None else y * (weight if weight.shape == shape else weight.view(shape))
    return (y if bias is None else y + (bias if bias.shape == shape else bias.view(shape))).to(dtype)


@_lowering("layer_norm", family="norms", why="batch", hands_back=True)
def _xla_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    shape = tuple(normalized_shape)
    if not shape or input.dim() < len(shape) or input.shape[-len(shape):] != shape or any(
            t is not None and t.shape != shape for t in (weight, bias)):  # torch's error
        return _torch_path("layer_norm")(input, normalized_shape, weight, bias, eps, cudnn_enable)
    dims = tuple(range(-len(shape), 0))
    if _transformed(input, weight, bias):
        return _affine(_normalized(input, dims, eps), weight, bias, shape, input.dtype)
    return _LayerNorm.apply(input, dims, weight, bias, eps)[0]


class _LayerNorm(torch.autograd.Function):
    """Layer norm by reductions over the normalized dims, with torch's compact backward (left to autograd, a 24-block
    GPT compiled in 1.2-1.3x the hand-written loop's time). The mean and 1/std are outputs, saved by setup_context as
    torch's kernel saves them; a backward that builds a graph recomputes them, so their derivatives are in it."""

    @staticmethod
    def forward(input, dims, weight, bias, eps):
        x, mean, rstd = _statistics(input, dims, eps)
        return _affine((x - mean) * rstd, weight, bias, x.shape[x.dim() - len(dims):], input.dtype), mean, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, ctx.dims, weight, bias, ctx.eps = inputs
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(input, weight, *output[1:])
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad, *_):
        input, weight, mean, rstd = ctx.saved_tensors
        x, dims = input.to(_computation_dtype(input)), ctx.dims
        if torch.is_grad_enabled():
            x, mean, rstd = _statistics(input, dims, ctx.eps)
        normed, grad = (x - mean) * rstd, grad.to(x.dtype)
        outer = tuple(range(grad.dim() - len(dims)))
        g = grad if weight is None else grad * weight
        dx = rstd * (g - g.mean(dims, keepdim=True) - normed * (g * normed).mean(dims, keepdim=True))
        dw = None if weight is None else (grad * normed).sum(outer).to(weight.dtype)
        db = None if ctx.bias_dtype is None else grad.sum(outer).to(ctx.bias_dtype)
        return dx.to(input.dtype), None, dw, db, None


@_lowering("group_norm", family="norms", why="batch", hands_back=True)
def _xla_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    channels = input.shape[1:2]
    if input.dim() < 2 or num_groups <= 0 or channels[0] % num_groups or any(
            t is not None and t.shape != channels for t in (weight, bias)):
        return _torch_path("group_norm")(input, num_groups, weight, bias, eps, cudnn_enabled)  # torch's error
    y = _normalized(input.unflatten(1, (num_groups, -1)).flatten(2), -1, eps).view(input.shape)
    return _affine(y, weight, bias, (-1,) + (1,) * (input.dim() - 2), input.dtype)


@_lowering("batch_norm", family="norms", why="batch", hands_back=True)
def _xla_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    stats, channels = running_mean is not None and running_var is not None, input.shape[1:2]
    if input.numel() == 0 or input.dim() < 2 or stats and not running_mean.shape == running_var.shape == channels:
        return _torch_path("batch_norm")(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                         cudnn_enabled)  # torch's answer, or its error
    dims, shape = [0, *range(2, input.dim())], (-1,) + (1,) * (input.dim() - 2)
    x = input.to(_computation_dtype(input))
    if stats and not training:  # torch_xla's eval batch_norm raised in its backward ("The size of mean should be ...")
        y = (x - running_mean.view(shape).to(x.dtype)) * torch.rsqrt(running_var.view(shape).to(x.dtype) + eps)
        return _affine(y, weight, bias, shape, input.dtype)
    torch.nn.functional._verify_batch_size(input.size())
    mean = x.mean(dims)
    centred = x - mean.view(shape)
    var = centred.square().mean(dims)
    if running_mean is not None:  # as eager: the unbiased variance
        n = input.numel() // input.shape[1]
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * (n / max(n - 1, 1))).to(running_var.dtype), alpha=momentum)
    return _affine(centred * torch.rsqrt(var + eps).view(shape), weight, bias, shape, input.dtype)


@_lowering("glu", family="pointwise", why="cpu")
def _xla_glu(input, dim=-1):  # torch_xla ran glu's backward on the CPU
    _torch_checks("glu", input, dim)
    first, second = input.chunk(2, dim)
    return first * torch.sigmoid(second)


@_lowering("channel_shuffle", family="pointwise", why="cpu")
def _xla_channel_shuffle(input, groups):  # torch_xla ran it on the CPU
    _torch_checks("channel_shuffle", input, groups)
    return torch.ops.aten.native_channel_shuffle(input, groups)


@_lowering("kl_div", family="pointwise", why="cpu", hands_back=True)
def _xla_kl_div(input, target, reduction=1, *, log_target=False):
    return _torch_path("kl_div")(input, target, reduction, log_target=log_target)


@_lowering("index_put_", family="masks", why="cpu")
def _xla_index_put_(self, indices, values, accumulate=False):
    """self[mask] = values, as a where: the selection's shape depends on the mask's values (torch_xla ran nonzero on
    the CPU, and compiled a graph per count: Rprop's step, 15-30 graphs a step), a where's does not. Other forms go to
    _index_put_impl_, all that index_put_'s own kernel calls (torch's path, its errors included)."""
    where = _masked_where(self, indices, values, accumulate)
    if where is None:
        return torch.ops.aten._index_put_impl_(self, indices, values, accumulate)
    return self.copy_(where)


@_lowering("index_put", family="masks", why="cpu")
def _xla_index_put(self, indices, values, accumulate=False):
    where = _masked_where(self, indices, values, accumulate)
    return torch.ops.aten.index_put_(self.clone(), indices, values, accumulate) if where is None else where


def _masked_where(self, indices, values, accumulate):
    """torch.where's form of index_put with one boolean mask (after any number of full slices), or None: another
    index, a value with a dim of the selected count (a value per selected element), or input torch rejects."""
    at = [i for i, index in enumerate(indices) if index is not None]
    mask = indices[at[0]] if len(at) == 1 else None
    if mask is None or mask.dtype != torch.bool or mask.dim() == 0 or values.dtype != self.dtype or (
            mask.device != self.device or values.device != self.device and values.dim()):
        return None
    k, rest = at[0], self.dim() - at[0] - mask.dim()
    selection = (*self.shape[:k], None, *self.shape[self.dim() - rest:])  # None: the count of True
    shape = (1,) * (len(selection) - values.dim()) + tuple(values.shape)
    if rest < 0 or self.shape[k:k + mask.dim()] != mask.shape or len(shape) > len(selection) or any(
            v != 1 and v != s for v, s in zip(shape, selection)):
        return None
    values = values.to(self.device).reshape(*shape[:k], *(1,) * mask.dim(), *shape[k + 1:])  # as torch: a CPU scalar
    mask = mask.reshape(*mask.shape, *(1,) * rest)
    return self + torch.where(mask, values, 0) if accumulate else torch.where(mask, values, self)


@_lowering("index_fill.int_Tensor", family="masks", why="cpu")
def _xla_index_fill(self, dim, index, value):
    """A where over a mask of the indexed places (torch_xla ran the value's gradient, which dedups the index with
    _unique, on the CPU, and refused a 0-d self); autograd's derivatives are torch's: grad where not filled, and its
    sum over the filled places."""
    dim = torch._prims_common.canonicalize_dim(self.dim(), dim)  # torch's error, where the meta kernel's is not
    _torch_checks("index_fill", self, dim, index, value)
    torch._check_index(index.dtype == torch.long, lambda: "index_fill_(): Expected dtype int64 for index.")
    n = self.shape[dim] if self.dim() else 1
    at = index.reshape(-1)
    mask = torch.zeros(n, dtype=torch.bool, device=self.device).index_fill(0, torch.where(at < 0, at + n, at), True)
    return torch.where(mask.view((n,) + (1,) * (self.dim() - dim - 1) if self.dim() else ()),
                       value.to(self.device, self.dtype), self)


@_lowering("masked_scatter_backward", family="masks", why="cpu", key="XLA")
def _xla_masked_scatter_backward(grad_output, mask, sizes):
    """The source's gradient: grad_output where mask is True, in order, in the source's first places (torch's
    masked_select, a shape of the mask's values, ran on the CPU): each scattered to the count of Trues before it."""
    shape, numel = torch.broadcast_shapes(grad_output.shape, mask.shape), math.prod(sizes)
    grad, mask = (torch.view_copy(torch.expand_copy(t, shape), (-1,)) for t in (grad_output, mask))
    at = torch.where(mask, torch.cumsum(mask, 0, dtype=torch.long) - 1, numel)  # the others past the end, dropped
    return torch.view_copy(torch.slice_copy(grad.new_zeros(numel + 1).scatter(0, at, grad), 0, 0, numel), sizes)


def _dtype_name(dtype):
    """torch's C++ name of a dtype, as its CPU kernels' messages spell it: "Float", "BFloat16", "ComplexDouble"."""
    return torch.empty(0, dtype=dtype, device="meta").type()[len("torch.meta."):-len("Tensor")]


@_lowering("linalg_cross", family="pointwise", why="cpu", key="XLA")
def _xla_linalg_cross(input, other, *, dim=-1):
    """Each factor rolled by one and by two along `dim` (torch_xla ran it on the CPU); below autograd, so torch's
    derivative (itself cross products) stays."""
    _torch_checks("linalg_cross", input, other, dim=dim)  # dims, lengths of 3, broadcasting
    torch._check(input.dtype == other.dtype, lambda: f"expected scalar type {_dtype_name(input.dtype)} but found "
                 f"{_dtype_name(other.dtype)}")  # the CPU kernel's check, which the meta kernel skips
    return input.roll(-1, dim) * other.roll(-2, dim) - input.roll(-2, dim) * other.roll(-1, dim)


@_lowering("rrelu", family="pointwise", why="cpu", hands_back=True)
def _xla_rrelu(self, lower=1 / 8, upper=1 / 3, training=False, generator=None):
    """In training each element <= 0 times a slope from uniform(lower, upper), drawn by the device's generator (as
    torch.rand on it: torch_xla's seed; torch_xla ran rrelu_with_noise on the CPU, with torch's CPU generator).
    Autograd's derivative is torch's: the slope, 1 above 0. Not training: leaky_relu at the mean slope, as torch. A
    generator of the user's goes to torch's path."""
    if generator is not None or not self.is_floating_point():
        return _torch_path("rrelu")(self, lower, upper, training, generator)
    if not training:
        return torch.nn.functional.leaky_relu(self, (lower + upper) / 2)
    return torch.where(self <= 0, self * torch.empty_like(self).uniform_(lower, upper), self)


@_lowering("rrelu_", family="pointwise", why="cpu", hands_back=True)
def _xla_rrelu_(self, lower=1 / 8, upper=1 / 3, training=False, generator=None):
    if generator is not None or not self.is_floating_point():
        return _torch_path("rrelu_")(self, lower, upper, training, generator)
    return self.copy_(_xla_rrelu(self, lower, upper, training))


@_lowering("roll", family="pointwise", why="crash", key="XLA")
def _xla_roll(self, shifts, dims=()):
    """torch_xla 2.9's roll of an empty tensor killed the process (SIGFPE: a shift modulo a size of 0); torch's is the
    empty tensor itself. Every other input: torch_xla's own kernel."""
    own = _torch_xla_path("roll")
    if self.numel() == 0:
        _torch_checks("roll", self, shifts, dims)
        return torch.clone(self)
    return own(self, shifts, dims) if own else torch.ops.aten.roll(self, shifts, dims)  # (CPU: the fast tests)


def _slice_bounds(size, dim, start, end):
    """torch's bounds of a slice of a dim of `size` whose start or end torch_xla 2.9 refused (a negative one beyond
    the size, "Value out of range": x[:, -4095:] of 16 positions): each counted from the end, then both clamped into
    [0, size], the end no lower than the start. None where torch_xla's error is torch's (no negative bound, a bad
    dim: a step, a 0-dim tensor)."""
    if not (start is not None and start < 0 or end is not None and end < 0) or not -len(size) <= dim < len(size):
        return None
    n = size[dim]
    start = 0 if start is None else min(max(start + n if start < 0 else start, 0), n)
    return start, min(max(n if end is None else end + n if end < 0 else end, start), n)


# Below functionalization every slice of an XLA tensor (x[a:b], narrow, split, a view remade after a write) is a
# slice_copy, a write through one (and torch.slice_scatter) a slice_scatter, its gradient a slice_backward: each is
# torch_xla's, again with torch's bounds where it refused them. transformers' sliding-window cache keeps the last
# window - 1 positions of fewer (x[:, :, -4095:]): Mistral, Gemma2 and Gemma3 crashed with their default config. A
# kernel in Python costs every slice ~7 us of tracing (x[:, 1:]: 7.4 us to ~14); the bounds torch_xla takes, nothing
# more (a try); one it refused, its error (~20 us).
@_lowering("slice_copy.Tensor", family="views", why="refused", key="XLA")
def _xla_slice_copy(self, dim=0, start=None, end=None, step=1):
    own = _torch_xla_path("slice_copy.Tensor") or torch.ops.aten.slice_copy.Tensor  # (CPU tensors: the fast tests)
    return _torch_bounds(own, self.shape, (self,), dim, start, end, step)


@_lowering("slice_scatter", family="views", why="refused", key="XLA")
def _xla_slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    own = _torch_xla_path("slice_scatter") or torch.ops.aten.slice_scatter.default
    return _torch_bounds(own, self.shape, (self, src), dim, start, end, step)


@_lowering("slice_backward", family="views", why="refused", key="XLA")
def _xla_slice_backward(grad, sizes, dim, start, end, step):  # the bounds the slice was given
    own = _torch_xla_path("slice_backward") or torch.ops.aten.slice_backward.default
    return _torch_bounds(own, sizes, (grad, sizes), dim, start, end, step)


def _torch_bounds(own, size, head, dim, start, end, step):
    """own(*head, dim, start, end, step), torch_xla's kernel; where it refused the bounds, with torch's."""
    try:
        return own(*head, dim, start, end, step)
    except RuntimeError:
        if (bounds := _slice_bounds(size, dim, start, end)) is None:
            raise
    return own(*head, dim, *bounds, step)

# --- 7e. lowerings: losses and reductions ---------------------------------------------------------
# Losses and reductions torch_xla ran on the CPU (a graph cut and two transfers a call: issue 49), static-shaped, below
# autograd (key XLA) where torch's derivative is made of ops XLA has; an unbatched nll_loss, which killed its process.
# Checks that would read values to the host are skipped, each named in its kernel. Budget 510 -> 585 (issue 60):
# torch.mode's index among ties is where libstdc++'s std::sort leaves it, replayed level by level (_std_sorted).


def _loss_reduced(loss, reduction, dtype):
    """reduction 0 (none), 1 (mean) or 2 (sum) of a loss computed in the computation dtype, cast to `dtype`."""
    return (loss if reduction == 0 else loss.mean() if reduction == 1 else loss.sum()).to(dtype)


def _floating_loss(kernel, input, target):
    """The computation dtype of a pointwise loss, and torch's CPU error for a dtype its kernel has no code for."""
    dtype = torch.promote_types(_computation_dtype(input), _computation_dtype(target))
    if not dtype.is_floating_point:
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_dtype_name(dtype)}\'')
    return dtype


@_lowering("nll_loss", family="losses", why="crash", hands_back=True)
def _xla_nll_loss(input, target, weight=None, reduction=1, ignore_index=-100):
    """An unbatched input (C,) with a 0-dim target is a batch of one: there torch_xla 2.9's nll_loss_forward killed
    the process (SIGSEGV), and F.cross_entropy of one sample with it. Every other input: torch's own path."""
    if input.dim() != 1 or target.dim() != 0:
        return _torch_path("nll_loss")(input, target, weight, reduction, ignore_index)
    out = _torch_path("nll_loss")(input[None], target[None], weight, reduction, ignore_index)
    return out[0] if reduction == 0 else out  # reduction "none": the one sample's loss, 0-dim as torch's


@_lowering("huber_loss", family="losses", why="cpu", key="XLA")
def _xla_huber_loss(input, target, reduction=1, delta=1.0):
    """torch's formula in the computation dtype, in the input's dtype as its CPU kernel (torch_xla ran it there);
    below autograd: torch's derivative is huber_loss_backward, the next kernel."""
    _torch_checks("huber_loss", input, target, reduction, delta)  # delta > 0, broadcasting
    dtype = _floating_loss("huber_cpu", input, target)
    distance = (input.to(dtype) - target.to(dtype)).abs()
    loss = torch.where(distance < delta, 0.5 * distance * distance, delta * (distance - 0.5 * delta))
    return _loss_reduced(loss, reduction, input.dtype)


@_lowering("huber_loss_backward", family="losses", why="cpu", key="XLA")
def _xla_huber_loss_backward(grad_output, input, target, reduction, delta):
    """torch's: the difference clamped to [-delta, delta], times the gradient (over input's numel for the mean)."""
    _torch_checks("huber_loss_backward", grad_output, input, target, reduction, delta)
    for t in (grad_output, target):  # the CPU kernel's check, which the meta kernel skips
        torch._check(t.dtype == input.dtype, lambda: f"Found dtype {_dtype_name(t.dtype)} but expected "
                     f"{_dtype_name(input.dtype)}")
    dtype = _floating_loss("huber_backward_cpu_out", input, target)
    scale = 1 / max(input.numel(), 1) if reduction == 1 else 1.0
    difference = input.to(dtype) - target.to(dtype)
    return (difference.clamp(-delta, delta) * (grad_output.to(dtype) * scale)).expand(input.shape).to(input.dtype)


def _margin_terms(input, target, p, margin, weight):
    """multi_margin_loss's terms as its CPU kernel computes them: (N, C) inputs, (N,) targets, z = margin - x[y] + x
    and where it counts (z > 0, the target's own class left out), weight[y] (or 1), and C. Targets out of range are
    not checked: torch's CPU kernel reads each one (a host read)."""
    dtype = _computation_dtype(input)
    x, classes = input.to(dtype).reshape(-1, max(input.shape[-1:] or (1,))), max(input.shape[-1:] or (1,))
    y = target.reshape(-1, 1)
    z = margin - x.gather(1, y) + x
    counts = (z > 0) & (torch.arange(classes, device=x.device) != y)
    scale = torch.ones((), dtype=dtype, device=x.device) if weight is None else weight.to(dtype).reshape(-1)[y]
    return z, counts, scale, classes


@_lowering("multi_margin_loss", family="losses", why="cpu", key="XLA")
def _xla_multi_margin_loss(input, target, p=1, margin=1, weight=None, reduction=1):
    """sum over the other classes of weight[y] * max(0, margin - x[y] + x)^p, over C; torch's derivative
    (multi_margin_loss_backward, the next kernel)."""
    _torch_checks("multi_margin_loss", input, target, p, margin, weight, reduction)
    z, counts, scale, classes = _margin_terms(input, target, p, margin, weight)
    loss = (torch.where(counts, z if p == 1 else z * z, 0) * scale).sum(1) / classes
    return _loss_reduced(loss.reshape(target.shape) if input.dim() < 2 else loss, reduction, input.dtype)


@_lowering("multi_margin_loss_backward", family="losses", why="cpu", key="XLA")
def _xla_multi_margin_loss_backward(grad_output, input, target, p, margin, weight=None, reduction=1):
    _torch_checks("multi_margin_loss", input, target, p, margin, weight, reduction)
    z, counts, scale, classes = _margin_terms(input, target, p, margin, weight)
    each = torch.where(counts, 1 if p == 1 else 2 * z, 0) * scale / classes  # d loss / d x, other classes
    grad = each.scatter_add(1, target.reshape(-1, 1), -each.sum(1, keepdim=True))  # the target's: minus their sum
    grad_output = grad_output.to(grad.dtype)
    grad = grad * (grad_output.reshape(-1, 1) if reduction == 0 and input.dim() == 2 else grad_output)
    return (grad / max(len(grad), 1) if reduction == 1 else grad).reshape(input.shape).to(input.dtype)


def _multilabel_terms(input, target):
    """multilabel_margin_loss's terms, as its CPU kernel: (N, K, C) z = 1 - x[y_k] + x where it counts (y_k before the
    first -1, x's class not among those targets, z > 0), the targets as classes (is_target), and C."""
    dtype, classes = _computation_dtype(input), max(input.shape[-1:] or (1,))
    x, y = input.to(dtype).reshape(-1, classes), target.reshape(-1, classes)
    valid = (y < 0).cumsum(1) == 0  # the targets before the first -1 (torch_xla ran an integer cumprod on the CPU)
    y = torch.where(valid, y, 0)
    is_target = torch.zeros_like(x).scatter_add(1, y, valid.to(dtype)) > 0
    z = 1 - x.gather(1, y)[:, :, None] + x[:, None, :]
    return z, valid[:, :, None] & ~is_target[:, None, :] & (z > 0), y, is_target, classes


@_lowering("multilabel_margin_loss_forward", family="losses", why="cpu", key="XLA")
def _xla_multilabel_margin_loss_forward(input, target, reduction):
    """(loss, is_target): for each target before the first -1, the hinge to each class that is not a target, over
    C; torch's derivative (multilabel_margin_loss_backward, the next kernel)."""
    _torch_checks("multilabel_margin_loss_forward", input, target, reduction)
    z, counts, _, is_target, classes = _multilabel_terms(input, target)
    loss = torch.where(counts, z, 0).sum((1, 2)) / classes
    loss = _loss_reduced(loss.reshape(input.shape[:-1]), reduction, input.dtype)
    return loss, is_target.to(input.dtype).reshape(input.shape)


@_lowering("multilabel_margin_loss_backward", family="losses", why="cpu", key="XLA")
def _xla_multilabel_margin_loss_backward(grad_output, input, target, reduction, is_target):
    _torch_checks("multilabel_margin_loss_forward", input, target, reduction)
    z, counts, y, _, classes = _multilabel_terms(input, target)
    counts = counts.to(z.dtype) / classes
    grad = counts.sum(1).scatter_add(1, y, -counts.sum(2))  # + for each class below a target, - for the target
    grad_output = grad_output.to(grad.dtype)
    grad = grad * (grad_output.reshape(-1, 1) if reduction == 0 and input.dim() == 2 else grad_output)
    return (grad / max(len(grad), 1) if reduction == 1 else grad).reshape(input.shape).to(input.dtype)


@_lowering("searchsorted.Tensor", "searchsorted.Scalar", family="reductions", why="cpu", key="XLA")
def _xla_searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    """A binary search in halving steps, log2(n) gathers (torch_xla ran it on the CPU), with torch's comparisons."""
    torch._check(not (side == "left" and right), lambda: "torch.searchsorted(): side and "
                 f"right can't be set to opposites, got side of {side} while right was {right}")  # the meta raises
    _torch_checks("searchsorted", sorted_sequence, self, out_int32=out_int32, right=right, side=side, sorter=sorter)
    return _searched(sorted_sequence, self, right or side == "right", sorter, out_int32)


@_lowering("bucketize.Tensor", "bucketize.Scalar", family="reductions", why="cpu", key="XLA")
def _xla_bucketize(self, boundaries, *, out_int32=False, right=False):
    _torch_checks("bucketize", self, boundaries, out_int32=out_int32, right=right)
    return _searched(boundaries, self, right, None, out_int32)


def _searched(boundaries, values, right, sorter, out_int32):
    """torch's binary search (its probes, so its answer for unsorted boundaries or NaN ones too) in bit_length(n)
    steps of a gather each, over each row's boundaries or the 1-D ones: the first not b < v (right: not b <= v)."""
    if not isinstance(values, torch.Tensor):  # a Scalar: torch's scalar_to_tensor
        values = torch.tensor(values, dtype=torch.float64 if isinstance(values, float) else None,
                              device=boundaries.device)
    dtype = torch.promote_types(boundaries.dtype, values.dtype)  # as torch's kernels compare
    start, n = torch.zeros(values.shape, dtype=torch.int64, device=values.device), boundaries.shape[-1]
    steps = n.bit_length() if boundaries.numel() and values.numel() else 0  # else 0 for each value (XLA's gather
    if steps:  # of an empty tensor raised)
        boundaries = (boundaries if sorter is None else boundaries.gather(-1, sorter)).to(dtype)
        values, end = values.to(dtype), torch.full_like(start, n)
    for _ in range(steps):  # each step at least halves end - start
        middle = start + (end - start) // 2
        index = middle.clamp(max=n - 1)
        b = (boundaries.gather(-1, index) if boundaries.dim() > 1  # not boundaries[index]: a 0-dim one is an .item()
             else boundaries.index_select(0, index.view(-1)).view(index.shape))
        after = (start < end) & ~(b > values if right else b >= values)
        start, end = torch.where(after, middle + 1, start), torch.where(after | (start >= end), end, middle)
    return start.to(torch.int32) if out_int32 else start


@_lowering("gaussian_nll_loss", family="losses", why="cpu", functional=True)
def _xla_gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    """torch's F.gaussian_nll_loss less its check of a var tensor on XLA, `torch.any(var < 0)`: a host read at each
    call (a graph cut and a transfer a step). The check runs under torch.autograd.detect_anomaly(), torch's debug
    mode, which reads values at each backward anyway (torch's own value checks, torch._check, are skipped in compiled
    code); without it a negative variance is clamped to eps, as a small one is, and nothing raises."""
    if not (isinstance(var, torch.Tensor) and _is_xla(var.device)) or torch.is_anomaly_enabled() or (
            torch.overrides.has_torch_function_variadic(input, target, var)):
        return _torch_path("gaussian_nll_loss")(input, target, var, full, eps, reduction)
    if var.shape != input.shape:  # torch's: var one dim short (homoscedastic), or of size 1 in the last
        if input.shape[:-1] == var.shape:
            var = var.unsqueeze(-1)
        elif not (input.shape[:-1] == var.shape[:-1] and var.shape[-1:] == (1,)):
            raise ValueError("var is of incorrect size")
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    var = var.clone()
    with torch.no_grad():
        var.clamp_(min=eps)  # as torch: the gradient goes through the clamp unchanged
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var) + (0.5 * math.log(2 * math.pi) if full else 0)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


@_lowering("ctc_loss.IntList", "ctc_loss.Tensor", family="losses", why="cpu", hands_back=True)
def _xla_ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, reduction=1, zero_infinity=False):
    """The CTC forward (alpha) recursion in log space over each target with blanks interleaved (torch_xla ran
    _ctc_loss and its backward on the CPU), in plain ops: autograd's derivative. Over T, one XLA While (torch_xla's
    scan, whose backward is another: a second derivative raises, as torch's). Lengths never go to the host: a
    sample's alphas stop changing past its input length. Inputs torch rejects go to its own path and error; lengths
    as tensors skip the checks of their values (a host read: lengths past T or the targets are clamped, not raised
    on)."""
    tensors = isinstance(input_lengths, torch.Tensor)
    if not _ctc_fits(log_probs, targets, input_lengths, target_lengths, blank):
        return _torch_path("ctc_loss.Tensor" if tensors else "ctc_loss.IntList")(
            log_probs, targets, input_lengths, target_lengths, blank, reduction, zero_infinity)
    lp = log_probs if log_probs.dim() == 3 else log_probs.unsqueeze(1)
    (steps, n, _), device = lp.shape, lp.device
    il, tl = (torch.as_tensor(x, device=device).reshape(-1).long() for x in (input_lengths, target_lengths))
    targets = targets.to(device, torch.long)
    width = max(target_lengths, default=0) if not tensors else targets.shape[-1] if targets.dim() == 2 else (
        targets.numel())  # the longest target, or a bound of it that needs no host read (concatenated targets with
    # tensor lengths: all of them, so T x N x 2 x the total length of alphas; padded targets cost T x N x 2 x S)
    if targets.dim() == 1:  # concatenated: each sample's targets from the sum of the lengths before it
        at = (tl.cumsum(0) - tl)[:, None] + torch.arange(width, device=device)
        targets = targets[at.clamp(0, max(targets.numel() - 1, 0))] if targets.numel() else at
    labels = torch.where(torch.arange(width, device=device) < tl[:, None], targets[:, :width], blank)
    size, pad = 2 * width + 1, torch.nn.functional.pad
    extended = pad(torch.stack([torch.full_like(labels, blank), labels], 2).view(n, 2 * width), (0, 1), value=blank)
    skip = extended != pad(extended, (2, 0))[:, :size]  # torch's l'[s] != l'[s - 2] (below s = 2, alpha is -inf)
    emitted = lp.gather(2, extended.expand(steps, n, size))
    active = torch.arange(steps, device=device)[:, None] < il
    alpha = pad(lp.new_zeros(n, 1), (0, size - 1), value=-math.inf)  # before t = 0: as if from s = -1
    xs = (emitted, active[:, :, None], skip.expand(steps, n, size))
    looped = steps and _is_xla(lp.device) and not _transformed(lp)
    if looped:  # its body compiled once, whatever T (unrolled, T=50 took 60-90 s to compile on XLA:CPU, against 1)
        xs = (_NotTwice.apply(emitted), *xs[1:])
        alpha = _import("torch_xla.experimental.scan").scan(_ctc_step, alpha, xs, is_fn_pure=True)[0]
    for t in range(0 if looped else steps):  # under torch.func (and on CPU tensors) the graph holds T steps
        alpha = _ctc_step(alpha, [x[t] for x in xs])[0]
    end = (2 * tl).clamp(max=2 * width)[:, None]
    before = torch.where(end > 0, alpha.gather(1, (end - 1).clamp(min=0)), -math.inf)
    loss = -_log_sum_exp(torch.stack([alpha.gather(1, end), before]))[:, 0]
    # torch's derivative is exp(log_probs) - the posterior, that of the logits under a log_softmax (which takes the
    # exp term back out): a term of value 0 with that gradient, over each sample's input length
    p = lp.exp()
    loss = loss + torch.where(active[:, :, None], p - p.detach(), 0).sum((0, 2))
    loss = torch.where(loss == math.inf, 0, loss) if zero_infinity else loss  # and its gradient
    if reduction == 1:
        return (loss / tl.clamp(min=1).to(loss.dtype)).mean()
    return loss.sum() if reduction == 2 else loss if log_probs.dim() == 3 else loss[0]


class _NotTwice(torch.autograd.Function):
    """x; its gradient, built with a graph (create_graph), raises if differentiated: scan's backward is not
    differentiable, and a second derivative without its share would be silently wrong (torch's raises too)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not torch.is_grad_enabled():
            return grad
        x, = ctx.saved_tensors  # x[..., :0].sum(): a 0 with a graph (scan's gradient has none)
        raises = torch._C._functions.DelayedError("seamless_tpu: no second derivative of ctc_loss (torch_xla's scan "
                                                  "runs its recursion; torch's has none either)", 1)
        return raises(grad + x[..., :0].sum())


def _ctc_step(alpha, x):
    """The alphas at one step from the last: staying, from s - 1, from s - 2 where l'[s] != l'[s - 2]; a sample
    past its input length keeps them."""
    emitted, active, skip = x
    one, two = (torch.nn.functional.pad(alpha, (k, 0), value=-math.inf)[:, :alpha.shape[1]] for k in (1, 2))
    came = _log_sum_exp(torch.stack([alpha, one, torch.where(skip, two, -math.inf)]))
    return torch.where(active, came + emitted, alpha), None


def _log_sum_exp(x):
    """logsumexp over dim 0 with a zero gradient (not NaN) where all are -inf, and NaN kept (torch's logsumexp
    derivative, exp(x - result), is NaN there; XLA's max drops NaN on the CPU)."""
    high = x.detach().amax(0)
    high = torch.where(high.isfinite(), high, 0)
    total = torch.exp(x - high).sum(0)
    return torch.where(total == 0, -math.inf, torch.log(torch.where(total == 0, 1, total)) + high)


def _ctc_fits(log_probs, targets, input_lengths, target_lengths, blank):
    """Whether torch takes these inputs: its checks of shapes, dtypes and blank, and of list lengths' values."""
    n = log_probs.shape[1] if log_probs.dim() == 3 else 1
    if not (log_probs.dtype in (torch.float32, torch.float64) and log_probs.dim() in (2, 3) and targets.dim() in (1, 2)
            and 0 <= blank < log_probs.shape[-1] and (targets.dim() == 1 or targets.shape[0] == n)):
        return False
    if isinstance(input_lengths, torch.Tensor):
        return all(t.numel() == n and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
                   for t in (input_lengths, target_lengths))
    return len(input_lengths) == len(target_lengths) == n and all(0 <= i <= len(log_probs) for i in input_lengths) and (
        min(target_lengths, default=0) >= 0) and (sum(target_lengths) == len(targets) if targets.dim() == 1 else
                                                  max(target_lengths, default=0) <= targets.shape[1])


def _prefix_scan(x, dim, combine, identity=None):
    """combine(x[..i], x[..i-step]) over log2(n) steps, a parallel prefix of an associative `combine`: positions below
    each step are combined with `identity` (None: with themselves, for an idempotent one). Copies, not views (the
    kernels below autograd)."""
    n, step = x.shape[dim], 1
    while step < n:
        head = torch.narrow_copy(x, dim, 0, step)
        head = head if identity is None else torch.full_like(head, identity)
        x, step = combine(x, torch.cat([head, torch.narrow_copy(x, dim, 0, n - step)], dim)), 2 * step
    return x


@_lowering("_logcumsumexp", family="reductions", why="cpu", key="XLA")
def _xla_logcumsumexp(self, dim):
    """A parallel prefix: log2(n) steps, each the log-add-exp of the partial results and themselves shifted by a
    power of two (torch_xla ran it on the CPU, and its logaddexp too). Below autograd: torch's derivative."""
    dim = _wrapped_dim(self, dim)
    if not (self.is_floating_point() or self.is_complex()):
        raise NotImplementedError(f'"logcumsumexp_out_cpu" not implemented for \'{_dtype_name(self.dtype)}\'')
    if self.is_complex():  # as before, on the CPU: torch's complex special cases, for a rare input
        return torch.ops.aten._logcumsumexp(self.cpu(), dim).to(self.device)
    x = self.to(_computation_dtype(self)).reshape(self.shape or (1,))
    return _prefix_scan(x, dim, _log_add_exp, identity=-math.inf).view(self.shape).to(self.dtype)


def _log_add_exp(x, y):
    """log(exp(x) + exp(y)) as torch's logcumsumexp kernel computes it: NaN kept; two equal infinities, x. XLA's
    minimum and maximum drop NaN on the CPU (a NaN then vanished from the running sum), so it is kept apart."""
    low, high = torch.minimum(x, y), torch.maximum(x, y)
    out = torch.where((low != high) | low.isfinite(), torch.log1p(torch.exp(low - high)) + high, x)
    return torch.where(x.isnan() | y.isnan(), x + y, out)


def _wrapped_dim(self, dim):
    """dim in [0, self.dim()) (a 0-dim tensor's: 0), or torch's IndexError."""
    torch.empty(self.shape or (1,), device="meta").size(dim)
    return dim % max(self.dim(), 1)


def _sorted_along(self, dim, op, kernel, rows_sorted=None):
    """(x, dim, its values sorted stably, their indices) with x = self (a 0-dim one as 1-D), and torch's errors: a dim
    out of range or of size 0, a dtype its CPU `kernel` has no code for. rows_sorted((R, n) rows): another order."""
    dim = _wrapped_dim(self, dim)
    x = self.reshape(self.shape or (1,))
    torch._check_index(x.shape[dim] > 0, lambda: f"{op}(): Expected reduction dim {dim} to have non-zero size.")
    if (self.is_complex() or self.dtype == torch.bool and op != "mode") and self.dim() and self.numel():
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_dtype_name(self.dtype)}\'')
    if rows_sorted is None:
        return (x, dim, *x.sort(dim=dim, stable=True))  # NaN last, ties in their order
    rows = x.movedim(dim, -1)
    values, indices = rows_sorted(rows.reshape(-1, rows.shape[-1]))
    return (x, dim, *(t.view(rows.shape).movedim(-1, dim) for t in (values, indices)))


def _std_sorted(x, scanned):
    """x's rows (R, n) as libstdc++'s std::sort leaves them, comparing values alone: torch's CPU mode kernel, whose
    ties past 16 values land where its introsort puts them. Its partitions, every segment of a level at once
    (_introsort_level), on the values' ranks, then its final insertion sort: a stable sort of what they left.
    (values, indices). `scanned`: the levels as one XLA While (torch_xla's scan, which carries floats only: ranks
    and positions exact below 2**24), compiled once (22 unrolled levels of 3000 values took 55-70 s on XLA:CPU,
    against 4-7 s scanned, on 2 loaded cores). A row that reaches the depth limit (2 log2 n levels of lopsided
    pivots) is heapsorted by libstdc++, stably here; NaN, not ordered, leaves std::sort's order undefined."""
    rows, n = x.shape
    values, perm = x.sort(dim=1, stable=True)
    scanned = scanned and 16 < n < 2 ** 24
    dtype = torch.float32 if scanned else torch.long
    groups = torch.cat([values.new_zeros((rows, 1), dtype=torch.bool), values[:, 1:] != values[:, :-1]], 1)
    rank = torch.empty_like(perm, dtype=dtype).scatter(1, perm, groups.to(dtype).cumsum(1))  # equal values, one rank
    pos = torch.arange(n, device=x.device).expand(rows, n)
    carry, levels = (rank, pos.to(dtype), (pos == 0).to(dtype)), 2 * int(math.log2(n)) if n > 16 else 0
    if scanned:
        carry = _import("torch_xla.experimental.scan").scan(_introsort_level, carry, torch.zeros(
            levels, device=x.device), is_fn_pure=True)[0]
    for _ in range(0 if scanned else levels):
        carry = _introsort_level(carry, None)[0]
    rank, order, _ = carry
    indices = order.gather(1, rank.sort(dim=1, stable=True).indices).long()
    return x.gather(1, indices), indices


def _introsort_level(carry, _):
    """One level of libstdc++'s introsort loop on every segment longer than 16: the median of its second, middle and
    last values swapped to its front as the pivot, then Hoare's scans, whose k-th stops from the left and from the
    right swap while in that order; it splits where the left scan stopped last. carry: (ranks, original positions,
    1 where a segment starts), in one dtype."""
    rank, order, start = carry
    rows, n = rank.shape
    pos = torch.arange(n, device=rank.device).expand(rows, n)
    seg = start.cumsum(1).long() - 1  # each position's segment, and its bounds (XLA's cummax crashed on 3000)
    starts = torch.full((rows, n + 1), n, device=rank.device).scatter(1, torch.where(start > 0, seg, n), pos)
    first, last = starts.gather(1, seg), starts.gather(1, seg + 1)
    live = last - first > 16  # shorter segments wait for the final insertion sort
    a, b, c = first + 1, first + (last - first) // 2, last - 1
    va, vb, vc = (rank.gather(1, p.clamp(max=n - 1)) for p in (a, b, c))
    median = torch.where(va < vb, torch.where(vb < vc, b, torch.where(va < vc, c, a)),
                         torch.where(va < vc, a, torch.where(vb < vc, c, b)))
    swap = torch.where(live & (pos == first), median, torch.where(live & (pos == median), first, pos))
    rank = rank.gather(1, swap)
    pivot, inner = rank.gather(1, first), live & (pos > first)
    left, right = inner & ~(rank < pivot), inner & ~(pivot < rank)  # where the two scans stop
    lsum, rsum = left.long().cumsum(1), right.long().cumsum(1)
    lrank, ltotal = lsum - lsum.gather(1, first), lsum.gather(1, c) - lsum.gather(1, first)
    rtotal = rsum.gather(1, c) - rsum.gather(1, first)
    lslot = torch.where(left, first + lrank - 1, n)  # a scan's k-th stop at slot first + k - 1
    rslot = torch.where(right, first + rtotal - rsum + rsum.gather(1, first), n)
    lpos = torch.full((rows, n + 1), n, device=rank.device).scatter(1, lslot, pos)
    rpos = torch.full((rows, n + 1), -1, device=rank.device).scatter(1, rslot, pos)
    lpartner, rpartner = rpos.gather(1, lslot), lpos.gather(1, rslot)  # -1 or n: none
    lswap, rswap = left & (lpartner > pos), right & (rpartner < pos)
    src = torch.where(lswap, lpartner, torch.where(rswap, rpartner, pos))
    k = torch.zeros((rows, n + 1), dtype=torch.long, device=rank.device).scatter_add(
        1, torch.where(lswap, first, n), torch.ones_like(pos)).gather(1, first)  # the segment's swaps
    cut = torch.minimum(torch.where(k < ltotal, lpos.gather(1, first + k), n),
                        torch.where(k > 0, rpos.gather(1, (first + k - 1).clamp(min=0)), last))
    return (rank.gather(1, src), order.gather(1, swap.gather(1, src)),
            torch.maximum(start, (live & (pos == cut)).to(start.dtype))), None


def _reduced(self, dim, keepdim, *outputs):
    shape = list(self.shape)
    if shape:
        shape[dim:dim + 1] = [1] if keepdim else []
    return tuple(t.reshape(shape) for t in outputs)


def _median(self, dim, keepdim, ignore_nan, kernel="median_out"):
    """The lower median and its index: the ((n - 1) // 2)-th of a stable sort (NaN last): of the values not NaN for
    nanmedian (an all-NaN row: the first), the first NaN for median, as torch's CPU kernel picks them."""
    x, dim, values, indices = _sorted_along(self, dim, "median", kernel)
    n, nans = x.shape[dim], x.isnan().sum(dim, keepdim=True)
    k = ((n - nans - 1) // 2).clamp(min=0) if ignore_nan else torch.where(nans > 0, n - nans, (n - 1) // 2)
    return _reduced(self, dim, keepdim, values.gather(dim, k), indices.gather(dim, k))


@_lowering("median.dim", family="reductions", why="cpu", key="XLA")
def _xla_median_dim(self, dim, keepdim=False):
    """A stable sort and a gather (torch_xla ran median and nanmedian on the CPU); torch's derivative, by index."""
    return _median(self, dim, keepdim, ignore_nan=False)


@_lowering("nanmedian.dim", family="reductions", why="cpu", key="XLA")
def _xla_nanmedian_dim(self, dim, keepdim=False):
    return _median(self, dim, keepdim, ignore_nan=True)


@_lowering("median", family="reductions", why="cpu", key="XLA")
def _xla_median(self):
    return _median(self.reshape(-1), 0, False, ignore_nan=False, kernel="median_cpu")[0] if self.numel() else (
        _no_median(self))


@_lowering("nanmedian", family="reductions", why="cpu", key="XLA")
def _xla_nanmedian(self):
    return _median(self.reshape(-1), 0, False, ignore_nan=True, kernel="median_cpu")[0] if self.numel() else (
        _no_median(self))


def _no_median(self):
    """torch's median of no values: NaN, in an integer dtype as the CPU casts it (the lowest value)."""
    nan = math.nan if self.is_floating_point() or self.is_complex() else torch.iinfo(self.dtype).min
    return torch.full((), nan, dtype=self.dtype, device=self.device)


@_lowering("mode", family="reductions", why="cpu")
def _xla_mode(self, dim=-1, keepdim=False):
    """The value of the longest run of the values sorted as torch's CPU kernel sorts them (_std_sorted), the smallest
    such, and the index its run ends with, as that kernel picks them (a stable sort's last occurrence was its answer
    up to 16 values only); the value is the input gathered there, whose derivative is torch's (the gradient to the
    index). The runs are counted by a scatter_add: XLA's cummax (of their starts) crashed the process on 3000 int64s."""
    with torch.no_grad():
        x, dim, values, indices = _sorted_along(self.detach(), dim, "mode", "mode_cpu", functools.partial(
            _std_sorted, scanned=_is_xla(self.device) and not _transformed(self)))
        new = torch.narrow_copy(values, dim, 1, x.shape[dim] - 1) != torch.narrow_copy(values, dim, 0,
                                                                                        x.shape[dim] - 1)
        first = torch.zeros_like(values.narrow(dim, 0, 1), dtype=torch.bool)
        run = torch.cat([first, new], dim).long().cumsum(dim)  # each element's run
        length = torch.zeros_like(run).scatter_add(dim, run, torch.ones_like(run))  # of each run
        best = length.argmax(dim, keepdim=True)  # the first longest: the smallest value
        index = indices.gather(dim, length.cumsum(dim).gather(dim, best) - 1)  # its last element's
    return _reduced(self, dim, keepdim, self.reshape(x.shape).gather(dim, index), index)


@_lowering("scatter_reduce.two", family="reductions", why="cpu", key="XLA")
def _xla_scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    """torch_xla's own kernel where it has one (sum, prod, amax, amin, including self); the rest (it ran them on the
    CPU) through it: include_self=False first sets the places scattered to a value the reduction ignores (0, 1, or
    one of the values scattered there: a tensor, as torch_xla's scatter of a scalar failed to lower for an index longer
    than self along `dim`), and a mean is a sum over a count. Below autograd: torch's derivative."""
    _torch_checks("scatter_reduce", self, dim, index, src, reduce, include_self=include_self)
    if self.dim() == 0:  # torch_xla's scatters refuse 0-dim tensors
        return _xla_scatter_reduce(self.view(1), 0, index.reshape(-1), src.reshape(-1), reduce,
                                   include_self=include_self)[0]
    own = _torch_xla_path("scatter_reduce.two")
    if reduce != "mean":
        ignored = src if reduce in ("amax", "amin") else torch.full_like(src, 0 if reduce == "sum" else 1)
        return own(self if include_self else self.scatter(dim, index, ignored), dim, index, src, reduce,
                   include_self=True)
    total = own(self if include_self else self.scatter(dim, index, torch.zeros_like(src)), dim, index, src, "sum",
                include_self=True)
    count = torch.full_like(self, int(include_self)).scatter_add(dim, index, torch.ones_like(src)).clamp(min=1)
    return total / count if self.is_floating_point() or self.is_complex() else total.div(count, rounding_mode="floor")


@_lowering("histc", family="reductions", why="cpu", key="XLA")
def _xla_histc(self, bins=100, min=0, max=0):
    """A scatter_add of ones at each in-range value's bin, bins as torch's CPU kernel computes them (in the input's
    dtype). min == max: the data's range, read on the device; its check (finite) would be a host read, so a range
    of inf or NaN counts nothing rather than raising as torch does. Integers, which torch's CUDA kernel counts and
    its CPU kernel refuses, are counted as CUDA's (in int64; transformers' MoE routing counts so off the CPU)."""
    if self.dtype == torch.bool or self.is_complex():  # torch's errors, from the kernels its CPU histc calls
        kernel = "linspace_cpu" if self.dtype == torch.bool else "aminmax_cpu" if min == max else "histogram_cpu"
        raise NotImplementedError(f'"{kernel}" not implemented for \'{_dtype_name(self.dtype)}\'')
    torch._check(bins > 0, lambda: f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    torch._check(min <= max, lambda: "torch.histc: max must be larger than min")
    integer = not self.is_floating_point()
    x = self.reshape(-1).long() if integer else self.reshape(-1)
    min, max = (int(min), int(max)) if integer else (min, max)  # CUDA's integer bounds: the Scalars as int64
    low, high = (x.min(), x.max()) if min == max and x.numel() else (x.new_tensor(min), x.new_tensor(max))
    low, high = torch.where(low == high, low - 1, low), torch.where(low == high, high + 1, high)
    at = ((x - low) * bins).div(high - low, rounding_mode="trunc") if integer else ((x - low) * bins / (high - low))
    inside = (x >= low) & (x <= high) & (high - low).isfinite()  # NaN: outside
    return self.new_zeros(bins).scatter_add(0, at.long().clamp(0, bins - 1), inside.to(self.dtype))  # max: last bin


@_lowering("norm.ScalarOpt_dim", family="reductions", why="cpu", key="XLA")
def _xla_norm(self, p, dim, keepdim=False):
    """linalg_vector_norm, torch's own kernel of it (torch_xla ran p=0 on the CPU); torch's derivative. No dims
    (x.norm(), Muon's every step) is every dim, as torch's norm: vector_norm's dim=[] reduced none on XLA."""
    return torch.linalg.vector_norm(self, 2 if p is None else p, dim or None, keepdim)


@_lowering("renorm", family="reductions", why="cpu", key="XLA")
def _xla_renorm(self, p, dim, maxnorm):
    """Each slice along `dim` times maxnorm / (its p-norm + 1e-7) where that norm exceeds maxnorm, as torch's kernel
    (the norm in fp32 for half precision; torch_xla ran renorm on the CPU). Below autograd: torch's derivative."""
    _torch_checks("renorm", self, p, dim, maxnorm)  # at least 2 dims, p > 0, maxnorm >= 0, a float or complex dtype
    dim = _wrapped_dim(self, dim)
    half = self.dtype in (torch.float16, torch.bfloat16)
    if self.is_complex():  # as before, on the CPU: torch_xla's norm refuses complex input, a rare one
        return torch.ops.aten.renorm(self.cpu(), p, dim, maxnorm).to(self.device)
    norm = torch.linalg.vector_norm(self, p, [d for d in range(self.dim()) if d != dim], keepdim=True,
                                    dtype=torch.float32 if half else None)
    factor = torch.where(norm > maxnorm, maxnorm / (norm + 1e-7), torch.ones_like(norm))
    return self * factor.to(self.dtype)


def _nan_minimum(a, b):
    """torch.minimum, NaN kept (XLA's minimum on the CPU dropped it)."""
    return torch.where(a.isnan(), a, torch.where(b.isnan(), b, torch.minimum(a, b)))


@_lowering("cummin", family="reductions", why="cpu", key="XLA")
def _xla_cummin(self, dim):
    """The running minimum (NaN kept from the first one) by a parallel prefix of _nan_minimum, and its index: the
    last position so far where the input equals it, or is NaN (torch's CPU kernel takes x <= min and NaN, so ties and
    NaNs give the latest), a parallel prefix of torch.maximum (torch_xla's cummax keeps the first index among ties
    and drops NaN; torch_xla ran cummin on the CPU). Below autograd: torch's derivative, by index."""
    dim = _wrapped_dim(self, dim)
    if self.is_complex():
        raise NotImplementedError(f'"cummin_cpu" not implemented for \'{_dtype_name(self.dtype)}\'')
    x = torch.view_copy(self, self.shape or (1,))
    if not x.numel():
        return self.clone(), torch.zeros(self.shape, dtype=torch.long, device=self.device)
    values = _prefix_scan(x, dim, _nan_minimum if x.is_floating_point() else torch.minimum)
    record = (x == values) | x.isnan() if x.is_floating_point() else x == values
    at = torch.arange(x.shape[dim], device=x.device).view([-1] + [1] * (x.dim() - dim - 1))
    indices = _prefix_scan(torch.where(record, at, 0), dim, torch.maximum)
    return torch.view_copy(values, self.shape), torch.view_copy(indices, self.shape)


def _index_func_checks(op, self, dim, index, source):
    """The checks of torch's index_func_meta_impl, in its order, which the meta kernel of index_reduce skips."""
    torch._check_index(index.dim() <= 1, lambda: f"{op}_(): Index is supposed to be a vector, but got dim: "
                       f"{index.dim()} with type: {_dtype_name(index.dtype)} and size: {list(index.shape)}")
    torch._check(index.dtype in (torch.long, torch.int), lambda: f"{op}_(): Expected dtype int32/int64 for index but "
                 f"got: {_dtype_name(index.dtype)}")
    torch._check(self.dtype == source.dtype, lambda: f"{op}_(): self ({_dtype_name(self.dtype)}) and source "
                 f"({_dtype_name(source.dtype)}) must have the same scalar type")
    torch._check(dim == 0 or dim < source.dim(), lambda: f"{op}_(): Indexing dim {dim} is out of bounds of the "
                 f"source tensor with dim {source.dim()}")
    length = source.shape[dim] if source.dim() else 1
    torch._check(index.numel() == length, lambda: f"{op}_(): Number of indices ({index.numel()}) should be equal to "
                 f"source.size(dim): ({length}), for dim: {dim}")
    same = self.dim() == source.dim() and all(n == m for d, (n, m) in enumerate(zip(self.shape, source.shape))
                                              if d != dim)
    torch._check(same, lambda: "source tensor shape must match self tensor shape, excluding the specified "
                 f"dimension. Got self.shape = {list(self.shape)} source.shape = {list(source.shape)}")


@_lowering("index_reduce", family="reductions", why="cpu", key="XLA")
def _xla_index_reduce(self, dim, index, source, reduce, *, include_self=True):
    """scatter_reduce (_xla_scatter_reduce) with the index laid along `dim` and expanded to the source's shape
    (torch_xla ran index_reduce on the CPU). An index out of range is not checked (a host read). Below autograd:
    torch's derivative."""
    torch._check(reduce in ("prod", "mean", "amax", "amin"), lambda: "index_reduce(): Expected reduce to be one "
                 f"of prod, mean, amax or amin but got {reduce}.")
    dim = _wrapped_dim(self, dim)
    _index_func_checks("index_reduce", self, dim, index, source)
    _torch_checks("index_reduce", self, dim, index, source, reduce, include_self=include_self)
    if self.dtype == torch.bool and not include_self:
        raise NotImplementedError('"index_reduce_func_exclude_input_init" not implemented for \'Bool\'')
    target, src = torch.view_copy(self, self.shape or (1,)), torch.view_copy(source, source.shape or (1,))
    at = torch.view_copy(index, [1] * dim + [-1] + [1] * (src.dim() - dim - 1)).expand(src.shape)
    return _xla_scatter_reduce(target, dim, at, src, reduce, include_self=include_self).view(self.shape)

# --- 7f. lowerings: pooling, windows and resampling -----------------------------------------------
# Adaptive pooling to sizes that do not divide the input's (average: gathered; max: on the CPU, 3-D always), average
# pooling's backward under ceil_mode, count_include_pad=False or a divisor, fractional max pooling, upsampling (each
# device gathered the whole upsampled image; nearest-exact ran on the CPU), im2col/col2im (F.unfold/F.fold) and
# grid_sample (on the CPU): separable windows, strided slices and per-dimension gathers that keep the batch split.


def _adaptive_windows(n, m, device):
    """(start, end) of each of m outputs' windows over n inputs, as torch's adaptive pooling: [floor(i*n/m),
    ceil((i+1)*n/m))."""
    i = torch.arange(m, device=device)
    return (i * n).div(m, rounding_mode="floor"), ((i + 1) * n + m - 1).div(m, rounding_mode="floor")


@_lowering("adaptive_avg_pool2d", "adaptive_avg_pool3d", family="pooling", why="batch", hands_back=True)
def _xla_adaptive_avg_pool(input, output_size):
    """Divisible sizes (and bad input) go to torch_xla's pooling; others average each output's window as an einsum
    with a pooling matrix per dimension (a window's mean is separable)."""
    spatial = len(output_size)
    if input.dim() not in (spatial + 1, spatial + 2) or not all(m > 0 for m in output_size) or all(
            n % m == 0 for n, m in zip(input.shape[-spatial:], output_size)):
        return _torch_path(f"adaptive_avg_pool{spatial}d")(input, output_size)
    for k, m in enumerate(output_size):
        n = input.shape[input.dim() - spatial + k]
        start, end = _adaptive_windows(n, m, input.device)
        j = torch.arange(n, device=input.device)
        window = (j >= start[:, None]) & (j < end[:, None])
        pool = window.to(input.dtype) / (end - start)[:, None].to(input.dtype)
        input = torch.einsum("...n,mn->...m", input.movedim(input.dim() - spatial + k, -1), pool).movedim(
            -1, input.dim() - spatial + k)
    return input


def _adaptive_max_pool(spatial):
    """Each output's window as gathered candidates (a short window repeats its last), reduced one dimension at a
    time (_windowed_max). Every size: torch_xla ran 2-D's to sizes that do not divide the input's, and 3-D's always,
    on the CPU, and the ops have no composite to hand the others to."""
    op = f"adaptive_max_pool{spatial}d"

    def kernel(input, output_size):
        _torch_checks(op, input, output_size)
        shape = (*input.shape[:input.dim() - spatial], *output_size)
        if not all(output_size):  # an empty output, as torch's, still in the graph (windows of m = 0 divide by 0)
            return input.amax(tuple(range(-spatial, 0)), keepdim=True).expand(shape), input.new_zeros(
                shape, dtype=torch.long)
        windows = []
        for n, m in zip(input.shape[input.dim() - spatial:], output_size):
            start, end = _adaptive_windows(n, m, input.device)
            width = -(-n // m) + 1  # the widest window: ceil(n / m) + 1
            windows.append(torch.minimum(start[:, None] + torch.arange(width, device=input.device), end[:, None] - 1))
        return _windowed_max(input, windows)
    return kernel


for _spatial in (2, 3):
    _lowering(f"adaptive_max_pool{_spatial}d", family="pooling", why="cpu")(_adaptive_max_pool(_spatial))


def _fractional_max_pool(spatial):
    """Each plane's pseudo-random windows (F.fractional_max_pool draws their samples on the input's device, from its
    generator), reduced as adaptive max pooling's (_windowed_max), with per-plane candidates: torch_xla ran both the
    op and its backward on the CPU. The windows' starts as torch's kernel computes them, in the samples' dtype."""
    op = f"fractional_max_pool{spatial}d"
    order = (1, 0) if spatial == 2 else (0, 1, 2)  # which sample each dimension uses: 2-D's are (W, H)

    def kernel(input, kernel_size, output_size, random_samples):
        _torch_checks(op, input, kernel_size, output_size, random_samples)
        if input.numel() == 0:  # an empty batch (XLA's gather refuses a slice of it), still in the graph
            shape = (*input.shape[:input.dim() - spatial], *output_size)
            return input.sum().expand(shape), input.new_zeros(shape, dtype=torch.long)
        samples = random_samples if input.dim() == spatial + 2 else random_samples[0]  # unbatched: (1, C, spatial)
        windows = []
        for n, k, m, j in zip(input.shape[input.dim() - spatial:], kernel_size, output_size, order):
            u = samples[..., j]
            if m > 1:
                alpha = torch.full((), n - k, dtype=u.dtype, device=u.device) / (m - 1)
                at = torch.arange(m - 1, dtype=u.dtype, device=u.device)
                start = ((at + u[..., None]) * alpha).long() - (u * alpha).long()[..., None]
                start = torch.cat([start, start.new_full((*u.shape, 1), n - k)], -1)
            else:
                start = torch.full((*u.shape, 1), n - k, device=u.device)
            windows.append(start[..., None] + torch.arange(k, device=u.device))  # (N, C, m, k)
        return _windowed_max(input, windows)
    return kernel


for _spatial in (2, 3):
    _lowering(f"fractional_max_pool{_spatial}d", family="pooling", why="cpu")(_fractional_max_pool(_spatial))


def _windowed_max(input, windows):
    """The max over each output's window, a box given along each spatial dimension by its candidates' indices: (m,
    width), or one set per plane (N, C, m, width). The max along the last dimension's candidates, then along the
    next, ... (the batch stays split); the flat index of the winner, as torch's (the first max in row-major order).
    Copies, no views: max pooling calls it at the XLA key."""
    spatial, value, flat, inner = len(windows), input, None, 1
    for k in reversed(range(spatial)):
        d, at = input.dim() - spatial + k, windows[k]
        m, width = at.shape[-2:]
        rest = (1,) * (spatial - 1 - k)

        def candidates(t):  # (..., m, width, *rest): t's values at each output's candidates along d
            shape = (*t.shape[:d], m, width, *t.shape[d + 1:])
            if at.dim() == 2:
                return torch.view_copy(t.index_select(d, torch.view_copy(at, (-1,))), shape)
            index = torch.view_copy(at, (*at.shape[:-2], *(1,) * (d - at.dim() + 2), m * width, *rest))
            return torch.view_copy(t.gather(d, torch.expand_copy(index, (*t.shape[:d], m * width, *t.shape[d + 1:]))),
                                   shape)

        found = candidates(value)
        value, pick = found.max(d + 1, keepdim=True)
        where = torch.view_copy(at, (*at.shape[:-2], *(1,) * (d - at.dim() + 2), m, width, *rest))
        where = torch.expand_copy(where, found.shape).gather(d + 1, pick) * inner
        flat = where if flat is None else where + candidates(flat).gather(d + 1, pick)
        value, flat = torch.squeeze_copy(value, d + 1), torch.squeeze_copy(flat, d + 1)
        inner *= input.shape[d]
    return value, flat


def _max_pool(spatial):
    """max_pool{spatial}d (at AutogradXLA), _with_indices and its backward (at XLA, torch's derivatives): with a
    dilation torch_xla ran them on the CPU, and its max_pool{spatial}d raised in the backward. Ours: each window's
    dilated taps (a tap in the padding repeats the window's first in the input: it never wins, and the index is
    torch's), reduced by _windowed_max; the backward adds the gradient at the indices (a scatter along the spatial
    dims). Without a dilation: torch_xla's own kernels (max_pool{spatial}d's only where no backward follows)."""
    op = f"max_pool{spatial}d_with_indices"

    def pool(input, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        own = _torch_xla_path(f"max_pool{spatial}d")
        if own and all(d == 1 for d in dilation) and not (input.requires_grad and torch.is_grad_enabled()):
            return own(input, kernel_size, stride, padding, dilation, ceil_mode)  # no backward: no indices needed
        # torch's derivative of _with_indices differentiates again; torch_xla's backward of max_pool{spatial}d did not
        # (a gradient penalty through it lost the pool's second derivative, silently). The same time on XLA:CPU.
        return getattr(torch.ops.aten, op)(input, kernel_size, stride, padding, dilation, ceil_mode)[0]

    def forward(input, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
        own = _torch_xla_path(op)
        if own and all(d == 1 for d in dilation):
            return own(input, kernel_size, stride, padding, dilation, ceil_mode)
        _torch_checks(op, input, kernel_size, stride, padding, dilation, ceil_mode)
        windows, options = [], (kernel_size, stride or kernel_size, padding, dilation)
        for n, k, s, p, d in zip(input.shape[input.dim() - spatial:], *(v * spatial if len(v) == 1 else v
                                                                         for v in map(list, options))):
            (*_, m), = _pool_plan(1, [d * (k - 1) + 1], [s], [p], ceil_mode, [n])
            start = torch.arange(m, device=input.device) * s - p
            first = (start + ((-start).clamp(min=0) + d - 1).div(d, rounding_mode="floor") * d).clamp(max=n - 1)
            taps = start[:, None] + torch.arange(k, device=input.device) * d
            windows.append(torch.where((taps >= 0) & (taps < n), taps, first[:, None]))
        return _windowed_max(input, windows)

    def backward(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices):
        own = _torch_xla_path(f"{op}_backward")
        if own and all(d == 1 for d in dilation):
            return own(grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices)
        _torch_checks(f"{op}_backward", grad_output, input, kernel_size, stride, padding, dilation, ceil_mode, indices)
        flat = (*input.shape[:input.dim() - spatial], -1)
        grad = grad_output.new_zeros(flat[:-1] + (math.prod(input.shape[input.dim() - spatial:]),))
        grad = grad.scatter_add(-1, torch.view_copy(indices, flat), torch.view_copy(grad_output, flat))
        return torch.view_copy(grad, input.shape)

    return pool, forward, backward


for _spatial in (2, 3):  # (1-D max pooling is 2-D underneath)
    for _op, _kernel in zip(("", "_with_indices", "_with_indices_backward"), _max_pool(_spatial)):
        _lowering(f"max_pool{_spatial}d{_op}", family="pooling", why="cpu", key="XLA" if _op else "AutogradXLA")(
            _kernel)
del _op, _kernel


def _windows(input, kernel, dilation, padding, stride):
    """(N, C, K, *out): every kernel offset's strided view of the padded input, K = prod(kernel); slices along the
    spatial dimensions only, so the batch stays split (torch_xla's im2col fell back to the CPU)."""
    spatial = len(kernel)
    input = torch.nn.functional.pad(input, [p for pad in reversed(padding) for p in (pad, pad)])
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(input.shape[-spatial:], kernel, dilation, stride)]
    views = []
    for offset in itertools.product(*map(range, kernel)):
        index = tuple(slice(o * d, o * d + (m - 1) * s + 1, s) for o, d, m, s in zip(offset, dilation, out, stride))
        views.append(input[(..., *index)])
    return torch.stack(views, 2)


def _pool_plan(spatial, kernel_size, stride, padding, ceil_mode, sizes):
    """Per spatial dimension (kernel, stride, padding, output size) as torch's pooling: a single int or empty stride
    spread, the output size rounded up under ceil_mode unless the last window would start in the right padding."""
    def spread(v, default):
        return [default[k] for k in range(spatial)] if len(v) == 0 else [v[0]] * spatial if len(v) == 1 else list(v)
    kernel = spread(kernel_size, None)
    plan = []
    for n, k, s, p in zip(sizes, kernel, spread(stride, kernel), spread(padding, None)):
        m = (n + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
        plan.append((k, s, p, m - 1 if ceil_mode and (m - 1) * s >= n + p else m))
    return plan


def _avg_pool_divisor(input, sizes, plan, count_include_pad, divisor_override, dtype):
    """The divisor of each output, as torch's: the window's size in the input and its padding (count_include_pad)
    or in the input alone, clipped at the right padding's end: a product over the dimensions, built from iotas."""
    if divisor_override is not None:  # (the checks of avg_pool3d's meta kernels and of 2-D's backward miss a 0)
        torch._check(divisor_override != 0, lambda: "divisor must be not zero")
        return divisor_override
    divisor = 1
    for j, (n, (k, s, p, m)) in enumerate(zip(sizes, plan)):
        start = torch.arange(m, device=input.device) * s - p
        end = (start + k).clamp(max=n + p)
        count = end - start if count_include_pad else end.clamp(max=n) - start.clamp(min=0)
        divisor = divisor * torch.ops.aten.view_copy(count, (m,) + (1,) * (len(plan) - j - 1))
    return divisor.to(dtype)


def _padded(x, d, left, right):  # x padded with zeros along dimension d
    return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 1 - d) + [left, right])


def _avg_pool(spatial):
    """avg_pool{spatial}d below autograd (torch's derivative: avg_pool_backward, ours, whose own is this one): each
    window's sum by strided slices, one dimension at a time (the batch stays split), over torch's divisor. torch_xla
    ran the backward on the CPU under ceil_mode, count_include_pad=False or a divisor_override, and ignored the
    override in its forward (wrong numbers): the other inputs go to its own kernels. Below autograd the tensors are
    torch_xla's own, not functionalized: a view of a view read the base's layout, so every step is a copy
    (slice_copy, view_copy), never a view."""
    op = f"avg_pool{spatial}d"

    def kernel(input, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
        own = _torch_xla_path(op)
        if own and divisor_override is None:  # one reduce-window, where ours is a slice per offset
            return own(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        _torch_checks(op, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        sizes = input.shape[input.dim() - spatial:]
        plan = _pool_plan(spatial, kernel_size, stride, padding, ceil_mode, sizes)
        x = input.to(_computation_dtype(input))
        for d, (n, (k, s, p, m)) in enumerate(zip(sizes, plan), input.dim() - spatial):
            x = _padded(x, d, p, max(0, (m - 1) * s + k - n - p))
            x = functools.reduce(torch.add, [torch.slice_copy(x, d, t, t + (m - 1) * s + 1, s) for t in range(k)])
        divisor = _avg_pool_divisor(input, sizes, plan, count_include_pad, divisor_override, x.dtype)
        if not x.is_floating_point():  # torch's integer division truncates
            return x.div(divisor, rounding_mode="trunc").to(input.dtype)
        return (x / divisor).to(input.dtype)

    def backward(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        """The adjoint of the forward: the gradient over the divisor, spread back over each window (each offset's
        stride-dilated gradient padded into place), one dimension at a time."""
        own = _torch_xla_path(f"{op}_backward")
        if own and not ceil_mode and count_include_pad and divisor_override is None:
            return own(grad_output, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        _torch_checks(f"{op}_backward", grad_output, input, kernel_size, stride, padding, ceil_mode,
                      count_include_pad, divisor_override)
        sizes = input.shape[input.dim() - spatial:]
        plan = _pool_plan(spatial, kernel_size, stride, padding, ceil_mode, sizes)
        g = grad_output.to(_computation_dtype(grad_output))
        g = g / _avg_pool_divisor(input, sizes, plan, count_include_pad, divisor_override, g.dtype)
        for d, (n, (k, s, p, m)) in enumerate(zip(sizes, plan), input.dim() - spatial):
            if s > 1:  # the gradient of output o at o * s
                g = _padded(torch.unsqueeze_copy(g, d + 1), d + 1, 0, s - 1)
                g = torch.slice_copy(torch.ops.aten.view_copy(g, (*g.shape[:d], m * s, *g.shape[d + 2:])), d, 0,
                                     (m - 1) * s + 1)
            length = max(n + 2 * p, (m - 1) * s + k)
            g = functools.reduce(torch.add, [_padded(g, d, t, length - t - g.shape[d]) for t in range(k)])
            g = torch.slice_copy(g, d, p, p + n)
        return g.to(input.dtype)

    return kernel, backward


for _spatial in (2, 3):  # (1-D average pooling is 2-D underneath)
    _forward, _backward = _avg_pool(_spatial)
    _lowering(f"avg_pool{_spatial}d", family="pooling", why="cpu", key="XLA")(_forward)
    _lowering(f"avg_pool{_spatial}d_backward", family="pooling", why="cpu", key="XLA")(_backward)
del _forward, _backward


@_lowering("im2col", family="windows", why="cpu")
def _xla_im2col(input, kernel_size, dilation, padding, stride):
    _torch_checks("im2col", input, kernel_size, dilation, padding, stride)
    if input.dim() == 3:  # unbatched (C, H, W), as torch's
        return _xla_im2col(input[None], kernel_size, dilation, padding, stride)[0]
    return _windows(input, kernel_size, dilation, padding, stride).flatten(1, 2).flatten(2)


@_lowering("col2im", family="windows", why="cpu")
def _xla_col2im(input, output_size, kernel_size, dilation, padding, stride):
    """F.fold: each window's column added back where _windows took it from (im2col's adjoint), one offset at a
    time, placed along each spatial dimension by a one-hot matrix: an einsum that keeps the batch split, at the cost
    of (H + W) multiply-adds per output element and offset, where torch's CPU scatter (torch_xla has none) adds."""
    _torch_checks("col2im", input, output_size, kernel_size, dilation, padding, stride)
    if input.dim() == 2:  # unbatched (C * K, L), as torch's
        return _xla_col2im(input[None], output_size, kernel_size, dilation, padding, stride)[0]
    k = math.prod(kernel_size)
    padded = [size + 2 * pad for size, pad in zip(output_size, padding)]
    out = [(m - d * (kk - 1) - 1) // s + 1 for m, kk, d, s in zip(padded, kernel_size, dilation, stride)]
    columns = input.unflatten(1, (-1, k)).unflatten(-1, out)  # (N, C, K, *out)
    image = 0
    for i, offset in enumerate(itertools.product(*map(range, kernel_size))):
        part = columns[:, :, i]
        for j, (o, d, m, s, size) in enumerate(zip(offset, dilation, out, stride, padded)):
            at = torch.arange(m, device=input.device) * s + o * d  # where window position p lands on this dimension
            place = (torch.arange(size, device=input.device)[:, None] == at).to(input.dtype)  # (size, m)
            part = torch.einsum("...m,sm->...s", part.movedim(2 + j, -1), place).movedim(-1, 2 + j)
        image = image + part
    crop = tuple(slice(pad, pad + size) for pad, size in zip(padding, output_size))
    return image[(..., *crop)]


def _cubic_weights(t):
    """The weights of the taps at floor(x) - 1 .. floor(x) + 2, t = x - floor(x): torch's cubic convolution, A=-0.75."""
    a = -0.75
    near, far = (lambda x: ((a + 2) * x - (a + 3)) * x * x + 1), (lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a)
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def _resized(input, sizes, scales, mode, align_corners=False):
    """input resized over its last len(sizes) dimensions one at a time, with eager's source positions and weights
    (nearest and nearest-exact: one tap, linear: two, cubic: four, A=-0.75), each tap an index_select along that
    dimension only. The positions are computed on the device (iota): no transfer, no new constant per step."""
    for k, m in enumerate(sizes):
        d, n = input.dim() - len(sizes) + k, input.shape[input.dim() - len(sizes) + k]
        dst = torch.arange(m, device=input.device, dtype=torch.float32)
        given = scales[k] if scales else None
        if mode.startswith("nearest"):  # exact: the centre's source pixel, where nearest takes the left edge's
            src = (dst + 0.5 if mode == "nearest-exact" else dst) * (1 / given if given else n / m)
            taps = [(src.floor().clamp(max=n - 1), None)]
        else:
            if align_corners:
                src = dst * ((n - 1) / (m - 1) if m > 1 else 0)
            else:
                src = (dst + 0.5) * (1 / given if given else n / m) - 0.5
            src = src if mode == "cubic" or align_corners else src.clamp(min=0)
            start = src.floor()
            t = src - start
            if mode == "linear":
                taps = [(start, 1 - t), ((start + 1).clamp(max=n - 1), t)]
            else:
                taps = [((start + j - 1).clamp(0, n - 1), w) for j, w in enumerate(_cubic_weights(t))]
        shape = (m,) + (1,) * (input.dim() - d - 1)
        parts = [input.index_select(d, i.long()) for i, _ in taps]
        parts = [p if w is None else p * w.to(input.dtype).view(shape) for p, (_, w) in zip(parts, taps)]
        input = functools.reduce(torch.add, parts) if len(parts) > 1 else parts[0]
    return input


def _resize_kernel(op, spatial, mode, with_corners):
    def kernel(input, output_size, *rest):
        align_corners, scales = rest if with_corners else (False, rest[0])
        size = output_size
        if input.dim() == spatial + 2 and size is None and scales and len(scales) == spatial:
            size = [math.floor(n * s) for n, s in zip(input.shape[-spatial:], scales)]
        if (input.dim() != spatial + 2 or size is None or len(size) != spatial
                or not all(n > 0 for n in (*input.shape[2:], *size))):  # torch's answer, or its error, as called
            return _torch_path(op)(input, output_size, *rest)
        return _resized(input, list(size), scales if scales else None, mode, align_corners)
    return kernel


_RESIZES = {  # aten op -> (spatial dims, mode, whether it takes align_corners)
    **{f"upsample_nearest{d}d.vec": (d, "nearest", False) for d in (1, 2, 3)},
    **{f"_upsample_nearest_exact{d}d.vec": (d, "nearest-exact", False) for d in (1, 2, 3)},
    "upsample_linear1d.vec": (1, "linear", True), "upsample_bilinear2d.vec": (2, "linear", True),
    "upsample_trilinear3d.vec": (3, "linear", True), "upsample_bicubic2d.vec": (2, "cubic", True)}
for _op, (_spatial, _mode, _corners) in _RESIZES.items():  # nearest-exact: torch_xla ran it on the CPU
    _lowering(_op, family="resampling", why="cpu" if _mode == "nearest-exact" else "batch", hands_back=True)(
        _resize_kernel(_op, _spatial, _mode, _corners))
del _op, _spatial, _mode, _corners  # the registration loops' names (7c's too): no module attributes


@_lowering("grid_sampler", family="resampling", why="cpu", hands_back=True)
def _xla_grid_sampler(input, grid, interpolation_mode, padding_mode, align_corners):
    """Bilinear (trilinear in 3-D), nearest or bicubic sampling, any padding (torch_xla ran grid_sampler_2d/3d and
    their backwards on the CPU): each tap a gather from the flattened image, along the spatial dims only, weighted
    per dim as torch's; what torch refuses takes torch's path, for its error."""
    k = input.dim() - 2
    if (k not in (2, 3) or grid.dim() != input.dim() or grid.shape[0] != input.shape[0] or grid.shape[-1] != k
            or grid.dtype != input.dtype or grid.device != input.device or 0 in input.shape[2:]
            or interpolation_mode not in ((0, 1, 2) if k == 2 else (0, 1)) or padding_mode not in (0, 1, 2)):
        return _torch_path("grid_sampler")(input, grid, interpolation_mode, padding_mode, align_corners)
    sizes = input.shape[2:][::-1]  # grid's x, y(, z) index W, H(, D)

    def padded(at, size):  # torch's compute_coordinates: border clips; reflection folds into the image, then clips
        if padding_mode == 2:
            low, span = (0, size - 1) if align_corners else (-0.5, size)
            if span == 0:
                return at * 0
            off = (at - low).abs()
            extra = off.fmod(span)
            at = torch.where((off / span).floor().remainder(2) == 0, extra + low, span - extra + low)
        return at.clamp(0, size - 1) if padding_mode else at

    taps = []  # per spatial dim, x first: [(position, weight)]
    for j, size in enumerate(sizes):
        g = grid[..., j].to(_computation_dtype(grid))  # fp32: bf16 has no integer past 256 (torch's CPU's are bf16)
        at = (g + 1) / 2 * (size - 1) if align_corners else ((g + 1) * size - 1) / 2
        at = at if interpolation_mode == 2 else padded(at, size)  # bicubic pads each tap's position instead
        start = at.floor()
        if interpolation_mode == 2:
            taps.append([(padded(start + i - 1, size), w) for i, w in enumerate(_cubic_weights(at - start))])
        elif interpolation_mode == 1:  # half to even as torch's nearbyint; the grid's gradient 0
            taps.append([(at.round(), 1 + 0 * at)])
        else:
            taps.append([(start, 1 - (at - start)), (start + 1, at - start)])
    flat, strides = input.flatten(2), [math.prod(sizes[:j]) for j in range(k)]
    out = 0
    for tap in itertools.product(*taps):  # the pixel at each tap's positions, zero outside the image
        inside = functools.reduce(torch.logical_and, [(p >= 0) & (p <= n - 1) for (p, _), n in zip(tap, sizes)])
        at = sum(p.clamp(0, n - 1).long() * s for (p, _), n, s in zip(tap, sizes, strides)).flatten(1)
        value = flat.gather(2, at[:, None].expand(*input.shape[:2], -1)).unflatten(2, grid.shape[1:-1])
        weight = functools.reduce(torch.mul, [w for _, w in tap])
        out = out + torch.where(inside[:, None], value, 0) * weight[:, None]
    return out.to(input.dtype)

# --- 8. the step: its hooks, graph cuts, the recompile watchdog -----------------------------------
# One global pre-step and one post-step hook run each concern of an optimizer step in a fixed order (docs/design.md,
# "The step"): before it rebinding, then on XLA the watchdog, scaled gradients rebuilt, the state first, the work check,
# the cut, SGD's damped momentum, special scalars off and _OwnScalars on (a first or pinned step); after it, on XLA the
# cut, both back and the watchdog, then preemption, the meter and the profiler. A trainer model's forward has one hook
# too (_before_forward): both back (a step that raised), meta init, then the cut that ends the last iteration.


@dataclasses.dataclass
class _GraphCuts:
    """What the graph-cut rule remembers between hooks; the watchdog from first XLA use."""

    watchdog: object = None  # the _CompileWatchdog
    backward: bool = False  # a backward reached a trainer's parameters since the graph was last cut
    no_grad_forward: bool = False  # a trainer's model ran under no_grad since the graph was last cut
    models: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # models whose forwards cut graphs
    scalars: bool = None  # torch_xla's special scalars (0, 1 as constants) as the user had them, while a step runs
    own_scalars: object = None  # the _OwnScalars mode while a step runs
    gathered: set = dataclasses.field(default_factory=set)  # ids of the parameters fsdp splits (_in_order); not
    # weak references, which swap_tensors (meta init) refuses; a parameter keeps its id through the swap
    gates: dict = dataclasses.field(default_factory=dict)  # "forward"/"backward" -> the last gathered product's input
    autocast_casts: bool = False  # _autocast_cast is registered (the first fsdp weight on XLA)


@dataclasses.dataclass
class _StepRecord:
    """What the step hooks remember of an optimizer: its groups' sizes, read once per step, and the sizes at which
    each concern last acted, so a new group (or model) is new to all."""

    groups: tuple = None  # at this step
    rebound: tuple = None  # at the last rebinding to the parameters that replaced its own
    ready: tuple = None  # when its state was last made before a step (_state_first)
    owned: tuple = None  # when `ours` was decided
    ours: bool = False  # it steps a trainer's parameters (not a probe's): preemption and the meter count its steps
    steps: int = 0  # steps taken, for the watchdog's warning
    pinned: dict = dataclasses.field(default_factory=dict)  # _OwnScalars: call -> {place: (last value, its scalar)}


def _install_step_hooks():
    if not _STATE.optimizer_hooks:
        _STATE.optimizer_hooks.update(pre=register_optimizer_step_pre_hook(_before_step),
                                      post=register_optimizer_step_post_hook(_after_step))


def _record(optimizer):
    record = _STATE.steps.get(optimizer)
    if record is None:
        record = _STATE.steps[optimizer] = _StepRecord()
    record.groups = tuple(len(group["params"]) for group in optimizer.param_groups)
    return record


def _before_step(optimizer, args, kwargs):
    record = _record(optimizer)
    if _STATE.rebinding and record.rebound != record.groups:  # a walk only when the groups change
        _place_optimizer_state(optimizer)
        record.rebound = record.groups
    if not _has_xla_params(optimizer):
        return args, kwargs
    _STATE.cuts.watchdog.before_step(_import("torch_xla.debug.metrics"))
    first = record.ready != record.groups
    _rebuild_scaled_grads(optimizer)
    _state_first(optimizer, record)
    _STATE.work_check.run()
    # The forward and backward are one graph, the step another, each compiled once: XLA's compile time grows faster
    # than a graph (24 GPT blocks: 14-16.5 s and 2-2.7 s against 23-26.5 s for one, docs/design.md); the last
    # micro-batch of an accumulation reuses the others' graph. Costs a launch a step; the gradients are graph outputs
    # either way.
    _cut_graph()
    if first:
        _momentum_first(optimizer)
    # The first step tags the lr of torch's own steps only: a user's step might keep it.
    _step_scalars_on(record, first, optimizer.param_groups if _torch_steps(optimizer) else ())
    # What the hook returns replaces the step's (args, kwargs); args[0] is the optimizer.
    if callable(kwargs.get("closure")):
        kwargs = {**kwargs, "closure": _cut_around(kwargs["closure"])}
    elif len(args) > 1 and callable(args[1]):
        args = (args[0], _cut_around(args[1]), *args[2:])
    return args, kwargs


def _after_step(optimizer, args, kwargs):
    record = _STATE.steps.get(optimizer) or _record(optimizer)
    if _has_xla_params(optimizer):
        _cut_graph()  # the step's graph
        _step_scalars_off()
        _STATE.cuts.watchdog.after_step(optimizer, record, _import("torch_xla.debug.metrics"))
    if _STATE.preemption.owns(optimizer, record):
        _STATE.preemption.after_step(optimizer)
        _STATE.meter.step_end()
    if _STATE.profile is not None:
        _STATE.profile.step_end()


def _has_xla_params(optimizer):
    # Any XLA parameter needs the sync, or its graph grows without bound; the first usually answers.
    return any(_is_xla(p.device) for group in optimizer.param_groups for p in group["params"])


def _cut_around(closure):
    """A closure is one graph, the optimizer's work between closures another. Uncut, each value LBFGS read recompiled
    the whole forward and backward: time_sequence_prediction's 100-step LSTM, a 36,000-op graph for 3-4 min a read."""
    @functools.wraps(closure)
    def cut():
        _cut_graph()
        loss = closure()
        _cut_graph()
        return loss
    return cut


def _cut_graph():
    """Compile (the first time) and run everything pending as one graph, asynchronously. The work check's outputs
    still held are dropped: as outputs of a graph that repeats, they would make its first run a graph of its own."""
    _STATE.work_check.drop()
    _STATE.cuts.gates.clear()
    _import("torch_xla").sync()
    _STATE.cuts.backward = _STATE.cuts.no_grad_forward = False


def _cut_each_iteration(model):
    """For loops no optimizer step ends (accumulation, updates by hand, eval): a trainer model's forward cuts the graph
    if a backward reached its parameters, or it ran under no_grad, since the last cut. Costs a flag per backward."""
    if model in _STATE.cuts.models:
        return
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_saw_backward)
    model.register_forward_pre_hook(_owned(model, _before_forward), with_kwargs=True)
    _STATE.cuts.models.add(model)


def _saw_backward(param):
    _STATE.cuts.backward = True
    if param.grad is not None and _is_split(param):
        # A graph's outputs take the layout XLA's propagation gives them: cut off from the step (or the next
        # micro-batch) that reads it, an fsdp gradient came out whole, 4x its shard on 4 devices, all-reduced where
        # it was reduce-scattered. Costs a mark per split parameter per backward.
        _lay_out_like(param.grad, param)


def _before_forward(module, args, kwargs):
    """A trainer model's forward starts: meta init, the cut that ends the last iteration, the watchdog's look."""
    cuts = _STATE.cuts
    _step_scalars_off()
    _STATE.meta_init.before_forward(module)
    if cuts.backward or cuts.no_grad_forward:
        kind = "train" if cuts.backward else "eval"
        _cut_graph()
        cuts.watchdog.after_forward_cut((cuts.watchdog.serial(module), kind), _import("torch_xla.debug.metrics"))
    cuts.no_grad_forward |= not torch.is_grad_enabled()
    if cuts.watchdog.late_compiles and not cuts.watchdog.sliced_input:  # only once a warning may follow
        cuts.watchdog.sliced_input = any(isinstance(t, torch.Tensor) and t._base is not None and _is_xla(t.device)
                                         for t in (*args, *kwargs.values()))


class _CompileWatchdog:
    """Counts XLA compiles per iteration (cut to cut); warns once per process when one pair of consecutive cuts
    compiles on consecutive runs past warm-up. Not per optimizer: that warned about graphs met once late (the step
    after an eval, an EMA copy's 3rd step). A cut costs a counter read and the CPU ops' names; no sync."""

    def __init__(self):
        self.serials, self._numbers = weakref.WeakKeyDictionary(), itertools.count()  # by object: ids are reused
        self.pairs = {}  # (previous cut, this cut) -> (runs, late compiles in a row); a cut: (id, layout or kind)
        self.cut, self.cuts = None, 0  # the last cut, and how many there were
        self.late_compiles = 0  # iterations after warm-up that compiled
        self.sliced_input = False  # a forward's input was a view of a larger XLA tensor
        self.in_step = False  # inside optimizer.step(): a closure's forwards belong to the step
        self._at_cut = 0  # the compile count at the last cut, or at the start of the step in progress
        self.cpu_ops = set()  # the ops torch_xla ran on the CPU that a warning named

    def before_step(self, met):
        self.in_step = True
        self._at_cut = met.counter_value("UncachedCompile") or 0

    def after_step(self, optimizer, record, met):  # a new group: a new cut, warmed anew
        record.steps += 1
        self.in_step = False
        history = optimizer.defaults.get("history_size") if isinstance(optimizer, torch.optim.LBFGS) else None
        self._count(met, (self.serial(optimizer), record.groups), record.steps, "step", history and (
            f"LBFGS compiles new graphs until its history is full (history_size={history}), since it reads every "
            "history term in each inner iteration; a smaller history_size (e.g. 10) bounds them. "))

    def serial(self, obj):
        """A number for `obj` no later object gets (a notebook's rebuilt model and optimizer reused the old ids, and
        their first compiles counted as late ones)."""
        if obj not in self.serials:
            self.serials[obj] = next(self._numbers)
        return self.serials[obj]

    def after_forward_cut(self, key, met):
        if not self.in_step:  # else LBFGS: its step counts a closure's forwards
            self._count(met, key, self.cuts + 1, "iteration")

    def _count(self, met, cut, index, what, known_cause=None):
        _name_cpu_fallbacks(met, self.cpu_ops)
        now = met.counter_value("UncachedCompile") or 0
        compiled, self._at_cut = now - self._at_cut, now
        pair, self.cut, self.cuts = (self.cut, cut), cut, self.cuts + 1
        runs, in_a_row = self.pairs.get(pair, (0, 0))
        late = bool(compiled and runs >= WARMUP_STEPS)
        in_a_row = in_a_row + 1 if late else 0
        self.pairs[pair], self.late_compiles = (runs + 1, in_a_row), self.late_compiles + late
        if in_a_row < LATE_COMPILES_TO_WARN or not _once("recompiles"):
            return
        cause = known_cause or ("A model input is a slice of a device tensor (e.g. source[i:i + seq_len] on XLA): "
                                "each new offset is a new graph. Keep the source on the host and move each batch with "
                                "trainer.to_device, or select with index_select and an index tensor. "
                                if self.sliced_input else "")
        logger.warning(
            "seamless_tpu: %s %d compiled %d new XLA graph(s) after warm-up. Each recompile stalls training. %s%s"
            "input shapes that change between steps (a smaller last batch: use trainer.prepare_data_loader, which "
            "drops it), Python control flow on tensor values, or .item()/print(tensor) inside the step. "
            "PT_XLA_DEBUG=1 names the cause.", what, index, compiled, cause,
            "Other causes: " if cause else "Likely causes: ")


# --- 8b. the first step: its state, and the step's scalars ----------------------------------------
# Before an optimizer's first step its state is made (one small graph), so step 1's graphs are every later step's; in
# each XLA step the numbers torch_xla would fold (0, 1) or share (equal at step 1 only) stay inputs of their own
# (docs/design.md, "First-step compile time").


def _state_first(optimizer, record):
    """Before an optimizer's first step, the state it would create (and the work check's outputs) become device data
    by a small graph of their own: step 1's graphs are then every later step's, compiled once (made inside it, step 2
    read the state as input: a second compile of the step). Costs a small graph once (the state's first values; with
    the work check, the forward up to its last held module)."""
    if record.ready == record.groups and not _STATE.work_check.held:  # not a first step, new group or model
        return
    _place_optimizer_state(optimizer)  # state made on the CPU (Adagrad makes it at construction) moves, split like p
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None and not optimizer.state.get(p) and _is_xla(p.device)]
    if params:
        _init_state(optimizer)
        for p in params:
            if optimizer.state.get(p):
                optimizer.state[p] = _state_like(optimizer.state[p], p)
    ready = [v for group in optimizer.param_groups for p in group["params"] if p.grad is not None
             for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and _is_xla(v.device)]
    ready = [t for t in ready + _STATE.work_check.outputs() if not _is_device_data(t)]
    if ready:
        _import("torch_xla")._XLAC._xla_sync_multi(ready, devices=[], wait=False)  # compiles a graph, async
    record.ready = record.groups


def _init_state(optimizer):
    """The state torch's first step makes, made by torch's own code: each group's _init_group, which every torch.optim
    step calls first (NAdam's mu_product 1, ASGD's eta the lr, Rprop's step sizes the lr, Adam's zeros). Left to the
    step: a step or _init_group not torch's (a subclass's own), fused or differentiable groups, and optimizers with
    no _init_group (LBFGS, SparseAdam). SGD's momentum: zeros stand for its first step's copy of the gradient only
    without dampening; with it the buffer is made from the gradients after the cut (_momentum_first)."""
    if not _torch_steps(optimizer):
        return
    with torch.no_grad():
        init = type(optimizer)._init_group
        for group in optimizer.param_groups:  # (group, params_with_grad, grads, one list per kind of state...)
            init(optimizer, group, *([] for _ in range(len(inspect.signature(init).parameters) - 2)))
            for p in group["params"] if isinstance(optimizer, torch.optim.SGD) and group["momentum"] and not group[
                    "dampening"] else ():
                if p.grad is not None and not optimizer.state.get(p):
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)


def _torch_steps(optimizer):
    kind = type(optimizer)
    return all(getattr(f, "__module__", "").startswith("torch.optim.") for f in (
        kind.step, getattr(kind, "_init_group", None))) and not any(
        group.get("fused") or group.get("differentiable") for group in optimizer.param_groups)


def _momentum_first(optimizer):
    """SGD's momentum buffer with dampening before its first step, once the cut made the gradients data: that step
    copies the gradient g (weight decay and maximize applied) where later ones take momentum x buf + (1 - dampening)
    x g, so a buffer of dampening / momentum x g gives step 1 the later steps' graph and torch's numbers to a
    rounding. Costs a small graph once."""
    if not (isinstance(optimizer, torch.optim.SGD) and _torch_steps(optimizer)):
        return
    made = []
    with torch.no_grad():
        for group in optimizer.param_groups:
            momentum, dampening, decay = group["momentum"], group["dampening"], group["weight_decay"]
            for p in group["params"] if momentum and dampening else ():
                if p.grad is not None and not optimizer.state.get(p):
                    g = (-p.grad if group["maximize"] else p.grad).add(p, alpha=decay)
                    optimizer.state[p] = _state_like({"momentum_buffer": g * (dampening / momentum)}, p)
                    made.append(optimizer.state[p]["momentum_buffer"])
    if made and _is_xla(made[0].device):
        _import("torch_xla")._XLAC._xla_sync_multi(made, devices=[], wait=False)  # compiles a graph, async


def _rebuild_scaled_grads(optimizer):
    """A gradient scaled in place (clipping) is a view that torch_xla rebuilds from its base where it is next read:
    on step 1 the state's reads did, on later steps the step's, and its outputs came in another order (a graph more:
    Rprop, Muon). Rebuilt here, in one order, before the cut. Costs 1-3 us a parameter, 7 more a scaled one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            grad = p.grad
            if grad is not None and torch._is_functional_tensor(grad) and torch._functionalize_has_data_mutation(grad):
                torch._functionalize_sync(grad)


def _step_scalars_on(record, first, groups):
    """torch_xla makes 0 and 1 graph constants and other numbers inputs: a scalar 1 at one step only (Adafactor's first
    weight) made that step a graph of its own. Off in a step; then as the user had them (_step_scalars_off: after the
    step, or at the forward after one that raised). Costs a constant folded less per such scalar. _OwnScalars runs in
    an optimizer's first step (tagging `groups`' lr), and in every step of one it pinned a call of."""
    cuts, xla = _STATE.cuts, sys.modules.get("torch_xla")
    if not _private_apis():
        return
    cuts.scalars = xla._XLAC._get_xla_handle_special_scalars() if cuts.scalars is None else cuts.scalars
    xla._XLAC._set_xla_handle_special_scalars(False)
    if first or record.pinned:
        cuts.own_scalars = _OwnScalars(record.pinned, groups if first else None).__enter__()


def _step_scalars_off():
    cuts, xla = _STATE.cuts, sys.modules.get("torch_xla")
    if cuts.scalars is not None:
        xla._XLAC._set_xla_handle_special_scalars(cuts.scalars)
        cuts.scalars = None
    mode, cuts.own_scalars = cuts.own_scalars, None
    if mode is not None:
        mode.leave()


# The ops whose float arguments a Tensor may replace (in place too: mul_), and the keywords that scale an operand.
# Elsewhere a 0-dim tensor would be read as a Scalar: .item(), a sync (full_like's fill value, norm's p).
_TENSOR_OVERLOADS = frozenset(
    "mul div true_divide add sub rsub lerp clamp clamp_min clamp_max pow fill masked_fill eq ne lt le gt ge".split()
    + [f"__{op}__" for op in "mul rmul truediv rtruediv add radd sub rsub pow rpow setitem".split()])
_SCALED_BY = {"alpha": ("add", "sub"), "value": ("addcmul", "addcdiv")}


class _Varying(float):
    """A float an optimizer's first step derives from a step count (Tensor.item) or its lr, which a scheduler moves:
    one equal to another there may differ later. Arithmetic keeps the tag; math.sqrt and float() drop it."""


def _still_varying(float_op):
    def op(self, *other):
        out = float_op(self, *other)
        return out if out is NotImplemented else _Varying(out)
    return op


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "pow", "rpow", "neg", "abs"):
    setattr(_Varying, f"__{_name}__", _still_varying(getattr(float, f"__{_name}__")))
_FLOATS = {float, _Varying}


class _OwnScalars(torch.overrides.TorchFunctionMode):
    """torch_xla gives equal scalars one device input, so floats equal at one step only gave it a graph of its own: at
    step 1 RAdam's bias correction 1 - beta1^1 is its lerp weight 1 - beta1, a warmup's lr 0 makes AdamW's 1 - lr x
    weight_decay 1 (torch_xla's own alpha=1 of every add). At an optimizer's first step (detect: its groups, whose lr
    become _Varying for it) a _Varying float equal to 1, or one equal to another call's float with either varying,
    pins its call: there, at that and every later step, the call's floats are device scalars of their own (one per
    place, sent once per new value). For good: each use of a device tensor is one graph node where a number's are
    one each (unpinned at step 2, the step compiled again). Costs 5-7 us per op in the steps it runs (an optimizer
    with a pinned call: RAdam, AdamW warmed up from lr 0) and none where floats equal at step 1 stay equal."""

    def __init__(self, pinned, groups=None):
        super().__init__()
        self.pinned, self.detect, self.seen, self.lrs = pinned, groups is not None, {}, []
        for group in groups or ():
            if type(group.get("lr")) is float:
                self.lrs.append((group, group["lr"], _Varying(group["lr"])))
                group["lr"] = self.lrs[-1][2]

    def leave(self):
        for group, lr, varying in self.lrs:
            if group.get("lr") is varying:
                group["lr"] = lr
        self.pinned, self.detect = {}, False  # inert, if a mode the step pushed keeps it on the stack
        depth = torch._C._len_torch_function_stack()
        if depth and torch._C._get_function_stack_at(depth - 1) is self:
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.item and self.detect and not torch.is_grad_enabled():  # not a closure's loss
            out = func(*args, **kwargs)
            return _Varying(out) if type(out) is float else out  # a step count: Adam's bias corrections
        if len(args) < 2 or not _FLOATS & {type(v) for v in (*args, *kwargs.values())}:
            return func(*args, **kwargs)  # most calls: x.grad, x.is_complex(), x.add_(y)
        frame = sys._getframe(1)
        if frame.f_globals.get("__name__") == "torch._tensor":  # v - x, 2 / x: torch's operator wrappers
            frame = frame.f_back
        call = (frame.f_code, frame.f_lasti)
        places = _scalar_places(func, args, kwargs) if self.detect or call in self.pinned else ()
        if not places:
            return func(*args, **kwargs)
        target, values = args[0], [kwargs[where] if isinstance(where, str) else args[where] for where in places]
        if self.detect and any([self._collides(call, v, target.dtype) for v in values]):
            self.pinned.setdefault(call, {})
        own = self.pinned.get(call)
        if own is None:
            return func(*args, **kwargs)
        args, kwargs = list(args), dict(kwargs)
        for where, value in zip(places, values):
            last, scalar = own.get(where, (None, None))
            if scalar is None or last != value:
                scalar = _import("torch_xla")._XLAC._xla_tensors_from_aten(
                    [torch.tensor(value, dtype=target.dtype)], [str(target.device)])[0]  # device data of its own
                own[where] = (value, scalar)
            if where == "alpha":  # add/sub(x, y, alpha=a) is x +- y x a, as torch_xla lowers it
                del kwargs[where]
                args[1] = args[1] * scalar
            elif where == "value":  # addcmul/addcdiv(x, t1, t2, value=v): x + (t1 op t2) x v, as torch_xla lowers them
                other = (args[1] * args[2] if func.__name__.startswith("addcmul") else args[1] / args[2]) * scalar
                return target.add_(other) if func.__name__.endswith("_") else torch.add(target, other)
            else:
                args[where] = scalar
        return func(*args, **kwargs)

    def _collides(self, call, value, dtype):
        """Whether `value` at `call` pins it: a varying 1, or a float another call passed first, either varying."""
        key, varying = float(torch.tensor(value).to(dtype)), type(value) is _Varying  # torch_xla's key: op's type
        first, first_varying = self.seen.setdefault(key, (call, varying))
        return varying and key == 1.0 or first != call and (varying or first_varying)


def _scalar_places(func, args, kwargs):
    """Where a call on a floating XLA tensor, outside autograd, passes floats a device scalar may replace: the
    positions of an op with a Tensor overload (all floats: an int beside means the Scalar overload) and `alpha` or
    `value` where they scale tensors; () for any other call."""
    target, name = args[0], getattr(func, "__name__", "")
    if not (isinstance(target, torch.Tensor) and target.is_floating_point() and _is_xla(target.device)) or (
            torch.is_grad_enabled() or "out" in kwargs):  # grad: a closure's forward
        return ()
    op = name if name.startswith("__") else name.rstrip("_")  # mul_ is mul
    numbers = [where for where in range(1, len(args)) if type(args[where]) in (int, *_FLOATS)]
    return [*(numbers if op in _TENSOR_OVERLOADS and all(type(args[i]) in _FLOATS for i in numbers) else ()), *(
        key for key, ops in _SCALED_BY.items() if type(kwargs.get(key)) in _FLOATS and op in ops
        and all(isinstance(t, torch.Tensor) for t in args[1:3]))]


# --- 9a. layouts: the _Layout value, meshes, XLA placement, batch and activation sharding ---------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a trainer puts its model, decided before anything moves (torchtitan's ParallelDims): print it,
    or build it in a test for any (device, strategy, plan, meta, ranks) case without placing anything."""

    kind: str  # "tpu", "xla", "gpu" or "cpu"
    device: torch.device
    strategy: str  # as asked: "ddp" or "fsdp"
    mesh: object = None  # XLA: the SPMD mesh the trainer keeps for its life
    batch: object = None  # XLA: the _BatchSharding of its batches (their batch dim over all axes but the model's)
    planned: dict = dataclasses.field(default_factory=dict)  # XLA: {parameter: spec} of the tensor-parallel plan
    styles: dict = None  # torch.distributed: {pattern: style} of the tensor-parallel plan (a name or a ParallelStyle)
    rank_axes: dict = None  # torch.distributed with a plan: {data or fsdp axis: size, "model": size} of the ranks
    data_ranks: tuple = None  # (data-parallel size, index) when tensor-parallel groups of ranks share batches
    wrap: str = None  # off XLA: "ddp", "fsdp2" or "tp" across ranks; None in one process
    meta_built: bool = False  # the model holds tensors on the meta device: made real as they are placed
    batch_dim: int = 0  # where batches hold their samples (on XLA also `batch.dim`, the one split)
    scan: bool = True  # XLA: stacks of repeated blocks run as one loop (9c)

    def __repr__(self):  # the mesh and the batch sharding by their axes, the planned weights by their count
        brief = {"mesh": self.mesh and _axis_sizes(self.mesh), "batch": self.batch and self.batch.axes,
                 "planned": len(self.planned), "styles": sorted(self.styles or ())}
        return "_Layout(" + ", ".join(f"{k}={brief.get(k, v)!r}" for k, v in vars(self).items()) + ")"

    def spec(self, param):
        """The partition spec of `param` on XLA: the plan's, else with fsdp one dimension over the fsdp axis (the
        largest that splits evenly, else the largest: XLA pads), else whole. What follows it: _lay_out_like."""
        if param in self.planned:
            return self.planned[param]
        shape, whole = tuple(param.shape), (None,) * param.dim()
        if self.strategy != "fsdp" or not shape:
            return whole
        shards = _axis_sizes(self.mesh)[FSDP_AXIS]
        dim = max([d for d in range(len(shape)) if shape[d] % shards == 0] or range(len(shape)), key=shape.__getitem__)
        return tuple(FSDP_AXIS if d == dim else None for d in range(len(shape)))


def create_xla_mesh(num_devices=None, num_processes=None, *, topology=None, xla_spmd_config=None, strategy="ddp"):
    """Build the torch_xla SPMD Mesh of this runtime's devices and make it the process mesh (get_xla_mesh()).
    num_devices and topology are checked against the runtime; num_processes (default: the runtime's) shapes "fsdp"."""
    mesh = _build_mesh(num_devices, num_processes, topology=topology, xla_spmd_config=xla_spmd_config,
                       strategy=strategy)
    _set_mesh(mesh)
    return mesh


def _build_mesh(num_devices=None, num_processes=None, *, topology=None, xla_spmd_config=None, strategy="ddp"):
    xr, np = _import("torch_xla.runtime"), _import("numpy")  # numpy: a torch_xla dependency
    _activate_xla(_auto_xla_kind())
    runtime_devices = xr.global_runtime_device_count()
    if num_devices is not None and num_devices != runtime_devices:
        raise ValueError(f"num_devices={num_devices!r} does not fit the runtime, which has {runtime_devices} "
                         f"devices; omit num_devices or match it")
    shape, names = mesh_shape_for(runtime_devices, xr.process_count() if num_processes is None else num_processes,
                                  topology=topology, xla_spmd_config=xla_spmd_config, strategy=strategy)
    mesh = _import("torch_xla.distributed.spmd").Mesh(np.arange(runtime_devices), shape, names)
    _log("seamless_tpu: XLA SPMD mesh %s axes %s (batch sharded over %s)", shape, names,
         tuple(n for n in names if n != MODEL_AXIS) or tuple(names))
    return mesh


def _axis_sizes(mesh):
    """{axis name (or index, for unnamed axes): size} of a torch_xla Mesh."""
    return dict(zip(mesh.axis_names or range(len(mesh.mesh_shape)), mesh.mesh_shape))


def _set_mesh(mesh, batch=None):
    """`mesh` becomes the process mesh (get_xla_mesh(), torch_xla's global mesh) and `batch` how to_device() splits."""
    _STATE.mesh, _STATE.batch_sharding = mesh, batch or _BatchSharding.for_mesh(mesh)
    _import("torch_xla.distributed.spmd").set_global_mesh(mesh)


def get_xla_mesh():
    """The SPMD mesh in use in this process, or None (not on XLA, or not set up yet)."""
    return _STATE.mesh


class _BatchSharding:
    """The batch dimension `dim` of every batch tensor over the batch axes, whatever its rank (dim 0 of one with no
    dimension `dim`: (B,) labels beside (T, B) tokens): torch_xla's ShardingSpec fits one rank and silently leaves the
    others replicated. One ShardingSpec per rank, made on first use; MpDeviceLoader's send_cpu_data_to_device needs
    only `xla_spec(tensor)` and `minibatch`."""

    def __init__(self, mesh, axes, minibatch=False, dim=0):
        self.mesh, self.axes, self.minibatch, self.dim, self._by_rank = mesh, axes, minibatch, dim, {}
        self.ways = math.prod(_axis_sizes(mesh)[a] for a in axes)  # devices that the batch splits over

    def from_host(self, tensor):
        """Whether torch_xla 2.9 can send `tensor` from the host split: a 1-D one split on some axes and replicated
        on others (labels beside a model axis) is an IndexError inside send_cpu_data_to_device, so it moves whole."""
        return tensor.dim() > 1 or self.ways == math.prod(self.mesh.mesh_shape)  # not replicated over a model axis

    @classmethod
    def for_mesh(cls, mesh, dim=0):
        """Every axis but the model axis (all when there is no other). Multi-host, each host feeds its slice."""
        names = tuple(_axis_sizes(mesh))
        batch = tuple(n for n in names if n != MODEL_AXIS)
        return cls(mesh, batch or names, minibatch=_import("torch_xla.runtime").process_count() > 1, dim=dim)

    def batch_dim(self, ndim):
        return self.dim if ndim > self.dim else 0

    def spec_for(self, ndim, at=None):
        """The batch axes on dimension `at` (default: this sharding's batch dim for that rank), None elsewhere."""
        head, at = self.axes[0] if len(self.axes) == 1 else tuple(self.axes), self.batch_dim(ndim) if at is None else at
        return tuple(head if d == at else None for d in range(ndim))

    def xla_spec(self, tensor):
        ndim = tensor.dim()
        if ndim not in self._by_rank:
            spmd = _import("torch_xla.distributed.spmd")
            self._by_rank[ndim] = spmd.ShardingSpec(self.mesh, self.spec_for(ndim), minibatch=self.minibatch)
        return self._by_rank[ndim].xla_spec(tensor)


def _to_xla(tensor, device, sharding):
    if sharding is None or tensor.dim() == 0:
        return tensor.to(device)
    plain = type(tensor) is torch.Tensor and tensor.device.type == "cpu" and not tensor.requires_grad
    if plain and sharding.from_host(tensor):
        # Sharded straight from host memory: no replicated copy to reshard later.
        return _import("torch_xla.core.xla_model").send_cpu_data_to_device([tensor], device, sharding)[0]
    # Subclasses (nn.Parameter, tv_tensors) and tensors with an autograd history move by their own
    # .to(), which keeps their type and graph as it does anywhere, then are resharded in place.
    tensor = tensor.to(device)
    _mark_sharding(tensor, sharding.mesh, sharding.spec_for(tensor.dim()))
    return tensor


def _mark_sharding(tensor, mesh, spec=None):
    """The one place a tensor gets an XLA sharding: `mesh` with a partition `spec`, or an OpSharding alone. A tensor
    an async step still computes raises "Data does not present on any device": only then, wait once and retry.
    Not through xs.mark_sharding: it tries to import torchax and jax on every call (2.4 ms each, where neither is
    installed), which block marks pay on every forward; the mesh caches its OpSharding per spec."""
    sharding = mesh if spec is None else mesh.get_op_sharding(tuple(spec))
    annotate = functools.partial(_import("torch_xla")._XLAC._xla_mark_sharding, tensor, sharding)
    try:
        annotate()
    except RuntimeError as e:
        if "Data does not present on any device" not in str(e):
            raise
        _import("torch_xla.core.xla_model").wait_device_ops()
        annotate()


def _lay_out_like(value, param):
    """`value` (a gradient, optimizer state, a loaded or initialised value) laid out as its parameter is: split like a
    DTensor (each rank keeps its part), marked like an XLA tensor (a host value is sent now, split: left replicated,
    4x an fsdp shard on 4 devices), or on its device. The one place a tensor follows its parameter."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None:
        if hasattr(value, "device_mesh") or value.shape != param.shape:
            return value
        dtensor = importlib.import_module("torch.distributed.tensor")
        return dtensor.distribute_tensor(value.to(param.device), mesh, param.placements, src_data_rank=None)
    value = value.to(param.device)
    if _is_xla(param.device) and value.shape == param.shape and not _is_split(value):
        xla = _import("torch_xla")._XLAC
        sharding = xla._get_xla_op_sharding(param)
        if sharding is not None and xla._get_xla_sharding_spec(value) != xla._get_xla_sharding_spec(param):
            _mark_sharding(value, sharding)
    return value


def _watch_inputs(model, sharding):
    """For the first INPUT_CHECKS forwards, warn once about an input on XLA replicated where its batch dimension
    could be split. Reads only each tensor's sharding annotation: no sync, no transfer, no new graph."""
    ways, left = sharding.ways, [INPUT_CHECKS]

    def check(module, args, kwargs):
        if _transformed():  # torch.func's wrappers carry no sharding annotation
            return
        found = []
        _map_tensors([args, kwargs], lambda t: found.append(t) or t, lambda obj: obj)
        for t in found:
            if not _is_xla(t.device) or t.dim() == 0 or t.shape[sharding.batch_dim(t.dim())] % ways or _is_split(t):
                continue
            # A tensor the step computes has no annotation until the compiler propagates one: not evidence.
            if _is_device_data(t) and _once("replicated_input"):
                logger.warning("seamless_tpu: a tensor of shape %s reaches the model replicated on XLA. If it is a "
                               "batch, each of the %d devices computes all of it (%dx the work for 1x the data). Move "
                               "batches with trainer.to_device(...) or trainer.prepare_data_loader(...), which split "
                               "the batch dimension, not with .to(device)", tuple(t.shape), ways, ways)
        left[0] -= 1
        if not left[0]:
            handle.remove()

    if ways > 1:
        handle = model.register_forward_pre_hook(_owned(model, check), with_kwargs=True)


def _shard_activations(model, batch, matmul_outputs=False):
    """Keep the batch split through the model, as torch_xla's FSDPv2 does: mark the batch dim of each repeated block's
    output (of its input's shape: transformer layers, HF decoder layers), of each RNN's input and state, a missing
    state made as split zeros, and of each EmbeddingBag's output (bags of 1-D ids with offsets ran whole). Without it
    "fsdp" let GSPMD split matmuls the tensor-parallel way and all-gather activations (a ViT: 1.5 MB a step against
    0.32 MB of weights). With `matmul_outputs` ("fsdp" without a plan) every Linear's and convolution's output too
    (attention outside a block ran 0.33 of its dots per device)."""
    if batch.ways == 1:
        return
    blocks = {id(child) for parent in model.modules() if isinstance(parent, (torch.nn.ModuleList, torch.nn.Sequential))
              and len(parent) > 1 and len({type(c) for c in parent}) == 1 for child in parent}

    def mark(t, dim):  # not data on the devices (a carried RNN state): marking that reshards it through the host
        if not (isinstance(t, torch.Tensor) and _is_xla(t.device) and t.dim() > dim and not t.shape[dim] % batch.ways):
            return t
        if _STATE.loops.tracing:  # a loop body's trace (9d): an op of the body, which marks it where it is lowered
            spmd = _import("torch_xla.distributed.spmd.xla_sharding")
            return spmd.MarkShardingFunction.apply(t, batch.mesh, batch.spec_for(t.dim(), dim))
        if not _transformed(t) and not _is_device_data(t):  # torch.func's wrappers carry no sharding
            _mark_sharding(t, batch.mesh, batch.spec_for(t.dim(), dim))
        return t

    def block_output(module, args, output):
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        residual = args and isinstance(args[0], torch.Tensor) and isinstance(first, torch.Tensor)
        if residual and first.shape == args[0].shape:
            marked = mark(first, batch.batch_dim(first.dim()))
            return marked if first is output else type(output)([marked, *output[1:]])

    def rnn_inputs(module, args):
        cell = isinstance(module, torch.nn.RNNCellBase)
        x, state = args[0], args[1] if len(args) > 1 else None
        if not (isinstance(x, torch.Tensor) and _is_xla(x.device) and x.dim() == 3 - cell):
            return None  # unbatched, or a packed sequence
        dim = 0 if cell or module.batch_first else 1
        x = mark(x, dim)
        if state is None:  # torch would start from zeros made whole: the first step's state matmuls all-gathered
            lstm, layers = isinstance(module, (torch.nn.LSTM, torch.nn.LSTMCell)), () if cell else (
                module.num_layers * (1 + module.bidirectional),)
            h = x.new_zeros(*layers, x.shape[dim], getattr(module, "proj_size", 0) or module.hidden_size)
            state = (h, x.new_zeros(*layers, x.shape[dim], module.hidden_size)) if lstm else h
        marked = tuple(mark(s, 0 if cell else 1) for s in (state if isinstance(state, tuple) else (state,)))
        return (x, marked if isinstance(state, tuple) else marked[0], *args[2:])  # (layers x dirs, B, h), or (B, h)

    def matmul_output(module, args, output):
        if isinstance(output, torch.Tensor):
            return mark(output, batch.batch_dim(output.dim()))

    for module in model.modules():
        if isinstance(module, (torch.nn.RNNBase, torch.nn.RNNCellBase)):
            module.register_forward_pre_hook(_owned(module, rnn_inputs))
        elif isinstance(module, torch.nn.EmbeddingBag):  # bags from offsets: where each lands is data, kept whole
            module.register_forward_hook(_owned(module, lambda _, args, output: mark(output, 0)))
        elif matmul_outputs and isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd)):
            module.register_forward_hook(_owned(module, matmul_output))
        elif id(module) in blocks:
            module.register_forward_hook(_owned(module, block_output))


def _is_device_data(tensor):
    """Data on the devices (a moved batch, a graph's output), not a value the pending graph computes: a copy of data
    (ASGD's eta, clone() of the lr) is a device_data node with no data of its own, an output of the next graph."""
    info = _import("torch_xla")._XLAC._get_xla_tensor_debug_info(tensor)
    ir = info.partition("IR: ")[2].partition("\n")[0]
    return ir.startswith("None") or "device_data" in ir and "XLAData: None" not in info


def _is_split(tensor):
    # XLA marks every tensor that a replicated graph computed "{replicated}": nobody chose that.
    return _import("torch_xla")._XLAC._get_xla_sharding_spec(tensor) not in ("", "{replicated}")

def _tp_layout(model, tp_plan, mesh, xla_spmd_config, strategy, distributed):
    """(XLA specs by parameter, torch ParallelStyles by pattern, rank axis sizes) of the tensor parallelism. Off XLA
    the ranks form a mesh too, by default (world / N, N), N = model_parallel_size: neighbours form a group."""
    sizes = _axis_sizes(mesh) if mesh is not None else {}
    if distributed and xla_spmd_config is not None:
        shape, names = _mesh_from_config(xla_spmd_config, _torch_dist_ranks()[0], strategy)
        sizes = dict(zip(names, shape))
    model_size = sizes.get(MODEL_AXIS, 1)
    if model_size == 1:
        if tp_plan is not None:
            raise ValueError(f"tp_plan splits weights over a '{MODEL_AXIS}' mesh axis, and this trainer's mesh has "
                             f"none of size > 1 (axes {dict(sizes)}); pass xla_spmd_config={{'model_parallel_size': "
                             "N}, or drop tp_plan")
        return {}, None, None
    plan = _model_tp_plan(model) if tp_plan is None else tp_plan
    if not plan:
        raise ValueError(f"the mesh's '{MODEL_AXIS}' axis has size {model_size}, but there is no tensor-parallel "
                         f"plan, so the {model_size} devices of each '{MODEL_AXIS}' row would compute the same thing. "
                         "Pass tp_plan= (e.g. {'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': "
                         "'rowwise'}), or drop the axis (model_parallel_size=1, or a mesh without it)")
    planned = _tp_specs(model, plan, sizes, xla=mesh is not None)
    if mesh is not None:
        return planned, None, None
    _check_torch_tp_plan(plan, sizes)
    return {}, plan, sizes


def _plan_layout(model, device, mesh, xla_spmd_config, strategy, tp_plan, batch_dim=None, scan=True):
    """The _Layout of a trainer, every argument and plan error raised before anything moves or the process mesh
    changes (_place installs it). On XLA the mesh is the one passed, one built, or the process mesh, and is kept for
    the trainer's life, whatever later replaces the process mesh."""
    kind, device, dim = _resolve_kind(device), get_device(device), _batch_dim(model, batch_dim)
    xla, (world, rank) = _is_xla(device), _torch_dist_ranks()
    if not xla and (mesh is not None or (xla_spmd_config is not None and world == 1)):
        raise ValueError(f"mesh/xla_spmd_config apply to XLA devices, or to several torch.distributed ranks, but the "
                         f"device is {device} in one process")
    if xla and mesh is not None and strategy == "fsdp":
        _check_fsdp_axis(mesh.axis_names, "the mesh passed as mesh=")
    elif xla and mesh is None:
        mesh = (_build_mesh(xla_spmd_config=xla_spmd_config, strategy=strategy)
                if xla_spmd_config is not None or strategy == "fsdp" else _STATE.mesh)
    batch = None
    if xla:  # the process's batch sharding when this is the process mesh and the batch dim is the same
        same = mesh is _STATE.mesh and dim == _STATE.batch_sharding.dim
        batch = _STATE.batch_sharding if same else _BatchSharding.for_mesh(mesh, dim)
        if dim and batch.minibatch:
            raise ValueError(f"batch_dim={dim} on several hosts: torch_xla 2.9 assembles a multi-host batch along "
                             f"dim 0 only (ShardingSpec minibatch); move batches with the batch first (x.transpose(0, "
                             f"{dim})) and pass batch_dim=0")
    distributed = mesh is None and world > 1
    planned, styles, rank_axes = _tp_layout(model, tp_plan, mesh, xla_spmd_config, strategy, distributed)
    wrap = ("tp" if styles else "fsdp2" if strategy == "fsdp" else "ddp") if distributed else None
    data_ranks = (world // rank_axes[MODEL_AXIS], rank // rank_axes[MODEL_AXIS]) if rank_axes else None
    if not isinstance(scan, bool):
        raise TypeError(f"scan must be True (repeated blocks run as one loop on XLA) or False, got {_shown(scan)}")
    return _Layout(kind, device, strategy, mesh, batch, planned, styles, rank_axes, data_ranks, wrap,
                   _has_meta_tensors(model), dim, scan)

# --- 9b. torch.distributed placement, optimizer rebinding, and the placement pipeline -------------


_SHARDED_AS = "_seamless_tpu_sharded_as"  # on a parameter fully_shard replaced: the DTensor that replaced it


def _replicate(model, device):
    """DDP on `model` itself (torch's composable replicate): backward averages the gradients whichever object the
    loop calls. Without find_unused_parameters (no graph walk per forward) until _UnusedCheck finds a rank leaving a
    parameter out. A DDP model is used as is: wrapping twice all-reduces twice."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model
    replicate = importlib.import_module("torch.distributed._composable.replicate")
    replicate.replicate(model, device_id=device.index if device.type == "cuda" else device)
    replicate.replicate.state(model).lazy_init()  # now, not at the first forward: its broadcast is a collective
    _UnusedCheck(model, replicate.replicate.state(model), device)
    if not hasattr(model, "no_sync"):  # DDP's own spelling for gradient accumulation, on this model's class only
        type(model).no_sync = _no_sync
    return model


class _UnusedCheck:
    """Which parameters the ranks use, read from the first step's gradients: DDP without find_unused_parameters hangs
    or raises when a rank leaves one out. The first averaging forward runs as under no_sync; at the end of its
    backward one all-reduce sums a used-mask and the gradients. Then every rank keeps DDP or rebuilds it with
    find_unused_parameters=True. A parameter left out only after step 1 gets DDP's error (wrap it in DDP yourself)."""

    def __init__(self, model, state, device):
        self.state, self.device, self.armed, self.forcing = state, device, False, False
        self.handles = [model.register_forward_pre_hook(self.before, prepend=True),
                        model.register_forward_hook(self.after, always_call=True)]
        self.handles += [p.register_post_accumulate_grad_hook(self.accumulated)
                         for p in state._param_list if p.requires_grad]

    def before(self, module, args):
        if torch.is_grad_enabled() and not self.state._no_sync:  # a forward DDP would average: not yet
            self.state._no_sync = self.armed = self.forcing = True

    def after(self, module, args, output):
        if self.forcing:
            self.state._no_sync = self.forcing = False

    def accumulated(self, param):  # in the backward of a forced forward: the check runs once it ends
        if self.armed:
            self.armed = False
            torch.autograd.Variable._execution_engine.queue_callback(self.agree)

    def agree(self):
        dist, params = torch.distributed, [p for p in self.state._param_list if p.requires_grad]  # DDP's own
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(used)
        world, used = dist.get_world_size(), used.tolist()  # a sync, once
        for p, count in zip(params, used):
            if count:  # as DDP: divided, then summed; a parameter no rank used keeps grad None
                grad = (p.grad if p.grad is not None else torch.zeros_like(p)).div(world).contiguous()
                dist.all_reduce(grad)
                p.grad = grad
        for handle in self.handles:
            handle.remove()
        if min(used) < world:
            old = self.state._ddp
            old.reducer._remove_autograd_hooks()
            ddp = torch.nn.parallel.DistributedDataParallel(
                self.state._param_list, device_ids=[self.device] if self.device.type == "cuda" else None,
                find_unused_parameters=True)
            self.state._ddp, self.state._ddp_weakref = ddp, weakref.ref(ddp)
            _log("seamless_tpu: %d of %d parameters were left out by some rank at the first step: DDP now finds the "
                 "unused ones at each forward (find_unused_parameters=True)", sum(c < world for c in used),
                 len(params))


@contextlib.contextmanager
def _no_sync(model):
    """DistributedDataParallel.no_sync: backward inside accumulates locally; the first one after averages it all."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _fully_shard(model, device, styles=None, sizes=None):
    """FSDP2 over every rank, each block of a ModuleList (a transformer's layers) a unit gathered just for its
    forward. Tensor-parallel `styles` go first through parallelize_module on the model dimension of a 2-D
    DeviceMesh (axis `sizes`), and FSDP2 splits over the other."""
    fsdp = importlib.import_module("torch.distributed.fsdp")
    sizes = sizes or {FSDP_AXIS: _torch_dist_ranks()[0]}
    mesh = importlib.import_module("torch.distributed.device_mesh").init_device_mesh(
        device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    if styles:
        tp = importlib.import_module("torch.distributed.tensor.parallel")
        _replacing_parameters(model, lambda: tp.parallelize_module(model, mesh[MODEL_AXIS], _torch_tp_styles(
            styles, sizes)))
        mesh = mesh[FSDP_AXIS]  # FSDP2 replaces them again: optimizers follow the chain
    # Each distinct block once: ModuleList([blk] * 3) shares one, and fully_shard twice is an AssertionError in torch.
    blocks = list({id(b): b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m}.values())

    def shard():
        for block in reversed(blocks):  # innermost first: a unit must not already hold another's parameters
            if next(block.parameters(), None) is not None:
                fsdp.fully_shard(block, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)

    _replacing_parameters(model, shard)


def _torch_tp_styles(plan, sizes):
    """The plan (checked by _check_torch_tp_plan when the layout was made) as torch ParallelStyles."""
    tp = importlib.import_module("torch.distributed.tensor.parallel")
    replicate_layout = importlib.import_module("torch.distributed.tensor").Replicate()
    styles = {}
    for pattern, style in plan.items():
        if not isinstance(style, str):
            styles[pattern] = style  # torch's own ParallelStyle
        elif TP_STYLES[style] == "out":
            gather = style in ("colwise_gather_output", "colwise_rep")
            styles[pattern] = tp.ColwiseParallel(output_layouts=replicate_layout) if gather else tp.ColwiseParallel()
        else:
            whole_input = style in ("embedding_rowwise", "rowwise_split_input")
            styles[pattern] = tp.RowwiseParallel(**({"input_layouts": replicate_layout} if whole_input else {}))
    return styles


def _replacing_parameters(model, replace):
    """Run replace() (fully_shard, parallelize_module), which swaps in parameters an optimizer made earlier lacks:
    each replaced one names its replacement, and optimizers move over before their first step."""
    before = dict(model.named_parameters())
    replace()
    for name, param in model.named_parameters():
        if before[name] is not param:
            setattr(before[name], _SHARDED_AS, param)
    _STATE.rebinding = True  # the pre-step hook moves optimizers over (8)


def _place_optimizer_state(optimizer):
    """Point `optimizer` at the parameters that replaced its own, each state tensor laid out like its parameter.
    The trainer's constructor, the pre-step rebinding, the first step's state and load_checkpoint all come here."""
    for group in optimizer.param_groups:
        for i, old in enumerate(group["params"]):
            param = old
            while hasattr(param, _SHARDED_AS):  # tensor parallel, then FSDP2: a chain of replacements
                param = getattr(param, _SHARDED_AS)
            group["params"][i] = param
            state = optimizer.state.pop(old, None)
            if state:
                optimizer.state[param] = _state_like(state, param)


def _state_like(state, param):
    """An optimizer's state of `param`, each tensor laid out like it; Adam keeps a CPU scalar 'step' on purpose
    (unless capturable or fused), and scalars stay where they are."""
    return {k: v if not isinstance(v, torch.Tensor) or v.dim() == 0 or k == "step" else _lay_out_like(v, param)
            for k, v in state.items()}


def _place(model, layout):
    """The model placed as `layout` says, in the one order that works, and returned (in DDP across ranks). Meta
    tensors are made real as they will be trained: on XLA split as they are made, under FSDP2 after it split them
    (each rank allocates only its shards), else whole."""
    xla, fsdp, fsdp2 = _is_xla(layout.device), layout.strategy == "fsdp", layout.wrap == "fsdp2"
    if xla:
        _set_mesh(layout.mesh, layout.batch)  # the process mesh, and to_device()'s split, are this trainer's
    elif fsdp and not layout.wrap and _once("fsdp_single"):
        _log("seamless_tpu: strategy='fsdp' on one %s process has nothing to shard over; running as 'ddp'",
             layout.device.type)
    if layout.meta_built:
        _materialize(model, layout, lay_out=not fsdp2)
    if not (layout.meta_built and fsdp2):
        _STATE.loops.placing, _STATE.loops.scan = True, layout.scan if xla else _STATE.loops.scan
        try:
            model.to(layout.device)
        finally:
            _STATE.loops.placing = False
    if xla:
        # Each parameter by its spec (FSDPv2 under fsdp): XLA gives the gradients the same sharding and puts the
        # all-gathers and reduce-scatters in the step graph. Split ones stay as they are.
        for param in model.parameters():
            spec = layout.spec(param)
            if any(spec) and not _is_split(param):
                _mark_sharding(param, layout.mesh, spec)
            if fsdp and FSDP_AXIS in torch.utils._pytree.tree_leaves(spec):
                _STATE.cuts.gathered.add(id(param))
                _register_autocast_casts()
            else:  # an id once a dead fsdp parameter's
                _STATE.cuts.gathered.discard(id(param))
        # The rest whole, said so: unmarked, step 1 read them unsharded and step 2 as its "{replicated}" outputs, a
        # second compile of the whole step.
        for t in itertools.chain(model.parameters(), model.buffers()):
            if not _import("torch_xla")._XLAC._get_xla_sharding_spec(t):
                _mark_sharding(t, layout.mesh, (None,) * t.dim())
        _moe_experts_dense()
        if model not in _STATE.cuts.models:  # a second trainer of the same model adds no second set of hooks
            if layout.scan and _private_apis():
                _find_loops(model, layout)
            _watch_inputs(model, layout.batch)
            _shard_activations(model, layout.batch, fsdp and not layout.planned)
            _check_work(model, layout)
            _cut_each_iteration(model)
    if layout.meta_built and not xla and not fsdp2:
        _initialize_pending(model)  # whole on each process, as DDP and TP want it
    if layout.wrap in ("tp", "fsdp2"):
        _fully_shard(model, layout.device, layout.styles, layout.rank_axes)
    if fsdp2 and layout.meta_built:
        _initialize_pending(model, layout.device)  # each module on the CPU in turn, each rank keeping its shards
    if layout.wrap == "ddp":
        return _replicate(model, layout.device)
    return model

# --- 9c. repeated blocks: which stacks run as one loop ---------------------------------------------
# A stack of blocks of one class (a ModuleList or Sequential) that its owner's forward runs as `x = block(x, ...)`,
# and nothing else, runs as one XLA While loop over the blocks' stacked weights: one turn traced, compiled and, under
# fsdp, gathered at a time. A turn is one block, or a period of them (Gemma2's sliding and global layers); blocks
# before and after the run that repeats (T5's first) run on their own. Which blocks share a turn's body is proven
# where the body is traced (9d), not guessed here. The owner's loop gets a _BlockCall per block: a looped one records
# its arguments and hands its input on unchanged (the source check says nothing reads it), and the last runs the loop.

MAX_PERIOD = 8  # blocks a turn at most (Gemma3: 6)


class _NotALoop(Exception):
    """These blocks, called so, run one by one (the message says why): raised by a check or the body's trace."""


@dataclasses.dataclass
class _Loops:
    """The stacks that run as loops (9c): container -> _Stack; tracing: a body is being traced (its activation marks
    become ops of the body, 9a)."""

    stacks: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    tracing: bool = False
    scan: bool = True  # the last XLA trainer's: whether a module moved to XLA by .to loops too
    placing: bool = False  # a trainer moves its model: its own layout decides its loops


class _Stack:
    """A registered stack: its blocks as `members()` gives them, how the owner's forward calls them (`form`), how
    they repeat (`plan`: blocks[start:stop] loop, `period` a turn; None and `reason` where none do), and one cache of
    the bodies traced for it (9d), each under a key holding all its trace assumed."""

    def __init__(self, members, form, where):
        self.members, self.form, self.where, self.blocks = members, form, where, None
        self.slices = {}  # (start, stop) -> the _Stack of a slice the owner iterates (self.layers[:n])
        self.refresh()

    def refresh(self):
        """Plan again where the container's members changed (append, replace, delete): the bodies and stacks go."""
        blocks = self.members()
        if self.blocks is not None and len(blocks) == len(self.blocks) and all(map(operator.is_, blocks, self.blocks)):
            return
        replanned = self.blocks is not None
        self.blocks, self.calls, self.bodies, self.frozen, self.indices, self.watch = blocks, [], {}, {}, {}, None
        self.tokens = {}  # the blocks' states key (_states_key) -> a number for the bodies' keys
        self.written = set()  # attributes a body's trace saw written
        self.plan, self.reason = _plan([_block_state(b) for b in blocks]) if len(blocks) > 1 else (
            None, "it holds one block")
        if replanned and self.reason:
            _say_unrolled(self.where, len(blocks), self.reason)

    @property
    def looped(self):
        return self.blocks[self.plan.start:self.plan.stop]

    def block_calls(self):
        self.refresh()
        self.calls = []
        return [_BlockCall(self, k) for k in range(len(self.blocks))]

    def call(self, k, x, args, kwargs):
        plan = self.plan
        if plan is None or not plan.start <= k < plan.stop:  # before or after the run that repeats
            return self.blocks[k](x, *args, **kwargs)
        if k - plan.start != len(self.calls) or (self.calls and x is not self.calls[0][0]):
            raise RuntimeError(f"seamless_tpu bug: the loop over {self.where} called block {k} out of order")
        self.calls.append((x, args, kwargs))
        if k < plan.stop - 1:  # the next block's input (the source check proved nothing else reads it), and the
            return self.form.result(x, args, kwargs)  # values passed on as they came
        calls, self.calls = self.calls, []
        return _run_blocks(self, calls)


class _Plan(collections.namedtuple("_Plan", "start stop period")):
    """blocks[start:stop] run as one loop, `period` blocks a turn."""


class _BlockCall:
    """What the owner's loop gets for block `k`: the block's attributes, and a call that goes to the stack."""

    __slots__ = ("_stack", "_k")

    def __init__(self, stack, k):
        self._stack, self._k = stack, k

    def __getattr__(self, name):
        return getattr(self._stack.blocks[self._k], name)

    def __call__(self, x, *args, **kwargs):
        return self._stack.call(self._k, x, args, kwargs)


def _find_loops(model, layout):
    """Register every stack of `model` that can run as a loop, its container's class swapped for one whose iteration
    gives _BlockCalls to the owner's checked forward; log once why a stack of blocks cannot."""
    named = dict(model.named_modules())
    for path, container in named.items():
        if (not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)) or len(container) < 2
                or container in _STATE.loops.stacks):
            continue
        blocks, where = list(container._modules.values()), path or type(model).__name__
        if len({type(b) for b in blocks}) > 1 or next(blocks[0].parameters(), None) is None:
            continue  # not a stack of blocks (a Sequential of layers, a list of parameterless modules)
        owner_path, _, attr = path.rpartition(".")
        owner = named.get(owner_path) if path else None
        form, reason = _loop_code(owner, attr) if owner is not None else (None, "it has no owner module")
        if form is None and isinstance(container, torch.nn.Sequential):
            form, reason = _loop_code(container, None)  # its own forward: called, not iterated, by its owner
        stack = form and _Stack(lambda c=container: list(c._modules.values()), form, where)
        reason = reason or stack.reason or _splits_lost(stack.looped, layout)
        if reason:
            _say_unrolled(where, len(blocks), reason)
            continue
        _STATE.loops.stacks[container] = stack
        container.__class__ = _looped_class(type(container))
        _STATE.torch_patches.append(functools.partial(_unloop, weakref.ref(container), type(container).__base__))


def _loops_of_moved(module):
    """A module moved to XLA by .to or to_device (a teacher, a reference model): its stacks loop as a trainer's, under
    the last XLA trainer's `scan` and the process's batch split (no tensor-parallel plan). A trainer's model is its
    trainer's to place."""
    if _STATE.xla_device is not None and _STATE.loops.scan and not _STATE.loops.placing and (
            module not in _STATE.cuts.models) and _private_apis():
        batch = _STATE.batch_sharding
        _find_loops(module, types.SimpleNamespace(planned={}, batch_dim=batch.dim if batch else 0))


def _unloop(container, cls):  # _reset_caches: the container's own class back
    if container() is not None:
        container().__class__ = cls


@functools.cache
def _looped_class(cls):
    """`cls` (ModuleList, Sequential or a subclass) whose __iter__ gives the forward whose loop was checked (its code
    object, one frame up) _BlockCalls, and whose slices taken there are stacks too. Swapped onto registered containers
    alone, as torch's parametrize swaps a module's class: every other container keeps its own. Pickled and deep-copied
    as `cls` (an EMA copy of the model holds plain containers)."""
    def __iter__(self):
        stack = _STATE.loops.stacks.get(self)
        if stack is None or sys._getframe(1).f_code is not stack.form.code:
            return cls.__iter__(self)
        return iter(stack.block_calls())

    def __getitem__(self, idx):
        part, stack = cls.__getitem__(self, idx), _STATE.loops.stacks.get(self)
        if stack is not None and isinstance(idx, slice) and sys._getframe(1).f_code is stack.form.code:
            key = idx.indices(len(self))
            if key not in stack.slices:
                blocks = lambda: stack.members()[slice(*key)]  # noqa: E731
                stack.slices[key] = _Stack(blocks, stack.form, f"{stack.where}[{key[0]}:{key[1]}]")
            if stack.slices[key].plan is not None:
                _STATE.loops.stacks[part] = stack.slices[key]
        return part

    def __reduce_ex__(self, protocol):
        reduced = object.__reduce_ex__(self, protocol)  # (copyreg.__newobj__, (class, ...), state, ...)
        return (reduced[0], (cls, *reduced[1][1:]), *reduced[2:])

    return type(cls.__name__, (cls,), {"__iter__": __iter__, "__getitem__": __getitem__, "__reduce_ex__": __reduce_ex__,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _splits_lost(blocks, layout):
    """Why a loop would lose the batch split where the blocks unrolled keep it (None: it would not). A loop's body is
    traced by AOTAutograd, where the lowerings of 7c-7f give way to torch's composites (its einsum folds dimensions)."""
    if any(p in layout.planned for b in blocks for p in b.parameters()):
        return ("its weights are split by the tensor-parallel plan, and inside a loop torch's matmul folds (batch, "
                "heads) into one dimension, of which GSPMD keeps one split of two")
    if layout.batch_dim:
        return (f"batches hold their samples on dim {layout.batch_dim}, and inside a loop torch's matmul folds (T, B) "
                "into one dimension, of which GSPMD keeps no split")
    if any(getattr(m, "groups", 1) > 1 for b in blocks for m in b.modules()
           if isinstance(m, torch.nn.modules.conv._ConvNd)):
        return "a block holds a grouped convolution, whose batch GSPMD gathers inside a loop (7c's lowering is off)"
    return None


def _say_unrolled(where, count, reason):
    if _once(("unrolled", where, reason)):
        _log("seamless_tpu: the %d blocks of %s run one by one, not as one loop: %s", count, where, reason)


# A module's own bookkeeping, which _block_state leaves out: its hooks (checked at each call, 9d), and its
# parameters, buffers and submodules (described by name, shape and dtype)
_MODULE_BOOKS = frozenset(vars(torch.nn.Module())) - {"training"}


_MISSING = object()


class _ModuleState(collections.namedtuple("_ModuleState", "name cls attrs params buffers")):
    """One module of a block as its forward may read it: its path in the block, its class, its attributes ((name,
    _plain value), ...) and its parameters' and buffers' (name, shape, dtype)."""

    def where(self, attr):
        return f"{self.name + '.' if self.name else ''}{attr}"

    def without(self, attrs):
        """This state with the attributes in `attrs` (names) read as None: values the body's trace proves unread."""
        return self._replace(attrs=tuple((k, None if k in attrs else v) for k, v in self.attrs))

    def apart(self, other):
        """The attributes whose values this state and `other` hold apart, in order."""
        mine, theirs = dict(self.attrs), dict(other.attrs)
        return [k for k in dict.fromkeys((*mine, *theirs)) if mine.get(k, _MISSING) != theirs.get(k, _MISSING)]


def _block_state(block, seen=None):
    """What a block's forward may read, as comparable values: a _ModuleState per module (its attributes: private ones,
    `training`, an object's such as a config's one level down). `seen` shares one object's value between blocks (a
    config they all hold) within one call."""
    seen = {} if seen is None else seen
    return tuple(_ModuleState(name, type(m), tuple((k, _plain(v, seen, 0)) for k, v in m.__dict__.items()
                                                   if k not in _MODULE_BOOKS),
                              tuple((k, p.shape, p.dtype) for k, p in m._parameters.items() if p is not None),
                              tuple((k, b.shape, b.dtype) for k, b in m._buffers.items() if b is not None))
                 for name, m in block.named_modules())


_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _plain(v, seen, depth):
    """`v` as a hashable value that equals another's where a forward reading either would do the same: containers
    walked, an object by its attributes (to depth 2), a tensor, a module or anything unhashable by identity."""
    if type(v) in _PLAIN_TYPES:
        return v
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_plain(w, seen, depth) for w in v)
    if isinstance(v, Mapping):
        return type(v), tuple((k, _plain(w, seen, depth)) for k, w in v.items())
    if isinstance(v, (torch.Tensor, torch.nn.Module)):
        return type(v), id(v)
    if isinstance(v, functools.partial):  # transformers' activations: one per layer, equal by what they call
        return type(v), v.func, _plain(v.args, seen, depth), _plain(v.keywords, seen, depth)
    if hasattr(v, "__dict__") and not callable(v) and depth < 2:
        if id(v) not in seen:
            seen[id(v)] = None  # a cycle back to it reads as its identity
            seen[id(v)] = type(v), tuple((k, _plain(w, seen, depth + 1)) for k, w in vars(v).items())
        return seen[id(v)] or (type(v), id(v))
    try:
        hash(v)
    except TypeError:
        return type(v), id(v)
    return v


def _plan(states):
    """(the longest run of blocks that repeats with a period of at most MAX_PERIOD blocks, twice or more: the most
    blocks, then the shortest period, then the earliest; None), or (None, why). An attribute whose value differs in
    every block (an index, a module path holding one) counts as equal here: the body's trace proves it unread (9d)."""
    values = collections.defaultdict(list)
    for state in states:
        for m in state:
            for k, v in m.attrs:
                values[m.name, k].append(v)
    index = {key for key, vs in values.items() if len(vs) == len(states) and len(set(vs)) == len(vs)}
    sigs = [tuple(m.without({k for name, k in index if name == m.name}) for m in state) for state in states]
    held = _holds(states[0])
    if held:
        return None, held
    n, best = len(sigs), None
    for period in range(1, min(MAX_PERIOD, n // 2) + 1):
        for start in range(n - 2 * period + 1):
            stop = start + period
            while stop + period <= n and sigs[stop:stop + period] == sigs[start:start + period]:
                stop += period
            if stop - start >= 2 * period and (best is None or stop - start > best.stop - best.start):
                best = _Plan(start, stop, period)
    if best is None:
        k = next(k for k in range(1, n) if sigs[k] != sigs[0])
        return None, f"no run of blocks repeats ({_difference(sigs[0], sigs[k], k, 0)})"  # an index left out
    return best, None


def _holds(state, written=()):
    """Why a block of this state cannot share a body with others (None if it can): buffers, which a forward may
    update (running statistics), or a tensor neither parameter nor buffer, which the body would hold as a constant
    (or which its forward writes: `written`, the attributes a trace saw written)."""
    if any(m.buffers for m in state):
        return "the blocks hold buffers, which a forward may update (running statistics)"
    held = next((m.where(k) for m in state for k, v in m.attrs
                 if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], type) and issubclass(v[0], torch.Tensor)),
                None)
    if held and held in written:
        return f"a block's forward writes {held}"
    return held and f"a block holds the tensor {held!r}, neither parameter nor buffer"


def _difference(a, b, k, j):
    """What block k's state `b` holds apart from block j's `a`, in words (None: nothing)."""
    if [(m.name, m.cls) for m in a] != [(m.name, m.cls) for m in b]:
        return f"block {k} differs from block {j} in its modules"
    for ma, mb in zip(a, b):
        if (ma.params, ma.buffers) != (mb.params, mb.buffers):
            return f"block {k} differs from block {j} in the parameters or buffers of module {ma.name!r}"
        for attr in ma.apart(mb)[:1]:
            return _attr_difference(ma, mb, k, j, attr)
    return None


def _attr_difference(ma, mb, k, j, attr):
    """How block k's module state `mb` holds `attr` apart from block j's `ma`, in words: both values."""
    return (f"block {k} differs from block {j} in {ma.where(attr)} ({_shown(_raw(dict(mb.attrs).get(attr)), 30)} "
            f"against {_shown(_raw(dict(ma.attrs).get(attr)), 30)})")


def _raw(v):  # _plain's value, shown: a container's contents, an object's type
    return v[1] if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], type) else v


class _Form(collections.namedtuple("_Form", "code outputs feeds")):
    """How the owner's forward calls its blocks: `code`, its code object; `outputs`, how many values a block returns
    (0: one tensor); `feeds`, {output: where the next call takes it, ("arg", i) or ("kw", name)}, for what a block
    returns to be passed on (T5's position bias: `x, bias, _ = block(x, mask, bias)`; `bias` = the output)."""

    def fed(self, args, kwargs):
        """What the owner gets from a block that hands on its input: that input, and the values it passed in for the
        outputs it feeds on (the loop's body proves each one handed on as it came), None for the rest."""
        return {i: args[at] if kind == "arg" else kwargs.get(at) for i, (kind, at) in self.feeds.items()}

    def result(self, x, args, kwargs):
        fed = self.fed(args, kwargs)
        return x if not self.outputs else (x, *(fed.get(i) for i in range(1, self.outputs)))

    def carried(self, out):
        return out[0] if self.outputs else out

    def passed_on(self, out, args, kwargs):
        """The next call's (args, kwargs) with each output fed on in its place, as the owner's loop passes them."""
        args, kwargs = list(args), dict(kwargs)
        for i, (kind, at) in self.feeds.items():
            if kind == "arg":
                args[at] = out[i]
            else:
                kwargs[at] = out[i]
        return tuple(args), kwargs


def _loop_code(owner, attr):
    """(_Form of owner's forward, None) if its one loop over self.<attr> (self, for attr None) is `x = block(x, ...)`
    and reads the block only for attributes, or `x, *outs = block(x, ...)` followed by `name = out` (under an `if`
    at most) for names passed on to the next call, the outs read nowhere else; else (None, why). `self` is the
    forward's first argument, by any name."""
    forward = inspect.unwrap(type(owner).forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):  # no source (a compiled or generated forward)
        return None, f"the source of {type(owner).__name__}.forward is not available to check its loop"
    me = forward.__code__.co_varnames[0] if forward.__code__.co_argcount else None

    def over(node):  # self.<attr>, self.<attr>[...], enumerate(either)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "enumerate":
            node = node.args[0] if len(node.args) == 1 else None
        node = node.value if isinstance(node, ast.Subscript) else node
        if attr is None:
            return isinstance(node, ast.Name) and node.id == me
        return isinstance(node, ast.Attribute) and node.attr == attr and getattr(node.value, "id", None) == me

    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and over(n.iter)]
    name = type(owner).__name__ + ".forward"
    if len(loops) != 1:
        return None, f"{name} iterates it {len(loops)} times, not once" if loops else f"{name} does not iterate it"
    loop = loops[0]
    target = loop.target.elts[-1] if isinstance(loop.target, ast.Tuple) else loop.target
    first, call = loop.body[0], getattr(loop.body[0], "value", None)
    assigned = first.targets[0] if isinstance(first, ast.Assign) and len(first.targets) == 1 else None
    outs = assigned.elts if isinstance(assigned, ast.Tuple) else [assigned]
    ok = (all(isinstance(n, ast.Name) for n in outs) and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
          and call.func.id == target.id and call.args and isinstance(call.args[0], ast.Name)
          and call.args[0].id == outs[0].id and not loop.orelse)
    feeds = _feeds(loop.body[1:], call, outs) if ok else None
    ok = feeds is not None
    if ok:  # the carried value and the block appear nowhere else in the call (the block's attributes may), the outs
        rest = [*call.args[1:], *call.keywords]  # nowhere but where they are passed on
        names = [n for r in rest for n in ast.walk(r) if isinstance(n, ast.Name)]
        attrs = {id(n.value) for r in rest for n in ast.walk(r) if isinstance(n, ast.Attribute)}
        reads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        ok = not any(n.id == outs[0].id or (n.id == target.id and id(n) not in attrs) for n in names) and sum(
            n.id in {o.id for o in outs[1:]} for n in reads) == len(feeds)
    if not ok:
        return None, f"the loop in {name} (line {loop.lineno}) does more than `x = block(x, ...)`"
    return _Form(forward.__code__, len(outs) if isinstance(assigned, ast.Tuple) else 0, feeds), None


def _feeds(rest, call, outs):
    """{output index: where `call` takes it}, for each statement of `rest` (the loop's body after the call) that is
    `name = out` (under an `if` that reads no output, at most) with `name` a whole argument of the call; None if one
    is anything else."""
    feeds, outs = {}, [o.id for o in outs]
    for stmt in rest:
        guarded = isinstance(stmt, ast.If) and not stmt.orelse
        if guarded and any(isinstance(n, ast.Name) and n.id in outs for n in ast.walk(stmt.test)):
            return None
        for s in stmt.body if guarded else [stmt]:
            if not (isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
                    and isinstance(s.value, ast.Name) and s.value.id in outs[1:]):
                return None
            name = s.targets[0].id
            where = [("arg", i - 1) for i, a in enumerate(call.args) if i and getattr(a, "id", None) == name] + [
                ("kw", k.arg) for k in call.keywords if k.arg and getattr(k.value, "id", None) == name]
            if len(where) != 1:
                return None
            feeds[outs.index(s.value.id)] = where[0]
    return feeds

# --- 9d. repeated blocks: running the loop ---------------------------------------------------------
# The last looped block's call runs the looped blocks as one XLA While over their stacked parameters, or one by one
# with the arguments each was given where a loop would differ (and says why, once). One cache per stack holds the
# traced bodies, under a key of everything a trace assumed, re-read at each call: the calls' arguments; each block's
# state (9c) against its turn's, where the body read; grad mode, autocast, the mesh and the matmul precision. The
# trace proves what it assumed: an attribute that differs within a turn's blocks is unreadable while it runs
# (_Unread), and an attribute it wrote, random numbers Python drew or any failure keeps the blocks unrolled.


def _run_blocks(stack, calls):
    """The looped blocks' calls as one loop, else one by one with the arguments each was given."""
    try:
        return _run_loop(stack, calls)
    except _NotALoop as e:
        if str(e):  # "": torch.func or forward-mode AD, which runs the blocks one by one silently
            _say_unrolled(stack.where, len(calls), str(e))
    x, form, out = calls[0][0], stack.form, None
    for block, (_, args, kwargs) in zip(stack.looped, calls):
        if out is not None and form.feeds:  # what the last block passed on, not what the owner took from us
            args, kwargs = form.passed_on(out, args, kwargs)
        out = block(x, *args, **kwargs)
        x = form.carried(out)
    return out


class _Run(collections.namedtuple("_Run", "stack calls args body")):
    """One call of a loop: its stack, the calls recorded, their _Arguments and the _Body that runs them."""


def _run_loop(stack, calls):
    """The looped blocks as one loop; the body for their key traced first if the stack's cache has none."""
    args = _Arguments(stack, calls)
    if stack.watch is None or not stack.watch.same():
        stack.watch = None
        stack.watch = _Watch(stack.looped, _states_key(stack), stack.tokens)
    key = (args.key, stack.watch.token, _torch_state())
    body = stack.bodies.get(key)
    if isinstance(body, str):
        raise _NotALoop(body)
    run = _Run(stack, calls, args, body)
    if args.cache is not None and _holding(run):  # generation: the blocks one by one, on what the cache holds
        raise _NotALoop(_holding(run))
    inputs = _loop_inputs(stack, args, calls[0][0])
    if body is None:
        try:
            body = stack.bodies[key] = _Body(run, stack.watch.key[-1], inputs)
        except _NotALoop as e:
            stack.bodies[key] = str(e)
            stack.written |= {getattr(e, "written", None)} - {None}
            raise
        run = run._replace(body=body)  # a cached body's run has it, and its cache was checked above
        if args.cache is not None and _holding(run):  # the layers the body updates, now that its trace says which
            raise _NotALoop(_holding(run))
    _STATE.work_check.probe(stack.looped[0], functools.partial(_first_two, run))  # once proven free of side effects
    if body.whiles:
        return stack.form.result(body.run(run, inputs), *calls[-1][1:])
    try:  # its first run builds the While from the traced graphs: a failure there runs the blocks one by one too
        return stack.form.result(body.run(run, inputs), *calls[-1][1:])
    except Exception as e:
        stack.bodies[key] = f"building its loop failed ({type(e).__name__}: {_shown(str(e), 120)})"
        raise _NotALoop(stack.bodies[key]) from e


def _states_key(stack):
    """The looped blocks' part of a body's key: each turn position's state (9c) but the attributes that differ between
    its blocks (`marked`: the trace proves them unread), which parameters are trainable, and `marked` ({(position,
    module, attribute): why}), last. Raises _NotALoop where the blocks cannot share a body: they differ in structure,
    hold buffers or tensors, or a hook is registered on one."""
    looped, period, start, seen = stack.looped, stack.plan.period, stack.plan.start, {}
    for k, block in enumerate(looped):
        for name, m in block.named_modules():
            hooks = [h for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
                     for h in d.values() if not getattr(h, "seamless_tpu", False)]
            if hooks:
                raise _NotALoop(f"a hook is registered on {stack.where}.{start + k}{'.' + name if name else ''}")
    states, marked = [_block_state(b, seen) for b in looped], {}
    for k in range(period, len(looped)):
        j = k % period
        if [m._replace(attrs=()) for m in states[k]] != [m._replace(attrs=()) for m in states[j]]:
            raise _NotALoop(_difference(states[j], states[k], start + k, start + j))
        if k < 2 * period and _holds(states[j], stack.written):
            raise _NotALoop(_holds(states[j], stack.written))
        for mine, theirs in zip(states[k], states[j]):
            for a in theirs.apart(mine):
                if (j, mine.name, a) not in marked:  # said of the first block that differs
                    marked[j, mine.name, a] = (_attr_difference(theirs, mine, start + k, start + j, a)
                                               + ", which their forward reads")
    trainable = tuple(p.requires_grad for b in looped for p in b.parameters())
    return tuple(_unmarked(states[j], j, marked) for j in range(period)), trainable, frozenset(marked.items())


class _Watch:
    """What a stack's blocks' key was read from, by identity, so that each call tells cheaply that nothing changed
    since: each module's attributes, submodules, parameters, buffers and hooks, and the dicts, lists and objects (a
    config) it holds, one level down; each parameter's requires_grad. Anything else: the states are read again."""

    def __init__(self, blocks, key, tokens):
        self.key, self.dicts, modules = key, [], [m for b in blocks for m in b.modules()]
        self.token = tokens.setdefault(key, len(tokens))  # the body's key holds it: hashing the states took ~20 ms
        for m in modules:
            self.dicts += [m.__dict__, m._modules, m._parameters, m._buffers, m._forward_hooks, m._forward_pre_hooks,
                           m._backward_hooks, m._backward_pre_hooks]
            for k, v in m.__dict__.items():
                if isinstance(v, dict) and k not in _MODULE_BOOKS:
                    self.dicts.append(v)
                elif k not in _MODULE_BOOKS and not isinstance(v, torch.nn.Module) and not callable(v) and hasattr(
                        v, "__dict__"):
                    self.dicts.append(vars(v))  # an object such as a config
        self.lists = [v for m in modules for k, v in m.__dict__.items() if isinstance(v, list)]
        self.dicts = list({id(d): d for d in self.dicts}.values())  # a config the blocks share, once
        self.empty = [d for d in self.dicts + self.lists if not d]  # most hooks and buffers: only their length
        self.dicts, self.lists = [d for d in self.dicts if d], [v for v in self.lists if v]
        self.values, self.items = [tuple(d.values()) for d in self.dicts], [tuple(v) for v in self.lists]
        self.params = [p for b in blocks for p in b.parameters()]
        self.flags = [p.requires_grad for p in self.params]

    def same(self):
        """Costs ~5 us a module at each call (a LoRA decoder layer holds 55: 28 of them, ~1.6 ms)."""
        try:  # tuples compare each item by identity first, then by ==, where a tensor would raise
            return (not any(map(len, self.empty)) and [tuple(d.values()) for d in self.dicts] == self.values
                    and [tuple(v) for v in self.lists] == self.items
                    and [p.requires_grad for p in self.params] == self.flags)
        except RuntimeError:
            return False


def _first_two(run):
    """The looped blocks' first two run on their own (the work check's probe), a stand-in for the empty cache."""
    x, args = run.calls[0][0], run.args
    for k in (0, 1):
        a, kw = args.of(k % run.stack.plan.period, args.tensors, _recorder_for(args.cache))
        x = run.stack.form.carried(run.stack.looped[k](x, *a, **kw))


def _unmarked(state, j, marked):
    return tuple(m.without({a for (i, name, a) in marked if (i, name) == (j, m.name)}) for m in state)


def _torch_state():
    """What a body's trace and its While read of torch's and torch_xla's state beyond its inputs: the process mesh
    by its value (each trainer makes its own, mostly an equal one)."""
    mesh = _STATE.mesh
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("xla"), torch.get_autocast_dtype("xla"),
            torch.get_default_dtype(), _import("torch_xla")._XLAC._xla_get_mat_mul_precision(),
            mesh and (tuple(mesh.mesh_shape), tuple(mesh.device_ids.flat), tuple(mesh.axis_names)))


class _Arguments:
    """The looped blocks' arguments, a turn's worth: each position's pytree spec and leaves, the distinct tensors among
    them (floating ones ride in the carry; others, such as position ids, are scanned as N copies: N x their bytes), an
    empty transformers cache among them (the loop records its updates), and their part of the body's key. Raises
    _NotALoop where a loop would differ: another input, arguments that differ from those of the turn's blocks, an
    object a block may change, torch.func, a global module hook."""

    def __init__(self, stack, calls):
        x, period, start = calls[0][0], stack.plan.period, stack.plan.start
        if not isinstance(x, torch.Tensor) or not _is_xla(x.device):
            raise _NotALoop(f"its input is a {type(x).__name__}" + (f" on {x.device}" if isinstance(x, torch.Tensor)
                                                                     else ""))
        self.turn = [torch.utils._pytree.tree_flatten((args, kwargs)) for _, args, kwargs in calls[:period]]
        self.tensors, self.cache, described = [], None, []
        for leaves, spec in self.turn:
            for v in leaves:
                if isinstance(v, torch.Tensor):
                    at = next((i for i, t in enumerate(self.tensors) if t is v), len(self.tensors))
                    self.tensors[at:at + 1] = [v]
                    described.append(("tensor", at))
                elif _empty_cache(v) and self.cache in (None, v):
                    self.cache = v
                    described.append("cache")
                elif not isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
                    raise _NotALoop(f"they are called with a {type(v).__name__} (a cache holding tokens, or another "
                                    "object a block may change)")
                else:
                    described.append(v)
        if _transformed(x, *self.tensors):
            raise _NotALoop("")  # torch.func or forward-mode AD: the blocks one by one give their numbers
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            raise _NotALoop("a global module hook is registered")  # it would run once, as the body is traced
        for k, (_, args, kwargs) in enumerate(calls[period:], period):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            same = self.turn[k % period][0]
            if len(leaves) != len(same) or any(a is not b and (isinstance(a, torch.Tensor) or a != b)
                                               for a, b in zip(leaves, same)):
                raise _NotALoop(f"block {start + k} is called with other arguments than block {start + k % period}")
        self.carried = [i for i, t in enumerate(self.tensors) if t.is_floating_point() or t.is_complex()]
        self.scanned = [i for i, t in enumerate(self.tensors) if i not in self.carried]
        self.key = (tuple(spec for _, spec in self.turn), tuple(described), x.shape, x.dtype,
                    tuple((t.shape, t.dtype, t.requires_grad) for t in self.tensors))

    def of(self, j, tensors, cache):
        """Position j's (args, kwargs), with `tensors` for the calls' tensors and `cache` for the empty cache."""
        leaves, spec = self.turn[j]
        fresh = iter(tensors[i] for v in leaves if isinstance(v, torch.Tensor)
                     for i in [next(i for i, t in enumerate(self.tensors) if t is v)])
        leaves = [next(fresh) if isinstance(v, torch.Tensor) else cache if v is self.cache and v is not None else v
                  for v in leaves]
        return torch.utils._pytree.tree_unflatten(leaves, spec)


def _empty_cache(v):
    """Whether `v` is a transformers cache of the kinds a model makes in training (a DynamicCache, its layers plain or
    sliding-window; an EncoderDecoderCache of two) whose update of an empty layer returns that layer's own keys and
    values. Which layers the loop's blocks update must hold no tokens: _holding(run) reads them before each run."""
    utils = sys.modules.get("transformers.cache_utils")
    if utils is not None and type(v) is utils.EncoderDecoderCache:
        return all(map(_empty_cache, (v.self_attention_cache, v.cross_attention_cache)))
    return (utils is not None and type(v) is utils.DynamicCache and not v.offloading
            and all(type(layer) in (utils.DynamicLayer, utils.DynamicSlidingWindowLayer) for layer in v.layers))


def _cache_places(run):
    """(turn, block, the cache (or its self- or cross-attention part), layer index) of each update the body records,
    in the blocks' order."""
    looped, period, cache = run.stack.looped, run.stack.plan.period, run.args.cache
    for turn in range(len(looped) // period):
        for j, index, kind in run.body.recorded:
            if isinstance(index, tuple):  # (module name, attribute) of the block
                index = getattr(looped[turn * period + j].get_submodule(index[0]), index[1])
            yield turn, (getattr(cache, kind) if kind else cache), index, kind


def _holding(run):
    """Why the cache cannot take the loop's updates (None if it can): a layer a looped block updates holds tokens
    (generation), so its update would not return the block's own keys and values. Before a body is traced (and
    records which layers it updates), the layers at the looped blocks' places."""
    cache, plan = run.args.cache, run.stack.plan
    places = _cache_places(run) if run.body else ((0, getattr(cache, "self_attention_cache", cache), i, None)
                                                  for i in range(plan.start, plan.stop))
    for _, target, index, kind in places:
        if index < len(target.layers) and target.layers[index].is_initialized or (
                kind == "cross_attention_cache" and cache.is_updated.get(index)):
            return f"the cache holds tokens for layer {index} (generation): its update would read them"
    return None


class _CacheRecorder:
    """An empty cache's stand-in in a loop's body: update(k, v, layer_idx) returns the layer's own keys and values, as
    the empty cache does, and records them, which the loop outputs per block; after the loop the cache gets each
    block's, under that block's own layer index. Anything else asked of it keeps the blocks unrolled."""

    def __init__(self, updates=None, kind=None):
        self.updates, self.kind = [] if updates is None else updates, kind

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updates.append((key_states, value_states, layer_idx, self.kind))
        return key_states, value_states

    def get_seq_length(self, layer_idx=0):  # T5 asks the empty cache for what it holds
        return 0

    def __getattr__(self, name):
        raise _NotALoop(f"a block reads the cache's {name!r}, where a loop records its updates only")


def _recorder_for(cache):
    """A _CacheRecorder for `cache`; for an EncoderDecoderCache (T5, Whisper), one of its class (blocks test it) whose
    self- and cross-attention caches record into one list, and whose `is_updated` takes any layer index."""
    utils = sys.modules.get("transformers.cache_utils")
    if cache is None or utils is None or type(cache) is not utils.EncoderDecoderCache:
        return _CacheRecorder()
    recorder = object.__new__(_encoder_decoder_recorder(utils.EncoderDecoderCache))
    recorder.updates = []
    recorder.self_attention_cache = _CacheRecorder(recorder.updates, "self_attention_cache")
    recorder.cross_attention_cache = _CacheRecorder(recorder.updates, "cross_attention_cache")
    recorder.is_updated = _Updated()
    return recorder


@functools.cache
def _encoder_decoder_recorder(cls):
    return type("EncoderDecoderRecorder", (cls,), {"__getattr__": _CacheRecorder.__getattr__})


class _Updated:
    """EncoderDecoderCache.is_updated in a loop's body: nothing updated yet, whatever the (unreadable) layer index."""

    def get(self, layer_idx, default=None):
        return default

    def __setitem__(self, layer_idx, value):
        pass


class _Unread:
    """What a body's trace sees for an attribute that differs between blocks of one turn: any use raises, so a trace
    that ends proves the body does not read it (transformers' layer_idx: passed to the cache's update only). Python
    cannot intercept `is` and `type()`: a forward that branches on those alone is not caught."""

    def __init__(self, why, where):
        object.__setattr__(self, "_why", why)
        object.__setattr__(self, "where", where)  # (module name, attribute): the cache's update reads it per block

    def _refuse(self, *args, **kwargs):
        raise _NotALoop(object.__getattribute__(self, "_why"))

    def __repr__(self):
        return object.__getattribute__(self, "_why")


for _name in ("getattribute", "bool", "index", "int", "float", "complex", "len", "iter", "contains", "getitem", "call",
              "hash", "eq", "ne", "lt", "le", "gt", "ge", "format", "str", "neg", "pos", "abs", "invert", "round",
              "trunc", "floor", "ceil", *(f"{r}{op}" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                                                  "pow", "and", "or", "xor", "lshift", "rshift",
                                                                  "matmul", "divmod") for r in ("", "r"))):
    setattr(_Unread, f"__{_name}__", _Unread._refuse)


def _proven(trace, reps, marked):
    """trace() with the attributes in `marked` ({(position, module, attribute): why}) unreadable, raising _NotALoop
    where it failed, read one, or did what a loop cannot repeat per block: wrote an attribute (an MoE's aux loss, a
    lazily built cache), drew Python's or numpy's random numbers. All of it is put back, so the blocks then run one by
    one as if never traced."""
    modules = [dict(r.named_modules()) for r in reps]
    saved = [{name: dict(m.__dict__) for name, m in mods.items()} for mods in modules]
    before, rng = [_block_state(r) for r in reps], _rng_states()
    marked = dict(marked)
    unread = {(j, name, a): _Unread(why, (name, a)) for (j, name, a), why in marked.items()}
    for (j, name, a), marker in unread.items():
        modules[j][name].__dict__[a] = marker
    failed = None
    try:
        return trace()
    except _NotALoop as e:
        failed = e
        raise
    except Exception as e:  # any failure of the trace: the blocks one by one give eager's behaviour (or error)
        read = [why for why in marked.values() if "_Unread" in str(e)]  # a marker passed where torch wants a value
        failed = _NotALoop(read[0] if read else f"tracing a block failed ({type(e).__name__}: "
                           f"{_shown(str(e), 120)})")
        raise failed from e
    finally:
        wrote = next((f"{name + '.' if name else ''}{a}" for (j, name, a), marker in unread.items()
                      if modules[j][name].__dict__.get(a) is not marker), None)
        for (j, name, a), marker in unread.items():
            modules[j][name].__dict__[a] = saved[j][name].get(a, marker)
        wrote = wrote or next(filter(None, map(_written, before, [_block_state(r) for r in reps])), None)
        for mods, dicts in zip(modules, saved):
            for name, m in mods.items():
                if m.__dict__.keys() != dicts[name].keys() or any(v is not dicts[name][k]
                                                                   for k, v in m.__dict__.items()):
                    m.__dict__.clear()
                    m.__dict__.update(dicts[name])
        drew = _rng_key(rng) != _rng_key(_rng_states())
        random.setstate(rng[0])
        if rng[1] is not None:
            sys.modules["numpy"].random.set_state(rng[1])
        if wrote or drew:  # raised over the trace's result or error: the cause
            failed = _NotALoop(f"a block's forward writes {wrote}" if wrote else
                               "a block's forward draws random numbers from Python's random or numpy")
            failed.written = wrote  # a tensor it leaves on the block later says the same (_holds)
            raise failed


def _written(before, after):
    """The first attribute a block's state `after` holds apart from `before`, by its path; None if none."""
    return next((m.where(a) for m, n in zip(before, after) for a in m.apart(n)), None)


def _rng_states():
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy and numpy.random.get_state()


def _rng_key(states):  # numpy's state holds an array: compared by its bytes
    return states[0], states[1] and (states[1][1].tobytes(), states[1][2:])


class _Body:
    """One turn of a stack's loop, traced by AOTAutograd through torch_xla's scan: its forward, alias and backward
    graphs; the stacked parameters it gives gradients (`trainable`: one no block uses gets none, as in eager); where
    each cache update's layer index is read (`recorded`); and the While programs built from it, once per shapes
    (torch_xla builds them anew at each call: ~20 ms of Python each for a LoRA layer's forward and backward)."""

    def __init__(self, run, marked, inputs):
        stack, args = run.stack, run.args
        self.reps, self.form = stack.looped[:stack.plan.period], stack.form  # the turn's blocks as traced: the first
        self.checkpointed = any(getattr(m, "gradient_checkpointing", False) and m.training
                                for b in self.reps for m in b.modules())
        self.recorded, self.whiles, given = [], {}, []
        init, xs = inputs
        functorch = importlib.import_module("functorch.compile")
        partition = _saving_primals(functorch.min_cut_rematerialization_partition if self.checkpointed
                                    else functorch.default_partition, len(init), self.checkpointed, given)
        scan = _import("torch_xla.experimental.scan")
        self.forward, self.alias, self.backward = _proven(lambda: scan.value_and_grad_partitioned(
            _turn(self, args), init, xs, partition_fn=partition, is_fn_pure=False), self.reps, marked)
        places = [(j, name) for j, params in enumerate(xs[0]) for name in params]  # xs's first leaves, in order
        self.trainable = [at for at, g in zip(places, given[len(init):]) if g]

    def run(self, run, inputs):
        init, xs = inputs
        flat, xs_spec = torch.utils._pytree.tree_flatten(xs)
        out = _Loop.apply(run, xs_spec, len(init), *init, *flat)
        if run.args.cache is not None:
            _fill(run, out[len(init):])
        return out[0]

    def scan(self, kind, fn, init, xs, reverse=False):
        """torch_xla's _scan_impl_pytree, its While computation built once per `kind` and shapes, then only called.
        Our bodies are pure (random numbers from the seeds they scan), so their While never changes."""
        scan, xlac = _import("torch_xla.experimental.scan"), _import("torch_xla")._XLAC
        (flat_init, unflatten_carry), (flat_xs, _) = scan.tree_flatten_none(init), scan.tree_flatten_none(xs)
        tree = torch.utils._pytree.tree_structure
        key = (kind, reverse, tree(init), tree(xs),
               tuple((t.shape, t.dtype, t.requires_grad) for t in flat_init + flat_xs))
        ys_at = 1 + len(flat_init) + len(flat_xs)  # the While's operands: [turn, *carry, *xs, *ys, *hoisted]
        if key not in self.whiles:
            user, recorded = xlac._xla_user_computation, []
            xlac._xla_user_computation = lambda *args: recorded.append(args) or user(*args)
            try:
                carry, ys = scan._scan_impl_pytree(fn, init, xs, reverse)
            finally:
                xlac._xla_user_computation = user
            _, operands, computation = [r for r in recorded if r[0] == "xla::scan"][-1]  # the While, made last
            flat_ys, unflatten_y = scan.tree_flatten_none(ys)
            ys_end = ys_at + len(flat_ys)
            self.whiles[key] = _While(computation, [(t.shape, t.dtype) for t in operands[ys_at:ys_end]],
                                      operands[ys_end:], unflatten_y)
            return carry, ys
        w, device = self.whiles[key], flat_init[0].device
        ys = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in w.ys]  # what the While fills in
        out = xlac._xla_user_computation("xla::scan", [torch.tensor(0, device=device), *flat_init, *flat_xs, *ys,
                                                       *w.hoisted], w.computation)
        return unflatten_carry(list(out[1:1 + len(flat_init)])), w.unflatten_y(list(out[ys_at:ys_at + len(ys)]))


class _While(collections.namedtuple("_While", "computation ys hoisted unflatten_y")):
    """One While torch_xla's scan built: its computation, its outputs per turn ((shape, dtype) of each, stacked), the
    tensors the body reads that torch_xla hoisted out as operands (its constants), and how its outputs regroup."""


def _loop_inputs(stack, args, x):
    """scan's (init, xs): the input and the floating arguments carried; each turn's position's stacked parameters,
    the other arguments' N copies, and in training a seed per turn from XLA's RNG (a graph value: no host read)."""
    turns = len(stack.looped) // stack.plan.period
    training = any(m.training for b in stack.looped[:stack.plan.period] for m in b.modules())  # dropout may draw
    seeds = [torch.randint(2**31 - 1, (turns,), dtype=torch.int32, device=x.device)] if training else []
    scanned = tuple(args.tensors[i].expand(turns, *args.tensors[i].shape) for i in args.scanned)
    return (x, *(args.tensors[i] for i in args.carried)), (_stacks(stack), scanned, *seeds)


def _turn(body, args):
    """scan's fn: one turn of the loop on the carry, each of the turn's blocks with its blocks' parameters swapped in;
    in training their dropout draws from the turn's seed; an empty cache's updates are the turn's outputs."""
    def turn(carry, xs):
        (x, *carried), (params, scanned, *seed) = carry, xs
        tensors = [None] * len(args.tensors)
        for i, t in zip(args.carried + args.scanned, (*carried, *scanned)):
            tensors[i] = t
        cache, body.recorded = _recorder_for(args.cache), []
        _STATE.loops.tracing = True
        try:
            with _RandomOps(*seed), _checkpointing_off(body.reps, body.checkpointed):
                for j, block in enumerate(body.reps):
                    a, kw = args.of(j, tensors, cache)
                    versions, updates = [t._version for t in (x, *tensors)], len(cache.updates)
                    out = torch.func.functional_call(block, params[j], (x, *a), kw, strict=False)
                    if [t._version for t in (x, *tensors)] != versions:
                        raise _NotALoop("a block writes its input in place, which its caller may still hold")
                    out = _handed_on(body.form, out, a, kw)
                    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
                        raise _NotALoop("a block returns " + (
                            f"shape {tuple(out.shape)} {out.dtype} for {tuple(x.shape)} {x.dtype}" if isinstance(
                                out, torch.Tensor) else f"a {type(out).__name__}, not a tensor like its input"))
                    x = out
                    body.recorded += [(j, object.__getattribute__(i, "where") if type(i) is _Unread else i, kind)
                                      for _, _, i, kind in cache.updates[updates:]]
        finally:
            _STATE.loops.tracing = False
        return (x, *carried), tuple(t for k, v, _, _ in cache.updates for t in (k, v)) or None
    return turn


def _handed_on(form, out, args, kwargs):
    """The carried output of a traced block, where each output the owner passes on to the next block is, as the
    owner's loop was told, the value it was given (T5's position bias, made by its first block and handed on)."""
    if not form.outputs:
        return out
    if not isinstance(out, tuple) or len(out) != form.outputs:
        raise _NotALoop(f"a block returns a {type(out).__name__}, where its owner's loop takes {form.outputs} values")
    for i, given in form.fed(args, kwargs).items():
        if out[i] is not given:
            raise _NotALoop(f"a block returns in its output {i} another value than it was given, which the next takes")
    return out[0]


def _fill(run, ys):
    """The empty cache given what eager's blocks would have put in it: each looped block's keys and values, under its
    own layer index (read from the block where the trace saw an attribute that differs, HF's layer_idx), in the
    encoder-decoder cache's self- or cross-attention part."""
    if not ys:
        return
    per_turn, at = len(run.body.recorded), _indices(run.stack, len(ys[0]), ys[0].device)
    for n, (turn, target, index, kind) in enumerate(_cache_places(run)):
        u = n % per_turn  # a gather at an index held as device data: one kernel for every turn's (see _Stacked)
        target.update(*(ys[2 * u + i].index_select(0, at[turn]).squeeze(0) for i in (0, 1)), index)
        if kind == "cross_attention_cache":
            run.args.cache.is_updated[index] = True


class _Loop(torch.autograd.Function):
    """The looped blocks: scan's forward (the body's forward graph in a While), and a backward from the last turn
    that writes its gradients over its stacked weights once it has read them, so each trainable stack rides the
    backward's carry and XLA updates it in place: the stacked gradients take the stacked weights' buffer, where scan
    kept both (per device under fsdp: 0.75x a trainable byte, not 1x). A backward that builds a graph (create_graph:
    a gradient penalty, a Hessian-vector product) recomputes the blocks one by one instead (_recomputed)."""

    @staticmethod
    def forward(ctx, run, xs_spec, n_init, *flat):
        body = run.body
        init, xs = flat[:n_init], torch.utils._pytree.tree_unflatten(list(flat[n_init:]), xs_spec)
        carry, (ys, partial) = body.scan("forward", body.forward, init, xs)
        acts, stacks = body.alias(partial, xs), [xs[0][j][name] for j, name in body.trainable]
        ctx.at = tuple(next((k for k, a in enumerate(acts) if a is s), None) for s in stacks)  # where the body reads it
        ctx.run, ctx.xs_spec, ctx.n_init, ys = run, xs_spec, n_init, list(ys or ())
        ctx.outputs = [(t.shape, t.dtype) for t in (*carry, *(y[0] for y in ys))]  # a turn's
        ctx.save_for_backward(*flat, *(a for k, a in enumerate(acts) if k not in ctx.at))
        ctx.set_materialize_grads(False)
        return (*carry, *ys)

    @staticmethod
    def backward(ctx, *grads):
        run, n_init, saved = ctx.run, ctx.n_init, ctx.saved_tensors
        flat, rest = saved[:n_init + ctx.xs_spec.num_leaves], saved[n_init + ctx.xs_spec.num_leaves:]
        init, xs = flat[:n_init], torch.utils._pytree.tree_unflatten(list(flat[n_init:]), ctx.xs_spec)
        if torch.is_grad_enabled():
            return None, None, None, *_recomputed(run, init, xs, grads)
        device, turns = init[0].device, len(flat[n_init])
        grad_carry = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, init)]
        given = tuple(g is not None for g in grads[n_init:])
        step = _TurnBackward(run.body.backward, run.body.trainable, ctx.at, given, ctx.outputs[n_init:])
        turn = torch.arange(turns, device=device)  # an iota in the graph, not a transfer
        stacks = [xs[0][j][name] for j, name in run.body.trainable]
        (grad_init, grad_stacks), _ = run.body.scan(("backward", given), step, (grad_carry, stacks),
                                                    (rest, [g for g in grads[n_init:] if g is not None], turn), True)
        return None, None, None, *grad_init, *_grads_of_xs(xs, dict(zip(run.body.trainable, grad_stacks)))


def _grads_of_xs(xs, stacked):
    """The gradients of scan's xs, flat: {(position, name): gradient} for the stacked parameters; none for the others
    (the arguments scanned, the seeds)."""
    return [stacked.get((j, name)) for j, params in enumerate(xs[0]) for name in params] + [None] * (
        len(xs[1]) + len(xs) - 2)


class _TurnBackward(collections.namedtuple("_TurnBackward", "graph trainable at given outputs")):
    """scan's fn for _Loop's backward, one turn (from the last): its weights read from the stacks the carry holds,
    its gradients written there in their place (a dynamic slice and update: XLA keeps the stack's buffer). `graph`
    is the body's backward; `trainable`, the stacks it gives gradients ((position, name)); `at`, where among the
    activations the forward saved the body reads each (None: it does not); `given`, which of a turn's outputs has a
    gradient, and `outputs` their (shape, dtype): a cache update's gradient nobody gave is a zero made here."""

    def __call__(self, carry, x):
        (grad_carry, stacks), (rest, grad_ys, k) = carry, x
        k = k.view(1)
        weights, acts = [s.index_select(0, k).squeeze(0) for s in stacks], list(rest)
        for position, w in sorted(((p, w) for p, w in zip(self.at, weights) if p is not None), key=lambda pw: pw[0]):
            acts.insert(position, w)
        grad_ys = iter(grad_ys)
        grad_y = tuple(next(grad_ys) if g else torch.zeros(shape, dtype=dtype, device=k.device)
                       for g, (shape, dtype) in zip(self.given, self.outputs))
        grad_carry, (params, *_) = self.graph(grad_carry, (grad_y or None, acts))
        grads = [params[j][name] for j, name in self.trainable]
        # XLA updates a stack in place only where it sees every read of it come first, and a weight's own gradient
        # does not read it (XLA copied each stack twice a block). A 0 made from the input's gradient and every
        # weight's orders the reads that lead to them.
        ends = [t for t in (torch.utils._pytree.tree_leaves(grad_carry)[0], *grads) if t.numel()]
        zero = _zero_after(ends, torch.float32)
        grads = [g + zero.to(g.dtype) for g in grads]
        return (grad_carry, [s.index_copy(0, k, g.unsqueeze(0)) for s, g in zip(stacks, grads)]), None


def _recomputed(run, init, xs, grads):
    """_Loop's backward when it builds a graph (create_graph): the blocks recomputed one by one from the loop's input,
    as activation checkpointing does (their dropout draws the loop's masks, from its seeds), and differentiated with a
    graph, so that their gradients differentiate again: eager's numbers for a gradient penalty or a Hessian-vector
    product through a looped stack. Costs a forward and a backward of the blocks unrolled, in that step's graph."""
    args, looped, period = run.args, run.stack.looped, run.stack.plan.period
    tensors, seeds = list(args.tensors), xs[2] if len(xs) > 2 else None
    for i, t in zip(args.carried, init[1:]):
        tensors[i] = t
    cache, x = _recorder_for(args.cache), init[0]
    with torch.enable_grad():
        for turn in range(len(looped) // period):
            with _RandomOps(seeds[turn]) if seeds is not None else contextlib.nullcontext():
                for j in range(period):
                    a, kw = args.of(j, tensors, cache)
                    x = run.stack.form.carried(looped[turn * period + j](x, *a, **kw))
    per_turn = len(cache.updates) // max(1, len(looped) // period)
    ys = [torch.stack([u[i] for u in cache.updates[n::per_turn]]) for n in range(per_turn) for i in (0, 1)]
    outs = [(o, g) for o, g in zip((x, *ys), (grads[0], *grads[len(init):])) if g is not None and o.requires_grad]
    params = {(j, name): [dict(b.named_parameters())[name] for b in looped[j::period]]
              for j, named in enumerate(xs[0]) for name in named}
    wrt = [t for t in init if t.requires_grad] + [p for ps in params.values() for p in ps if p.requires_grad]
    got = iter(torch.autograd.grad([o for o, _ in outs], wrt, [g for _, g in outs], create_graph=True,
                                   allow_unused=True) if outs and wrt else [None] * len(wrt))
    grad_init = [next(got) if t.requires_grad else None for t in init]
    grad_init = [g if k == 0 or grads[k] is None else grads[k] if g is None else g + grads[k]  # carried: passed on
                 for k, g in enumerate(grad_init)]
    stacked = {}
    for place, ps in params.items():
        gs = [next(got) if p.requires_grad else None for p in ps]
        if any(g is not None for g in gs):
            stacked[place] = torch.stack([torch.zeros_like(p) if g is None else g for g, p in zip(gs, ps)])
    return *grad_init, *_grads_of_xs(xs, stacked)


@contextlib.contextmanager
def _checkpointing_off(blocks, checkpointed):
    """Inside the loop the body's rematerialization is the partitioner's (min-cut): transformers' checkpointing of
    each layer call stays off while the body is traced."""
    modules = [m for b in blocks for m in b.modules() if getattr(m, "gradient_checkpointing", False)] if (
        checkpointed) else []
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True


class _RandomOps(TorchDispatchMode):
    """A random op in a loop body, traced once, would draw the same numbers for every block and step. Dropout's
    (native_dropout; bernoulli_ with a float p: dropout1d-3d, alpha dropout) draws from the turn's seed instead
    (_uniform): integer ops, so the body stays pure and its backward and remat see the forward's masks. Any other
    random op, or dropout with no seed (eval mode), keeps the blocks unrolled."""

    def __init__(self, seed=None):
        super().__init__()
        self.seed, self.drawn = seed, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten, kwargs = torch.ops.aten, kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        if (self.seed is None or kwargs or args[2:3] == (False,)  # a generator, native_dropout not in training
                or func not in (aten.native_dropout.default, aten.bernoulli_.float)):
            raise _NotALoop(f"a block draws random numbers ({func.__name__}), which a loop draws only for dropout in "
                            "training, from a seed per block")
        (x, p), self.drawn = args[:2], self.drawn + 1
        u = _uniform(self.seed, self.drawn, x.shape, x.device)
        if func is aten.bernoulli_.float:
            return x.copy_((u < p).to(x.dtype))
        keep = u >= p  # torch's decomposition: the kept elements scaled by 1/(1-p), and the mask
        return x * keep * (1 / (1 - p) if p < 1 else 0.0), keep


def _mix32(h):
    """Wellons' lowbias32 hash on int32 tensors: the products wrap, the shifts are masked to logical ones."""
    h = (h ^ ((h >> 16) & 0xFFFF)) * 0x7FEB352D
    h = (h ^ ((h >> 15) & 0x1FFFF)) * (0x846CA68B - 2**32)
    return h ^ ((h >> 16) & 0xFFFF)


def _uniform(seed, counter, shape, device):
    """[0, 1) floats of `shape`, 24 random bits each, a hash of (int32 seed, counter, index): mixed with each
    dimension's iota in turn (broadcast: one hash per element for the last dimension; no flat index to overflow)."""
    h = _mix32(_mix32(seed) + counter)
    for size in shape:
        h = _mix32(h.unsqueeze(-1) + torch.arange(size, dtype=torch.int32, device=device))
    return ((h >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24


def _stacks(stack):
    """Per position of a turn, {name: that position's blocks' parameters of that name, stacked}. Trainable ones are
    stacked in the step's graph (their gradients flow back through _Stacked). A frozen one's stack (LoRA's base
    weights, a teacher's) is made once, in a small graph of its own, and then read as device data: the step's graph
    no longer copies it, nor takes every block's weights as inputs. It is made anew once any of those parameters is
    changed or replaced (its version counter or its XLA tensor, which every in-place write, `.data` alias or load
    changes), and held beside them between steps: the step held both anyway, the stack as a temporary."""
    xlac, out, new, period = _import("torch_xla")._XLAC, [], [], stack.plan.period
    for j in range(period):
        per_block, stacked = [dict(b.named_parameters()) for b in stack.looped[j::period]], {}
        for name in per_block[0]:
            params = [p[name] for p in per_block]
            if any(p.requires_grad for p in params) or not _device_data(params):
                stack.frozen.pop((j, name), None)  # unfrozen since: not held for nothing
                stacked[name] = _Stacked.apply(_indices(stack, len(params), params[0].device), *params)
                continue
            key = [(id(p), p._version, xlac._xla_get_tensor_id(p)) for p in params]
            cached = stack.frozen.get((j, name))
            if cached is None or cached[0] != key:
                cached = stack.frozen[j, name] = key, torch.stack(params)
                new.append(cached[1])
            stacked[name] = cached[1]
        out.append(stacked)
    if new:  # without this, the first step's graph would make them and the second would read them: 2 compiles
        xlac._xla_sync_multi(new, devices=[], wait=False)
    return tuple(out)


def _indices(stack, n, device):
    """[0], [1], ... [n - 1] as device data, made once per stack: where _Stacked's backward and a cache's fill
    gather."""
    return stack.indices.setdefault((n, device), [torch.tensor([k]).to(device) for k in range(n)])


def _device_data(tensors):
    """Whether every tensor is data on its device, with no pending computation (which a stack's own graph would run
    out of turn)."""
    try:
        _import("torch_xla")._XLAC._get_tensors_handle(tensors)
    except RuntimeError:
        return False
    return True


class _Stacked(torch.autograd.Function):
    """torch.stack of the blocks' parameters, whose gradients are copies, not views of the stacked one: a view keeps
    its base alive, and the graph computed both (the stacked gradients beside each block's: +0.25x the model). Each
    block's is a gather at an index held as device data: slices at N offsets are N kernels XLA compiles one by one
    (XLA:CPU: ~9 ms each, most of what the step's compile grew by with depth); gathers of one shape are one kernel.
    No gradient (a parameter no block uses) leaves every block's None, as in eager."""

    @staticmethod
    def forward(ctx, indices, *params):
        ctx.indices = indices
        ctx.set_materialize_grads(False)
        return torch.stack(params)

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return (None,) * (1 + len(ctx.indices))
        return None, *(grad.index_select(0, k).squeeze(0).clone() for k in ctx.indices)  # not views, as above

# --- 9e. repeated blocks: what the loop's body saves ----------------------------------------------
# AOTAutograd splits the body into a forward and a backward; what the forward hands on is saved per turn, stacked by
# scan. The partition here saves the blocks' parameters by reference, computes x @ W.t() over W as stored, and notes
# which inputs the backward gives a gradient.


# What the backward remakes from a block's parameter rather than save: views, and casts (autocast's)
_REMADE = frozenset({"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "expand", "unsqueeze",
                     "squeeze", "alias", "detach", "_to_copy", "select", "slice"})


def _saving_primals(partition, carried, remat, given=None):
    """AOT's partitioner saves what the backward reads of the forward: `W.t()` for a linear, which scan then stacks,
    a copy of every block's weights (+0.25x the model per device under fsdp). Given `W` itself, scan passes on the
    stacked parameters it holds, so the backward reads a view remade from the parameter. Under checkpointing the
    min-cut's budget is 0: the body saves its inputs and recomputes the rest, checkpointing's promise. `given` gets,
    per input, whether the backward gives it a gradient (a parameter no block uses gets none)."""
    def partition_fn(joint, inputs, *, num_fwd_outputs, **kwargs):
        graph = joint.graph
        results = next(iter(graph.find_nodes(op="output"))).args[0]
        if given is not None:
            given[:] = [g is not None for g in results[num_fwd_outputs:]]
        params = [n for n in graph.find_nodes(op="placeholder") if str(n.target).startswith("primals")][carried:]
        _views_remade(graph, params, _needed(torch.utils._pytree.arg_tree_leaves(*results)[:num_fwd_outputs]))
        next(iter(graph.nodes)).meta["memory_budget"] = 0.0 if remat else None
        joint.recompile()
        return tuple(map(_dots_as_stored, partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)))
    return partition_fn


def _needed(outputs):
    """The nodes of a joint graph that its forward's outputs need."""
    needed, todo = set(), [n for n in outputs if isinstance(n, torch.fx.Node)]
    while todo:
        node = todo.pop()
        if node not in needed:
            needed.add(node)
            todo.extend(node.all_input_nodes)
    return needed


def _views_remade(graph, params, forward):
    """Each view or cast of a parameter (_REMADE) that the `forward` computes, made again for its backward's users,
    so that the partitioner saves the parameter rather than the forward's view of it."""
    made, of_params = dict(zip(params, params)), set(params)  # a view of a parameter -> its copy for the backward

    def remake(node):
        if node not in made:
            with graph.inserting_after(node):
                made[node] = graph.call_function(node.target, (remake(node.args[0]), *node.args[1:]), node.kwargs)
            made[node].meta = dict(node.meta)
        return made[node]
    for node in list(graph.nodes):
        if (getattr(getattr(node.target, "overloadpacket", None), "__name__", None) in _REMADE
                and node.all_input_nodes == [node.args[0]] and node.args[0] in of_params):
            of_params.add(node)
            for user in [u for u in node.users if u not in forward] if node in forward else ():
                user.replace_input_with(node, remake(node))


def _dots_as_stored(module):
    """`x @ W.t()` (AOT's linear) as one dot contracting W's stored dim: under fsdp GSPMD otherwise gathers the
    transposed shards, which XLA then copies back to a row-major layout (one block's weight, in the loop's body)."""
    aten, graph = torch.ops.aten, module.graph
    for node in list(graph.nodes):
        w = node.args[-1] if node.target in (aten.mm.default, aten.addmm.default) and not node.kwargs else None
        if not isinstance(w, torch.fx.Node) or w.target is not aten.t.default:
            continue
        with graph.inserting_before(node):
            y = graph.call_function(_dot_transposed, (node.args[-2], w.args[0]))
            y = graph.call_function(aten.add.Tensor, (y, node.args[0])) if node.target is aten.addmm.default else y
        y.meta = dict(node.meta)
        node.replace_all_uses_with(y)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    module.recompile()
    return module


def _dot_transposed(a, w):  # a @ w.t() as XLA's dot over both operands' last dims, at torch_xla's matmul precision
    return _xla_dot(a, w, (([1], [1]), ([], [])))

# --- 10. models built on meta ---------------------------------------------------------------------


@dataclasses.dataclass
class _MetaInit:
    """A model built under torch.device("meta") is made real module by module, children first, each initialised on
    the CPU from the CPU RNG as the build left it (the CPU build's weights if modules were built in registration
    order). On XLA at the first forward or save; a module load_checkpoint filled first is never initialised."""

    pending: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    # ^ module -> (its transformers owner, RNG, first-use hook, names a load filled): laid out, not yet initialised
    unset: weakref.WeakKeyDictionary = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    # ^ module -> (its path, the tensors its initialiser left unset, the refusing hook)

    def before_forward(self, model):  # a trainer model's forward starts (8): what no checkpoint filled is initialised
        if self.pending:
            _initialize_pending(model, refuse=True)


def _has_meta_tensors(model):
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _materialize(model, layout, lay_out=True):
    """Lay out the meta tensors of `model` on the layout's device (unless `lay_out` is False: FSDP2 splits them on
    meta), each parameter split by its spec, and hook each module's initialisation to its first use."""
    def post_order(module, owner):  # owner: the transformers model whose _initialize_weights initialises it, or None
        owner = module if callable(getattr(module, "_initialize_weights", None)) else owner
        for child in module.children():
            yield from post_order(child, owner)
        yield module, owner

    pending, rng = {}, [torch.get_rng_state()]  # the CPU RNG as the build left it: every module draws from it in turn
    root = weakref.ref(model)
    for module, owner in dict(post_order(model, None)).items():  # children first, as their constructors ran
        own = {name: t for name, t in _own_tensors(module) if t.is_meta}
        if not own:
            continue
        resets = [getattr(module, m, None) for m in ("reset_parameters", "_reset_parameters")]
        if owner is None and not any(map(callable, resets)):
            raise ValueError(f"cannot initialise the meta tensors {list(own)} of {type(module).__name__}: it has no "
                             "reset_parameters(), so their values are unknown. Give it a reset_parameters() that sets "
                             "them, or build the model on the CPU")
        for name, meta in own.items() if lay_out else ():
            made = torch.empty(meta.shape, dtype=meta.dtype, device=layout.device)
            if layout.mesh is not None and isinstance(meta, torch.nn.Parameter) and any(layout.spec(meta)):
                _mark_sharding(made, layout.mesh, layout.spec(meta))
            _set_own_tensor(module, name, made)
        # A submodule run on its own first (model.encoder(x)) must not see unset values either.
        first_use = module.register_forward_pre_hook(
            _owned(module, lambda *_: _initialize_pending(root(), refuse=True)))
        pending[module] = (owner, rng, first_use, set())
    _STATE.meta_init.pending.update(pending)


def _blank_like(t):
    """An XLA tensor split like `t` for a load to overwrite: an empty host shard per device, no compute, no whole copy
    (a meta model's lazy placeholder, read as it is, compiles a graph per shape: 9 on the 320 MB test model)."""
    xla = _import("torch_xla")._XLAC
    tiles = re.search(r"devices=\[([\d,]+)\]", xla._get_xla_sharding_spec(t)).group(1).split(",")[:t.dim()]
    shard = torch.empty([-(-size // int(n)) for size, n in zip(t.shape, tiles)], dtype=t.dtype)  # XLA pads shards
    shards = [shard] * len(xla._xla_get_runtime_devices())
    return xla._global_tensor_from_cpu_shards(shards, xla._get_xla_op_sharding(t), list(t.shape))


def _own_tensors(module):
    return [(n, t) for n, t in itertools.chain(module._parameters.items(), module._buffers.items()) if t is not None]


def _set_own_tensor(module, name, value):
    """A parameter keeps its object (swapped in place, with its hooks and attributes): optimizers and hooks keep it."""
    if name not in module._parameters:
        module._buffers[name] = value
        return
    param = module._parameters[name]
    kept = dict(param.__dict__)
    torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))
    param.__dict__.update(kept)


def _initialize_pending(model, device=None, refuse=False):
    """Initialise the laid-out modules of `model` one at a time, by reset_parameters(), _reset_parameters() (as
    MultiheadAttention has) or a transformers owner's _initialize_weights, and send each tensor to its place shard by
    shard. A tensor left unset is refused now if `refuse` (first forward or save), else then unless a load fills it."""
    paths = {m: p for p, m in model.named_modules()}
    release = _HostMemoryRelease(every=0)  # after each tensor: a module may be GBs
    for module in [m for m in list(_STATE.meta_init.pending) if m in paths]:  # the post-order they were laid out in
        owner, rng, first_use, loaded = _STATE.meta_init.pending.pop(module)
        first_use.remove()
        if device is not None:  # FSDP2 split it on meta: this rank's shards are allocated here, nothing more
            module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t, recurse=False)
        placed, held = dict(_own_tensors(module)), {}
        for name, t in placed.items():
            stand_in = torch.full(t.shape, _mark(t), dtype=t.dtype)  # on the CPU, for the initialiser to write
            if name in module._parameters:
                stand_in = torch.nn.Parameter(stand_in, requires_grad=t.requires_grad)  # sharing its version counter
            (module._parameters if name in module._parameters else module._buffers)[name] = stand_in
            if name not in loaded:  # a loaded tensor is kept, whatever the initialiser does
                held[name] = (stand_in, stand_in._version)
        with torch.random.fork_rng(devices=[]):  # the loop's own CPU RNG goes on untouched
            torch.set_rng_state(rng[0])
            if owner is not None:
                module._is_hf_initialized = False  # built under meta, its initialisation ran on nothing
                owner._initialize_weights(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            else:
                module._reset_parameters()
            rng[0] = torch.get_rng_state()
        if unset := [n for n, (tensor, version) in held.items() if _left_unset(getattr(module, n), tensor, version)]:
            refusal = module.register_forward_pre_hook(_owned(module, lambda m, _: _refuse_unset(m)))
            _STATE.meta_init.unset[module] = (paths[module], unset, refusal)
        del held  # the stand-ins go with the write-back below, tensor by tensor: the host holds one module
        for name, t in placed.items():
            value = getattr(module, name).detach()
            (module._parameters if name in module._parameters else module._buffers)[name] = t
            if name in loaded:  # load_checkpoint filled it before this first use: the initialiser's value is dropped
                continue
            if hasattr(t, "device_mesh"):  # an FSDP2 shard: this rank's part, in place (FSDP2 gathers from its storage)
                with torch.no_grad():
                    t.to_local().copy_(_lay_out_like(value, t).to_local())
                release(value)
                continue
            # On XLA the mark sends it now, split or whole as _place marked it: .to() alone defers the copy to the
            # first graph, and the host held every tensor till then (ddp: 5.7x the model at its first forward).
            _set_own_tensor(module, name, release(_lay_out_like(value, t)))
    if refuse and _STATE.meta_init.unset:
        _refuse_unset(model)


def _mark(t):
    """What a stand-in holds until its initialiser writes it, which none does on purpose, so that one left alone is
    found: the version counter misses writes through .data (as older _init_weights make). One fill per tensor."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    return True if t.dtype == torch.bool else torch.iinfo(t.dtype).max


def _left_unset(now, held, version):
    """The initialiser left the stand-in `held` alone: still in the module, no in-place op, and still the mark."""
    if now is not held or held._version != version or not held.numel():
        return False
    return bool((held.isnan() if held.is_floating_point() or held.is_complex() else held == _mark(held)).all())


def _refuse_unset(model):
    """At the first forward or save: training on a tensor nothing set would use the mark (NaN)."""
    for module in model.modules():
        if module in _STATE.meta_init.unset:
            path, names, _ = _STATE.meta_init.unset[module]
            lost = sorted(set(names) & module._non_persistent_buffers_set)
            raise ValueError(
                f"{type(module).__name__} at {path or '(the model itself)'!r} was built under torch.device('meta') "
                f"and its tensors {names} were set neither by its initialiser (reset_parameters(), or _init_weights "
                "in a transformers model) nor by load_checkpoint, so they have no value: what __init__ computed on "
                "meta was never computed. Every tensor of a module built on meta must be set by its initialiser or "
                "loaded. Set them in reset_parameters()/_init_weights, build this module off meta (inside "
                "`with torch.device('cpu'):`), or load a checkpoint that holds them before the first forward"
                + (f" (the non-persistent buffers {lost} are in no checkpoint)" if lost else ""))


def _loaded(module):
    """load_checkpoint filled `module`'s persistent tensors: only its non-persistent buffers may still need setting."""
    own, transient = {n for n, _ in _own_tensors(module)}, module._non_persistent_buffers_set
    if module in _STATE.meta_init.pending and own & transient:
        _STATE.meta_init.pending[module][3].update(own - transient)
    elif module in _STATE.meta_init.pending:
        _STATE.meta_init.pending.pop(module)[2].remove()  # and its first-use hook
    _, names, refusal = _STATE.meta_init.unset.get(module, (None, [], None))
    names[:] = [n for n in names if n in transient]
    if refusal is not None and not names:
        refusal.remove()
        del _STATE.meta_init.unset[module]

# --- 11. data loading -----------------------------------------------------------------------------


def _loader_ranks(device):
    if _is_xla(device):  # SPMD: one process per host, each loading its own slice
        xr = _import("torch_xla.runtime")
        return xr.process_count(), xr.process_index()
    return _torch_dist_ranks()


def _distributed_sampler(loader, replicas, rank):
    """A DistributedSampler giving this rank its share where it reproduces the loader's sampler exactly, else None."""
    sampler, data = loader.sampler, torch.utils.data
    shuffle = type(sampler) is data.RandomSampler and not sampler.replacement and sampler._num_samples is None
    if not shuffle and type(sampler) is not data.SequentialSampler:
        return None
    return data.DistributedSampler(loader.dataset, num_replicas=replicas, rank=rank, shuffle=shuffle)


def _split_by_user(sampler, replicas, rank):
    """True for a DistributedSampler already set for this process's rank; one set for another world is an error."""
    if not isinstance(sampler, torch.utils.data.DistributedSampler):
        return False
    if (sampler.num_replicas, sampler.rank) != (replicas, rank):
        raise ValueError(f"the loader's DistributedSampler has num_replicas={sampler.num_replicas}, rank="
                         f"{sampler.rank}, but this process is rank {rank} of {replicas}; build it with those values, "
                         "or pass a plain DataLoader and let prepare_data_loader split it")
    return True


def _rebuild_loader(loader, drop_last, device, data_ranks=None):
    """`loader` split so each rank gets its share of exactly what the user's sampling yields; fixed shapes if asked."""
    data = torch.utils.data
    replicas, rank = data_ranks or _loader_ranks(device)
    if not isinstance(loader, data.DataLoader):
        if replicas > 1:
            logger.warning("seamless_tpu: %s is not a DataLoader, so every rank iterates all of it",
                           type(loader).__name__)
        return loader
    own_batches = loader.batch_size is None  # a user batch_sampler, an iterable yielding batches, or no batching
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(_split_by_user(sampler, replicas, rank) for sampler in samplers):
        replicas, rank = 1, 0  # the user's DistributedSampler gives this rank its share (as Fabric and Ray keep it)
    if replicas == 1 and (drop_last == loader.drop_last or own_batches):
        return loader
    kwargs = {k: getattr(loader, k) for k in ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                                              "generator", "persistent_workers")}
    if loader.num_workers:
        kwargs.update(prefetch_factor=loader.prefetch_factor, multiprocessing_context=loader.multiprocessing_context)
    if isinstance(loader.dataset, data.IterableDataset):
        rebuilt = data.DataLoader(loader.dataset, batch_size=loader.batch_size, drop_last=drop_last and not own_batches,
                                  **kwargs)
        return _ShardedBatches(rebuilt, replicas, rank, drop_last) if replicas > 1 else rebuilt
    if own_batches and loader.batch_sampler is None:  # batch_size=None: each sample is a step, as the dataset gives it
        sampler = (_distributed_sampler(loader, replicas, rank)
                   or _ShardedBatches(loader.sampler, replicas, rank, drop_last))
        return data.DataLoader(loader.dataset, batch_size=None, sampler=sampler, **kwargs)
    if own_batches:
        batches = _ShardedBatches(loader.batch_sampler, replicas, rank, drop_last)
        return data.DataLoader(loader.dataset, batch_sampler=batches, **kwargs)
    split = _distributed_sampler(loader, replicas, rank) if replicas > 1 else None
    sampler, replicas = (loader.sampler, replicas) if split is None else (split, 1)  # a DistributedSampler splits it
    per_epoch = len(sampler) if hasattr(sampler, "__len__") else None
    if drop_last and per_epoch is not None and per_epoch % loader.batch_size:
        _log("seamless_tpu: dropping the last %d of %d samples per epoch to keep batch shapes fixed "
             "(prepare_data_loader(loader, drop_last=False) keeps them)", per_epoch % loader.batch_size, per_epoch)
    if replicas == 1:
        return data.DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=drop_last,
                               **kwargs)
    batches = _ShardedBatches(data.BatchSampler(sampler, loader.batch_size, drop_last), replicas, rank, drop_last)
    return data.DataLoader(loader.dataset, batch_sampler=batches, **kwargs)


class _ShardedBatches:
    """Rank r of n takes batches r, r+n, ... of `batches` (a batch sampler, or a loader over an IterableDataset). As
    many on each rank, or a collective hangs: a short last round is dropped (drop_last) or padded from the start."""

    def __init__(self, batches, replicas, rank, drop_last):
        self.batches, self.replicas, self.rank, self.drop_last = batches, replicas, rank, drop_last

    def __len__(self):
        n = len(self.batches)  # TypeError for a stream of unknown length, as DataLoader raises
        return n // self.replicas if self.drop_last else -(-n // self.replicas)

    def __iter__(self):
        first, round_ = [], []
        for batch in self.batches:
            if len(first) < self.replicas:
                first.append(batch)
            round_.append(batch)
            if len(round_) == self.replicas:
                yield round_[self.rank]
                round_ = []
        if round_ and not self.drop_last:
            round_ += [first[i % len(first)] for i in range(self.replicas - len(round_))]
            yield round_[self.rank]

    def set_epoch(self, epoch):
        _set_epoch(self.batches, epoch)


def _set_epoch(loader, epoch):
    """Reseed every part of a loader that shuffles by epoch: samplers, batch samplers, datasets (HF streaming ones)."""
    parts = [loader] + [getattr(loader, name, None) for name in ("sampler", "batch_sampler", "dataset")]
    for part in {id(p): p for p in parts if p is not None}.values():
        if callable(getattr(part, "set_epoch", None)):
            part.set_epoch(epoch)


class _PendingTensor:
    """Stands in a batch for the `index`-th tensor MpDeviceLoader moves in its thread, due in `arrived`."""

    def __init__(self, arrived, index):
        self.arrived, self.index = arrived, index

    def to(self, device):
        return self.arrived[0][self.index]


class _DeviceLoader:
    """Iterates the loader with batches on the device, advancing sampler epochs (set_epoch(n) when resuming at n)."""

    def __init__(self, loader, device, sharding):
        self.loader, self._device, self._sharding, self._epoch = loader, device, sharding, 0

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch):
        self._epoch = epoch

    def __iter__(self):
        _set_epoch(self.loader, self._epoch)
        self._epoch += 1
        if not _is_xla(self._device):
            return (_move((batch,), self._device) for batch in self.loader)
        return self._xla_batches()

    def _xla_batches(self):
        # MpDeviceLoader moves plain host tensors in its thread; to_device's rules rebuild the rest, as on every path.
        device, sharding, templates = self._device, self._sharding, collections.deque()
        def plain_tensors():  # runs in MpDeviceLoader's thread, ahead of the consumer
            for batch in self.loader:
                tensors, arrived = [], []
                def take(t):
                    plain = type(t) is torch.Tensor and not t.requires_grad and t.device.type == "cpu"
                    if not (plain and sharding.from_host(t)):
                        return t  # moved by to_device's rules below
                    tensors.append(t)
                    return _PendingTensor(arrived, len(tensors) - 1)
                templates.append((_map_tensors(batch, take, lambda obj: obj), arrived))
                yield tensors
        on_tensor = _mover(device, sharding)
        def on_other(obj):
            return obj.to(device) if isinstance(obj, _PendingTensor) else _move_by_own_to(obj, device)
        pl = _import("torch_xla.distributed.parallel_loader")
        for moved in pl.MpDeviceLoader(plain_tensors(), device, input_sharding=sharding):
            template, arrived = templates.popleft()
            arrived.append(moved)
            yield _map_tensors(template, on_tensor, on_other)

# --- 12. preemption -------------------------------------------------------------------------------


def _catch_sigterm():
    """SIGTERM's handler, installed once per process from the main thread (Ray's loop thread may not set handlers)."""
    state, old = _STATE.preemption, signal.getsignal(signal.SIGTERM)
    if state.previous is not None or old is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_grace()  # a bad SEAMLESS_TPU_SIGTERM_GRACE is refused now, not when the signal comes
    state.previous = signal.SIG_DFL if old is None else old  # None: set outside Python
    state.delays_exit = state.previous is signal.SIG_DFL or getattr(old, "__module__", None) == "ray._private.worker"
    signal.signal(signal.SIGTERM, state._on_sigterm)
    _STATE.torch_patches.append(state.close)


@dataclasses.dataclass
class _Preemption:
    """SIGTERM (a spot VM, slice or pod going away) as trainer.preempted, at one step on every process. A user's handler
    is chained, SIG_IGN stays, an exit (the default's, Ray's) is held until SIGTERM_GRACE_S after the signal or save."""

    previous: object = None  # the SIGTERM handler chained; None until ours is installed
    delays_exit: bool = False  # the previous action is an exit (the default's, Ray's): held back, not chained
    sigterm: bool = False  # SIGTERM reached this process
    preempted_at: int = 0  # the step count at which every process learnt that SIGTERM reached one; 0: not yet
    steps: int = 0  # steps of trainers' optimizers only (a probe that only some processes step would skew the counts)
    models: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # every trainer's model
    watching: bool = False  # a trainer's optimizers' steps are counted and agreed on (the first trainer's watch)
    stepped_after: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # optimizers since `preempted`
    group: object = None  # a CPU gloo group of every process, for the agreement; None in one process
    pending: tuple = None  # (work, values) of the all-reduce the last agreement started: [flag, -steps to the next]
    next_agreement: int = 1  # the step count of the next agreement
    agreed_at: tuple = (-math.inf, 0)  # (time.monotonic(), step count) of the last agreement
    deadline: float = None  # time.monotonic() at which the held exit happens; None before SIGTERM
    saves: int = 0  # saves in progress: they hold the exit
    expired: bool = False  # the grace ran out: the handler now acts as the previous one would
    closed: bool = False  # _reset_caches: the held exit no longer applies

    def watch(self, model):
        """From each trainer: its optimizers count; the first also sets up the agreement (a collective)."""
        self.models.add(model)
        _catch_sigterm()  # leaves `previous` None for SIG_IGN, or off the main thread with no Ray backend
        if self.previous is not None and not self.watching:
            self.group, self.watching = _agreement_group(), True
            if self.group is not None:  # whole on every process before any goes on: gloo meets each peer in the
                self.group.barrier().wait()  # background, and one that ended first broke a slower one's mesh
                atexit.register(self.settle)

    def close(self):  # _reset_caches: the previous handler is back, and the held exit no longer applies
        self.closed = True
        signal.signal(signal.SIGTERM, self.previous)
        self.settle()

    def settle(self):
        """At exit, while the interpreter runs, ends the last agreement's all-reduce and the group: left to finalization
        (a peer a little behind), gloo's thread freed its tensor there and the process aborted ("terminate called
        without an active exception"). A crashed peer fails it at once, a stuck one is waited for SETTLE_S."""
        try:
            if self.pending is not None:
                self.pending[0].wait(datetime.timedelta(seconds=SETTLE_S))
        except RuntimeError as e:  # a peer gone or stuck: this process is ending all the same
            logger.warning("seamless_tpu: the SIGTERM agreement in flight did not end at exit (%s); gloo may abort "
                           "this process as it ends", e)
        self.group = None  # first: ending a group joins its threads, which need no GIL while `pending` holds the
        self.pending = None  # tensor; freed after them, here, with the GIL

    def _on_sigterm(self, signum, frame):
        if not self.delays_exit or self.expired or not self.watching:
            self.sigterm |= not self.delays_exit  # a user's handler decides; else the grace is over or none can save
            if callable(self.previous):
                return self.previous(signum, frame)  # the user's, or Ray's (SystemExit)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the default action: the process ends by SIGTERM
            return os.kill(os.getpid(), signal.SIGTERM)
        self.sigterm = True
        if self.deadline is None:  # a second SIGTERM does not postpone the exit
            self.deadline = time.monotonic() + _sigterm_grace()
            threading.Thread(target=self._exit_when_due, name="seamless_tpu-sigterm", daemon=True).start()

    def _exit_when_due(self):
        while not self.closed and (self.saves or time.monotonic() < self.deadline):
            time.sleep(0.1)
        if self.closed:
            return
        self.expired = True
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # Python runs handlers there
        if callable(self.previous):
            return  # Ray's handler ends the worker its own way
        time.sleep(5)  # a main thread held in C code (a compile) runs no Python handler: the default action here
        if not self.closed:
            os._exit(128 + signal.SIGTERM)

    def saving(self):
        """A save starts; call the result when it ends. The held exit waits for it, then the grace again."""
        self.saves += 1
        def done():
            self.saves -= 1
            if self.deadline is not None:
                self.deadline = max(self.deadline, time.monotonic() + _sigterm_grace())
        return done

    def owns(self, optimizer, record):
        """Whether `optimizer` steps a trainer's parameters (a probe's does not): counted here and by the meter."""
        if record.owned != record.groups:  # ids, as a weakref to a parameter makes .to() raise
            ours = {id(p) for model in self.models for p in model.parameters()}
            record.ours = any(id(p) in ours for g in optimizer.param_groups for p in g["params"])
            record.owned = record.groups
        return record.ours

    def after_step(self, optimizer):  # one of a trainer's optimizers stepped
        if not self.watching:
            return
        self.steps += 1
        if self.preempted_at and optimizer in self.stepped_after and self.delays_exit:
            raise RuntimeError(
                f"seamless_tpu: SIGTERM reached this run and trainer.preempted turned True at optimizer step "
                f"{self.preempted_at}, but the loop stepped again. The trainer delays SIGTERM's exit only until the "
                "loop saves: after optimizer.step(), `if trainer.preempted: trainer.save_checkpoint(...); break` "
                "(under Ray, also ray.train.report(..., checkpoint=...)). To train on through a SIGTERM, install "
                "your own SIGTERM handler before creating the trainer; it is chained, and nothing is stopped")
        if not self.preempted_at and self.steps >= self.next_agreement and self._agree():
            self.preempted_at = self.steps
        if self.preempted_at:
            self.stepped_after.add(optimizer)  # the other optimizers of the iteration (a GAN's) may finish it

    def _agree(self):
        """Reads the MAX all-reduce (gloo, CPU) the last agreement started: the flag any process saw (False at first)
        and the fewest steps any proposed; starts the next. No device sync or wait, at step counts all compute alike."""
        if self.group is None:
            return self.sigterm
        agreed, every = False, 1
        if self.pending is not None:
            work, values = self.pending
            work.wait()  # started at the last agreement, steps ago: done unless a peer is that far behind
            agreed, every = bool(values[0]), int(-values[1])
        now, (then, step) = time.monotonic(), self.agreed_at  # proposed: AGREE_EVERY_S of steps, growing slowly
        propose = max(1, min(AGREE_MAX_STEPS, 2 * every, int(AGREE_EVERY_S * (self.steps - step) / (now - then))))
        values = torch.tensor([int(self.sigterm), -propose], dtype=torch.int64)  # MAX of -steps: the fewest proposed
        self.pending = self.group.allreduce(values, torch.distributed.ReduceOp.MAX), values
        self.next_agreement, self.agreed_at = self.steps + every, (now, self.steps)
        return agreed


def _sigterm_grace():
    value = os.environ.get("SEAMLESS_TPU_SIGTERM_GRACE") or SIGTERM_GRACE_S
    with contextlib.suppress(ValueError):
        if 0 <= float(value) < math.inf:
            return float(value)
    raise ValueError(f"SEAMLESS_TPU_SIGTERM_GRACE is how many seconds SIGTERM's exit waits for the loop to save, a "
                     f"number >= 0; got {value!r}. Unset it for the default, {SIGTERM_GRACE_S:g}")


def _agreement_group():
    """A CPU gloo group of every process, or None in one. An XLA slice without torch.distributed gets one over a store
    process 0 serves (torch_xla's preemption sync manager takes SIGTERM in C; every host aborts if its leader exits)."""
    dist = torch.distributed
    if _torch_dist_ranks()[0] > 1:
        return dist.new_group(backend="gloo")
    count, index, address = _xla_processes()
    if count == 1:
        return None
    port = int(os.environ.get("SEAMLESS_TPU_PORT") or AGREEMENT_PORT)
    timeout = datetime.timedelta(minutes=30)  # torch.distributed's default: hosts start minutes apart
    try:
        store = dist.TCPStore(address, port, count, index == 0, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # DistNetworkError and DistStoreError are RuntimeErrors
        raise RuntimeError(f"seamless_tpu: process {index} of {count} could not {'serve' if index == 0 else 'reach'} "
                           f"the store at {address}:{port} that the hosts agree on SIGTERM through ({e}). Set "
                           "SEAMLESS_TPU_PORT to a port free on process 0's host, the same on every host") from e
    _log("seamless_tpu: SIGTERM agreement among %d XLA processes over %s:%d", count, address, port)
    return dist.ProcessGroupGloo(dist.PrefixStore("seamless_tpu/preemption", store), index, count, timeout)


def _xla_processes():
    """(count, index, address of process 0) of this XLA run's processes: one per host of a TPU slice."""
    if _STATE.xla_device is None or _import("torch_xla.runtime").process_count() == 1:
        return 1, 0, None
    xr = _import("torch_xla.runtime")
    return xr.process_count(), xr.process_index(), os.environ.get("MASTER_ADDR") or xr.get_master_ip()

# --- 13. the trainer ------------------------------------------------------------------------------


class SeamlessTPUTrainer:
    """Puts `model` on the best device and makes the user's plain loop correct there.

    - XLA: SPMD on, model replicated over the mesh (strategy="ddp") or every parameter sharded over its fsdp axis
      ("fsdp"); every optimizer.step() ends in torch_xla.sync(); recompile watchdog.
    - GPU/CPU with torch.distributed running (Ray, torchrun): DDP ("ddp") or FSDP2 ("fsdp").
    - A "model" mesh axis: the tensor-parallel plan splits weights over it (GSPMD on XLA; off XLA torch TP, then FSDP2).
    - batch_dim: where batches hold their samples (default: 1 when the model's RNNs and attention are batch_first=False,
      else 0). On XLA that dimension is split, and stays split through linear, layer_norm and attention.
    - scan: on XLA a stack of identical blocks (transformer layers) runs as one loop: one block compiled and, under
      fsdp, gathered at a time; False runs them one by one.
    An optimizer passed here gets its existing state laid out like its parameters."""

    def __init__(self, model, optimizer=None, *, device=None, mesh=None, xla_spmd_config=None, precision=None,
                 drop_last=None, strategy="ddp", tp_plan=None, batch_dim=None, log_every=None, log_to=None,
                 progress=None, scan=True):
        _check_trainer_args(model, mesh, xla_spmd_config, precision, strategy)
        self.layout = _plan_layout(model, device, mesh, xla_spmd_config, strategy, tp_plan, batch_dim, scan)
        self.device, self.kind, self.mesh = self.layout.device, self.layout.kind, self.layout.mesh
        self.precision, self.drop_last, self.strategy = precision, drop_last, strategy
        self.model = _place(model, self.layout)
        if optimizer is not None:
            _place_optimizer_state(optimizer)
        _install_step_hooks()
        _STATE.preemption.watch(self.model)
        _STATE.meter.watch(self.model, self.layout)
        self.log_every, self.log_to, self.progress = log_every, log_to, progress
        table = _describe(self.model, self.layout, ()).split("\n")
        _log("seamless_tpu: %s; %s", table[0], table[-1])  # the whole table: trainer.describe()

    @property
    def preempted(self):
        """True from the first optimizer step after SIGTERM reached any process, the same on all: save, then stop."""
        return _STATE.preemption.preempted_at > 0

    def to_device(self, *objs):
        """Like to_device(); on XLA every tensor's batch dimension (batch_dim) is split over this trainer's mesh."""
        return _move(objs, self.device, self.layout.batch)

    def prepare_data_loader(self, loader, drop_last=None):
        """Wrap `loader` so batches arrive on the device (sharded on XLA) and each rank reads its own part of the
        dataset. On XLA the last incomplete batch is dropped by default: its shape would compile a second graph
        (seconds to minutes on TPU). drop_last=False (here or to the trainer) keeps it."""
        drop_last = self.drop_last if drop_last is None else drop_last
        drop_last = _is_xla(self.device) if drop_last is None else drop_last
        return _DeviceLoader(_rebuild_loader(loader, drop_last, self.device, self.layout.data_ranks), self.device,
                             self.layout.batch)

    def autocast(self):
        """Context for the forward pass: bf16 autocast when precision='bf16', else a no-op."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        device_type = "xla" if self.kind in XLA_DEVICE_KINDS else ("cuda" if self.kind == "gpu" else "cpu")
        return torch.autocast(device_type, dtype=torch.bfloat16)

    def save(self, obj, path):
        """Sync, copy to CPU, write from process 0 only. The file loads on any device, with the model's own keys (no
        DDP or torch.compile prefixes). Atomic: a crash mid-save leaves the previous file. Every rank returns, or
        raises the same error, together."""
        return _save_file(obj, path)

    def save_checkpoint(self, directory, *, blocking=True, keep_last=1, **state):
        """A sharded checkpoint of modules, optimizers and plain picklable values (epoch, RNG states): every process
        writes only its shards (torch.distributed.checkpoint; on XLA torch_xla's SPMD planner), and replacing
        `directory/LATEST` commits it atomically, so a crash leaves the previous checkpoint loadable. Returns
        `directory`, or with blocking=False a concurrent.futures.Future of it: the state is copied to the host and a
        thread writes and commits it meanwhile. keep_last=K keeps the K newest commits, named in `directory/HISTORY`
        (load one as `directory/<name>`). `blocking` and `keep_last` are reserved names, like `directory`."""
        return _save_checkpoint(directory, state, blocking, keep_last)

    def load_checkpoint(self, directory, **state):
        """Load modules and optimizers saved by save_checkpoint in place, onto this trainer's device, mesh and
        strategy, whatever they were at save time; returns the plain values (epoch, ...). Each process reads only the
        saved chunks that overlap its own shards, straight into them: no whole copy on the host."""
        return _load_checkpoint(directory, state)

    def compile_stats(self):
        """XLA compiles, cached compiles, executions, device->host transfers, and the persistent compile cache's hits,
        misses and failures to read an executable back (all 0 off XLA)."""
        return _compile_stats(_is_xla(self.device))

    def memory_stats(self, *optimizers):
        """{"per_device": [bytes on each device], "replica": bytes of one whole copy} of the model's parameters and
        each optimizer's tensor state, counted from the shards (torch_xla's memory query does not work under SPMD).
        Off XLA, per_device holds this rank's bytes."""
        return _memory_stats(self.model, optimizers)

    def stats(self):
        """What the last RATE_WINDOW steps of the trainers' optimizers cost (not a probe's or another loop's), read
        with no sync, compile or transfer: steps, samples and tokens so far (of all processes), step_time_s (wall
        time between step ends), device_time_s (XLA: the devices' execution time per step) and host_bound,
        samples_per_s, tokens_per_s, flops_per_device (the first step's, counted from the shapes of its matmuls,
        convolutions, attention and, on XLA, einsums and RNNs, forward and backward; flops_from "flop_counter", None
        where nothing was counted), tflops_per_device, and mfu against the device's dense bf16 peak (None where it is
        not known: CPU, XLA:CPU). Samples and tokens: the batch dim of the model's first tensor input, and the size of
        its first integer one, in forwards under grad."""
        return _STATE.meter.stats()

    def log(self, step, **metrics):
        """Log numbers and one-element tensors (loss=loss, lr=...) without stalling the step: their values are read
        once their step's graph has run, on a thread of their own, and every log_every steps (default: 5 s worth)
        one line of their means plus throughput and MFU goes to the logger at info on rank 0, and to log_to(dict).
        progress=True shows a tqdm bar (default: when stderr is a terminal). An error there is raised by the next
        call."""
        _STATE.run_log.log(step, metrics, self.log_every, self.log_to, self.progress, self.stats)

    def describe(self, *optimizers):
        """A text table: the mesh, how batches split, and for each parameter its shape, how each dimension is split
        and its bytes per device, with the parameter and optimizer-state totals against one replica. Read from the
        tensors' real shardings (XLA specs, DTensor placements), not the plan."""
        return _describe(self.model, self.layout, optimizers)

    def profile(self, logdir, steps=None):
        """Trace from now until `steps` optimizer steps end (or the with-block exits, or .stop()) into `logdir`, for
        TensorBoard's profiler: `with trainer.profile("runs/prof", steps=3): ...`. Waits for the devices at its start
        and end only."""
        return _Profile(logdir, steps, _is_xla(self.device))

# --- 14a. what a run costs: stats and logging -----------------------------------------------------


# Dense bf16 peak FLOP/s per device, for MFU, matched in order against the device kind (torch_xla's, or CUDA's name).
# Where none matches (CPU, XLA:CPU, an unknown chip) MFU is None. v4 and v5p show a chip's 2 cores as one device.
PEAK_FLOPS = (
    (r"7x|v7", 2307e12 / 2),  # cloud.google.com/tpu/docs/tpu7x: 4614 TFLOPs fp8 per chip, bf16 half; 2 devices
    (r"v6", 918e12),  # cloud.google.com/tpu/docs/v6e: 918 TFLOPs per chip (bf16)
    (r"v5 ?lite|v5e", 197e12),  # cloud.google.com/tpu/docs/v5e: 197 TFLOPs per chip (bf16)
    (r"v5", 459e12),  # cloud.google.com/tpu/docs/v5p: 459 TFLOPs per chip (bf16)
    (r"v4", 275e12),  # cloud.google.com/tpu/docs/v4: 275 TFLOPs per chip (bf16)
    (r"b200", 2250e12),  # NVIDIA HGX B200 datasheet: 4.5 PFLOPS bf16 with sparsity, dense half
    (r"h100.*pcie", 756e12),  # NVIDIA H100 datasheet, PCIe: 1513 TFLOPs bf16 with sparsity
    (r"h100|h200|gh200", 989e12),  # NVIDIA H100 SXM / H200 datasheets: 1979 TFLOPs bf16 with sparsity
    (r"a100", 312e12),  # NVIDIA A100 datasheet: 312 TFLOPs bf16 dense
)
RATE_WINDOW = 20  # step ends the rates are measured over: recent enough to follow the run, long enough to be stable
FLOP_FORWARDS = 64  # training forwards the first step's FLOP count may span: past them (forwards under grad that
# never step, or more micro-batches) it stops, uncounted, and ops stop costing a Python call each


@dataclasses.dataclass
class _Meter:
    """What the trainers' steps cost, counted with no sync: the samples and tokens their models took under grad, the
    wall time at each step end of a trainer's optimizer (as preemption decides: not a probe's), the first such step's
    FLOPs (_FlopCount, from the first training forward on) and, when asked, the devices' execution time (XLA)."""

    steps: int = 0  # the trainers' optimizer steps, samples and tokens since the trainers were built
    samples: int = 0
    tokens: int = 0
    kind: str = None  # of the last trainer built: its device kind, batch dim and data-parallel ways
    batch_dim: int = 0
    data_ways: int = 1
    stepped: bool = False  # a step ended since the last trainer was built: the next one starts afresh
    step_flops: int = None  # the first step's FLOPs (XLA: over the whole mesh), once it ended
    counting: object = None  # the _FlopCount in force from the first training forward until that step ends
    # (perf_counter, time.time, steps, samples, tokens) at the last RATE_WINDOW step ends and the one before them
    ends: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=RATE_WINDOW + 1))

    def watch(self, model, layout):
        if self.stepped:  # counts, FLOPs and rates are of the trainers built since the last step (a GAN's two)
            self.steps = self.samples = self.tokens = 0
            self.step_flops, self.stepped = None, False
            self.ends.clear()
        self.kind, self.batch_dim = layout.kind, layout.batch_dim
        # processes that each read their own batch; on XLA 1: the batch's shape is the whole slice's already
        self.data_ways = 1 if layout.mesh is not None else (layout.data_ranks or _torch_dist_ranks())[0]
        model.register_forward_pre_hook(_owned(model, self._count_inputs), with_kwargs=True)

    def _count_inputs(self, module, args, kwargs):
        if torch.is_grad_enabled():  # a training forward; eval batches are not the step's work
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            ids = [t for t in tensors if t.dim() > 1 and not (t.is_floating_point() or t.is_complex())]
            dim = self.batch_dim if tensors and tensors[0].dim() > self.batch_dim else 0
            self.samples += tensors[0].shape[dim] if tensors else 0
            self.tokens += ids[0].numel() if ids else 0
            # a mode the user is in may end before the step does: popping ours then would pop theirs
            if self.step_flops is None and self.counting is None and not is_in_torch_dispatch_mode():
                self.counting = _FlopCount(_STATE.xla_device is not None).start()
            elif self.counting is not None and self.counting.thread == threading.get_ident():
                self.counting.forwards += 1
                if self.counting.forwards > FLOP_FORWARDS:
                    self.step_flops, self.counting = self.counting.stop() and 0, None

    def step_end(self):  # one of a trainer's optimizers stepped: a few attribute writes, no call into torch_xla
        if self.counting is not None and self.counting.thread == threading.get_ident():  # modes are per thread
            self.step_flops, self.counting = self.counting.stop(), None
        self.steps, self.stepped = self.steps + 1, True
        self.ends.append((time.perf_counter(), time.time(), self.steps, self.samples, self.tokens))

    def stats(self):
        xla, (first, last) = _STATE.xla_device is not None, (self.ends[0], self.ends[-1]) if self.ends else (None,) * 2
        out = {"steps": self.steps, "samples": self.samples * self.data_ways, "tokens": self.tokens * self.data_ways}
        out.update(dict.fromkeys(("step_time_s", "device_time_s", "host_bound", "samples_per_s", "tokens_per_s",
                                  "flops_per_device", "tflops_per_device", "mfu", "flops_from", "peak_tflops")))
        if not self.ends or last[2] == first[2]:
            return out
        steps, wall = last[2] - first[2], last[0] - first[0]
        out["step_time_s"] = wall / steps
        out["samples_per_s"] = (last[3] - first[3]) * self.data_ways / wall
        out["tokens_per_s"] = (last[4] - first[4]) * self.data_ways / wall or None
        if xla:  # torch_xla's execution times carry the wall clock at which each ended: those inside the window
            data = _import("torch_xla.debug.metrics").metric_data("ExecuteReplicatedTime") or (0, 0, ())
            out["device_time_s"] = sum(ns for at, ns in data[2] if first[1] < at <= last[1]) / 1e9 / steps
            out["host_bound"] = out["step_time_s"] > 1.25 * out["device_time_s"]  # tracing sets the pace
        if self.step_flops:  # XLA's shapes are the whole mesh's; a process's elsewhere (a DTensor op's: its shard's)
            devices = _import("torch_xla.runtime").global_runtime_device_count() if xla else 1
            flops, out["flops_from"] = self.step_flops / devices, "flop_counter"
            peak = _peak_flops(self.kind)
            out["flops_per_device"], out["tflops_per_device"] = flops, flops / out["step_time_s"] / 1e12
            out["peak_tflops"], out["mfu"] = peak and peak / 1e12, peak and flops / out["step_time_s"] / peak
        return out


LOG_EVERY_S = 5.0  # trainer.log()'s default: one line per few seconds of training, whatever a step costs
LOG_HELD = 1000  # values held for the next line at most: then a line is due (a few KiB of device scalars)


@dataclasses.dataclass
class _RunLog:
    """trainer.log()'s values, held until a line is due (every `every` steps, else LOG_EVERY_S seconds or LOG_HELD
    calls), read on their own thread once their step's graph ran (XLA: one transfer, from a step closure of that graph,
    never mid-trace; CUDA: async copies), averaged, and written with the throughput to the logger (rank 0) and `to`."""

    thread: object = None  # the one thread that reads values and writes lines, from the first line
    held: list = dataclasses.field(default_factory=list)  # (name, value: float, tensor or (copy, CUDA event))
    last: float = 0.0  # time.monotonic() of the last line: the first call makes one
    bar: object = None  # the tqdm bar (False: none), decided at the first call
    failed: BaseException = None  # the thread's error, raised by the next log()

    def log(self, step, metrics, every, to, progress, stats):
        if self.failed is not None:  # the thread's error (a hook's, a transfer's), raised where the user can see it
            error, self.failed = self.failed, None
            raise RuntimeError(f"seamless_tpu: trainer.log() failed on an earlier step: {error!r}") from error
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.detach()
                value = value.item() if value.device.type == "cpu" and not _is_xla(value.device) else value
                if isinstance(value, torch.Tensor) and value.is_cuda:  # the copy is queued behind what computes it
                    value = (value.to("cpu", non_blocking=True), torch.cuda.Event())
                    value[1].record()
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"trainer.log() takes numbers and one-element tensors, got {name}={value!r}: log a "
                                "reduction of it (loss.mean()) or a float")
            self.held.append((name, value))
        if self.bar is None:
            tqdm = importlib.util.find_spec("tqdm") and importlib.import_module("tqdm")
            wanted = progress or (progress is None and sys.stderr.isatty())
            self.bar = tqdm.tqdm(desc="steps", initial=step - 1) if tqdm and wanted and _is_main_process() else False
        if self.bar is not False:
            self.bar.update(step - self.bar.n)
        now = time.monotonic()
        if not (step % every == 0 if every else now - self.last >= LOG_EVERY_S or len(self.held) >= LOG_HELD):
            return
        self.thread = self.thread or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="seamless_tpu_log")
        job = functools.partial(self._write, step, self.held, to, stats(), _is_main_process())
        self.held, self.last = [], now
        xla = [v for _, v in job.args[1] if isinstance(v, torch.Tensor) and _is_xla(v.device)]
        if xla and not all(_is_device_data(t) for t in xla):  # the pending graph computes them: after its cut
            _import("torch_xla.core.xla_model").add_step_closure(self.thread.submit, (job,))
        else:
            self.thread.submit(job)

    def _write(self, step, held, to, stats, main):
        try:
            xla = [i for i, (_, v) in enumerate(held) if isinstance(v, torch.Tensor)]
            fetched = _import("torch_xla")._XLAC._xla_get_cpu_tensors([held[i][1] for i in xla]) if xla else []
            values = dict(zip(xla, (t.item() for t in fetched)))  # one transfer for all of them
            sums = collections.defaultdict(list)
            for i, (name, value) in enumerate(held):
                if isinstance(value, tuple):
                    value[1].synchronize()  # this thread waits for the copy; the training thread never does
                sums[name].append(values[i] if i in values else float(value[0] if isinstance(value, tuple) else value))
            line = {"step": step, **{k: sum(v) / len(v) for k, v in sums.items()}}
            line.update((k, stats[k]) for k in ("samples_per_s", "tokens_per_s", "tflops_per_device", "mfu")
                        if stats[k])
            if main:
                text = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in line.items())
                if self.bar is not False:
                    self.bar.set_postfix_str(text[len(f"step {step}  "):])
                logger.info("seamless_tpu: %s", text)
                if to is not None:
                    to(line)
        except BaseException as e:  # nothing here may die unseen: the next log() call raises it
            self.failed = e

    def close(self):  # _reset_caches and tests: the values in flight are written first
        if self.thread is not None:
            self.thread.shutdown(wait=True)
        if self.bar is not None and self.bar is not False:
            self.bar.close()


_COMPILE_COUNTERS = {"compiles": "UncachedCompile", "cached_compiles": "CachedCompile",
                     "executions": "ExecuteReplicated", "persistent_cache_hits": "PersistentCacheHit",
                     "persistent_cache_misses": "PersistentCacheMiss",
                     "persistent_cache_failures": "PersistentCacheDeserializeFailure"}


def _compile_stats(xla):
    if not xla:
        return {**dict.fromkeys(_COMPILE_COUNTERS, 0), "device_to_host_transfers": 0}
    met = _import("torch_xla.debug.metrics")
    transfers = met.metric_data("TransferFromDeviceTime")
    stats = {key: met.counter_value(name) or 0 for key, name in _COMPILE_COUNTERS.items()}
    return {**stats, "device_to_host_transfers": transfers[0] if transfers else 0}


# Reads of a value to the host, counted under aten:: though nothing lacks a lowering: the transfer is the point, and
# the watchdog and compile_stats() count it. Measured on torch_xla 2.9 SPMD, 4 CPU devices: .item(), float(), int(),
# bool(t), `if t > 0:`, f"{t:.3f}", torch.allclose and .all().item() each add aten::_local_scalar_dense once; .tolist(),
# str(t), print(t), .cpu() and numpy() add no aten:: counter. Still named: torch.equal (aten::equal copies both tensors
# whole; (a == b).all() reads one value), torch._assert_async, nonzero, unique, histc (no lowering).
_HOST_READS = frozenset({"aten::_local_scalar_dense"})


def _name_cpu_fallbacks(met, named):
    """Warns once per op torch_xla 2.9 ran on the CPU for lack of a lowering: its aten:: counters (its only use of that
    prefix) less the host reads and `named` (those warned about); and once if the persistent compile cache could
    not be read back. The watchdog's, at each cut: ~1 us."""
    if met.counter_value("PersistentCacheDeserializeFailure") and _once("cache_unreadable"):
        logger.warning(
            "seamless_tpu: torch_xla %s could not read back the executables in its persistent compile cache (%s): "
            "it deletes each and compiles again, so a restart costs the whole first-run compile. This is "
            "pytorch/xla#9094 (TPU: 'Deserializing serialized executable not supported'), fixed by pytorch/xla#9759 "
            "in a later torch_xla; until you have it, %s=off (or unsetting XLA_PERSISTENT_CACHE_PATH) stops the "
            "writes that buy nothing.", _version("torch_xla"), os.environ.get("XLA_PERSISTENT_CACHE_PATH"),
            COMPILE_CACHE_ENV)
    ops = sorted(n for n in met.counter_names() if n.startswith("aten::") and n not in named and n not in _HOST_READS)
    if ops:
        named.update(ops)
        logger.warning(
            "seamless_tpu: torch_xla ran %s on the CPU (no XLA lowering in torch_xla %s): each call waits for the "
            "device, copies its inputs to the host and its result back, whole on every device. Build it from ops "
            "XLA lowers, or move it out of the loop; PT_XLA_DEBUG_LEVEL=1 shows where it is called.",
            ", ".join(ops), _version("torch_xla"))


def _state_tensors(optimizers):
    return [v for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim()]


def _memory_stats(model, optimizers):
    tensors = list(model.parameters()) + _state_tensors(optimizers)
    return {"per_device": _device_bytes(tensors), "replica": sum(t.numel() * t.element_size() for t in tensors)}


def _device_bytes(tensors):
    """memory_stats' per_device: on XLA from the shards' shapes, off it this rank's local part (an FSDP2 shard)."""
    if _STATE.xla_device is None:
        return [sum(map(_bytes_per_device, tensors))]
    xlac = _import("torch_xla")._XLAC
    _import("torch_xla.core.xla_model").wait_device_ops()  # shards are readable once the step that made them ran
    per_device = [0] * _import("torch_xla.runtime").global_runtime_device_count()
    for t in tensors:  # torch_xla lists no shards of a tensor without a sharding: it is whole everywhere
        shards = xlac._get_local_shards([t])[0] if xlac._get_xla_sharding_spec(t) else [(t, None)] * len(per_device)
        for i, (shard, _) in enumerate(shards):
            per_device[i] += shard.numel() * shard.element_size()
    return per_device

# --- 14b. what a run costs: the sharding map and the work check -----------------------------------


def _describe(model, layout, optimizers):
    """trainer.describe(): the mesh, the batch split, and per parameter (repeated blocks folded into one row) how
    each dimension is split and the bytes a device holds, all read from the tensors' own shardings."""
    if layout.mesh is not None:
        where = (f"mesh {tuple(layout.mesh.mesh_shape)} {tuple(layout.mesh.axis_names)} over "
                 f"{math.prod(layout.mesh.mesh_shape)} {layout.kind} devices; batches split {layout.batch.ways} ways "
                 f"on dim {layout.batch.dim} over {tuple(layout.batch.axes)}")
    else:
        where = f"{layout.device}, {_torch_dist_ranks()[0]} process(es), {layout.wrap or 'no wrapper'}"
    rows = collections.OrderedDict()  # (name pattern, shape, splits) -> (parameters, bytes each on a device)
    for name, p in model.named_parameters():
        key = (_name_pattern(name), tuple(p.shape), _splits(p, layout.mesh))
        rows[key] = (rows.get(key, (0,))[0] + 1, _bytes_per_device(p))
    table = [where, f"{'parameter':48} {'shape':>18} {'split':>14} {'per device':>11}"]
    table += [f"{name + (f' (x{count})' if count > 1 else ''):48} {str(shape):>18} "
              f"{'[' + ', '.join(splits) + ']':>14} {_fmt_bytes(each):>11}"
              for (name, shape, splits), (count, each) in rows.items()]
    state = _state_tensors(optimizers)
    totals = (("parameters", list(model.parameters()), sum(count * each for count, each in rows.values())),
              ("optimizer state", state, sum(map(_bytes_per_device, state))))
    for what, tensors, mine in totals:
        if tensors:
            whole = sum(t.numel() * t.element_size() for t in tensors)
            table.append(f"{what}: {_fmt_bytes(mine)} per device of {_fmt_bytes(whole)} in one replica "
                         f"({mine / whole:.2f})")
    return "\n".join(table)


def _splits(tensor, mesh):
    """The mesh axes each dimension of `tensor` is split over ('fsdp', 'fsdp*model'), or '-': a DTensor's placements,
    or on XLA its tile assignment (the axes whose coordinate changes between the devices of one dimension's tiles)."""
    names = [[] for _ in range(tensor.dim())]
    if hasattr(tensor, "placements"):
        for i, placement in enumerate(tensor.placements):
            if placement.is_shard():
                dims = tensor.device_mesh.mesh_dim_names
                names[placement.dim].append(dims[i] if dims else str(tensor.device_mesh.size(i)))
    elif _is_xla(tensor.device) and _is_split(tensor):
        found = re.search(r"devices=\[([\d,]+)\]([\d,]+)", _import("torch_xla")._XLAC._get_xla_sharding_spec(tensor))
        tiles, order = [int(t) for t in found[1].split(",")], [int(d) for d in found[2].split(",")]
        ids = [int(i) for i in mesh.device_ids]
        coords = {d: [ids.index(d) // math.prod(mesh.mesh_shape[k + 1:]) % n for k, n in enumerate(mesh.mesh_shape)]
                  for d in ids}
        for dim in range(tensor.dim()):
            tile = [order[i * math.prod(tiles[dim + 1:])] for i in range(tiles[dim])]  # its tiles' first devices
            names[dim] = [a for k, a in enumerate(mesh.axis_names) if len({coords[d][k] for d in tile}) > 1]
    return tuple("*".join(n) or "-" for n in names)


def _bytes_per_device(tensor):
    """Bytes of `tensor` on one device: its local shard (DTensor), its tile (XLA pads uneven splits), or all of it."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    elif _is_xla(tensor.device) and _is_split(tensor):
        return math.prod(-(-n // _split_ways(tensor, d)) for d, n in enumerate(tensor.shape)) * tensor.element_size()
    return tensor.numel() * tensor.element_size()


def _fmt_bytes(n):
    return next(f"{n / 1024 ** i:.1f} {unit}" for i, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))
                if n < 1024 ** (i + 1) or unit == "TiB")


@dataclasses.dataclass
class _WorkCheck:
    """What the work check holds between a model's first forward and its step (_check_work)."""

    held: list = dataclasses.field(default_factory=list)  # (name, module, output, input) of the first forwards
    checks: list = dataclasses.field(default_factory=list)  # a model's check, due once its first forward ended
    armed: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)  # modules whose first forward it reads

    def probe(self, block, run):
        """A loop of blocks (9c) in a first forward the check reads: run() runs its first two blocks on their own as
        well, so the check reads `block`'s modules as unrolled (an outline of the loop's split); nothing keeps their
        results but the held tensors, so the step's graph is the later steps'. Not counted as the step's FLOPs."""
        if any(m in self.armed for m in block.modules()):
            counting, gates = _STATE.meter.counting, dict(_STATE.cuts.gates)  # a gate on them would keep them
            flops = counting and counting.flops
            with torch.no_grad():
                run()
            if counting:
                counting.flops = flops
            _STATE.cuts.gates = gates

    def outputs(self):
        """The held tensors, once a check is due: _state_first makes them data on the devices with the state."""
        return [t for h in self.held for t in h[2:] if t is not None] if self.checks else []

    def run(self):  # before the step's cut (8): the checks read the held tensors' shardings
        checks, self.checks = self.checks, []
        while self.held and checks:
            checks.pop()()

    def drop(self):  # any cut: as outputs of a graph that repeats, they would make its first run a graph of its own
        self.held.clear()
        self.checks.clear()


def _check_work(model, layout):
    """The guard for models nobody tried: on the first forward, hold the input and output of the first matmul module
    of each name pattern (layers.#.mlp.up_proj) up to the first block's end (the head's input took the whole forward,
    a quarter of a 4-layer LoRA student's first compile); before the step, run them as a graph of their own
    (_state_first), read how XLA split each and warn once if over 5% of those FLOPs ran whole. A whole input counts:
    the backward's matmuls compute it whole too. Any other cut drops them first, so a repeating first graph is not
    checked."""
    devices, held, handles = math.prod(layout.mesh.mesh_shape), _STATE.work_check.held, []
    counts = collections.Counter()
    past_first_block = []

    def hold(module, args, output):
        if _transformed() or past_first_block:  # torch.func's wrappers: no sharding to read, nor the graph's work
            return
        out = output[0] if isinstance(output, (tuple, list)) else output
        x = args[0] if args and isinstance(args[0], torch.Tensor) and _is_xla(args[0].device) else None
        if isinstance(out, torch.Tensor) and _is_xla(out.device) and out.dim() > 1:  # not their autograd graphs
            held.append((names[module], module, out.detach(), x if x is None or x.dim() < 2 else x.detach()))

    def check():
        total, whole = 0, []
        for name, module, out, x in held:
            flops = _matmul_flops(module, out) * counts[_name_pattern(name)]
            weight = getattr(module, "weight", None)
            ways = _split_ways(out) * (_split_ways(weight, dim=-1) if weight in layout.planned else 1)  # rowwise
            x_ways = layout.batch.ways if x is None or x.dim() < 2 else _split_ways(x)
            total += flops
            if ways < devices or x_ways < layout.batch.ways:
                whole.append((flops, name, module, min(ways, x_ways)))
        held.clear()
        share = sum(w[0] for w in whole) / total if total else 0
        if share > 0.05 and _once("replicated_work"):
            _, name, module, ways = whole[0]
            logger.warning(
                "seamless_tpu: %.0f%% of the model's matmul FLOPs run whole where %d devices should split them (%dx "
                "their cost), first at %r (%s, its input or output split only %d ways): XLA lost the batch split "
                "there or just before it. Keep the batch dimension through the reshapes before that module (fold (T, "
                "B) into B*T, not T*B), pass batch_dim= if batches hold their samples elsewhere than dim %d, or mark "
                "its input with torch_xla.distributed.spmd.mark_sharding", 100 * share, devices, devices // ways, name,
                type(module).__name__, ways, layout.batch.dim)

    def first_block_done(module, args):
        past_first_block.append(True)

    def first_forward_done(module, args, output):
        for handle in handles:
            handle.remove()
        _STATE.work_check.armed.clear()
        _STATE.work_check.checks.append(check)

    names = {m: n for n, m in model.named_modules()}
    if devices > 1:
        for module, name in names.items():
            if isinstance(module, _MATMULS):
                pattern = _name_pattern(name)
                counts[pattern] += 1
                if counts[pattern] == 1:
                    handles.append(module.register_forward_hook(_owned(module, hold)))
                    _STATE.work_check.armed.add(module)
                elif counts[pattern] == 2:
                    handles.append(module.register_forward_pre_hook(_owned(module, first_block_done)))
        handles.append(model.register_forward_hook(_owned(model, first_forward_done)))


_MATMULS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.RNNBase, torch.nn.MultiheadAttention)


def _matmul_flops(module, output):
    """A matmul module's forward FLOPs from its output: 2 x rows x weights, exact for Linear, a convolution (rows:
    output positions), an RNN's input and state products, and attention's projections (not its scores)."""
    out = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        return 0
    rows = out.numel() // out.shape[1 if isinstance(module, torch.nn.modules.conv._ConvNd) else -1]
    return 2 * rows * sum(p.numel() for p in module.parameters() if p.dim() > 1)


def _name_pattern(name):  # layers.3.mlp.up_proj -> layers.#.mlp.up_proj: one name for a repeated block's modules
    return re.sub(r"\.\d+(?=\.|$)", ".#", name)


def _split_ways(tensor, dim=None):
    """How many ways XLA split `tensor` (its dimension `dim` only, if given), from its sharding annotation."""
    spec = _import("torch_xla")._XLAC._get_xla_sharding_spec(tensor)
    tiles = re.search(r"devices=\[([\d,]+)\]", spec)
    if not tiles:
        return 1
    tiles = [int(t) for t in tiles.group(1).split(",")]
    tiles = tiles[:-1] if "last_tile_dim_replicate" in spec else tiles
    return tiles[dim] if dim is not None else math.prod(tiles)

# --- 14c. what a run costs: the profiler and the compile cache ------------------------------------


class _Profile:
    """trainer.profile(): a TensorBoard trace until `steps` optimizer steps end or the with-block exits (XLA:
    torch_xla's profiler, xplane.pb; else torch.profiler's Chrome trace); syncs the devices at start and end only."""

    def __init__(self, logdir, steps, xla):
        self.logdir, self.left, self.xla, self.torch_profiler = os.fspath(logdir), steps, xla, None
        if _STATE.profile is not None:
            raise RuntimeError(f"trainer.profile(): a trace into {_STATE.profile.logdir!r} is in progress; one at a "
                               "time (torch_xla's profiler allows one session)")
        self._wait()
        if xla:
            _import("torch_xla.debug.profiler").start_trace(self.logdir)
        else:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.torch_profiler = torch.profiler.profile(
                activities=activities, on_trace_ready=torch.profiler.tensorboard_trace_handler(self.logdir))
            self.torch_profiler.start()
        _STATE.profile = self  # the post-step hook counts its steps (8)

    def _wait(self):  # the trace holds whole steps: what ran before is done, what it covers has run
        if self.xla:
            _import("torch_xla.core.xla_model").wait_device_ops()
        elif torch.cuda.is_available():
            torch.cuda.synchronize()

    def step_end(self):
        self.left = None if self.left is None else self.left - 1
        if self.left == 0:
            self.stop()

    def stop(self):
        if _STATE.profile is not self:
            return
        _STATE.profile = None
        self._wait()
        if self.xla:
            _import("torch_xla.debug.profiler").stop_trace()
        else:
            self.torch_profiler.stop()
        _log("seamless_tpu: profile written to %s (tensorboard --logdir %s)", self.logdir, self.logdir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _init_compile_cache(kind):
    """TPU, before the first compile: torch_xla's persistent compile cache, one directory per accelerator type and host
    (one shared between hosts misses: vLLM went per rank), unless the user set one up or turned it off. Off on XLA:CPU,
    where torch_xla 2.9 writes it but cannot read it ("Deserializing serialized executable not supported")."""
    choice = os.environ.get(COMPILE_CACHE_ENV) or ""
    if kind != "tpu":
        if choice not in ("", "off") and _once("compile_cache"):
            _log("seamless_tpu: %s=%s ignored: torch_xla 2.9 cannot read its compile cache back on XLA:CPU",
                 COMPILE_CACHE_ENV, choice)
        return
    if choice.lower() == "off" or os.environ.get("XLA_PERSISTENT_CACHE_PATH") or (
            _import("torch_xla")._XLAC._xla_computation_cache_is_initialized()):
        return
    root = choice or os.path.join(os.path.expanduser("~"), ".cache", "seamless_tpu", "xla_cache")
    path = os.path.join(root, f"{os.environ.get('TPU_ACCELERATOR_TYPE') or 'tpu'}-{socket.gethostname()}")
    # torch_xla's own initialize_cache(path) writes the same two variables over the user's, and asserts.
    applied = _setdefault_env({"XLA_PERSISTENT_CACHE_PATH": path, "XLA_PERSISTENT_CACHE_READ_ONLY": "0"})
    _log("seamless_tpu: XLA compile cache in %s (set %s; %s=off turns it off)", path, sorted(applied),
         COMPILE_CACHE_ENV)

# --- 14d. what a run costs: the environment report ------------------------------------------------


# The environment report: `python -m seamless_tpu [--probe] [--ray[=ADDRESS]]` prints what to paste into an issue.
_REPORT_ENV = re.compile(r"PJRT_DEVICE|TPU_\w+|MEGASCALE_\w+|LIBTPU_INIT_ARGS|XLA_FLAGS|SEAMLESS_TPU_\w+|"
                         r"CPU_NUM_DEVICES|XLA_PERSISTENT_CACHE_PATH")
_CACHE_NOTE = {"tpu": "under ~/.cache/seamless_tpu/ unless SEAMLESS_TPU_COMPILE_CACHE=off|PATH", "xla": "off on "
               "XLA:CPU (torch_xla 2.9 writes it but cannot read it back: 'Deserializing serialized executable not "
               "supported')"}


def _version(dist):  # from the installed metadata: importing torch_xla writes env, importing ray is slow
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _report_facts():
    """(env, facts) for the report and its checks. Imports nothing; asks torch_xla only if something loaded it."""
    env = {k: v for k, v in os.environ.items() if _REPORT_ENV.fullmatch(k)}
    xla, xr, (evidence, chips) = sys.modules.get("torch_xla"), sys.modules.get("torch_xla.runtime"), _tpu_chips()
    versions = {"python": sys.version.split()[0], **{d: _version(d) for d in
                                                     ("torch", "torch_xla", "libtpu", "ray", "transformers")}}
    facts = {"versions": versions, "chips": chips, "chip_evidence": evidence, "hostname": socket.gethostname(),
             "host_ip": None, "xla_loaded": xla is not None, "user_pjrt": _user_pjrt_device(),
             "spmd_locked": bool(xla and xr and xla._XLAC._xla_get_spmd_config_is_locked() and not xr.is_spmd())}
    if env.get("TPU_WORKER_HOSTNAMES"):  # a DNS lookup: only where check 4 needs this host's address
        with contextlib.suppress(OSError):  # our own name has no address: the name alone is compared
            facts["host_ip"] = socket.gethostbyname(facts["hostname"])
    return env, facts


def _environment_checks(env, facts):
    """Pure: what is wrong in `env` (a dict of variables) given `facts` (_report_facts'), as (problem, fix) pairs."""
    found, wid, xla_v = [], env.get("TPU_WORKER_ID"), facts["versions"].get("torch_xla", "not installed")
    if facts.get("xla_loaded") and facts.get("spmd_locked"):
        found.append(("SPMD is locked off: an XLA tensor or torch_xla.device() came before SPMD was switched on",
                      "build the trainer / call seamless_tpu.get_device() before anything touches an XLA device"))
    if facts.get("xla_loaded") and env.get("PJRT_DEVICE") and not facts.get("user_pjrt"):
        found.append((f"PJRT_DEVICE={env['PJRT_DEVICE']} was written by torch_xla's import guess, not by you",
                      f"set PJRT_DEVICE yourself (TPU or CPU) or {ENV_DEVICE}"))
    visible = [c for c in env.get("TPU_VISIBLE_CHIPS", "").split(",") if c.strip()]
    bounds = env.get("TPU_CHIPS_PER_HOST_BOUNDS", "")  # "2,2,1": 4 chips a host, where none were found
    host = facts.get("chips") or (math.prod(map(int, bounds.split(","))) if re.fullmatch(r"\d+(,\d+)*", bounds) else 0)
    if visible and len(visible) < host:
        found.append((f"TPU_VISIBLE_CHIPS={env['TPU_VISIBLE_CHIPS']} holds {len(visible)} of this host's {host} chips",
                      "for SPMD one process must hold all of its host's chips: unset TPU_VISIBLE_CHIPS (on Ray give "
                      "one worker all the host's TPUs)"))
    hosts = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    mine = [i for i, h in enumerate(hosts) if h in (facts.get("hostname"), facts.get("host_ip"))]
    problem = ("TPU_WORKER_ID is not a whole number" if wid is not None and not re.fullmatch(r"[0-9]+", wid) else
               f"TPU_WORKER_ID is not in range({len(hosts)})" if hosts and wid and int(wid) >= len(hosts) else
               "TPU_WORKER_HOSTNAMES names a host twice" if len(set(hosts)) < len(hosts) else
               f"this host ({facts.get('hostname')}) is number {mine[0]} in TPU_WORKER_HOSTNAMES, not {wid}"
               if hosts and wid and mine and int(wid) not in mine else None)
    if problem:
        found.append((f"{problem} (TPU_WORKER_ID={wid!r}, TPU_WORKER_HOSTNAMES={env.get('TPU_WORKER_HOSTNAMES')!r})",
                      "list every host once, in worker order, in TPU_WORKER_HOSTNAMES (the same on every host) and "
                      "set TPU_WORKER_ID to this host's position in it, from 0"))
    torch_v, want = facts["versions"].get("torch", ""), ".".join(xla_v.split(".")[:2]) + ".0"
    if xla_v != "not installed" and xla_v.split(".")[:2] != torch_v.split(".")[:2]:
        found.append((f"torch_xla {xla_v} is built for torch {want}, but torch is {torch_v}",
                      f"pip install torch=={want} torch_xla=={want}"))
    return found


def _device_reason(kind):
    asked, pjrt, (evidence, chips) = os.environ.get(ENV_DEVICE, ""), _user_pjrt_device(), _tpu_chips()
    if asked and asked.lower() != "auto":
        return f"{ENV_DEVICE}={asked} asks for it"
    if kind in XLA_DEVICE_KINDS:
        return (f"PJRT_DEVICE={pjrt} set by the user" if pjrt else f"{chips} TPU chips ({evidence})" if chips
                else "torch_xla already runs in this process")
    return "torch.cuda.is_available()" if kind == "gpu" else (
        "torch_xla, but no TPU chip and no PJRT_DEVICE" if _xla_installed() else "no torch_xla") + ", no CUDA"


def environment_report(probe=False):
    """What `python -m seamless_tpu` prints. Imports neither torch_xla nor ray; probe=True starts the XLA runtime."""
    env, facts = _report_facts()
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items())]
    try:
        kind = _resolve_kind(None)
        lines.append(f"device: {kind}: {_device_reason(kind)}")
    except (ImportError, RuntimeError, ValueError) as e:  # what get_device() would raise: shown, not raised
        kind = None
        lines.append(f"device: error: {e}")
    lines += ["env:", *(f"  {k}={env[k]}" for k in sorted(env))] if env else ["env: none of the variables read is set"]
    lines.append(f"counts: {torch.cuda.device_count()} CUDA devices, {facts['chips']} TPU chips ("
                 f"{facts['chip_evidence'] or 'none found'}), RANK={os.environ.get('RANK')}, "
                 f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
    try:
        device = get_device() if probe else None  # starts the runtime on XLA: SPMD on, the default mesh built
        if device is None:
            lines.append("--probe starts the XLA runtime to count devices")
        elif _is_xla(device):
            xr, mesh = _import("torch_xla.runtime"), get_xla_mesh()
            lines.append(f"probe: {device}: {xr.global_runtime_device_count()} devices, {xr.process_count()} "
                         f"process(es), default mesh {tuple(mesh.mesh_shape)} {tuple(mesh.axis_names)}")
        else:
            lines.append(f"probe: {device}")
    except (ImportError, RuntimeError, ValueError) as e:  # as the device line: shown, not raised
        lines.append(f"probe: error: {e}")
    lines.append("compile cache: " + _CACHE_NOTE.get(kind, "XLA only"))
    checks = _environment_checks(env, facts)
    return "\n".join(lines + ([f"! {problem}. Fix: {fix}" for problem, fix in checks] or ["checks: all passed"]))


def _report_on_node(source, probe):
    """--ray's task: this module's source run afresh on the node (which may lack it, or know it by another name; sent
    by value, its functions would drag _STATE's weakrefs into the pickle), then its report and facts."""
    module = types.ModuleType("_seamless_tpu_report")
    sys.modules[module.__name__] = module  # dataclasses look their class's module up
    exec(compile(source, "seamless_tpu.py", "exec"), module.__dict__)
    return module.environment_report(probe), *module._report_facts()


def _cluster_checks(reports):
    """Pure: what differs between nodes, as (problem, fix). One dict per node: "node" (a name), "worker_id"
    (TPU_WORKER_ID or None), "tpu" (its Ray "TPU" resource, 0 if none), "chips" (the chips its report found)."""
    ids, counts = collections.defaultdict(list), {r["node"]: int(r.get("tpu") or r.get("chips") or 0) for r in reports}
    for r in reports:
        if r.get("worker_id") is not None:
            ids[r["worker_id"]].append(r["node"])
    found = [(f"TPU_WORKER_ID={wid} is set on {len(nodes)} nodes ({', '.join(nodes)})",
              "give each host of a slice its own TPU_WORKER_ID: its position in TPU_WORKER_HOSTNAMES")
             for wid, nodes in ids.items() if len(nodes) > 1]
    if len({c for c in counts.values() if c}) > 1:  # a CPU-only node (the head, often) is no TPU host: left out
        found.append(("nodes hold different TPU counts (" + ", ".join(f"{n}: {c}" for n, c in counts.items()) + ")",
                      "SPMD needs the same chips on every host of a slice: one TPU type and topology per slice, "
                      "one worker per host holding all of its chips"))
    return found + [(f"{r['node']}: Ray's TPU resource is {r['tpu']:g} but the host has {r['chips']} chips",
                     "start its raylet with the host's chip count (ray start --resources) or let Ray detect the chips")
                    for r in reports if r.get("tpu") and r.get("chips") and r["tpu"] != r["chips"]]


def _ray_report(address, probe=False, timeout_s=120):  # 120 s: each node's worker imports torch first
    """--ray: every alive node's report (one task pinned to each), then what differs between the nodes."""
    ray, pin = _import("ray"), _import("ray.util.scheduling_strategies").NodeAffinitySchedulingStrategy
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        with open(__file__) as f:
            source = f.read()
        nodes, out, reports = [n for n in ray.nodes() if n["Alive"]], [], []
        task = ray.remote(num_cpus=0)(_report_on_node)  # num_cpus=0: never waits for a busy node's CPUs
        refs = [task.options(scheduling_strategy=pin(n["NodeID"], soft=False)).remote(source, probe) for n in nodes]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for node, ref in zip(nodes, refs):
            name, tpu = f"{node['NodeManagerAddress']} ({node['NodeID'][:8]})", node["Resources"].get("TPU", 0)
            try:
                text, env, facts = ray.get(ref, timeout=timeout_s) if ref in done else (
                    f"no answer in {timeout_s} s", {}, {})
            except ray.exceptions.RayError as e:  # the node's task failed: its error is its report
                text, env, facts = f"failed: {e}", {}, {}
            out += [f"=== node {name}, Ray TPU resource {tpu:g} ===", text, ""]
            reports.append({"node": name, "tpu": tpu, "chips": facts.get("chips", 0),
                            "worker_id": env.get("TPU_WORKER_ID")})
        checks = [f"! {p}. Fix: {f}" for p, f in _cluster_checks(reports)] or ["cluster checks: all passed"]
        return "\n".join(out + [f"=== cluster: {len(nodes)} nodes ===", *checks])
    finally:
        ray.shutdown()


def _main(argv=None):  # python -m seamless_tpu
    parser = argparse.ArgumentParser(prog="python -m seamless_tpu", description="Print what to paste into an issue.")
    parser.add_argument("--probe", action="store_true", help="start the XLA runtime to count devices and build a mesh")
    parser.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                        help="report every alive node of a running Ray cluster (address: auto unless given)")
    args = parser.parse_args(argv)
    print(_ray_report(args.ray, args.probe) if args.ray else environment_report(args.probe))  # a CLI's output

# --- 14e. what a run costs: counting FLOPs --------------------------------------------------------


class _FlopCount(TorchDispatchMode):
    """FLOPs run while it is in force, from shapes only (no sync, transfer or compile). Off XLA: torch's formulas
    (torch.utils.flop_counter; SDPA kernels: ours, allowing grouped-query heads) on each op dispatched, forward and
    backward, each run as called (FlopCounterMode decomposes ops without a formula); torch.compile compiles as without
    it. On XLA no dispatch mode may run: under one, torch_xla 2.9 drops in-place writes to views (mask[:, -2:] = False
    did nothing; the first step trained on a wrong mask), so _FunctionFlops counts calls."""

    def __init__(self, xla):
        super().__init__()
        formulas, aten = importlib.import_module("torch.utils.flop_counter"), torch.ops.aten
        kernels = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
        self.formulas = {**formulas.flop_registry, **{
            getattr(aten, f"_scaled_dot_product_{kernel}{end}"): formulas.shape_wrapper(formula)
            for kernel in kernels for end, formula in (("", _sdpa_flops), ("_backward", _sdpa_backward_flops))}}
        self.flops, self.forwards, self.thread = 0, 1, threading.get_ident()
        self.functions = xla and _FunctionFlops(self)

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in self.formulas:
            flops = self.formulas[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            first = out[0] if isinstance(out, (tuple, list)) else out
            if hasattr(first, "placements"):  # a DTensor's shapes are global: its shards (Partial: of the sum)
                flops //= math.prod(first.device_mesh.size(i) for i, p in enumerate(first.placements)  # split it
                                    if not p.is_replicate())
            self.flops += flops
        return out

    def start(self):
        (self.functions or self).__enter__()
        return self

    def stop(self):  # modes are per thread: the thread that started it stops it
        (self.functions or self).__exit__(None, None, None)
        return self.flops


class _FunctionFlops(torch.overrides.TorchFunctionMode):
    """XLA: the FLOPs of the step's matmul-like calls, from shapes: forward, plus as much again per operand the backward
    computes a gradient of (attention: its backward's products; an RNN: its weights' and states'). A call inside a
    counted one (the matmul kernel's einsum) is not seen: a function mode is off in its own handler."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in _FUNCTION_FLOPS:
            self.count.flops += _FUNCTION_FLOPS[name](out, *args, **(kwargs or {}))
        return out


def _grads(*tensors):
    return sum(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors) if torch.is_grad_enabled() else 0


def _product_flops(contracted):
    """A matmul's FLOPs given where its contracted size is: 2 x output x that size, x 1 + 1 per operand's gradient."""
    def flops(out, a, b, *rest, **kwargs):
        x, y = (b, rest[0]) if contracted == "addmm" else (a, b)
        return 2 * out.numel() * x.shape[-1] * (1 + _grads(x, y))
    return flops


def _conv_flops(transposed):
    def flops(out, input, weight, *rest, **kwargs):
        return 2 * (input if transposed else out).numel() * weight[0].numel() * (1 + _grads(input, weight))
    return flops


def _rnn_flops(out, input, *args, **kwargs):
    """Each 2-D weight once per step and sample, forward; backward, its gradient and its input's (the state's always,
    the layer's input's where it needs one)."""
    cell = not isinstance(args[1], (list, tuple))
    weights = [w for w in (args[1:3] if cell else args[1]) if isinstance(w, torch.Tensor) and w.dim() == 2]
    rows = input.numel() // input.shape[-1]
    backward = torch.is_grad_enabled() and (input.requires_grad or any(w.requires_grad for w in weights))
    return sum(2 * rows * w.numel() * (1 + backward * (w.requires_grad + (i > 0 or input.requires_grad)))
               for i, w in enumerate(weights))


def _einsum_call_flops(equation, *operands):
    operands = operands[0] if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    return _einsum_flops(equation, [t.shape for t in operands]) * (1 + _grads(*operands))


def _attention_flops(out, query, key, value, *args, **kwargs):
    """Forward: the scores and their product with the values; backward on XLA twice that, 4 products (the scores are
    kept, where torch's flash kernels compute them again)."""
    return _sdpa_flops(query.shape, key.shape, value.shape) * (3 if _grads(query, key, value) else 1)


_FUNCTION_FLOPS = {
    "linear": lambda out, input, weight, *rest, **kwargs: 2 * out.numel() * weight.shape[-1] * (
        1 + _grads(input, weight)),
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm"), _product_flops("ab")),
    **dict.fromkeys(("addmm", "baddbmm"), _product_flops("addmm")),
    "einsum": lambda out, equation, *operands, **kwargs: _einsum_call_flops(equation, *operands),
    **{f"conv{d}d": _conv_flops(False) for d in (1, 2, 3)},
    **{f"conv_transpose{d}d": _conv_flops(True) for d in (1, 2, 3)},
    "scaled_dot_product_attention": _attention_flops,
    **dict.fromkeys(("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"),
                    _rnn_flops),
}


def _einsum_flops(equation, shapes):
    """2 x the product of every index's size (the ellipsis's dims broadcast): a product of two operands, summed."""
    sizes, ellipses = {}, []
    for spec, shape in zip(equation.replace(" ", "").split("->")[0].split(","), shapes):
        at, letters = spec.find("..."), spec.replace("...", "")
        if at >= 0:
            ellipses.append(shape[at:at + len(shape) - len(letters)])
            shape = (*shape[:at], *shape[at + len(shape) - len(letters):])
        for letter, n in zip(letters, shape):
            sizes[letter] = max(n, sizes.get(letter, 1))
    return 2 * math.prod(torch.broadcast_shapes(*ellipses)) * math.prod(sizes.values())


def _sdpa_flops(query, key, value, *args, out_shape=None, **kwargs):  # scores, then their product with the values
    return 2 * math.prod(query[:-2]) * query[-2] * key[-2] * (query[-1] + value[-1])


def _sdpa_backward_flops(grad, query, key, value, *args, out_shape=None, **kwargs):  # scores again, 4 products
    return 2 * math.prod(query[:-2]) * query[-2] * key[-2] * (3 * query[-1] + 2 * value[-1])

# --- 15a. checkpoints: save -----------------------------------------------------------------------


def _save_file(obj, path):
    """trainer.save: one torch.save file written by process 0, every rank returning together."""
    saved, error = _STATE.preemption.saving(), None  # a held SIGTERM exit waits for this save to end
    try:
        _sync_if_xla()
        cpu = _map_tensors(_state_dicts(obj), _cpu_copy)
        if _is_main_process():
            try:
                _atomic_write(cpu, path)
            except Exception as e:  # shared with every rank below, then raised here too
                error = e
        _agree(f"trainer.save(..., {path!r})", error=error)
    finally:
        saved()
    return path


def _save_checkpoint(directory, state, blocking=True, keep_last=1):
    """trainer.save_checkpoint: every process writes its shards into a new attempt folder, which process 0 commits."""
    directory = os.fspath(directory)
    if not state:
        raise ValueError("save_checkpoint needs something to save, e.g. save_checkpoint(dir, model=model, epoch=epoch)")
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"save_checkpoint(keep_last=N) keeps the N newest checkpoints, at least 1; got {keep_last!r}")
    plain = {k: v for k, v in state.items() if not _is_stateful(v)}
    for name, value in plain.items():
        _refuse_nested_state(value, name)
    _STATE.saves.wait()  # one save at a time: the next attempt's commit may remove the one in flight
    # What a bitwise resume needs that the user cannot take: the XLA RNG, taken before the save's own syncs.
    rng = {} if _STATE.xla_device is None else {"xla": _import("torch_xla.core.xla_model").get_rng_state()}
    saved, handed_off = _STATE.preemption.saving(), False  # a held SIGTERM exit waits for this save to end
    try:
        _sync_if_xla()
        for value in state.values():  # a meta-built model not used yet is initialised before it is saved
            if isinstance(value, torch.nn.Module) and (_STATE.meta_init.pending or _STATE.meta_init.unset):
                _initialize_pending(value, refuse=True)
        attempt, error = None, None
        try:  # all that reads the state happens now, blocking or not; a failure on any rank is shared below
            dicts = {k: _state_dicts(v) for k, v in state.items()
                     if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))}
            stage = None if blocking else _STATE.saves.staging_for(dicts)  # CUDA: pinned buffers, a side stream
            tensors = {k: _map_tensors(d, lambda t: _saved_form(t, blocking, stage)) for k, d in dicts.items()}
            ready = stage and stage.issued()  # the call returns once the copies are queued
            objects = {k: _map_tensors(_state_dicts(v), _cpu_copy)
                       for k, v in state.items() if _is_stateful(v) and k not in tensors}
            files = {OBJECT_STATES: {"objects": objects, "rng": rng}, PLAIN_VALUES: plain}
            for name, value in files.items():  # bytes now: what a later write puts on disk cannot change after the call
                files[name] = io.BytesIO()
                torch.save(value, files[name])
            if _is_main_process():
                attempt = f"save-{os.getpid()}-{time.time_ns()}"
                os.makedirs(os.path.join(directory, attempt))
                open(os.path.join(directory, attempt, ATTEMPT_MARKER), "w").close()
        except Exception as e:
            error = e
        attempt = _agree(f"save_checkpoint({directory!r})", attempt, error)
        write = functools.partial(_write_checkpoint, directory, attempt, tensors, files, keep_last, blocking, ready)
        if blocking:
            return write()
        future, handed_off = _STATE.saves.start(write, os.path.join(directory, attempt), saved), True
        return future
    finally:
        if not handed_off:
            saved()
        _set_rng_states(rng)  # a run that saves continues exactly as one that does not, or one resumed from here


@dataclasses.dataclass
class _Saves:
    """The asynchronous save in flight (one at a time) and the gloo group its thread's collectives use."""
    group: object = None  # under torch.distributed: its own process group, never the training loop's
    in_flight: object = None  # the _SaveFuture not yet waited for
    staging: object = None  # CUDA: the _Staging buffers the saves copy the state into, one set, reused

    def staging_for(self, dicts):
        """The _Staging of a save of `dicts` when they hold CUDA tensors, its buffers fitted to them; else None."""
        local = []  # DTensors: their local parts
        _map_tensors(dicts, lambda t: local.append(t.to_local() if hasattr(t, "to_local") else t) or t)
        if not (cuda := [t for t in local if t.is_cuda]):
            return None
        self.staging = self.staging or _Staging()  # after wait(): its buffers are free
        self.staging.begin([(tuple(t.shape), t.dtype) for t in cuda], cuda[0].device)
        return self.staging

    def start(self, write, path, saved):
        if _torch_dist_ranks()[0] > 1 and self.group is None:
            self.group = torch.distributed.new_group(backend="gloo")  # collective: every rank is here
        future = _SaveFuture()
        future.path = path
        def run():
            future.set_running_or_notify_cancel()
            try:
                future.set_result(write())
            except BaseException as e:  # the Future raises it, or the next save or load, or the exit reports it
                future.set_exception(e)
            finally:
                saved()
        threading.Thread(target=run, name="seamless_tpu-save").start()  # not a daemon: the exit waits for the save
        self.in_flight = future
        if _once("report_unasked_saves"):
            atexit.register(lambda: _STATE.saves.wait(at_exit=True))  # after the interpreter joined the thread
        return future

    def wait(self, at_exit=False):
        """Wait for the save in flight, if any; raise its failure if nobody asked its Future (at exit: log it)."""
        future, self.in_flight = self.in_flight, None
        error = future and concurrent.futures.Future.exception(future)  # waits for it, and is not an ask
        if error is not None and not future.asked:
            if not at_exit:
                raise error
            logger.error("seamless_tpu: save_checkpoint(..., blocking=False) to %r failed, and nothing asked its "
                         "Future: %s: %s. That attempt was removed; the checkpoint before it is still the one "
                         "LATEST names", future.path, type(error).__name__, error)


class _SaveFuture(concurrent.futures.Future):
    """An asynchronous save's Future (of `path`) that remembers whether its outcome was asked for (_Saves.wait)."""
    asked, path = False, None

    def result(self, timeout=None):
        self.asked = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.asked = True
        return super().exception(timeout)


def _write_checkpoint(directory, attempt, tensors, files, keep_last, blocking, ready=None):
    """This process's shards, then (process 0) the other files and the commit; all ranks return or raise together."""
    group, path, error = (None if blocking else _STATE.saves.group), os.path.join(directory, attempt), None
    try:
        if ready is not None:  # the CUDA event the host copies of `tensors` end at
            ready.synchronize()
        dcp = importlib.import_module("torch.distributed.checkpoint")  # part of torch, slow to import: on use
        xla = _STATE.xla_device is not None
        planner = _import("torch_xla.experimental.distributed_checkpoint").SPMDSavePlanner() if xla else None
        try:
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path), planner=planner, process_group=group)
        except importlib.import_module("torch.distributed.checkpoint.api").CheckpointException as e:
            # a BaseException whose text starts with a remote traceback: its first failure as an ordinary one
            rank, (cause, _) = next(iter(e.failures.items()))
            raise (OSError if isinstance(cause, OSError) else RuntimeError)(
                f"could not write the checkpoint {path!r} (process {rank}): {type(cause).__name__}: {cause}") from None
        if _is_main_process():
            for name, data in files.items():
                _atomic_write(data.getvalue(), os.path.join(path, name))
            _commit_checkpoint(directory, attempt, keep_last)
    except Exception as e:
        error = e
    try:
        _agree(f"save_checkpoint({directory!r})", error=error, group=group)
    except Exception:  # every rank has stopped writing: a checkpoint is complete or absent
        if _is_main_process() and _read_name(directory, CHECKPOINT_POINTER) != attempt:
            shutil.rmtree(path, ignore_errors=True)
        raise
    return directory


def _saved_form(t, blocking, stage=None):
    """What the writer gets for `t`: the tensor (blocking) or a host copy taken now (a DTensor keeps its placements).
    XLA: this process's replica-0 shards of a split tensor (async) or of one also replicated over some mesh axes,
    which torch_xla 2.9's SPMDSavePlanner drops (measured: key missing). TODO(remove when it doesn't)"""
    if _is_xla(t.device):
        spec = _import("torch_xla")._XLAC._get_xla_sharding_spec(t)
        if "last_tile_dim_replicate" in spec or (not blocking and _is_split(t)):
            helpers = _import("torch_xla.experimental.distributed_checkpoint._helpers")
            shards = helpers._cpu_shards_from_tensors([t])[0]  # this process's share of one copy, never the whole
            replica_0 = [s for s in shards.shards if s.replica_id == 0]
            return helpers._CpuShards(shards=replica_0, global_shape=shards.global_shape)
        return t if blocking else t.detach().cpu()
    if blocking:
        return t
    if hasattr(t, "to_local"):
        local = _host_copy(t.to_local(), stage)
        return type(t).from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return _host_copy(t, stage)


def _host_copy(t, stage):  # CUDA: into the save's pinned buffer, queued (_Staging)
    return stage.copy(t) if stage is not None and t.is_cuda else t.detach().to("cpu", copy=True)


def _refuse_nested_state(value, where):
    """A stateful object inside a plain value would be pickled whole, never restored in place: refused at save."""
    if _is_stateful(value):
        raise TypeError(f"save_checkpoint: {where} is a {type(value).__name__} inside a plain value; pass it as its "
                        f"own keyword (save_checkpoint(dir, {where.split('[')[0]}=...)) to save its state_dict")
    if isinstance(value, (Mapping, list, tuple)):
        for k, v in value.items() if isinstance(value, Mapping) else enumerate(value):
            _refuse_nested_state(v, f"{where}[{k!r}]")

# --- 15b. checkpoints: load -----------------------------------------------------------------------


def _load_checkpoint(directory, state):
    """trainer.load_checkpoint: each tensor read straight into its current layout, other objects' state in place."""
    directory = os.fspath(directory)
    for name, obj in state.items():
        if not _is_stateful(obj):
            raise TypeError(f"load_checkpoint loads modules, optimizers and other objects with load_state_dict() in "
                            f"place; {name!r} is a {type(obj).__name__}. Plain values come back from the call instead")
    path = _committed_attempt(directory)  # once: tensors, objects and values all come from this attempt
    (objects, rng, plain), release = _read_files(path), _HostMemoryRelease()
    reader, planner = _dcp_loader(path, release)
    saved = {}  # {saved name: [(path below it, flat key, TensorStorageMetadata or BytesStorageMetadata)]}
    metadata = reader.read_metadata()
    for key, entry in metadata.state_dict_metadata.items():
        name, *below = metadata.planner_data[key]
        saved.setdefault(name, []).append((tuple(below), key, entry))
    for name in state:
        if name not in saved and name not in objects:
            raise KeyError(f"checkpoint {directory!r} has no {name!r}; it holds {sorted({*saved, *objects})}")
    reads, extra = {}, {}  # reads: {the checkpoint's flat key: the tensor read into in place, or None if pickled}
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            extra[name] = _module_targets(obj, saved.get(name, []), reads, f"{name!r} in {directory!r}", release)
        elif isinstance(obj, torch.optim.Optimizer):
            _optimizer_targets(obj, saved.get(name, []), reads, release)
    if reads:  # flat keys: the two planners flatten nested values differently, and a flat dict is the same to both
        importlib.import_module("torch.distributed.checkpoint").load(reads, storage_reader=reader, planner=planner)
    set_element = importlib.import_module("torch.distributed.checkpoint._traverse").set_element
    for name, obj in state.items():
        values = {}  # the nested state_dict saved under `name`, as read
        for below, key, _ in saved.get(name, []):
            set_element(values, below, reads.get(key))
        if isinstance(obj, torch.nn.Module):
            for module in _unwrap(obj).modules():  # filled: a meta-built model's module needs no initialisation
                _loaded(module)
            if extra[name]:  # the tensors are in place; a non-tensor entry (extra state) goes through the module's hook
                _unwrap(obj).load_state_dict({own: values[key] for own, key in extra[name].items()}, strict=False)
        elif isinstance(obj, torch.optim.Optimizer):  # DCP writes parameter ids as strings, and drops an empty state
            obj.load_state_dict({**values, "state": {int(k): v for k, v in values.get("state", {}).items()}})
            _place_optimizer_state(obj)
        else:
            obj.load_state_dict(objects[name])
    _set_rng_states(rng)
    return plain


class _HostMemoryRelease:
    """Hands host memory freed by a checkpoint load or a meta model's initialisation back to the OS (malloc_trim,
    Linux) every `every` bytes handled: glibc keeps freed buffers of up to 32 MB. Measured, growth of the process: a
    255 MB checkpoint on 4 XLA devices 1.17x its size without, 0.13x releasing every 32 MB; a meta model's load (16 MB
    tensors, 4 shards each) 0.28-0.32x every 32 MB, 0.23-0.25x every 4 MB, in the same 9.5 s."""

    def __init__(self, every=RELEASE_EVERY):
        self.release = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None
        self.handled, self.every = 0, every

    def __call__(self, tensor=None, nbytes=0):  # handled: `tensor` (returned) or `nbytes`
        self.handled += nbytes if tensor is None else tensor.numel() * tensor.element_size()
        if self.release is not None and self.handled >= self.every:
            self.release(0)
            self.handled = 0
        return tensor


def _dcp_loader(path, release):
    """DCP's (reader, planner) for `path` (SPMD planner on XLA), calling `release` after each read. Its reader loads a
    stored chunk once for all this process's shards in it, torch's per shard (measured: 4 XLA shards of a replicated
    save read 4.04x the checkpoint, of a whole one held 4 copies). torch 2.9 private API: TODO(remove when fixed)"""
    dcp = importlib.import_module("torch.distributed.checkpoint")
    tensor_item = importlib.import_module("torch.distributed.checkpoint.planner").LoadItemType.TENSOR
    narrow = importlib.import_module("torch.distributed._shard._utils").narrow_tensor_by_index
    xla = _STATE.xla_device is not None
    base = _import("torch_xla.experimental.distributed_checkpoint").SPMDLoadPlanner if xla else dcp.DefaultLoadPlanner

    class Planner(base):
        def commit_tensor(self, read_item, tensor):
            super().commit_tensor(read_item, tensor)
            release(tensor)

    class Reader(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            stored, mine, others = self.storage_data, {}, []  # mine: {(file, offset) of a stored chunk: its requests}
            for item in plan.items:  # plain tensors are mine; bytes and transformed streams go torch's way
                chunk = stored[item.storage_index]
                ours = item.type == tensor_item and not chunk.transform_descriptors
                (mine.setdefault((chunk.relative_path, chunk.offset), []) if ours else others).append(item)
            done = super().read_data(dataclasses.replace(plan, items=others), planner)
            for (relative_path, _), requests in sorted(mine.items()):  # in file order (keys are unique)
                chunk = stored[requests[0].storage_index]
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    whole = torch.load(self._slice_file(stream, chunk), map_location="cpu", weights_only=True)
                for request in requests:
                    target = planner.resolve_tensor(request).detach()
                    target.copy_(narrow(whole, request.storage_offsets, request.lengths))
                    planner.commit_tensor(request, target)
                del whole  # one chunk at a time
                release(nbytes=chunk.length)
            return done

    return Reader(path), Planner()


def _module_targets(module, saved, reads, what, release):
    """Point `reads` at the module's own tensors (read in place); returns {own key: saved key} of its extra state."""
    current = {k.replace("_orig_mod.", ""): (k, v) for k, v in _unwrap(module).state_dict(keep_vars=True).items()}
    shapes = {path[0]: getattr(entry, "size", None) for path, _, entry in saved}
    missing, unexpected = sorted(set(current) - set(shapes)), sorted(set(shapes) - set(current))
    if missing or unexpected:
        raise KeyError(f"{what} does not fit the model: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    for saved_key, (_, value) in current.items():
        if isinstance(value, torch.Tensor) and shapes[saved_key] not in (None, value.shape):
            raise ValueError(f"{what} does not fit the model: {saved_key!r} has shape {tuple(shapes[saved_key])} in "
                             f"the checkpoint and {tuple(value.shape)} in the model")
    for submodule in _unwrap(module).modules():  # a meta model laid out and not yet initialised: once it fits
        if submodule in _STATE.meta_init.pending:
            for name, t in _own_tensors(submodule):  # split ones are parameters, swapped in place: `current` holds them
                if _is_xla(t.device) and _is_split(t):
                    _set_own_tensor(submodule, name, release(_blank_like(t)))
    for path, key, _ in saved:
        value = current[path[0]][1]
        reads[key] = value if isinstance(value, torch.Tensor) and len(path) == 1 else None
    return {own: saved_key for saved_key, (own, value) in current.items() if not isinstance(value, torch.Tensor)}


def _optimizer_targets(optimizer, saved, reads, release):
    """Point `reads` at a tensor per saved optimizer tensor: the state tensor there if it fits, or a new one."""
    _place_optimizer_state(optimizer)  # its parameters are the current ones (FSDP2 replaces them)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for path, key, entry in saved:
        reads[key] = None
        if not hasattr(entry, "size"):  # a pickled value: BytesStorageMetadata
            continue
        param = params[int(path[1])] if len(path) == 3 and path[0] == "state" and int(path[1]) < len(params) else None
        current = optimizer.state.get(param, {}).get(path[2]) if param is not None else None
        dtype = entry.properties.dtype
        if isinstance(current, torch.Tensor) and current.shape == entry.size and current.dtype == dtype:
            reads[key] = current
        elif param is not None and entry.size == param.shape:  # laid out like it (XLA sharding, FSDP2 placements)
            reads[key] = release(_lay_out_like(torch.empty(entry.size, dtype=dtype), param))
        else:
            reads[key] = torch.empty(entry.size, dtype=dtype)  # on the CPU, as Adam's scalar 'step'


def _read_files(attempt):
    """(the other stateful objects' state_dicts, the RNG states, the plain values) of one committed attempt."""
    load = functools.partial(torch.load, map_location="cpu", weights_only=False)
    stored = load(os.path.join(attempt, OBJECT_STATES))
    return stored["objects"], stored["rng"], load(os.path.join(attempt, PLAIN_VALUES))


def consolidate_checkpoint(directory, path=None):
    """What save_checkpoint saved as one dict of CPU state_dicts (the model's own keys) and plain values, also written
    to `path` if given (atomically). Needs no torch_xla: the bridge to from_pretrained and to a laptop."""
    attempt = _committed_attempt(os.fspath(directory))  # once: tensors, objects and values from one attempt
    with tempfile.TemporaryDirectory() as tmp:  # the public way to read a DCP checkpoint whole, with no process group
        importlib.import_module("torch.distributed.checkpoint.format_utils").dcp_to_torch_save(attempt, f"{tmp}/all.pt")
        tensors = torch.load(f"{tmp}/all.pt", map_location="cpu", weights_only=False)
    for state in tensors.values():  # DCP turns an optimizer's int parameter ids into strings, and drops an empty state
        if isinstance(state, dict) and "param_groups" in state:
            state["state"] = {int(k) if str(k).isdigit() else k: v for k, v in state.get("state", {}).items()}
    objects, _, plain = _read_files(attempt)
    merged = {**tensors, **objects, **plain}
    if path is not None:
        _atomic_write(merged, path)
    return merged

# --- 15c. checkpoints: files and commit -----------------------------------------------------------


def _is_stateful(value):
    """Modules, optimizers, any instance with state_dict()/load_state_dict(): restored in place, never pickled whole."""
    methods = ("state_dict", "load_state_dict")
    return not isinstance(value, type) and all(callable(getattr(value, m, None)) for m in methods)


def _sync_if_xla():
    if _STATE.xla_device is not None:
        _cut_graph()  # what is saved is what the loop computed so far


def _unwrap(module):
    """The user's own module inside DDP and torch.compile (OptimizedModule) wrappers, nested in any order."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return _unwrap(module.module)
    inner = getattr(module, "_orig_mod", None)
    return _unwrap(inner) if isinstance(inner, torch.nn.Module) else module


def _state_dicts(obj):
    """Stateful objects (also a dict's values) as state_dicts, a module's with its own keys (no '_orig_mod.')."""
    if isinstance(obj, torch.nn.Module):
        state = _unwrap(obj).state_dict()
        if any("_orig_mod." in k for k in state):
            state = type(state)((k.replace("_orig_mod.", ""), v) for k, v in state.items())
        return state
    if _is_stateful(obj):  # optimizers, schedulers, scalers: never pickled whole
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return {k: _state_dicts(v) for k, v in obj.items()}
    return obj


def _cpu_copy(t):
    """`t` whole on the CPU. An FSDP2 DTensor's full_tensor() is a collective: every rank calls it."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()


def _set_rng_states(states):
    """The XLA RNG as save_checkpoint took it: every sync, even an empty one, moves it on."""
    if "xla" in states and _STATE.xla_device is not None:
        _import("torch_xla.core.xla_model").set_rng_state(states["xla"])


def _agree(what, value=None, error=None, group=None):
    """Every rank learns whether `what` worked on every rank and gets process 0's `value`; if any failed, all raise
    together, so nobody hangs. It is also the barrier that keeps readers out of a checkpoint until it is complete."""
    if (size := _torch_dist_ranks()[0]) > 1:
        outcomes = [None] * size
        message = None if error is None else f"{type(error).__name__}: {error}"
        torch.distributed.all_gather_object(outcomes, (value, message), group=group)
        failed = [(rank, message) for rank, (_, message) in enumerate(outcomes) if message is not None]
        if failed and error is None:
            raise RuntimeError(f"{what} failed on process {failed[0][0]}: {failed[0][1]}")
        value = outcomes[0][0]
    if error is not None:
        raise error
    return value


def _atomic_write(obj, path):
    """Write `obj` (bytes, or anything torch.save takes) to `path` (a file object: as given) through a fsynced
    temporary sibling and os.replace, atomic on POSIX and Windows: never a torn file, whatever kills the process."""
    write = (lambda f: f.write(obj)) if isinstance(obj, bytes) else (lambda f: torch.save(obj, f))
    if not isinstance(path, (str, os.PathLike)):
        return write(path)
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot save to {path!r}: the directory {directory!r} does not exist; create it "
                                f"first (os.makedirs)")
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:  # created with the user's umask, as torch.save would
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # persists the rename; not possible on every platform
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit_checkpoint(directory, attempt, keep_last=1):
    """Make `attempt` the newest kept checkpoint (HISTORY, then LATEST, each one atomic rename); drop other attempts."""
    kept = ([a for a in _history(directory) if a != attempt] + [attempt])[-keep_last:]
    _atomic_write("\n".join(kept).encode(), os.path.join(directory, CHECKPOINT_HISTORY))
    _atomic_write(attempt.encode(), os.path.join(directory, CHECKPOINT_POINTER))
    for name in os.listdir(directory):
        if name not in kept and os.path.isfile(os.path.join(directory, name, ATTEMPT_MARKER)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _read_name(directory, file):
    """The text of `directory`/`file` (LATEST: the committed attempt; HISTORY: the kept ones), or None."""
    try:
        with open(os.path.join(directory, file)) as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _history(directory):
    """The committed save attempts in `directory` that still exist, oldest first."""
    names = (_read_name(directory, CHECKPOINT_HISTORY) or "").split()
    return [n for n in names if SAVE_ATTEMPT.fullmatch(n) and os.path.isdir(os.path.join(directory, n))]


def _committed_attempt(directory):
    """The folder to load: the one LATEST names, or `directory` itself if its parent's HISTORY names it (keep_last)."""
    _STATE.saves.wait()  # a save in flight in this process may be about to commit the checkpoint asked for
    parent, name = os.path.split(os.path.normpath(directory))
    if SAVE_ATTEMPT.fullmatch(name) and name in _history(parent):
        return directory
    if (attempt := _read_name(directory, CHECKPOINT_POINTER)) is None:
        raise FileNotFoundError(f"{directory!r} is not a seamless_tpu checkpoint: it has no {CHECKPOINT_POINTER} "
                                "file, which save_checkpoint writes last (a save that was killed leaves none). Pass "
                                "the directory given to save_checkpoint")
    path = os.path.join(directory, attempt)
    if not SAVE_ATTEMPT.fullmatch(attempt) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint {directory!r} is damaged: {CHECKPOINT_POINTER} names {attempt!r}, which "
                                f"is missing or incomplete")
    return path


class _Staging:
    """CUDA: the pinned host buffers an asynchronous save copies the state into (one copy of the state, kept, made anew
    when shapes or dtypes change), on a side stream after the work queued so far. With GPU room for the state twice
    (free, or cached by torch's allocator) it first takes a GPU copy (~1 ms for 2 GB), all the training stream waits
    for; the host copies (pinned: ~55 GB/s on an H100) run from it beside the next steps, its memory back in the side
    stream's pool (freed blocks serve that stream only: nothing overwrites it early). Without room the training stream
    waits for the host copies. The writer thread waits for their event."""

    def __init__(self):
        self.buffers, self.stream, self.left, self.pending, self.on_gpu = [], None, None, [], False

    def begin(self, specs, device):
        self.buffers = _staging_buffers(self.buffers, specs, lambda s, d: torch.empty(s, dtype=d, pin_memory=True))
        self.stream = self.stream or torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        room = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device)
        self.on_gpu = room >= 2 * sum(b.nbytes for b in self.buffers)
        self.device, self.left, self.pending = device, iter(self.buffers), []

    def copy(self, t):
        """The buffer `t` lands in once issued() has queued the copies."""
        buffer = next(self.left)
        with torch.cuda.stream(self.stream):
            self.pending.append((buffer, t.detach().clone() if self.on_gpu else t.detach()))
        return buffer

    def issued(self):
        """The event the host copies end at. The training stream waits (on the GPU) for the GPU copy, else for them."""
        current = torch.cuda.current_stream(self.device)
        if self.on_gpu:
            current.wait_event(self.stream.record_event())
        with torch.cuda.stream(self.stream):
            for buffer, source in self.pending:
                buffer.copy_(source, non_blocking=True)
        self.pending, event = [], self.stream.record_event()
        if not self.on_gpu:
            current.wait_event(event)
        return event


def _staging_buffers(held, specs, alloc):
    """`held` if made for `specs` [(shape, dtype)], else new ones from alloc(shape, dtype), `held` cleared first."""
    if [(tuple(b.shape), b.dtype) for b in held] == list(specs):
        return held
    held.clear()
    return [alloc(shape, dtype) for shape, dtype in specs]

# --- 16. the Ray hook -----------------------------------------------------------------------------
# Ray's _TorchBackend pattern: hooks orchestrate; the work is in top-level worker functions (tests run them on fakes).


def _check_tpu_scaling(num_workers, tpu_per_worker, topology):
    if topology is None:
        return
    chips, requested = math.prod(parse_topology(topology)), num_workers * tpu_per_worker
    if requested != chips:
        raise ValueError(f"ScalingConfig asks for num_workers={num_workers} x TPU per worker={tpu_per_worker} = "
                         f"{requested:g} chips, but topology {topology!r} has {chips} chips. The xla_tpu backend runs "
                         "one SPMD process per TPU host holding all of its chips: set num_workers to the number of "
                         f"hosts and resources_per_worker={{'TPU': chips per host}} so they multiply to {chips}.")


def _xla_worker_env(*, rank, world_size, local_rank, local_world_size, node_rank, master_addr, master_port, hostnames):
    return {"PJRT_DEVICE": "TPU", "MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
            "NODE_RANK": str(node_rank), "TPU_WORKER_ID": str(rank), "TPU_WORKER_HOSTNAMES": ",".join(hostnames)}


def _setdefault_env(env):
    """Set (and return) what the user has not set; '' and torch_xla's PJRT_DEVICE guess count as unset."""
    applied = {k: v for k, v in env.items() if not (_user_pjrt_device() if k == "PJRT_DEVICE" else os.environ.get(k))}
    os.environ.update(applied)
    _STATE.env_we_set.update(applied)
    return applied


def _train_context():
    return _import("ray.train").get_context()  # a new object per call: keep no state on it


def _node_ip():
    return _import("ray").util.get_node_ip_address()


def _worker_address():
    with socket.socket() as s:
        s.bind(("", 0))  # a free port of our own: Ray's helper for this is private
        return _train_context().get_world_rank(), _node_ip(), s.getsockname()[1]


def _xla_worker_setup(master_addr, master_port, hostnames, xla_spmd_config, timeout_s):
    """In each Ray worker: env (only where unset), SPMD, mesh, and a gloo group for several. Rerunnable."""
    ctx = _train_context()
    rank, size = ctx.get_world_rank(), ctx.get_world_size()
    applied = _setdefault_env(_xla_worker_env(
        rank=rank, world_size=size, local_rank=ctx.get_local_rank(), local_world_size=ctx.get_local_world_size(),
        node_rank=ctx.get_node_rank(), master_addr=master_addr, master_port=master_port, hostnames=hostnames))
    _log("seamless_tpu: worker %s set %s", rank, applied, main=rank == 0)
    if os.environ.get("TPU_VISIBLE_CHIPS") and os.environ.get("PJRT_DEVICE", "").upper() == "TPU":
        logger.warning("seamless_tpu: TPU_VISIBLE_CHIPS=%s limits this SPMD worker to part of its host; "
                       "give each Ray worker all chips of its host", os.environ["TPU_VISIBLE_CHIPS"])
    _activate_xla(_auto_xla_kind())
    mesh = create_xla_mesh(xla_spmd_config=xla_spmd_config)
    if size > 1 and not torch.distributed.is_initialized():
        # XLA does the training collectives; this group coordinates saves (torch_xla's DCP needs one: CheckpointManager)
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rank=rank,
            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        _STATE.group_we_started = True
    return {"rank": rank, "set": applied, "mesh_shape": tuple(mesh.mesh_shape)}


def _xla_worker_shutdown():
    _STATE.mesh = _STATE.batch_sharding = None
    if _STATE.group_we_started and torch.distributed.is_initialized():
        _STATE.group_we_started = False
        torch.distributed.destroy_process_group()


def _check_cluster_tpus(scaling_config):
    """use_tpu wanting TPUs the cluster lacks: Ray 2.60 retries forever, past RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S."""
    if not getattr(scaling_config, "use_tpu", False):
        return
    ray = _import("ray")
    if not ray.is_initialized():
        ray.init()  # what fit() does a moment later anyway
    workers, per_worker = scaling_config.num_workers, scaling_config.num_tpus_per_worker
    if (have := ray.cluster_resources().get("TPU", 0)) < workers * per_worker:
        raise RuntimeError(f"ScalingConfig(use_tpu=True) asks for num_workers={workers} x {per_worker:g} TPU = "
                           f"{workers * per_worker:g} TPU, but the Ray cluster has {have:g} (ray.cluster_resources())."
                           " Connect to a cluster of TPU hosts (ray.init(address=...)), fewer workers or TPU per "
                           "worker, or use_tpu=False for CPU/GPU")


class _RayTrainLoop:
    """The user's train function. A class: cloudpickle would ship a closure's globals by value, _STATE with them."""

    def __init__(self, train_fn):
        self.train_fn = train_fn
        functools.update_wrapper(self, train_fn)  # Ray reads the signature to pass `config` or not

    def __call__(self, *args):
        result = self.train_fn(*args)
        if _STATE.preemption.preempted_at and _STATE.preemption.delays_exit:  # Ray never restarts a finished run
            raise RuntimeError(f"seamless_tpu: preempted (SIGTERM) at optimizer step {_STATE.preemption.preempted_at}; "
                               "the loop returned after it, so this attempt ends as failed for Ray to restart it from "
                               "the last reported checkpoint (ray.train.get_checkpoint()). Allow the restart with "
                               "RunConfig(failure_config=FailureConfig(max_failures=N))")
        return result


@functools.lru_cache(maxsize=None)
def _ray_classes():
    """Ray's classes subclassed on first use (importing this module never imports ray); declarations only."""
    ray_torch = _import("ray.train.torch")

    class _XlaSpmdBackend(_import("ray.train.backend").Backend):
        """One torch_xla SPMD process per TPU host; a gloo group across them coordinates checkpoints."""

        def on_start(self, worker_group, backend_config):
            addresses = sorted(worker_group.execute(_worker_address))  # (rank, IP, a free port), in rank order
            _, master_addr, master_port = addresses[0]  # the gloo group's rendezvous, on rank 0
            reports = worker_group.execute(_xla_worker_setup, master_addr, master_port, [ip for _, ip, _ in addresses],
                                           backend_config.xla_spmd_config, backend_config.timeout_s)
            worker_group.execute(_catch_sigterm)
            logger.info("seamless_tpu: xla_tpu backend started: %s", reports)

        def on_shutdown(self, worker_group, backend_config):
            try:
                worker_group.execute(_xla_worker_shutdown)
            except _import("ray").exceptions.RayError as e:  # workers that already died hold no mesh
                logger.debug("seamless_tpu: shutdown skipped on dead workers: %s", e)

    class _RayTorchBackend(_import("ray.train.torch.config")._TorchBackend):
        """Ray's own gloo/NCCL backend, plus the trainer's SIGTERM handler on every worker."""

        def on_start(self, worker_group, backend_config):
            super().on_start(worker_group, backend_config)
            worker_group.execute(_catch_sigterm)

    @dataclasses.dataclass
    class TorchConfig(ray_torch.TorchConfig):
        """Ray's TorchConfig plus backend='xla_tpu' (alias 'xla') and xla_spmd_config."""
        xla_spmd_config: dict = None

        def __post_init__(self):
            getattr(super(), "__post_init__", lambda: None)()
            if self.xla_spmd_config is not None:
                if self.backend not in RAY_XLA_BACKENDS:
                    raise ValueError(f"xla_spmd_config needs backend='xla_tpu', got backend={self.backend!r}")
                _mesh_from_config(self.xla_spmd_config, _spmd_config_devices(self.xla_spmd_config))

        @property
        def backend_cls(self):
            return _XlaSpmdBackend if self.backend in RAY_XLA_BACKENDS else _RayTorchBackend

        @property
        def train_func_context(self):
            # Ray's context calls its torch_tpu device manager where TPUs exist; XLA needs nothing.
            return contextlib.nullcontext if self.backend in RAY_XLA_BACKENDS else super().train_func_context

    class TorchTrainer(ray_torch.TorchTrainer):
        """Ray's TorchTrainer; ScalingConfig(use_tpu=True) without a torch_config runs the torch_xla SPMD backend."""

        def __init__(self, train_loop_per_worker, *, torch_config=None, scaling_config=None, **kwargs):
            if torch_config is None:  # use_tpu: ours, not Ray's torch_tpu backend; else Ray's default (None)
                torch_config = TorchConfig(backend="xla_tpu" if getattr(scaling_config, "use_tpu", False) else None)
            if torch_config.backend in RAY_XLA_BACKENDS and scaling_config is not None:
                _check_tpu_scaling(scaling_config.num_workers, scaling_config.num_tpus_per_worker,
                                   scaling_config.topology)
            super().__init__(_RayTrainLoop(train_loop_per_worker), torch_config=torch_config,
                             scaling_config=scaling_config, **kwargs)

        def fit(self):
            _check_cluster_tpus(self.scaling_config)
            return super().fit()

    classes = {cls.__name__: cls for cls in (_XlaSpmdBackend, _RayTorchBackend, TorchConfig, TorchTrainer)}
    for name, cls in classes.items():  # picklable by reference (Ray ships configs to its controller)
        cls.__module__, cls.__qualname__ = __name__, name
    return classes


def __getattr__(name):
    if name in ("TorchConfig", "TorchTrainer", "_XlaSpmdBackend", "_RayTorchBackend"):
        return _ray_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# --- the process, once every room's class exists --------------------------------------------------


_STATE = _ProcessState()


_note_user_pjrt()  # a value set before this import is the user's, whatever loads torch_xla later


if __name__ == "__main__":
    _main()
