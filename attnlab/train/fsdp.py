"""Fully sharded data parallel for models that outgrow data parallel: PyTorch's FSDP2 (``fully_shard``) and
``torch.distributed.checkpoint`` (docs/training.md, "Sharded training").

Each transformer block is one FSDP unit: its parameters live as 1/N shards on the N ranks (DTensors), are
all-gathered before the block's forward and backward and freed after, and its gradients are reduce-scattered, so
that a rank holds 1/N of the parameters, gradients and optimizer state. The root unit holds what is left
(embeddings, final norm, head). Gradients are averaged over the ranks as DDP averages them, so with the global
batch split by rank (:mod:`attnlab.train.distributed`) a sharded step equals the one-process step up to the order
of the float sums.

Options, as torchtitan sets them: bfloat16 mixed precision (parameters gathered and computed in bf16, gradients
reduced in fp32: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), activation checkpointing
per block (the block's activations recomputed in the backward), and the compiled forward on top.

Checkpoints: :func:`save` writes the sharded model and optimizer state with ``torch.distributed.checkpoint``
(one file per rank and a metadata file, written by every rank in parallel), :func:`load` reads them back at any
world size (DCP reshards on load), and :func:`full_weights` gathers the plain state dict that evaluation,
sampling and reports read (rank 0, on the CPU).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from attnlab.errors import ConfigError


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, each an FSDP unit: the modules of every ``nn.ModuleList`` or
    ``nn.Sequential`` named ``blocks`` (attnlab's GPT and Llama, timm's ViT, each stage of timm's Swin)."""
    return [block for name, child in model.named_modules() if name.rsplit(".", 1)[-1] == "blocks"
            and isinstance(child, (nn.ModuleList, nn.Sequential)) for block in child]


def shard(model: nn.Module, *, device: torch.device, bf16: bool = False, checkpoint: bool = False) -> nn.Module:
    """``model`` sharded in place over the process group's ranks (every rank calls it with the same model, built
    from the same seed); returns it. ``bf16``: compute in bfloat16, reduce gradients in float32; ``checkpoint``:
    recompute each block's activations in the backward."""
    from torch.distributed._composable import checkpoint as checkpoint_module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError(f"{type(model).__name__} has no transformer blocks (a ModuleList or Sequential named 'blocks') to shard; "
                          "train it without --parallel fsdp.")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in blocks:
        if checkpoint:
            checkpoint_module(block)
        # the last block's parameters are needed again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=block is not blocks[-1])
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU, on rank 0 (empty on the others); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The sharded model and optimizer state into directory ``path``, replaced whole: written beside it, then
    renamed by rank 0 once every rank has written (a kill leaves the old directory or the new one, never a mix)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state from :func:`save`'s directory ``path``, resharded to this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=Path(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def local_numel(params: Iterable[torch.Tensor]) -> int:
    """Elements this rank holds of ``params`` (a shard's for DTensors)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in params)


__all__ = ["blocks_of", "full_weights", "is_sharded", "load", "local_numel", "save", "shard"]
