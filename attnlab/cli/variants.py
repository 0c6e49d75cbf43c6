"""List the terms of the variant spec language: name, kind, options with defaults, what it is, and its paper.

Terms join with '+': at most one attention kernel, then head-output transforms, q/k terms and weight terms (the
kind column: kernel, head, qk, weight). Example: attnlab train --attn 'dna(variant=q)+ns'.

With --cost MODEL, also count each variant's parameters and forward GFLOPs on MODEL (batch 1)."""

from __future__ import annotations

import argparse
import json


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--cost", metavar="MODEL", help="count parameters and forward GFLOPs per variant on MODEL "
                   "(a preset or timm name, e.g. vit_base_patch16_224)")
    p.add_argument("--attn", default=None, help="comma-separated specs for --cost (default: every kernel variant)")


def _options(options: dict) -> str:
    from ..spec import format_value

    parts = []
    for key, opt in options.items():
        text = f"{key}={format_value(opt['default'])}"
        if opt["choices"]:
            text += f" [{'|'.join(map(str, opt['choices']))}]"
        parts.append(text)
    return ", ".join(parts) or "-"


def run(args) -> int:
    from ..variants import list_variants

    table = list_variants()
    if args.cost:
        from ..analysis.cost import format_costs, variant_costs
        from ..spec import split_specs

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
