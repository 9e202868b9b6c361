"""Config builders for the registry's random-weight architectures (real shapes and tiny ones).

Contract: every builder returns a fresh transformers ``PretrainedConfig`` whose
``architectures[0]`` names the HF class; nothing is downloaded. Full-size values are copied from
the models' public ``config.json`` files (sources in each docstring); tiny configs keep every
architecture feature the flex engine must reproduce, at hidden 64 and 2-4 layers, on the SmolLM2
tokenizer's vocabulary (49,152 ids: ``<|endoftext|>``=0, ``<|im_start|>``=1, ``<|im_end|>``=2).

Run: ``python -c "from nbhelpers.model_configs import qwen3_4b; print(qwen3_4b())"``.
"""

from __future__ import annotations

from typing import Any

SMOLLM2_VOCAB = 49152
SMOLLM2_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
"""Special ids of the converted SmolLM2 tokenizer (its config.json: bos 1, eos 2, pad 2)."""

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
"""Llama-3.2 rope scaling (meta-llama/Llama-3.2-3B config.json ``rope_scaling``)."""


def _with_arch(cfg: Any, arch: str) -> Any:
    cfg.architectures = [arch]
    return cfg


def qwen3_4b() -> Any:
    """Qwen/Qwen3-4B (``Qwen3ForCausalLM``), values of its hub ``config.json``.

    hidden 2560, 36 layers, 32 heads / 8 KV heads, head_dim 128, FFN 9728, vocab 151,936,
    rope_theta 1e6, rms eps 1e-6, tied embeddings, max positions 40,960, bos 151643, eos 151645.
    Cross-checked against public copies of that file (e.g. a FLUX.2-klein ``text_encoder/
    config.json`` fixture, which is Qwen3-4B) and the Qwen3-4B-Base model card (36 layers, GQA
    32/8). Note: Qwen3-4B-Instruct-2507 differs (max positions 262,144, rope_theta 5e6).
    """
    from transformers import Qwen3Config

    return _with_arch(Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643,
    ), "Qwen3ForCausalLM")


def llama_3_2_3b() -> Any:
    """meta-llama/Llama-3.2-3B(-Instruct) (``LlamaForCausalLM``), values of its ``config.json``.

    hidden 3072, 28 layers, 24 heads / 8 KV heads, head_dim 128, FFN 8192, vocab 128,256,
    rms eps 1e-5, tied embeddings, max positions 131,072, llama3 rope scaling (theta 5e5, factor
    32, low/high freq 1/4, original 8192). Sources: public copies of that config (llm-foundry's
    ``llama/config.py`` comment, NeMo's Llama3.2-3B yaml, Llama-3.2-1B's config for the rope
    block). eos = the Instruct list [128001, 128008, 128009] so chat turns stop at ``<|eot_id|>``.
    """
    from transformers import LlamaConfig

    return _with_arch(LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE), bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ), "LlamaForCausalLM")


def gemma_4_e2b() -> Any:
    """google/gemma-4-E2B text tower (``Gemma4ForCausalLM``, ``gemma4_text``), from its
    ``config.json`` ``text_config``.

    hidden 1536, 35 layers (4 sliding : 1 full, full at 4, 9, ..., 34), 8 heads / 1 KV head,
    head_dim 256 (sliding) / 512 (full, ``global_head_dim``), FFN 6144 with double-wide MLP on the
    20 KV-shared layers (15-34), per-layer input embeddings 256 wide over 262,144 ids, sliding
    window 512, final logit soft-cap 30, rope 1e4 (sliding) / proportional 1e6 with partial
    rotary 0.25 (full), max positions 131,072, tied. Source: public copies of that config in
    test fixtures (larql ``test_parse_gemma4_e2b_config``), checked against transformers 5.17's
    ``Gemma4TextConfig``. Vision/audio towers are left out (text-only rollouts).
    """
    from transformers import Gemma4TextConfig

    layer_types = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention"
                   for i in range(35)]
    return _with_arch(Gemma4TextConfig(
        vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        sliding_window=512, layer_types=layer_types, num_kv_shared_layers=20,
        use_double_wide_mlp=True, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, final_logit_softcapping=30.0,
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_k_eq_v=False, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
    ), "Gemma4ForCausalLM")


def tiny_qwen3() -> Any:
    """2-layer Qwen3 (QK-norm, GQA 4/2, tied) on the SmolLM2 vocab; runs in milliseconds."""
    from transformers import Qwen3Config

    return _with_arch(Qwen3Config(
        vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **SMOLLM2_IDS,
    ), "Qwen3ForCausalLM")


def tiny_llama() -> Any:
    """2-layer Llama with llama3 rope scaling (same rope block as Llama-3.2) on the SmolLM2 vocab.

    With head_dim 16 and theta 5e5 the low-frequency half of the rotary dims has wavelengths
    > 8192 / low_freq_factor, so the llama3 scaling changes them even at short lengths.
    """
    from transformers import LlamaConfig

    return _with_arch(LlamaConfig(
        vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=16384,  # > original 8192, else transformers warns
        rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE),
        **SMOLLM2_IDS,
    ), "LlamaForCausalLM")


def tiny_gemma4() -> Any:
    """4-layer Gemma-4 text model keeping every E2B feature, on the SmolLM2 vocab.

    Layers: [sliding, full, sliding, full]; the last 2 share KV (``num_kv_shared_layers=2``), so
    layer 0 stores the sliding KV and layer 1 the full KV that layers 2 and 3 reuse. Sliding window
    16 (short prompts cross it), head_dim 16 / global 32, per-layer input embeddings (16 wide),
    double-wide MLP on the shared layers, final logit soft-cap 30, proportional rope (0.25).
    """
    from transformers import Gemma4TextConfig

    return _with_arch(Gemma4TextConfig(
        vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=SMOLLM2_VOCAB, final_logit_softcapping=30.0,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attention_k_eq_v=False, **SMOLLM2_IDS,
    ), "Gemma4ForCausalLM")
