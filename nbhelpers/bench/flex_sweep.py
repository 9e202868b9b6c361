"""Benchmark helpers for the flex engine, shared by ``scripts/bench_flex.py`` and notebook 33.

Contract: build a random-weight model of a named shape on the device (speed does not depend on the
values: DESIGN.md workload W), attach a PEFT LoRA with non-zero B, time ``LLM.generate`` over
rounds (warm-up apart), and return schema-v1 rows plus a per-step breakdown: prefill seconds,
decode seconds per step (graph replays + one readback per ``sync_every`` window), host seconds, and
a separate replay-only timing of one decode step (``replay_ms``) so host overhead is
``decode_step_ms - replay_ms``. Heavy imports stay inside the functions.

Run: ``python scripts/bench_flex.py --help``.
"""

from __future__ import annotations

import time
from typing import Any

from nbhelpers.bench.flex_ab_figures import (  # noqa: F401 (re-exported: the notebooks' names)
    ab_figure,
    ab_frame,
    kernels_figure,
)
from nbhelpers.bench.flex_figures import (  # noqa: F401 (re-exported: the notebooks' names)
    breakdown_figure,
    earlier_frame,
    flex_frame,
    mode_label,
    own_sidecars,
    pct_figure,
    reference_frame,
    sweep_figure,
)
from nbhelpers.bench.profile import (  # noqa: F401 (re-exported: the notebooks' names)
    KERNEL_CLASSES,
    count_decode_ops,
    kernel_breakdown,
    kernel_class,
    profile_decode_step,
)
from nbhelpers.config import LoraSpec, SamplingParams
from nbhelpers.engine.tuner_tables import resolved_kernels, tuner_tables

QWEN3_4B_SHAPE = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9728,
                      "vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                      "tie_word_embeddings": True, "max_position_embeddings": 40960}
"""Qwen/Qwen3-4B config.json shape (hub model card); random weights for speed work."""
TINY_QWEN3_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
                        "vocab_size": 1024, "tie_word_embeddings": True}


def random_qwen3(shape: dict[str, Any], dtype: str = "bfloat16", device: str = "cuda",
                 seed: int = 0) -> Any:
    """``Qwen3ForCausalLM`` with random weights built directly on ``device`` (eval mode)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(**shape)
    cfg.architectures = ["Qwen3ForCausalLM"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # no fp32 copy of a 4B model on the way
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def attach_lora(model: Any, lora: LoraSpec, b_std: float = 0.01, adapter_dtype: str = "model",
                seed: int = 0) -> Any:
    """PEFT LoRA on ``lora.targets`` with non-zero B (N(0, b_std^2)).

    ``adapter_dtype="model"``: adapter in the model's dtype (``autocast_adapter_dtype=False``, as
    Unsloth keeps it); ``"float32"``: PEFT's default upcast.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                     lora_dropout=0.0, init_lora_weights=False)
    peft = get_peft_model(model, cfg, autocast_adapter_dtype=adapter_dtype == "float32")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    return peft.eval()


def random_prompt_ids(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` uniform random token ids (speed work only)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def hf_greedy_reference(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens + raw logprobs from full HF forwards (no cache), on the model's device."""
    import torch
    dev = next(iter(model.parameters())).device
    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids], device=dev)).logits[0, -1].float()
            logp = torch.log_softmax(logits, -1)
            tok = int(logp.argmax())
            toks, lps, ids = toks + [tok], lps + [float(logp[tok])], ids + [tok]
    return toks, lps


def parity(model: Any, llm: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Greedy engine vs HF: fraction of identical tokens up to the first divergence, and the max
    |logprob difference| over that common prefix."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps,
                                                ignore_eos=True))
    same, total, drift = 0, 0, 0.0
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf_greedy_reference(model, prompt, steps)
        k = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), steps)
        same, total = same + k, total + steps
        drift = max([drift] + [abs(a - b) for a, b in zip(out.logprobs[:k], ref_lp[:k])])
    return {"prefix_match_frac": same / total, "max_logprob_diff": drift,
            "all_identical": same == total}


def replay_ms(llm: Any, batch: int, iters: int = 20, back: int = 0) -> float | None:
    """Median milliseconds of one captured decode-step replay for ``batch`` (None: no graph),
    from the last state rewound ``back`` positions (:func:`.profile.rewound_state`)."""
    import torch

    from nbhelpers.bench.profile import rewound_state
    states = [st for (b, _), st in llm.runner.states.items() if b >= batch and st.graph]
    if not states or not torch.cuda.is_available():
        return None
    st, times = states[0], []
    kept = (st.pos.clone(), st.gen_idx.clone(), st.tokens.clone())
    saved = rewound_state(st, back)
    for _ in range(iters):  # replay from the same state each time (no position overflow)
        st.col.zero_()
        for buf, val in zip((st.pos, st.gen_idx, st.tokens), saved):
            buf.copy_(val)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        st.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    for buf, val in zip((st.pos, st.gen_idx, st.tokens), kept):  # as found: the profile rewinds
        buf.copy_(val)
    return sorted(times)[len(times) // 2]


ROUND_STALL_KEYS = ("graph_captures", "gc_s", "gc_collections", "gc_gen2", "gc_paused")
"""``LLM.last_stats`` keys each timed round's row also records: a decode-graph capture or a
Python garbage collection inside a timed round (:mod:`nbhelpers.engine.gc_watch`)."""


def time_rounds(llm: Any, prompts: list[list[int]], sampling: SamplingParams, rounds: int,
                warmup: int) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Timed rounds (schema-v1 ``rounds`` rows, plus :data:`ROUND_STALL_KEYS` per round) and
    the breakdown of the last timed round."""
    from nbhelpers.stats import timer
    for _ in range(warmup):
        llm.generate(prompts, sampling)
    rows, breakdown = [], {}
    for _ in range(rounds):
        llm.reset_timings()
        with timer() as t:
            outs = llm.generate(prompts, sampling)
        st = dict(llm.last_stats)
        steps = max(1, st["decode_steps"])
        rows.append({"wall_s": t["s"], "new_tokens": sum(len(o.token_ids) for o in outs),
                     "prompt_tokens": sum(len(p) for p in prompts) * sampling.n,
                     # what can stall one round (gc_watch.py: 0.2-0.3 s once at fp32 b64)
                     **{k: st.get(k) for k in ROUND_STALL_KEYS}})
        breakdown = {"prefill_s": st["prefill_s"], "decode_s": st["decode_s"],
                     "host_s": st["host_s"], "decode_steps": st["decode_steps"],
                     "decode_step_ms": 1e3 * st["decode_s"] / steps,
                     "num_preemptions": st["num_preemptions"],
                     "prefill_graph_captures": st.get("prefill_graph_captures", 0),
                     "prefill_graph_replays": st.get("prefill_graph_replays", 0)}
    return rows, breakdown


def bench_one(llm: Any, prompts: list[list[int]], sampling: SamplingParams, rounds: int = 3,
              warmup: int = 1) -> dict[str, Any]:
    """Rounds + breakdown + replay timing + peak memory for one configuration."""
    from nbhelpers.stats import peak_memory_gib, reset_peak_memory, rounds_summary
    reset_peak_memory()
    t0 = time.perf_counter()
    rows, breakdown = time_rounds(llm, prompts, sampling, rounds, warmup)
    # at the mean decode context, as the floor (prompt + max_new_tokens / 2): rewound by half
    breakdown["replay_ms"] = replay_ms(llm, len(prompts) * sampling.n,
                                       back=sampling.max_new_tokens // 2)
    if breakdown["replay_ms"] is not None:
        breakdown["host_overhead_ms_per_step"] = (breakdown["decode_step_ms"]
                                                  - breakdown["replay_ms"])
    breakdown["bench_s"] = time.perf_counter() - t0
    return {"rounds": rows, "breakdown": breakdown, "peak_mem": peak_memory_gib(),
            **rounds_summary(rows)}


def run_flex_point(model: Any, batch: int, prompt_tokens: int, max_new_tokens: int,
                   rounds: int = 3, warmup: int = 1, sync_every: int = 32, profile: bool = False,
                   floor: bool = True, floor_gemms: bool = False, num_generations: int = 1,
                   **options: Any) -> dict[str, Any]:
    """Workload-W-style point: ``batch`` random prompts of ``prompt_tokens``, GRPO sampling,
    ``max_new_tokens`` with EOS ignored; KV pool sized for the batch. ``options`` go to the LLM.
    ``num_generations``: ``batch / num_generations`` prompts with ``n = num_generations``
    samples each (TRL's GRPO rollout: the samples of a prompt share its prompt pages); the
    floor still counts every row's whole context (no sharing).

    Raises:
        ValueError: ``batch`` not a multiple of ``num_generations``.

    ``profile``: a CUDA kernel profile (``breakdown["profile"]``, ``["kernel_breakdown"]``) and
    the aten-op count (``["aten_ops"]``). Always: the GEMM tuners' choices and per-candidate ms
    for the shapes this engine tuned (``breakdown["skinny_tuner"]``, ``["lora_gemm_tuner"]``,
    :func:`nbhelpers.engine.tuner_tables.tuner_tables`; ``{}`` on the CPU) and the kernels that
    ran (``breakdown["resolved"]``, :func:`~nbhelpers.engine.tuner_tables.resolved_kernels`).
    ``floor``: ``res["floor"]`` and ``res["pct_of_floor"]``
    (:func:`nbhelpers.bench.floor.floor_record`, measured after the timed rounds, at the mean
    decode context ``prompt_tokens + max_new_tokens / 2``; ``floor_gemms``: cold GEMM times too).
    """
    from nbhelpers.backends.flex import build_llm
    from nbhelpers.config import WORKLOAD_W
    if num_generations < 1 or batch % num_generations:
        raise ValueError(f"run_flex_point: batch {batch} is not a multiple of num_generations "
                         f"{num_generations}; use a batch of k x num_generations rows.")
    per_seq = prompt_tokens + max_new_tokens
    llm = build_llm(model, [], kv_tokens=batch * (per_seq + 128), max_num_seqs=max(batch, 8),
                    max_model_len=per_seq + 64, sync_every=sync_every, **options)
    sampling = SamplingParams(**{**WORKLOAD_W.sampling_params().to_dict(),
                                 "max_new_tokens": max_new_tokens, "n": num_generations})
    prompts = random_prompt_ids(batch // num_generations, prompt_tokens,
                                model.config.vocab_size)
    res = bench_one(llm, prompts, sampling, rounds=rounds, warmup=warmup)
    res["breakdown"].update(tuner_tables(llm.runner), resolved=resolved_kernels(llm.runner))
    if profile:
        res["breakdown"].update(profile_point(llm, batch, back=max_new_tokens // 2))
    llm.sleep()
    if floor:
        res.update(point_floor(model, batch, prompt_tokens + max_new_tokens / 2,
                               res["breakdown"], floor_gemms))
    return res


def profile_point(llm: Any, batch: int, back: int = 0) -> dict[str, Any]:
    """``profile`` + ``kernel_breakdown`` (CUDA only; the last state rewound ``back`` positions,
    :func:`.profile.rewound_state`, and ``profile_back`` records it) and ``aten_ops`` (every
    device; its ``note`` says why ``ops_per_layer`` is missing for models that cannot drop a
    layer)."""
    out: dict[str, Any] = {}
    if llm.runner.device.type == "cuda":
        out["profile"] = profile_decode_step(llm, batch, back=back)
        out["profile"]["back"] = back
        out["kernel_breakdown"] = kernel_breakdown(out["profile"])
    ops = count_decode_ops(llm, batch)  # the CPU proxy, also recorded on the GPU
    out["aten_ops"] = {k: ops[k] for k in ("ops_per_step", "ops_per_layer", "fixed_ops", "note")}
    return out


def point_floor(model: Any, batch: int, context_len: float, breakdown: dict[str, Any],
                gemms: bool = False) -> dict[str, Any]:
    """``{"floor", "pct_of_floor", "pct_of_floor_replay"}`` of a measured point: the model's
    config, weight dtype and PEFT adapter (:func:`nbhelpers.bench.floor.lora_of`) against
    ``decode_step_ms`` (and the graph replay alone, ``replay_ms``, when measured)."""
    from nbhelpers.bench import floor as fl
    lora, adapter_dtype = fl.lora_of(model)
    base = next(p for n, p in model.named_parameters() if "lora_" not in n)
    device = str(base.device)
    rec = fl.floor_record(model.config, batch, context_len, breakdown.get("decode_step_ms"),
                          device, lora, str(base.dtype).removeprefix("torch."), adapter_dtype,
                          gemms=gemms)
    replay, total = breakdown.get("replay_ms"), (rec["floor"].get("bytes_per_step") or {})
    rec["pct_of_floor_replay"] = (fl.pct_of_floor(total["total"], replay / 1e3,
                                                  rec["floor"]["bandwidth_bytes_per_s"])
                                  if replay and total else None)
    return rec


def flex_sidecar(tag: str, model_info: dict[str, Any], lora: LoraSpec | None, batch: int,
                 prompt_tokens: int, max_new_tokens: int, res: dict[str, Any] | None,
                 error: str | None = None, extra: dict[str, Any] | None = None,
                 run_id: str | None = None, num_generations: int = 1) -> dict[str, Any]:
    """Schema-v1 sidecar (phase ``phase3_flex``, backend ``flex``) with the breakdown, ``floor``
    and ``pct_of_floor`` (``pct_of_floor_replay``) of ``res`` beside; ``run_id`` names the run
    (one per notebook / script call) so figures can hold to it (:func:`own_sidecars`)."""
    from nbhelpers.stats import make_sidecar
    res = res or {}
    workload = {"n_prompts": batch, "prompt_tokens_mean": prompt_tokens,
                "max_new_tokens": max_new_tokens, "ignore_eos": True, "sampling": "grpo",
                "num_generations": num_generations}  # n_prompts: rows (prompts x samples)
    lora_block = None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                            "targets": list(lora.targets)}
    return make_sidecar(phase="phase3_flex", backend="flex", model=model_info, lora=lora_block,
                        workload=workload, rounds=res.get("rounds", ()),
                        peak_mem=res.get("peak_mem"), error=error, run_id=run_id,
                        extra={"breakdown": res.get("breakdown"), "tag": tag,
                               "floor": res.get("floor"), "pct_of_floor": res.get("pct_of_floor"),
                               "pct_of_floor_replay": res.get("pct_of_floor_replay"),
                               **(extra or {})})
