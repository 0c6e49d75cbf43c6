"""Run by tests/train/test_fsdp.py on CPU ranks (gloo), not collected on its own: trains ``llama_tiny`` for STEPS
AdamW steps on a fixed global batch, each rank on its 1/N share, with the model sharded by attnlab.train.fsdp
(FSDP2); writes the gathered weights to OUT/weights-TAG.pt. With SAVE, the state is saved at the end as the trainer
saves it (gathered weights, the optimizer's shards through torch.distributed.checkpoint); with LOAD, such a state,
saved at another world size, is loaded first.

    python fsdp_worker.py OUT WORLD STEPS [--bf16] [--checkpoint] [--save DIR] [--load DIR] [--tag TAG]
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from attnlab.models import build_model
from attnlab.train import fsdp

BATCH, BLOCK = 8, 32


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (BATCH, BLOCK + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rank_main(rank: int, a) -> None:
    dist.init_process_group("gloo", init_method=f"file://{a.out}/store-{a.tag}", rank=rank, world_size=a.world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("llama_tiny", attn=a.attn)
    fsdp.shard(model, device=torch.device("cpu"), bf16=a.bf16, checkpoint=a.checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if a.load:  # as the trainer resumes: the gathered weights into the model, the optimizer's shards resharded
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, torch.load(f"{a.load}/weights.pt"), options=StateDictOptions(full_state_dict=True))
        fsdp.load_optimizer(a.load, {"dcp": "optimizer-0"}, model, opt)
    per = BATCH // a.world
    for step in range(a.first, a.first + a.steps):
        x, y = batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        logits = model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    weights = fsdp.full_weights(model)
    if a.save:  # as the trainer saves: the gathered weights (rank 0) and the optimizer's shards (every rank)
        import os

        os.makedirs(a.save, exist_ok=True)
        fsdp.save_optimizer(a.save, "0", model, opt)
        if rank == 0:
            torch.save(weights, f"{a.save}/weights.pt")
    if rank == 0:
        torch.save(weights, f"{a.out}/weights-{a.tag}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("world", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--attn", default="standard")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--tag", default="run")
    args = p.parse_args()
    mp.start_processes(rank_main, args=(args,), nprocs=args.world, start_method="fork")
    sys.exit(0)
