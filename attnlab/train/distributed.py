"""Data-parallel training under torchrun: process group, data sharding, reductions, errors that end every rank
(docs/training.md, "Several GPUs").

:func:`session` joins torchrun's process group (gloo on the CPU, nccl on CUDA, one device per local rank).
``--batch-size`` stays the global batch B, so each of the N ranks takes B/N a step, from the one-process order
split by rank (timm's RepeatAugSampler strides its list the same way):

    global order o_0, o_1, ... (the same on every rank, a function of (seed, epoch))
    rank r, step s:  {o_p : sB <= p < (s+1)B, p = r mod N}

Per-sample and per-batch randomness (augmentation, Mixup/CutMix, drop-path) is seeded from (seed, epoch, rank), so
that ranks do not repeat each other. How an error ends every rank (:func:`agree`, :func:`steps`, :func:`settle`):
the docs' "Errors".
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from attnlab.errors import AttnlabError, ConfigError


class PeerFailedError(AttnlabError, RuntimeError):
    """Another rank stopped with an error that is not an attnlab error (its traceback is in that rank's output)."""


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: ``world_size`` processes, this one ``rank`` (``local_rank`` on its node)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run's files and prints."""
        return self.rank == 0


SINGLE = Ranks()
_current = SINGLE


def env_ranks() -> Ranks:
    """The ranks torchrun's environment gives this process (one process without torchrun)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ConfigError("WORLD_SIZE, RANK and LOCAL_RANK must be integers; start distributed runs with torchrun.")
    return Ranks(world, rank, local)


def rank_device(device: torch.device, ranks: Ranks) -> torch.device:
    """Each local rank on its own GPU: ``cuda`` means ``cuda:LOCAL_RANK`` under torchrun."""
    if ranks.distributed and device.type == "cuda":
        if device.index is not None:
            raise ConfigError(f"device {device} was asked for, but under torchrun each rank trains on "
                              f"cuda:LOCAL_RANK; use --device cuda (or auto) and CUDA_VISIBLE_DEVICES to pick GPUs.")
        return torch.device("cuda", ranks.local_rank)
    return device


@contextmanager
def session(device: torch.device) -> Iterator[Ranks]:
    """Join torchrun's process group for the run (gloo on CPU, nccl on CUDA) and leave it at the end; a process
    group the caller already started is used as it is and left running."""
    global _current
    ranks = env_ranks()
    joined = dist.is_available() and dist.is_initialized()
    owned = ranks.distributed and not joined
    if joined:
        ranks = Ranks(dist.get_world_size(), dist.get_rank(), ranks.local_rank)
    elif owned:
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device, ranks))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    previous, _current = _current, ranks
    try:
        yield ranks
    finally:
        _current = previous
        if owned:
            dist.destroy_process_group()


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """Seed of rank ``rank``'s random streams in epoch ``epoch`` (augmentation, mixing, drop-path)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


class ShardedSampler(Sampler[int]):
    """Rank ``rank``'s share of ``base``'s order: positions rank, rank + N, ... of its first
    ``len(base) // N * N`` indices, so that every rank has the same number of samples and per-rank batches of
    B/N make up the one-process batches of B (see the module docstring)."""

    def __init__(self, base: Sampler, num_replicas: int, rank: int):
        self.base, self.num_replicas, self.rank = base, num_replicas, rank

    def __iter__(self) -> Iterator[int]:
        order = list(self.base)
        return iter(order[self.rank:len(order) // self.num_replicas * self.num_replicas:self.num_replicas])

    def __len__(self) -> int:
        return len(self.base) // self.num_replicas


def rank_batch_size(batch_size: int, ranks: Ranks) -> int:
    """The per-rank batch: the global ``batch_size`` split evenly, or ConfigError."""
    if batch_size % ranks.world_size:
        raise ConfigError(f"batch_size {batch_size} is the global batch and must split evenly over the "
                          f"{ranks.world_size} ranks; use a multiple of {ranks.world_size}.")
    return batch_size // ranks.world_size


def reduce_sums(*values: torch.Tensor | float) -> list[torch.Tensor]:
    """Sums over the ranks of each value (float64 on the values' device; one all-reduce for all of them): the
    step statistics are read through it, so a one-process run and an N-rank run log the same quantities."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if _current.distributed and dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    flat = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach().reshape(()) for v in values])
    if _current.distributed:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return list(flat.unbind())


@contextmanager
def steps() -> Iterator[None]:
    """Marks the training steps, where DDP's collectives may be pending: an error there is this rank's alone."""
    try:
        yield
    except BaseException as err:
        if not getattr(err, "attnlab_shared", False):
            err.attnlab_local = True  # type: ignore[attr-defined]
        raise


def agree(error: BaseException | None) -> None:
    """A meeting point of every rank: each brings its error (or None); if any rank has one, every rank raises the
    error of the lowest such rank, marked shared. A no-op in a single process."""
    if not _current.distributed:
        if error is not None:
            raise error
        return
    if error is not None and not isinstance(error, AttnlabError):
        error = PeerFailedError(f"rank {_current.rank} stopped with {type(error).__name__}: "
                                f"{' '.join(str(error).split()) or 'no message'}; its traceback is in that rank's "
                                f"output.")
    gathered: list = [None] * _current.world_size
    dist.all_gather_object(gathered, error)
    first = next((e for e in gathered if e is not None), None)
    if first is not None:
        first.attnlab_shared = True
        raise first


def settle(error: BaseException) -> BaseException:
    """The error a rank ends with: outside the steps, one agreed with the other ranks (see :func:`agree`)."""
    if not _current.distributed or getattr(error, "attnlab_shared", False) or getattr(error, "attnlab_local", False):
        return error
    try:
        agree(error)
    except BaseException as agreed:  # noqa: BLE001 - agree always raises here
        # a crash keeps its traceback on the rank where it happened; the others end with PeerFailedError
        return error if not isinstance(error, AttnlabError) else agreed
    return error


def shared(error: BaseException) -> BaseException:
    """``error`` marked as raised on every rank at the same point (rank 0 alone prints it)."""
    if _current.distributed:
        error.attnlab_shared = True  # type: ignore[attr-defined]
    return error


def from_main(value):
    """Rank 0's ``value`` on every rank (the run's result)."""
    if not _current.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
