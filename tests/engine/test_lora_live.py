"""Live LoRA: the engine reads PEFT's lora_A/lora_B in place; an in-place update is seen."""

from __future__ import annotations

import pytest
import torch
from _tiny import hf_greedy, random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture()
def peft_model():
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return get_peft_model(tiny_model("qwen3"), cfg).eval()


@pytest.mark.parametrize("fuse", [True, False], ids=["fused_A", "separate_A"])
def test_lora_matches_peft_and_sees_in_place_updates(peft_model, fuse):
    prompt = random_prompts(1, 12, 12, seed=9)[0]
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64, fuse_lora_a=fuse)
    before = llm.generate([prompt], GREEDY)[0]
    assert before.token_ids == hf_greedy(peft_model, prompt, 10)[0]
    weights_before = {n: p.data_ptr() for n, p in peft_model.named_parameters()}
    with torch.no_grad():  # what an optimizer step does: in place, same storage
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    after = llm.generate([prompt], GREEDY)[0]
    ref, ref_lp = hf_greedy(peft_model, prompt, 10)
    assert after.token_ids != before.token_ids
    assert after.token_ids == ref
    assert max(abs(a - b) for a, b in zip(after.logprobs, ref_lp)) < 1e-4
    assert weights_before == {n: p.data_ptr() for n, p in peft_model.named_parameters()}


def test_engine_adds_no_parameter_memory(peft_model):
    n_before = sum(p.numel() for p in peft_model.parameters())
    llm = LLM(peft_model, page_size=8, num_pages=8, max_model_len=32)
    assert sum(p.numel() for p in peft_model.parameters()) == n_before
    engine_tensors = {t.data_ptr() for g in llm.runner.model.qkv for t in g.tensors()}
    model_tensors = {p.data_ptr() for p in peft_model.parameters()}
    assert engine_tensors <= model_tensors  # the engine reads the model's own storage


def test_fused_views_share_storage_and_see_adamw_steps(peft_model):
    """q/k/v and gate/up base weights and LoRA A are views of one buffer each (same Parameter
    objects); an AdamW step on the PEFT model is seen by the next rollout (live LoRA)."""
    params_before = dict(peft_model.named_parameters())
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64)
    assert dict(peft_model.named_parameters()) == params_before  # same objects, re-pointed
    attn = peft_model.get_base_model().model.layers[0].self_attn
    q, k = attn.q_proj, attn.k_proj
    for a, b in ((q.base_layer.weight, k.base_layer.weight),
                 (q.lora_A["default"].weight, k.lora_A["default"].weight)):
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    qa = q.lora_A["default"].weight  # same dtype as the base: A rows join the base buffer
    assert qa.untyped_storage().data_ptr() == q.base_layer.weight.untyped_storage().data_ptr()
    prompt = random_prompts(1, 12, 12, seed=4)[0]
    before = llm.generate([prompt], GREEDY)[0].token_ids
    ids = torch.tensor([prompt])
    peft_model.train()
    for _ in range(3):
        peft_model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    peft_model.eval()
    after = llm.generate([prompt], GREEDY)[0].token_ids
    assert after != before
    assert after == hf_greedy(peft_model, prompt, 10)[0]


def test_fused_plain_model_saves_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM
    model = tiny_model("qwen3")
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    LLM(model, page_size=8, num_pages=8, max_model_len=32)  # re-points q/k/v, gate/up
    q_ptr = model.model.layers[0].self_attn.q_proj.weight.data_ptr()
    LLM(model, page_size=8, num_pages=8, max_model_len=32)  # already fused: no second copy
    assert model.model.layers[0].self_attn.q_proj.weight.data_ptr() == q_ptr
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ref.items())


def test_replaced_storage_is_re_fused_and_seen(peft_model):
    """``load_state_dict(assign=True)`` swaps every tensor: the engine re-fuses and follows."""
    prompt = random_prompts(1, 12, 12, seed=6)[0]
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64)
    before = llm.generate([prompt], GREEDY)[0].token_ids
    state = {k: (-v if "lora_B" in k else v).clone() for k, v in peft_model.state_dict().items()}
    peft_model.load_state_dict(state, assign=True)
    after = llm.generate([prompt], GREEDY)[0].token_ids
    assert after != before
    assert after == hf_greedy(peft_model, prompt, 10)[0]
    attn = peft_model.get_base_model().model.layers[0].self_attn
    q, v = attn.q_proj.lora_A["default"].weight, attn.v_proj.lora_A["default"].weight
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # fused again


def test_disabled_adapter_gives_the_base_model(peft_model):
    prompt = random_prompts(1, 12, 12, seed=7)[0]
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64)
    with_lora = llm.generate([prompt], GREEDY)[0].token_ids
    with peft_model.disable_adapter():
        base = llm.generate([prompt], GREEDY)[0].token_ids
        assert base == hf_greedy(peft_model, prompt, 10)[0]
    assert base != with_lora
    assert llm.generate([prompt], GREEDY)[0].token_ids == with_lora


def test_lora_on_some_projections_only():
    """LoRA on q/v but not k (TRL-style targets): the q/k/v group runs per part, B is applied."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                     init_lora_weights=False)
    model = get_peft_model(tiny_model("qwen3"), cfg).eval()
    prompt = random_prompts(1, 12, 12, seed=8)[0]
    llm = LLM(model, page_size=8, num_pages=32, max_model_len=64)
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(model, prompt, 10)[0]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(model, prompt, 10)[0]


def _fresh(model, prompt):
    return LLM(model, page_size=8, num_pages=32, max_model_len=64).generate([prompt], GREEDY)[0]


def _same_as_fresh(llm, model, prompt):
    got, want = llm.generate([prompt], GREEDY)[0], _fresh(model, prompt)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    return got


@pytest.mark.parametrize("fuse", [True, False])
def test_a_new_lora_scaling_is_seen(peft_model, fuse):
    """PEFT's ``scaling`` is a Python float the fused path read once (helper-7's probe,
    2026-12-03: ``scaling *= 20`` after the engine was built kept the old tokens); it is part
    of the live-weights check and of the graph signature now."""
    prompt = random_prompts(1, 12, 12, seed=7)[0]
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64, fuse_lora_a=fuse)
    before = llm.generate([prompt], GREEDY)[0]
    sig = llm.runner.model.signature()
    for module in peft_model.modules():
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
            module.scaling["default"] *= 20
    after = _same_as_fresh(llm, peft_model, prompt)
    assert after.logprobs != before.logprobs
    assert llm.runner.model.signature() != sig  # a CUDA graph would be recaptured


def test_a_switched_adapter_is_seen(peft_model):
    """``set_adapter`` after the engine was built: the engine follows (it chose the adapter
    once before) and recaptures; with two adapters active it refuses, naming the fix."""
    from peft import LoraConfig
    torch.manual_seed(1)
    peft_model.add_adapter("b", LoraConfig(r=4, lora_alpha=32, target_modules=TARGETS,
                                           init_lora_weights=False))
    prompt = random_prompts(1, 12, 12, seed=7)[0]
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64)
    first = llm.generate([prompt], GREEDY)[0]
    sig = llm.runner.model.signature()
    peft_model.set_adapter("b")
    second = _same_as_fresh(llm, peft_model, prompt)
    assert second.logprobs != first.logprobs and llm.runner.model.signature() != sig
    peft_model.set_adapter("default")
    back = llm.generate([prompt], GREEDY)[0]
    assert back.token_ids == first.token_ids
    torch.testing.assert_close(back.logprobs, first.logprobs, atol=1e-5, rtol=0)


def test_disabling_or_merging_changes_the_graph_signature(peft_model):
    """A captured graph bakes LoRA in: ``disable_adapter()`` and ``merge_adapter()`` must change
    the signature (CUDA graphs recapture) as well as the eager result."""
    llm = LLM(peft_model, page_size=8, num_pages=32, max_model_len=64)
    model = llm.runner.model
    sig = model.signature()
    with peft_model.disable_adapter():
        assert model.signature() != sig
    assert model.signature() == sig
    peft_model.merge_adapter()
    try:
        assert model.signature() != sig
    finally:
        peft_model.unmerge_adapter()
