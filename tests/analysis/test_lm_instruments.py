"""The instruments on language-model runs: the training probe in the trainer, `attnlab analyze RUN --what all` and
compare's annotate_runs on tiny GPT runs: what applies is measured on the run's validation blocks (token ids, in
causal order), what does not is one line each, never a traceback."""

import json

import pytest

from attnlab.analysis import training_probe
from attnlab.analysis.instruments import annotate_runs
from attnlab.analysis.entropy import max_logits
from attnlab.cli import main
from attnlab.train import RECIPES, train
from attnlab.train.run import Run

TINY = {"embed_dim": 16, "depth": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_runs")
    out = {}
    for attn in ("standard", "dna"):
        cfg = RECIPES["lm_demo"].replace(attn=attn, max_steps=4, eval_every=2, eval_iters=1,
                                         block_size=16, batch_size=2, model_options=TINY, probe_every=2, probe_images=4,
                                         runs_dir=str(root), progress=False)
        out[attn] = root / train(cfg, probe=training_probe)["name"]
    return out


def test_the_probe_runs_in_the_lm_trainer(runs):
    lines = [json.loads(x) for x in (runs["standard"] / "metrics.jsonl").read_text().splitlines()]
    assert [p["step"] for line in lines for p in line["probes"]] == [2, 4]
    assert {"max_logit/layer_0", "max_logit/layer_1", "entropy/layer_1"} <= set(lines[-1]["probes"][-1])
    dna = json.loads((runs["dna"] / "metrics.jsonl").read_text().splitlines()[-1])["probes"][-1]
    assert "max_logit/layer_0" not in dna and "qk_spectral_norm/max" in dna  # DnA is no single softmax


def test_analyze_all_on_lm_runs(runs, tmp_path, capsys):
    assert main(["analyze", str(runs["standard"]), str(runs["dna"]), "--what", "all", "--images", "3",
                 "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    data = json.loads((tmp_path / "analysis.json").read_text())
    standard, dna = data[runs["standard"].name], data[runs["dna"].name]
    assert {"p1", "entropy", "max_logit", "qk_norm_max", "log10_kappa", "head_distance"} <= set(standard["summary"])
    assert {"p1", "intruders_mean", "branch_cosine_mean", "head_distance_pos"} <= set(dna["summary"])
    # measured on the run's first validation blocks, through the causal mask the GPT passes its blocks
    run = Run.open(runs["standard"])
    want = max(float(layer["max"].max()) for layer in max_logits(run.load_model(), run.task.inputs(3)))
    assert standard["summary"]["max_logit"] == pytest.approx(want, rel=1e-6)
    for label, instrument in ((runs["standard"].name, "robustness"), (runs["standard"].name, "relevance"),
                              (runs["standard"].name, "branches"), (runs["dna"].name, "entropy")):
        [line] = [x for x in err.splitlines() if x.startswith(f"{label}: {instrument} does not apply: ")]
        assert len(line) < 400


def test_compare_annotation_on_lm_runs(runs):
    annotate_runs([runs["standard"]], ["entropy", "robustness", "relevance"], images=2, progress=False)
    result = json.loads((runs["standard"] / "result.json").read_text())
    assert result["analyzed"] == {"entropy": True, "robustness": False, "relevance": False}
    assert "token ids" in result["skipped"]["robustness"] and "max_logit" in result["extra"]
