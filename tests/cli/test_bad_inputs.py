"""One error contract, everywhere: every command, given a bad input, prints one line on stderr that names the input
and says what would be right, exits with 2, shows no traceback, and leaves nothing behind.

Each case runs in a fresh directory (its working directory, so that default paths such as runs/ land there too)
and compares a listing of that directory before and after. A case runs `attnlab.cli.main` in this process
(tests/cli_runner.py: a fresh interpreter would spend seconds importing torch per case);
`test_in_process_reads_as_a_real_process` checks that `python -m attnlab ...` as a real process prints and exits
alike. Cases marked slow build models or read data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import forked
import pytest

from attnlab.cli import COMMANDS
from tests.cli_runner import in_process

# damage applied to a copy of the finished run's file before the command runs
DAMAGE = {
    "truncate": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "garbage": lambda p: p.write_bytes(b"\x00\xff\x13garbage\x80" * 64),
    "directory": lambda p: (p.unlink(), p.mkdir()),
    # config.yaml describing another model than the checkpoint holds (an edited or swapped config)
    "other_model": lambda p: p.write_text(p.read_text().replace("model_options: {}", "model_options:\n  depth: 1")),
}
RUN = "{run}"  # placeholder for the copy of a finished 1-epoch vit_digits run (config, checkpoint, result)


def case(id_, argv, expected, files=None, damage=None, slow=False):
    """argv: words (or a list), with {run} (the copy of a finished run, which lies under {tmp}) and {tmp} (the case's
    directory, also its working directory); files: {relative path: bytes or
    None for a directory} made before; damage: {file in the run: DAMAGE key}; slow: the case builds a model or
    reads data."""
    argv = argv.split() if isinstance(argv, str) else argv
    return pytest.param(argv, expected, files or {}, damage or {}, id=id_,
                        marks=[pytest.mark.slow] if slow else [])


YAML_LIST = {"c.yaml": b"- epochs\n- 3\n"}
CASES = [
    # ---- argument parsing (all commands): one line, the nearest flag or choice, no abbreviations
    case("no-command", "", "the following arguments are required: COMMAND"),
    case("command-typo", "trian", "invalid choice 'trian' (did you mean 'train'?)"),
    case("top-flag-typo", "--versoin", "unknown option --versoin (did you mean '--version'?)"),
    case("train-abbrev", "train --epoch 3", "unknown option --epoch (did you mean '--epochs'?)"),
    case("train-unknown-flag", "train --learning-rate 0.1", "unknown option --learning-rate"),
    case("compare-abbrev", "compare --no-rep", "unknown option --no-rep (did you mean '--no-report'?)"),
    case("report-abbrev", "report runs --base standard", "unknown option --base (did you mean '--baseline'?)"),
    case("analyze-abbrev", "analyze {run} --wha spectra", "unknown option --wha (did you mean '--what'?)"),
    case("bench-abbrev", "bench --iter 3", "unknown option --iter (did you mean '--iters'?)"),
    case("variants-abbrev", "variants --jsn", "unknown option --jsn (did you mean '--json'?)"),
    case("export-abbrev", "export {run} --ou x.safetensors", "unknown option --ou (did you mean '--out'?)"),
    case("export-extra-arg", "export {run} other", "unexpected argument 'other'"),
    case("export-no-run", "export", "the following arguments are required: RUN_DIR"),
    case("compare-preset-choice", "compare --preset dem", "invalid choice 'dem' (did you mean 'demo'?)"),
    case("bench-dtype-choice", "bench --dtype fp64", "argument --dtype: invalid choice 'fp64'"),
    # ---- wrong type / out of range, flags and config keys
    case("train-epochs-type", "train --epochs x", "argument --epochs: got 'x', but it must be an integer"),
    case("train-lr-type", "train --lr fast", "argument --lr: got 'fast', but it must be a finite number"),
    case("train-lr-nan", "train --lr nan", "argument --lr: got 'nan', but it must be a finite number"),
    case("train-bool-type", "train --compile=maybe", "ignored explicit argument 'maybe'"),
    case("train-epochs-range", "train --recipe demo --epochs 0", "config key 'epochs' is 0, but it must be at least 1"),
    case("train-smoothing-range", "train --label-smoothing 1.5", "'label_smoothing' is 1.5, but it must lie in [0, 1]"),
    case("train-drop-path-range", "train --drop-path 2", "'drop_path' is 2.0, but it must lie in [0, 1]"),
    case("train-clip-range", "train --clip-grad 0", "'clip_grad' is 0.0, but it must be positive"),
    case("train-amp-choice", "train --amp fp16", "'amp' is 'fp16', but it must be one of auto, bf16, none"),
    case("train-recipe-typo", "train --recipe dmeo", "unknown recipe 'dmeo' (did you mean 'demo'?)"),
    case("train-options-yaml", "train --model-options {depth:2}", "YAML needs a space after the colon"),
    case("train-options-type", "train --model-options [2]", "argument --model-options: got [2], but it must be a mapping"),
    case("compare-jobs-range", "compare --jobs 0", "argument --jobs: got 0, but it must be at least 1"),
    case("compare-seeds-type", "compare --preset demo --seeds a,b",
         "seeds must be non-negative integers such as 0,1,3", slow=True),
    case("compare-epochs-type", "compare --epochs many", "argument --epochs: got 'many', but it must be an integer"),
    case("analyze-images-range", "analyze {run} --images 0", "argument --images: got 0, but it must be at least 1"),
    case("analyze-batch-type", "analyze {run} --batch-size x", "argument --batch-size: got 'x', but it must be an"),
    case("analyze-what-typo", "analyze {run} --what spectr", "unknown instrument 'spectr' in --what (did you mean"),
    case("analyze-no-target", "analyze --what spectra", "give run directories to analyse"),
    case("bench-batch-range", "bench --batch-size 0", "argument --batch-size: got 0, but it must be at least 1"),
    case("bench-warmup-range", "bench --warmup -1", "argument --warmup: got -1, but it must be at least 0"),
    case("bench-no-variant", "bench --attn ,", "--attn names no variant"),
    # ---- config files (train --config, compare --config): missing, directory, empty, garbage, wrong content
    case("config-missing", "train --config nope.yaml", "config file nope.yaml does not exist"),
    case("config-directory", "train --config {tmp}", "is a directory; give the path of a YAML file"),
    case("config-empty", "train --config c.yaml", "config file c.yaml is empty", files={"c.yaml": b""}),
    case("config-garbage", "train --config c.yaml", "c.yaml is not a text file", files={"c.yaml": b"\xff\xfe\x00"}),
    case("config-bad-yaml", "train --config c.yaml", "c.yaml is not valid YAML", files={"c.yaml": b"epochs: [1,\n"}),
    case("config-list", "train --config c.yaml", "must hold a mapping of config keys", files=YAML_LIST),
    case("config-key-typo", "train --config c.yaml", "unknown config key 'epoch' (did you mean 'epochs'?)",
         files={"c.yaml": b"epoch: 3\n"}),
    case("config-value-type", "train --config c.yaml", "config key 'epochs' got 'ten', but it must be an integer",
         files={"c.yaml": b"epochs: ten\n"}),
    case("config-key-type", "train --config c.yaml", "has the key 1", files={"c.yaml": b"1: 2\n"}),
    case("grid-missing", "compare --config nope.yaml", "grid file nope.yaml does not exist", slow=True),
    case("grid-directory", "compare --config {tmp}", "is a directory; give the path of a YAML file", slow=True),
    case("grid-garbage", "compare --config g.yaml", "g.yaml is not a text file", files={"g.yaml": b"\xff\xfe\x00"}, slow=True),
    case("grid-key-typo", "compare --config g.yaml", "unknown key 'variant' in grid file g.yaml (did you mean "
         "'variants'?)", files={"g.yaml": b"variant: [ns]\n"}, slow=True),
    case("grid-jobs-type", "compare --config g.yaml", "jobs in grid file g.yaml is 'two', but it must be an integer",
         files={"g.yaml": b"jobs: two\n"}, slow=True),
    case("grid-variants-type", "compare --config g.yaml", "variants in grid file g.yaml is 5, but it must be a list",
         files={"g.yaml": b"variants: 5\n"}, slow=True),
    # ---- run directories and the files in them (train --resume, export, analyze, report)
    case("resume-not-a-run", "train --resume {tmp}", "no config.yaml there"),
    case("resume-and-config", "train --resume {run} --config c.yaml", "drop --config", files={"c.yaml": b"seed: 1\n"}),
    case("resume-config-empty", "train --resume {run}", "config.yaml is empty", damage={"config.yaml": "empty"}),
    case("resume-config-garbage", "train --resume {run}", "config.yaml is not a text file",
         damage={"config.yaml": "garbage"}),
    # a run whose only checkpoint is damaged is no mistake: `train --resume` starts it afresh, saying why
    # (tests/train/test_train_faults.py, tests/security/test_hostile_files.py)
    case("export-not-a-run", "export {tmp}", "is not a run directory"),
    case("export-checkpoint-truncated", "export {run}", "checkpoint.safetensors",
         damage={"checkpoint.safetensors": "truncate"}),
    case("export-checkpoint-empty", "export {run}", "checkpoint.safetensors",
         damage={"checkpoint.safetensors": "empty"}, slow=True),
    case("export-checkpoint-directory", "export {run}", "checkpoint.safetensors",
         damage={"checkpoint.safetensors": "directory"}, slow=True),
    case("export-config-garbage", "export {run}", "config.yaml is not a text file", damage={"config.yaml": "garbage"},
         slow=True),
    case("analyze-not-a-run", "analyze {tmp} --out {tmp}/a", "is not a run directory"),
    case("analyze-checkpoint-truncated", "analyze {run}", "checkpoint.safetensors",
         damage={"checkpoint.safetensors": "truncate"}, slow=True),
    case("report-missing", "report nope", "runs directory 'nope' does not exist"),
    case("report-file", "report {run}/result.json", "result.json is a file; give the folder"),
    case("report-result-garbage", "report {tmp}", "result.json", damage={"result.json": "garbage"}),
    case("report-result-truncated", "report {tmp}", "result.json", damage={"result.json": "truncate"}),
    case("report-result-empty", "report {tmp}", "result.json", damage={"result.json": "empty"}),
    case("report-baseline-typo", "report {tmp} --baseline standrd", "--baseline 'standrd' is no run's variant (did "
         "you mean 'standard'?)"),
    # ---- output paths: a file where a directory goes and the reverse, under a file
    case("train-runs-dir-file", "train --runs-dir f", "runs_dir f is a file; give a directory", files={"f": b"x"}),
    case("train-runs-dir-under-file", "train --runs-dir f/runs", "lies under the file", files={"f": b"x"}),
    case("report-out-file", "report {tmp} --out f", "--out f is a file; give a directory", files={"f": b"x"}),
    case("analyze-out-file", "analyze {run} --out f", "--out f is a file; give a directory", files={"f": b"x"}),
    case("export-out-directory", "export {run} --out d", "--out d is a directory; give a file path", files={"d": None}),
    case("export-out-under-file", "export {run} --out f/x.safetensors", "x.safetensors lies under the file", files={"f": b"x"}),
    case("bench-json-directory", "bench --json d", "--json d is a directory; give a file path", files={"d": None}),
    # ---- names and specs resolved by the library (these import torch)
    case("train-model-options-typo", ["train", "--recipe", "demo", "--model-options", "{dpth: 2}"],
         "model option 'dpth' is not an argument of vit_digits (did you mean 'depth'?)"),
    case("train-model-typo", "train --recipe demo --model vit_digit", "unknown model 'vit_digit'", slow=True),
    case("train-missing-cifar", "train --recipe demo --dataset cifar10 --data-dir {tmp}/none", "--download",
         slow=True),
    case("train-device", "train --recipe demo --device cuda:99", "cuda:99", slow=True),
    case("compare-analyze-typo", "compare --preset demo --analyze spectr", "unknown instrument 'spectr'"),
    case("compare-bad-spec", "compare --preset demo --attn standard,bogus", "unknown attention variant 'bogus'"),
    case("bench-model-typo", "bench --model vit_digit", "unknown model 'vit_digit'", slow=True),
    case("variants-cost-model", "variants --cost nomodel", "unknown model 'nomodel'", slow=True),
    # ---- variants --support (issue 14 item 1)
    case("variants-support-model", "variants --support nomodel", "unknown model 'nomodel'", slow=True),
    case("variants-support-no-attention", "variants --support resnet18",
         "ResNet has no attention module attnlab can replace", slow=True),
    # ---- eval, --pretrained, --pretrained-file, --checkpoint (issue 14 items 4 and 5)
    case("eval-nothing", "eval", "give a run directory, or --model"),
    case("eval-not-a-run", "eval {tmp}", "is not a run directory"),
    case("eval-run-and-checkpoint", "eval {run} --checkpoint w.pt", "--checkpoint goes with --model"),
    case("eval-ood-missing", "eval {run} --ood o", "--ood o is not a directory"),
    case("eval-dna-layout-without-checkpoint", "eval --model vit_digits --dna-layout legacy", "give --checkpoint"),
    case("eval-dna-layout-typo", "eval --model vit_digits --checkpoint w.pt --dna-layout legasy",
         "invalid choice 'legasy' (did you mean 'legacy'?)"),
    case("eval-folder-missing", "eval {run} --folder nope", "--folder nope is not a directory"),
    case("eval-checkpoint-missing", "eval --model vit_digits --checkpoint nope.pt", "nope.pt does not exist",
         slow=True),
    case("eval-checkpoint-garbage", "eval --model vit_digits --checkpoint w.pt",
         "cannot be read as safetensors or a weights-only torch file", files={"w.pt": b"\x00garbage" * 40}),
    case("eval-checkpoint-other-model", "eval --model vit_digits --attn dna --checkpoint {run}/checkpoint.safetensors",
         "lacks 'blocks.0.attn.alpha'", slow=True),
    case("eval-pretrained-unknown-model", "eval --model nomodel --pretrained", "--pretrained needs a timm model name",
         slow=True),
    case("train-pretrained-file-garbage", "train --recipe demo --pretrained-file w.safetensors",
         "cannot be read as safetensors", files={"w.safetensors": b"garbage" * 40}, slow=True),
    case("train-pretrained-preset", "train --recipe demo --pretrained", "vit_digits has no published weights",
         slow=True),
    # ---- low-rank kernels, ListOps and the LRA text task (issue 14 items 2 and 3)
    case("train-listops-image-recipe", "train --dataset listops --model seq_listops",
         "dataset listops (LRA ListOps, generated locally once) cannot take image augmentation and Mixup/CutMix; use "
         "--recipe lra_listops"),
    case("train-norm-choice", "train --recipe lra_listops --norm nope", "must be one of pre, post, none"),
    case("train-nystrom-even-conv", ["train", "--recipe", "demo", "--attn", "nystrom(conv=4)"],
         "nystrom(conv=4) is not valid; conv is an odd kernel length", slow=True),
    case("train-performer-swin", "train --recipe demo --model swin_cifar --attn performer",
         "Swin's window attention and ViTDet's relative positions add one", slow=True),
    case("train-listops-options", ["train", "--recipe", "lra_listops", "--data-options", "{max_args: 1}"],
         "dataset option max_args=1 for listops must be at least 2", slow=True),
    case("train-listops-bad-file", "train --recipe lra_listops --data-dir {tmp}",
         "line 2 cannot be read: unknown ListOps token '[FIRST'",
         files={"listops": None} | {f"listops/basic_{s}.tsv": b"Source\tTarget\n( [FIRST 2 ] )\t2\n" for s in ("train", "val", "test")},
         slow=True),
    # ---- the run plan (issue 26): checked before any work, one line each
    case("train-spec-typo-fast", "train --recipe demo --attn nss", "unknown attention variant 'nss'"),
    case("train-resume-other-name", "train --resume {run} --name other",
         "continues that run in place, so --name other would train another; drop --name"),
    case("compare-seed-fraction", "compare --recipe demo --attn standard --seeds 0.5",
         "seeds must be non-negative integers such as 0,1,3, not '0.5'"),
    case("compare-seeds-empty", ["compare", "--recipe", "demo", "--attn", "standard", "--seeds", ","],
         "seeds is empty; give at least one seed"),
    case("train-name-too-long", ["train", "--recipe", "demo", "--name", "n" * 240], "is 240 characters long"),
    case("train-name-not-portable", ["train", "--recipe", "demo", "--name", "ré sumé"],
         "cannot carry portably ( é); use letters, digits and . _ = , + -, such as 'r_sum'"),
    case("train-model-options-geometry", ["train", "--recipe", "demo", "--model-options", "{embed_dim: 50}"],
         "model vit_digits with model options {'embed_dim': 50} cannot be built for dataset digits", slow=True),
    case("train-model-options-type", ["train", "--recipe", "demo", "--model-options", "{depth: two}"],
         "cannot be built for dataset digits", slow=True),
    case("train-model-options-size", ["train", "--recipe", "demo", "--model-options", "{img_size: 7}"],
         "cannot be built for dataset digits", slow=True),
    case("compare-plan-model-options", "compare --config {tmp}/g.yaml --plan", "cannot be built for dataset digits",
         files={"g.yaml": b"variants: [standard]\nbase: {recipe: demo, model_options: {embed_dim: 50}}\n"},
         slow=True),
    case("train-device-mps", "train --recipe demo --device mps", "'mps' is not one attnlab runs on", slow=True),
    case("compare-analyze-no-variant", "compare --recipe demo --attn standard --seeds 0 --analyze branches",
         "--analyze branches applies to none of the grid's runs", slow=True),
    case("eval-config-checkpoint-disagree", "eval {run}", "does not fit the model its config.yaml describes",
         damage={"config.yaml": "other_model"}, slow=True),
    case("export-config-checkpoint-disagree", "export {run} --out x.safetensors",
         "does not fit the model its config.yaml describes", damage={"config.yaml": "other_model"}, slow=True),
    case("analyze-config-checkpoint-disagree", "analyze {run} --what spectra",
         "does not fit the model its config.yaml describes", damage={"config.yaml": "other_model"}, slow=True),
    case("train-lra-text-missing", "train --recipe lra_listops --dataset lra_text --model seq_text --data-dir {tmp}",
         "no reviews in neg, pos/; extract aclImdb_v1.tar.gz", slow=True),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 1-epoch run of the demo recipe (vit_digits on digits): config.yaml, checkpoint, result.json."""
    from attnlab.train import RECIPES, train

    runs = tmp_path_factory.mktemp("bad_inputs_runs")
    cfg = RECIPES["demo"].replace(epochs=1, runs_dir=str(runs), progress=False, name="run")
    train(cfg)
    return runs / "run"


def _listing(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (path.is_dir(), st.st_size, st.st_mtime_ns)
    return out


def run_case(argv, files, damage, tmp_path, finished_run, process=False):
    """Set the case up in tmp_path and run it there with :func:`in_process` (``process``: as a real process);
    returns (process, listing before, listing after)."""
    run = tmp_path / "runs" / "run"
    shutil.copytree(finished_run, run)
    for name, how in damage.items():
        if how == "delete":
            (run / name).unlink()
        else:
            DAMAGE[how](run / name)
    for name, content in files.items():
        if content is None:
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(content)
    argv = [a.replace(RUN, str(run)).replace("{tmp}", str(tmp_path)) for a in argv]
    before = _listing(tmp_path)
    if process:
        proc = forked.run([sys.executable, "-m", "attnlab", *argv], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # a real process: tests/forked.py's start as a fresh interpreter's
    else:
        proc = in_process(argv, tmp_path)
    return proc, before, _listing(tmp_path)


@pytest.mark.parametrize("argv,expected,files,damage", CASES)
def test_bad_input_is_one_line_exit_2_nothing_made(argv, expected, files, damage, tmp_path, finished_run):
    proc, before, after = run_case(argv, files, damage, tmp_path, finished_run)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attnlab{' ' + argv[0] if argv and argv[0] in COMMANDS else ''}: error: ")
    assert expected in lines[0], lines[0]
    assert after == before, f"the command changed {sorted(set(after.items()) ^ set(before.items()))}"


@pytest.mark.slow
@pytest.mark.parametrize("id_", ["command-typo", "report-missing", "compare-seeds-type", "eval-checkpoint-garbage",
                                 "train-lra-text-missing"])
def test_in_process_reads_as_a_real_process(id_, tmp_path, finished_run):
    """The in-process runner of the torch cases prints what a real process prints, and exits alike (the process
    starts as a fresh interpreter would, tests/train/test_forked.py)."""
    argv, _, files, damage = next(c.values for c in CASES if c.id == id_)
    codes, errs = [], []
    for how, process in (("process", True), ("here", False)):
        (tmp_path / how).mkdir()
        proc = run_case(argv, files, damage, tmp_path / how, finished_run, process)[0]
        codes.append(proc.returncode)
        errs.append(proc.stderr.replace(str(tmp_path / how), "{tmp}"))
    assert codes == [2, 2] and errs[0] == errs[1], errs


def test_help_does_not_import_torch():
    """`attnlab --help` and every command's --help build their parsers without torch (or timm), so they answer
    at once; the heavy imports happen in each command's run()."""
    code = ("import sys, contextlib, io\n"
            "from attnlab.cli import main\n"
            f"for argv in [['--help'], *[[c, '--help'] for c in {list(COMMANDS)!r}]]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            main(argv)\n"
            "        except SystemExit as e:\n"
            "            assert e.code == 0, argv\n"
            "print(sorted(m for m in ('torch', 'timm', 'matplotlib') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_no_parser_accepts_abbreviations():
    from attnlab.cli import build_parser

    parser = build_parser()
    assert parser.allow_abbrev is False
    assert parser.commands and all(p.allow_abbrev is False for p in parser.commands.values())


def test_analyze_lists_every_instrument():
    """analyze keeps the instrument names as text (its --help must not import torch); they must stay the registry's."""
    from attnlab.analysis.instruments import INSTRUMENTS
    from attnlab.cli.analyze import INSTRUMENTS as NAMES

    assert tuple(INSTRUMENTS) == NAMES
