"""The instruments `attnlab analyze` and the demo can run by name, each ``fn(model, images, batch_size, ctx) ->
dict`` with a flat ``summary`` of floats (what report tables show), a ``detail`` (what analysis.json keeps) and
optionally ``figures`` (paths written into ``ctx.out_dir``). ``ctx`` carries the images' labels and where figures
go. An instrument that does not apply to a model raises UnsupportedModelError, which :func:`analyze_model` can
record and pass over."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..models.vlm import VideoPrompts
from .dna import branch_instruments
from .entropy import attention_entropy, max_logits, qk_spectral_norms
from .jacobian import jacobian_conditioning
from .redundancy import head_redundancy, plot_redundancy, redundancy_summary
from .relevance import plot_relevance, relevance_maps
from .robustness import plot_robustness, representational_robustness, robustness_summary
from .spectra import head_output_spectra, plot_spectra

RELEVANCE_IMAGES = 4  # images drawn with their relevance overlays per run


@dataclass
class Context:
    """What an instrument may use besides the model and images: ``labels`` (n,) or None, ``out_dir`` for per-run
    figures (None: write none) and ``prefix`` for their file names."""

    labels: torch.Tensor | None = None
    out_dir: Path | None = None
    prefix: str = ""

    def figure(self, name: str) -> Path | None:
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self.out_dir / f"{self.prefix}{name}"


def by_group(model: nn.Module, names: list[str], measures: dict[str, list[float]]) -> dict[str, float]:
    """``{f"{measure}_{group}": mean over the group's layers}`` for the attention groups a model declares
    (TimeSformer: ``spatial``, ``temporal``; none for other models), so that the two attentions of a divided block
    are reported apart as well as together."""
    out = {}
    for group, pattern in (getattr(model, "attention_groups", None) or {}).items():
        for measure, values in measures.items():
            picked = [v for n, v in zip(names, values) if fnmatchcase(n, pattern)]
            if picked:
                out[f"{measure}_{group}"] = sum(picked) / len(picked)
    return out


def _spectra(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    s = head_output_spectra(model, images, batch_size=batch_size).summary()
    blocks = s.get("blocks") or []
    groups = by_group(model, [b["layer"] for b in blocks], {k: [b[k] for b in blocks] for k in ("p1", "eff_rank")})
    return {"summary": {"p1": s["p1"], "eff_rank": s["eff_rank"], **groups}, "detail": s}


def _entropy(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    layers = attention_entropy(model, images, batch_size=batch_size)
    logits = max_logits(model, images, batch_size=batch_size)
    detail = [{"layer": e["layer"], "entropy_mean": e["mean"].tolist(), "entropy_low": e["low"].tolist(),
               "log_n": e["log_n"], "max_logit": m["max"].tolist()} for e, m in zip(layers, logits)]
    summary = {"entropy": torch.cat([e["mean"] for e in layers]).mean().item(),
               **by_group(model, [e["layer"] for e in layers], {"entropy": [e["mean"].mean().item() for e in layers]}),
               "entropy_min_head": torch.cat([e["mean"] for e in layers]).min().item(),
               "max_logit": torch.cat([m["max"] for m in logits]).max().item()}
    return {"summary": summary, "detail": detail}


def _qk_norms(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    norms = qk_spectral_norms(model)
    flat = torch.cat([n["norm"] for n in norms])
    return {"summary": {"qk_norm_max": flat.max().item(), "qk_norm_mean": flat.mean().item()},
            "detail": [{"layer": n["layer"], "norm": n["norm"].tolist()} for n in norms]}


def _branches(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    return _branch_result(model, branch_instruments(model, images, batch_size=batch_size))


def _branch_result(model: nn.Module, measured) -> dict:
    summary = measured.summary()
    flat = {k: v for k, v in summary.items() if k.endswith("_mean") and isinstance(v, float)}
    flat.update(by_group(model, measured.layers, {f"{k}_mean": [float(t.double().mean()) for t in getattr(measured, k)]
                                                  for k in ("intruders", "value_similarity", "branch_cosine")}))
    return {"summary": flat, "detail": summary}


def _jacobian(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    # one sequence (image or window) per block and head, float64 SVD: seconds per block on a CPU
    result = jacobian_conditioning(model, images[:1])
    per_block = result.log10_mean()
    return {"summary": {"log10_kappa": per_block.nanmean().item()},
            "detail": {**result.to_dict(), "log10_kappa_per_block": per_block.tolist()}}


def _redundancy(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    layers = head_redundancy(model, images, batch_size=batch_size)
    return {"summary": redundancy_summary(layers), "detail": layers}


def _robustness(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    result = representational_robustness(model, images, labels=ctx.labels, batch_size=batch_size)
    return {"summary": robustness_summary(result), "detail": result}


def _relevance(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    shown = images[:RELEVANCE_IMAGES]
    rel = relevance_maps(model, shown, batch_size=min(batch_size, RELEVANCE_IMAGES))
    detail = {"classes": rel.classes.tolist(), "prefix": rel.prefix,
              "maps": {b: m.tolist() for b, m in rel.maps.items()}}
    path = ctx.figure("relevance.png")
    if path is not None:
        plot_relevance(shown, rel, path, title=ctx.prefix.rstrip("-"))
    return {"summary": {}, "detail": detail, "figures": [str(path)] if path is not None else []}


def _curves(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    raise UnsupportedModelError("training curves are read from run directories (metrics.jsonl), not measured on a "
                                "model; give run directories to attnlab analyze or call analysis.training_curves.")


def _predictions(model: nn.Module, images: torch.Tensor, batch_size: int, ctx: Context) -> dict:
    raise UnsupportedModelError("predictions draws a detector's boxes and masks beside the ground truth of its "
                                "dataset; give detection run directories to attnlab analyze, or call "
                                "analysis.predictions.predictions_figures.")


INSTRUMENTS: dict[str, Callable[[nn.Module, torch.Tensor, int, Context], dict]] = {
    "spectra": _spectra,    # NS-Attn Sec. 3.4: p1 and effective rank of head outputs
    "entropy": _entropy,    # sigma-Reparam: attention entropy per layer/head, max scaled logit per head
    "qk": _qk_norms,        # sigma-Reparam note Thm 3.1: ||W_Q,h W_K,h^T||_2 per head
    "branches": _branches,  # DnA Sec. 4.4 / App. C.5: intruders, C(V+, V-), branch cosine (dna and diff models)
    "jacobian": _jacobian,  # spectral conditioning Figs. 2-4: log10 condition number of the attention Jacobian
    "redundancy": _redundancy,  # DnA App. C.5 (C), Fig. 12: mean 1 - cos between heads' maps, per layer and branch
    "robustness": _robustness,  # DnA Sec. 4.5, Fig. 9: token cosine distance per block, clean and noisy; top-1 drop
    "relevance": _relevance,    # DnA Sec. 4.3, App. C.5 (E): Chefer et al.'s signed relevance per branch
    "curves": _curves,          # train/test loss and top-1 per epoch per variant (run directories only)
    "predictions": _predictions,  # DnA Fig. 10: detections beside the ground truth (detection runs only)
}


def _probe_relevance(model: nn.Module, prompts: VideoPrompts, batch_size: int, ctx: Context) -> dict:
    from .probe_relevance import plot_probe_relevance, vlm_probe_relevance

    shown = prompts[:RELEVANCE_IMAGES]
    rel = vlm_probe_relevance(model, shown.tokens, shown.clips, shown.num_frames, position=shown.lengths - 1)
    figures = []
    for i in range(len(shown)):
        path = ctx.figure(f"probe_relevance_{i}.png")
        if path is not None:
            figures.append(str(plot_probe_relevance(shown.clips, rel, path, sample=i)))
    detail = {"layers": list(rel.layers), "targets": rel.targets.tolist(), "scores": rel.scores.tolist(),
              "maps": {b: rel.total(b).tolist() for b in rel.maps}}
    return {"summary": {}, "detail": detail, "figures": figures}


def _probe_branches(model: nn.Module, prompts: VideoPrompts, batch_size: int, ctx: Context) -> dict:
    from .probe_dna import probe_branch_instruments

    return _branch_result(model, probe_branch_instruments(model.vision, prompts.clips, prompts.num_frames,
                                                          merge_size=model.merge_size, batch_size=batch_size))


#: on a video LLM (its inputs :class:`VideoPrompts`) the instruments measure the visual probes' interaction modules
PROBE_INSTRUMENTS: dict[str, Callable[[nn.Module, VideoPrompts, int, Context], dict]] = {
    "relevance": _probe_relevance,  # DnA Sec. 4.3, Figs. 4(b) and 14: each probe's relevance over the video tokens
    "branches": _probe_branches,    # DnA Sec. 4.4 on the probes' cross-DnA: intruders, C(V+, V-), branch cosine
}


def _instrument(name: str, images):
    if not isinstance(images, VideoPrompts):
        return INSTRUMENTS[name]
    if name not in PROBE_INSTRUMENTS:
        raise UnsupportedModelError(f"{name} measures a transformer's self-attention on images or token blocks; on a "
                                    f"video LLM attnlab measures the visual probes: "
                                    f"{', '.join(PROBE_INSTRUMENTS)}.")
    return PROBE_INSTRUMENTS[name]


def analyze_model(model: nn.Module, images: torch.Tensor | VideoPrompts, what: list[str], batch_size: int = 32, *,
                  labels: torch.Tensor | None = None, out_dir: str | Path | None = None, prefix: str = "",
                  skip_unsupported: bool = False, progress: bool = False) -> dict:
    """Run the instruments ``what`` on ``model``; returns ``{"summary": {...}, name: detail, ..., "figures": [...]}``.

    ``images``: what the model takes (a video LLM's :class:`VideoPrompts`: the probe instruments run).
    ``labels`` (one per image) feed the instruments that need them (robustness's top-1); per-run figures go to
    ``out_dir`` (file names start with ``prefix``). With ``skip_unsupported`` an instrument that does not apply to
    the model is recorded under ``"skipped"`` (name -> the one-line reason) and the others run. ``progress`` shows
    a bar over the instruments and one over the images each forward pass feeds.
    """
    from tqdm.auto import tqdm

    ctx = Context(labels=labels, out_dir=None if out_dir is None else Path(out_dir), prefix=prefix)
    out: dict = {"summary": {}}
    outer = tqdm(what, desc="instruments", unit="instrument", disable=not progress, leave=False)
    inner = tqdm(desc="images", unit="img", disable=not progress, leave=False)

    def tick(module, args):
        inner.update(args[0].shape[0])

    ticker = model.register_forward_pre_hook(tick)
    try:
        for name in outer:
            outer.set_postfix_str(name)
            inner.reset()
            try:
                result = _instrument(name, images)(model, images, batch_size, ctx)
            except UnsupportedModelError as err:
                if not skip_unsupported:
                    raise
                out.setdefault("skipped", {})[name] = str(err)
                continue
            out["summary"].update(result["summary"])
            out[name] = result["detail"]
            out.setdefault("figures", []).extend(result.get("figures", []))
    finally:
        ticker.remove()
        inner.close()
        outer.close()
    return out


def plot_results(results: dict[str, dict], out_dir: str | Path) -> list[Path]:
    """PNG figures for what ``results`` (label -> analyze_model output + ``attn``) holds; returns their paths."""
    from .figures import variant_colors

    out_dir = Path(out_dir)
    paths = []
    by_variant = variant_colors({r["attn"] for r in results.values() if "attn" in r})
    colors = {label: by_variant["".join(str(r["attn"]).split())] for label, r in results.items() if "attn" in r}
    curves: dict[tuple[str, int], list[list[float]]] = defaultdict(list)
    for result in results.values():
        spectrum = result.get("spectra", {}).get("mean_spectrum")
        if spectrum is not None:
            curves[result["attn"], len(spectrum)].append(spectrum)
    if curves:  # Figure 2: each variant's mean spectrum, averaged over its runs (seeds)
        mixed = len({n for _, n in curves}) > 1
        mean = {(f"{attn} (D={n})" if mixed else attn): torch.tensor(c).mean(0).tolist()
                for (attn, n), c in curves.items()}
        spectrum_colors = {(f"{attn} (D={n})" if mixed else attn): by_variant["".join(attn.split())]
                           for attn, n in curves}
        paths.append(Path(plot_spectra(mean, out_dir / "spectra.png", colors=spectrum_colors)))
    # DnA Figure 12 (one line per run and branch) and Figure 9 (one panel per sigma)
    for name, plot in (("redundancy", plot_redundancy), ("robustness", plot_robustness)):
        found = {label: r[name] for label, r in results.items() if r.get(name)}
        if found:
            plot(found, out_dir / f"{name}.png", colors=colors)
            paths.append(out_dir / f"{name}.png")
    return paths


def _instrumented(run, model: nn.Module) -> nn.Module:
    """What the instruments measure of a run's model: the model, or what its task says (a detector's backbone)."""
    return getattr(run.task, "instrument_model", lambda m: m)(model)


def annotate_runs(run_dirs: list[str | Path], what: list[str], images: int = 160, batch_size: int = 32,
                  progress: bool = True) -> None:
    """Add the instruments' summaries to each finished run's ``result.json`` under ``extra`` (skipping runs that
    already have them), measured on the first ``images`` test images of the run's dataset."""
    import json

    from ..train.checkpoint import atomic_write_json
    from ..train.files import RESULT
    from ..train.run import Run

    cache: dict = {}
    for run_dir in map(Path, run_dirs):
        result_path = run_dir / RESULT
        if not result_path.exists():
            continue
        result = json.loads(result_path.read_text())
        todo = [w for w in what if not result.get("analyzed", {}).get(w)]
        if not todo:
            continue
        run = Run.open(run_dir)
        model, cfg = _instrumented(run, run.load_model()), run.cfg
        key = (cfg.dataset, cfg.run.data_dir, repr(sorted(cfg.data_options.items())))
        if key not in cache:
            cache[key] = run.task.instrument_inputs(images)
        out = analyze_model(model, cache[key], todo, batch_size=batch_size, skip_unsupported=True)
        summary = out["summary"]
        result.setdefault("extra", {}).update(summary)
        result.setdefault("analyzed", {}).update({w: w not in out.get("skipped", {}) for w in todo})
        result.setdefault("skipped", {}).update(out.get("skipped", {}))
        atomic_write_json(result_path, result)
        if progress:
            print(f"  {run_dir.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()), flush=True)


def check_instruments(what: list[str], configs: list) -> None:
    """ConfigError, before a grid trains, for an instrument of ``what`` that applies to none of its runs (``branches``
    on a grid without a two-branch variant, say): each distinct model of the grid is built untrained and the
    instruments run on two of its test inputs (runs an instrument does not apply to are skipped after training)."""
    from ..errors import ConfigError
    from ..train.run import Run

    reasons: dict[str, str] = {}
    applies: set[str] = set()
    seen = set()
    for cfg in configs:
        run = Run(cfg)
        key = (run.cfg.model, run.cfg.attn, run.cfg.dataset, run.cfg.norm, repr(sorted(run.cfg.model_options.items())))
        if key in seen or applies >= set(what):
            continue
        seen.add(key)
        with torch.random.fork_rng(devices=[]):
            model = _instrumented(run, run.build_model(pretrained=False).eval())
        inputs = run.task.instrument_inputs(2)
        skipped = analyze_model(model, inputs, [w for w in what if w not in applies], batch_size=2,
                                skip_unsupported=True).get("skipped", {})
        applies |= {w for w in what if w not in skipped}
        for name, reason in skipped.items():
            reasons.setdefault(name, reason)
    missing = [w for w in what if w not in applies]
    if missing and configs:
        raise ConfigError(f"--analyze {missing[0]} applies to none of the grid's runs ({reasons[missing[0]]}); drop it "
                          f"from --analyze or add a variant it measures.")
