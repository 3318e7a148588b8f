"""torch.distributed plumbing for the update stage (docs/design.md §7, §12).

``graft update`` run under ``torchrun --nproc_per_node K`` finds ``WORLD_SIZE``/``RANK`` in the
environment and joins a process group (gloo on CPU, nccl on GPU). Every rank holds the whole
iteration's rows; each minibatch is split across ranks (``batching.shard``). Gradient averaging
(DDP, or FSDP2's reduce-scatter) divides by K, so each rank scales its loss sum by K / (global unit
count): the averaged gradient then equals the one-process gradient of the same minibatch.

``update.parallel = "fsdp"`` shards parameters, gradients and optimizer state with FSDP2
(``torch.distributed.fsdp.fully_shard``, one unit per decoder layer plus the root) for models that do
not fit one device; ``"ddp"`` (default) replicates the model.

The ``torchrun`` commands for one node (DDP) and several nodes (FSDP2) are in docs/scaling.md; the
run directory must be on a filesystem every node sees, and rank 0 writes.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """This process's place in the (possibly trivial) process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this module created the process group (destroyed at process exit)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor


def _pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from schemas.errors import GraftError

            raise GraftError("run.device = 'cuda' but torch sees no CUDA device")
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def init_distributed(device_preference: str = "cpu") -> DistContext:
    """Join the torchrun process group when ``WORLD_SIZE`` > 1 (else a one-process context)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(device_preference, local_rank)
    if world_size <= 1:
        return DistContext(device=device)
    owns = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
        # Kept for the life of the process: a loop under torchrun calls run_update once per
        # iteration, and re-creating a group on the same rendezvous can hang.
        atexit.register(_destroy_group)
        owns = True
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistContext, parallel: str) -> torch.nn.Module:
    """The training module: a ``SelectedLogits`` around ``model``, in DDP or FSDP2 under torchrun."""
    from stages.update.logprobs import SelectedLogits

    scorer = SelectedLogits(model)
    if not ctx.distributed:
        return scorer
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers if layers is not None else []:
            fully_shard(layer)
        fully_shard(scorer)
        return scorer
    from torch.nn.parallel import DistributedDataParallel

    # No buffer sync per forward: buffers (rotary tables) are identical on every rank, and a broadcast
    # per forward would add a collective to the no-grad scoring passes.
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(scorer, device_ids=device_ids, forward_sync_buffers=False)
    return DistributedDataParallel(scorer, device_ids=device_ids, broadcast_buffers=False)


def reshard(model: torch.nn.Module) -> None:
    """Return FSDP2 modules to their sharded parameters (a no-grad forward leaves the root unsharded
    until a backward that never comes). A no-op for other models."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
            module.reshard()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside the DDP / SelectedLogits wrappers (FSDP2 works in place)."""
    from stages.update.logprobs import language_model

    return language_model(model)


@contextlib.contextmanager
def accumulate(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for all but the last micro-batch of an optimizer step."""
    if sync:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield
