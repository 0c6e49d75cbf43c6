"""The video LLM family (issue 47) through the one trainer: the embedded QA set trains and evaluates (overall and
per-category accuracy, `attnlab eval`'s table), the loss reads the answer tokens only, an interrupted run resumes
exactly, and the GPU configuration loads."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import forked
import pytest
import torch
from train_helpers import weights

from attnlab.train import RECIPES, load_config, train
from attnlab.train.run import Run

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(epochs=2, batch_size=8, num_probes=2, encoder_pretrain_steps=3, progress=False,
            data_options={"num_train": 32, "num_test": 8, "num_frames": 4, "image_size": 16})


def test_gpu_config_loads_with_the_authors_settings():
    cfg = load_config(ROOT / "configs" / "dna_viscop_ego.yaml", data_dir="/nonexistent")
    o = cfg.vlm
    assert (o.num_probes, o.probe_layers, o.frames_per_clip, o.merge_size) == (16, "all", 40, 2)
    assert o.lora_rank > 0 and o.gradient_checkpointing and cfg.run.amp == "bf16" and cfg.epochs == 3
    assert cfg.optim.lr == 1e-5 and cfg.sched.lr_schedule == "cosine" and cfg.sched.warmup_epochs == pytest.approx(0.09)
    assert cfg.attn.startswith("dna") and cfg.data_options["num_frames"] == 40


def test_loss_reads_answer_tokens_only(tmp_path):
    """Changing a prompt token's target changes nothing; the loss equals the cross-entropy of the answer tokens
    computed by hand (float64 reference)."""
    cfg = RECIPES["vlm_demo"].replace(runs_dir=str(tmp_path), **{**TINY, "encoder_pretrain_steps": 0})
    run = Run(cfg)
    torch.manual_seed(0)
    model = run.task.build_model()
    batch = next(iter(run.task.train_data(4, torch.device("cpu")).batches(1)))
    tokens, labels, clips, frames = batch
    with torch.no_grad():
        loss, sums = run.task.loss(model, batch)
        logits = model(tokens, clips, frames).double()
    picked = [(b, t) for b in range(4) for t in range(tokens.shape[1] - 1) if labels[b, t + 1] != -100]
    ref = sum(-torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]] for b, t in picked) / len(picked)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5) and int(sums["seen"]) == len(picked)
    assert len(picked) == 4 * 4 * 2  # four answers per training conversation: each letter and its end, no prompt


@pytest.mark.slow
def test_digits_qa_trains_and_eval_prints_the_category_table(tmp_path, capsys):
    from attnlab.cli import main

    result = train(RECIPES["vlm_demo"].replace(runs_dir=str(tmp_path), name="qa", **TINY))
    assert result["metric"] == "accuracy" and {"acc_digit", "acc_direction", "acc_end", "acc_count"} <= set(result)
    run_dir = tmp_path / "qa"
    assert json.loads((run_dir / "data.json").read_text())["generator"].startswith("moving digits QA")
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[0])["accuracy"] == pytest.approx(result["accuracy"])
    assert out[1].split() == ["category", "items", "accuracy"] and out[-1].split()[:2] == ["overall", "8"]
    assert [line.split()[0] for line in out[2:-1]] == ["count", "digit", "direction", "end"]


SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from attnlab.train import RECIPES, train
    from attnlab.train.tasks.vlm import VideoQA
    runs_dir, kill_at = sys.argv[1], int(sys.argv[2])
    build = VideoQA.build_model
    def armed(self, pretrained=True):
        model = build(self, pretrained)
        count = [0]
        def hook(module, inputs, output):
            if module.training:
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGINT)
        model.register_forward_hook(hook)
        return model
    VideoQA.build_model = armed
    cfg = RECIPES["vlm_demo"].replace(runs_dir=runs_dir, resume=True, **%s)
    print(json.dumps(train(cfg)))
""" % repr(TINY))


@pytest.mark.slow
def test_ctrl_c_mid_epoch_then_resume_gives_identical_weights(tmp_path):
    def go(where, kill_at):
        return forked.run([sys.executable, "-c", SCRIPT, str(tmp_path / where), str(kill_at)], capture_output=True,
                          text=True, timeout=300)

    whole = go("whole", 0)
    assert whole.returncode == 0, whole.stderr
    name = json.loads(whole.stdout.strip().splitlines()[-1])["name"]
    cut = go("cut", 4 + 2)  # epoch 2, step 2 (4 steps of 8 per epoch)
    assert cut.returncode != 0 and not (tmp_path / "cut" / name / "result.json").exists()
    assert torch.load(tmp_path / "cut" / name / "trainer_state.pt", weights_only=True)["epoch"] == 1
    again = go("cut", 0)
    assert again.returncode == 0, again.stderr
    a, b = (weights(tmp_path / d / name / "checkpoint.safetensors") for d in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads(again.stdout.strip().splitlines()[-1])["accuracy"] == \
        json.loads(whole.stdout.strip().splitlines()[-1])["accuracy"]


def test_analyze_measures_the_probes_of_a_vlm_run(tmp_path, capsys):
    """`attnlab analyze` on a DnA video LLM run: relevance explains each prompt's first predicted token (the same
    token the model predicts from that prompt alone, unpadded), branches measures the probes' two branches, an
    instrument of self-attention says in one line that it does not apply, and the curves read the family's
    metrics (accuracy, not top-1)."""
    from attnlab.cli import main

    cfg = RECIPES["vlm_demo"].replace(runs_dir=str(tmp_path), name="qa", attn="dna",
                                      **{**TINY, "epochs": 1, "encoder_pretrain_steps": 0})
    train(cfg)
    run_dir = tmp_path / "qa"
    capsys.readouterr()
    assert main(["analyze", str(run_dir), "--what", "relevance,branches,spectra,curves", "--images", "3"]) == 0
    err = capsys.readouterr().err
    assert "spectra does not apply" in err and "visual probes: relevance, branches" in err
    found = json.loads((run_dir / "analysis.json").read_text())["qa"]
    assert set(found["relevance"]["maps"]) == {"neg", "pos"} and len(found["relevance"]["targets"]) == 3
    assert found["summary"]["branch_cosine_mean"] == found["branches"]["branch_cosine_mean"]
    assert all((run_dir / f"probe_relevance_{i}.png").stat().st_size > 0 for i in range(3))
    curves = json.loads((run_dir / "analysis.json").read_text())["curves"]["dna"]  # the family's own metrics
    assert [p[0] for p in curves["panels"]] == ["train_loss", "test_loss", "accuracy"] and curves["runs"] == 1

    opened = Run.open(run_dir)
    model, prompts = opened.load_model(torch.device("cpu")).eval(), opened.task.instrument_inputs(3)
    with torch.no_grad():
        alone = [int(model(prompts.tokens[i:i + 1, :n], prompts.clips[i:i + 1], prompts.num_frames[i:i + 1])[0, -1]
                     .argmax()) for i, n in enumerate(prompts.lengths.tolist())]
    assert len(set(prompts.lengths.tolist())) > 1  # right padding: the last token is not every prompt's
    assert found["relevance"]["targets"] == alone
