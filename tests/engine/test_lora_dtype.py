"""``lora_dtype="model"``: TRL's fp32 adapters computed in the base dtype from shadow copies
(``engine/lora.py`` ``LiveGroup.set_lora_dtype``), refreshed on the trainer's version counter.

Runs on the CPU (bf16 tiny models, torch paths) and on the GPU (``DEV``).
"""

from __future__ import annotations

import pytest
import torch
from _kernels import DEV, inplace_lora_step, peft_tiny
from _tiny import random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM
from nbhelpers.engine.lora import LiveGroup
from nbhelpers.engine.runner_options import RunnerOptions
from nbhelpers.engine.runner_resolve import resolve_lora_dtype


def _groups(model):
    layer = model.get_base_model().model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj], [attn.o_proj]]


def _by_hand(x, mods):
    """The shadow path's arithmetic: ``y = x W^T``, ``xa = x A_bf16^T`` (rounded to bf16, as the
    joined GEMM writes it), ``y += s * xa B_bf16^T`` in bf16."""
    out = []
    for m in mods:
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        y = torch.nn.functional.linear(x, m.base_layer.weight)
        xa = torch.nn.functional.linear(x, a.to(x.dtype))
        out.append(torch.addmm(y.reshape(-1, y.shape[-1]), xa.reshape(-1, xa.shape[-1]),
                               b.to(x.dtype).t(), alpha=m.scaling["default"]).view_as(y))
    return out


def test_shadow_group_matches_peft_keeps_the_fp32_adapters_and_sees_in_place_updates():
    model = peft_tiny(torch.bfloat16)  # PEFT default: fp32 adapters on a bf16 base
    x = torch.randn(1, 5, 64, device=DEV).to(torch.bfloat16)
    for mods in _groups(model):
        lora = [t for m in mods for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
        before = [t.detach().clone() for t in lora]
        group = LiveGroup(mods)
        group.set_lora_dtype("model")
        assert "shadow" in group._fused and group._fused["W"].dtype == torch.bfloat16
        buf = group._fused["W"]
        for m in mods:  # base weights live in the group's buffer (no second copy of W)
            assert m.base_layer.weight.untyped_storage().data_ptr() == \
                buf.untyped_storage().data_ptr()
        with torch.no_grad():
            got, ref = group(x), [m(x) for m in mods]
        assert all(t.dtype == torch.float32 for t in lora)  # the trainer's tensors untouched
        assert all(torch.equal(t, b) for t, b in zip(lora, before))
        for g, h, r in zip(got, _by_hand(x, mods), ref):
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g, h, rtol=1.6e-2, atol=1e-2)  # summation order only
            torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)  # PEFT's fp32 order
        with torch.no_grad():  # an optimizer step: in place, same storage, version bumped
            for m in mods:
                m.lora_B["default"].weight.add_(0.25)
                m.lora_A["default"].weight.mul_(-2.0)
            after = group(x)
            fresh = LiveGroup(mods)
            fresh.set_lora_dtype("model")
            want = fresh(x)
        for a, g, w in zip(after, got, want):
            assert not torch.equal(a, g)  # the update reached the shadows
            assert torch.equal(a, w)  # exactly what a group built after the update computes


def test_replaced_adapter_storage_refuses_and_adapter_mode_reads_fp32():
    model = peft_tiny(torch.bfloat16)
    mods = _groups(model)[0]
    x = torch.randn(3, 64, device=DEV).to(torch.bfloat16)
    group = LiveGroup(mods)
    group.set_lora_dtype("model")
    with torch.no_grad():
        first = group(x)
        for m in mods:  # load_state_dict(assign=True)-like: new storage, new values
            w = m.lora_B["default"].weight
            w.data = w.data.clone() + 0.5
        second = group(x)
    assert all(not torch.equal(a, b) for a, b in zip(first, second))
    group.set_lora_dtype("adapter")
    assert group._fused is None or "shadow" not in group._fused
    with torch.no_grad():
        for g, r in zip(group(x), [m(x) for m in mods]):
            torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)
    with pytest.raises(ValueError, match="lora_dtype"):
        group.set_lora_dtype("fp8")


def test_same_dtype_adapters_need_no_shadow():
    model = peft_tiny(torch.bfloat16, autocast_adapter_dtype=False)  # bf16 adapters
    group = LiveGroup(_groups(model)[0])
    group.set_lora_dtype("model")
    assert group._fused["ext"] and "shadow" not in group._fused


def test_auto_is_model_on_cuda_and_adapter_on_the_cpu_and_bad_values_are_clear():
    assert resolve_lora_dtype(RunnerOptions(), on_cuda=True) == "model"
    assert resolve_lora_dtype(RunnerOptions(), on_cuda=False) == "adapter"
    assert resolve_lora_dtype(RunnerOptions(lora_dtype="adapter"), on_cuda=True) == "adapter"
    with pytest.raises(ValueError, match=r"lora_dtype='bf16'.*'adapter', 'model'"):
        RunnerOptions(lora_dtype="bf16")


def _bf16_adapter_copy(model):
    """A deep copy of ``model`` with its LoRA tensors cast to bf16: the arithmetic the shadows
    run, through the engine's ordinary 16-bit-adapter path."""
    import copy
    twin = copy.deepcopy(model)
    for name, p in twin.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(torch.bfloat16)
    return twin


def test_engine_shadow_is_the_bf16_adapter_path_and_follows_the_trainer():
    """The engine with shadows gives the tokens and logprobs of the same engine on a bf16 copy of
    the adapters (same GEMMs), before and after an in-place update of the trainer's fp32
    tensors, which the next generate sees with no user call."""
    model = peft_tiny(torch.bfloat16)
    prompts = random_prompts(2, 10, 10, seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    kw = {"page_size": 64, "num_pages": 8, "max_model_len": 32}
    shadow = LLM(model, lora_dtype="model", **kw)

    def check():
        twin = LLM(_bf16_adapter_copy(model), lora_dtype="adapter", **kw)
        got, want = shadow.generate(prompts, greedy), twin.generate(prompts, greedy)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
        return [g.token_ids for g in got]

    before = check()
    inplace_lora_step(model)
    assert check() != before


def test_kernel_option_dicts_are_checked_at_construction():
    """Checked on every host, not only where the Triton decode kernel is built."""
    with pytest.raises(ValueError, match="decode_kernel_options='v2': must be a dict"):
        RunnerOptions(decode_kernel_options="v2")
    with pytest.raises(ValueError, match=r"\['kernel'\]='v3'.*'auto', 'v1', 'v2'"):
        RunnerOptions(decode_kernel_options={"kernel": "v3"})
    with pytest.raises(ValueError, match="prefill_kernel_options='x'"):
        RunnerOptions(prefill_kernel_options="x")
    assert RunnerOptions(decode_kernel_options={"kernel": "v2"}).decode_kernel_options
