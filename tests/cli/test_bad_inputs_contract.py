"""Issue 26's and 27.8's contract breaks, as the bad-input table of test_bad_inputs.py runs them: each case is
`python -m attnlab ...` in a fresh directory, which must print one line on stderr, exit with 2, show no traceback
and leave the directory as it was (that file's helpers and check are reused here). Then the cases that are not a
refusal: a closed stdout, a batch that does not fit in memory, analyze over a folder compare wrote into, timm's
scheduler warning, and analysis.json behind a symlink."""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import struct
import subprocess
import sys
import zlib

import forked
import pytest
from PIL import Image
from test_bad_inputs import case, finished_run, run_case  # noqa: F401  (finished_run: the fixture)
from test_bad_inputs import test_bad_input_is_one_line_exit_2_nothing_made as check_case


def png(width=12, height=12) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height 1-bit pixels and holds almost none: a decompression bomb's header."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


FOLDER = {"f": None, "f/a": None, "f/l": None, "f/a/0.png": png(), "f/l/0.png": png()}
TWELVE = "\n".join("abcdefghijkl").encode() + b"\n"  # 12 names for vit_digits' 10 outputs; 'l' is index 11

CASES = [
    # ---- ranges (26.6): refused before anything is made
    case("train-seed-negative", "train --recipe demo --seed -3", "config key 'seed' is -3, but it must be an integer "
         "from 0 to 2**63 - 1"),
    case("train-lars-momentum", "train --recipe demo --optimizer lars --momentum 5",
         "config key 'momentum' is 5.0, but it must lie in [0, 1)"),
    case("train-warmup-longer", "train --recipe demo --epochs 2 --warmup-epochs 3",
         "config key 'warmup_epochs' is 3, longer than the 2 epochs of training; give --warmup-epochs at most 2"),
    case("train-min-lr-above-lr", "train --recipe demo --min-lr 0.1",
         "config key 'min_lr' is 0.1, above lr 0.005; the cosine decay ends at min_lr"),
    # ---- tracebacks before (26.8)
    case("train-swin-norm-none", "train --recipe demo --model swin_cifar --norm none",
         "norm='none' is available for ViT-family and sequence models, not 'swin_cifar'", slow=True),
    # ---- export must not destroy its run (26.3)
    case("export-out-own-checkpoint", "export {run} --out {run}/checkpoint.safetensors",
         "would replace the run's own checkpoint.safetensors; give a path outside"),
    case("export-out-own-file-dotdot", "export {run} --out {run}/../run/result.json",
         "would replace the run's own result.json", slow=True),
    case("export-out-own-name-not-yet-there", "export {run} --out {run}/checkpoint.prev.safetensors",
         "would replace the run's own checkpoint.prev.safetensors", slow=True),
    # ---- eval (26.4, 26.8, 27.8)
    case("eval-model-without-weights", "eval --model vit_digits", "--model vit_digits has no weights to evaluate; "
         "give --checkpoint FILE, --pretrained or --pretrained-file FILE (or --random-weights"),
    case("eval-random-and-checkpoint", "eval --model vit_digits --checkpoint w.pt --random-weights",
         "--random-weights evaluates a fresh initialisation; drop it, or drop --checkpoint"),
    case("eval-run-random-weights", "eval {run} --random-weights", "--random-weights goes with --model"),
    case("eval-classes-beyond-outputs", "eval {run} --folder f --classes c.txt",
         "--classes c.txt has 12 names, but the model has 10 outputs", files=FOLDER | {"c.txt": TWELVE}),
    case("eval-classes-twice", "eval {run} --folder f --classes c.txt", "--classes c.txt names 'a' twice (names 1 "
         "and 3)", files=FOLDER | {"c.txt": b"a\nl\na\n"}, slow=True),
    case("eval-folder-not-an-image", "eval {run} --folder f", "--folder file f/a/x.png is not a readable image",
         files=FOLDER | {"f/a/x.png": b"not an image at all"}),
    case("eval-ood-not-an-image", "eval {run} --ood o", "--ood file o/x/x.png is not a readable image",
         files={"o": None, "o/x": None, "o/x/x.png": b"\x89PNG\r\n\x1a\ntruncated"}, slow=True),
    case("eval-folder-bomb", "eval {run} --folder f", "--folder file f/l/big.png has 400,000,000 pixels, more than "
         "the 67,108,864", files=FOLDER | {"f/l/big.png": png_header(20000, 20000)}, slow=True),
    case("eval-folder-bomb-below-pil-limit", "eval {run} --folder f", "f/l/big.png has 9000 x 9000 pixels",
         files=FOLDER | {"f/l/big.png": png_header(9000, 9000)}, slow=True),
    case("eval-other-dataset-shape", "eval {run} --dataset synthetic", "--dataset synthetic has 3-channel 32 x 32 "
         "images in 10 classes, but the run's model (trained on digits) takes 1-channel 8 x 8 images", slow=True),
    case("eval-image-size-of-run", "eval {run} --folder f --image-size 32",
         "--image-size 32 does not fit the run's model, which takes 1-channel 8 x 8 images", files=FOLDER, slow=True),
    # ---- report and analyze
    case("report-bench-not-json", "report {tmp}/runs --bench b.json", "--bench b.json: b.json is not valid JSON",
         files={"b.json": b"{not json"}),
    case("report-bench-not-a-result", "report {tmp}/runs --bench b.json", "is not an attnlab bench --json result",
         files={"b.json": b'{"models": 1}'}, slow=True),
    case("analyze-what-all", "analyze --what all", "give run directories to analyse"),
    case("analyze-what-all-typo", "analyze {run} --what al", "unknown instrument 'al' in --what (did you mean 'all'?)"),
    case("analyze-nothing-is-a-run", "analyze {run}/result.json {tmp}/f", "result.json is not a run directory",
         files={"f": None}),
]


@pytest.mark.parametrize("argv,expected,files,damage", CASES)
def test_contract_case(argv, expected, files, damage, tmp_path, finished_run):  # noqa: F811
    check_case(argv, expected, files, damage, tmp_path, finished_run)


def attnlab(*argv, cwd, **kwargs):
    return forked.run([sys.executable, "-m", "attnlab", *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                      timeout=300, **kwargs)


def test_stdout_reader_gone_is_quiet(tmp_path):
    """`attnlab variants --json | head -1`: the reader leaves; no BrokenPipeError traceback, exit 141 as in
    `yes | head`."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "attnlab", "variants", "--json"], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == ""


def _vm_size_with_torch() -> int:
    code = ("import torch, timm, attnlab.cli.bench, attnlab.bench, attnlab.models\n"
            "print(open('/proc/self/status').read().split('VmSize:')[1].split()[0])")
    out = forked.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return int(out.stdout) * 1024


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only: the address-space limit of the test")
def test_bench_batch_out_of_memory_names_one_that_fits(tmp_path):
    """An address-space limit (ulimit -v) 3 GB above what torch maps makes the CPU allocator refuse a 100M-image
    batch at once, as a GPU refuses; the line names a batch that was run (halving, within the limit)."""
    limit = _vm_size_with_torch() + (3 << 30)
    proc = attnlab("bench", "--model", "vit_digits", "--attn", "standard", "--batch-size", 100_000_000, "--warmup",
                   0, "--iters", 1, "--rounds", 1, "--device", "cpu", cwd=tmp_path,
                   rlimits={"RLIMIT_AS": (limit, resource.RLIM_INFINITY)})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("attnlab bench: error: batch 100000000 does not fit in memory on cpu "
                               "(an allocation of 25,600,000,000 bytes failed); batch "), lines[0]
    fits = int(lines[0].rsplit("--batch-size ", 1)[1].rstrip("."))
    assert any(100_000_000 >> k == fits for k in range(1, 40))  # a halving of the batch asked for
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_analyze_passes_over_report_files_and_never_writes_through_a_link(tmp_path, finished_run):  # noqa: F811
    """`analyze runs/demo/* --what curves` right after compare (its report files lie beside the runs), and an
    analysis.json that is a symlink to a file outside: replaced, its target unchanged."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(finished_run, runs / "run")
    for name in ("report.md", "report.json", "report_vit_digits_digits.png"):
        (runs / name).write_text("written by compare\n")
    outside = tmp_path / "outside.json"
    outside.write_text("precious\n")
    os.symlink(outside, runs / "run" / "analysis.json")
    proc = attnlab("analyze", *sorted(runs.iterdir()), "--what", "curves", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ("attnlab analyze: passed over 3 entries that are not a run directory (no config.yaml): report.json, "
            "report.md, report_vit_digits_digits.png") in proc.stderr
    assert outside.read_text() == "precious\n"
    analysis = runs / "run" / "analysis.json"
    assert not analysis.is_symlink() and "curves" in json.loads(analysis.read_text())


def test_one_step_of_cosine_is_no_warning(caplog):
    """A 1-epoch run whose warm-up fills it leaves one cosine step: timm warns that the schedule "will have no
    effect", which is what attnlab means there; the warning is dropped for attnlab's scheduler only."""
    import torch
    from timm.scheduler import CosineLRScheduler

    from attnlab.train.optim import build_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    with caplog.at_level(logging.WARNING):
        build_scheduler(opt, total_steps=5, warmup_steps=5, warmup_lr=0.0, min_lr=0.0)
    assert "no effect" not in caplog.text
    with caplog.at_level(logging.WARNING):
        CosineLRScheduler(opt, t_initial=1)  # timm's own warning still reaches whoever builds one directly
    assert "will have no effect" in caplog.text
