"""The ``flex`` backend through the contract on tiny random Qwen3 (n=2 greedy samples agree)."""

from __future__ import annotations

import pytest

from nbhelpers.backends import get_backend
from nbhelpers.config import ModelSpec, SamplingParams


def test_flex_backend_contract_shapes_and_group_greedy():
    models = pytest.importorskip("nbhelpers.models")
    name = next((n for n in models.list_models() if "tiny" in n and "qwen3" in n), None)
    if name is None:
        pytest.skip("no tiny-qwen3 entry in nbhelpers.models yet")
    spec = ModelSpec(name=name, kind="random", dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, n=2)
    flex = get_backend("flex")
    from _tiny import skip_if_assets_missing
    skip_if_assets_missing(name, flex.load, spec, None, device="cpu", kv_tokens=1024,
                           max_model_len=128)
    outs = flex.generate([[5, 6, 7, 8], [9, 10, 11]], greedy)
    flex.close()
    assert len(outs) == 4 and outs[0].token_ids == outs[1].token_ids
    assert all(len(o.token_ids) == 6 and len(o.logprobs) == 6 for o in outs)
    with pytest.raises(ValueError, match="unknown engine options"):
        get_backend("flex").load(spec, None, page_sz=3)


def test_adapter_dtype_model_casts_peft_fp32_adapters_in_place_and_bad_value_is_named():
    import torch
    from _tiny import tiny_model
    from peft import LoraConfig, get_peft_model

    from nbhelpers.backends.flex import cast_adapters_to_base_dtype
    base = tiny_model("qwen3").to(torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    lora = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    assert {p.dtype for p in lora.values()} == {torch.float32}  # PEFT's default upcast
    assert cast_adapters_to_base_dtype(peft) == len(lora)
    after = dict(peft.named_parameters())
    assert all(after[n] is p and p.dtype == torch.bfloat16 for n, p in lora.items())
    assert cast_adapters_to_base_dtype(peft) == 0
    spec = ModelSpec(name="tiny-qwen3", kind="random", dtype="float32")
    with pytest.raises(ValueError, match=r"adapter_dtype='bf16': use one of \('peft', 'model'\)"):
        get_backend("flex").load(spec, None, device="cpu", adapter_dtype="bf16")
