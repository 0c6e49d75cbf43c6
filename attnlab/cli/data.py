"""Prepare a corpus for language modelling, once.

  attnlab data prepare INPUT --tokenizer tokenizer.json --out DIR

INPUT is a JSONL file (one JSON object per line, the text in --text-key; .jsonl.gz too), a Parquet file (needs
pyarrow: pip install 'attnlab[data]'), a plain text file (one document per file), a folder of any of these (read in
sorted path order), or a Hugging Face dataset name such as allenai/c4 (streamed through the datasets package:
pip install 'attnlab[data]'; --hf-config, --hf-split). Every document is encoded by the tokenizer.json, preceded by
one separator token (<|endoftext|> for GPT-2 and Qwen, the BOS token of Llama; --separator to choose), and written
to DIR as train_000000.bin, ... and val_000000.bin, ...: raw uint16 ids (uint32 for vocabularies over 65536), the
layout of nanoGPT's train.bin. DIR/manifest.json records the source, the tokenizer's sha256, vocabulary, dtype and
the token and document counts of every split and shard. Train on it with

  attnlab train --recipe lm --dataset nanogpt --data-dir DIR --model llama_small

An interrupted run (Ctrl-C, a killed job, a full disk) continues where it stopped when started again with the same
arguments: shards are written whole, and the finished corpus is byte for byte the one an uninterrupted run writes.
"""

from __future__ import annotations

import argparse
import os


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _val(text: str):
    from attnlab.data.prepare import parse_val
    from attnlab.errors import ConfigError

    try:
        return parse_val(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--val ").rstrip(".")) from None


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    prep = sub.add_parser("prepare", help="tokenize a text dataset into nanoGPT .bin shards with a manifest",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("input", metavar="INPUT", help="a JSONL, Parquet or text file, a folder of them, or a Hugging "
                      "Face dataset name (e.g. allenai/c4)")
    prep.add_argument("--tokenizer", required=True, metavar="FILE", help="a Hugging Face tokenizer.json (GPT-2, "
                      "Llama, Qwen or your own)")
    prep.add_argument("--out", required=True, metavar="DIR", help="the folder for the shards and manifest.json: new, "
                      "empty, or an interrupted run's of the same arguments (which it continues)")
    prep.add_argument("--text-key", default="text", metavar="NAME", help="the JSONL field, Parquet column or dataset "
                      "field that holds the text (default: text)")
    prep.add_argument("--val", type=_val, default="0.005", metavar="X", help="the validation split: a fraction of "
                      "the documents, spread evenly (every 1/X-th), or a whole number N: the first N documents "
                      "(default: 0.005)")
    prep.add_argument("--shard-tokens", type=_positive, default=100_000_000, metavar="N", help="close a shard once "
                      "it holds N tokens; shards hold whole documents (default: 100000000, llm.c's shard size)")
    prep.add_argument("--workers", type=_positive, default=max(1, min(8, (os.cpu_count() or 2) - 1)), metavar="N",
                      help="tokenizing processes (default: CPU cores - 1, at most 8)")
    prep.add_argument("--separator", metavar="TOKEN", help="the token put before each document (default: the "
                      "tokenizer's BOS from its post-processor, else <|endoftext|>, ... whichever it defines)")
    prep.add_argument("--hf-config", metavar="NAME", help="the Hugging Face dataset's configuration (e.g. en for "
                      "allenai/c4)")
    prep.add_argument("--hf-split", default="train", metavar="NAME", help="the Hugging Face dataset's split to read "
                      "(default: train)")
    prep.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                      help="no progress bar (by default it shows on a terminal)")


def run(args) -> int:
    import sys

    from attnlab.data.prepare import prepare, resolve_source

    source = resolve_source(args.input, args.hf_config, args.hf_split)
    val = args.val if not isinstance(args.val, str) else _val(args.val)
    manifest = prepare(source, args.tokenizer, args.out, text_key=args.text_key, val=val,
                       shard_tokens=args.shard_tokens, workers=args.workers, separator=args.separator,
                       progress=args.progress, log=lambda line: print(line, file=sys.stderr))
    parts = [f"{name} {s['tokens']:,} tokens in {s['documents']:,} documents, {len(s['shards'])} shard"
             f"{'s' * (len(s['shards']) != 1)}" for name, s in manifest["splits"].items()]
    print(f"{args.out}: {'; '.join(parts)}; {manifest['dtype']}, vocabulary {manifest['vocab_size']:,}, separator "
          f"{manifest['separator']['token']}; manifest {os.path.join(args.out, 'manifest.json')}")
    return 0
