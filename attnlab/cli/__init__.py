"""``attnlab`` command line: train | compare | report | analyze | bench | variants | export | eval | sample | data.

Each subcommand lives in its own module with ``configure(parser)`` and ``run(args) -> int``; ``configure`` imports
nothing heavy (no torch), so that ``--help`` and argument errors answer at once. Errors a user can cause
(:class:`attnlab.AttnlabError`, a bad flag, a path that cannot be read or written) become one line on stderr and
exit code 2, never a traceback. Ctrl-C and SIGTERM (what SLURM and Kubernetes send) stop the command at once with
one line, exit code 130 and 143; files are written atomically, so what was written stays whole.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

from ..errors import AttnlabError, ConfigError, NonFiniteLossError, did_you_mean

COMMANDS = {
    "train": "train one model with a recipe (the NS-Attn paper's ns_cifar by default)",
    "compare": "train a grid (variants x seeds x datasets x models) and print the report",
    "report": "write report.md, report.json and one offline report.html from a runs directory",
    "analyze": "run the papers' instruments on a trained run or a fresh model",
    "bench": "forward latency of variants with identical parameters (NS-Attn paper's protocol)",
    "variants": "list the attention variant terms of the spec language",
    "export": "write a model's weights with every reparametrisation folded, as safetensors (or, --hf, Llama/Qwen "
              "runs in Hugging Face's layout)",
    "eval": "top-1, top-5, loss and the DnA paper's robustness metrics of a run or of given weights, as JSON",
    "sample": "generate text from a trained language-model run",
    "data": "prepare a text corpus once: tokenized .bin shards with a manifest (attnlab data prepare)",
}


class Parser(argparse.ArgumentParser):
    """argparse with attnlab's error contract: one line on stderr, exit code 2, no abbreviated long flags, and the
    nearest valid flag or choice suggested for a typo."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}

    def error(self, message: str):
        choice = re.match(r"argument (.+?): invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if choice:
            valid = re.findall(r"'([^']*)'", choice[3])
            message = (f"argument {choice[1]}: invalid choice {choice[2]!r}{did_you_mean(choice[2], valid)}; "
                       f"choose from {', '.join(valid)}")
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        if argv and argv[0].startswith("--") and self.commands:  # before the command: only attnlab's own flags
            flags = [o for a in self._actions for o in a.option_strings]
            if argv[0].split("=", 1)[0] not in flags:
                self.error(f"unknown option {argv[0]}{did_you_mean(argv[0], flags)}; give a command first, e.g. "
                           "`attnlab train --help`")
        args, extras = self.parse_known_args(argv, namespace)
        if extras:
            target = self.commands.get(getattr(args, "command", None), self)
            flag = extras[0].split("=", 1)[0]
            if flag.startswith("-"):
                flags = [o for a in target._actions for o in a.option_strings if o.startswith("--")]
                target.error(f"unknown option {flag}{did_you_mean(flag, flags)}; `{target.prog} --help` lists the "
                             "options")
            target.error(f"unexpected argument {extras[0]!r}; `{target.prog} --help` says what it takes")
        return args


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(
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
        parser.commands[name] = p
    return parser


# What would be right, per errno of an OSError on a path the user named (a flag, a config key, a run directory)
_PATH_ERRORS = {
    errno.EACCES: "permission denied; choose a path you can read and write",
    errno.EPERM: "operation not permitted; choose a path you can read and write",
    errno.EROFS: "the file system is read-only; choose a writable path",
    errno.EISDIR: "it is a directory; give a file path",
    errno.ENOTDIR: "it (or a folder above it) is a file, not a directory; give a directory path",
    errno.EEXIST: "it already exists as a file; give a directory path",
    errno.ENOENT: "no such file or directory; check the path (its parent folder must exist)",
    errno.ENOSPC: "no space left on the device; free some space or choose another path",
    errno.ENAMETOOLONG: "the name is too long; choose a shorter path",
}


def path_error(err: OSError) -> str | None:
    """One sentence for an OSError about a named path, or None for any other OSError (left to propagate). A full
    disk is one sentence even when the error names no file."""
    if err.filename is None and err.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return "no space left on the device (or the disk quota is used up); free some space or choose another path."
    if err.filename is None or err.errno not in _PATH_ERRORS:
        return None
    return f"cannot use {str(err.filename)!r}: {_PATH_ERRORS[err.errno]}."


def current_rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _quiet(err: BaseException) -> bool:
    """Under torchrun, an error every rank raised alike is printed by rank 0 alone. The other ranks wait a moment
    before they exit, since torchrun stops every rank as soon as one exits with an error, and rank 0 must print
    first. An error of one rank in the middle of the steps (marked by attnlab.train.distributed) is printed by it."""
    if current_rank() == 0 or getattr(err, "attnlab_local", False):
        return False
    time.sleep(10)
    return True


def _check_launch(command: str) -> None:
    """Only ``train`` is data-parallel: under torchrun every other command would run once per rank, and ``compare``
    would start each run of its grid N times into the same directories."""
    world = os.environ.get("WORLD_SIZE", "1")
    if command != "train" and world not in ("", "1"):
        hint = (" (it places runs on GPUs itself: --jobs N; on a cluster: --launcher submitit)"
                if command == "compare" else "")
        raise ConfigError(f"this command runs in one process, but torchrun started {world} of it (WORLD_SIZE); only "
                          f"`attnlab train` is distributed: run `attnlab {command}` without torchrun{hint}.")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that the same code stops both."""


def _terminate(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        _exit_worker(argv)  # torchrun's workers keep SIGTERM's default: torchrun sends it to end every rank
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_worker(argv: list[str] | None) -> NoReturn:
    """A torchrun worker leaves with ``os._exit``, after its output is flushed and its files are written.

    Python's own shutdown is unsafe there: a gloo thread can still be releasing the last collective's tensors while
    the interpreter finalises, and taking the GIL then aborts the process (SIGABRT in place of the run's exit code).
    """
    try:
        code = _main(argv)
    except SystemExit as stop:  # argparse: --help, or a bad flag already printed
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except BaseException:  # noqa: BLE001 - a crash keeps its traceback, as it would without os._exit
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_launch(args.command)
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a reader that left shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:  # stdout's reader left (`attnlab variants --json | head -1`): stop as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE
    except NonFiniteLossError as err:
        if not _quiet(err):
            print(f"attnlab {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except AttnlabError as err:
        if not _quiet(err):
            print(f"attnlab {args.command}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except OSError as err:
        message = path_error(err)
        if message is None:
            raise
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # DataLoader workers end with the process (daemonic children are joined)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM while shutting down ends it at once
        if isinstance(stop, Terminated):
            print(f"attnlab {args.command}: terminated (SIGTERM)", file=sys.stderr)
            return 143
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
