"""Probe: hf_cb with ``paged|flash_attention_4`` on Qwen3-4B (random bf16 weights), CUDA graphs
off then on, against ``paged|sdpa``; prints per configuration whether every request finished and
how many greedy tokens match sdpa's.

Why: on the H200 (2026-12-03, ``executed/phase1_rollout/10_lora_rollout/20261203T221743Z_h200_
48b88b7*``) phase 1's ``hf_cb_fa4`` (32 prompts x 150 tokens, 512 new, LoRA r32, CUDA graphs on)
died with "probability tensor contains either inf, nan or element < 0" in the sampler after
FA4's varlen kernel ran, while phase 2's hf_cb with the same FA4 set (4 sequences, TRL's CB
config) finished 6 steps. This separates the two suspects: CUDA graph capture of the CuTe DSL
kernel (its log warns that ``aux_data`` cannot be a JitArgument) vs the kernel's output itself.

Run on the device with the fa4 and notebooks sets staged (``scripts/device/step_table.py`` f4a,
then step ``f4p``): ``python3 scripts/device/fa4_probe.py`` (~60-90 s). Needs CUDA, FA4 and the
Qwen3 tokenizer (``python -m nbhelpers fetch``); exits 1 on a configuration that failed.
"""
from __future__ import annotations

import sys
import time
import traceback


def main() -> int:
    from nbhelpers.backends import get_backend
    from nbhelpers.config import ModelSpec, SamplingParams
    spec = ModelSpec("qwen3-4b", kind="random", dtype="bfloat16")
    prompts = [[100 + i + j for j in range(150)] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    tokens, bad = {}, 0
    for attn, graphs in (("paged|sdpa", False), ("paged|flash_attention_4", False),
                         ("paged|flash_attention_4", True)):
        b = get_backend("hf_cb")
        t0 = time.perf_counter()
        try:
            b.load(spec, None, **{**b.default_options, "attn_implementation": attn,
                                  "use_cuda_graph": graphs})
            tokens[attn, graphs] = [o.token_ids for o in b.generate(prompts, greedy)]
            ref = tokens.get(("paged|sdpa", False), [])
            same = sum(x == y for a, r in zip(tokens[attn, graphs], ref) for x, y in zip(a, r))
            print(f"{attn} graphs={graphs}: ok, lengths {[len(t) for t in tokens[attn, graphs]]}"
                  f", {same} of {sum(map(len, ref))} greedy tokens equal sdpa's, "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as err:  # noqa: BLE001 (a probe: report every configuration)
            bad += 1
            print(f"{attn} graphs={graphs}: FAILED {err!r:.400}", flush=True)
            traceback.print_exc()
        finally:
            b.close()
    return 1 if bad else 0


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.exit(main())
