"""TrainConfig, recipes, YAML loading with overrides, run names."""

from __future__ import annotations

import pytest

from attnlab.errors import ConfigError
from attnlab.train import RECIPES, TrainConfig, load_config, make_config, run_name
from attnlab.train.grid import split_specs


def test_ns_cifar_recipe_has_the_papers_numbers():
    # NS-Attn Sec. 3.1 and the SPT/LSA README (REFERENCES.md), typed in from the text
    r = RECIPES["ns_cifar"]
    assert (r.epochs, r.batch_size, r.optim.lr, r.optim.weight_decay, r.sched.warmup_epochs) == \
        (100, 128, 1e-3, 0.05, 10)
    i = r.image
    assert (i.label_smoothing, i.mixup, i.cutmix, i.mixup_prob, i.repeated_aug) == (0.1, 0.8, 1.0, 0.5, 3)
    assert i.augment == "recipe" and r.drop_path is None  # drop-path comes from the preset
    assert r == TrainConfig()


def test_unknown_key_names_the_valid_keys(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: vit_cifar\nlearning_rate: 0.1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "'learning_rate'" in msg and "valid keys" in msg
    for key in ("lr", "batch_size", "weight_decay", "warmup_epochs", "seed"):
        assert key in msg
    with pytest.raises(ConfigError, match="'bogus'"):
        make_config("demo", bogus=1)


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("recipe: demo\nepochs: 5\nlr: 0.01\nmodel_options: {depth: 1}\n")
    cfg = load_config(path, lr="0.5", seed="3", compile="true", drop_path="none")
    demo = RECIPES["demo"]
    assert cfg.dataset == demo.dataset and cfg.batch_size == demo.batch_size  # from the recipe
    assert cfg.epochs == 5                                                    # from the file
    assert cfg.optim.lr == 0.5 and cfg.seed == 3 and cfg.run.compile is True           # flags, converted from text
    assert cfg.drop_path is None and cfg.model_options == {"depth": 1}


def test_bad_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="epochs"):
        make_config("demo", epochs="ten")
    with pytest.raises(ConfigError, match="amp"):
        make_config("demo", amp="fp16")
    with pytest.raises(ConfigError, match="recipe"):
        make_config(None, recipe="imagenet")
    with pytest.raises(ConfigError, match="even"):
        make_config("ns_cifar", batch_size=127)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_run_name_is_file_system_safe():
    cfg = RECIPES["demo"].replace(model="vit_cifar", dataset="cifar100", seed=3)
    assert run_name(cfg, "ns") == "vit_cifar-cifar100-ns-s3"
    assert run_name(cfg, "dna(variant=q)+sigma") == "vit_cifar-cifar100-dna_variant=q+sigma-s3"
    assert run_name(cfg.replace(model="hf-hub:org/model"), "ns") == "hf-hub_org_model-cifar100-ns-s3"
    assert run_name(cfg.replace(name="my_run.1"), "ns") == "my_run.1"
    # a name the user gives is never rewritten: unsafe characters and over-long names are refused with a suggestion
    for name, why in (("my run/1", "such as 'my_run_1'"), ("ré sumé", "such as 'r_sum'"), ("..", "dots only"),
                      ("x" * 201, "at most 200")):
        with pytest.raises(ConfigError, match=why):
            run_name(cfg.replace(name=name), "ns")


def test_split_specs_keeps_commas_inside_parentheses():
    assert split_specs("standard, ns,dna(variant=q,alpha_init=1)+ns") == [
        "standard", "ns", "dna(variant=q,alpha_init=1)+ns"]


def test_a_recipes_warm_up_longer_than_a_short_run_is_cut_with_one_note(capsys, tmp_path):
    """A one-epoch or two-step smoke run of any recipe runs: the recipe's warm-up ends at the run's end, and one line
    on stderr says so; a warm-up the user gave (flag or config file) that is longer than training stays an error."""
    import attnlab.train.config as config

    config._noted.clear()
    cfg = make_config(None, model="vit_digits", dataset="digits", epochs=1)  # ns_cifar: 10 warm-up epochs
    assert cfg.sched.warmup_epochs == 1.0
    lm = make_config("lm", max_steps=2)  # 100 warm-up steps
    assert lm.sched.warmup_steps == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "ns_cifar recipe's warm-up of 10 epochs" in err[0] and "cut to the run's 1 epoch " in err[0]
    assert "lm recipe's warm-up of 100 steps" in err[1] and "--warmup-steps" in err[1]
    make_config("lm", max_steps=2)
    assert capsys.readouterr().err == ""  # once per process, not once per run of a grid
    for given in (dict(epochs=2, warmup_epochs=3), dict(recipe="lm", max_steps=2, warmup_steps=5)):
        with pytest.raises(ConfigError, match="longer than the"):
            make_config(None, **given)
    path = tmp_path / "short.yaml"
    path.write_text("recipe: demo\nepochs: 1\nwarmup_epochs: 4\n")
    with pytest.raises(ConfigError, match="config key 'warmup_epochs' is 4, longer than the 1 epochs"):
        load_config(path)


def test_one_epoch_and_two_step_smoke_runs_train(tmp_path):
    import attnlab.train.config as config
    from tests.cli_runner import in_process

    config._noted.clear()  # the notes are said once per process

    for argv in (["--model", "vit_digits", "--dataset", "digits", "--epochs", "1"], ["--recipe", "lm", "--max-steps", "2",
                                                                                    "--eval-iters", "1"]):
        run = in_process(["train", *argv, "--runs-dir", tmp_path / "runs"], cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "warm-up" in run.stderr and "is cut to the run's" in run.stderr
    assert len(list((tmp_path / "runs").glob("*/result.json"))) == 2


def test_compile_on_the_cpu_refuses_a_temporary_directory_with_a_space(tmp_path, monkeypatch):
    """Inductor hands g++ its temporary directory unquoted, so a TMPDIR with a space would fail every build mid-run;
    the plan says so in one line before anything starts (found by running the suite under an unusual TMPDIR)."""
    import tempfile

    from attnlab.train.run import Run

    spaced = tmp_path / "a b"
    spaced.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spaced))
    cfg = make_config("demo", compile=True, device="cpu", runs_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="set TMPDIR to a directory without spaces"):
        Run(cfg).plan()
    Run(cfg.replace(compile=False)).plan()  # without --compile the path does not matter
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    Run(cfg).plan()
    assert not (tmp_path / "runs").exists()


def test_yaml_numbers_without_a_dot_are_numbers_in_files_and_flags(tmp_path):
    """1e6 and 3e-4 are floats (YAML 1.2) in --model-options and in config files, as a researcher writes them;
    PyYAML alone (YAML 1.1) reads them as text. Integers, dates and words stay what they were."""
    from attnlab.train.config import load_config, make_config

    cfg = make_config("lm_demo_llama", model_options="{rope_theta: 1e6, norm_eps: 1e-6, depth: 2, name: 1e}")
    assert cfg.model_options == {"rope_theta": 1e6, "norm_eps": 1e-6, "depth": 2, "name": "1e"}
    assert type(cfg.model_options["depth"]) is int
    (tmp_path / "c.yaml").write_text("recipe: lm_demo_llama\nmodel_options: {rope_theta: 5e5}\noptim: {lr: 3e-4}\n")
    loaded = load_config(tmp_path / "c.yaml")
    assert loaded.model_options == {"rope_theta": 5e5} and loaded.optim.lr == 3e-4
