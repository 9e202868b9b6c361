"""nbhelpers.adapters: canonical adapters are non-zero, load in PEFT, cache, and copy into another
wrapper through key normalisation. Tiny Qwen3 config built in the test (no assets). Run:
``pytest tests/unit/test_lora.py -q``.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from nbhelpers import adapters as L
from nbhelpers.config import LoraSpec

CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8)
SPEC = LoraSpec(rank=4, alpha=8)
IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _base(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(CFG).eval()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return L.make_adapter(CFG, SPEC, tmp_path_factory.mktemp("adapter"), seed=1)


def test_adapter_files_and_nonzero_b(adapter):
    assert (adapter / "adapter_config.json").is_file()
    state = L.load_adapter_state(adapter)
    b = [v for k, v in state.items() if ".lora_B." in k]
    assert len(b) == 2 * 7  # 2 layers x 7 targets
    stds = torch.stack([t.float().std() for t in b])
    assert bool((stds > 0.5 * L.DEFAULT_B_STD).all() and (stds < 2 * L.DEFAULT_B_STD).all())
    meta = json.loads((adapter / "nbhelpers_adapter.json").read_text())
    assert meta["n_lora_layers"] == 14 and meta["rank"] == 4


def test_adapter_changes_logits_and_is_off_when_disabled(adapter):
    base_logits = _base()(IDS).logits
    model = L.apply_adapter(_base(), adapter)
    with torch.no_grad():
        on = model(IDS).logits
        with model.disable_adapter():
            off = model(IDS).logits
    assert torch.allclose(off, base_logits, atol=1e-6)
    assert (on - off).abs().max() > 1e-4


def test_init_b_std_is_used_when_positive(tmp_path):
    path = L.make_adapter(CFG, LoraSpec(rank=4, alpha=8, init_b_std=0.5), tmp_path)
    b = [v for k, v in L.load_adapter_state(path).items() if ".lora_B." in k]
    assert 0.3 < float(torch.cat([t.flatten() for t in b]).std()) < 0.7


def test_normalise_lora_key_both_spellings():
    live = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    saved = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert L.normalise_lora_key(live) == L.normalise_lora_key(saved) == \
        "model.layers.0.self_attn.q_proj.lora_A.weight"


def test_copy_adapter_into_other_wrapper_matches_peft_load(adapter):
    ref = L.apply_adapter(_base(), adapter)
    wrapped = get_peft_model(_base(), L.peft_config(SPEC)).eval()
    assert L.copy_adapter_into(wrapped, adapter) == 14
    with torch.no_grad():
        assert torch.allclose(wrapped(IDS).logits, ref(IDS).logits, atol=1e-6)


def test_copy_adapter_into_wrong_rank_fails(adapter):
    wrapped = get_peft_model(_base(), L.peft_config(LoraSpec(rank=8, alpha=16)))
    with pytest.raises(ValueError, match="adapter shape"):
        L.copy_adapter_into(wrapped, adapter)
    partial = get_peft_model(_base(), L.peft_config(LoraSpec(rank=4, targets=("q_proj",))))
    with pytest.raises(KeyError, match="only in adapter"):
        L.copy_adapter_into(partial, adapter)


def test_bad_targets_raise(tmp_path):
    with pytest.raises(ValueError, match="targets"):
        L.make_adapter(CFG, LoraSpec(targets=("no_such_proj",)), tmp_path)


def test_canonical_adapter_is_cached(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(L, "model_hf_config", lambda name: calls.append(name) or CFG)
    first = L.canonical_adapter("tiny-x", SPEC, root=tmp_path)
    second = L.canonical_adapter("tiny-x", SPEC, root=tmp_path)
    assert first == second and calls == ["tiny-x"]
    other = L.canonical_adapter("tiny-x", LoraSpec(rank=4, alpha=8, init_b_std=0.1), root=tmp_path)
    assert other != first
