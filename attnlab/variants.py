"""The registry of attention variants: one entry per method, the single place a new method is announced.

Adding a method is one new file (its module or function) plus one ``register(Variant(...))`` line below. Targets
are ``"module:attribute"`` strings imported on first use, so this file imports nothing from the layers above it.

Kinds, in the order a spec applies them:
- ``kernel``: the attention function itself, an :class:`attnlab.attention.base.AttnlabAttention` subclass;
- ``head``: a transform of each head's output before head merge (``nn.Module`` built from the options);
- ``qk``: changes to queries/keys or their weights, ``apply(model, modules, **options)``;
- ``weight``: weight-side reparametrisations, ``apply(model, modules, **options)``.

A term that acts during training as well (QK-clip's clip after each optimizer step) names its
:class:`TrainingHooks` in ``training=``; the trainer runs every registered term's hooks (each a no-op on models
without the term) and names no method itself.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import SpecError

KIND_ORDER = ("kernel", "head", "qk", "weight")


@dataclass(frozen=True)
class Option:
    """One ``key=value`` option of a term: its default (from the paper's main text), type and allowed values.

    A number is checked against ``minimum`` and ``maximum`` (inclusive; ``above``: a strict lower bound) and must be
    finite (nan and inf are no setting of any option)."""

    default: Any
    type: type | tuple[type, ...] = float
    choices: tuple[Any, ...] | None = None
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None

    def parse(self, term: str, key: str, raw: str) -> Any:
        """Coerce the text ``raw`` to this option's type, or raise SpecError naming what is valid."""
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        value: Any = None
        for typ in types:
            try:
                if typ is bool:
                    if raw.lower() not in ("true", "false", "1", "0"):
                        continue
                    value = raw.lower() in ("true", "1")
                else:
                    value = typ(raw)
                break
            except ValueError:
                continue
        else:
            if self.choices:
                raise SpecError(f"{term}({key}={raw}) is not valid; {key} is one of: {', '.join(map(str, self.choices))}.")
            names = " or ".join(t.__name__ for t in types)
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} takes a {names}.")
        if self.choices is not None and isinstance(value, str) and value not in self.choices:
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} is one of: {', '.join(map(str, self.choices))}.")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self._check_range(term, key, raw, value)
        return value

    def _check_range(self, term: str, key: str, raw: str, value: float) -> None:
        if not math.isfinite(value):
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} must be a finite number.")
        low = (self.minimum is not None and value < self.minimum) or (self.above is not None and value <= self.above)
        if low or (self.maximum is not None and value > self.maximum):
            bounds = [f"{word} {bound:g}" for word, bound in (("at least", self.minimum), ("above", self.above),
                                                               ("at most", self.maximum)) if bound is not None]
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} must be {' and '.join(bounds)}.")


@dataclass(frozen=True)
class Variant:
    """A registry entry: what a spec term means and where its code lives."""

    name: str
    kind: str
    summary: str
    paper: str
    target: str
    options: dict[str, Option] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)
    demo: bool | str = True  # trained in `make demo` (a string: the spec the demo trains, e.g. with options)
    training: str | None = None  # "module:attribute" of the term's TrainingHooks, if it acts during training

    def load(self) -> Callable[..., Any]:
        return _resolve(self.target)


@dataclass(frozen=True)
class TrainingHooks:
    """What a term does during training. ``attach(model, optimizer)`` runs once the optimizer exists (a no-op for
    models without the term); ``stats(model) -> dict`` is merged into each epoch's metrics line (empty without it)."""

    attach: Callable[[Any, Any], Any]
    stats: Callable[[Any], dict[str, float]]


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def training_hooks() -> list[TrainingHooks]:
    """The :class:`TrainingHooks` of every registered term that acts during training, in registry order."""
    return [_resolve(v.training) for v in VARIANTS.values() if v.training]


VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    if variant.kind not in KIND_ORDER:
        raise ValueError(f"unknown variant kind {variant.kind!r}")
    VARIANTS[variant.name] = variant
    return variant


def list_variants() -> list[dict[str, Any]]:
    """The spec table as data: one dict per registered term with its kind, summary, paper and options."""
    return [
        {
            "name": v.name,
            "kind": v.kind,
            "summary": v.summary,
            "paper": v.paper,
            "options": {k: {"default": o.default, "choices": o.choices, "help": o.help} for k, o in v.options.items()},
        }
        for v in VARIANTS.values()
    ]


# ---------------------------------------------------------------------------------------------------------------
# The registry. One line (one entry) per method.
# ---------------------------------------------------------------------------------------------------------------
def _backend(*names: str, help: str = "auto: SDPA, or the explicit product where it measures faster (a CPU "
                                       "training step with few keys)") -> Option:
    """A kernel's ``backend`` option: ``auto`` (the dispatcher's choice) or one of the backends its record declares."""
    return Option("auto", str, choices=("auto", *names), help=help + "; a forced backend that cannot run a call "
                                                                       "says why")


_SIGMA_TARGETS = Option("all", str, choices=("all", "attn"),
                        help="all: every Linear and Conv2d; attn: the Linears inside the attention modules")
_SIGMA_SPECNORM = ("specnorm is sigma-Reparam with gamma removed, so the two would normalise the same weights twice; "
                   "pick one")

register(Variant(
    "standard", "kernel", "softmax attention, fused SDPA (timm's)", "Vaswani et al. 2017",
    "attnlab.attention.standard:StandardAttention",
    options={"backend": _backend("sdpa", "explicit")},
))
register(Variant(
    "ns", "head", "Newton-Schulz step on each head's feature-by-token output before head merge", "NS-Attn (Sec. 2, Alg. 1)",
    "attnlab.attention.ns:NSTransform",
    options={
        "steps": Option(1, int, minimum=1, help="polynomial iterations K (paper: 1; ablation: 2)"),
        "eps": Option(1e-6, float, above=0.0, help="clamp of both Frobenius-norm divisions (> 0)"),
        "backend": Option("auto", str, choices=("auto", "kernel", "fast", "reference"),
                          help="auto: fused CPU kernel without gradient, else the Gram-space torch path (fast); "
                               "reference: Algorithm 1 literally"),
    },
))
register(Variant(
    "dna", "kernel", "denoising attention: softmax(Q+K^T/sqrt(d))V+ + alpha_h * softmin(Q-K^T/sqrt(d))V-",
    "DnA: Denoising Attention for Visual Tasks (Sec. 3.2, Table 12)", "attnlab.attention.dna:DnAAttention",
    options={
        "variant": Option("qv", str, choices=("qv", "q", "v", "shared", "sum"),
                          help="qv: separate Q and V per branch; q: separate Q, shared V; v: shared Q, separate V; "
                               "shared: one Q and V, learnable alpha; sum: one Q and V, alpha fixed at 1"),
        "alpha_init": Option(0.5, float, help="initial alpha_h of every head (learnable; not used by variant=sum)"),
        "scale": Option("both", str, choices=("both", "neg_only"),
                        help="both: 1/sqrt(d) on both branches (main text, authors' code); neg_only: Algorithm 1"),
        "init": Option("random", str, choices=("random", "copy"),
                       help="negative branch on conversion: random (timm's init) or copy (warm start "
                            "Q- = |neg_init| Q, V- = neg_init V)"),
        "neg_init": Option(1e-4, float, help="warm-start factor; negative flips V- as the authors' video code"),
        "backend": _backend("kernel", "triton", "sdpa", "explicit",
                            help="auto: the fused CPU kernel where it runs, Triton where opted in, else SDPA"),
    },
))
register(Variant(
    "diff", "kernel", "Differential attention: (softmax(q1k1) - lambda softmax(q2k2)) v, per-head RMSNorm (timm's)",
    "Ye et al. 2024", "attnlab.attention.diff:DiffAttention",
    options={"dual_lambda": Option(False, bool, help="timm's 2-scalar lambda instead of the paper's 4 vectors"),
             "backend": _backend("sdpa", "explicit")},
))
register(Variant(
    "cog", "kernel", "Cog attention: sign(s) * softmax(|s|), first and last layers softmax", "Lv et al. 2024",
    "attnlab.attention.cog:CogAttention",
    options={"all_layers": Option(False, bool, help="signed weights in the first and last layers too"),
             "backend": _backend("sdpa", "explicit")},
    demo="cog(all_layers=true)",  # the demo's 2-block model has only a first and a last layer
))
register(Variant(
    "nystrom", "kernel", "Nystrom approximation: softmax(q k~) pinv(softmax(q~ k~)) softmax(q~ k) v, m landmarks",
    "Xiong et al. 2021 (Nystromformer, Eq. 14-16)", "attnlab.attention.nystrom:NystromAttention",
    options={
        "landmarks": Option(64, int, minimum=1, help="landmarks m: means of m contiguous token segments of q and k; "
                                                      "m >= N is exact softmax attention"),
        "pinv": Option("iterative", str, choices=("iterative", "exact"),
                       help="iterative: Eq. 16's Moore-Penrose iteration; exact: the SVD pseudo-inverse"),
        "iters": Option(6, int, minimum=1, help="iterations of Eq. 16 (paper: 6)"),
        "conv": Option(0, int, minimum=0, help="kernel length of the depthwise-convolution skip on v (odd; 0: none; "
                                               "the authors' LRA code: 35)"),
        "z0": Option("head", str, choices=("head", "authors", "lucidrains"),
                     help="scale of Eq. 16's initial guess: head (per matrix; samples stay independent), authors (one "
                          "maximum column sum over the batch), lucidrains (max column x max row sum over the batch)"),
    },
    demo=False,  # a long-sequence kernel: the demo's 16 tokens are fewer than its 64 landmarks
))
register(Variant(
    "performer", "kernel", "FAVOR+: positive orthogonal random features phi, phi(q) (phi(k)^T v) / phi(q) phi(k)^T 1",
    "Choromanski et al. 2021 (Performer, Lemma 1, Sec. 2.4)", "attnlab.attention.performer:PerformerAttention",
    options={
        "features": Option(256, int, minimum=1, help="random features M"),
        "redraw": Option(0, int, minimum=0, help="draw new features every this many training forwards (0: never; "
                                                 "1: every call, as Google's FAVOR+)"),
        "seed": Option(0, int, minimum=0, help="seed of the feature draws (with the block index and draw number)"),
        "backend": _backend("kernel", "explicit", help="auto: the fused CPU kernel for float32 passes without "
                                                       "gradient or mask, else torch ops (explicit)"),
    },
    demo=False,  # a long-sequence kernel (benchmarks/long_sequence.py, the listops dataset)
))
register(Variant(
    "sigma", "weight", "sigma-Reparam: W_hat = gamma * W / sigma(W) on every Linear and the patch embedding",
    "Zhai et al. 2023", "attnlab.reparam.sigma:apply_sigma",
    options={
        "gamma_init": Option("sigma", (float, str), choices=("sigma",),
                             help="'sigma': gamma = sigma(W0), so W_hat = W at step 0 (authors' vision code); "
                                  "a number: gamma starts there (the note's literal gamma = 1)"),
        "targets": _SIGMA_TARGETS,
        "estimate": Option("stored", str, choices=("stored", "refresh"),
                           help="eval-mode sigma: stored = ||W u|| (W_hat = W exactly at conversion, folds "
                                "as evaluated); refresh = the authors' ||W^T v|| after one unsaved iteration"),
    },
    conflicts={"specnorm": _SIGMA_SPECNORM},
))
register(Variant(
    "specnorm", "weight", "plain spectral normalisation W / sigma(W), no gamma (sigma-Reparam's ablation)",
    "Zhai et al. 2023", "attnlab.reparam.sigma:apply_specnorm",
    options={"targets": _SIGMA_TARGETS,
             "estimate": Option("stored", str, choices=("stored", "refresh"),
                                help="eval-mode sigma: ||W u|| (stored) or the authors' ||W^T v|| (refresh)")},
    conflicts={"sigma": _SIGMA_SPECNORM},
    demo=False,  # an ablation (the note: ViT-B drops from 82.2% to 69.8%); `attnlab compare --attn specnorm`
))
register(Variant(
    "speccond", "weight", "spectral conditioning: W_Q, W_K, W_V -> W + lam * I_k, lam fixed",
    "Spectral Conditioning of Attention (NeurIPS 2025)", "attnlab.reparam.speccond:apply_speccond",
    options={
        "lam": Option("auto", (float, str), choices=("auto",), minimum=0.0,
                      help="the multiple of I_k; 'auto' (default): the corrected Theorem 3.8's bound "
                           "max sigma_max + 1 on the initial weights; 10 is the value a summary reports (unverified)"),
        "targets": Option("qkv", str, choices=("qkv", "qkv+mlp"),
                          help="qkv: the attention's query, key and value weights; qkv+mlp: also the MLP's"),
    },
))
register(Variant(
    "qknorm", "qk", "LayerNorm over head_dim on q and k before the 1/sqrt(D) scale (timm's qk_norm=True)",
    "Dehghani et al. 2023", "attnlab.reparam.qknorm:apply",
))
register(Variant(
    "qkclip", "qk", "after each optimizer step, rescale W_q, W_k of heads whose max logit exceeded tau",
    "Kimi Team 2025 (Kimi K2, MuonClip)", "attnlab.reparam.qkclip:apply", training="attnlab.reparam.qkclip:TRAINING",
    options={
        "tau": Option(100.0, float, above=0.0, help="largest allowed per-head logit q.k/sqrt(D) (> 0)"),
        "alpha": Option(0.5, float, minimum=0.0, maximum=1.0,
                        help="share of the rescaling on W_q, in [0, 1] (W_k takes 1 - alpha)"),
    },
    conflicts={
        "qknorm": "QK-norm normalises q and k after the projection, which divides out any rescaling of W_q and W_k, "
                  "so the clip would have no effect",
        "sigma": "sigma-Reparam recomputes qkv's weight as gamma W / sigma(W), so scaling rows of W would not scale "
                 "the logits by the clip's factor",
        "specnorm": "spectral normalisation recomputes qkv's weight as W / sigma(W), so scaling rows of W would not "
                    "scale the logits by the clip's factor",
        "speccond": "spectral conditioning adds lambda I_k to qkv's weight, so scaling rows of W would not scale the "
                    "logits by the clip's factor",
    },  # kernels by capability: qkclip.apply refuses a module whose record does not declare plain_softmax
))
