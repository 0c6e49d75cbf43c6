"""The spec language: parsing, canonical names, and errors that list what is valid."""

import json

import pytest

import attnlab
from attnlab.cli import main
from attnlab.errors import SpecError
from attnlab.spec import format_value, split_specs
from attnlab.variants import VARIANTS, Option, Variant, register


@pytest.fixture
def toy_variants():
    """Registry entries standing in for methods of every kind, removed after the test."""
    added = [
        Variant("toyhead", "head", "t", "p", "x:y", {"steps": Option(1, int, minimum=1), "eps": Option(1e-6, float)}),
        Variant("toyw", "weight", "t", "p", "x:y", {"mode": Option("a", str, choices=("a", "b")),
                                                    "flag": Option(False, bool)}, conflicts={"toyw2": "both rescale W"}),
        Variant("toyw2", "weight", "t", "p", "x:y"),
        Variant("toyk", "kernel", "t", "p", "x:y", {"lam": Option(10.0, (float, str))}),
    ]
    for v in added:
        register(v)
    yield
    for v in added:
        del VARIANTS[v.name]


def test_standard():
    spec = attnlab.parse_spec("standard")
    assert str(spec) == "standard" and spec.kernel.name == "standard"
    assert str(attnlab.parse_spec(None)) == "standard"


@pytest.mark.parametrize("text", ["toyhead", "toyhead(steps=2)", "toyhead(eps=1e-8)", "toyk(lam=auto)+toyhead",
                                  "toyk+toyhead(steps=3,eps=0.001)+toyw(mode=b,flag=true)", "toyw"])
def test_canonical_round_trip(toy_variants, text):
    spec = attnlab.parse_spec(text)
    assert str(spec) == text
    assert attnlab.parse_spec(str(spec)) == spec


def test_normalisation(toy_variants):
    # whitespace ignored, defaults dropped, keys in registry order, kinds in canonical order
    assert str(attnlab.parse_spec(" toyhead( eps = 1e-6 , steps=2 ) ")) == "toyhead(steps=2)"
    assert str(attnlab.parse_spec("toyw+toyhead+toyk")) == "toyk+toyhead+toyw"
    assert str(attnlab.parse_spec("standard+toyhead")) == "toyhead"
    assert attnlab.parse_spec("toyhead(steps=1)") == attnlab.parse_spec("toyhead")
    assert attnlab.parse_spec("toyk(lam=10)").get("toyk").resolved()["lam"] == 10.0


def test_format_value():
    assert format_value(1e-8) == "1e-8" and format_value(0.5) == "0.5" and format_value(True) == "true"
    assert format_value(10.0) == "10" and format_value(3) == "3"


@pytest.mark.parametrize("text,message", [
    ("nope", "valid names are: standard"),
    ("toyhead(step=2)", "its options are: steps, eps"),
    ("toyhead(steps=two)", "takes a int"),
    ("toyhead(steps=0)", "at least 1"),
    ("toyw(mode=c)", "one of: a, b"),
    ("toyw(flag=maybe)", "takes a bool"),
    ("toyhead(steps)", "key=value"),
    ("toyhead+toyhead", "more than once"),
    ("toyk+standard", "2 attention kernels"),
    ("toyw+toyw2", "both rescale W"),
    ("", "empty"),
    ("ns(", "cannot read"),
])
def test_errors(toy_variants, text, message):
    with pytest.raises(SpecError, match=message):
        attnlab.parse_spec(text)


def test_error_is_attnlab_error():
    with pytest.raises(attnlab.AttnlabError):
        attnlab.parse_spec("bogus")


def test_list_variants_has_standard():
    names = [v["name"] for v in attnlab.list_variants()]
    assert names[0] == "standard"
    assert all(set(v) >= {"name", "kind", "summary", "paper", "options"} for v in attnlab.list_variants())


def test_plus_inside_parentheses_is_a_value(toy_variants):
    register(Variant("toyt", "weight", "t", "p", "x:y", {"targets": Option("qkv", str, choices=("qkv", "qkv+mlp"))}))
    try:
        spec = attnlab.parse_spec("toyhead+toyt(targets=qkv+mlp)")
        assert [t.name for t in spec.terms] == ["toyhead", "toyt"]
        assert spec.get("toyt").resolved()["targets"] == "qkv+mlp"
        assert attnlab.parse_spec(str(spec)) == spec
    finally:
        del VARIANTS["toyt"]


# ---------------------------------------------------------------------------------------------- lists of specs
@pytest.mark.parametrize("text,expected", [
    ("standard,ns", ["standard", "ns"]),
    (" standard , ns ,", ["standard", "ns"]),
    ("dna(variant=q,alpha_init=1),ns", ["dna(variant=q,alpha_init=1)", "ns"]),
    ("standard, dna(variant=q,alpha_init=1)+ns(steps=2,eps=1e-8)",
     ["standard", "dna(variant=q,alpha_init=1)+ns(steps=2,eps=1e-8)"]),
    ("", []),
    ("ns),dna", ["ns)", "dna"]),  # a stray ')' does not glue the rest together; parse_spec reports it
])
def test_split_specs_splits_at_commas_outside_parentheses(text, expected):
    assert split_specs(text) == expected


def test_every_split_item_parses():
    items = split_specs("standard,dna(variant=q,alpha_init=1)+ns,ns(steps=2)")
    assert [str(attnlab.parse_spec(s)) for s in items] == ["standard", "dna(variant=q,alpha_init=1)+ns", "ns(steps=2)"]


def test_bench_cli_reads_a_spec_with_an_inner_comma_as_one(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", "vit_digits", "--attn", "dna(variant=q,alpha_init=1),ns", "--batch-size", "2",
            "--warmup", "0", "--iters", "1", "--rounds", "1", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["models"]) == ["dna(variant=q,alpha_init=1)", "ns"]
    assert result["baseline"] == "dna(variant=q,alpha_init=1)"


def test_variants_cost_cli_reads_a_spec_with_an_inner_comma_as_one(capsys):
    argv = ["variants", "--cost", "vit_digits", "--attn", "dna(variant=q,alpha_init=1),ns", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in rows] == ["dna(variant=q,alpha_init=1)", "ns"]
