"""``attnlab`` command line: train | compare | report | analyze | bench | variants | export.

Each subcommand lives in its own module with ``configure(parser)`` and ``run(args) -> int``. Errors a user can cause
(:class:`attnlab.AttnlabError`) become one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import AttnlabError, NonFiniteLossError

COMMANDS = {
    "train": "train one model with a recipe (the NS-Attn paper's ns_cifar by default)",
    "compare": "train a grid (variants x seeds x datasets x models) and print the report",
    "report": "rebuild report.md / report.json from a runs directory",
    "analyze": "run the papers' instruments on a trained run or a fresh model",
    "bench": "forward latency of variants with identical parameters (NS-Attn paper's protocol)",
    "variants": "list the attention variant terms of the spec language",
    "export": "write a model's weights with every reparametrisation folded, as safetensors",
}


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Attention variants of four papers (NS-Attn, DnA, spectral conditioning, sigma-Reparam) on timm's "
                    "ViT and Swin: train, compare on matched seeds, analyse, benchmark. A variant is a spec string "
                    "such as 'ns', 'dna(variant=q)+ns' or 'ns+sigma'; see `attnlab variants`.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"attnlab.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"attnlab.cli.{name}":
                continue
            raise
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except NonFiniteLossError as err:
        print(f"attnlab {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except AttnlabError as err:
        print(f"attnlab {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
