"""Same-process A/B of flex's importance-sampling ratio: loss time vs the extra no-grad forward.

On-policy ``FlexGRPOTrainer`` takes the IS ratio from the loss forward's detached logprobs
(``loss_time``, the default); ``_defer_is = False`` (``extra_forward``) brings back the no-grad
policy forward at generation. Run-to-run noise exceeds the saving, so both run in ONE trainer of
phase 2's flex run (parameters: the 20_grpo_equivalence notebook's defaults < its config for
``--profile`` < ``-p NAME VALUE``; built by ``nbhelpers.grpo.trainer._train_local`` as
``train(backend="flex")`` builds it), switched between steps: ``--lead-in`` steps, then per
round ``--steps`` steps of each variant, the first variant alternating (AB, BA, ...: a linear
drift cancels); lead-in and each block's first step are left out. One trainer, not two: one
policy, engine (KV pool, CUDA graphs, compiled attention) and optimizer in memory, every warm-up
and compile paid once for both; the variants differ only in trainer code.

Per step: TRL's ``step_time`` (``training_step``, not synchronised), ``generate_s`` and
``wall_s`` (synchronised; with the optimizer step), trainer time = step_time - generate_s (and
wall_s - generate_s), the policy's forward calls. Writes a schema-v1 sidecar under ``--out``.

Run (H200): ``python3 scripts/ab_flex_is.py --profile h200 --steps 8 --rounds 4 --out $OUT``.
CPU smoke: ``python scripts/ab_flex_is.py --model tiny-llama --steps 2 --rounds 1 -p n_questions 4
-p max_completion_length 8 -p flex_compile_attention '"off"'``. Test: tests/unit/test_ab_flex_is.py.
Bad input (profile, model, ``-p``, a GPU profile where nvidia-smi lists no GPU) prints one
``error: ...`` line and exits 2 before the trainer is built.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NOTEBOOK = REPO / "notebooks/phase2_grpo/20_grpo_equivalence.ipynb"
VARIANTS = {"loss_time": True, "extra_forward": False}
"""Variant name -> ``FlexGRPOTrainer._defer_is``."""
NOT_HERE = {"backends": "backend is flex", "max_steps": "use --steps and --rounds",
            "reference_backend": "no gate here", "kl_tolerance": "no gate here",
            "reuse_runs": "nothing is reused", "sidecar_path": "use --out"}
TIMES = ("step_time_s", "generate_s", "trainer_s", "wall_s", "trainer_wall_s")
"""Seconds per step; trainer_s = step_time_s - generate_s, trainer_wall_s = wall_s - generate_s."""
METRICS = (*TIMES, "policy_forwards", "completion_length_mean_tokens")


def notebook_defaults(notebook: Path = NOTEBOOK) -> dict[str, tuple[Any, str]]:
    """``{name: (literal default, annotation)}`` of ``notebook``'s cell tagged ``parameters``
    (read as JSON: no nbformat on the device image)."""
    cells = json.loads(notebook.read_text())["cells"]
    src = next("".join(c["source"]) for c in cells
               if "parameters" in c.get("metadata", {}).get("tags", []))
    return {node.target.id: (ast.literal_eval(node.value), ast.unparse(node.annotation))
            for node in ast.parse(src).body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def phase2_parameters(profile: str, overrides: dict[str, Any],
                      flags: dict[str, str] | None = None) -> dict[str, Any]:
    """What the notebook sees under ``--profile profile -p ...``, checked by the runner's own
    value checks; ``flags``: the option that set an override when not ``-p NAME`` (``model``:
    ``--model``), named in its error. Raises ``UserInputError`` (unknown profile/model, bad
    value, a -p this A/B sets itself)."""
    from nbhelpers.run.params import UserInputError, check_value, load_parameters
    from nbhelpers.run.values import check_values
    known = sorted(p.name.split(".")[-2] for p in (REPO / "configs").glob(f"{NOTEBOOK.stem}.*"))
    if profile not in known:
        raise UserInputError(f"--profile {profile!r}: use one of {known} "
                             f"(configs/{NOTEBOOK.stem}.<profile>.yaml).")
    if bad := [n for n in overrides if n in NOT_HERE]:
        raise UserInputError(f"-p {bad[0]}: not a parameter of this A/B ({NOT_HERE[bad[0]]}).")
    defaults = notebook_defaults()
    if bad := [n for n in overrides if n not in defaults]:
        raise UserInputError(f"-p {bad[0]}: not a parameter of {NOTEBOOK.name}; use one of "
                             f"{sorted(set(defaults) - set(NOT_HERE))}.")
    params = {n: d for n, (d, _) in defaults.items()} | load_parameters(NOTEBOOK, profile,
                                                                         overrides)
    config = f"configs/{NOTEBOOK.stem}.{profile}.yaml"
    sources = {n: (flags or {}).get(n, f"-p {n}") if n in overrides else config for n in params}
    for name, value in params.items():
        check_value(name, defaults[name][1] if name in defaults else None, value, sources[name])
    check_values(params, sources, NOTEBOOK)
    return params


def check_host(profile: str) -> None:
    """Raises ``UserInputError`` when ``profile`` is not ``cpu`` and ``nvidia-smi`` lists no GPU
    (the runner's own check, ``python -m nbhelpers run --profile``): the GPU sizes would build
    e.g. the Qwen3-4B trainer on the CPU and run for minutes."""
    from nbhelpers.__main__ import visible_gpu_count
    from nbhelpers.run.params import UserInputError
    if profile != "cpu" and visible_gpu_count() == 0:
        raise UserInputError(f"--profile {profile} sizes the run for a GPU host, and nvidia-smi "
                             "lists no GPU here: use --profile cpu (the CPU sizes).")


def settings_from(params: dict[str, Any], max_steps: int) -> Any:
    """``GRPOSettings(..., lora=LoraSpec(...))`` as the notebook's derived cell builds it (the
    runner's own map of that cell, ``nbhelpers.run.values.CONFIG_FIELDS["phase2"]``)."""
    from nbhelpers.run.values import CONFIG_FIELDS
    grpo, lora = CONFIG_FIELDS["phase2"]
    kw = {f: params[p] for p, f in grpo.fields.items()} | {"max_steps": max_steps}
    return grpo.config(**kw, lora=lora.config(**{f: params[p] for p, f in lora.fields.items()}))


def train_options(params: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """``train()``'s keyword arguments (its ``opts``) as the notebook's ``run_backends`` call
    and its child (``nbhelpers.grpo.compare._child``) pass them, for backend flex."""
    from nbhelpers.grpo import compare, train
    opts = {n: p.default for n, p in inspect.signature(train).parameters.items()
            if p.kind is p.KEYWORD_ONLY}
    same = ("dataset", "n_questions", "compile_mode", "attn_implementation", "vllm_sleep_mode",
            "vllm_gpu_memory_utilization", "format_warmup_steps")
    return opts | {k: params[k] for k in same} | {
        "backend": "flex", "output_dir": output_dir, "progress": False,
        "skip_first": 0,  # only GRPOResult.summary's medians: the blocks skip their own
        "compile_dynamic": compare.compile_dynamic_flag(params["compile_dynamic"]),
        "flex_options": compare.flex_options(params["flex_sleep_between_rollouts"],
                                             params["flex_compile_attention"]),
        "warmup_adapter": compare.WARMUP_ADAPTER}


def schedule(steps: int, rounds: int, lead_in: int = 0) -> list[dict[str, Any]]:
    """One dict per optimizer step: ``round`` (-1: the lead-in), ``variant``, ``warmup`` (a
    lead-in step or a block's first step: left out of every median)."""
    names = list(VARIANTS)
    return [{"round": -1, "variant": names[0], "warmup": True} for _ in range(lead_in)] + [
        {"round": r, "variant": v, "warmup": i == 0}
        for r in range(rounds) for v in (names if r % 2 == 0 else names[::-1])
        for i in range(steps)]


class ABProbe:
    """``_train_local``'s hooks: sets ``_defer_is`` before each step by :func:`schedule` and
    counts the policy's forward calls per step (``forwards``)."""

    def __init__(self, plan: list[dict[str, Any]]):
        self.steps, self.forwards = plan, []
        self._calls = self._start = 0

    def _count(self, *_: Any) -> None:
        self._calls += 1

    def plan(self, plan: Any) -> None:  # the backend plan stays phase 2's
        pass

    def trainer(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        from nbhelpers.grpo.flex_is import trl_computes_old_logps
        if trl_computes_old_logps(trainer):
            raise ValueError("off-policy (TRL computes old logprobs): both variants take TRL's "
                             "path; keep gradient_accumulation_steps % (steps_per_generation * "
                             "num_iterations) == 0.")
        probe = self
        trainer.model.register_forward_pre_hook(self._count)

        class _Switch(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                trainer._defer_is = VARIANTS[probe.steps[state.global_step]["variant"]]
                probe._start = probe._calls

            def on_step_end(self, args, state, control, **kw):
                probe.forwards.append(probe._calls - probe._start)

        trainer.add_callback(_Switch())


def _minus(x: float | None, y: float | None) -> float | None:
    return None if x is None or y is None else x - y


def step_table(result: Any, probe: ABProbe) -> list[dict[str, Any]]:
    """Per-step rows: the schedule, TRL's timings, the forward count."""
    from nbhelpers.grpo import step_rows
    return [plan | {"step": rec["step"], "step_time_s": rec.get("step_time"),
                    "generate_s": rec.get("generate_s"), "wall_s": rec.get("wall_s"),
                    "trainer_s": _minus(rec.get("step_time"), rec.get("generate_s")),
                    "trainer_wall_s": _minus(rec.get("wall_s"), rec.get("generate_s")),
                    "policy_forwards": fwd, **{k: rec.get(k) for k in (
                        "completion_length_mean_tokens", "peak_mem_allocated_gib")}}
            for rec, plan, fwd in zip(step_rows(result), probe.steps, probe.forwards,
                                      strict=True)]


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant over its kept steps: ``n_steps`` and the median of each of :data:`METRICS`;
    ``paired_delta`` (loss_time - extra_forward): per :data:`TIMES`, the median over rounds of
    the difference of the round's two block medians."""
    from nbhelpers.stats import median

    def med(m: str, variant: str, rnd: int | None = None) -> float | None:
        return median([r[m] for r in rows if r["variant"] == variant and not r["warmup"]
                       and rnd in (None, r["round"])])
    out = {v: {"n_steps": sum(r["variant"] == v and not r["warmup"] for r in rows)}
           | {m: med(m, v) for m in METRICS} for v in VARIANTS}
    rounds = sorted({r["round"] for r in rows} - {-1})
    out["paired_delta"] = {m: median([_minus(*(med(m, v, n) for v in VARIANTS))
                                      for n in rounds]) for m in TIMES}
    return out


def markdown(med: dict[str, dict[str, Any]]) -> str:
    """A small table of :func:`medians`: one row per variant and the paired delta."""
    cols = ("n_steps", *METRICS)

    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.0f}" if x.is_integer() and abs(x) >= 1 else f"{x:.3f}"
        return "" if x is None else str(x)
    lines = ["| variant | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    return "\n".join(lines + [f"| {name} | " + " | ".join(cell(row.get(c)) for c in cols)
                              + " |" for name, row in med.items()])


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu", help="configs/20_grpo_equivalence.<profile>.yaml")
    ap.add_argument("--model", default="", help="default: the profile's model (h200: qwen3-4b)")
    ap.add_argument("--steps", type=int, default=4, help="steps per variant per round (>= 2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both variants (>= 1)")
    ap.add_argument("--lead-in", type=int, default=2, help="steps before round 0, left out: "
                    "engine build, graph capture, first compiles (>= 0)")
    ap.add_argument("--out", default="executed/phase2_grpo/bench/ab_flex_is")
    ap.add_argument("-p", nargs=2, action="append", metavar=("NAME", "VALUE"), default=[],
                    help="a notebook parameter (YAML literal), as the runner's -p")
    a = ap.parse_args(argv)
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: need >= 2 (each block's first step is a warm-up).")
    if a.rounds < 1 or a.lead_in < 0:
        ap.error(f"--rounds {a.rounds} --lead-in {a.lead_in}: need rounds >= 1, lead-in >= 0.")
    return a


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the A/B; returns the sidecar (also written under ``--out``). Raises
    ``UserInputError`` for bad parameters or a GPU profile on a host without a GPU (before
    anything loads)."""
    from nbhelpers.run.params import parse_overrides
    a = parse(argv)
    overrides = parse_overrides(a.p) | ({"model": a.model} if a.model else {})
    params = phase2_parameters(a.profile, overrides, {"model": "--model"} if a.model else None)
    check_host(a.profile)
    plan = schedule(a.steps, a.rounds, a.lead_in)
    settings = settings_from(params, len(plan))
    import torch
    if params["cpu_threads"] and not torch.cuda.is_available():
        torch.set_num_threads(params["cpu_threads"])
    from nbhelpers.grpo.trainer import _train_local
    probe = ABProbe(plan)
    with tempfile.TemporaryDirectory(prefix="ab_flex_is_") as out:  # TRL's output_dir, unused
        opts = train_options(params, out)
        result = _train_local(params["model"], settings, opts, {}, hooks=probe)
    rows = step_table(result, probe)
    side = sidecar(a, params, settings, result, rows, medians(rows))
    print(markdown(side["medians"]))
    return side


def sidecar(a: argparse.Namespace, params: dict[str, Any], settings: Any, result: Any,
            rows: list[dict[str, Any]], med: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write the schema-v1 sidecar (phase2, backend flex, ``kind`` flex_is_ab)."""
    from nbhelpers.models import describe
    from nbhelpers.stats import device_tag, git_sha, make_sidecar, utc_stamp, write_sidecar
    lt, ef, delta = med["loss_time"], med["extra_forward"], med["paired_delta"]
    side = make_sidecar(
        phase="phase2", backend="flex", model=describe(params["model"]),
        lora=asdict(settings.lora), workload={k: params[k] for k in (
            "dataset", "n_questions", "num_generations", "per_device_train_batch_size",
            "max_prompt_length", "max_completion_length")},
        extra={"kind": "flex_is_ab", "args": vars(a),
               "parameters": {k: v for k, v in params.items() if k not in NOT_HERE},
               "grpo_config": result.config, "steps": rows, "medians": med,
               "headline": {"loss_time_trainer_s": lt["trainer_s"],
                            "extra_forward_trainer_s": ef["trainer_s"],
                            "paired_delta_trainer_s": delta["trainer_s"],
                            "forwards": f"{lt['policy_forwards']} vs {ef['policy_forwards']}"}})
    name = f"{utc_stamp()}_{device_tag()}_{git_sha()}_ab_flex_is.json"
    print("sidecar:", write_sidecar(side, Path(a.out) / name))
    return side


if __name__ == "__main__":
    from nbhelpers.run.params import UserInputError
    try:
        main()
    except UserInputError as err:  # as the runner's CLI: the message, no traceback, exit 2
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
