"""Tiny random HF models and an HF greedy reference for the engine tests (CPU, fp32)."""

from __future__ import annotations

import torch

# tiny GEMMs: one thread avoids 2-core oversubscription (16 ms vs 20 us per call measured here)
torch.set_num_threads(1)
VOCAB = 512


def tiny_model(arch: str = "qwen3", seed: int = 0, vocab: int = VOCAB):
    """A 2-layer, hidden-64 ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` (llama3 RoPE scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    common = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 512, "eos_token_id": vocab - 1}
    if arch == "qwen3":
        cfg = Qwen3Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**common, rope_theta=5e5, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    cfg.architectures = [type(model).__name__]
    return model.eval()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (L,), generator=g).tolist() for L in lens]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int):
    """Greedy tokens and raw logprobs from full HF forwards (no KV cache: the plainest
    reference; HF ``generate`` with its cache drifts by ~1e-2 in logprob on these configs)."""
    ids, toks, lps = list(prompt), [], []
    for _ in range(max_new_tokens):
        device = next(model.parameters()).device  # the model may live on CUDA (engine tests)
        logp = torch.log_softmax(model(torch.tensor([ids], device=device)).logits[0, -1].float(),
                                 -1)
        tok = int(logp.argmax())
        toks.append(tok)
        lps.append(logp[tok].item())
        ids.append(tok)
    return toks, lps


def skip_if_assets_missing(name: str, load, *args, **kwargs):
    """``load(*args, **kwargs)`` (e.g. ``nbhelpers.models.load_model(name)``, which needs the
    model's fetched weights or tokenizer), or a pytest skip naming the fetch command when the
    assets of registry model ``name`` are not in the cache (``ModelAssetsMissing``)."""
    import pytest

    from nbhelpers.assets import ModelAssetsMissing, fix_command
    try:
        return load(*args, **kwargs)
    except ModelAssetsMissing as err:
        pytest.skip(f"{name} assets not fetched: run `{fix_command(name)}` ({err})")
