"""List the terms of the variant spec language: name, kind, options with defaults, what it is, and its paper.

Terms join with '+': at most one attention kernel, then head-output transforms, q/k terms and weight terms (the
kind column: kernel, head, qk, weight). Example: attnlab train --attn 'dna(variant=q)+ns'.

With --cost MODEL, also count each variant's parameters and forward GFLOPs on MODEL (batch 1).
With --support MODEL, list MODEL's attention modules by type, the terms that act on each, and why the others do not
(XCiT's and DaViT's channel maps take only the weight terms and ns)."""

from __future__ import annotations

import argparse
import json

from ..spec import format_value, split_specs
from ..variants import list_variants


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--cost", metavar="MODEL", help="count parameters and forward GFLOPs per variant on MODEL "
                   "(a preset or timm name, e.g. vit_base_patch16_224)")
    p.add_argument("--support", metavar="MODEL", help="which terms apply to which attention modules of MODEL "
                   "(a preset or timm name, e.g. xcit_nano_12_p16_224, davit_tiny)")
    p.add_argument("--attn", default=None, help="comma-separated specs for --cost (default: every kernel variant)")


def _options(options: dict) -> str:
    parts = []
    for key, opt in options.items():
        text = f"{key}={format_value(opt['default'])}"
        if opt["choices"]:
            text += f" [{'|'.join(map(str, opt['choices']))}]"
        parts.append(text)
    return ", ".join(parts) or "-"


def run(args) -> int:
    table = list_variants()
    if args.support:
        from ..models import build_model
        from ..models.convert import term_support

        groups = term_support(build_model(args.support, attn=None))
        print(json.dumps(groups, indent=2) if args.json else _format_support(args.support, groups))
        return 0
    if args.cost:
        from ..analysis.cost import format_costs, variant_costs

        specs = split_specs(args.attn) if args.attn else [v["name"] for v in table if v["kind"] == "kernel"]
        rows = variant_costs(args.cost, specs)
        print(json.dumps(rows, indent=2) if args.json else format_costs(rows))
        return 0
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print("| term | kind | options (defaults) | what | paper |")
    print("|---|---|---|---|---|")
    for v in table:
        print(f"| {v['name']} | {v['kind']} | {_options(v['options'])} | {v['summary']} | {v['paper']} |")
    return 0


def _format_support(model: str, groups: list[dict]) -> str:
    lines = [f"{model}: attention modules and the spec terms that act on them", "",
             "| modules | type | computes | terms that apply | refused, and why |", "|---|---|---|---|---|"]
    for g in groups:
        names = g["modules"]
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)})"
        refused = "; ".join(f"{t}: {why}" for t, why in g["refused"].items()) or "-"
        lines.append(f"| {shown} | {g['type']} | {g['family']} | {', '.join(g['applies']) or '-'} | {refused} |")
    return "\n".join(lines)
