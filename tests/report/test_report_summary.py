"""attnlab.report.summary against numbers worked out by hand (see the comment above each case)."""

import json
import math

import pytest

from attnlab.errors import AttnlabError
from attnlab.report import format_markdown, load_runs, summarize


def run(model, dataset, attn, seed, top1, **extra):
    return {"name": f"{model}-{dataset}-{attn}-s{seed}", "model": model, "dataset": dataset, "attn": attn,
            "seed": seed, "epochs": 100, "top1": top1, "top5": top1 + 5.0, "test_loss": 1.0, "params": 10,
            "seconds": 1.0, "extra": extra}


# vit_cifar / cifar10, seeds 0, 1, 3.
#   standard: 93.40 93.50 93.60 -> mean 93.50, deviations -.1 0 .1, SD = sqrt(0.02 / 2) = 0.10
#             p1 .72 .70 .74 -> .72 ; eff_rank 2.50 2.55 2.60 -> 2.55
#   ns:       93.70 93.90 94.10 -> mean 93.90, SD = sqrt(0.08 / 2) = 0.20, gain +0.40, wins 3/3
#             p1 .62 .60 .64 -> .62 ; eff_rank 2.90 2.90 2.93 -> 2.91
#   ns(steps=2): seeds 0, 3, 5 (seed 1 missing; seed 5 has no baseline): 93.30 93.90 93.60 -> mean 93.60,
#             deviations -.3 .3 0, SD = sqrt(0.18 / 2) = 0.30, gain +0.10; matched seeds 0 and 3:
#             93.30 < 93.40 (loss), 93.90 > 93.60 (win) -> wins 1/2
#   dna:      seed 0 only: 93.80 -> SD None, gain +0.30, wins 1/1
#   cog:      seeds 0, 1: 93.40 (tie with baseline: not a win), 93.80 (win) -> mean 93.60, SD sqrt(.08) = 0.2828,
#             gain +0.10, wins 1/2
def vit_c10_runs():
    return [
        run("vit_cifar", "cifar10", "ns", 0, 93.70, p1=0.62, eff_rank=2.90),
        run("vit_cifar", "cifar10", "standard", 0, 93.40, p1=0.72, eff_rank=2.50),
        run("vit_cifar", "cifar10", "ns", 1, 93.90, p1=0.60, eff_rank=2.90),
        run("vit_cifar", "cifar10", "standard", 1, 93.50, p1=0.70, eff_rank=2.55),
        run("vit_cifar", "cifar10", "ns", 3, 94.10, p1=0.64, eff_rank=2.93),
        run("vit_cifar", "cifar10", "standard", 3, 93.60, p1=0.74, eff_rank=2.60),
        run("vit_cifar", "cifar10", "ns(steps=2)", 0, 93.30),
        run("vit_cifar", "cifar10", "ns( steps = 2 )", 3, 93.90),  # whitespace is not part of the variant
        run("vit_cifar", "cifar10", "ns(steps=2)", 5, 93.60),
        run("vit_cifar", "cifar10", "dna", 0, 93.80),
        run("vit_cifar", "cifar10", "cog", 0, 93.40),
        run("vit_cifar", "cifar10", "cog", 1, 93.80),
    ]


def by_variant(rows, model="vit_cifar", dataset="cifar10"):
    return {r["variant"]: r for r in rows if (r["model"], r["dataset"]) == (model, dataset)}


def test_mean_sd_gain_wins_by_hand():
    rows = by_variant(summarize(vit_c10_runs()))
    std, ns, ns2, dna, cog = rows["standard"], rows["ns"], rows["ns(steps=2)"], rows["dna"], rows["cog"]

    assert std["baseline"] and std["n"] == 3 and std["seeds"] == [0, 1, 3]
    assert std["mean"] == pytest.approx(93.50, abs=1e-9)
    assert std["sd"] == pytest.approx(0.10, abs=1e-9)
    assert std["gain_pp"] is None and std["wins"] is None

    assert ns["mean"] == pytest.approx(93.90, abs=1e-9)
    assert ns["sd"] == pytest.approx(0.20, abs=1e-9)
    assert ns["gain_pp"] == pytest.approx(0.40, abs=1e-9)
    assert ns["wins"] == "3/3"

    assert ns2["n"] == 3 and ns2["seeds"] == [0, 3, 5]
    assert ns2["mean"] == pytest.approx(93.60, abs=1e-9)
    assert ns2["sd"] == pytest.approx(0.30, abs=1e-9)
    assert ns2["gain_pp"] == pytest.approx(0.10, abs=1e-9)
    assert ns2["wins"] == "1/2" and (ns2["wins_k"], ns2["wins_n"]) == (1, 2)

    assert dna["n"] == 1 and dna["sd"] is None
    assert dna["gain_pp"] == pytest.approx(0.30, abs=1e-9)
    assert dna["wins"] == "1/1"

    assert cog["sd"] == pytest.approx(math.sqrt(0.08), abs=1e-9)
    assert cog["wins"] == "1/2"  # the tie at seed 0 is not a win


def test_extras_are_averaged_per_variant():
    rows = by_variant(summarize(vit_c10_runs()))
    assert rows["standard"]["extras"] == pytest.approx({"eff_rank": 2.55, "p1": 0.72})
    assert rows["ns"]["extras"] == pytest.approx({"eff_rank": 2.91, "p1": 0.62})
    assert rows["dna"]["extras"] == {}


def test_gain_uses_unrounded_means():
    # standard 93.404 93.504 93.604 -> 93.504 (shown 93.50); ns 93.786 93.886 93.986 -> 93.886 (shown 93.89).
    # Unrounded gain 0.382 -> "+0.38"; subtracting the rounded means would give 93.89 - 93.50 = "+0.39".
    runs = [run("vit_cifar", "cifar100", "standard", s, v) for s, v in [(0, 93.404), (1, 93.504), (3, 93.604)]]
    runs += [run("vit_cifar", "cifar100", "ns", s, v) for s, v in [(0, 93.786), (1, 93.886), (3, 93.986)]]
    rows = by_variant(summarize(runs), dataset="cifar100")
    assert rows["ns"]["gain_pp"] == pytest.approx(0.382, abs=1e-9)
    md = format_markdown(summarize(runs))
    assert "| ns | 93.89 ± 0.10 | +0.38 | 3/3 | 3 |" in md
    assert "| standard (baseline) | 93.50 ± 0.10 | — | — | 3 |" in md
    assert "+0.39" not in md


def test_order_grouping_and_missing_baseline():
    runs = vit_c10_runs() + [
        run("swin_cifar", "cifar100", "ns", 0, 78.0),
        run("swin_cifar", "cifar100", "standard", 0, 77.0),
        run("vit_cifar", "cifar100", "ns", 0, 70.0),  # no baseline in this group
    ]
    rows = summarize(runs)
    keys = [(r["model"], r["dataset"], r["variant"]) for r in rows]
    assert keys == [
        ("swin_cifar", "cifar100", "standard"), ("swin_cifar", "cifar100", "ns"),
        ("vit_cifar", "cifar10", "standard"), ("vit_cifar", "cifar10", "cog"), ("vit_cifar", "cifar10", "dna"),
        ("vit_cifar", "cifar10", "ns"), ("vit_cifar", "cifar10", "ns(steps=2)"),
        ("vit_cifar", "cifar100", "ns"),
    ]
    swin = by_variant(rows, "swin_cifar", "cifar100")
    assert swin["ns"]["gain_pp"] == pytest.approx(1.0) and swin["ns"]["wins"] == "1/1"
    lonely = by_variant(rows, "vit_cifar", "cifar100")["ns"]
    assert lonely["gain_pp"] is None and lonely["wins"] is None and lonely["sd"] is None


def test_other_baseline():
    rows = by_variant(summarize(vit_c10_runs(), baseline="ns"))
    assert next(iter(rows)) == "ns"
    # standard vs ns: 93.50 - 93.90 = -0.40, never higher on a matched seed.
    assert rows["standard"]["gain_pp"] == pytest.approx(-0.40, abs=1e-9)
    assert rows["standard"]["wins"] == "0/3"


def test_format_markdown_table():
    md = format_markdown(summarize(vit_c10_runs()))
    lines = md.splitlines()
    assert lines[0] == "### vit_cifar / cifar10"
    assert lines[2] == "| Variant | Top-1 (mean ± SD) | Gain (pp) | Wins | n | eff_rank | p1 |"
    body = lines[4:]
    assert body == [
        "| standard (baseline) | 93.50 ± 0.10 | — | — | 3 | 2.55 | 0.72 |",
        "| cog | 93.60 ± 0.28 | +0.10 | 1/2 | 2 | — | — |",
        "| dna | 93.80 | +0.30 | 1/1 | 1 | — | — |",
        "| ns | 93.90 ± 0.20 | +0.40 | 3/3 | 3 | 2.91 | 0.62 |",
        "| ns(steps=2) | 93.60 ± 0.30 | +0.10 | 1/2 | 3 | — | — |",
    ]


def test_negative_gain_has_sign():
    runs = [run("m", "d", "standard", 0, 80.0), run("m", "d", "x", 0, 79.61)]
    assert "| x | 79.61 | -0.39 | 0/1 | 1 |" in format_markdown(summarize(runs))


def test_duplicate_seed_is_an_error():
    runs = [run("m", "d", "ns", 0, 80.0), run("m", "d", "ns", 0, 81.0)]
    with pytest.raises(AttnlabError, match="seed 0"):
        summarize(runs)


def write(root, sub, payload):
    d = root / sub
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(payload if isinstance(payload, str) else json.dumps(payload))


def test_load_runs_recursive_and_sorted(tmp_path):
    write(tmp_path, "b", run("m", "d", "ns", 0, 81.0))
    write(tmp_path, "group/a", run("m", "d", "standard", 0, 80.0))
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "metrics.jsonl").write_text("{}\n")
    runs = load_runs(tmp_path)
    assert [r["run_dir"] for r in runs] == ["b", "group/a"]
    assert [r["attn"] for r in runs] == ["ns", "standard"]


def test_load_runs_errors(tmp_path):
    with pytest.raises(AttnlabError, match="does not exist"):
        load_runs(tmp_path / "nope")
    with pytest.raises(AttnlabError, match="no finished runs"):
        load_runs(tmp_path)
    write(tmp_path, "bad", "{not json")
    with pytest.raises(AttnlabError, match="not valid JSON"):
        load_runs(tmp_path)
    payload = run("m", "d", "ns", 0, 80.0)
    del payload["top1"]
    write(tmp_path, "bad", payload)
    with pytest.raises(AttnlabError, match="top1"):
        load_runs(tmp_path)
    write(tmp_path, "bad", "[1, 2]")
    with pytest.raises(AttnlabError, match="not a JSON object"):
        load_runs(tmp_path)


def test_gain_rounding_to_zero_has_plus_sign():
    runs = [run("m", "d", "standard", 0, 80.0), run("m", "d", "x", 0, 79.996)]
    assert "| x | 80.00 | +0.00 | 0/1 | 1 |" in format_markdown(summarize(runs))
