"""A small fake of torch_xla 2.9 for the fast test tier.

Its "XLA device" is the CPU, so the shim's XLA code paths run on plain tensors. It records what the
shim calls (EVENTS) and models just enough behaviour to assert on: sharding-spec text in XLA's own
format, a compile cache keyed on the shapes fed since the last sync, and the SPMD config lock.

Every callable here keeps torch_xla 2.9's signature, and every behaviour it claims is checked
against the real library by tests/test_real_xla.py (same scenarios, same assertions), so the fake
cannot drift silently. FAKE_API lists what the signature check compares.
"""

import os
import types
from collections import OrderedDict

import numpy as np
import torch
import torch.utils.checkpoint

FAKE_API = {
    "torch_xla": ("device", "devices", "device_count", "sync"),
    "torch_xla.runtime": (
        "use_spmd",
        "is_spmd",
        "global_runtime_device_count",
        "process_count",
        "process_index",
        "device_type",
        "get_master_ip",
    ),
    "torch_xla.core.xla_model": ("send_cpu_data_to_device", "wait_device_ops"),
    "torch_xla.distributed.spmd": ("Mesh", "ShardingSpec", "mark_sharding", "set_global_mesh", "get_global_mesh"),
    "torch_xla.distributed.parallel_loader": ("MpDeviceLoader",),
    "torch_xla.debug.metrics": ("counter_value", "counter_names", "metric_data"),
}


class FakeXLA:
    """State of one fake torch_xla 'process'."""

    def __init__(self, num_devices=4, process_count=1, pjrt_device="CPU"):
        self.num_devices, self.nprocs, self.pjrt_device = num_devices, process_count, pjrt_device
        self.events = []
        self.spmd = False
        self.locked = False  # torch_xla locks the SPMD config on the first device request
        self.counters = {}
        self.transfers = 0
        self.cache_env = None  # XLA_PERSISTENT_CACHE_* as torch_xla reads them: at the first compile
        self.pending_shapes = []
        self.graphs = set()
        self.shardings = _Shardings()
        # ids of tensors an asynchronous step is still computing: not reshardable until wait_device_ops()
        # (ids, not weak references: torch cannot swap a parameter that has one)
        self.running = set()
        self.global_mesh = None
        self.special_scalars = True  # torch_xla makes 0 and 1 constants of a graph (the trainer: not in a step)
        self.modules = self._build()

    def make_early_tensor(self):
        """What torch.zeros(2, device=torch_xla.device()) before use_spmd() leaves behind."""
        self.modules["torch_xla"].device()
        self._count("CreateXlaTensor")

    # -- helpers used by the fake modules --
    def _settled(self, tensor):
        """torch_xla refuses to reshard data that a running step is still computing."""
        if id(tensor) in self.running:
            raise RuntimeError(
                "Check failed: (xtensor->CurrentDataHandle() && xtensor->CurrentDataHandle()->HasValue()) || "
                "device_data_node != nullptr: Cannot shard tensor. Data does not present on any device."
            )
        return True

    def _transfer(self, tensors):  # one device->host transfer of them all, as torch_xla counts it
        self.transfers += 1
        return tensors

    def _count(self, name, n=1):
        self.counters[name] = self.counters.get(name, 0) + n

    def _sharding_text(self, mesh, partition_spec):
        """The text XLA prints for `partition_spec` on `mesh`, e.g. {devices=[4,1]0,1,2,3}."""
        names = list(mesh.axis_names or range(len(mesh.mesh_shape)))
        logical = np.asarray(mesh.device_ids).reshape(mesh.mesh_shape)
        tiles, used = [], []
        for entry in partition_spec:
            axes = [] if entry is None else (list(entry) if isinstance(entry, tuple) else [entry])
            idx = [names.index(a) if isinstance(a, str) else a for a in axes]
            used += idx
            tiles.append(int(np.prod([mesh.mesh_shape[i] for i in idx])) if idx else 1)
        rest = [i for i in range(len(names)) if i not in used]
        order = logical.transpose(used + rest).reshape(-1)
        replicate = int(np.prod([mesh.mesh_shape[i] for i in rest])) if rest else 1
        if replicate == len(order):
            return "{replicated}"
        dims = tiles + ([replicate] if replicate > 1 else [])
        text = "{devices=[" + ",".join(map(str, dims)) + "]" + ",".join(map(str, order))
        return text + (" last_tile_dim_replicate}" if replicate > 1 else "}")

    def _build(self):
        fx = self
        torch_xla = types.ModuleType("torch_xla")
        runtime = types.ModuleType("torch_xla.runtime")
        core = types.ModuleType("torch_xla.core")
        xm = types.ModuleType("torch_xla.core.xla_model")
        distributed = types.ModuleType("torch_xla.distributed")
        spmd = types.ModuleType("torch_xla.distributed.spmd")
        pl = types.ModuleType("torch_xla.distributed.parallel_loader")
        debug = types.ModuleType("torch_xla.debug")
        metrics = types.ModuleType("torch_xla.debug.metrics")
        utils = types.ModuleType("torch_xla.utils")
        checkpoint = types.ModuleType("torch_xla.utils.checkpoint")
        # The shim routes only tensors on an 'xla' device here; the fake's live on the CPU, so this
        # stand-in is never called (tests/test_workloads.py proves the real routing).
        checkpoint.CheckpointFunction = torch.utils.checkpoint.CheckpointFunction

        def device(index: int = None) -> torch.device:
            fx.locked = True
            return torch.device("cpu")

        def devices():
            return [torch.device("cpu")]

        def device_count() -> int:
            return fx.num_devices // fx.nprocs  # this process's devices, SPMD or not (devices() is [xla:0] under SPMD)

        def sync(wait: bool = False, reset_scope: bool = True):
            fx.events.append(("sync",))
            if fx.pending_shapes:
                key = tuple(fx.pending_shapes)
                if not fx.graphs:
                    fx.cache_env = {k: v for k, v in os.environ.items() if k.startswith("XLA_PERSISTENT_CACHE")}
                fx._count("CachedCompile" if key in fx.graphs else "UncachedCompile")
                fx.graphs.add(key)
                fx._count("ExecuteReplicated")
            fx.pending_shapes = []

        xlac = types.SimpleNamespace(
            _xla_get_spmd_config_is_locked=lambda: fx.locked,  # stays locked once SPMD is on
            _get_xla_sharding_spec=lambda t: fx.shardings.get(t, ""),
            _get_xla_tensor_debug_info=lambda t: (
                "XLATensor {\nIR: None\nXLAData: None\n}\n"
            ),  # every tensor is data here
            # torch_xla returns an OpSharding object (None without one); its text stands in for it here
            _get_xla_op_sharding=lambda t: fx.shardings.get(t),
            _xla_mark_sharding=lambda t, op_sharding: fx._settled(t) and fx.shardings.__setitem__(t, op_sharding),
            _xla_computation_cache_is_initialized=lambda: bool(fx.graphs),  # from the first compile, as torch_xla
            _xla_get_cpu_tensors=lambda tensors: fx._transfer([t.detach().to("cpu") for t in tensors]),
            _get_xla_handle_special_scalars=lambda: fx.special_scalars,
            _set_xla_handle_special_scalars=lambda on: setattr(fx, "special_scalars", on),
        )
        torch_xla.device, torch_xla.devices, torch_xla.device_count, torch_xla.sync = (
            device,
            devices,
            device_count,
            sync,
        )
        torch_xla._XLAC = xlac

        def use_spmd(auto: bool = False):
            fx.events.append(("use_spmd", xlac._xla_get_spmd_config_is_locked()))
            fx.spmd = True

        def is_spmd():
            return fx.spmd

        runtime.use_spmd, runtime.is_spmd = use_spmd, is_spmd
        runtime.global_runtime_device_count = lambda: fx.num_devices
        runtime.process_count = lambda: fx.nprocs
        runtime.process_index = lambda: 0
        runtime.device_type = lambda: fx.pjrt_device

        def get_master_ip() -> str:
            # torch_xla asks the TPU (or Neuron) runtime for worker 0's address, and refuses on any other device
            if runtime.device_type() == "TPU":
                return "10.0.0.2"
            raise RuntimeError(f"IP discovery not supported for device: {runtime.device_type()}")

        runtime.get_master_ip = get_master_ip

        class Mesh:
            def __init__(self, device_ids, mesh_shape, axis_names=None):
                device_ids = np.asarray(device_ids)  # torch_xla's checks, in its order and words (asserts)
                if len(device_ids) != fx.num_devices:
                    raise AssertionError(f"Number of device IDs ({len(device_ids)}) must match the global number "
                                         f"of devices ({fx.num_devices})")
                if axis_names is not None and len(mesh_shape) != len(axis_names):
                    raise AssertionError(f"Number of axis names ({len(axis_names)}) must match mesh dimensions "
                                         f"({len(mesh_shape)})")
                if axis_names is not None and len(set(axis_names)) != len(axis_names):
                    raise AssertionError(f"Axis names must be unique, got: {axis_names}")
                if int(np.prod(mesh_shape)) != len(device_ids):
                    raise AssertionError(f"Number of device IDs ({len(device_ids)}) must match mesh size "
                                         f"({int(np.prod(mesh_shape))})")
                if len(np.unique(device_ids)) != len(device_ids):
                    raise AssertionError(f"Device IDs must be unique, got: {device_ids}")
                self.device_ids, self.mesh_shape, self.axis_names = device_ids, tuple(mesh_shape), axis_names

            def shape(self):
                return OrderedDict(zip(self.axis_names or range(len(self.mesh_shape)), self.mesh_shape))

            def get_op_sharding(self, partition_spec):  # an OpSharding in torch_xla; its text stands in for it here
                return fx._sharding_text(self, partition_spec)

        class ShardingSpec:
            def __init__(self, mesh, partition_spec, minibatch=False):
                self.mesh, self.partition_spec, self.minibatch = mesh, tuple(partition_spec), minibatch

            def can_apply(self, t):
                return len(t.shape) == len(self.partition_spec)

            def xla_spec(self, t):
                return fx._sharding_text(self.mesh, self.partition_spec) if self.can_apply(t) else None

        def mark_sharding(t, mesh, partition_spec):
            if len(t.shape) != len(partition_spec):
                raise AssertionError(
                    f"Partition spec length ({len(partition_spec)}) should be equal to the input rank ({len(t.shape)})."
                )
            fx._settled(t)
            fx.events.append(("mark_sharding", tuple(t.shape), tuple(partition_spec)))
            fx.shardings[t] = fx._sharding_text(mesh, partition_spec)
            return t

        def set_global_mesh(mesh):
            fx.global_mesh = mesh

        def get_global_mesh():
            return fx.global_mesh

        spmd.Mesh, spmd.ShardingSpec, spmd.mark_sharding = Mesh, ShardingSpec, mark_sharding
        spmd.set_global_mesh, spmd.get_global_mesh = set_global_mesh, get_global_mesh

        def send_cpu_data_to_device(datas, device, input_sharding=None):
            def convert(t):
                out = t.clone()
                fx.events.append(("send", tuple(t.shape)))
                fx.pending_shapes.append(tuple(t.shape))
                spec = input_sharding.xla_spec(t) if input_sharding else None
                if spec:
                    fx.shardings[out] = spec
                return out

            if type(datas) is torch.Tensor:
                datas = [datas]
            return _map_tensors(datas, convert)

        xm.send_cpu_data_to_device = send_cpu_data_to_device

        def wait_device_ops(devices=[]):
            fx.events.append(("wait_device_ops",))
            fx.running.clear()

        xm.wait_device_ops = wait_device_ops

        class MpDeviceLoader:
            def __init__(self, loader, device, **kwargs):
                self._loader, self._device, self._sharding = loader, device, kwargs.get("input_sharding")

            def __iter__(self):
                for batch in self._loader:
                    yield send_cpu_data_to_device(batch, self._device, self._sharding)

            def __len__(self):
                return len(self._loader)

        pl.MpDeviceLoader = MpDeviceLoader

        def counter_value(name):
            return fx.counters.get(name)

        def metric_data(name):
            if name == "TransferFromDeviceTime" and fx.transfers:
                return (fx.transfers, 0.0, [])
            return None

        metrics.counter_value, metrics.metric_data = counter_value, metric_data
        metrics.counter_names = lambda: list(fx.counters)

        torch_xla.runtime, torch_xla.core, torch_xla.distributed, torch_xla.debug = runtime, core, distributed, debug
        core.xla_model, distributed.spmd, distributed.parallel_loader, debug.metrics = xm, spmd, pl, metrics
        torch_xla.utils, utils.checkpoint = utils, checkpoint
        return {
            m.__name__: m
            for m in (torch_xla, runtime, core, xm, distributed, spmd, pl, debug, metrics, utils, checkpoint)
        }

    def install(self, monkeypatch):
        for name, module in self.modules.items():
            monkeypatch.setitem(__import__("sys").modules, name, module)
        return self


class _Shardings:
    """tensor -> sharding text, kept on the tensor as torch_xla keeps it in the tensor: a freed tensor's reused id
    never looks sharded, and no weak reference stops torch.utils.swap_tensors (the trainer marks every parameter,
    whole ones "{replicated}", and a second trainer's .to() swaps them), which moves it with the tensor's __dict__."""

    KEY = "_fake_xla_sharding"

    def get(self, t, default=None):
        return t.__dict__.get(self.KEY, default)

    def __getitem__(self, t):
        return t.__dict__[self.KEY]

    def __setitem__(self, t, text):
        t.__dict__[self.KEY] = text


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj
