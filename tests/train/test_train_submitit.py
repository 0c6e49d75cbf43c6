"""--launcher submitit: one job per run through submitit, tested with submitit's local executor (the
'submitit-local' launcher): the same run directories, results and report as one run after another; a grid with a
bad run, a missing submitit or a missing sbatch submits nothing."""

import importlib.util

import pytest
import torch
from train_helpers import tiny, weights

from attnlab.errors import AttnlabError, SpecError
from attnlab.report import write_report
from attnlab.train import launch, run_grid

pytest.importorskip("submitit")


@pytest.mark.slow
def test_submitit_local_grid_same_report_as_jobs_1(tmp_path):
    args = (["standard", "ns"], [0], None, None)
    seq = run_grid(tiny(tmp_path / "seq", epochs=1), *args, tmp_path / "seq", progress=False, jobs=1)
    sub = run_grid(tiny(tmp_path / "sub", epochs=1), *args, tmp_path / "sub", progress=False,
                   launcher="submitit-local")
    assert (tmp_path / "sub" / ".submitit").is_dir()  # the jobs' logs, beside the runs
    assert [r["name"] for r in sub] == [r["name"] for r in seq]
    for a, b in zip(seq, sub):
        assert a["top1"] == b["top1"]
        wa = weights(tmp_path / "seq" / a["name"] / "checkpoint.safetensors")
        wb = weights(tmp_path / "sub" / b["name"] / "checkpoint.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    report_seq = write_report(tmp_path / "seq", plots=False)
    report_sub = write_report(tmp_path / "sub", plots=False)
    assert report_sub["markdown"] == report_seq["markdown"]
    assert "standard" in report_sub["markdown"] and "ns" in report_sub["markdown"]
    # a second call finds every run finished and submits nothing
    again = run_grid(tiny(tmp_path / "sub", epochs=1), *args, tmp_path / "sub", progress=False,
                     launcher="submitit-local")
    assert again == sub


def test_bad_grid_submits_nothing(tmp_path):
    with pytest.raises(SpecError):
        run_grid(tiny(tmp_path, epochs=1), ["standard", "ns(steps=-1)"], [0], None, None, tmp_path,
                 progress=False, launcher="submitit-local")
    assert not (tmp_path / ".submitit").exists()


def test_without_submitit_one_line_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "submitit" else real(name, *a))
    with pytest.raises(AttnlabError, match=r"pip install attnlab\[cluster\]") as info:
        run_grid(tiny(tmp_path, epochs=1), ["standard"], [0], None, None, tmp_path, progress=False,
                 launcher="submitit-local")
    assert "\n" not in str(info.value)
    assert not (tmp_path / ".submitit").exists()


def test_slurm_without_sbatch_and_bad_options(tmp_path, monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)
    with pytest.raises(AttnlabError, match="sbatch is not on PATH"):
        launch.check_launcher("submitit", {"partition": "gpu"})
    with pytest.raises(AttnlabError, match="unknown launcher option 'gpus'"):
        launch.check_launcher("submitit-local", {"gpus": 1})
    with pytest.raises(AttnlabError, match="time is -5"):
        launch.check_launcher("submitit-local", {"time": -5})
    with pytest.raises(AttnlabError, match="apply to --launcher submitit"):
        launch.check_launcher("local", {"partition": "gpu"})


def test_launcher_block_in_grid_file_and_flags_over_it(tmp_path):
    from attnlab.train import load_grid

    path = tmp_path / "grid.yaml"
    path.write_text("variants: [standard]\nlauncher: {name: submitit-local, time: 30, gpus_per_node: 0}\n"
                    "base: {recipe: demo}\n")
    grid = load_grid(path)
    assert grid["launcher"] == "submitit-local"
    assert grid["launcher_options"] == {"time": 30, "gpus_per_node": 0}
    grid = load_grid(path, launcher_options={"time": 90, "partition": None})
    assert grid["launcher_options"] == {"time": 90, "gpus_per_node": 0}
    assert load_grid(None, "demo")["launcher"] == "local"
    path.write_text("launchr: submitit\n")
    with pytest.raises(AttnlabError, match="did you mean 'launcher'"):
        load_grid(path)
    path.write_text("launcher: [submitit]\n")
    with pytest.raises(AttnlabError, match="launcher name or a mapping"):
        load_grid(path)
