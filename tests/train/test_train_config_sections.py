"""The sectioned config: a common section plus one section per task family (declared by its Task), flat keys and
flags mapped to their sections, another family's key refused in one line, recipes that state only what differs,
config.yaml files written before sections (main 1063594, tests/train/configs_1063594/) loading unchanged."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from attnlab.errors import ConfigError
from attnlab.train.config import (COMMON_SECTIONS, RECIPE_VALUES, RECIPES, TrainConfig, config_to_dict,
                                  family_sections, flat_settings, key_places, load_config, make_config)
from attnlab.train.section import keys_of
from attnlab.train.tasks import TASKS, task_class
from tests.cli_runner import in_process

OLD = Path(__file__).parent / "configs_1063594"  # main 1063594's Run.config_dict() of every recipe


def _default(key: str, family: str):
    """The default of ``key`` for a run of ``family``: the common one, or the family section's."""
    where = key_places()[key]
    if where == ("",):
        return getattr(TrainConfig(), key)
    if where[0] in COMMON_SECTIONS:
        return getattr(COMMON_SECTIONS[where[0]](), key)
    return getattr(family_sections()[family](), key)


def test_the_common_section_is_small_and_the_families_come_from_the_task_registry():
    assert len(dataclasses.fields(TrainConfig)) <= 25
    assert list(family_sections()) == list(TASKS) == ["image", "sequence", "lm", "video", "detect", "vlm"]
    for family, cls in family_sections().items():
        assert task_class(family).section is cls and cls.__module__ == task_class(family).__module__
    cfg = TrainConfig()
    assert cfg.image is cfg.families["image"] and cfg.lm.eval_iters == 20 and cfg.family == "image"


@pytest.mark.parametrize("name", list(RECIPE_VALUES))
def test_a_recipe_states_only_what_differs_from_its_defaults(name):
    family = RECIPES[name].family
    same = {k: v for k, v in RECIPE_VALUES[name].items() if v == _default(k, family)}
    assert not same, f"{name} repeats defaults: {same}"
    assert RECIPES[name] == make_config(name)  # what make_config builds, and valid


def _other_keys():
    """(recipe, key, family that reads it) for every recipe and every key of every other family's section."""
    for name, cfg in RECIPES.items():
        for family, cls in family_sections().items():
            for key in keys_of(cls):
                if family != cfg.family and cfg.family not in key_places()[key]:
                    yield name, key, family


@pytest.mark.parametrize("name, key, family", list(_other_keys()))
def test_a_key_of_another_family_is_refused_in_one_line_naming_the_family(name, key, family):
    value = getattr(family_sections()[family](), key)  # a value the key takes, in its own family
    with pytest.raises(ConfigError) as info:
        make_config(name, **{key: value})
    msg = str(info.value)
    assert "\n" not in msg and f"config key '{key}'" in msg and family in msg.partition(";")[0], msg
    assert f"{name} trains" in msg and f"the {RECIPES[name].family} family" in msg, msg
    with pytest.raises(ConfigError, match=f"config section '{family}' belongs to the {family} family; {name} "):
        make_config(name, **{family: {key: value}})


def test_the_refusals_example_and_a_sample_through_the_cli(tmp_path):
    with pytest.raises(ConfigError, match="config key 'label_smoothing' .* belongs to the image, sequence and video "
                                          "families; lm_demo trains a language model .dataset stdlib, the lm family"):
        make_config("lm_demo", label_smoothing=0.1)
    for argv, family in ((["--recipe", "lm_demo", "--repeated-aug", "3"], "image family"),
                         (["--recipe", "lm_demo", "--mixup-switch-prob", "0.9"], "image family"),
                         (["--recipe", "demo", "--z-loss", "0.1"], "lm family"),
                         (["--recipe", "detect_demo", "--video-metric", "top1"], "video family"),
                         (["--recipe", "lra_listops", "--augment", "none"], "image, video and detect families")):
        proc = in_process(["train", *argv, "--runs-dir", tmp_path / "runs"], tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and family in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_yaml_may_nest_and_flat_keys_map_to_their_sections(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("recipe: lm_demo\noptim: {lr: 0.01}\nsched: {min_lr: 0.001}\nlm: {block_size: 32}\n"
                    "run: {threads: 2}\nz_loss: 0.0\n")
    cfg = load_config(path, eval_iters="2")
    assert (cfg.optim.lr, cfg.sched.min_lr, cfg.lm.block_size, cfg.run.threads) == (0.01, 0.001, 32, 2)
    assert (cfg.lm.z_loss, cfg.lm.eval_iters, cfg.optim.beta2) == (0.0, 2, 0.95)  # flat keys; the recipe's beta2
    assert make_config("lm_demo", optim={"lr": 0.02}).optim.lr == make_config("lm_demo", lr=0.02).optim.lr == 0.02
    for text, match in (("lm: {blocksize: 3}", "unknown key 'blocksize' in config section 'lm'.*block_size"),
                        ("optim: 3", "config section 'optim' .* must be a mapping"),
                        ("image: {mixup: 0.1}", "config section 'image' belongs to the image family")):
        path.write_text(f"recipe: lm_demo\n{text}\n")
        with pytest.raises(ConfigError, match=match):
            load_config(path)
    written = config_to_dict(cfg)
    assert list(written)[-4:] == ["optim", "sched", "lm", "run"] and "label_smoothing" not in str(written)
    path.write_text(yaml.safe_dump(written))
    assert load_config(path) == cfg  # config.yaml round-trips


@pytest.mark.parametrize("name", sorted(p.stem for p in OLD.glob("*.yaml")))
def test_a_config_yaml_written_by_main_1063594_loads_unchanged(name):
    """main's flat config.yaml lists every family's keys (an lm run's label_smoothing: 0.0, an image run's
    block_size: null); the run read its own family's, and loads as the same config."""
    data = yaml.safe_load((OLD / f"{name}.yaml").read_text())
    old = load_config(OLD / f"{name}.yaml")
    assert old == make_config(name, runs_dir="/runs", data_dir="/data", name=data["name"])
    assert flat_settings(data) == flat_settings(config_to_dict(old))  # reports group old and new runs alike
    mutated = {**data, "lr": 0.5, "min_lr": 0.0}  # a mutation the loader must see: the file is really read
    assert flat_settings(mutated)["lr"] == 0.5


def test_a_run_directory_written_before_sections_resumes_and_evaluates(tmp_path):
    """A finished demo run whose config.yaml has main 1063594's flat layout: opened, evaluated, resumed (its
    settings compared key by key), and refused in one line when resumed with another learning rate."""
    import json

    from attnlab.train import train
    from attnlab.train.run import Run

    runs = tmp_path / "runs"
    result = train(make_config("demo", epochs=1, runs_dir=str(runs), progress=False, data_dir=str(tmp_path / "d")))
    run = runs / result["name"]
    flat = yaml.safe_load((OLD / "demo.yaml").read_text())  # main's layout, with this run's values
    flat.update(epochs=1, progress=False, runs_dir=str(runs), data_dir=str(tmp_path / "d"), name=run.name)
    (run / "config.yaml").write_text(yaml.safe_dump(flat, sort_keys=False))
    assert Run.open(run).cfg.epochs == 1
    proc = in_process(["eval", run], tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["top1"] == pytest.approx(result["top1"]), proc.stderr
    proc = in_process(["train", "--resume", run], tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = in_process(["train", "--recipe", "demo", "--epochs", "1", "--runs-dir", runs, "--data-dir",
                       tmp_path / "d", "--resume", "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stderr  # the same settings given as flags: finished, skipped
    proc = in_process(["train", "--recipe", "demo", "--epochs", "1", "--lr", "0.1", "--runs-dir", runs, "--name",
                       run.name, "--data-dir", tmp_path / "d", "--resume"], tmp_path)
    assert proc.returncode == 2 and "config.yaml differs in lr;" in proc.stderr, proc.stderr


def test_help_groups_flags_by_section_and_shows_the_recipes_values():
    lm = in_process(["train", "--recipe", "lm", "--help"]).stdout
    cifar = in_process(["train", "--help"]).stdout
    assert "training batch size (lm: 16)" in " ".join(lm.split())
    assert "training batch size (ns_cifar: 128)" in " ".join(cifar.split())
    for heading in ("optim: the optimizer", "sched: the learning-rate schedule", "run: how it runs",
                    "lm: keys of language-model runs", "image: keys of image classification runs"):
        assert heading in lm and heading in cifar
    assert lm.index("lm: keys of") < lm.index("image: keys of")  # the recipe's family first
    assert "weight of the z-loss, mean (log sum exp logits)^2 (Wortsman et al. use 1e-4) (lm: 0.0)" in " ".join(
        lm.split())
    late = in_process(["train", "--help", "--recipe", "lm"]).stdout  # --recipe after --help counts too
    assert late == lm


@pytest.mark.parametrize("argv", [
    # the recipe's warm-up cut to the run, the recipe made for another dataset, too many threads: then the typo
    ["train", "--model", "vit_digits", "--dataset", "digits", "--epochs", "1", "--threads", "9999",
     "--model-options", "{depht: 1}"],
    ["train", "--recipe", "lm", "--max-steps", "2", "--model-options", "{embed_dimm: 8}"],
    ["compare", "--models", "vit_digits", "--datasets", "digits", "--attn", "standard", "--epochs", "1",
     "--analyze", "spectra,entropyy"],
    ["compare", "--datasets", "digits,bogus", "--attn", "standard", "--epochs", "1", "--models", "vit_digits"],
])
def test_a_refused_command_prints_its_one_line_and_no_note(argv, tmp_path):
    import attnlab.train.config as config

    config._noted.clear()  # the warm-up note would be said here, once per process
    proc = in_process([*argv, "--runs-dir", tmp_path / "runs"], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "note" not in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()
