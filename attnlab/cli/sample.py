"""Sample text from a trained language-model run (nanoGPT's sample.py): the prompt is encoded as the run's data is
(bytes for stdlib and byte-level text, the run's tokenizer.json, a nanoGPT meta.pkl's characters), or given as ids
with --prompt-ids; the continuation is printed. A KV cache is used where the attention allows it (standard, dna,
diff, cog), recomputation otherwise; --seed makes the draws reproducible, --temperature 0 is greedy.

Example: attnlab sample runs/gpt_tiny-stdlib-standard-s0 --prompt "def " --max-new-tokens 200 --top-k 50"""

from __future__ import annotations

import argparse

MIN_TEMPERATURE = 1e-6  # logits / temperature stay finite in float32 above it (|logits| < 3e32)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory of a language model (config.yaml + checkpoint)")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of --prompt")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=200, help="keep the k most likely tokens (0: all)")
    p.add_argument("--num-samples", type=int, default=1, help="independent samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws")
    p.add_argument("--device", default="cpu", help="'cpu', 'cuda', 'cuda:1', ...")
    p.add_argument("--data-dir", default=None, help="where the run's data lies now, if it has moved (a nanoGPT run "
                                                    "reads meta.pkl there; bytes need no data)")
    p.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the run's tokenizer.json, if it has moved (text runs trained through a tokenizer)")


def run(args) -> int:
    import torch

    from attnlab.data.lm import text_codec
    from attnlab.errors import ConfigError
    from attnlab.models.gpt import generate
    from attnlab.train.run import Run, resolve_device

    run_ = Run.open(args.run_dir, data_dir=args.data_dir, tokenizer=args.tokenizer)
    if run_.task.name != "lm":
        raise ConfigError(f"{args.run_dir} trained a {run_.task.name} model; sample takes a language-model run.")
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples must be at least 1, not {args.num_samples}.")
    if 0 < args.temperature < MIN_TEMPERATURE:
        raise ConfigError(f"--temperature {args.temperature:g} is below {MIN_TEMPERATURE:g}, where dividing the "
                          f"logits by it overflows float32 or picks the most likely token anyway; give 0 (greedy "
                          f"decoding) or a temperature of at least {MIN_TEMPERATURE:g}.")
    cfg = run_.cfg
    run_.warn_data_changed("sample", only=("tokenizer.json", "meta.pkl"),  # what encodes the prompt and decodes
                           consequence="the prompt is encoded and the sample decoded with it as it is now")
    codec = text_codec(cfg.dataset, cfg.run.data_dir, cfg.data_options)
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids {args.prompt_ids!r} is not a comma-separated list of integers.") from None
    elif codec is None:
        raise ConfigError(f"the run's dataset {cfg.dataset} has no text encoding here; give --prompt-ids.")
    else:
        ids = codec[0](args.prompt)
    device = resolve_device(args.device)
    model = run_.load_model(device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, [ids] * args.num_samples, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k or None, generator=generator)
    for row in out.tolist():
        print(codec[1](row) if codec is not None and args.prompt_ids is None else ",".join(map(str, row)))
        if args.num_samples > 1:
            print("---")
    return 0
