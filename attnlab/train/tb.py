"""``--log tensorboard``: each epoch's metrics line as TensorBoard scalars, in ``<run_dir>/tensorboard/``
(docs/training.md, "TensorBoard"). ``metrics.jsonl`` stays the source of truth; every scalar is plotted against
the optimizer step, so that epoch scalars and ``--probe-every`` values share one axis.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from attnlab.errors import ConfigError

from .files import TB_DIR as LOG_DIR

# metrics.jsonl key -> TensorBoard tag
EPOCH_SCALARS = {"train_loss": "train/loss", "train_acc": "train/top1", "test_loss": "test/loss", "top1": "test/top1",
                 "top5": "test/top5", "lr": "train/lr", "img_per_s": "train/img_per_s"}


def require(log: str) -> None:
    """ConfigError, before any training, when ``log`` asks for a writer whose package is missing."""
    if log == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--log tensorboard needs the tensorboard package, which is not installed; run "
                          "`pip install attnlab[tensorboard]` or drop --log.")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class TensorBoardLog:
    """Writes metrics records (the dicts of ``metrics.jsonl``) as scalars. ``start_step``: when a run resumes
    after that many optimizer steps, events past it that an earlier attempt wrote are hidden (TensorBoard's
    ``purge_step``), so the curves show each step once."""

    def __init__(self, run_dir: str | Path, start_step: int = 0):
        require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        kwargs = {"purge_step": start_step + 1} if start_step > 0 else {}
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / LOG_DIR), **kwargs)

    def epoch(self, record: dict[str, Any], step: int) -> None:
        """One epoch's record: the scalars of ``EPOCH_SCALARS``, hook statistics (any other number) under
        ``train/``, and each probe's numbers under ``probe/`` at its own step."""
        for key, value in record.items():
            if key not in ("epoch", "epoch_seconds") and (number := _number(value)) is not None:
                self.writer.add_scalar(EPOCH_SCALARS.get(key, f"train/{key}"), number, step)
        for probe in record.get("probes", ()):
            for key, value in probe.items():
                if key != "step" and (number := _number(value)) is not None:
                    self.writer.add_scalar(f"probe/{key}", number, int(probe["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
