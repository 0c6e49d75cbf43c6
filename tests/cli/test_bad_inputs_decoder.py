"""Issue 45 (the decoder) through the command line: a value the Llama/Qwen decoder cannot use, from
``--model-options``, from a Hugging Face checkpoint's ``config.json`` or tensors, or from a run's ``config.yaml``,
ends in one line on stderr that names the key, its value and a right one, exit code 2, no traceback, and nothing
left in the working directory (no run directory: the refusal comes before training). ``attnlab.cli.main`` runs in
this process (tests/cli_runner.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from cli_runner import in_process


def _listing(root: Path) -> dict:
    return {str(Path(d, n).relative_to(root)): Path(d, n).is_dir() for d, dirs, files in os.walk(root)
            for n in dirs + files}


def refused(argv, cwd: Path, expected: str, command: str = "train") -> str:
    """``attnlab ARGV`` in ``cwd``: one stderr line holding ``expected``, exit 2, ``cwd`` unchanged; the line."""
    before = _listing(cwd)
    proc = in_process([str(a) for a in argv], cwd)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attnlab {command}: error: ") and expected in lines[0], lines[0]
    assert _listing(cwd) == before
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A 4 KB text corpus and llama_tiny (one layer) exported as a Hugging Face checkpoint ``ck``."""
    import attnlab
    from attnlab.models.hf_decoder import export_hf

    root = tmp_path_factory.mktemp("dec45")
    (root / "corpus.txt").write_bytes(bytes(range(32, 127)) * 44)
    export_hf(attnlab.build_model("llama_tiny", depth=1), root / "ck")
    return root


def _train(files: Path, *extra) -> list:
    return ["train", "--recipe", "lm_demo_llama", "--dataset", "text", "--data-dir", files / "corpus.txt",
            "--block-size", 8, "--batch-size", 2, "--max-steps", 1, "--eval-every", 1, "--eval-iters", 1, *extra]


def _checkpoint(files: Path, tmp_path: Path, change: dict | None = None, drop=(), tensors=None) -> Path:
    """A copy of the exported checkpoint (outside the working directory) with its config.json or tensors edited."""
    out = tmp_path.parent / f"{tmp_path.name}-ck"
    shutil.copytree(files / "ck", out)
    config = json.loads((out / "config.json").read_text())
    config.update(change or {})
    for key in drop:
        config.pop(key)
    (out / "config.json").write_text(json.dumps(config))
    if tensors:
        from safetensors.torch import load_file, save_file

        save_file(tensors(load_file(str(out / "model.safetensors"))), str(out / "model.safetensors"))
    return out


# ---- 2, 3: --model-options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, expected", [
    ("{num_kv_heads: 0}", "Llama's num_kv_heads is 0, not a positive integer dividing num_heads 4; give 1, 2 or 4"),
    ("{head_dim: 0}", "Llama's head_dim is 0, not a positive even integer"),
    ("{mlp_hidden: 0}", "Llama's mlp_hidden is 0, not a positive integer; give one such as 352"),
    ("{tie_embeddings: maybe}", "Llama's tie_embeddings is 'maybe', not a boolean; give true or false"),
    ("{qk_norm: 3}", "Llama's qk_norm is 3, not a boolean; give true or false"),
    ("{rope_theta: 0}", "Llama's rope_theta is 0, not a finite number above 1 and at most 3.403e+38; give one such as "
                        "10000.0"),
    ("{rope_theta: -10000.0}", "Llama's rope_theta is -10000.0, not a finite number above 1"),
    ("{rope_theta: '1e6'}", "Llama's rope_theta is '1e6', not a finite number above 1 and at most 3.403e+38; give "
                            "one such as 10000.0 (Llama 2; Llama 3: 500000.0, Qwen: 1000000.0) ('1e6' is text; write "
                            "the number 1000000.0 without quotes)"),
    ("{norm_eps: \"1e-6\"}", "Llama's norm_eps is '1e-6', not a finite number above 0; give one such as 1.0e-06 "
                            "(Llama: 1.0e-05) ('1e-6' is text; write the number 1.0e-06 without quotes)"),
    ("{rope_theta: .nan}", "Llama's rope_theta is nan, not a finite number above 1"),
    ("{rope_theta: .inf}", "Llama's rope_theta is inf, not a finite number above 1"),
    ("{norm_eps: -1}", "Llama's norm_eps is -1, not a finite number above 0; give one such as 1.0e-06"),
    ("{norm_eps: .nan}", "Llama's norm_eps is nan, not a finite number above 0"),
    ("{num_heads: 5}", "Llama's num_heads is 5, not a positive integer dividing embed_dim 128 into even head_dims"),
])
def test_a_model_option_the_decoder_cannot_use_is_one_line_and_no_run(options, expected, files, tmp_path):
    refused(_train(files, "--model-options", options), tmp_path, expected)


def test_a_gpt_option_the_decoder_cannot_use_is_one_line_and_no_run(files, tmp_path):
    refused(_train(files, "--model", "gpt_tiny", "--model-options", "{bias: maybe}"), tmp_path,
            "GPT's bias is 'maybe', not a boolean; give true or false")


# ---- 1, 5: a Hugging Face checkpoint's config.json -------------------------------------------------------------
@pytest.mark.parametrize("change, drop, expected, not_said", [
    ({"num_attention_heads": 0}, ("head_dim",), "config.json's num_attention_heads is 0, not a positive integer "
                                                "dividing hidden_size 128 into even head_dims", "num_heads=0"),
    ({"num_attention_heads": 0}, (), "config.json's num_attention_heads is 0, not a positive integer; give one such "
                                     "as 4 (hidden_size / head_dim)", "num_heads=0"),
    ({"rope_theta": "abc", "rope_parameters": None}, (), "config.json's rope_theta is 'abc', not a finite number above "
                                                         "1", "Traceback"),
    ({"num_key_value_heads": -2}, (), "config.json's num_key_value_heads is -2, not a positive integer dividing "
                                      "num_attention_heads 4; give 1, 2 or 4", "num_kv_heads=-2"),
    ({"rope_theta": 0.0, "rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, (),
     "config.json's rope_parameters.rope_theta is 0.0, not a finite number above 1", "rope_theta=0.0"),
    ({"rms_norm_eps": -1e-6}, (), "config.json's rms_norm_eps is -1e-06, not a finite number above 0", "norm_eps="),
    ({}, ("vocab_size",), "config.json has no vocab_size; give it as a positive integer (256, as the weights show)",
     "vocab_size="),
    ({"hidden_size": 130}, ("head_dim",), "config.json's num_attention_heads is 4, not a positive integer dividing "
                                          "hidden_size 130 into even head_dims", "embed_dim="),
    ({"tie_word_embeddings": "yes"}, (), "config.json's tie_word_embeddings is 'yes', not a boolean", "True"),
])
def test_a_checkpoint_config_value_is_one_line_naming_a_right_value(change, drop, expected, not_said, files,
                                                                     tmp_path):
    ck = _checkpoint(files, tmp_path, change, drop)
    line = refused(_train(files, "--model-options", "{depth: 1}", "--pretrained-file", ck), tmp_path, expected)
    assert not_said not in line and "give" in line


# ---- 4: a tensor of the wrong kind -----------------------------------------------------------------------------
def test_an_int8_tensor_in_a_float32_checkpoint_is_refused_not_cast(files, tmp_path):
    import torch

    key = "model.layers.0.mlp.up_proj.weight"
    ck = _checkpoint(files, tmp_path, tensors=lambda s: {**s, key: (s[key] * 100).to(torch.int8)})
    refused(_train(files, "--model-options", "{depth: 1}", "--pretrained-file", ck), tmp_path,
            "holds 'blocks.0.mlp.up_proj.weight' as torch.int8 where llama_tiny has a floating-point torch.float32 "
            "tensor; give floating-point weights")


# ---- 5: a checkpoint of 256 ids against a 300-token tokenizer says that the two disagree ------------------------
def test_a_checkpoint_vocabulary_smaller_than_the_tokenizers_says_the_two_disagree(files, tmp_path):
    pytest.importorskip("tokenizers")
    from tests.data.test_lm import write_tokenizer

    words = ["[UNK]"] + [f"w{i}" for i in range(299)]
    data = tmp_path.parent / f"{tmp_path.name}-data"
    data.mkdir()
    write_tokenizer(data / "tok.json", words)
    (data / "corpus.txt").write_text(" ".join(words[1:] * 4))
    argv = ["train", "--recipe", "lm_demo_llama", "--dataset", "text", "--data-dir", data / "corpus.txt",
            "--data-options", f"{{tokenizer: {data / 'tok.json'}}}", "--block-size", 8, "--batch-size", 2,
            "--max-steps", 1, "--eval-every", 1, "--eval-iters", 1, "--model-options", "{depth: 1}",
            "--pretrained-file", files / "ck"]
    line = refused(argv, tmp_path, "embeds 256 tokens (its vocab_size) but the model has 300 (in a run, the data's "
                                   "vocabulary, e.g. its tokenizer's): the two disagree; the checkpoint has no "
                                   "embedding for ids 256..299, so give data (a tokenizer) of at most 256 tokens")
    assert "vocab_size=300" not in line


# ---- 2: a run whose config.yaml says theta 0 is refused when it is read again -----------------------------------
@pytest.mark.slow
def test_a_run_whose_config_says_theta_0_is_refused_at_load(files, tmp_path):
    from attnlab.train import RECIPES, train

    cfg = RECIPES["lm_demo_llama"].replace(dataset="text", data_dir=str(files / "corpus.txt"),
                              block_size=8, batch_size=2, max_steps=1, eval_every=1, eval_iters=1, probe_every=0,
                              warmup_steps=0, model_options={"depth": 1}, runs_dir=str(tmp_path / "runs"),
                              name="llama", progress=False)
    train(cfg)
    run = tmp_path / "runs" / "llama"
    config = (run / "config.yaml").read_text()
    assert "depth: 1" in config
    (run / "config.yaml").write_text(config.replace("depth: 1", "depth: 1\n  rope_theta: 0.0"))
    for command in ("eval", "sample"):
        refused([command, run], tmp_path, "Llama's rope_theta is 0.0, not a finite number above 1", command)
