"""Grid workers never outlive their parent (issue 27 item 3): `compare --jobs 2` killed outright or sent SIGTERM
while both workers train takes them, and their DataLoader workers, with it; their run locks are free at once."""

from __future__ import annotations

import signal
import subprocess
import sys

import forked
import pytest
import yaml
from process_helpers import alive, children, one_line, wait_for

from attnlab.train.lock import LOCK, RunLockedError, check_unlocked

RUNS = ["vit_digits-digits-standard-s0", "vit_digits-digits-ns-s0"]


def _holders(run_dirs) -> list[int] | None:
    """The pids holding every run's lock, or None while one is not held yet."""
    pids = []
    for run in run_dirs:
        try:
            check_unlocked(run)
            return None
        except RunLockedError:
            pids.append(int((run / LOCK).read_text().split()[0]))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_grid_workers_end_with_their_parent(tmp_path, sig):
    grid = tmp_path / "grid.yaml"
    runs = tmp_path / "runs"
    grid.write_text(yaml.safe_dump({  # long enough never to finish here
        "variants": ["standard", "ns"], "seeds": [0], "runs_dir": str(runs), "jobs": 2,
        "base": {"recipe": "demo", "epochs": 500, "batch_size": 64, "num_workers": 1}}))
    parent = forked.popen([sys.executable, "-m", "attnlab", "compare", "--config", str(grid)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = wait_for(lambda: _holders([runs / r for r in RUNS]), "both workers to hold their runs", parent)
    assert set(workers) <= set(children(parent.pid)), (workers, children(parent.pid))
    loaders = [c for w in workers for c in children(w)]  # their DataLoader workers, when between batches
    parent.send_signal(sig)
    out, err = parent.communicate(timeout=120)
    if sig == signal.SIGTERM:
        assert parent.returncode == 143, err
        assert one_line(err) == "attnlab compare: terminated (SIGTERM)"
    # a guard against waiting forever, not a measurement: without the fix they trained on for minutes
    wait_for(lambda: not any(alive(p) for p in workers + loaders), "the workers to end", timeout=60)
    for run in RUNS:
        check_unlocked(runs / run)  # a rerun may take the runs over
