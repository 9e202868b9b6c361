"""Notebook-side helpers for phase 0: completions table, reference comparison, sidecar, result.

Contract: small pure functions over a :class:`~nbhelpers.grpo.result.GRPOResult` so that the phase 0
notebook's cells stay a few lines each. The published reference numbers live in
:data:`REFERENCE_PHASE0` with their source.

Run: ``python -c "from nbhelpers.grpo.phase0_report import REFERENCE_PHASE0; print(REFERENCE_PHASE0)"``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from nbhelpers.stats import GIB, finite_or_none, make_sidecar

if TYPE_CHECKING:
    import pandas as pd

    from nbhelpers.config import GRPOSettings
    from nbhelpers.grpo.result import GRPOResult

REFERENCE_PHASE0: dict[str, Any] = {
    "step_time_s_median": 5.80,
    "peak_mem_gb": 158.9,
    "steps": 10,
    "model": "Qwen3-4B-Base (real weights), LoRA r=32",
    "engine": "vLLM colocated (Unsloth fast_inference=True)",
    "device": "NVIDIA B200",
    "source": "unslothai/unsloth PR #5108, scripts/benchmarks/results/notebook_ref_10.md "
              "(the canonical Qwen3_(4B)-GRPO notebook, 10 steps; step 1 = 60.6 s of vLLM graph "
              "capture); quoted in research/anchors.md",
}
"""Published 10-step numbers of the reference experiment (peak in GB as published, i.e. 1e9 B)."""


def completions_table(result: GRPOResult, max_chars: int = 300) -> pd.DataFrame:
    """The recorded completions with each reward function's score and their sum (``total``).

    Text columns are cut to ``max_chars`` characters for display.
    """
    import pandas as pd
    frame = pd.DataFrame(result.completions)
    if frame.empty:
        return frame
    names = [n for n in result.reward_names if n in frame.columns]
    frame["total"] = frame[names].sum(axis=1, min_count=1)
    for col in ("question", "completion"):
        frame[col] = frame[col].str.slice(0, max_chars)
    return frame[["step", "question", "completion", "answer", *names, "total"]]


def reference_table(result: GRPOResult, device: str) -> pd.DataFrame:
    """This run beside :data:`REFERENCE_PHASE0` (median step seconds, peak memory in GB)."""
    import pandas as pd
    s, ref = result.summary, REFERENCE_PHASE0
    peak = s.get("peak_mem_device_gib")
    ours = {"model": result.model_name, "engine": f"TRL GRPOTrainer, {result.backend}",
            "device": device, "steps": s["n_steps"],
            "step_time_s_median": s["step_time_s_median"],
            "peak_mem_gb": None if peak is None else peak * GIB / 1e9}
    rows = {"this run": ours, "reference (published)": {k: ref[k] for k in ours}}
    return pd.DataFrame(rows).T


def grpo_rounds(config: dict[str, Any], records: list[dict[str, Any]],
                skip_first: int) -> list[dict[str, float | None]]:
    """Sidecar ``rounds``: one per step after the first ``skip_first`` (every step when none is
    left, as the summary's ``note`` says). ``config``: the run's GRPOConfig values
    (``generation_batch_size``); ``records``: its step rows
    (:func:`~nbhelpers.grpo.result.step_rows`: they carry TRL's ``generate_s``).

    Each round: ``wall_s`` (the whole optimiser step: rollout, rewards, reference logprobs, loss
    forward/backward, optimiser), ``generate_s`` (the step's rollout, ``GRPOTrainer._generate``;
    ``None`` when the row has none), ``new_tokens`` (mean completion length x completions per
    step), ``prompt_tokens`` (TRL's ``num_tokens`` increase minus them). The sidecar's token
    rates divide by ``generate_s`` (:func:`nbhelpers.stats.rounds_summary`), never by the step.
    """
    from nbhelpers.grpo.result import GENERATE_KEY
    batch = config["generation_batch_size"]
    rounds, prev = [], 0.0
    for i, rec in enumerate(records):
        total = rec.get("num_tokens_total") or prev
        new = (rec.get("completion_length_mean_tokens") or 0.0) * batch
        if rec.get("wall_s"):
            rounds.append((i, {"wall_s": rec["wall_s"],
                               "generate_s": finite_or_none(rec.get(GENERATE_KEY)),
                               "new_tokens": new, "prompt_tokens": max(total - prev - new, 0.0)}))
        prev = total
    after = [r for i, r in rounds if i >= skip_first]
    return after or [r for _, r in rounds]


RATES_NOTE = ("decode_tok_per_s_median / prompt_tok_per_s_median: completion / prompt tokens per "
              "second of each step's rollout (rounds' generate_s: GRPOTrainer._generate), not of "
              "the whole step; None when no rollout was timed. wall_s_median: the whole step "
              "(rollout, rewards, loss forward/backward, optimiser).")
"""What a phase 0 sidecar's token rates divide by (its ``rates_note``)."""


def rounds_note(result: GRPOResult, skip_first: int) -> str:
    """Which steps a phase 0 sidecar's ``rounds`` hold (:func:`grpo_rounds`)."""
    n = len(result.records)
    if n > skip_first:
        return f"steps {skip_first + 1}..{n} of {n} (the first skip_first={skip_first} left out)"
    return (f"all {n} steps: none is left after skip_first={skip_first}, so the warm-up steps "
            "are included")


def headline(result: GRPOResult) -> dict[str, Any]:
    """The numbers ``executed/INDEX.md`` shows for a phase 0 run."""
    s = result.summary
    return {"step_time_s_median": s["step_time_s_median"],
            "peak_mem_gib": s["peak_mem_device_gib"],
            "reward_median": s.get("reward_median"), "steps": s["n_steps"]}


def phase0_sidecar(result: GRPOResult, settings: GRPOSettings, model_info: dict[str, Any],
                   skip_first: int) -> dict[str, Any]:
    """The schema-v1 sidecar of a phase 0 run (``phase0``, ``hf_generate``); GRPO stats as
    extras."""
    from nbhelpers.grpo.result import step_rows
    s = result.summary
    prompt_tokens_mean = result.dataset_stats.get("prompt_tokens_mean")
    workload = {"n_prompts": result.config["generation_batch_size"] // settings.num_generations,
                "prompt_tokens_mean": prompt_tokens_mean,
                "max_new_tokens": settings.max_completion_length, "ignore_eos": False,
                "sampling": settings.sampling_params().to_dict()}
    return make_sidecar(
        phase="phase0", backend=result.backend, model=model_info, lora=asdict(settings.lora),
        workload=workload, rounds=grpo_rounds(result.config, step_rows(result), skip_first),
        peak_mem={"allocated": s["peak_mem_allocated_gib"], "device": s["peak_mem_device_gib"]},
        extra={**result.sidecar_extra(), "headline": headline(result),
               "rates_note": RATES_NOTE, "rounds_note": rounds_note(result, skip_first),
               "torch_num_threads": _torch_threads()})


def _torch_threads() -> int:
    """torch's intra-op CPU threads (``OMP_NUM_THREADS``); CPU step times depend on it."""
    import torch
    return torch.get_num_threads()


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def losses_finite(result: GRPOResult) -> bool:
    """True when every step logged a loss and all of them are finite (``finite_or_none``)."""
    return bool(result.records) and all(r.get("loss") is not None for r in result.records)


def zero_advantage_steps(result: GRPOResult) -> int:
    """Steps whose groups all scored alike (TRL's ``reward_std`` 0): advantage 0, so no gradient.

    GRPO's advantage is ``(r - mean(group)) / std(group)`` (TRL ``GRPOTrainer``): a step where every
    completion of every group got the same reward teaches nothing, whatever its loss says.
    """
    return sum(1 for r in result.records if r.get("reward_std") == 0.0)


def result_line(result: GRPOResult, device: str) -> str:
    """The notebook's "Result:" sentence, computed from the run."""
    s, ref, fmt = result.summary, REFERENCE_PHASE0, _fmt
    finite = "losses finite" if losses_finite(result) else "SOME LOSSES MISSING OR NOT FINITE"
    n_flat = zero_advantage_steps(result)
    if n_flat:
        finite += (f"; {n_flat} of {len(result.records)} steps had zero advantage (all completions"
                   " scored alike, so no learning signal)")
    elif result.records:  # said either way: silence read as "not counted" (helper-19's trial)
        finite += (f"; none of the {len(result.records)} steps had zero advantage (rewards varied"
                   " within a group at every step)")
    n, skip = s["n_steps"], s["skip_first"]
    span = (f"over steps {skip + 1}-{n} (after {skip} warm-up steps)" if n > skip
            else f"over all {n} steps (no more than skip_first={skip} ran)")
    return (f"**Result:** {n} GRPO steps of `{result.model_name}` on {device} "
            f"({result.backend}): {span} median step {fmt(s['step_time_s_median'], '.2f')} s "
            f"and median mean reward {fmt(s.get('reward_median'), '.2f')}; peak memory "
            f"{fmt(s['peak_mem_device_gib'], '.2f')} GiB; {finite}. "
            f"Reference: {ref['step_time_s_median']} s and {ref['peak_mem_gb']} GB "
            f"({ref['model']}, {ref['engine']}, {ref['device']}).")
