"""Grids of runs: models x datasets x seeds x attention variants, one after another, finished runs skipped."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnlab.errors import ConfigError
from attnlab.spec import split_specs

from .config import GRID_KEYS, GRID_PRESETS, TrainConfig, check_grid, make_config, read_yaml
from .files import RESULT, result_line
from .loop import check_run, train
from .run import run_dir_of


def demo_variants() -> list[str]:
    """Specs of the registered variants flagged for the demo (``Variant.demo``: True for the bare name, or the spec
    to train), in registry order, 'standard' first."""
    from attnlab.variants import VARIANTS

    specs = [v.demo if isinstance(v.demo, str) else v.name for v in VARIANTS.values() if v.demo]
    return sorted(specs, key=lambda n: n != "standard")


def grid_runs(base_cfg: TrainConfig, variants: Sequence[str], seeds: Sequence[int], datasets: Sequence[str] | None,
              models: Sequence[str] | None, runs_dir: str | Path,
              variations: dict[str, dict[str, Any]] | None = None) -> list[TrainConfig]:
    """The configs of a grid, ordered variation, model, dataset, seed, variant: a partial grid holds matched-seed
    pairs. ``variations`` maps a tag (e.g. ``no_warmup``) to TrainConfig overrides (e.g. ``{warmup_epochs: 0}``);
    each becomes its own comparison in the report."""
    datasets = list(datasets) if datasets else [base_cfg.dataset]
    models = list(models) if models else [base_cfg.model]
    bases = [base_cfg]
    if variations:
        bases = [make_config(base_cfg, tag=tag, **(overrides or {})) for tag, overrides in variations.items()]
    return [base.replace(model=m, dataset=d, seed=int(s), attn=a, runs_dir=str(runs_dir),
                         name=None, resume=True)
            for base in bases for m in models for d in datasets for s in seeds for a in variants]


def plan_grid(base_cfg: TrainConfig, variants: Sequence[str] | None, seeds: Sequence[int],
              datasets: Sequence[str] | None, models: Sequence[str] | None, runs_dir: str | Path,
              variations: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Check every run of the grid before any of them trains (:func:`~attnlab.train.loop.check_run`, each dataset
    and model once; two runs with one run directory are an error too), raising the first problem's AttnlabError.
    Returns check_run's dicts in grid order, each with the run's config under ``"cfg"``. Arguments as for
    :func:`run_grid`.
    """
    variants = demo_variants() if variants is None else list(variants)
    cache: dict = {}
    plans: list[dict[str, Any]] = []
    seen: dict[str, TrainConfig] = {}
    for cfg in grid_runs(base_cfg, variants, seeds, datasets, models, runs_dir, variations):
        plan = check_run(cfg, cache)
        if plan["name"] in seen:
            first = seen[plan["name"]]
            raise ConfigError(f"the grid trains run {plan['name']} twice (attn {first.attn!r} and {cfg.attn!r}, seed "
                              f"{cfg.seed}); list each variant, seed, dataset and model once.")
        seen[plan["name"]] = cfg
        plans.append({**plan, "cfg": cfg})
    return plans


def format_plan(plans: Sequence[dict[str, Any]]) -> str:
    """One line per run (train / resume / skip, the run's name, why), then the counts."""
    lines = []
    for p in plans:
        if p["action"] == "skip":
            detail = "finished, " + result_line(p["result"]).partition(": ")[2]
        elif p["action"] == "resume":
            detail = f"after epoch {p['epoch']} of {p['cfg'].epochs}" + (f": {p['note']}" if p["note"] else "")
        else:
            detail = f"{p['cfg'].epochs} epoch" + ("s" if p["cfg"].epochs != 1 else "")
        lines.append(f"{p['action']:<7}{p['name']}  ({detail})")
    counts = {a: sum(p["action"] == a for p in plans) for a in ("train", "resume", "skip")}
    lines.append(f"{len(plans)} runs: {counts['train']} to train, {counts['resume']} to resume, "
                 f"{counts['skip']} finished")
    return "\n".join(lines)


def run_grid(base_cfg: TrainConfig, variants: Sequence[str] | None, seeds: Sequence[int],
             datasets: Sequence[str] | None, models: Sequence[str] | None, runs_dir: str | Path,
             progress: bool = True, variations: dict[str, dict[str, Any]] | None = None,
             jobs: int = 1, probe=None, launcher: str = "local",
             launcher_options: dict[str, Any] | None = None,
             plans: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Train every (model, dataset, seed, variant) of the grid; return their result dicts in grid order.

    Every run is checked first (:func:`plan_grid`, and the launcher), so a grid with a bad run trains or submits
    nothing; a finished run is skipped, an interrupted one resumes. ``variants=None`` means :func:`demo_variants`;
    ``datasets`` / ``models`` ``None`` mean the base config's. ``jobs=N`` trains N at a time in worker processes
    (:mod:`attnlab.train.launch`; each run seeded as alone, so results do not depend on N); ``launcher`` submitit
    submits one job per run instead, with ``launcher_options`` (:data:`~attnlab.train.launch.SLURM_OPTIONS`).
    ``probe`` goes to :func:`~attnlab.train.loop.train` (a module-level function, for workers). ``plans``:
    :func:`plan_grid`'s result for these arguments, when the caller has checked the grid already.
    """
    from .launch import check_launcher, run_local, run_submitit

    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, not {jobs}.")
    check_launcher(launcher, launcher_options)
    if plans is None:
        plans = plan_grid(base_cfg, variants, seeds, datasets, models, runs_dir, variations)
    parallel = jobs > 1 or launcher != "local"
    configs = [p["cfg"].replace(progress=progress and not parallel) for p in plans]
    todo = [c for c, p in zip(configs, plans) if p["action"] != "skip"]
    if progress:
        print(f"{len(configs)} runs, {len(configs) - len(todo)} already finished"
              + (f", {jobs} at a time" if jobs > 1 and todo and launcher == "local" else ""), flush=True)
    if launcher != "local":
        if todo:
            run_submitit(todo, runs_dir, launcher, launcher_options, jobs=jobs if jobs > 1 else None,
                         probe=probe, progress=progress)
    elif jobs == 1:
        for i, cfg in enumerate(todo, start=1):
            if progress:
                print(f"[{i}/{len(todo)}] {run_dir_of(cfg).name}", flush=True)
            result = train(cfg, probe)
            if not progress:  # without bars, one line per finished run, so a long grid is not silent
                print(f"[{i}/{len(todo)}] {result_line(result)}", flush=True)
    else:
        run_local(todo, jobs, probe, progress)
    return [json.loads((run_dir_of(c) / RESULT).read_text()) for c in configs]


def _seeds(value: Any) -> list[int]:
    """A grid's seeds: a list (or comma-separated text) of non-negative integers, at least one; ``0.5`` or
    ``'1.5'`` is refused rather than truncated."""
    items = [s for s in str(value).split(",") if s.strip()] if isinstance(value, (int, float, str)) else value
    seeds = []
    for item in items if isinstance(items, list) else [items]:
        try:
            number = float(item) if not isinstance(item, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or not number.is_integer() or number < 0:
            raise ConfigError(f"seeds must be non-negative integers such as 0,1,3, not {value!r}.")
        seeds.append(int(number))
    if not seeds:
        raise ConfigError("seeds is empty; give at least one seed, such as --seeds 0,1,2.")
    return seeds


def load_grid(path: str | Path | None = None, preset: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A grid description from a preset and/or YAML file (layout: docs/training.md, "Grids"), with overrides
    applied (``None`` values ignored; ``launcher_options``' non-None values replace the file's ``launcher:``
    options). Returns ``{"base": TrainConfig, "variants", "seeds", "datasets", "models", "runs_dir", "variations",
    "jobs", "launcher", "launcher_options"}`` ready for :func:`run_grid`.
    """
    from .launch import check_launcher

    grid: dict[str, Any] = {"variants": None, "seeds": [0], "datasets": None, "models": None, "runs_dir": "runs",
                            "variations": None, "jobs": 1}
    launcher: dict[str, Any] = {}
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in GRID_PRESETS:
            raise ConfigError(f"unknown grid preset {preset!r}; valid presets are: {', '.join(GRID_PRESETS)}.")
        p = dict(GRID_PRESETS[preset])
        base["recipe"] = p.pop("recipe")
        grid.update(p)
    if path is not None:
        data = read_yaml(path, "grid file") or {}
        if not isinstance(data, dict):
            raise ConfigError(f"grid file {path} must hold a mapping, not a {type(data).__name__}.")
        base_part = data.pop("base", None) or {}
        if not isinstance(base_part, dict):
            raise ConfigError(f"'base' in grid file {path} must be a mapping of training config keys.")
        base.update(base_part)
        launcher_part = data.pop("launcher", None)
        if isinstance(launcher_part, str):
            launcher_part = {"name": launcher_part}
        if not isinstance(launcher_part, (dict, type(None))):
            raise ConfigError(f"'launcher' in grid file {path} must be a launcher name or a mapping such as "
                              "{name: submitit, partition: gpu, time: 240}.")
        launcher.update(launcher_part or {})
        grid.update({k: data.pop(k) for k in GRID_KEYS if k in data})  # base and launcher are popped already
        if grid["variations"] is not None and not isinstance(grid["variations"], dict):
            raise ConfigError(f"'variations' in grid file {path} must map a tag to training config keys, "
                              "e.g. no_warmup: {warmup_epochs: 0}.")
        check_grid(grid, data, f"grid file {path}")
        base.update(data)  # remaining top-level keys are TrainConfig keys
    for key in ("variants", "seeds", "datasets", "models", "runs_dir", "jobs"):
        if (value := overrides.pop(key, None)) is not None:
            grid[key] = value
    if (name := overrides.pop("launcher", None)) is not None:
        launcher["name"] = name
    launcher.update({k: v for k, v in (overrides.pop("launcher_options", None) or {}).items() if v is not None})
    base.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("variants", "datasets", "models"):
        if isinstance(grid[key], str):
            grid[key] = split_specs(grid[key])
    grid["seeds"] = _seeds(grid["seeds"])
    check_grid(grid, (), "the grid")
    grid["launcher"] = launcher.pop("name", "local")
    grid["launcher_options"] = launcher
    check_launcher(grid["launcher"], grid["launcher_options"])
    grid["base"] = make_config(None, **base)
    return grid
