"""``FlexBackend.load`` checks what needs no weights before loading them (a 4B model is ~8 GB):
runner option values and an explicit ``max_model_len`` against the model's context."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the flex backend needs torch (pip install -e '.[cpu]')")

from nbhelpers.backends import _common
from nbhelpers.backends.flex import FlexBackend
from nbhelpers.config import ModelSpec

SPEC = ModelSpec("tiny-qwen3", kind="random", dtype="float32")  # context 2048 tokens


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the options were checked")
    monkeypatch.setattr(_common, "load_hf", refuse)


def test_max_model_len_above_context_fails_before_the_weights(no_weights):
    with pytest.raises(ValueError, match=r"max_model_len=4096.*context is 2048.*"
                                         r"allow_long_max_model_len=True"):
        FlexBackend().load(SPEC, None, max_model_len=4096)


@pytest.mark.parametrize("options,match", [
    ({"skinny_gemm": "on"}, "skinny_gemm"),
    ({"page_size": 0}, "page_size"),
    ({"allow_long_max_model_len": "yes", "max_model_len": 4096}, "allow_long_max_model_len"),
])
def test_bad_runner_values_fail_before_the_weights(no_weights, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FlexBackend().load(SPEC, None, **options)


def test_valid_options_reach_the_weights(no_weights):
    """The preflight lets good values through: the (refused) weight load is what stops it."""
    with pytest.raises(AssertionError, match="weights were loaded"):
        FlexBackend().load(SPEC, None, max_model_len=2048, skinny_gemm="off")
    with pytest.raises(AssertionError, match="weights were loaded"):
        FlexBackend().load(SPEC, None, max_model_len=4096, allow_long_max_model_len=True)
