"""`attnlab train`: one training run from a recipe, a YAML config and flags (flags win)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import typing
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError, ConfigError, NonFiniteLossError
from attnlab.train.files import CONFIG, METRICS, TB_DIR

from . import current_rank

# TrainConfig keys that `attnlab train` does not expose as --flags (resume has its own flag below)
_HIDDEN = {"resume", "world_size"}  # world_size is recorded from torchrun, not set


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _converter(key: str):
    """argparse ``type=`` converting a flag's text as config key ``key`` (so the error names the flag)."""
    from attnlab.train.config import coerce

    def convert(text: str) -> Any:
        try:
            return coerce(key, text)
        except ConfigError as err:  # "config key 'k' got ..." -> "argument --k: got ..."
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"config key '{key}' ").rstrip(".")) from None

    convert.__name__ = key
    return convert


class _RecipeHelp(argparse.Action):
    """``-h/--help`` noted, not printed at once: :func:`run` prints the help with the defaults of the recipe the
    command line names, wherever ``--recipe`` stands."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest="help", default=False, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.help = True


def _add_flag(parser, key: str, help_text: str, shown: Any) -> None:
    """One --flag for config key ``key``; ``shown`` (a value, or None) goes after the help in parentheses."""
    from attnlab.train.config import _hint

    hint = _hint(key)
    if shown is not None:
        help_text += f" ({shown})"
    if hint in (bool, bool | None):  # None: the default that depends on the run
        parser.add_argument(_flag(key), dest=key, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                            help=help_text)
        return
    typ = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    metavar = {dict: "YAML", str: "TEXT", int: "N", float: "X"}.get(typ, "X")
    parser.add_argument(_flag(key), dest=key, metavar=metavar, default=argparse.SUPPRESS, help=help_text,
                        type=_converter(key))


def _help_of(cls: type, key: str) -> str:
    from attnlab.data.registry import DATASET_TABLE, describe

    text = next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == key)
    if key == "data_options":
        text += (" as a YAML mapping, e.g. '{image_size: 64}'; each dataset's options, with defaults and bounds: "
                 + "; ".join(describe(name) for name in DATASET_TABLE))
    elif key == "model_options":
        text += " as a YAML mapping, e.g. '{depth: 2}'"
    return text


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     only: typing.Iterable[str] | None = None, recipe: str = "ns_cifar") -> None:
    """One --flag per config key (help from the field's metadata, with the value of ``recipe``); unset flags leave
    the config alone. With ``only``, those keys' flags go into ``parser`` (a group) itself; without, one argument
    group per section: what is trained, optim, sched, the recipe's family, the other families, run."""
    from attnlab.data.registry import DATASET_TABLE
    from attnlab.train.config import COMMON_SECTIONS, RECIPES, TOP_KEYS, TrainConfig, family_sections
    from attnlab.train.section import keys_of, title

    cfg = RECIPES.get(recipe, RECIPES["ns_cifar"])
    own, families = cfg.family, family_sections()
    order = [("", TrainConfig), *((n, c) for n, c in COMMON_SECTIONS.items() if n != "run"),
             (own, families[own]), *((n, c) for n, c in families.items() if n != own), ("run", COMMON_SECTIONS["run"])]
    done: set[str] = set(_HIDDEN)
    for name, cls in order:
        keys = [k for k in (TOP_KEYS if name == "" else keys_of(cls)) if k not in done
                and (only is None or k in only)]
        if not keys:
            continue
        target = parser
        if only is None:
            if name in families:
                datasets = ", ".join(d for d, e in DATASET_TABLE.items() if e.task == name)
                head = f"{title(cls)}; read only by {name} runs (datasets {datasets})"
                target = parser.add_argument_group(head + ("" if name == own else f"; {cfg.recipe} trains {own} runs"))
            else:
                target = parser.add_argument_group(title(cls) if name else
                                                   f"what is trained (defaults: the {cfg.recipe} recipe's values)")
        other = name in families and name != own  # a family this recipe's runs are not of: its own defaults
        values = cls() if other else cfg if name == "" else getattr(cfg, name)
        for key in keys:
            done.add(key)
            readers = [f for f, c in families.items() if key in keys_of(c)]
            text = _help_of(cls, key) + (f"; read by {', '.join(readers)} runs" if len(readers) > 1 else "")
            value = getattr(values, key)
            shown = (f"{', '.join(RECIPES)}; default ns_cifar" if key == "recipe" else None if value in (None, {}, "")
                     else f"{name} default: {value}" if other else f"{cfg.recipe}: {value}")
            _add_flag(target, key, text, shown)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig keys given on the command line (converted to the keys' types by the flags)."""
    from attnlab.train.config import config_keys

    return {k: getattr(args, k) for k in config_keys() if k not in _HIDDEN and hasattr(args, k)}


def _missing_dirs(run_dir: Path) -> list[Path]:
    """``run_dir`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not run_dir.exists() and run_dir != run_dir.parent:
        missing.append(run_dir)
        run_dir = run_dir.parent
    return missing


def _remove_unstarted(made: list[Path]) -> None:
    """Undo a run that failed before its first epoch: remove the directories it created, if they hold no more than
    set-up writes (config.yaml, an empty metrics.jsonl, TensorBoard's first events); a run with a checkpoint or a
    logged epoch stays, to be resumed."""
    run_dir = made[0] if made else None
    if (run_dir is not None and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {CONFIG, METRICS, TB_DIR}
            and (not (run_dir / METRICS).exists() or (run_dir / METRICS).stat().st_size == 0)):
        for name in (CONFIG, METRICS):
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / TB_DIR, ignore_errors=True)
    for directory in made:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: keep it and what holds it
            return


def configure(parser: argparse.ArgumentParser, recipe: str = "ns_cifar") -> None:
    # -h/--help replaced (argparse's own prints at once, before a later --recipe is read): run() prints it
    parser.conflict_handler = parser._optionals.conflict_handler = "resolve"
    parser.add_argument("-h", "--help", action=_RecipeHelp,
                        help="show this help, with the defaults of the --recipe given (e.g. --recipe lm --help)")
    parser.description = (
        "Train one model with the NS-Attn paper's CIFAR recipe (or another named recipe) into\n"
        "<runs-dir>/<model>-<dataset>-<attn>-s<seed>/: config.yaml, metrics.jsonl, checkpoint.safetensors,\n"
        "trainer_state.pt and, when finished, result.json. Precedence: recipe < --config file < flags.")
    parser.epilog = ("examples:\n"
                     "  attnlab train --model vit_cifar --dataset cifar100 --attn ns --seed 0 --download\n"
                     "  attnlab train --recipe demo --attn ns\n"
                     "  attnlab train --config configs/x.yaml --epochs 10\n"
                     "  attnlab train --resume runs/vit_cifar-cifar100-ns-s0")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="YAML", help="YAML file of training config keys (see the flags below)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                        help="continue from the last completed epoch: of RUN_DIR (its config.yaml is used) or of the "
                             "run the other options name; starts afresh if there is no checkpoint yet")
    parser.description += ("\nConfig keys (each overrides the recipe and --config) in groups: the common sections,\n"
                           "then each task family's, read only by runs of that family (its datasets).")
    add_config_flags(parser, recipe=recipe)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "help", False):
        return _print_help(args)
    from attnlab.cli.checks import output_dir
    from attnlab.train.config import deferred_notes, load_config, say_notes

    overrides = config_overrides(args)
    config_path = args.config
    if isinstance(args.resume, str):
        run_dir = Path(args.resume)
        if not (run_dir / CONFIG).exists():
            raise ConfigError(f"--resume {run_dir}: no {CONFIG} there; give a run directory made by attnlab train.")
        if config_path is not None:
            raise ConfigError("--resume RUN_DIR reads the run's own config.yaml; drop --config or give --resume alone.")
        for key, value in (("name", run_dir.name), ("runs_dir", str(run_dir.parent))):
            if key in overrides and Path(overrides[key]) != Path(value):
                raise ConfigError(f"--resume {run_dir} continues that run in place, so --{key.replace('_', '-')} "
                                  f"{overrides[key]} would train another; drop --{key.replace('_', '-')}.")
        config_path = run_dir / CONFIG
        overrides.update(runs_dir=str(run_dir.parent), name=run_dir.name)
    with deferred_notes() as warmup:  # said with the other notes, once every check has passed
        cfg = load_config(config_path, **overrides).replace(resume=bool(args.resume))
    output_dir(cfg.run.runs_dir, "runs_dir")
    notes = warmup + _notes(cfg)

    from attnlab.train import run_dir_of, train  # torch loads only once the options are known to be good

    if notes:  # a note is for a run that starts: an error found by the checks stays the one line
        from attnlab.train.run import Run

        Run(cfg).plan()
        say_notes(notes)

    made = _missing_dirs(run_dir_of(cfg))
    probe = None
    if cfg.run.probe_every > 0:
        from attnlab.analysis import training_probe as probe
    try:
        result = train(cfg, probe)  # NonFiniteLossError -> attnlab.cli.main: one stderr line, exit code 3
    except AttnlabError as err:
        # rank 0 writes the run's files, so it alone removes them: two ranks would race in iterdir and rmdir
        if not isinstance(err, NonFiniteLossError) and not current_rank():
            _remove_unstarted(made)
        raise
    if not current_rank():  # under torchrun, rank 0 speaks for the run
        from attnlab.train.files import result_line

        print(f"{result_line(result)}  ({result['params'] / 1e6:.2f}M params, {result['seconds']:.1f} s) -> "
              f"{run_dir_of(cfg)}")
    return 0


def _print_help(args: argparse.Namespace) -> int:
    """The help of ``attnlab train`` with the defaults of the recipe the command line gave (an unknown recipe is
    the one line that says so)."""
    from attnlab.cli import Parser
    from attnlab.train.config import RECIPES

    recipe = getattr(args, "recipe", "ns_cifar")
    if recipe not in RECIPES:
        from attnlab.errors import did_you_mean

        raise ConfigError(f"unknown recipe {recipe!r}{did_you_mean(recipe, RECIPES)}; valid recipes are: "
                          f"{', '.join(RECIPES)}.")
    parser = Parser(prog="attnlab train", formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    configure(parser, recipe)
    parser.print_help()
    return 0


def _notes(cfg) -> list[str]:
    """Lines for stderr on settings that are valid but probably not meant: more threads than cores, and a dataset
    trained with a recipe made for another when one exists for it."""
    from attnlab.train.config import RECIPES

    notes = []
    cores = os.cpu_count() or 1
    if cfg.run.threads and cfg.run.threads > cores:
        notes.append(f"attnlab train: note: --threads {cfg.run.threads} on {cores} cores oversubscribes them (torch's "
                     f"threads then wait on each other, often several times slower); use --threads {cores} or "
                     f"fewer.")
    recipe = RECIPES[cfg.recipe]
    if cfg.dataset != recipe.dataset:
        made_for = [name for name, r in RECIPES.items() if r.dataset == cfg.dataset]
        if made_for:
            notes.append(f"attnlab train: note: the {cfg.recipe} recipe is tuned for {recipe.dataset}; --recipe "
                         f"{made_for[0]} is the one made for {cfg.dataset}.")
    return notes
