"""nbhelpers.shims.transformers_top_k: both paths, and a canary for its removal condition."""

import pytest

from nbhelpers.shims.transformers_top_k import TRANSFORMERS_TOP_K_OFF, vllm_top_k_to_transformers


@pytest.mark.parametrize("disabled", [-1, 0, None])
def test_disabled_top_k_maps_to_transformers_off(disabled):
    assert vllm_top_k_to_transformers(disabled) == TRANSFORMERS_TOP_K_OFF == 0


@pytest.mark.parametrize("k", [1, 5, 50])
def test_positive_top_k_passes_through(k):
    assert vllm_top_k_to_transformers(k) == k


@pytest.mark.parametrize("bad", [-2, 1.5, "5", True])
def test_bad_top_k_raises_with_fix(bad):
    with pytest.raises(ValueError, match="int >= -1"):
        vllm_top_k_to_transformers(bad)


def test_canary_transformers_still_rejects_minus_one():
    """When this fails, transformers accepts top_k=-1: delete the shim (its removal condition)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    with pytest.raises(ValueError, match="strictly positive"):
        TopKLogitsWarper(top_k=-1)


def test_translated_value_builds_a_sampling_processor_list():
    """The shimmed value goes through transformers' own processor selection without error."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    cfg = GenerationConfig(do_sample=True, top_k=vllm_top_k_to_transformers(-1), min_p=0.1)
    procs = GenerationMixin._get_logits_processor(
        GenerationMixin(), generation_config=cfg, input_ids_seq_length=1,
        encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList())
    assert not any(type(p).__name__ == "TopKLogitsWarper" for p in procs)
    assert any(type(p).__name__ == "MinPLogitsWarper" for p in procs)
