"""The trainer's CUDA attention: sdpa with fully masked query rows unmasked
(:mod:`nbhelpers.grpo.attn_unmask`). The NaN it removes is CUDA-only; here the CPU checks that it
changes nothing a valid position sees, forward or backward."""
from __future__ import annotations

import pytest
import torch

from nbhelpers.grpo import attn_unmask


def test_the_mask_unmasks_only_rows_with_no_key():
    from transformers.masking_utils import causal_mask_function
    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])  # an integer mask, as a tokenizer gives
    mask = attn_unmask.unmasked_rows_mask(batch_size=2, q_length=4, kv_length=4,
                                          mask_function=causal_mask_function,
                                          attention_mask=pad, allow_is_causal_skip=False)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (2, 1, 4, 4)
    assert mask[0, 0, :2].all()  # the two pad rows: every key
    assert mask[0, 0, 2].tolist() == [False, False, True, False]  # valid rows: causal, no pad
    assert mask[0, 0, 3].tolist() == [False, False, True, True]
    assert torch.equal(mask[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_no_padding_keeps_sdpa_is_causal_path():
    from transformers.masking_utils import causal_mask_function
    assert attn_unmask.unmasked_rows_mask(batch_size=2, q_length=4, kv_length=4,
                                          mask_function=causal_mask_function,
                                          attention_mask=torch.ones(2, 4, dtype=torch.long)) is None


def _loss_and_grads(lm, ids, mask):
    lm.zero_grad(set_to_none=True)
    logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
    valid = mask.bool()
    logits[valid].logsumexp(-1).sum().backward()
    return logits[valid].detach(), {n: p.grad.clone() for n, p in lm.named_parameters()
                                    if p.grad is not None}


def test_valid_positions_forward_and_backward_are_sdpa_s():
    from nbhelpers import models
    lm, _ = models.load_model("tiny-llama", dtype="float32", device="cpu")
    ids = torch.randint(5, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0  # row 0 left-padded by 6: six query rows see no key
    ref_logits, ref_grads = _loss_and_grads(lm, ids, mask)
    notes: list[str] = []
    assert attn_unmask.apply(lm, notes, force=True)
    assert lm.config._attn_implementation == attn_unmask.NAME
    assert len(notes) == 1 and attn_unmask.NAME in notes[0]
    logits, grads = _loss_and_grads(lm, ids, mask)
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    greedy = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    lm.set_attn_implementation("sdpa")
    assert torch.equal(greedy, lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                           do_sample=False))


def test_apply_leaves_cpu_and_other_attentions_alone():
    from nbhelpers import models
    lm, _ = models.load_model("tiny-llama", dtype="float32", device="cpu")
    notes: list[str] = []
    assert not attn_unmask.apply(lm, notes)  # CPU, not forced: plain sdpa kept
    assert lm.config._attn_implementation == "sdpa" and notes == []
    eager, _ = models.load_model("tiny-llama", dtype="float32", device="cpu",
                                 attn_implementation="eager")
    assert not attn_unmask.apply(eager, notes, force=True)
    assert eager.config._attn_implementation == "eager" and notes == []


def test_apply_goes_through_a_peft_model():
    peft = pytest.importorskip("peft")
    from nbhelpers import models
    lm, _ = models.load_model("tiny-llama", dtype="float32", device="cpu")
    pm = peft.get_peft_model(lm, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert attn_unmask.apply(pm, [], force=True)
    assert pm.get_base_model().config._attn_implementation == attn_unmask.NAME
