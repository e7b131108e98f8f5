"""Multi-process training under ``torchrun``: process group, data sharding, reductions, wrapping.

``scale.parallel=ddp|fsdp`` with ``torchrun --nproc_per_node=N -m opd_exp.cli.train ...``:

* the process group comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
  MASTER_ADDR/PORT): nccl on CUDA, gloo on CPU; each rank uses ``cuda:LOCAL_RANK``;
* every rank draws the same global prompts (the data cursor is replicated) and keeps its
  contiguous share of the step's rows; each row samples from its own generator keyed by
  (seed, step, global row index) (``rollout.RowKeyedSampler``), so the union of the ranks'
  rows is the batch one process samples with the same global ``trainer.batch_size``;
* the loss of each rank is its response tokens' sum divided by the GLOBAL token count, times
  the world size (DDP and FSDP average gradients over ranks): gradients equal the
  single-process ones; metric sums and token counts are all-reduced (token-weighted means);
* W&B, metrics.jsonl, the run-folder lock and checkpoints belong to rank 0; every rank loads
  the same checkpoint on resume; the teacher is replicated on every rank, frozen (no grad);
* the preemption flag is all-reduced at each step boundary, so every rank stops at the same
  step and the checkpoint is consistent.

Without torchrun (no WORLD_SIZE in the environment) ``parallel=ddp|fsdp`` runs as a world of
one: the same row-keyed sampling, no process group. That is the reference a multi-process run
is compared with (tests/test_distributed.py).

FSDP2 (``fully_shard``) shards each decoder layer and then the root module; checkpoints gather
the full state dict (``torch.distributed.checkpoint.state_dict``) and rank 0 writes the same
safetensors layout as a single-process run, so any run can resume any other's folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from opd_exp.runtime.errors import ConfigError


@dataclass
class DistState:
    """Who this process is in the run."""

    parallel: str = "none"  # none | ddp | fsdp
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group exists (collectives are needed)."""
        return self.backend is not None

    @property
    def row_keyed(self) -> bool:
        """Sample rows from (seed, step, global row) generators (any parallel mode, any world size)."""
        return self.parallel != "none"


def _export_submitit_env() -> None:
    """A SLURM job with several tasks started by submitit (hydra/launcher=slurm with
    tasks_per_node > 1) has SLURM_PROCID etc. but no torchrun variables: export RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT the way submitit's helper derives them."""
    if "RANK" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def torchrun_env() -> dict[str, int] | None:
    """RANK/WORLD_SIZE/LOCAL_RANK as torchrun (or submitit's export) sets them, or None."""
    _export_submitit_env()
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        return {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE")} | {"LOCAL_RANK": int(os.environ.get("LOCAL_RANK", "0"))}
    except ValueError as ex:
        raise ConfigError(f"torchrun environment: {ex}; allowed: integer RANK, WORLD_SIZE, LOCAL_RANK") from None


def device_for(dev_name: str, local_rank: int, world_size: int) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is used by a multi-process run."""
    use_cuda = dev_name == "cuda" or dev_name.startswith("cuda:") or (dev_name == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if world_size > 1 or dev_name in ("auto", "cuda"):
        return torch.device(f"cuda:{local_rank}")
    return torch.device(dev_name)


def setup(parallel: str, dev_name: str) -> tuple[DistState, torch.device]:
    """Join the process group torchrun set up (idempotent), and pick this rank's device."""
    env = torchrun_env() if parallel != "none" else None
    if env is None or (env["WORLD_SIZE"] == 1 and not torch.distributed.is_initialized()):
        if parallel == "none" and torchrun_env() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError(
                f"scale.parallel='none' under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}: every rank would train "
                f"its own copy into the same folder; allowed: scale.parallel=ddp or fsdp"
            )
        if dev_name == "auto":
            return DistState(parallel=parallel), torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return DistState(parallel=parallel), torch.device(dev_name)
    import torch.distributed as dist

    device = device_for(dev_name, env["LOCAL_RANK"], env["WORLD_SIZE"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
    state = DistState(parallel, dist.get_rank(), dist.get_world_size(), env["LOCAL_RANK"], dist.get_backend())
    return state, device


def teardown() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            # every rank done before any destroys the group: a rank that destroyed it while another
            # still had gloo work in flight aborted that one ("terminate called without an active
            # exception", exit -6, 1 run in 12 of the FSDP test). Bounded: a rank that failed never
            # arrives, and the others go on after the timeout.
            with contextlib.suppress(RuntimeError):
                dist.monitored_barrier(timeout=timedelta(seconds=60))
        dist.destroy_process_group()


# -- data ---------------------------------------------------------------------
def shard(n_rows: int, ds: DistState, group: tuple[str, int] | None = None) -> slice:
    """This rank's contiguous rows of a global batch of ``n_rows`` (an even split). ``group``: (what needs
    it, rows per prompt) where each rank must hold a prompt's samples whole (a leave-one-out baseline)."""
    if n_rows % ds.world_size:
        raise ConfigError(
            f"trainer.batch_size x rollout.n_samples = {n_rows} rows cannot be split evenly over {ds.world_size} ranks; "
            f"allowed: a multiple of the world size"
        )
    per = n_rows // ds.world_size
    if group is not None and per % group[1]:
        raise ConfigError(
            f"trainer.batch_size={n_rows // group[1]} is not allowed with {group[0]} over {ds.world_size} ranks (a prompt's "
            f"{group[1]} samples would be split between ranks); allowed: a multiple of {ds.world_size}"
        )
    return slice(ds.rank * per, (ds.rank + 1) * per)


def row_seeds(seed: int, step: int, rows: Sequence[int]) -> list[int]:
    """One generator seed per GLOBAL row index of step ``step`` (never the rank)."""
    base = (seed * 1_000_003 + step + 1) * 1_000_033
    return [(base + 7_919 * r + 17) % (2**63 - 1) for r in rows]


# -- reductions ---------------------------------------------------------------
def _device_of(ds: DistState) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if ds.backend == "nccl" else torch.device("cpu")


def all_reduce_sum(values: Sequence[float], ds: DistState) -> list[float]:
    """Element-wise sum over ranks (float64 on the wire); identity without a process group."""
    if not ds.active:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device_of(ds))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: Sequence[float], ds: DistState) -> list[float]:
    """Element-wise maximum over ranks (float64 on the wire); identity without a process group."""
    if not ds.active or not values:
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device_of(ds))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def reduce_sums(sums: dict[str, float], keys: Sequence[str], ds: DistState) -> dict[str, float]:
    """All-reduce a dict of per-token sums over a fixed key order (every rank the same keys)."""
    total = all_reduce_sum([sums.get(k, 0.0) for k in keys], ds)
    return dict(zip(keys, total))


def any_rank(flag: bool, ds: DistState) -> bool:
    """True on every rank if it is true on any (a NaN seen by one rank stops them all)."""
    return all_reduce_sum([1.0 if flag else 0.0], ds)[0] > 0 if ds.active else bool(flag)


def broadcast_object(obj: Any, ds: DistState) -> Any:
    """Rank 0's value of ``obj`` on every rank (e.g. the run folder)."""
    if not ds.active:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ds: DistState) -> None:
    if ds.active:
        import torch.distributed as dist

        dist.barrier()


# -- models -------------------------------------------------------------------
def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks FSDP shards one by one (HF decoder-only layout, or peft on top)."""
    found: list[torch.nn.Module] = []
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and type(mod[0]).__name__.endswith("DecoderLayer"):
            found.extend(mod)
    return found


def wrap_student(model, ds: DistState, device: torch.device, param_dtype: torch.dtype | None = None):
    """The module the training forward goes through: DDP(model), the FSDP2-sharded model
    (``fully_shard`` works in place: the same object), or the model itself."""
    if not ds.active or ds.parallel == "none":
        return model
    if ds.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    if ds.parallel == "fsdp":
        try:
            from torch.distributed.fsdp import fully_shard  # torch >= 2.6
        except ImportError:  # torch 2.4-2.5: the same FSDP2 API, not yet public
            from torch.distributed._composable.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ConfigError(f"scale.parallel={ds.parallel!r} is not allowed; allowed: none, ddp, fsdp")


def no_sync(train_module, ds: DistState, last: bool):
    """Skip DDP's gradient all-reduce on every micro-batch but the last (one all-reduce per
    step); FSDP2: defer the reduce-scatter likewise."""
    import contextlib

    if last or not ds.active:
        return contextlib.nullcontext()
    if hasattr(train_module, "no_sync"):  # DDP
        return train_module.no_sync()
    if hasattr(train_module, "set_requires_gradient_sync"):  # FSDP2 module

        @contextlib.contextmanager
        def _fsdp() -> Iterator[None]:
            train_module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                train_module.set_requires_gradient_sync(True)

        return _fsdp()
    return contextlib.nullcontext()


def grad_norm_value(total_norm) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2)."""
    if hasattr(total_norm, "full_tensor"):
        total_norm = total_norm.full_tensor()
    return float(total_norm)


# -- checkpoints under FSDP2 --------------------------------------------------
class FullModelView:
    """What ``checkpoint.save/load`` needs of a model, over an FSDP2-sharded one: the full
    (unsharded, CPU) state dict. Both methods are collectives: every rank calls them."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return compact(sd)

    def load_state_dict(self, sd, strict: bool = True):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(self.model, sd, options=StateDictOptions(full_state_dict=True, strict=strict))

    def parameters(self):
        yield torch.zeros(())  # load the file on CPU; set_model_state_dict shards it


def compact(sd: dict) -> dict:
    """Each tensor in its own storage (gathered tensors can be views of one flat buffer, which
    safetensors refuses); tensors that shared memory (tied embeddings) still share it."""
    out, seen = {}, {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
            continue
        key = (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype)
        if key not in seen:
            seen[key] = v.detach().clone().contiguous()
        out[k] = seen[key]
    return out


class FullOptimizerView:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, sd, options=StateDictOptions(full_state_dict=True))


class Frozen:
    """A state dict gathered beforehand, handed to ``checkpoint.save`` (rank 0 only)."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd
