"""Files that carry code never run it: each file attnlab reads, crafted to execute a payload, is refused.

Every payload would create a marker file when unpickled or constructed; each case runs attnlab as a real process and
checks one line on stderr, exit code 2, and that the marker does not exist afterwards.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
import torch

from attnlab.errors import ConfigError
from tests.cli_runner import in_process

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from test_data_cifar import write_cifar10  # noqa: E402  (the benign generated archive)


class Payload:
    """Unpickling this calls ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def hostile_pickle(marker: Path, protocol: int = 2, wrap=lambda p: p) -> bytes:
    return pickle.dumps(wrap(Payload(marker)), protocol=protocol)


def attnlab(*argv, cwd=None, process=False) -> subprocess.CompletedProcess:
    """The command in this process (tests/cli_runner.py), or with ``process`` in a process of its own
    (tests/forked.py)."""
    if not process:
        return in_process(list(argv), cwd)
    return forked.run([sys.executable, "-m", "attnlab", *map(str, argv)], capture_output=True, text=True,
                      timeout=300, cwd=cwd)


def assert_refused(proc: subprocess.CompletedProcess, marker: Path, *fragments: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not marker.exists(), "the payload ran"


def test_the_payload_runs_under_plain_pickle(tmp_path):
    """The test's own check: an ordinary pickle.load of the payload does create the marker."""
    marker = tmp_path / "marker"
    pickle.loads(hostile_pickle(marker))
    assert marker.exists()


# ------------------------------------------------------------------------------------------------- CIFAR files
CIFAR_CASES = {
    # the whole batch file is the payload
    "batch": ("data_batch_3", lambda m: hostile_pickle(m)),
    # a payload nested inside an otherwise well-formed batch (protocol 4: STACK_GLOBAL)
    "nested": ("test_batch", lambda m: pickle.dumps({"data": np.zeros((1, 3072), np.uint8),
                                                     "labels": [Payload(m)]}, protocol=4)),
    # an object array whose elements are payloads: numpy's own constructors, a dtype other than uint8
    "object-array": ("data_batch_1", lambda m: pickle.dumps({"data": np.array([Payload(m)], dtype=object),
                                                             "labels": [0]}, protocol=2)),
    "meta": ("batches.meta", lambda m: hostile_pickle(m, protocol=5, wrap=lambda p: {"label_names": [p]})),
}


@pytest.mark.parametrize("case", list(CIFAR_CASES))
def test_hostile_cifar_file_is_refused_by_the_loader(tmp_path, case):
    from attnlab.data import build_dataset
    from attnlab.errors import DatasetError

    name, make = CIFAR_CASES[case]
    marker = tmp_path / "marker"
    folder = write_cifar10(tmp_path)
    (folder / name).write_bytes(make(marker))
    splits = {"data_batch_1": [True], "data_batch_3": [True], "test_batch": [False]}.get(name, [True, False])
    for train in splits:
        with pytest.raises(DatasetError, match="refused") as err:
            build_dataset("cifar10", train, data_dir=tmp_path, verify_md5=False)
        assert name in str(err.value) and "nothing in it was run" in str(err.value)
    assert not marker.exists(), "the payload ran"


@pytest.mark.slow
def test_hostile_cifar_file_is_refused_whatever_the_md5_setting(tmp_path):
    """As a real process: one line, exit 2, with md5 checking off (the unpickler refuses) and on (md5 refuses)."""
    marker = tmp_path / "marker"
    folder = write_cifar10(tmp_path / "data")
    (folder / "data_batch_3").write_bytes(hostile_pickle(marker))
    common = ["train", "--model", "vit_digits", "--dataset", "cifar10", "--data-dir", tmp_path / "data",
              "--epochs", "1", "--warmup-epochs", "0", "--runs-dir", tmp_path / "runs"]
    assert_refused(attnlab(*common, "--data-options", "{verify_md5: false}", process=True), marker, "data_batch_3",
                   "refused", "nothing in it was run")
    assert_refused(attnlab(*common, process=True), marker, "md5", "verify_md5: false")  # the default checks md5 first


def test_cifar_unpickler_refuses_every_global_outside_the_format(tmp_path):
    from attnlab.data.cifar import CifarUnpickler, RefusedPickle

    marker = tmp_path / "marker"
    for blob in (hostile_pickle(marker, p) for p in (0, 2, 4, 5)):
        with pytest.raises(RefusedPickle, match="posix.system|os.system"):
            CifarUnpickler(io.BytesIO(blob), encoding="latin1").load()
    for obj in (np.arange(3, dtype=np.int64), np.array(["a"], dtype=object), np.float32(1.0), {1, 2}):
        with pytest.raises(RefusedPickle):
            CifarUnpickler(io.BytesIO(pickle.dumps({"data": obj}, protocol=2)), encoding="latin1").load()
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_cifar_unpickler_reads_the_format_at_every_protocol(protocol):
    from attnlab.data.cifar import CifarUnpickler

    entry = {"batch_label": "training batch 1 of 5", "data": np.arange(2 * 3072).astype(np.uint8).reshape(2, 3072),
             "labels": [3, 7], "filenames": ["a.png", "b.png"], "raw": b"\x00\xff", "n": 2, "x": 0.5}
    out = CifarUnpickler(io.BytesIO(pickle.dumps(entry, protocol=protocol)), encoding="latin1").load()
    assert out.keys() == entry.keys()
    assert out["data"].dtype == np.uint8 and np.array_equal(out["data"], entry["data"])
    assert {k: v for k, v in out.items() if k != "data"} == {k: v for k, v in entry.items() if k != "data"}


def test_cifar_unpickler_reads_python2_numpy1_pickles():
    """The official files were written by Python 2 and numpy 1: ``numpy.core.multiarray`` and byte strings."""
    from attnlab.data.cifar import CifarUnpickler

    data = np.arange(3072, dtype=np.uint8).reshape(1, 3072)
    blob = pickle.dumps({"data": data, "labels": [1]}, protocol=2)
    blob = blob.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    assert b"numpy.core.multiarray" in blob
    out = CifarUnpickler(io.BytesIO(blob), encoding="latin1").load()
    assert np.array_equal(out["data"], data) and out["labels"] == [1]


# ------------------------------------------------------------------------------------------ run directories
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One finished one-epoch digits run, trained in this process."""
    from attnlab.train import RECIPES, train

    runs = tmp_path_factory.mktemp("runs")
    cfg = RECIPES["demo"].replace(epochs=1, batch_size=256, runs_dir=str(runs), progress=False)
    return runs / train(cfg)["name"]


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    run = tmp_path / "runs" / trained_run.name
    shutil.copytree(trained_run, run)
    return run


def test_hostile_config_yaml_is_refused(run_copy, tmp_path):
    marker = tmp_path / "marker"
    text = f'!!python/object/apply:os.system ["touch {marker}"]\n'
    (run_copy / "config.yaml").write_text(text)
    assert_refused(attnlab("train", "--resume", run_copy), marker, "config.yaml")
    (tmp_path / "grid.yaml").write_text(text)
    assert_refused(attnlab("compare", "--config", tmp_path / "grid.yaml"), marker, "grid.yaml")


def _restarted(proc: subprocess.CompletedProcess, marker: Path, name: str) -> None:
    """`train --resume` of a run whose only checkpoint is hostile: started afresh, saying why, the payload unrun."""
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "no intact checkpoint" in line]
    assert len(notes) == 1 and name in notes[0] and "starting the run afresh" in notes[0], proc.stderr
    assert not marker.exists(), "the payload ran"


def test_hostile_checkpoint_is_refused(run_copy, tmp_path):
    marker = tmp_path / "marker"
    (run_copy / "checkpoint.safetensors").write_bytes(hostile_pickle(marker))
    (run_copy / "result.json").unlink()
    assert_refused(attnlab("export", run_copy, "--out", tmp_path / "w.safetensors"), marker, "checkpoint")
    assert not (tmp_path / "w.safetensors").exists()
    _restarted(attnlab("train", "--resume", run_copy), marker, "checkpoint.safetensors")


def test_hostile_trainer_state_is_refused(run_copy, tmp_path):
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"epoch": 1, "optimizer": Payload(marker)}, buf)  # torch's own zip format, a code payload inside
    (run_copy / "trainer_state.pt").write_bytes(buf.getvalue())
    (run_copy / "result.json").unlink()
    _restarted(attnlab("train", "--resume", run_copy), marker, "trainer_state.pt")


def test_readers_never_read_the_trainer_state(run_copy, tmp_path):
    """eval, export and analyze read the weights alone: a trainer state they would choke on (a payload here, a
    zip bomb elsewhere) is never opened."""
    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save({"epoch": 1, "optimizer": Payload(marker)}, buf)
    (run_copy / "trainer_state.pt").write_bytes(buf.getvalue())
    proc = attnlab("export", run_copy, "--out", tmp_path / "w.safetensors")
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    assert (tmp_path / "w.safetensors").exists() and not marker.exists()


def bomb(*keys: str) -> str:
    """YAML whose ``keys`` (nested) hold nine levels of ten aliases each: 10^9 values once expanded."""
    pad = "  " * len(keys)
    head = "".join(f"{'  ' * depth}{key}:\n" for depth, key in enumerate(keys))
    levels = "".join(f"{pad}{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    return f"{head}{pad}a: &a [x, x, x, x, x, x, x, x, x, x]\n{levels}"


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """1 KB that nested aliases expand to 10^9 values ("billion laughs"): refused before anything expands it."""
    marker = tmp_path / "marker"  # no payload: the refusal is what is checked
    (tmp_path / "bomb.yaml").write_text(bomb("model_options") + "epochs: 1\n")
    assert (tmp_path / "bomb.yaml").stat().st_size < 1024
    assert_refused(attnlab("train", "--config", tmp_path / "bomb.yaml", "--runs-dir", tmp_path / "runs"), marker,
                   "bomb.yaml", "aliases expand it to more than")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_yaml_alias_bomb_grid_is_refused_at_once(tmp_path):
    (tmp_path / "bomb.yaml").write_text(bomb("base", "model_options") + "seeds: [0]\n")
    assert_refused(attnlab("compare", "--config", tmp_path / "bomb.yaml"), tmp_path / "marker", "grid file",
                   "bomb.yaml", "aliases expand it to more than")


def _many_tensors(path: Path, n: int) -> None:
    """A safetensors file of ``n`` one-byte tensors, written header first (safetensors itself would take minutes)."""
    header = "{" + ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(n)) + "}"
    header += " " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(n))


@pytest.mark.slow
def test_safetensors_with_too_many_entries_is_refused_from_its_header(tmp_path):
    big = tmp_path / "big.safetensors"
    _many_tensors(big, 300_000)  # a 20 MB header
    marker = tmp_path / "marker"
    assert_refused(attnlab("eval", "--model", "vit_digits", "--checkpoint", big, cwd=tmp_path), marker,
                   "big.safetensors", "header")
    assert_refused(attnlab("train", "--recipe", "demo", "--pretrained-file", big, "--runs-dir", tmp_path / "runs",
                           cwd=tmp_path), marker, "big.safetensors", "header")


def test_safetensors_of_another_model_is_refused_from_its_header(tmp_path):
    from attnlab.models import build_model
    from attnlab.models.pretrained import read_state_dict

    small = tmp_path / "small.safetensors"
    _many_tensors(small, 3)
    model = build_model("vit_digits", num_classes=10)
    with pytest.raises(ConfigError, match="small.safetensors lacks '"):
        read_state_dict(small, model)
    assert set(read_state_dict(small)) == {"t0", "t1", "t2"}


def test_hostile_result_json_is_refused(run_copy, tmp_path):
    marker = tmp_path / "marker"
    (run_copy / "result.json").write_bytes(hostile_pickle(marker))
    assert_refused(attnlab("train", "--resume", run_copy), marker, "result.json")
    report = attnlab("report", run_copy.parent)  # lists the run as unreadable instead of loading it
    assert run_copy.name in report.stdout + report.stderr and "Traceback" not in report.stderr, report.stderr
    assert not marker.exists()


def test_hostile_metrics_file_is_never_unpickled(run_copy, tmp_path):
    """metrics.jsonl is written, never read back: a resumed run rewrites it from the checkpoint's history."""
    marker = tmp_path / "marker"
    (run_copy / "metrics.jsonl").write_bytes(hostile_pickle(marker))
    (run_copy / "result.json").unlink()
    proc = attnlab("train", "--resume", run_copy)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert (run_copy / "metrics.jsonl").read_text().startswith("{")


# ------------------------------------------------------------- pretrained and checkpoint files (issue 14 items 4, 5)
@pytest.mark.parametrize("fmt", ["raw-pickle", "torch-zip", "safetensors-name"])
def test_hostile_pretrained_file_is_refused(tmp_path, fmt):
    """--pretrained-file and eval --checkpoint read safetensors or torch.load(weights_only=True): a pickle payload,
    bare, inside torch's zip format, or under a .safetensors name, never runs."""
    marker = tmp_path / "marker"
    name = "w.safetensors" if fmt == "safetensors-name" else "w.pt"
    if fmt == "torch-zip":
        buf = io.BytesIO()
        torch.save({"state_dict": {"w": Payload(marker)}}, buf)
        (tmp_path / name).write_bytes(buf.getvalue())
    else:
        (tmp_path / name).write_bytes(hostile_pickle(marker))
    assert_refused(attnlab("eval", "--model", "vit_digits", "--checkpoint", tmp_path / name, cwd=tmp_path), marker,
                   name)
    assert_refused(attnlab("train", "--recipe", "demo", "--pretrained-file", tmp_path / name, "--runs-dir",
                           tmp_path / "runs", cwd=tmp_path), marker, name)
    assert not (tmp_path / "runs").exists()
