"""Run under torchrun by test_train_ddp.py: `attnlab train ARGS...` with one rank made to fail at a chosen point.

Usage: ddp_fail_worker.py RANK WHERE -- ARGS...; WHERE is 'data' (set-up: the train set cannot be read) or
'checkpoint' (end of epoch 1: the checkpoint cannot be written). Other ranks run unchanged.
"""

import os
import sys

import attnlab.data
import attnlab.train.loop as loop
from attnlab.cli import main
from attnlab.errors import ConfigError, DatasetError

fail_rank, where = int(sys.argv[1]), sys.argv[2]
argv = sys.argv[sys.argv.index("--") + 1:]

if int(os.environ["RANK"]) == fail_rank:
    if where == "data":
        def build_dataset(*args, **kwargs):
            raise DatasetError(f"rank {fail_rank} cannot read the digits files; check the data directory.")

        attnlab.data.build_dataset = build_dataset
    elif where == "checkpoint":
        def save_checkpoint(*args, **kwargs):
            raise ConfigError(f"rank {fail_rank} cannot write the checkpoint; check the runs directory.")

        loop.save_checkpoint = save_checkpoint
    else:
        raise SystemExit(f"unknown failure point {where}")

sys.exit(main(argv))
