"""Grids of runs: models x datasets x seeds x attention variants, one after another, finished runs skipped."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from attnlab.errors import ConfigError

from .config import GRID_PRESETS, TrainConfig, make_config
from .loop import RESULT, run_dir_of, train



def demo_variants() -> list[str]:
    """Registered variants flagged for the demo (``Variant.demo``), in registry order, 'standard' first."""
    from attnlab.variants import VARIANTS

    names = [v.name for v in VARIANTS.values() if getattr(v, "demo", True)]
    return sorted(names, key=lambda n: n != "standard")


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs at commas outside parentheses: 'standard,dna(variant=q,alpha_init=1)'."""
    parts, depth, current = [], 0, []
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


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
    return [dataclasses.replace(base, model=m, dataset=d, seed=int(s), attn=a, runs_dir=str(runs_dir),
                                name=None, resume=True)
            for base in bases for m in models for d in datasets for s in seeds for a in variants]


def run_grid(base_cfg: TrainConfig, variants: Sequence[str] | None, seeds: Sequence[int],
             datasets: Sequence[str] | None, models: Sequence[str] | None, runs_dir: str | Path,
             progress: bool = True, variations: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Train every (model, dataset, seed, variant) of the grid in turn; return their result dicts.

    A run whose ``result.json`` exists is skipped (its stored result returned); a run interrupted earlier
    resumes from its last checkpoint. ``variants=None`` means :func:`demo_variants`; ``datasets`` / ``models``
    ``None`` mean the base config's; ``variations`` as in :func:`grid_runs`.
    """
    variants = demo_variants() if variants is None else list(variants)
    configs = grid_runs(base_cfg, variants, seeds, datasets, models, runs_dir, variations)
    results = []
    for i, cfg in enumerate(configs, start=1):
        cfg = dataclasses.replace(cfg, progress=progress)
        run_dir = run_dir_of(cfg)
        done = (run_dir / RESULT).exists()
        if progress:
            print(f"[{i}/{len(configs)}] {run_dir.name}" + ("  (done, skipped)" if done else ""), flush=True)
        results.append(json.loads((run_dir / RESULT).read_text()) if done else train(cfg))
    return results


def load_grid(path: str | Path | None = None, preset: str | None = None, **overrides: Any) -> dict[str, Any]:
    """A grid description from a preset and/or YAML file, with overrides applied (``None`` values ignored).

    YAML layout: ``variants: [standard, ns]``, ``seeds: [0, 1, 3]``, ``datasets: [...]``, ``models: [...]``,
    ``runs_dir: runs`` and ``base:`` a mapping of TrainConfig keys (``recipe: ns_cifar``, ``epochs: 100``, ...);
    TrainConfig keys may also sit at the top level; optional ``variations:`` maps a tag to TrainConfig overrides
    (recipe variations compared separately). Returns ``{"base": TrainConfig, "variants", "seeds", "datasets",
    "models", "runs_dir", "variations"}`` ready for :func:`run_grid`.
    """
    grid: dict[str, Any] = {"variants": None, "seeds": [0], "datasets": None, "models": None, "runs_dir": "runs",
                            "variations": None}
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in GRID_PRESETS:
            raise ConfigError(f"unknown grid preset {preset!r}; valid presets are: {', '.join(GRID_PRESETS)}.")
        p = dict(GRID_PRESETS[preset])
        base["recipe"] = p.pop("recipe")
        grid.update(p)
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"grid file {path} does not exist; give the path of a YAML file.") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"grid file {path} is not valid YAML ({str(err).splitlines()[0]}).") from None
        if not isinstance(data, dict):
            raise ConfigError(f"grid file {path} must hold a mapping, not a {type(data).__name__}.")
        base_part = data.pop("base", None) or {}
        if not isinstance(base_part, dict):
            raise ConfigError(f"'base' in grid file {path} must be a mapping of training config keys.")
        base.update(base_part)
        for key in ("variants", "seeds", "datasets", "models", "runs_dir", "variations"):
            if key in data:
                grid[key] = data.pop(key)
        if grid["variations"] is not None and not isinstance(grid["variations"], dict):
            raise ConfigError(f"'variations' in grid file {path} must map a tag to training config keys, "
                              "e.g. no_warmup: {warmup_epochs: 0}.")
        base.update(data)  # remaining top-level keys are TrainConfig keys (unknown ones raise below)
    for key in ("variants", "seeds", "datasets", "models", "runs_dir"):
        if overrides.get(key) is not None:
            grid[key] = overrides.pop(key)
        else:
            overrides.pop(key, None)
    base.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("variants", "datasets", "models"):
        if isinstance(grid[key], str):
            grid[key] = split_specs(grid[key])
    if isinstance(grid["seeds"], (int, str)):
        grid["seeds"] = [s for s in str(grid["seeds"]).split(",") if s.strip()]
    try:
        grid["seeds"] = [int(s) for s in grid["seeds"]]
    except (TypeError, ValueError):
        raise ConfigError(f"seeds must be a list of integers such as 0,1,3, not {grid['seeds']!r}.") from None
    grid["base"] = make_config(None, **base)
    return grid
