"""MQAR (Zoology, arXiv 2312.04927) generated locally: every query answered by an independent solver that reads the
key-value context, the layout Zoology's generator draws, its power-law gaps against exact probabilities worked
out here by enumeration, and determinism by (seed, split, index) and (seed, rank, step)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from attnlab.data.mqar import MQAR, build_mqar, mqar_info
from attnlab.errors import ConfigError


def solve(inputs: list[int], num_kv_pairs: int) -> dict[int, int]:
    """The answer at every position whose token is a key of the context: the value that followed it there."""
    context = dict(zip(inputs[0:2 * num_kv_pairs:2], inputs[1:2 * num_kv_pairs:2]))
    return {t: context[tok] for t, tok in enumerate(inputs) if t >= 2 * num_kv_pairs and tok in context}


@pytest.mark.parametrize("geo", [dict(vocab_size=8192, seq_len=64, num_kv_pairs=8),
                                 dict(vocab_size=40, seq_len=32, num_kv_pairs=8),
                                 dict(vocab_size=100, seq_len=64, num_kv_pairs=4, random_non_queries=False)])
def test_every_query_is_answered_by_the_context(geo):
    data = MQAR("train", num_train=300, **geo)
    K, V, L = geo["num_kv_pairs"], geo["vocab_size"], geo["seq_len"]
    x, y = data.examples(range(300))
    for inputs, targets in zip(x.tolist(), y.tolist()):
        keys, values = inputs[0:2 * K:2], inputs[1:2 * K:2]
        assert len(set(keys)) == K and all(1 <= k < V // 2 for k in keys)
        assert len(set(values)) == K and all(V // 2 <= v < V for v in values)
        queries = [t for t, target in enumerate(targets) if target != -100]
        assert len(queries) == K and all(t >= 2 * K and (t - 2 * K) % 2 == 0 for t in queries)
        assert sorted(inputs[t] for t in queries) == sorted(keys)  # each key asked once
        answers = solve(inputs, K)
        assert all(answers[t] == targets[t] for t in queries)
        fillers = [tok for t, tok in enumerate(inputs) if t >= 2 * K and t not in queries]
        if not geo.get("random_non_queries", True):
            assert set(fillers) == {0}
    if geo.get("random_non_queries", True):
        assert len(set(x[:, 2 * K:].flatten().tolist())) > min(V, 1000) // 2  # fillers spread over the vocabulary


def test_query_slots_follow_zoologys_power_law():
    """Slots drawn one after another, without replacement, with probability ~ (g + 1)^(a - 1) among those left:
    inclusion probabilities by enumerating every ordered draw, against 20,000 generated examples."""
    K, slots, a = 2, 6, 0.3
    p = np.arange(1, slots + 1) ** (a - 1.0)
    p /= p.sum()
    exact = np.zeros(slots)
    for first, second in itertools.permutations(range(slots), 2):
        prob = p[first] * p[second] / (1 - p[first])
        exact[[first, second]] += prob
    data = MQAR("train", vocab_size=32, seq_len=2 * K + 2 * slots, num_kv_pairs=K, power_a=a, num_train=20_000)
    _, y = data.examples(range(20_000))
    used = (y[:, 2 * K::2] != -100).double().mean(0).numpy()
    assert np.abs(used - exact).max() < 0.015  # 4 standard errors of 20,000 draws


def test_examples_are_fixed_by_seed_split_and_index():
    a, b = MQAR("train", num_train=5000, seed=0), MQAR("train", num_train=5000, seed=0)
    xa, ya = a.examples([4999, 3, 1500])
    x3, y3 = b[3]
    assert torch.equal(xa[1], x3) and torch.equal(ya[1], y3)
    assert not torch.equal(MQAR("train", seed=1)[3][0], x3)
    assert not torch.equal(MQAR("test", seed=0)[3][0], x3)
    first = a.batch(7, 16, 64, seed=2, rank=1)
    a.batch(0, 16)
    assert all(torch.equal(u, v) for u, v in zip(first, b.batch(7, 16, 64, seed=2, rank=1)))
    assert not torch.equal(first[0], b.batch(7, 16, seed=2, rank=0)[0])
    with pytest.raises(IndexError):
        a.examples([5000])


def test_info_builder_and_errors():
    info = mqar_info(vocab_size=512, seq_len=128, num_kv_pairs=16)
    assert info.model_kwargs() == {"vocab_size": 512, "block_size": 128}
    test = build_mqar(False, data_dir="unused", vocab_size=512, seq_len=128, num_kv_pairs=16, num_test=10)
    assert len(test) == 10 and test[9][0].shape == (128,)
    batches = list(test.eval_batches(4, 128))
    assert [len(b[0]) for b in batches] == [4, 4, 2] and torch.equal(batches[2][0][1], test[9][0])
    with pytest.raises(ConfigError, match="use block size 128"):
        test.batch(0, 2, block_size=64)
    for bad, match in ((dict(seq_len=63), "must be even"), (dict(seq_len=16, num_kv_pairs=8), "seq_len >= 32"),
                       (dict(vocab_size=64, seq_len=64, num_kv_pairs=4), "must exceed seq_len"),
                       (dict(vocab_size=8, seq_len=8, num_kv_pairs=2), "must exceed seq_len"),
                       (dict(vocab_size=9, seq_len=8, num_kv_pairs=2), None)):
        if match is None:
            MQAR("train", **bad)
            continue
        with pytest.raises(ConfigError, match=match):
            MQAR("train", **bad)
    with pytest.raises(ConfigError, match="split"):
        MQAR("val")
