"""Run by tests/train/test_ddp_variants.py on 2 CPU ranks (gloo), not collected on its own: for each spec, DDP
without find_unused_parameters (what attnlab's trainer uses), eager and optionally compiled, trains 2 steps on each
rank's half of a batch; writes rank RANK's gradients and its one-process full-batch gradients to OUT/RANK.pt.

    python ddp_variants_worker.py OUT SPECS [--compile BACKEND]

The two ranks are forks of this process (torch.multiprocessing, below), which has computed nothing yet: they need
not import torch again.
"""

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from attnlab.models import build_model


MODEL = dict(drop_path_rate=0.0, embed_dim=192, num_heads=3)  # 16 tokens, ~0.9M parameters: 4 buckets


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rank_main(rank: int, out: str, specs: list[str], backend: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 4, 1, 8, 8, generator=g), torch.randint(0, 10, (2, 4), generator=g)
    result = {}
    for spec in specs:
        torch.manual_seed(0)  # the same weights on both ranks (DDP also broadcasts rank 0's)
        model = build_model("vit_digits", attn=spec, **MODEL).train()
        # 1 MB buckets (DDP's first bucket's size, the least Dynamo's DDP graph splitting accepts): ~4 all-reduces
        # overlapping the backward, and under torch.compile the graph split at each
        ddp = DistributedDataParallel(model, find_unused_parameters=False, bucket_cap_mb=1)
        forward = torch.compile(ddp, backend=backend) if backend else ddp
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: step 2 sees step 1's weights
        for _ in range(2):  # an unused parameter would fail here, in the second step's forward
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(forward(x[rank]), y[rank]).backward()
            opt.step()
        torch.manual_seed(0)
        full = build_model("vit_digits", attn=spec, **MODEL).train()
        F.cross_entropy(full(x.flatten(0, 1)), y.flatten()).backward()
        result[spec] = {"ddp": grads(model), "full": grads(full)}
    torch.save(result, f"{out}/{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    backend = sys.argv[sys.argv.index("--compile") + 1] if "--compile" in sys.argv else None
    mp.start_processes(rank_main, args=(sys.argv[1], sys.argv[2].split(";"), backend), nprocs=2, join=True,
                       start_method="fork")
