"""RunnerOptions ``"auto"`` kernels: the Triton decode attention and LoRA-B kernel on CUDA when
triton imports, flex / addmm otherwise; explicit choices are kept; bad values raise."""

import importlib.util

import pytest

from nbhelpers.engine.model_runner import RunnerOptions, resolve_kernels


def test_auto_resolves_by_device_and_triton(monkeypatch):
    opt = RunnerOptions()
    assert (opt.decode_attention, opt.lora_expand) == ("auto", "auto")
    assert resolve_kernels(opt, on_cuda=False) == ("flex", "addmm")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert resolve_kernels(opt, on_cuda=True) == ("triton", "consumer")  # H200 A/B n17a
    assert resolve_kernels(opt, True, decode_kernels=("flex",)) == ("flex", "consumer")  # Gemma-4
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert resolve_kernels(opt, on_cuda=True) == ("flex", "addmm")


def test_explicit_choices_are_kept():
    opt = RunnerOptions(decode_attention="flex", lora_expand="addmm")
    assert resolve_kernels(opt, on_cuda=True) == ("flex", "addmm")


@pytest.mark.parametrize("field,value", [("decode_attention", "fast"), ("lora_expand", "bmm")])
def test_bad_values_name_the_choices(field, value):
    with pytest.raises(ValueError, match="auto"):
        RunnerOptions(**{field: value})


def test_cpu_engine_resolves_auto_to_sdpa_and_addmm():
    from _tiny import skip_if_assets_missing

    from nbhelpers.engine import LLM
    from nbhelpers.models import load_model
    model, _ = skip_if_assets_missing("tiny-qwen3", load_model, "tiny-qwen3")
    llm = LLM(model, page_size=16, num_pages=8, max_model_len=64)
    assert (llm.runner.decode_attention, llm.runner.lora_expand) == ("sdpa", "addmm")
    assert llm.runner.prefill_attention == "sdpa" and llm.runner.attention_note is None
