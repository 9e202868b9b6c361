"""Notebook-facing helpers of ``notebooks/phase3_flex/34_gemma4.ipynb`` (Gemma-4 in the flex engine).

Contract: small functions over an HF ``Gemma4ForCausalLM`` and the flex :class:`~nbhelpers.engine.LLM`
so that the notebook's cells stay a few lines: the per-layer architecture table, KV bytes per token,
teacher-forced parity against HF, and the throughput sweep (one subprocess per backend and batch
size through :func:`nbhelpers.bench.rollout.run_backends`) with its table and figure. Heavy imports inside.

Run: see the notebook; ``pytest tests/engine/test_gemma4.py`` covers the parity helper.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nbhelpers.config import LoraSpec, SamplingParams, Workload


def randomise_norms_and_scalars(model: Any, seed: int = 1, std: float = 0.3) -> Any:
    """Set every RMSNorm weight to ``1 + N(0, std^2)`` and each ``layer_scalar`` to U(0.5, 1.5).

    HF initialises them to exactly 1 (modeling_gemma4.py ``_init_weights``), which would hide a
    misplaced norm or scalar in a parity check. In place; returns ``model``.
    """
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + std * torch.randn(p.shape, generator=g))
        for layer in _base(model).model.layers:
            layer.layer_scalar.fill_(0.5 + torch.rand((), generator=g).item())
    return model


def _base(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def architecture_table(model: Any) -> Any:
    """One row per decoder layer: attention type, head_dim, KV heads, which layer's KV it reads,
    MLP width, RoPE (theta, rotated fraction) and sliding window (read from the HF modules)."""
    import pandas as pd

    from nbhelpers.engine.models.gemma4_model import _store_layers
    hf = _base(model)
    layers, rope = hf.model.layers, hf.config.rope_parameters
    store_of = _store_layers(list(layers))
    rows = []
    for i, ly in enumerate(layers):
        sa = ly.self_attn
        r = rope[sa.layer_type]
        rows.append({"layer": i, "type": sa.layer_type.replace("_attention", ""),
                     "head_dim": sa.head_dim, "kv_heads": sa.config.num_attention_heads
                     // sa.num_key_value_groups, "reads_kv_of": store_of[i],
                     "mlp_width": ly.mlp.intermediate_size, "rope_theta": r["rope_theta"],
                     "rotary_frac": r.get("partial_rotary_factor", 1.0),
                     "window": sa.sliding_window})
    return pd.DataFrame(rows).set_index("layer")


def kv_bytes_per_token(model: Any, dtype_bytes: int = 2) -> dict[str, int]:
    """KV bytes per token: the engine's pool (storing layers only) vs one K/V per layer."""
    table = architecture_table(model)
    per_layer = 2 * table["kv_heads"] * table["head_dim"] * dtype_bytes
    stores = table.index == table["reads_kv_of"]
    return {"engine_bytes": int(per_layer[stores].sum()), "every_layer_bytes": int(per_layer.sum())}


def decode_limit_tok_per_s(model: str, batch: int, prompt_tokens: float, max_new_tokens: int,
                           param_bytes: int = 2, kv_bytes: int = 2,
                           bandwidth_bytes_per_s: float | None = None) -> float:
    """Memory-bandwidth ceiling of Gemma-4 decode (tokens/s), prefill ignored.

    Per step: every weight once *except* the per-layer-input table (only ``batch`` rows of it are
    gathered: 2.35 B of E2B's 4.63 B parameters), plus each layer's read of its (store layer's)
    K/V: ``min(ctx, window)`` tokens on sliding layers, ``ctx`` on full ones, averaged over the
    decode (``ctx = prompt + t``, t = 1..max_new_tokens). Step time >= bytes / bandwidth, at
    ``bandwidth_bytes_per_s`` (the run's card, :func:`nbhelpers.bench.floor.read_bandwidth`), else
    the H200's measured copy bandwidth (``nbhelpers.bench.rollout.H200_COPY_BANDWIDTH_BYTES_PER_S``,
    DESIGN.md "Reference workloads"); the same formula as ``bench.decode_limit_tok_per_s``
    otherwise.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from nbhelpers.bench.rollout import H200_COPY_BANDWIDTH_BYTES_PER_S
    from nbhelpers.models import build_config
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(build_config(model))
    ple = getattr(hf.model, "embed_tokens_per_layer", None)
    weights = sum(p.numel() for p in hf.parameters()) - (ple.weight.numel() if ple else 0)
    table, steps = architecture_table(hf), range(1, max_new_tokens + 1)
    kv = 0.0
    for _, row in table.iterrows():
        window = row["window"] if row["window"] == row["window"] else float("inf")  # NaN: full
        ctx = sum(min(prompt_tokens + t, window) for t in steps) / max_new_tokens
        kv += 2 * row["kv_heads"] * row["head_dim"] * kv_bytes * ctx
    step_bytes = weights * param_bytes + batch * kv
    return batch * (bandwidth_bytes_per_s or H200_COPY_BANDWIDTH_BYTES_PER_S) / step_bytes


def limits_for(model: str, sides: list[dict],
               bandwidth_bytes_per_s: float | None = None) -> dict[int, float]:
    """:func:`decode_limit_tok_per_s` per batch, from each sidecar's actual prompt mean, at
    ``bandwidth_bytes_per_s`` (``None``: the H200 constant). The H100 run of 2026-12-07
    (``executed/phase3_flex/34_gemma4/20261207T103600Z_h100_d658f26*``) used the H200 constant:
    its limit column is the H200's, not that card's."""
    out: dict[int, float] = {}
    for side in sides:
        w, batch = side.get("workload") or {}, side.get("batch")
        if batch is not None and batch not in out and w.get("prompt_tokens_mean"):
            out[batch] = decode_limit_tok_per_s(model, batch, w["prompt_tokens_mean"],
                                                w["max_new_tokens"],
                                                bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return out


def kernel_probe(seconds: float) -> Any:
    """:func:`..gemma4_kernels.sweep` on CUDA for ``seconds`` (empty frame on the CPU or at 0),
    with ``engine_default``: the candidate the engine uses (``gemma4.kernel_options``, else the
    runner's prefill tiles, else torch's defaults: the ``None`` rows)."""
    import pandas as pd
    import torch

    from nbhelpers.bench import gemma4_kernels
    from nbhelpers.engine.models import gemma4
    if seconds <= 0 or not torch.cuda.is_available():
        return pd.DataFrame(columns=["head_dim", "is_decode", "options", "ms", "max_abs_err",
                                     "compile_s", "error", "engine_default"])
    from nbhelpers.engine.model_runner import RunnerOptions
    runner_prefill = RunnerOptions().prefill_kernel_options  # what the engine falls back to
    frame = pd.DataFrame(gemma4_kernels.sweep(seconds))
    frame["engine_default"] = [
        o == (gemma4.kernel_options(d, dec) or (None if dec else runner_prefill))
        for o, d, dec in zip(frame["options"], frame["head_dim"], frame["is_decode"])]
    return frame


def parity_llm(model: Any, prompts: list[list[int]], steps: int, page_size: int,
               **options: Any) -> Any:
    """A flex :class:`~nbhelpers.engine.LLM` whose pool holds every prompt + ``steps`` tokens;
    ``options`` are further :class:`~nbhelpers.engine.model_runner.RunnerOptions` (e.g. the
    eager path for a float64 check: compiled flex has no fp64 kernels)."""
    from nbhelpers.engine import LLM
    longest = max(map(len, prompts)) + steps
    pages = sum(-(-(len(p) + steps) // page_size) for p in prompts) + 1
    return LLM(model, page_size=page_size, num_pages=pages,
               max_model_len=-(-longest // page_size) * page_size, **options)


def hf_noise_floor(model: Any, prompts: list[list[int]]) -> dict[str, float]:
    """HF against itself: ``|logprob_sdpa - logprob_eager|`` over every prompt position.

    With random weights (and randomised norms) Gemma-4 E2B amplifies rounding: on the H200 in
    bf16 HF's own sdpa and eager attention disagree by up to 5.4 nats with 2 % argmax agreement
    (scripts/diag_gemma4.py, 2026-11-30), so a bf16 engine-vs-HF tolerance says nothing there;
    this floor is reported beside the (float64) parity. Shapes: ``prompts`` lists of token ids.
    Returns ``max_abs``, ``mean_abs`` (nats) and ``argmax_agree`` (share of positions).
    """
    import torch
    dev, diffs, agree, n = next(model.parameters()).device, [], 0, 0
    saved = model.config._attn_implementation
    try:
        with torch.no_grad():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=dev)
                lp = {}
                for impl in ("sdpa", "eager"):
                    model.config._attn_implementation = impl
                    lp[impl] = torch.log_softmax(model(ids).logits[0].float(), -1)
                d = (lp["sdpa"] - lp["eager"]).abs()
                diffs.append((float(d.max()), float(d.mean())))
                agree += int((lp["sdpa"].argmax(-1) == lp["eager"].argmax(-1)).sum())
                n += len(prompt)
    finally:
        model.config._attn_implementation = saved
    return {"max_abs": max(m for m, _ in diffs), "mean_abs": sum(a for _, a in diffs) / len(diffs),
            "argmax_agree": agree / n}


def teacher_forced_parity(model: Any, llm: Any, prompts: list[list[int]],
                          steps: int) -> tuple[dict[str, Any], Any]:
    """Greedy engine tokens scored again by one plain HF forward over prompt + tokens.

    Per generated token: engine logprob vs HF logprob of the *same* token (no divergence
    cascade: random weights give near-flat logits, so greedy ties flip under bf16 noise), and
    whether HF's argmax is the engine's token. Returns ``(summary, frame)``; summary keys
    ``max_abs_logprob_diff``, ``mean_abs_logprob_diff``, ``argmax_agreement``,
    ``identical_prefix_frac`` (tokens before the first disagreement / all tokens).
    """
    import pandas as pd
    import torch
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=steps,
                                                ignore_eos=True))
    dev, rows = next(iter(model.parameters())).device, []
    for p_idx, (prompt, out) in enumerate(zip(prompts, outs)):
        ids = torch.tensor([prompt + out.token_ids[:-1]], device=dev)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:].float()
        logp = torch.log_softmax(logits, -1)
        for s, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            rows.append({"prompt": p_idx, "step": s, "token": tok, "engine_logprob": lp,
                         "hf_logprob": logp[s, tok].item(), "hf_argmax": int(logp[s].argmax())})
    frame = pd.DataFrame(rows)
    frame["abs_diff"] = (frame["engine_logprob"] - frame["hf_logprob"]).abs()
    frame["agree"] = frame["token"] == frame["hf_argmax"]
    prefix = frame.groupby("prompt")["agree"].apply(lambda a: int(a.cummin().sum())).sum()
    summary = {"max_abs_logprob_diff": float(frame["abs_diff"].max()),
               "mean_abs_logprob_diff": float(frame["abs_diff"].mean()),
               "argmax_agreement": float(frame["agree"].mean()),
               "identical_prefix_frac": float(prefix / len(frame)), "n_tokens": len(frame)}
    return summary, frame


def throughput_sweep(backends: list[str], model: str, batch_sizes: list[int], workload: Workload,
                     out_dir: str | Path, engine_options: dict[str, dict] | None = None,
                     lora: LoraSpec | None = None, timeout_s: float = 1200.0) -> list[dict]:
    """:func:`nbhelpers.bench.rollout.run_backends` once per batch size (``n_prompts = batch``).

    Sidecars land in ``out_dir/b<batch>/`` and are re-stamped ``phase="phase3"`` with
    ``notebook="34_gemma4"`` and ``batch`` (the worker writes phase1). Failed backends keep their
    sidecar with ``error`` (e.g. ``hf_cb`` on Gemma-4 in transformers 5.17).
    """
    from dataclasses import replace

    from nbhelpers.bench.rollout import run_backends
    from nbhelpers.stats import device_tag, write_sidecar
    sides = []
    for batch in batch_sizes:
        folder = Path(out_dir) / f"b{batch}"
        got = run_backends(backends, model, lora, replace(workload, n_prompts=batch), folder,
                           engine_options, timeout_s=timeout_s, progress=False)
        for side in got:  # the file name run_backends gave it (bench._spec)
            side.update(phase="phase3", notebook="34_gemma4", batch=batch)
            write_sidecar(side, folder / f"{side['run_id']}_{device_tag()}_{side['backend']}.json")
        sides += got
    return sides


def throughput_frame(sides: list[dict]) -> Any:
    """Tidy frame: backend, batch, decode tok/s (median), wall s, peak GiB, error (last line)."""
    import pandas as pd
    return pd.DataFrame([{
        "backend": s["backend"], "batch": s.get("batch", (s.get("workload") or {})
                                                 .get("n_prompts")),
        "decode_tok_per_s": s.get("decode_tok_per_s_median"), "wall_s": s.get("wall_s_median"),
        "peak_mem_allocated_gib": s.get("peak_mem_allocated_gib"),
        "error": ((s.get("error") or "").strip().splitlines() or [""])[-1][:160]}
        for s in sides])


def throughput_figure(frame: Any, limits: dict[int, float] | None = None) -> Any:
    """Decode tok/s against batch size, one line per backend in its fixed colour; ``limits``
    (batch -> tok/s) as a dashed black line (the bandwidth ceiling)."""
    from matplotlib.figure import Figure

    from nbhelpers.plots import color
    fig = Figure(figsize=(5.5, 3.4), layout="constrained")
    ax = fig.add_subplot()
    for name, grp in frame.dropna(subset=["decode_tok_per_s"]).groupby("backend"):
        grp = grp.sort_values("batch")
        ax.plot(grp["batch"], grp["decode_tok_per_s"], marker="o", label=name,
                color=color(name.removesuffix("_lora")))
    if limits:
        xs = sorted(limits)
        ax.plot(xs, [limits[b] for b in xs], "k--", label="bandwidth limit (this card's read "
                "bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (prompts decoded together)")
    ax.set_ylabel("output tok/s (median round)")
    ax.set_title("Gemma-4 E2B architecture: decode throughput")
    ax.legend(fontsize=8)
    return fig


def speedup_table(frame: Any, engine: str = "flex", limits: dict[int, float] | None = None) -> Any:
    """tok/s per batch (rows) and backend (columns), ``<engine>_x_<other>`` ratios and, with
    ``limits`` (batch -> bandwidth ceiling), ``limit_tok_per_s`` and ``<engine>_pct_of_limit``."""
    wide = frame.pivot_table(index="batch", columns="backend", values="decode_tok_per_s")
    for other in [c for c in wide.columns if c != engine and engine in wide.columns]:
        wide[f"{engine}_x_{other}"] = wide[engine] / wide[other]
    if limits:
        wide["limit_tok_per_s"] = [limits.get(int(b)) for b in wide.index]
        if engine in wide.columns:
            wide[f"{engine}_pct_of_limit"] = 100 * wide[engine] / wide["limit_tok_per_s"]
    return wide


def free_device_memory() -> None:
    """``gc.collect()`` and, on CUDA, ``torch.cuda.empty_cache()`` (after ``del`` of the model):
    the backends' :func:`nbhelpers.backends._common.free_device_memory`, named here for 34."""
    from nbhelpers.backends import _common
    _common.free_device_memory()


def runs_dir(out_dir: str, sidecar_path: str) -> Path:
    """Folder for the measurement sidecars: ``out_dir``, else ``<sidecar stem>_runs/`` beside the
    notebook sidecar, else a fresh temporary folder."""
    import tempfile
    if out_dir:
        return Path(out_dir)
    if sidecar_path:
        side = Path(sidecar_path)
        return side.parent / f"{side.stem}_runs"
    return Path(tempfile.mkdtemp(prefix="34_gemma4_"))


def notebook_sidecar(model_info: dict, parity: dict, frame: Any, workload: Workload,
                     runs: Path, kernels: Any = None, limits: dict | None = None) -> dict:
    """The notebook's schema-v1 sidecar (backend ``flex``, phase3): parity numbers, the tok/s
    table per (backend, batch), and where the per-measurement sidecars are."""
    from dataclasses import asdict

    from nbhelpers.stats import make_sidecar
    flex = frame[frame["backend"] == "flex"].dropna(subset=["decode_tok_per_s"])
    headline = {"max_abs_logprob_diff": parity["max_abs_logprob_diff"],
                **{f"flex_b{int(b)}_tok_per_s": t for b, t in
                   zip(flex["batch"], flex["decode_tok_per_s"])}}
    return make_sidecar(phase="phase3", backend="flex", model=model_info, workload=asdict(
        workload), extra={"notebook": "34_gemma4", "parity": parity, "headline": headline,
                          "throughput": frame.to_dict(orient="records"),
                          "kernel_probe": [] if kernels is None else
                          kernels.astype(object).to_dict(orient="records"),
                          "decode_limit_tok_per_s": limits or {},
                          "measurement_sidecars": str(runs)})


def result_line(parity: dict, frame: Any, device: str, dtype: str | None = None,
                noise_floor: dict | None = None) -> str:
    """The notebook's **Result:** sentence from the measured numbers (``dtype``: the parity
    model's; ``noise_floor``: :func:`hf_noise_floor` in the rollout dtype, when measured)."""
    wide = speedup_table(frame)
    head = (f"**Result ({device}):** flex vs HF on the same tokens{f' in {dtype}' if dtype else ''}"
            f": max |logprob diff| {parity['max_abs_logprob_diff']:.2e}, mean "
            f"{parity['mean_abs_logprob_diff']:.2e}; HF argmax = engine token for "
            f"{100 * parity['argmax_agreement']:.0f} % of {parity['n_tokens']} tokens.")
    if noise_floor:
        head += (f" For scale, HF against itself (sdpa vs eager attention) differs by up to "
                 f"{noise_floor['max_abs']:.2f} nats (mean {noise_floor['mean_abs']:.3f}, argmax "
                 f"agreement {100 * noise_floor['argmax_agree']:.0f} %) in the rollout dtype with "
                 "these random weights.")
    parts = []
    for b, row in wide.iterrows():
        cells = [f"{c} {row[c]:.0f}" for c in wide.columns
                 if "_x_" not in c and "limit" not in c and row[c] == row[c]]
        ratios = [f"{c.split('_x_')[1]} x{row[c]:.1f}" for c in wide.columns
                  if "_x_" in c and row[c] == row[c]]
        parts.append(f"batch {b}: " + ", ".join(cells) + " tok/s"
                     + (f" (flex over {', '.join(ratios)})" if ratios else ""))
    return head + "\n\nDecode throughput: " + "; ".join(parts) + "."
