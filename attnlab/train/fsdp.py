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

Checkpoints: :func:`full_weights` gathers the plain state dict that the run's weights file holds (what evaluation,
sampling and reports read; rank 0, on the CPU); :func:`save_optimizer` writes the sharded optimizer state with
``torch.distributed.checkpoint`` (one file per rank and a metadata file, written by every rank in parallel), and
:func:`load_optimizer` reads it back at any world size (DCP reshards on load), one process included.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError(f"{type(model).__name__} has no transformer blocks (a ModuleList or Sequential named 'blocks') to shard; "
                          "train it without --parallel fsdp.")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    if checkpoint:
        checkpoint_blocks(model)
    for block in blocks:
        # the last block's parameters are needed again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=block is not blocks[-1])
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing: each block's activations recomputed in the backward instead of kept (PyTorch's
    composable ``checkpoint``, which FSDP2 and torch.compile compose with). Returns ``model``."""
    from torch.distributed._composable import checkpoint

    blocks = blocks_of(model)
    if not blocks:
        raise ConfigError(f"{type(model).__name__} has no transformer blocks (a ModuleList or Sequential named "
                          "'blocks') to checkpoint; train it without --activation-checkpointing.")
    for block in blocks:
        checkpoint(block)
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the CPU, on rank 0 (empty on the others); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


OPTIMIZER_PREFIX = "optimizer-"  # a sharded run's optimizer state: RUN_DIR/optimizer-<save id>/


def save_optimizer(run_dir: str | Path, save_id: str, model: nn.Module, optimizer: torch.optim.Optimizer
                   ) -> dict[str, str]:
    """The sharded optimizer state into ``RUN_DIR/optimizer-<save_id>/`` (every rank its shard; a collective);
    returns what the trainer state records in place of the optimizer's state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    name = OPTIMIZER_PREFIX + save_id
    path, tmp = Path(run_dir) / name, Path(run_dir) / f".{name}.tmp"
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp.rename(path)
    dist.barrier()
    return {"dcp": name}


def load_optimizer(run_dir: str | Path, recorded: dict[str, str], model: nn.Module,
                   optimizer: torch.optim.Optimizer) -> None:
    """The optimizer state :func:`save_optimizer` recorded, resharded to this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(run_dir) / recorded["dcp"]
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{path} (the sharded optimizer state of the run's checkpoint) is missing; restore it, or "
                          "start the run afresh without --resume.")
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():  # one process resuming a sharded run: DCP says it loads without ranks
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def keep_optimizers(run_dir: str | Path) -> None:
    """Remove the optimizer directories that no checkpoint pair names any more (rank 0, after a save)."""
    from .checkpoint import _weights_meta
    from .files import PREV_WEIGHTS, WEIGHTS

    run_dir = Path(run_dir)
    kept = set()
    for name in (WEIGHTS, PREV_WEIGHTS):
        try:
            kept.add(OPTIMIZER_PREFIX + _weights_meta(run_dir / name)[1])
        except Exception:  # noqa: BLE001 - a missing or damaged file names nothing
            pass
    for path in run_dir.glob(f"{OPTIMIZER_PREFIX}*"):
        if path.name not in kept:
            shutil.rmtree(path, ignore_errors=True)
    for path in run_dir.glob(f".{OPTIMIZER_PREFIX}*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["blocks_of", "checkpoint_blocks", "full_weights", "keep_optimizers", "load_optimizer", "save_optimizer",
           "shard"]
