"""A run: one training configuration, resolved once (config, spec, device, precision, ranks), what training would
do with it (:meth:`Run.plan`), and its directory ``<runs_dir>/<name>/``, which readers open with :meth:`Run.open`
(docs/training.md, "A run, its task, its data"; the files: :mod:`attnlab.train.files`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from attnlab.errors import ConfigError, UnsupportedModelError

from . import distributed
from .config import RUNTIME_KEYS, TrainConfig, config_to_dict, flat_settings, load_config, run_name, validate
from .files import CONFIG, DATA, EMA_WEIGHTS, METRICS, RESULT, TB_DIR, read_jsonl  # noqa: F401 - re-exported

COMPILE_MODES = {"cuda": "reduce-overhead", "cpu": "default"}  # 'auto' per device type; measured in docs/perf.md


def resolve_device(device: str) -> torch.device:
    """``device`` ("auto", "cpu", "cuda", "cuda:N") as a torch device of this machine, or ConfigError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N.") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not one attnlab runs on (its fused paths and tests cover CPU and "
                          f"CUDA); use auto, cpu, cuda or cuda:N.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but CUDA is not available; use --device cpu or auto.")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ConfigError(f"device {device!r} was asked for but this machine has {n} CUDA device(s); "
                          f"use cuda:0 to cuda:{n - 1}.")
    return dev


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default (no loss scaling needed, unlike fp16); fp32 on CPU, where bf16 is slow."""
    if amp == "none" or (amp == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def compile_mode(mode: str, device: torch.device) -> str:
    """torch.compile's mode for ``mode`` ('auto': CUDA graphs on CUDA, where the step's shapes are static)."""
    return COMPILE_MODES.get(device.type, "default") if mode == "auto" else mode


def check_compile_paths() -> None:
    """ConfigError unless inductor's CPU builds can run here: g++ is handed its temporary and cache directories
    unquoted, so a space in either breaks every build (with a C++ compile error, mid-run)."""
    import tempfile

    for name, path in (("TMPDIR", tempfile.gettempdir()), ("TORCHINDUCTOR_CACHE_DIR",
                                                          os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))):
        if any(c.isspace() for c in path):
            raise ConfigError(f"--compile on the CPU builds C++ kernels in {path!r}, and torch.compile cannot pass a "
                              f"path with a space to the compiler; set {name} to a directory without spaces, or "
                              f"train without --compile.")


@dataclass(frozen=True)
class Plan:
    """What training would do with a run: ``action`` "skip" (finished; ``result`` holds its result.json),
    "resume" (after completed epoch ``epoch``; ``note`` says why if not from the latest checkpoint) or "train"."""

    action: str = "train"
    epoch: int = 0
    note: str | None = None
    result: dict[str, Any] | None = None


class Run:
    """One run: its config validated, its spec parsed, its task, dataset entry and directory (module docstring);
    ``Run(cfg)`` for a run to train (or to check), ``Run.open(path)`` for one on disk."""

    def __init__(self, cfg: TrainConfig) -> None:
        from attnlab.data.registry import dataset
        from attnlab.spec import parse_spec

        from .tasks import task_class

        cfg = absolute_paths(validate(cfg))
        self.spec = parse_spec(cfg.attn)
        self.cfg = cfg.replace(attn=str(self.spec))  # the canonical form, in config.yaml and names
        self.name = run_name(self.cfg)
        self.dir = Path(self.cfg.run.runs_dir) / self.name
        self.dataset = dataset(self.cfg.dataset)
        self.task = task_class(self.dataset.task)(self)
        self.ranks = distributed.SINGLE

    def __repr__(self) -> str:
        return f"Run({self.name!r}, task={self.task.name!r})"

    # ---- resolved once --------------------------------------------------------------------------------------
    @cached_property
    def info(self):
        """The dataset's :class:`~attnlab.data.registry.DatasetInfo` (classes, sizes, statistics)."""
        from attnlab.data import dataset_info

        return dataset_info(self.cfg.dataset, data_dir=self.cfg.run.data_dir, **self.cfg.data_options)

    @cached_property
    def device(self) -> torch.device:
        """Where this process trains: the configured device, under torchrun each rank's own GPU (:meth:`join`)."""
        return resolve_device(self.cfg.run.device)

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return resolve_amp(self.cfg.run.amp, self.device)

    def join(self, ranks: distributed.Ranks) -> None:
        """Take this process's place among torchrun's ranks (its device, the world size config.yaml records)."""
        self.device = distributed.rank_device(self.device, ranks)
        self.ranks = ranks

    def config_dict(self) -> dict[str, Any]:
        """What config.yaml holds: every field, with the canonical spec, the run's name and world size, ``resume``
        off."""
        return config_to_dict(self.cfg.replace(name=self.name, resume=False, accept_data_change=False,
                                               world_size=self.ranks.world_size))

    # ---- the data it trains on -----------------------------------------------------------------------------
    @cached_property
    def fingerprint(self) -> dict[str, str] | None:
        """What identifies the run's data now (:func:`attnlab.data.registry.data_fingerprint`), recorded in
        data.json when the run starts; None for a dataset that records nothing."""
        from attnlab.data.registry import data_fingerprint

        return data_fingerprint(self.cfg.dataset, data_dir=self.cfg.run.data_dir, **self.cfg.data_options)

    def recorded_data(self) -> dict[str, str] | None:
        """The fingerprint the run recorded (data.json), None if it recorded none (a run written before it, or a
        dataset without one); ConfigError for an unreadable file."""
        path = self.dir / DATA
        if not path.is_file():
            return None
        try:
            recorded = json.loads(path.read_text())
            if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
                raise ValueError("not a mapping of descriptions")
        except (OSError, ValueError, RecursionError) as err:
            raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {err}"[:300] + "); delete it, and the "
                              f"run records its data again when it resumes.") from None
        return recorded

    def data_changes(self, only: tuple[str, ...] | None = None) -> str:
        """What differs between the recorded data and the data now, in words (empty if nothing, or nothing was
        recorded); ``only``: the keys compared."""
        from attnlab.data.registry import data_changes

        recorded = self.recorded_data()
        current = self.fingerprint if recorded is not None else None
        if recorded is None or current is None:
            return ""
        if only is not None:
            recorded = {k: v for k, v in recorded.items() if k in only}
            current = {k: v for k, v in current.items() if k in only}
        return data_changes(recorded, current)

    def warn_data_changed(self, command: str, only: tuple[str, ...] | None = None,
                          consequence: str = "its numbers are measured on the data as it is now") -> None:
        """One line on stderr when the run's data differs from what it trained on (eval, sample, analyze); data
        that cannot be read now is left to the command, which says so."""
        from attnlab.errors import AttnlabError

        try:
            changes = self.data_changes(only)
        except (AttnlabError, OSError):
            return
        if changes:
            print(f"attnlab {command}: warning: {self.name}'s data differs from what it trained on ({changes}); "
                  f"{consequence}.", file=sys.stderr, flush=True)

    # ---- what training would do ------------------------------------------------------------------------------
    def plan(self, cache: dict | None = None, *, check: bool = True) -> Plan:
        """Say what :func:`~attnlab.train.loop.train` would do with this run, raising the AttnlabError it would
        raise before its first step: with ``check``, the device, the data, the model and the run's lock (``cache``,
        kept across calls, makes a grid load each dataset and build each model once); always, a run directory it
        could not continue (another config, a checkpoint without ``resume``). Checkpoint files without an intact
        pair plan "train" with a note (it starts afresh); ``check=False`` (training itself, which reads them once
        the model exists) plans "resume" for any checkpoint files without reading them."""
        from .checkpoint import has_checkpoint, resume_point
        from .lock import check_unlocked

        cache = {} if cache is None else cache
        cfg = self.cfg
        if check:
            if self.device.type == "cpu" and cfg.run.compile:  # the device is resolved (and checked) here
                check_compile_paths()
            self.task.check(cache)
            self.check_model(cache)
            check_unlocked(self.dir)  # another process is training it
        finished, resumable = (self.dir / RESULT).exists(), has_checkpoint(self.dir)
        if resumable and not cfg.run.resume:
            raise ConfigError(f"run directory {self.dir} already holds a checkpoint; pass --resume to continue it "
                              f"or --name to start another run.")
        if cfg.run.resume and (self.dir / CONFIG).exists() and (resumable or finished):
            self.check_same_config()
        if cfg.run.resume and resumable and not finished and not cfg.run.accept_data_change:
            changes = self.data_changes()
            if changes:
                raise ConfigError(f"cannot resume {self.dir}: its data differs from what it trained on, as recorded "
                                  f"in {DATA} ({changes}); put the data back, or pass --accept-data-change to "
                                  f"continue on the new data (recording it), or train a new run.")
        if cfg.run.resume and finished:
            return Plan("skip", result=self.result())
        if resumable and not check:
            return Plan("resume")
        if resumable:
            found, note = resume_point(self.dir)  # None: no intact pair, the run starts afresh
            return Plan("resume" if found else "train", found.epoch if found else 0, note)
        return Plan("train")

    def check_model(self, cache: dict) -> None:
        """Build the model once (on the meta device where its construction allows) so that a model option the
        model cannot take, or a geometry it cannot have, is one line now rather than a traceback later."""
        cfg = self.cfg
        key = ("model", cfg.model, cfg.attn, cfg.norm, cfg.drop_path, repr(sorted(cfg.model_options.items())),
               self.info, cfg.pretrained, cfg.pretrained_file)
        if key in cache:
            return
        with torch.random.fork_rng(devices=[]):  # leave the caller's random streams as they were
            model, device = None, "cpu"
            if not (cfg.pretrained or cfg.pretrained_file):  # else the weights are read and fitted too, on the CPU
                try:  # nothing is allocated or initialised on the meta device
                    with torch.device("meta"):
                        model, device = self.build_model(checking=True), "meta"
                except (NotImplementedError, RuntimeError, ConfigError):  # a set-up that reads a value (sigma's
                    pass  # .item(), which build_model reports as a ConfigError): built again on the CPU below
            if model is None:
                model = self.build_model(pretrained=True, checking=True)
            self.check_forward(model.eval(), device)
        cache[key] = True

    def check_forward(self, model: nn.Module, device: torch.device | str) -> None:
        """One forward of the task's example input, so that a geometry the data cannot pass (an ``img_size`` other
        than the images') is found now; on the meta device it costs nothing. Forced backends are checked first."""
        self.check_backends(model)
        try:
            with torch.no_grad():
                model(self.task.example_input(2, device))
        except NotImplementedError:
            if str(device) == "meta":  # an op without a meta kernel: the check is left to training
                return
            raise
        except (UnsupportedModelError, ConfigError) as err:  # a term or a forced backend says why itself
            if isinstance(err, UnsupportedModelError) or "backend cannot run" in str(err):
                raise
            raise self._cannot_build(err, ": it does not take the dataset's inputs",
                                     "the data (image size, channels, length)") from None
        except Exception as err:  # noqa: BLE001 - timm and torch raise what they raise for a shape
            raise self._cannot_build(err, ": it does not take the dataset's inputs",
                                     "the data (image size, channels, length)") from None

    def check_backends(self, model: nn.Module) -> None:
        """ConfigError when the spec forces a backend that cannot run this run's training steps (the C kernels are
        forward-only), before anything is written."""
        from attnlab.attention.base import AttnlabAttention
        from attnlab.models import attention_modules

        dtype = self.amp_dtype or torch.float32
        for name, module in attention_modules(model):
            why = isinstance(module, AttnlabAttention) and module.training_refusal(
                self.device, dtype, masked=bool(getattr(model, "causal", False)))
            if why:
                raise ConfigError(f"{self.cfg.attn} forces a backend that cannot train here ({name}): {why}; use "
                                  f"backend=auto for training, a forced backend for evaluation or benchmarks.")

    def check_same_config(self) -> None:
        saved = flat_settings(yaml.safe_load((self.dir / CONFIG).read_text()) or {})  # flat (before sections) or not
        if isinstance(saved.get("data_options"), dict):  # a run written before paths were stored absolute
            saved["data_options"] = _absolute_options(saved["data_options"])
        ours = flat_settings(self.config_dict())
        differ = sorted(k for k in ours if k not in RUNTIME_KEYS and saved.get(k) != ours[k])
        if differ:
            raise ConfigError(f"cannot resume {self.dir}: its config.yaml differs in {', '.join(differ)}; resume "
                              f"with the same settings, or train a new run under another name (--name in attnlab "
                              f"train, --runs-dir in attnlab compare).")

    # ---- the model -------------------------------------------------------------------------------------------
    def build_model(self, pretrained: bool = True, checking: bool = False) -> nn.Module:
        """The run's model (:meth:`Task.build_model <attnlab.train.tasks.base.Task.build_model>`); an error in
        its construction that its model options caused is one line naming them."""
        from attnlab.errors import AttnlabError

        self.task.check_model_name()
        try:
            return self.task.build_model(pretrained=pretrained)
        except AttnlabError:
            raise
        except Exception as err:  # noqa: BLE001 - timm and torch raise what they raise for a geometry
            if not self.cfg.model_options and not checking:
                raise
            raise self._cannot_build(err, "", "the model's constructor") from None

    def _cannot_build(self, err: Exception, why: str, check: str) -> ConfigError:
        """One line for a model that the run's options (or data) make fail, naming the options given."""
        given = f" with model options {self.cfg.model_options}" if self.cfg.model_options else ""
        reason = " ".join(str(err).split()) or type(err).__name__
        return ConfigError(f"model {self.cfg.model}{given} cannot be built for dataset {self.cfg.dataset}{why} "
                           f"({type(err).__name__}: {reason[:200]}); check the options against {check}.")

    # ---- reading a run on disk ---------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path, data_dir: str | None = None, tokenizer: str | None = None) -> "Run":
        """The run in directory ``path``, from its own config.yaml (ConfigError if it is not a run directory);
        ``data_dir`` and ``tokenizer`` replace the recorded ones (data that has moved)."""
        path = Path(path)
        if not (path / CONFIG).is_file():
            raise ConfigError(f"{path} is not a run directory (it has no {CONFIG}); give a directory made by "
                              f"attnlab train.")
        cfg = load_config(path / CONFIG)
        if data_dir is not None:
            cfg = cfg.replace(data_dir=data_dir)
        if tokenizer is not None:
            if not cfg.data_options.get("tokenizer"):
                what = "bytes" if cfg.dataset in ("text", "stdlib") else f"dataset {cfg.dataset}"
                raise ConfigError(f"--tokenizer says where the tokenizer.json of a text run trained through one lies "
                                  f"now, and {path} trained on {what}; drop it.")
            cfg = cfg.replace(data_options={**cfg.data_options, "tokenizer": tokenizer})
        # the directory is the run's, whatever its name: a reader neither renames nor refuses it
        run = cls(cfg.replace(runs_dir=str(path.parent), name=None))
        run.name, run.dir = path.name, path
        return run

    def result(self) -> dict[str, Any]:
        try:
            return json.loads((self.dir / RESULT).read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"{self.dir / RESULT} cannot be read ({err}); delete it to train the run again.") from None

    def load_model(self, map_location: str | torch.device = "cpu") -> nn.Module:
        """The model of the run's newest intact checkpoint, in eval mode on ``map_location`` (``"cpu"``,
        ``"cuda:1"``); the checkpoint's weights must fit the model its config.yaml describes (one line if not)."""
        from .checkpoint import NoIntactCheckpoint, find_weights

        model = self.build_model(pretrained=False)
        try:  # the weights alone (a reader never loads the trainer state), names and shapes checked from the header
            found = find_weights(self.dir, model=model)
        except NoIntactCheckpoint:
            found = find_weights(self.dir)  # intact but for another model: said below, as such
        if found is None:
            raise ConfigError(f"{self.dir} holds no checkpoint ({CONFIG} but no checkpoint.safetensors); train "
                              f"the run first.")
        note = found.fallback("using")  # analysis and eval read a run too: say which epoch they measure
        if note:
            print(f"{self.name}: {note}", file=sys.stderr, flush=True)
        own, theirs = set(model.state_dict()), set(found.weights)
        what = "; ".join(f"{word} {', '.join(sorted(keys)[:3])}" for word, keys in
                         (("missing", own - theirs), ("unexpected", theirs - own)) if keys)
        if not what:
            try:
                model.load_state_dict(found.weights)
            except RuntimeError as err:  # same keys, other shapes
                first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err))
                what = first[:200] or type(err).__name__  # never empty: an empty one would return the model unloaded
        if what:
            raise ConfigError(f"the checkpoint of {self.dir} does not fit the model its {CONFIG} describes "
                              f"({what}); was config.yaml edited or replaced?")
        # built on the CPU and then moved, as training does: sigma's set-up calls .item(), which meta cannot
        return model.to(map_location).eval()


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _absolute_options(options: dict) -> dict:
    """Data options with a path in them (a text run's tokenizer) made absolute."""
    if isinstance(options.get("tokenizer"), str) and options["tokenizer"]:
        return {**options, "tokenizer": _absolute(options["tokenizer"])}
    return options


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its data directory, data option paths and pretrained file absolute, so that config.yaml
    names what the run read wherever its directory is opened from (relative to the current directory)."""
    return cfg.replace(data_dir=_absolute(cfg.run.data_dir), data_options=_absolute_options(cfg.data_options),
                       pretrained_file=_absolute(cfg.pretrained_file) if cfg.pretrained_file else None)


def run_dir_of(cfg: TrainConfig) -> Path:
    """``<runs_dir>/<run_name>``, with the attention spec in its canonical form."""
    from attnlab.spec import parse_spec

    return Path(cfg.run.runs_dir) / run_name(cfg.replace(attn=str(parse_spec(cfg.attn))))


def load_run(run_dir: str | Path, map_location: str | torch.device = "cpu") -> tuple[nn.Module, TrainConfig]:
    """A run's model in eval mode with its last checkpoint's weights, on ``map_location``, and its config."""
    run = Run.open(run_dir)
    return run.load_model(map_location), run.cfg


__all__ = ["COMPILE_MODES", "Plan", "Run", "compile_mode", "load_run", "resolve_amp", "resolve_device", "run_dir_of"]
