"""Fixture for the training tests: a model wrapper that misbehaves on cue."""

from __future__ import annotations

import pytest


@pytest.fixture
def on_train_forward(monkeypatch):
    """``on_train_forward(fn)``: every model built afterwards calls ``fn(count, output)`` after each training-mode
    forward (count from 1) and uses its return value, if not None, as the output."""

    def install(fn):
        import attnlab.models as models

        original = models.build_model

        def build(*args, **kwargs):
            model = original(*args, **kwargs)
            calls = [0]

            def hook(module, inputs, output):
                if module.training:
                    calls[0] += 1
                    return fn(calls[0], output)
                return None

            model.register_forward_hook(hook)
            return model

        monkeypatch.setattr(models, "build_model", build)

    return install
