"""Probe: where do the NaN gradients of CUDA runs with ``pad_to_multiple_of`` come from?

Why: on an H100 (2026-12-07, e858b3e) ``tests/unit/test_pad_to_multiple_of.py``'s runs padded to 64
had NaN gradients at step 1 on CUDA (hf_generate and flex backends, tiny-llama fp32), while the
unpadded runs and every CPU run were finite (``executed/tests/h100_20261207T013550Z_e858b3e_rest/
NOTE.md``). Padding to 64 gives every prompt left padding, so the pad tokens' query rows see no
key at all (fully masked rows). Hypothesis to test: a CUDA sdpa kernel (memory-efficient) returns
finite outputs for such rows but a NaN gradient in its backward, which reaches the LoRA/base
weights through the masked rows' K/V even though the loss never reads those positions. Public
reports of the same: pytorch/pytorch#119320 (mem-efficient backward, fp32 CUDA: NaN gradients the
math backend does not give), #178251 (open: EfficientAttentionBackward NaN with an attn_mask),
huggingface/transformers#38690 (non-math backends give NaN at padding tokens, which later layers
spread); transformers 5.x no longer unmasks fully masked rows (``allow_torch_fix`` deprecated,
``masking_utils.sdpa_mask``). Why bf16 Qwen3-4B runs with left-padded prompts were finite on the
H200 (grad norm 0.0 at the realistic preset) is part of the question: bf16 may take another
kernel (cuDNN) than fp32.

What it runs: tiny-llama (fp32 and bf16) on CUDA, a batch of 2 where row 0 is left-padded by 6,
forward + backward of a loss over the valid positions only, for attention ``eager`` and ``sdpa``
with each sdpa backend forced (math, efficient, cudnn, flash where the dtype allows), and the
same with no padding; and the candidate fix (:data:`UNMASKED`) with the efficient and math
kernels, whose valid-position logits must equal sdpa's. Prints one line per case: NaN in logits
(valid / pad positions), NaN in any parameter gradient. Run:
``python3 scripts/device/pad_nan_probe.py`` (~20 s; needs nothing staged: tiny-llama is built from
its config, random weights seeded 0).
"""
from __future__ import annotations

import sys

import probe_log

UNMASKED_ROWS: list[int] = []
"""Fully masked query rows the candidate unmasked, one entry per attention call."""
UNMASKED = "probe_unmasked_rows"
"""The candidate fix, registered by :func:`register_unmasked` under this name: sdpa with every
fully masked query row unmasked (it attends to every key; its output is never read), what
transformers 4.x did for the memory-efficient path (``AttentionMaskConverter._unmask_unattended``)
and 5.x dropped."""


def register_unmasked() -> None:
    """Register :data:`UNMASKED` with transformers' ``AttentionInterface`` (sdpa after the rows
    are unmasked) and ``AttentionMaskInterface`` (sdpa's boolean mask)."""
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            empty = ~attention_mask.any(dim=-1, keepdim=True)
            UNMASKED_ROWS.append(int(empty.sum()))
            attention_mask = attention_mask | empty
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(UNMASKED, forward)
    AttentionMaskInterface.register(UNMASKED, sdpa_mask)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    from nbhelpers import model_configs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the probe) or cpu (a dry run)")
    ap.add_argument("--out", default=None, help="folder: the lines also go to pad_nan_probe.log")
    ap.add_argument("--length", type=int, default=20,
                    help="tokens a row (the padded GRPO test: 128)")
    ap.add_argument("--pad", type=int, default=6, help="row 0's left padding (the test: ~58)")
    args = ap.parse_args(argv)
    dev = args.device

    def say(line: str) -> None:
        probe_log.say(line, args.out, "pad_nan_probe.log")

    if dev == "cuda" and not torch.cuda.is_available():
        print("pad_nan_probe: needs CUDA (or --device cpu for a dry run)")
        return 2
    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    register_unmasked()
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)  # tiny-llama from its config: no tokenizer, so no staging needed
        lm = AutoModelForCausalLM.from_config(model_configs.tiny_llama(),
                                              attn_implementation="sdpa")
        lm = lm.to(device=dev, dtype=getattr(torch, dtype))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, 200, (2, args.length), generator=g).to(dev)
        for pad in (0, args.pad):
            mask = torch.ones_like(ids)
            if pad:
                mask[0, :pad] = 0
            cases = ([("eager", None)] + [("sdpa", k) for k in backends]
                     + [(UNMASKED, k) for k in ("efficient", "math")])
            ref = None  # sdpa/math's valid-position logits: the candidate must give them
            for impl, kernel in cases:
                lm.config._attn_implementation = impl
                UNMASKED_ROWS.clear()
                lm.zero_grad(set_to_none=True)
                name = f"{impl}/{kernel}" if kernel else impl
                head = f"{dtype} len={args.length} pad={pad} {name}:"
                try:
                    ctx = sdpa_kernel([backends[kernel]]) if kernel else torch.enable_grad()
                    with ctx:
                        logits = lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
                        valid = mask.bool()
                        logits.float()[valid].logsumexp(-1).sum().backward()
                    nan_valid = bool(torch.isnan(logits[valid]).any())
                    nan_pad = bool(torch.isnan(logits[~valid]).any()) if pad else False
                    bad = [n for n, p in lm.named_parameters()
                           if p.grad is not None and not torch.isfinite(p.grad).all()]
                    extra = ""
                    if (impl, kernel) == ("sdpa", "math"):
                        ref = logits[valid].detach()
                    elif impl == UNMASKED and ref is not None:
                        diff = (logits[valid].detach() - ref).abs().max().item()
                        extra = (f"; rows unmasked {sum(UNMASKED_ROWS)}, valid logits vs "
                                 f"sdpa/math max |d| {diff:.3g}")
                    say(f"{head} NaN logits valid={nan_valid} pad={nan_pad}; non-finite grads "
                        f"in {len(bad)} tensors {bad[:3]}{extra}")
                except Exception as err:  # noqa: BLE001 (a probe: every case reported)
                    say(f"{head} not run: {type(err).__name__}: {str(err)[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
