"""Where a flex decode step goes: kernel classes from a CUDA profile of one eager step
(:func:`profile_decode_step`) and an aten-op count of one step (:func:`count_decode_ops`, the CPU
proxy for the kernel count). Used by :mod:`nbhelpers.bench.flex_sweep` (re-exported there).
"""

from __future__ import annotations

from typing import Any

KERNEL_CLASSES = (("attention", ("flex", "attention")), ("gemm", ("gemm", "nvjet", "cutlass",
                  "xmma", "matmul", "splitk", "skinny_lora", "mlp_block")), ("sort/sample", (
                  "sort", "radix", "argmax", "softmax", "scan", "cumsum")))
"""Name keys per class, first match wins. ``skinny_lora``: the epilogue-LoRA skinny GEMM
(``engine/kernels/skinny_lora_epilogue.py``'s ``_skinny_lora``), whose name has no other key;
``mlp_block``: the one-launch decode MLP (``engine/kernels/mlp_block.py``: two GEMMs and the
SiLU x up between them, counted as GEMM)."""


def kernel_class(name: str) -> str:
    """Coarse class of a CUDA kernel name: attention, gemm, sort/sample or elementwise/other."""
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)),
                "elementwise/other")


def rewound_state(st: Any, back: int) -> tuple[Any, Any, Any]:
    """``(pos, gen_idx, tokens)`` of decode state ``st`` moved ``back`` positions earlier
    (clamped at 0; ``tokens`` as saved): the state a profile or a graph replay restores before
    each step, so it runs at the context the timed steps averaged (after a run the state sits at
    the last position, ``prompt + max_new_tokens - 1``, where attention reads the most KV). The
    KV entries at the rewound positions are overwritten by those steps: call it only after the
    timed rounds. ``back`` < 0 raises ``ValueError``."""
    if back < 0:
        raise ValueError(f"rewound_state: back={back} must be >= 0")
    return ((st.pos - back).clamp(min=0), (st.gen_idx - back).clamp(min=0), st.tokens.clone())


def profile_decode_step(llm: Any, batch: int, steps: int = 3, back: int = 0) -> dict[str, Any]:
    """GPU kernel time of one eager decode step by class (ms), the kernel count and the
    slowest kernels one by one (:func:`summarize_kernels`), from ``torch.profiler`` over
    ``steps`` steps of the last-used state of bucket >= ``batch``, rewound ``back`` positions
    (:func:`rewound_state`; the benchmarks pass ``max_new_tokens // 2``: the mean context)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    st = next(s for (b, _), s in sorted(llm.runner.states.items()) if b >= batch)
    kept = (st.pos.clone(), st.gen_idx.clone(), st.tokens.clone())
    saved = rewound_state(st, back)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            st.col.zero_()
            for buf, val in zip((st.pos, st.gen_idx, st.tokens), saved):
                buf.copy_(val)
            llm.runner._step_body(st, st.use_sort)
        torch.cuda.synchronize()
    for buf, val in zip((st.pos, st.gen_idx, st.tokens), kept):
        buf.copy_(val)
    return summarize_kernels(kernel_rows(prof.key_averages(), torch.autograd.DeviceType.CUDA),
                             steps)


def kernel_rows(events: Any, device_type: Any) -> list[tuple[str, float, int]]:
    """``(name, device us, count)`` of the ``key_averages()`` events of ``device_type`` with
    device time (``device_time_total``, or ``cuda_time_total`` on older torch)."""
    rows = []
    for evt in events:
        dev_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if evt.device_type == device_type and dev_us:
            rows.append((evt.key, float(dev_us), int(evt.count)))
    return rows


TOP_KERNELS = 25
"""Kernels :func:`summarize_kernels` lists one by one (by time); the rest go to one remainder."""


def summarize_kernels(rows: Any, steps: int, top: int = TOP_KERNELS) -> dict[str, Any]:
    """The profile record of :func:`profile_decode_step` from ``rows`` = ``(kernel name, device
    us over all steps, launches over all steps)`` (one row per name: ``key_averages()``):

    - ``kernel_ms_per_step``: class (:func:`kernel_class`) -> ms per step;
    - ``kernels_per_step``, ``kernel_ms_total`` (ms per step, every kernel);
    - ``top_kernels``: the ``top`` slowest names, each ``{"name", "class", "ms_per_step",
      "launches_per_step", "us_per_launch"}``, slowest first (ties by name);
    - ``top_kernels_rest``: ``{"kernels", "ms_per_step", "launches_per_step"}`` of the others,
      so that ``top_kernels`` + rest add up to ``kernel_ms_total`` and ``kernels_per_step``.

    Raises ``ValueError`` for ``steps < 1`` or a negative time or count.
    """
    if steps < 1:
        raise ValueError(f"summarize_kernels: steps={steps}; profile at least one step.")
    per: list[dict[str, Any]] = []
    by_class: dict[str, float] = {}
    launches = 0
    for name, dev_us, count in rows:
        if dev_us < 0 or count < 0:
            raise ValueError(f"summarize_kernels: {name!r} has time {dev_us} us, count {count}.")
        cls, ms = kernel_class(name), dev_us / 1e3 / steps
        by_class[cls] = by_class.get(cls, 0.0) + ms
        launches += count
        per.append({"name": name, "class": cls, "ms_per_step": ms,
                    "launches_per_step": count / steps,
                    "us_per_launch": dev_us / count if count else None})
    per.sort(key=lambda k: (-k["ms_per_step"], k["name"]))
    rest = per[top:]
    return {"kernel_ms_per_step": by_class, "kernels_per_step": launches / steps,
            "kernel_ms_total": sum(by_class.values()), "top_kernels": per[:top],
            "top_kernels_rest": {"kernels": len(rest),
                                 "ms_per_step": sum(k["ms_per_step"] for k in rest),
                                 "launches_per_step": sum(k["launches_per_step"] for k in rest)}}


_VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "transpose", "t", "unsqueeze", "squeeze",
                       "expand", "slice", "select", "split", "split_with_sizes", "as_strided",
                       "alias", "detach", "permute", "unbind", "narrow", "lift_fresh",
                       "view_as"})


def count_decode_ops(llm: Any, batch: int = 4) -> dict[str, Any]:
    """Aten ops of one eager decode step: the CPU proxy for CUDA kernels per step.

    Counts every aten call under a ``TorchDispatchMode`` except pure view/metadata ops and
    same-dtype ``to`` (no kernel on the GPU). The flex_attention call counts as one op per layer
    (compiled on the GPU it is one Triton kernel; its eager CPU decomposition is not what the H200
    runs), and so does each call of a torch.compiled elementwise piece (``compiled:<name>``,
    ``compile_layers=True``; inductor emits one or two kernels for each, an assumption here). ``ops_per_layer`` is the difference between a step over all layers and one over all
    but the last layer (Llama-block models; ``None`` with ``note`` set for models that cannot
    drop a layer, e.g. Gemma-4). Needs a prior ``generate`` so a decode state of bucket
    >= ``batch`` exists. Returns ``{"ops_per_step", "ops_per_layer", "fixed_ops", "num_layers",
    "by_op", "note"}`` (``by_op``: op name -> count over the step, top 25). Raises ``ValueError`` when no
    decode state exists yet.
    """
    runner = llm.runner
    states = [s for (b, _), s in sorted(runner.states.items()) if b >= batch]
    if not states:
        raise ValueError("count_decode_ops: no decode state yet; run llm.generate first.")
    full = _count_step(runner, states[0])
    total, layers = sum(full.values()), len(runner.model.layers)
    out = {"ops_per_step": total, "ops_per_layer": None, "num_layers": layers, "fixed_ops": None,
           "by_op": dict(sorted(full.items(), key=lambda kv: -kv[1])[:25]), "note": None}
    fewer, note = _count_without_last_layer(runner, states[0])
    if fewer is None:
        out["note"] = note
    else:
        out["ops_per_layer"] = total - sum(fewer.values())
        out["fixed_ops"] = total - out["ops_per_layer"] * layers
    return out


def _count_without_last_layer(runner: Any, st: Any) -> tuple[dict[str, int] | None, str | None]:
    """Op counts of a step over all layers but the last, or ``(None, note)`` where the model
    cannot run without it (Gemma-4: its per-layer inputs are laid out for every layer, and KV
    sharing points layers at their store layers), so only the whole-step count is reported."""
    model = runner.model
    layers = model.layers
    model.layers = layers[:-1]
    try:
        return _count_step(runner, st), None
    except Exception as err:  # noqa: BLE001 -- an architecture that needs all layers: a note
        return None, (f"ops_per_layer not counted: {type(model).__name__} cannot step without "
                      f"its last layer ({type(err).__name__}: {str(err)[:160]})")
    finally:
        model.layers = layers


def _count_step(runner: Any, st: Any) -> dict[str, int]:
    """Op-name counts of one eager ``_step_body`` on state ``st`` (state restored afterwards)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    counts: dict[str, int] = {}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in _VIEW_OPS and not (name == "to" and args and out is args[0]):
                counts[name] = counts.get(name, 0) + 1
            return out

    def as_one(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            with _disable_current_modes():  # runs outside the counter: one op
                return fn(*a, **k)
        return call

    model, flex = runner.model, runner.model.flex
    fx = getattr(model, "fx_decode", None)
    fx_saved = {n: getattr(fx, n) for n in fx.NAMES} if fx is not None and fx.compiled else {}
    saved = (st.pos.clone(), st.gen_idx.clone(), st.tokens.clone(), st.col.clone())
    model.flex = as_one("flex_attention", flex)
    for name, fn in fx_saved.items():
        setattr(fx, name, as_one(f"compiled:{name}", fn))
    st.col.zero_()  # the window column: after a generate it can sit at its end (sync_every)
    try:
        with torch.inference_mode(), Counter():
            runner._step_body(st, st.use_sort)
    finally:
        model.flex = flex
        for name, fn in fx_saved.items():
            setattr(fx, name, fn)
        for buf, val in zip((st.pos, st.gen_idx, st.tokens, st.col), saved):
            buf.copy_(val)
    return counts


BREAKDOWN_CLASSES = {"gemm": "gemm", "attention": "attention", "elementwise/other": "elementwise",
                     "sort/sample": "sampling"}
"""Profile class -> sidecar key stem of :func:`kernel_breakdown` (issue 12's table columns)."""


def kernel_breakdown(profile: dict[str, Any] | None) -> dict[str, float] | None:
    """``{"gemm_ms", "attention_ms", "elementwise_ms", "sampling_ms", "kernel_ms_total",
    "kernels_per_step"}`` (ms per step) from a :func:`profile_decode_step` result; ``None``
    when no profile ran."""
    if not profile:
        return None
    by = profile["kernel_ms_per_step"]
    out = {f"{stem}_ms": by.get(cls, 0.0) for cls, stem in BREAKDOWN_CLASSES.items()}
    return {**out, "kernel_ms_total": profile["kernel_ms_total"],
            "kernels_per_step": profile["kernels_per_step"]}
