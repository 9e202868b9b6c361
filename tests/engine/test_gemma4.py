"""Gemma-4 in the flex engine: greedy parity with HF on tiny configs that keep every feature.

Features covered (see ``nbhelpers/engine/models/gemma4.py``): KV-shared layers reading a store
layer's pages (one store layer per attention type), sliding (window 16) + full attention with
head_dim 16 / 32, proportional RoPE, per-layer inputs, four norms + layer_scalar (randomised here:
HF initialises them to 1, which would hide a misplaced norm or scalar), final logit soft-cap,
``attention_k_eq_v`` with global KV heads, live PEFT LoRA, GRPO prefix sharing (copy-on-write).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _tiny import hf_greedy, random_prompts

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM

VOCAB = 49152  # tiny-gemma4 runs on the SmolLM2 vocabulary
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
SMALL = {"page_size": 16, "num_pages": 24, "max_model_len": 96}


def _randomise_norms_and_scalars(model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        for layer in model.model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand((), generator=g).item())
    return model


def tiny_gemma4(variant: str = "e2b_like", seed: int = 0):
    """``tiny-gemma4`` of the registry (E2B features), or a variant built here:
    ``k_eq_v`` (V = raw K on full layers, 2 global KV heads: the 31B-style attention),
    ``no_ple_no_sharing`` (hidden_size_per_layer_input 0, num_kv_shared_layers 0) and
    ``e2b_layers`` (E2B's 35-layer pattern, full every 5th, the last 20 KV-shared: store layers
    13 and 14, at hidden 64)."""
    from transformers import Gemma4ForCausalLM

    from nbhelpers.model_configs import tiny_gemma4 as registry_config
    cfg = registry_config()
    if variant != "e2b_like":
        d = cfg.to_dict()
        d.pop("per_layer_config", None)
        if variant == "k_eq_v":
            d.update(attention_k_eq_v=True, num_global_key_value_heads=2, num_attention_heads=4)
        elif variant == "e2b_layers":
            d.update(num_hidden_layers=35, num_kv_shared_layers=20, layer_types=[
                "full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)])
        else:
            d.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
        cfg = type(cfg)(**d, global_head_dim=32)
        cfg.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(seed)
    return _randomise_norms_and_scalars(Gemma4ForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def e2b_like():
    return tiny_gemma4()


def test_tiny_config_keeps_every_feature(e2b_like):
    attn = [ly.self_attn for ly in e2b_like.model.layers]
    assert {a.layer_type for a in attn} == {"sliding_attention", "full_attention"}
    assert {a.head_dim for a in attn} == {16, 32}
    assert any(a.store_full_length_kv for a in attn) and any(a.is_kv_shared_layer for a in attn)
    assert e2b_like.config.hidden_size_per_layer_input > 0
    assert e2b_like.config.final_logit_softcapping == 30.0


@pytest.mark.parametrize("variant", ["e2b_like", "k_eq_v", "no_ple_no_sharing", "e2b_layers"])
def test_greedy_matches_hf(variant, e2b_like):
    model = e2b_like if variant == "e2b_like" else tiny_gemma4(variant)
    if variant == "e2b_layers":  # 35 layers of fp32 rounding reach 1e-4; in fp64 only the
        model = model.double()  # final fp32 log-softmax rounding (~1e-6) is left
    prompts = random_prompts(3, 5, 40, vocab=VOCAB)  # past the 16-token window, across pages
    outs = LLM(model, **SMALL).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert out.token_ids == ref
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lp)) < 1e-4


def test_e2b_layer_pattern_reads_store_layers_13_and_14():
    llm = LLM(tiny_gemma4("e2b_layers"), **SMALL)
    expected = list(range(15)) + [14 if i % 5 == 4 else 13 for i in range(15, 35)]
    assert llm.runner.model.store_of == expected
    assert all(llm.runner.kv.k[i] is llm.runner.kv.k[expected[i]] for i in range(35))


def test_shared_layers_read_the_store_layers_pages(e2b_like):
    llm = LLM(e2b_like, **SMALL)
    kv, store_of = llm.runner.kv, llm.runner.model.store_of
    assert store_of == [0, 1, 0, 1]  # layer 2 (sliding) reads 0, layer 3 (full) reads 1
    assert kv.k[2] is kv.k[0] and kv.v[3] is kv.v[1]  # aliases: no side buffer
    slots = SMALL["num_pages"] * SMALL["page_size"]
    assert kv.bytes() == 2 * 4 * slots * (16 + 32)  # K+V, fp32, storing layers only
    assert kv.k[0].shape == (1, 1, slots, 16) and kv.k[1].shape == (1, 1, slots, 32)


def test_prefix_sharing_forks_match_hf(e2b_like):
    prompt = random_prompts(1, 21, 21, seed=3, vocab=VOCAB)[0]  # partial last page: copy-on-write
    outs = LLM(e2b_like, **SMALL).generate([prompt], SamplingParams(
        temperature=0.0, max_new_tokens=8, ignore_eos=True, n=3))
    ref = hf_greedy(e2b_like, prompt, 8)[0]
    assert [o.token_ids for o in outs] == [ref] * 3


def test_live_lora_matches_peft_and_follows_in_place_updates():
    from peft import LoraConfig, get_peft_model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "per_layer_input_gate", "per_layer_projection"]
    torch.manual_seed(0)
    model = get_peft_model(tiny_gemma4(), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                     init_lora_weights=False)).eval()
    prompt = random_prompts(1, 20, 20, seed=5, vocab=VOCAB)[0]
    llm = LLM(model, **SMALL)
    before = llm.generate([prompt], GREEDY)[0]
    assert before.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)[0]
    with torch.no_grad():  # an optimizer step: in place, same storage
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-3.0)
    after = llm.generate([prompt], GREEDY)[0]
    assert after.token_ids != before.token_ids
    assert after.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens)[0]


def test_arch_spec_masks_and_softcap(e2b_like):
    from nbhelpers.engine.models import get_arch_spec
    spec = get_arch_spec(e2b_like.config)
    sliding, full = spec.mask_for_layer(0), spec.mask_for_layer(1)
    assert full is None and spec.mask_for_layer(2) is sliding  # one factory, one BlockMask
    q = torch.tensor([20, 20, 20])
    assert sliding(q, torch.tensor([4, 5, 20])).tolist() == [False, True, True]  # kv > q - 16
    assert spec.final_logit_softcap == 30.0 and spec.attn_score_mod is None
    assert spec.attn_scale == 1.0


@pytest.mark.parametrize("field,value,match", [("enable_moe_block", True, "MoE"),
                                               ("use_bidirectional_attention", "all", "causal")])
def test_unsupported_variants_are_clear_errors(field, value, match):
    from nbhelpers.engine.models.gemma4_model import _check_supported
    with pytest.raises(ValueError, match=match):
        _check_supported(SimpleNamespace(**{field: value}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (compiled flex_attention + CUDA-graph decode)")
def test_gpu_compiled_graphs_match_hf():
    from nbhelpers.bench.gemma4_report import parity_llm, teacher_forced_parity
    model = tiny_gemma4().cuda()
    prompts = random_prompts(4, 20, 150, vocab=VOCAB)  # several pages of 128, past the window
    llm = parity_llm(model, prompts, 24, page_size=128)  # compile + graphs: on by default
    summary, _ = teacher_forced_parity(model, llm, prompts, 24)
    assert llm.runner.timings["graph_captures"] >= 1
    assert summary["argmax_agreement"] == 1.0 and summary["max_abs_logprob_diff"] < 1e-3


def test_report_architecture_table_and_kv_bytes(e2b_like):
    from nbhelpers.bench import gemma4_report as g4
    table = g4.architecture_table(e2b_like)
    assert table["reads_kv_of"].tolist() == [0, 1, 0, 1]
    assert table["head_dim"].tolist() == [16, 32, 16, 32]
    assert table["rotary_frac"].tolist() == [1.0, 0.25, 1.0, 0.25]  # proportional RoPE on full
    assert table["mlp_width"].tolist() == [128, 128, 256, 256]  # double-wide on shared layers
    # fp32: K+V x (16 + 32) x 4 B for the store layers, twice that if every layer kept its own
    assert g4.kv_bytes_per_token(e2b_like, 4) == {"engine_bytes": 384, "every_layer_bytes": 768}


def test_report_tables_and_result_line():
    import pandas as pd

    from nbhelpers.bench import gemma4_report as g4
    frame = pd.DataFrame([
        {"backend": "flex", "batch": 8, "decode_tok_per_s": 900.0, "error": ""},
        {"backend": "hf_generate", "batch": 8, "decode_tok_per_s": 300.0, "error": ""},
        {"backend": "hf_cb", "batch": 8, "decode_tok_per_s": None, "error": "Ambiguous..."}])
    wide = g4.speedup_table(frame)
    assert wide.loc[8, "flex_x_hf_generate"] == pytest.approx(3.0)
    parity = {"max_abs_logprob_diff": 1e-6, "mean_abs_logprob_diff": 1e-7,
              "argmax_agreement": 1.0, "n_tokens": 64}
    line = g4.result_line(parity, frame, "cpu")
    assert "flex 900" in line and "hf_generate x3.0" in line and "hf_cb" not in line


def test_kernel_probe_case_matches_dense_attention():
    """The probe's paged prefill/decode BlockMasks read exactly each row's causal keys."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from nbhelpers.bench.gemma4_kernels import paged_case
    for is_decode in (True, False):
        c = paged_case(32, is_decode, batch=2, prompt_len=20, page_size=16, device="cpu")
        q, k, v = (c[n].float() for n in ("q", "k", "v"))
        out = flex_attention(q, k, v, block_mask=c["mask"], scale=1.0, enable_gqa=True)
        for r in range(2):  # row r owns pages 1 + 2r, 2 + 2r
            keys = slice(16 * (1 + 2 * r), 16 * (1 + 2 * r) + 21 - (not is_decode))
            rq = q[r, :, :] if is_decode else q[0, :, 20 * r:20 * r + 20]
            ref = F.scaled_dot_product_attention(
                rq, k[0, :, keys].expand(8, -1, -1), v[0, :, keys].expand(8, -1, -1),
                is_causal=not is_decode, scale=1.0)
            got = out[r] if is_decode else out[0, :, 20 * r:20 * r + 20]
            assert (got - ref).abs().max() < 1e-5


def test_decode_limit_skips_the_per_layer_input_table_and_caps_sliding_reads():
    from nbhelpers.bench.gemma4_report import decode_limit_tok_per_s
    from nbhelpers.bench.rollout import H200_COPY_BANDWIDTH_BYTES_PER_S
    # tiny-gemma4: 6,483,424 params, of which the per-layer-input table is 49,152 x 4 x 16
    weights = (6_483_424 - 49_152 * 64) * 2
    # prompt 10, 10 new tokens: full layers read ctx 11..20 (mean 15.5), sliding ones min(ctx, 16)
    kv = 2 * (2 * 16 * 2) * 14.5 + 2 * (2 * 32 * 2) * 15.5
    expected = H200_COPY_BANDWIDTH_BYTES_PER_S / (weights + kv)
    assert decode_limit_tok_per_s("tiny-gemma4", 1, 10, 10) == pytest.approx(expected)


def test_decode_limit_uses_the_card_bandwidth_it_is_given():
    """34 passes the run's measured read bandwidth (its H100 run of 2026-12-07 plotted the H200
    constant as its limit)."""
    from nbhelpers.bench.gemma4_report import decode_limit_tok_per_s, limits_for
    h200 = decode_limit_tok_per_s("tiny-gemma4", 4, 10, 10)
    card = decode_limit_tok_per_s("tiny-gemma4", 4, 10, 10, bandwidth_bytes_per_s=3.0e12)
    from nbhelpers.bench.rollout import H200_COPY_BANDWIDTH_BYTES_PER_S
    assert card == pytest.approx(h200 * 3.0e12 / H200_COPY_BANDWIDTH_BYTES_PER_S)
    sides = [{"batch": 4, "workload": {"prompt_tokens_mean": 10, "max_new_tokens": 10}}]
    assert limits_for("tiny-gemma4", sides, 3.0e12) == {4: pytest.approx(card)}
    assert limits_for("tiny-gemma4", sides) == {4: pytest.approx(h200)}
