"""Shim unsloth_trainer_hooks on both paths: a vanilla HF model gets working hooks, a model that
has them (Unsloth's) is left alone. Run: ``pytest tests/unit/test_shims_unsloth_trainer_hooks.py``.
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from nbhelpers.shims import unsloth_trainer_hooks as shim

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)


def test_vanilla_model_gets_hooks_that_switch_modes():
    model = LlamaForCausalLM(CFG).eval()
    assert shim.needed(model) and shim.apply(model)
    assert model.for_training() is model
    assert model.training and model.config.use_cache is False and model.is_gradient_checkpointing
    model.for_inference()
    assert not model.training and model.config.use_cache is True
    assert not shim.apply(model)  # idempotent


def test_training_without_checkpointing():
    model = LlamaForCausalLM(CFG)
    shim.apply(model)
    model.for_training(use_gradient_checkpointing=False)
    assert model.training and not model.is_gradient_checkpointing


def test_model_with_own_hooks_is_untouched():
    model = LlamaForCausalLM(CFG)
    own = [lambda: "unsloth-train", lambda: "unsloth-infer"]
    model.for_training, model.for_inference = own
    assert not shim.needed(model) and not shim.apply(model)
    assert model.for_training() == "unsloth-train" and model.for_inference() == "unsloth-infer"
