"""The full report (issue 12 item 3): every table against numbers worked out by hand, report.html against report.md
(every table cell and every figure, nothing outside the file), damaged files listed instead of aborting, and the
page rendered by a headless Chromium when one is installed."""

import base64
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from attnlab.report import write_report

# vit_cifar, seeds 0, 1, 3 (ablation, NS-Attn Table 2 form; best mean of a row in bold):
#   cifar10:  standard 93.40 93.50 93.60 -> 93.50 ± 0.10; ns 93.70 93.90 94.10 -> 93.90 ± 0.20 (best);
#             ns(steps=2) 93.45 93.50 93.55 -> 93.50 ± 0.05
#   cifar100: standard 72.20 72.40 72.60 -> 72.40 ± 0.20; ns 73.00 73.30 73.00 -> 73.10, deviations -.1 .2 -.1,
#             SD sqrt(.06 / 2) = 0.17; ns(steps=2) 73.20 73.60 73.40 -> 73.40 ± 0.20 (best)
TOP1 = {
    "cifar10": {"standard": [93.40, 93.50, 93.60], "ns": [93.70, 93.90, 94.10], "ns(steps=2)": [93.45, 93.50, 93.55]},
    "cifar100": {"standard": [72.20, 72.40, 72.60], "ns": [73.00, 73.30, 73.00], "ns(steps=2)": [73.20, 73.60, 73.40]},
}
# swin_cifar / cifar10, seeds 0 and 1, spectra from each run's analysis.json (a run's p1 = mean of its blocks):
#   standard: blocks (.82, 2.0) (.78, 2.2) and (.78, 2.2) (.74, 2.4) -> p1 .78, r_eff 2.20; per block .80/2.10, .76/2.30
#   ns:       blocks (.66, 2.9) (.62, 3.1) and (.62, 3.1) (.58, 3.3) -> p1 .62, r_eff 3.10; per block .64/3.00, .60/3.20
SWIN_BLOCKS = {"standard": [[(.82, 2.0), (.78, 2.2)], [(.78, 2.2), (.74, 2.4)]],
               "ns": [[(.66, 2.9), (.62, 3.1)], [(.62, 3.1), (.58, 3.3)]]}
LAYERS = ["layers.0.blocks.0.attn", "layers.0.blocks.1.attn"]
# `attnlab bench --json` on vit_cifar; the table recomputes from round_ms (the stored means here are stale on purpose):
#   standard 23.00 24.00 23.65 -> mean 23.55, deviations -.55 .45 .10, SD sqrt(.515 / 2) = 0.51
#   ns       33.00 33.90 32.70 -> mean 33.20, deviations -.20 .70 -.50, SD sqrt(.78 / 2) = 0.62
#   overhead 100 * (33.20 / 23.55 - 1) = +41.0%
BENCH = {"device": "cuda:0 (NVIDIA H200)", "batch_size": 128, "warmup": 50, "iters": 200, "rounds": 3,
         "baseline": "standard", "model": "vit_cifar", "dtype": "fp32", "compiled": False,
         "models": {"standard": {"mean_ms": 0.0, "sd_ms": 0.0, "round_ms": [23.00, 24.00, 23.65], "overhead_pct": 0},
                    "ns": {"mean_ms": 0.0, "sd_ms": 0.0, "round_ms": [33.00, 33.90, 32.70], "overhead_pct": 0}}}


def png(path, color="C0"):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1.5), dpi=50)
    FigureCanvasAgg(fig)
    fig.add_subplot().plot([0, 1], [1, 0], color=color)
    fig.savefig(path)
    return path


def add_run(root, model, dataset, attn, seed, top1, extra=None):
    d = root / f"{model}-{dataset}-{attn}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"model: {model}\ndataset: {dataset}\nattn: '{attn}'\nseed: {seed}\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps(
        {"epoch": e, "train_loss": 3.0 - e, "test_loss": 2.5 - e, "top1": top1 - 1 + e}) + "\n" for e in (0, 1)))
    (d / "result.json").write_text(json.dumps({"name": d.name, "model": model, "dataset": dataset, "attn": attn,
                                               "seed": seed, "top1": top1, "extra": extra or {}}))
    return d


def comparison(root):
    for dataset, variants in TOP1.items():
        for attn, tops in variants.items():
            for seed, top1 in zip([0, 1, 3], tops):
                add_run(root, "vit_cifar", dataset, attn, seed, top1)
    for attn, runs in SWIN_BLOCKS.items():
        for seed, blocks in enumerate(runs):
            d = add_run(root, "swin_cifar", "cifar10", attn, seed, 95.0 + seed)
            p1 = sum(b[0] for b in blocks) / 2
            r_eff = sum(b[1] for b in blocks) / 2
            spectra = {"p1": p1, "eff_rank": r_eff, "mean_spectrum": [p1, 1 - p1],
                       "blocks": [{"layer": name, "p1": b[0], "eff_rank": b[1]} for name, b in zip(LAYERS, blocks)]}
            (d / "analysis.json").write_text(json.dumps({d.name: {"attn": attn, "summary": {}, "spectra": spectra}}))
            if (attn, seed) == ("standard", 0):
                png(d / "spectra.png")
    figures = root / "figures"  # analyze --out with several runs: prefixed figure names, one analysis.json
    figures.mkdir()
    (figures / "analysis.json").write_text(json.dumps({"curves": {}}))
    png(figures / "vit_cifar-cifar10-ns-s0-relevance.png", "C1")
    png(figures / "redundancy.png", "C2")
    png(root / "vit_cifar-cifar10-ns-s0" / "notes.png", "C3")  # no analysis.json beside it: not analyze's
    (root / "bench").mkdir()
    (root / "bench" / "bench-vit_cifar.json").write_text(json.dumps(BENCH))


def markdown_tables(md):
    """{title: [[cells] per row, header first]} of the pipe tables under '### title' headings."""
    tables, title, current = {}, None, None
    for line in md.splitlines():
        if line.startswith("#"):
            title, current = line.lstrip("#").strip(), None
        elif line.startswith("|"):
            if current is None:
                current = tables.setdefault(title, [])
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(re.fullmatch(r"-+:?", c) for c in cells):
                current.append(cells)
        else:
            current = None
    return tables


def section(md, heading):
    """The text of the '## heading' section."""
    start = md.index(f"## {heading}\n")
    end = md.find("\n## ", start + 1)
    return md[start:end if end >= 0 else None]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp")
    comparison(root / "runs")
    result = write_report(root / "runs", root / "out")
    return root, result


def test_tables_against_hand_computed_numbers(report):
    root, result = report
    md = result["markdown"]

    ablation = markdown_tables(section(md, "Ablation (NS-Attn Table 2 form)"))
    assert ablation == {"vit_cifar": [
        ["Dataset", "standard (baseline)", "ns", "ns(steps=2)"],
        ["cifar10", "93.50 ± 0.10", "**93.90 ± 0.20**", "93.50 ± 0.05"],
        ["cifar100", "72.40 ± 0.20", "73.10 ± 0.17", "**73.40 ± 0.20**"],
    ]}  # swin_cifar has two variants: Table 1 (the accuracy table) says it all

    latency = markdown_tables(section(md, "Latency (NS-Attn Table 3 form)"))
    assert list(latency.values()) == [[
        ["Backbone", "Setting", "standard (baseline)", "ns", "Overhead"],
        ["vit_cifar", "cuda:0 (NVIDIA H200), fp32, eager, batch 128, 3 x (50 + 200)", "23.55 ± 0.51", "33.20 ± 0.62",
         "+41.0%"],
    ]]
    data = json.loads(result["json"].read_text())
    [bench] = data["latency"]
    assert bench["file"] == "bench/bench-vit_cifar.json"
    assert bench["models"]["ns"]["mean_ms"] == pytest.approx(33.20, abs=1e-12)
    assert bench["models"]["ns"]["sd_ms"] == pytest.approx((0.78 / 2) ** 0.5, abs=1e-12)
    assert bench["models"]["ns"]["overhead_pct"] == pytest.approx(100 * (33.20 / 23.55 - 1), abs=1e-9)

    spectra = markdown_tables(section(md, "Head-output spectra (NS-Attn Section 3.4)"))
    assert spectra == {
        "swin_cifar / cifar10": [["Variant", "p1", "r_eff", "runs"], ["standard", "0.78", "2.20", "2"],
                                 ["ns", "0.62", "3.10", "2"]],
        "swin_cifar / cifar10, per block": [
            ["Block", "standard p1", "standard r_eff", "ns p1", "ns r_eff"],
            [LAYERS[0], "0.80", "2.10", "0.64", "3.00"],
            [LAYERS[1], "0.76", "2.30", "0.60", "3.20"],
        ],
    }  # the vit runs have no spectra: no table for them

    # vit_cifar on CIFAR-10 (N = 65 tokens, D = 192, 12 heads, depth 9, MLP ratio 2, patch 4, 10 classes), counted
    # from the architecture: per block qkv N*D*3D + q k^T and attn v 2*N*N*D + proj N*D*D + MLP 2*N*D*2D
    # multiply-adds, patch embedding 64*48*D, head D*10; parameters likewise.
    n, d = 65, 192
    macs = 9 * (n * d * 3 * d + 2 * n * n * d + n * d * d + 2 * n * d * 2 * d) + 64 * 48 * d + d * 10
    block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 2 * d + 2 * d) + (2 * d * d + d)
    params = (48 * d + d) + d + n * d + 9 * block + 2 * d + (d * 10 + 10)
    costs = markdown_tables(section(md, "Parameters and operations"))
    std = costs["vit_cifar / cifar10"][1]
    # 0.19 giga multiply-adds read as 187.7 MMACs (the unit in which the smallest count is at least 1)
    assert costs["vit_cifar / cifar10"][0] == ["Variant", "Params (M)", "MMACs", "MFLOPs", "x params", "x MACs"]
    assert std == ["standard", f"{params / 1e6:.3f}", f"{macs / 1e6:.4g}", f"{2 * macs / 1e6:.4g}", "1.000", "1.000"]
    assert [row[4] for row in costs["vit_cifar / cifar10"][1:]] == ["1.000"] * 3  # NS adds no parameter
    ns_macs = float(costs["vit_cifar / cifar10"][2][2])
    assert ns_macs > macs / 1e6  # and costs operations


def test_figures_grouped_by_instrument(report):
    root, result = report
    figures = section(result["markdown"], "Figures")
    groups = re.findall(r"^### (.*)$", figures, flags=re.M)
    assert groups == ["Top-1 per variant", "Training curves", "attnlab analyze: head redundancy (DnA Appendix C.5, Figure 12)",
                      "attnlab analyze: signed relevance maps (DnA Section 4.3)",
                      "attnlab analyze: head-output spectra (NS-Attn Figure 2)"]
    links = re.findall(r"!\[[^\]]*\]\(([^)]*)\)", figures)
    assert links == ["report_swin_cifar_cifar10.png", "report_vit_cifar_cifar10.png", "report_vit_cifar_cifar100.png",
                     "report_curves_swin_cifar_cifar10.png", "report_curves_vit_cifar_cifar10.png",
                     "report_curves_vit_cifar_cifar100.png", "../runs/figures/redundancy.png",
                     "../runs/figures/vit_cifar-cifar10-ns-s0-relevance.png",
                     "../runs/swin_cifar-cifar10-standard-s0/spectra.png"]
    assert "notes.png" not in result["markdown"]


class PageParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.images, self.links, self._cell, self._title = [], [], [], None, None
        self.headings, self._heading = [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append((self._title, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(attrs)
        elif re.fullmatch(r"h[1-6]", tag):
            self._heading = ""
        for key in ("href", "src", "action", "srcset", "poster"):
            if key in attrs:
                self.links.append(attrs[key])

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][1][-1].append(self._cell)
            self._cell = None
        elif re.fullmatch(r"h[1-6]", tag):
            self._title, self._heading = self._heading, None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._heading is not None:
            self._heading += data


def test_html_holds_every_table_and_figure_and_nothing_outside(report):
    root, result = report
    out = root / "out"
    page = (out / "report.html").read_text()
    parser = PageParser()
    parser.feed(page)

    md = result["markdown"]
    md_tables = [[[c.replace("**", "") for c in row] for row in rows]
                 for rows in (markdown_tables(section(md, s)) for s in re.findall(r"^## (.*)$", md, flags=re.M))
                 for rows in rows.values()]
    assert len(md_tables) == 10  # accuracy 3, ablation 1, latency 1, spectra 2, parameters and operations 3
    assert [rows for _, rows in parser.tables] == md_tables
    assert "<strong>93.90 ± 0.20</strong>" in page

    md_figures = re.findall(r"!\[([^\]]*)\]\(([^)]*)\)", md)
    assert len(md_figures) == 9
    assert [i["alt"] for i in parser.images] == [caption for caption, _ in md_figures]
    for image, (_, ref) in zip(parser.images, md_figures):
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        assert base64.b64decode(image["src"][len(prefix):]) == (out / ref).read_bytes()
    assert all(link.startswith("data:image/png;base64,") for link in parser.links)  # no href, no file, no URL
    assert not re.search(r"https?:|file:|<script|<link|@import|url\(", page, flags=re.I)


def test_damaged_files_are_listed_and_the_rest_reported(tmp_path, report):
    _, clean = report
    runs = tmp_path / "runs"
    comparison(runs)
    (runs / "bench" / "latency-swin.json").write_text("{not json")
    (runs / "bench" / "bench-other.json").write_text(json.dumps({"models": {"a": {"round_ms": []}}, "baseline": "a"}))
    (runs / "figures" / "analysis.json").write_text("[1, 2")
    bad_metrics = runs / "vit_cifar-cifar100-ns-s1" / "metrics.jsonl"
    bad_metrics.write_text('{"epoch": 0}\n')
    (runs / "vit_cifar-cifar10-dna-s0").mkdir()  # started: config.yaml only
    (runs / "vit_cifar-cifar10-dna-s0" / "config.yaml").write_text("model: vit_cifar\n")
    (runs / "vit_cifar-cifar10-dna-s1").mkdir()
    (runs / "vit_cifar-cifar10-dna-s1" / "result.json").write_text("{")

    result = write_report(runs, tmp_path / "out")
    md = result["markdown"]
    for name in ("Accuracy", "Ablation (NS-Attn Table 2 form)", "Latency (NS-Attn Table 3 form)",
                 "Head-output spectra (NS-Attn Section 3.4)", "Parameters and operations"):
        assert section(md, name) == section(clean["markdown"], name)
    left_out = section(md, "Not included")
    assert "Unfinished runs (no result.json), not included: vit_cifar-cifar10-dna-s0" in left_out
    assert "- vit_cifar-cifar10-dna-s1: result.json is not valid JSON" in left_out
    assert "- bench/latency-swin.json: latency-swin.json is not valid JSON" in left_out
    assert "- bench/bench-other.json: bench-other.json: model 'a' has no list of positive round means" in left_out
    assert "- figures/analysis.json: is not a readable analysis" in left_out
    assert "- vit_cifar-cifar100-ns-s1/metrics.jsonl: " in left_out
    assert str(tmp_path) not in md
    # the analysis folder that cannot be read contributes no figures; the run's own still shows
    assert "relevance.png" not in md and "spectra.png" in md
    assert "Not included" in result["html"] and "bench/bench-other.json" in result["html"]
    data = json.loads(result["json"].read_text())
    assert {p["path"] for p in data["problems"]} == {"bench/latency-swin.json", "bench/bench-other.json",
                                                     "figures/analysis.json", "vit_cifar-cifar100-ns-s1/metrics.jsonl"}


def test_cli_report_with_a_bench_file_elsewhere(tmp_path, capsys):
    from attnlab.cli import main

    runs = tmp_path / "runs"
    add_run(runs, "vit_cifar", "cifar10", "standard", 0, 93.0)
    bench = tmp_path / "timing.json"
    bench.write_text(json.dumps(BENCH))
    assert main(["report", str(runs), "--no-plots", "--bench", str(bench)]) == 0
    printed = capsys.readouterr().out
    assert "| vit_cifar | cuda:0 (NVIDIA H200), fp32, eager" in printed and "report.html" in printed
    inside = runs / "bench-vit.json"  # found by its name, and given again: one row
    inside.write_text(json.dumps(BENCH))
    assert main(["report", str(runs), "--no-plots", "--bench", str(inside)]) == 0
    assert capsys.readouterr().out.count("| vit_cifar | cuda:0") == 1
    assert main(["report", str(runs), "--bench", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_page_renders_in_headless_chromium(report, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); the page was not rendered")
    root, result = report
    page = (root / "out" / "report.html").read_text()
    # a copy with a script that lists every image's decoded size once the page has loaded
    probe = ('<script>window.addEventListener("load", () => { const p = document.createElement("pre"); '
             'p.id = "sizes"; p.textContent = Array.from(document.images).map(i => i.complete + ":" + i.naturalWidth '
             '+ "x" + i.naturalHeight).join(" "); document.body.appendChild(p); });</script>')
    probed = tmp_path / "probe.html"
    probed.write_text(page.replace("</body>", probe + "</body>"))
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run(flags + ["--virtual-time-budget=10000", "--dump-dom", probed.as_uri()], capture_output=True,
                         text=True, timeout=120).stdout
    sizes = re.search(r'<pre id="sizes">([^<]*)</pre>', dom)
    assert sizes, dom[-2000:]
    decoded = sizes[1].split()
    assert len(decoded) == page.count("<img ") == 9
    for entry in decoded:
        complete, size = entry.split(":")
        width, height = map(int, size.split("x"))
        assert complete == "true" and width > 0 and height > 0, entry

    shot = tmp_path / "shot.png"
    subprocess.run(flags + ["--window-size=1200,2400", f"--screenshot={shot}", (root / "out" / "report.html").as_uri()],
                   capture_output=True, timeout=120)
    from PIL import Image

    pixels = Image.open(shot).convert("L")
    low, high = pixels.getextrema()
    assert pixels.size == (1200, 2400) and high - low > 100  # text and figures, not a blank page
