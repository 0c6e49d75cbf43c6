"""Data-parallel training under torchrun (gloo on the CPU).

What must hold (attnlab.train.distributed): with the global batch B split over N ranks, the union of the ranks'
step-s batches is the one-process batch s, so a run without per-rank randomness (no augmentation, no mixing,
drop-path 0: the demo recipe) trains the same weights on 2 ranks as on 1, up to the float32 rounding of summing
gradients in another order; a DDP run killed on one rank resumes to the weights of an uninterrupted DDP run; an
error on one rank outside the steps ends every rank with one line, printed once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
import torch
from torch.utils.data import RandomSampler
from train_helpers import weights

from attnlab.errors import ConfigError
from attnlab.train.distributed import Ranks, ShardedSampler, rank_batch_size

WORKER = Path(__file__).with_name("ddp_fail_worker.py")
DEMO = ["train", "--recipe", "demo", "--batch-size", "64", "--no-progress"]


# ----------------------------------------------------------------------------------------------- the data split
def _step_batches(order: list[int], batch: int) -> list[list[int]]:
    return [order[i:i + batch] for i in range(0, len(order) // batch * batch, batch)]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_shuffle_splits_each_one_process_batch(world):
    def shuffle():  # each rank draws the epoch's order from a generator seeded alike
        return RandomSampler(range(1437), generator=torch.Generator().manual_seed(3))

    per_rank = [_step_batches(list(ShardedSampler(shuffle(), world, r)), 64 // world) for r in range(world)]
    single = _step_batches(list(shuffle()), 64)
    assert all(len(p) == len(single) for p in per_rank)
    for s, batch in enumerate(single):
        assert sorted(i for p in per_rank for i in p[s]) == sorted(batch)


@pytest.mark.parametrize("world", [2, 4])
def test_repeat_aug_sampler_strided_over_ranks_splits_each_one_process_batch(world):
    from timm.data.distributed_sampler import RepeatAugSampler

    def order(n, r):
        sampler = RepeatAugSampler(range(1437), num_replicas=n, rank=r, num_repeats=3)
        sampler.set_epoch(7)
        return list(sampler)

    single = _step_batches(order(1, 0), 64)
    per_rank = [_step_batches(order(world, r), 64 // world) for r in range(world)]
    assert all(len(p) == len(single) for p in per_rank)
    for s, batch in enumerate(single):
        assert sorted(i for p in per_rank for i in p[s]) == sorted(batch)


def test_global_batch_must_split_over_ranks():
    assert rank_batch_size(128, Ranks(4, 0, 0)) == 32
    with pytest.raises(ConfigError, match="multiple of 3"):
        rank_batch_size(128, Ranks(3, 0, 0))


def test_each_rank_takes_its_local_gpu():
    from attnlab.train.distributed import rank_device

    assert rank_device(torch.device("cuda"), Ranks(4, 3, 1)) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), Ranks(4, 3, 1)) == torch.device("cpu")
    assert rank_device(torch.device("cuda", 2), Ranks(1, 0, 0)) == torch.device("cuda", 2)
    with pytest.raises(ConfigError, match="cuda:LOCAL_RANK"):
        rank_device(torch.device("cuda", 0), Ranks(2, 1, 1))


def test_mixing_needs_an_even_batch_on_each_rank(tmp_path):
    from train_helpers import tiny

    from attnlab.train.loop import _train
    from attnlab.train.run import Run

    run = Run(tiny(tmp_path, batch_size=66, mixup=0.8, mixup_prob=1.0))  # even, but 33 per rank on 2 ranks
    run.join(Ranks(2, 0, 0))
    with pytest.raises(ConfigError, match="multiple of 4"):
        _train(run)  # stops before anything that would need the process group
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------- torchrun runs
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SCRATCH: list[str] = []


def _scratch() -> str:
    """A temporary directory of this test process, removed when it exits."""
    if not _SCRATCH:
        import atexit
        import shutil
        import tempfile

        _SCRATCH.append(tempfile.mkdtemp(prefix="attnlab-torchrun-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return _SCRATCH[0]


def _torchrun(args: list[str], *, script: list[str] | None = None, wait: bool = True):
    """``torchrun --nproc_per_node=2 SCRIPT ARGS``: torchrun's agent and its ranks are forks of tests/forked.py's
    zygote (``python -m torch.distributed.run`` is the torchrun command), each rank behind a stand-in that torchrun
    starts, signals and watches as it would the rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}",
           "--no-python", *forked.torchrun_rank(), *(script or ["-m", "attnlab"]), *args]
    env = forked.rank_env({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent),
                           "TMPDIR": _scratch()})  # torchrun's log directories and error files, which it leaves
    if not wait:
        return forked.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return forked.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _single(args: list[str]):
    from cli_runner import in_process

    return in_process(args)  # the one-process reference needs no interpreter of its own (--threads 1 in args)


def _root_cause(stderr: str) -> tuple[int, str]:
    """(rank, exit code) of the failure torchrun names as the root cause."""
    import re

    cause = stderr.split("Root Cause", 1)[1]
    return int(re.search(r"rank\s*: (\d+)", cause)[1]), re.search(r"exitcode\s*: (-?\d+)", cause)[1]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("attnlab train")]


# FSDP2 (attnlab.train.fsdp): the parameters, gradients and optimizer state sharded over the ranks, each block its
# own unit, activations recomputed in the backward; the same weights, within the same tolerance
SHARDED = ["--parallel", "fsdp", "--activation-checkpointing"]


@pytest.mark.slow
@pytest.mark.parametrize(("repeated_aug", "parallel"), [(1, []), (3, []), (1, [*SHARDED, "--grad-accum", "2"])],
                         ids=["ddp", "ddp-ra3", "fsdp-accum"])
def test_two_ranks_train_the_one_process_model(tmp_path, repeated_aug, parallel):
    args = [*DEMO, "--epochs", "1", "--repeated-aug", str(repeated_aug), "--threads", "1"]
    one = _single([*args, "--runs-dir", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    two = _torchrun([*args, *parallel, "--runs-dir", str(tmp_path / "two")])
    assert two.returncode == 0, two.stderr
    [run_one] = (tmp_path / "one").iterdir()
    [run_two] = (tmp_path / "two").iterdir()
    w1, w2 = weights(run_one / "checkpoint.safetensors"), weights(run_two / "checkpoint.safetensors")
    assert w1.keys() == w2.keys()
    dim = w1["head.weight"].shape[1]
    for key in w1:  # 22 (or 20) AdamW steps from the same start on the same batches
        a, b = w1[key].clone(), w2[key].clone()
        if key.endswith("attn.qkv.bias"):
            # The key bias adds q.b_k to every logit of a row, which softmax ignores: its exact gradient is 0, so
            # it receives summation-order noise, which Adam scales up to steps of up to lr (5e-3).
            torch.testing.assert_close(b[dim:2 * dim], a[dim:2 * dim], rtol=0, atol=5e-3 * 22, msg=key)
            a[dim:2 * dim] = b[dim:2 * dim] = 0
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=key)
    # rank 0 alone writes and speaks; both files record the world size
    assert len(two.stdout.strip().splitlines()) == 1, two.stdout
    assert "world_size: 2" in (run_two / "config.yaml").read_text()
    assert json.loads((run_two / "result.json").read_text())["world_size"] == 2
    assert json.loads((run_one / "result.json").read_text())["world_size"] == 1
    m1 = [json.loads(x) for x in (run_one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (run_two / "metrics.jsonl").read_text().splitlines()]
    assert len(m2) == 1  # one line per epoch, not one per rank
    # the logged train loss and accuracy are over all ranks' images, so they match the one-process run
    assert m2[0]["train_loss"] == pytest.approx(m1[0]["train_loss"], rel=1e-4)
    assert m2[0]["train_acc"] == pytest.approx(m1[0]["train_acc"], abs=1e-9)
    assert m2[0]["top1"] == pytest.approx(m1[0]["top1"], abs=1e-9)


def _rank_pid(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of the worker with RANK=rank among torchrun's children (the rank's stand-in: killing it kills the
    rank, tests/forked.py)."""
    for child in Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker with RANK={rank}")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [[], SHARDED], ids=["ddp", "fsdp"])
def test_resume_after_a_rank_is_killed_equals_an_uninterrupted_run(tmp_path, parallel):
    args = [*DEMO, "--epochs", "3", "--threads", "1", *parallel]
    full = _torchrun([*args, "--runs-dir", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr

    runs = tmp_path / "killed"
    proc = _torchrun([*args, "--runs-dir", str(runs)], wait=False)
    metrics = runs / "vit_digits-digits-standard-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    os.kill(_rank_pid(proc, 1), signal.SIGKILL)  # during epoch 2
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert not (metrics.parent / "result.json").exists(), "the run finished before rank 1 was killed"

    resumed = _torchrun([*args, "--runs-dir", str(runs), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    w_full = weights(tmp_path / "full" / "vit_digits-digits-standard-s0" / "checkpoint.safetensors")
    w_resumed = weights(metrics.parent / "checkpoint.safetensors")
    for key in w_full:
        assert torch.equal(w_resumed[key], w_full[key]), key
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [1, 2, 3]
    if parallel:  # the sharded optimizer state of the two kept checkpoints, and nothing else
        kept = sorted(p.name for p in metrics.parent.glob("*optimizer-*"))
        assert len(kept) == 2 and not any(name.startswith(".") for name in kept), kept


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "where", "message"), [
    (1, "data", "rank 1 cannot read the digits files"),        # set-up, on a rank that writes nothing
    (0, "checkpoint", "rank 0 cannot write the checkpoint"),  # end of epoch 1, while rank 1 waits
])
def test_an_error_on_one_rank_ends_both_with_one_line(tmp_path, rank, where, message):
    run = _torchrun([*DEMO, "--epochs", "2", "--threads", "1", "--runs-dir", str(tmp_path)],
                    script=[str(WORKER), str(rank), where, "--"])
    assert run.returncode != 0
    lines = _errors(run.stderr)
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert "attnlab/train" not in run.stderr, run.stderr  # no worker traceback (torchrun prints its own)
    # rank 0 exits first, with the user-error code; torchrun then stops rank 1, which waits for that
    assert _root_cause(run.stderr) == (0, "2"), run.stderr
    if where == "data":  # failed before its first epoch: rank 0 removed the run directory it had made
        assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_non_finite_loss_stops_every_rank_with_one_line(tmp_path):
    run = _torchrun([*DEMO, "--epochs", "2", "--lr", "1e30", "--threads", "1", "--runs-dir", str(tmp_path)])
    assert run.returncode != 0
    lines = _errors(run.stderr)
    assert len(lines) == 1 and "training loss became" in lines[0], run.stderr
    assert _root_cause(run.stderr) == (0, "3"), run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [[], ["--parallel", "fsdp"]], ids=["ddp", "fsdp"])
def test_two_ranks_train_a_language_model(tmp_path, parallel):
    """The lm recipe under torchrun (each rank draws its own blocks, data/lm.py): it finishes, records both ranks,
    evaluates every --eval-every steps and ends below its loss at initialisation (sharded: every rank takes part in
    each evaluation, the one at initialisation included)."""
    args = ["train", *parallel, "--recipe", "lm", "--max-steps", "4", "--eval-every", "2", "--eval-iters", "1",
            "--batch-size", "4", "--block-size", "16", "--warmup-steps", "1", "--threads", "1", "--no-progress",
            "--model-options", "{embed_dim: 32, depth: 1, num_heads: 2}", "--runs-dir", str(tmp_path)]
    proc = _torchrun(args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = tmp_path.iterdir()
    result = json.loads((run / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 4 and result["val_loss"] < result["init"]["val_loss"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4]
