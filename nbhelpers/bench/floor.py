"""The bandwidth floor of a decode step, measured in the same process as the engine benchmark.

Contract: :func:`read_bandwidth` measures this device's read bandwidth (a reduction over a buffer
much larger than L2); :func:`step_bytes` counts the bytes one decode step must read (weights +
LoRA at its dtype + the KV cache at the context length) from the model config and the
:class:`~nbhelpers.config.LoraSpec`; :func:`cold_gemm_times` times each decode GEMM shape with cold
weights for cuBLAS (``F.linear``) and for the engine's own kernels (``engine/kernels``:
``lora_shrink``, ``lora_expand``, and ``lora_gemm`` when that module exists). Then
``pct_of_floor = bytes_per_step / step_time / bandwidth * 100`` (:func:`pct_of_floor`): 100 % is
a step that only streams its bytes once at the measured bandwidth.

Everything runs on the CPU at tiny sizes too (the numbers there mean nothing; the code path is the
same, so it is unit-tested: ``tests/unit/test_floor.py``). Method after
``shared/tools/gemv_roofline.py`` (issue 12: 4.28 TB/s read on the H200 over 4 GiB; weights of
each GEMM cycled over > 256 MB of copies so the 50 MB L2 holds none).
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from typing import Any

from nbhelpers.config import LoraSpec

L2_BYTES = 50 * 10**6
"""H200 L2 cache (50 MB, NVIDIA H200 datasheet); cold-weight buffers are sized past it."""
CUDA_READ_BYTES = 2 << 30
"""Default read-bandwidth buffer on CUDA (2 GiB, ~40x L2)."""
CUDA_CYCLE_BYTES = 256 << 20
"""Default bytes of weight copies cycled per GEMM shape on CUDA (> 5x L2)."""
CPU_BYTES = 4 << 20
"""Default read buffer on the CPU (tiny: the code path, not the number)."""
CPU_CYCLE_BYTES = 64 << 10
"""Default cycled weight bytes per shape on the CPU (few copies: Triton's interpreter is slow)."""
_ELT = {"float32": 4, "bfloat16": 2, "float16": 2}


def _sync(device: str) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def median_seconds(fn: Any, device: str, rounds: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``rounds`` calls, device synchronised before and after
    each (CUDA events on CUDA, ``perf_counter`` on the CPU)."""
    import torch
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        if str(device).startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(device: str = "cuda", nbytes: int | None = None, rounds: int = 5) -> dict:
    """Read bandwidth of ``device`` in bytes/s: ``buf.sum(dtype=float32)`` over a bf16 buffer of
    ``nbytes`` (default :data:`CUDA_READ_BYTES` on CUDA, :data:`CPU_BYTES` on the CPU), median of
    ``rounds`` synchronised timings. Returns ``{"bytes_per_s", "buffer_bytes", "median_s",
    "rounds"}``. Raises ``ValueError`` for ``nbytes < 2`` or ``rounds < 1``."""
    import torch
    nbytes = nbytes or (CUDA_READ_BYTES if str(device).startswith("cuda") else CPU_BYTES)
    if nbytes < 2 or rounds < 1:
        raise ValueError(f"read_bandwidth: nbytes={nbytes}, rounds={rounds}; use >= 2 and >= 1.")
    buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    sec = median_seconds(lambda: buf.sum(dtype=torch.float32), device, rounds)
    size = buf.numel() * 2
    return {"bytes_per_s": size / sec, "buffer_bytes": size, "median_s": sec, "rounds": rounds}


def _text_config(config: Any) -> Any:
    """The decoder config (``text_config`` of multimodal configs), checked for the fields used.

    Raises ``ValueError`` naming the model type when it is not a Llama-style dense decoder."""
    cfg = getattr(config, "text_config", None) or config
    kind = getattr(cfg, "model_type", "")
    if kind not in ("llama", "qwen3", "qwen2", "mistral"):
        raise ValueError(f"step_bytes: no byte formula for model_type {kind!r} (Llama-style dense "
                         "decoders only: llama, qwen3, qwen2, mistral); Gemma-4's per-layer "
                         "inputs, KV sharing and sliding windows need their own count.")
    return cfg


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``name -> (out N, in K)`` of one decoder layer's projections (HF module names)."""
    cfg = _text_config(config)
    h, d = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // \
        cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def step_bytes(config: Any, batch: int, context_len: float, lora: LoraSpec | None = None,
               weight_dtype: str = "bfloat16", adapter_dtype: str | None = None,
               kv_dtype: str | None = None) -> dict[str, float]:
    """Bytes one decode step of ``batch`` rows reads, by part, for a Llama-style decoder.

    Formula (L layers, hidden h, projections (N, K) of :func:`projection_shapes`, vocab V):
    ``weights = e_w * (L * (sum_p N_p K_p + 2 h) + h + V h + batch h)``: every projection, the two
    RMSNorm weights per layer and the final one, the lm_head (read whole, tied or not) and the
    ``batch`` embedding rows; ``lora = e_a * L * sum_{p in targets} r (N_p + K_p)`` (A ``[r, K]``
    and B ``[N, r]`` per target, PEFT's layout); ``kv = e_kv * 2 * L * n_kv * d * batch *
    context_len`` (K and V of every layer for each row's context). Qwen3's q/k norms (2 d per
    layer) and activations are left out (< 0.01 %). On Qwen3-4B bf16 the weights give 8.05 GB,
    as issue 12 states. ``context_len``: tokens each row attends to, e.g. the mean over the decode
    ``prompt + new / 2``. Returns ``{"weights", "lora", "kv", "total"}`` in bytes.
    Raises ``ValueError`` for a non-Llama-style config or an unknown dtype.
    """
    cfg, shapes = _text_config(config), projection_shapes(config)
    e_w, e_a, e_kv = (_elt(t) for t in (weight_dtype, adapter_dtype or weight_dtype,
                                        kv_dtype or weight_dtype))
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    per_layer = sum(n * k for n, k in shapes.values()) + 2 * h
    weights = e_w * (layers * per_layer + h + cfg.vocab_size * h + batch * h)
    lora_b = 0 if lora is None else e_a * layers * sum(
        lora.rank * (n + k) for name, (n, k) in shapes.items() if name in lora.targets)
    d = shapes["k_proj"][0] // cfg.num_key_value_heads
    kv = e_kv * 2 * layers * cfg.num_key_value_heads * d * batch * context_len
    return {"weights": weights, "lora": lora_b, "kv": kv, "total": weights + lora_b + kv}


def _elt(dtype: str) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _ELT:
        raise ValueError(f"step_bytes: dtype {dtype!r}; use one of {sorted(_ELT)}.")
    return _ELT[name]


def pct_of_floor(bytes_per_step: float, step_s: float, bytes_per_s: float) -> float:
    """``bytes_per_step / step_s / bytes_per_s * 100``: the step's achieved share of the measured
    read bandwidth. Raises ``ValueError`` unless all three are positive and finite."""
    if not all(math.isfinite(v) and v > 0 for v in (bytes_per_step, step_s, bytes_per_s)):
        raise ValueError(f"pct_of_floor: bytes {bytes_per_step}, step {step_s} s, bandwidth "
                         f"{bytes_per_s} B/s must all be positive and finite.")
    return bytes_per_step / step_s / bytes_per_s * 100.0


def decode_gemm_shapes(config: Any) -> dict[str, dict[str, int]]:
    """The decode GEMMs as the engine groups them: ``name -> {"n", "k", "per_step"}`` for qkv,
    o, gate_up, down (once per layer) and lm_head (once a step)."""
    cfg, s = _text_config(config), projection_shapes(config)
    layers = cfg.num_hidden_layers
    groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
              "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    out = {g: {"n": sum(s[p][0] for p in parts), "k": s[parts[0]][1], "per_step": layers,
               "parts": [s[p][0] for p in parts]} for g, parts in groups.items()}
    out["lm_head"] = {"n": cfg.vocab_size, "k": cfg.hidden_size, "per_step": 1, "parts": []}
    return out


def _cold(fn_of: Any, tensors: list[Any], device: str, rounds: int) -> float:
    """Seconds per call of ``fn_of(t)`` cycled over ``tensors`` (cold weights), median. On CUDA
    the cycle is one captured CUDA graph (as ``gemv_roofline.py`` times it: launches of small
    GEMMs from Python would otherwise starve the GPU); eager where capture fails."""
    def cycle() -> None:
        for t in tensors:
            fn_of(t)
    run = _graphed(cycle) if str(device).startswith("cuda") else cycle
    return median_seconds(run, device, rounds) / len(tensors)


def _graphed(fn: Any) -> Any:
    """``graph.replay`` of ``fn`` captured after a side-stream warm-up, or ``fn`` when capture
    raises (an op that cannot be captured)."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return fn
    return graph.replay


def cold_gemm_times(config: Any, batch: int, device: str = "cuda", dtype: str = "bfloat16",
                    lora: LoraSpec | None = None, adapter_dtype: str = "float32",
                    cycle_bytes: int | None = None, rounds: int = 3) -> dict[str, dict]:
    """Cold-weight time of each decode GEMM (:func:`decode_gemm_shapes`) at ``M = batch`` rows.

    Per shape: ``cublas_ms`` (``F.linear(x [M, K], W [N, K])``) and ``cublas_bytes_per_s``
    (weight bytes / time), over ``ceil(cycle_bytes / weight bytes)`` copies (default
    :data:`CUDA_CYCLE_BYTES` on CUDA: L2 holds none). With ``lora`` (projection groups in
    ``lora.targets``): the engine kernels' times, ``lora_shrink_ms`` (fp32 A, ``adapter_dtype``
    float32 only, as the kernel serves), ``lora_expand_ms``, and ``engine_gemm_ms`` /
    ``lora_gemm_ms`` (``engine/kernels/lora_gemm.py`` without / with LoRA, when importable;
    ``engine_gemm_ms`` also without ``lora``), each
    ``None`` with a note when not run. Times in ms per call; ``rounds`` medians.
    """
    import torch
    cycle = cycle_bytes or (CUDA_CYCLE_BYTES if str(device).startswith("cuda") else
                           CPU_CYCLE_BYTES)
    tdt = getattr(torch, dtype)
    out = {}
    for name, s in decode_gemm_shapes(config).items():
        x = torch.randn(batch, s["k"], dtype=tdt, device=device)
        copies = max(1, -(-cycle // (s["n"] * s["k"] * _elt(dtype))))
        ws = [torch.randn(s["n"], s["k"], dtype=tdt, device=device) * 0.02 for _ in range(copies)]
        sec = _cold(lambda w, x=x: torch.nn.functional.linear(x, w), ws, device, rounds)
        row = {"m": batch, "n": s["n"], "k": s["k"], "per_step": s["per_step"], "copies": copies,
               "cublas_ms": sec * 1e3, "cublas_bytes_per_s": s["n"] * s["k"] * _elt(dtype) / sec}
        del ws
        if lora is not None:
            row.update(_lora_kernel_times(name, s, x, lora, adapter_dtype, device, cycle, rounds))
        elif s["parts"]:  # the engine's base GEMM alone
            row.update(_lora_gemm_time(x, s, None, None, None, device, cycle, rounds))
        out[name] = row
    return out


def _lora_kernel_times(name: str, s: dict, x: Any, lora: LoraSpec, adapter_dtype: str,
                       device: str, cycle: int, rounds: int) -> dict[str, Any]:
    """Times of the engine's LoRA kernels for one projection group (see :func:`cold_gemm_times`)."""
    import torch

    from nbhelpers.engine.kernels import lora_expand, lora_shrink
    res: dict[str, Any] = {"lora_shrink_ms": None, "lora_expand_ms": None, "notes": []}
    if name == "lm_head" or not s["parts"]:
        res["notes"].append("no LoRA on lm_head")
        return res
    r, adt = lora.rank, getattr(torch, adapter_dtype)
    ranks, n_parts = [r] * len(s["parts"]), len(s["parts"])
    copies = max(1, -(-cycle // (n_parts * r * (s["k"] + s["n"]) * _elt(adapter_dtype))))
    a_s = [torch.randn(n_parts * r, s["k"], dtype=adt, device=device) * 0.02
           for _ in range(copies)]
    if lora_shrink.supported(x, a_s[0]):
        res["lora_shrink_ms"] = _cold(lambda a: lora_shrink.lora_shrink(x, a), a_s, device,
                                      rounds) * 1e3
    else:
        res["notes"].append(f"lora_shrink: unsupported here (A {adapter_dtype}, x {x.dtype}, "
                            f"device {x.device})")
    xa = torch.randn(x.shape[0], n_parts * r, dtype=adt, device=device)
    y = torch.zeros(x.shape[0], s["n"], dtype=x.dtype, device=device)
    b_s = [[torch.randn(n, r, dtype=adt, device=device) for n in s["parts"]]
           for _ in range(copies)]
    if lora_expand.supported(y, xa, b_s[0], s["parts"], ranks):
        res["lora_expand_ms"] = _cold(lambda bs: lora_expand.lora_expand(
            y, xa, bs, s["parts"], ranks, 2.0), b_s, device, rounds) * 1e3
    else:
        res["notes"].append("lora_expand: unsupported operands here")
    res.update(_lora_gemm_time(x, s, a_s, b_s, ranks, device, cycle, rounds))
    return res


def _lora_gemm_time(x: Any, s: dict, a_s: list[Any], b_s: list[list[Any]], ranks: list[int],
                    device: str, cycle: int, rounds: int) -> dict[str, Any]:
    """``engine_gemm_ms`` (no LoRA) and ``lora_gemm_ms`` (LoRA fused) of ``engine/kernels/
    lora_gemm.py``'s ``lora_gemm(x, w, sizes, a=, bs=, ranks=, scaling=)`` with cold weights, if
    that module exists and serves the operands (issue 12 item 2); else ``None`` with a note.
    ``a_s=None``: the base GEMM only."""
    import torch
    res: dict[str, Any] = {"engine_gemm_ms": None, "lora_gemm_ms": None}
    try:
        mod = importlib.import_module("nbhelpers.engine.kernels.lora_gemm")
    except ImportError as err:
        return {**res, "note_lora_gemm": f"engine/kernels/lora_gemm.py not importable: {err}"}
    sizes = s["parts"]
    copies = max(1, -(-cycle // (s["n"] * s["k"] * x.element_size())))
    ws = [torch.randn(s["n"], s["k"], dtype=x.dtype, device=device) * 0.02 for _ in range(copies)]
    if not mod.supported(x, ws[0], sizes):
        return {**res, "note_lora_gemm": f"lora_gemm.supported is false (x {x.dtype} "
                f"{tuple(x.shape)}, device {x.device})"}
    res["engine_gemm_ms"] = _cold(lambda w: mod.lora_gemm(x, w, sizes), ws, device, rounds) * 1e3
    if a_s is None:
        return res
    if not mod.supported(x, ws[0], sizes, a_s[0], b_s[0], ranks):
        return {**res, "note_lora_gemm": f"lora_gemm.supported is false with LoRA (A "
                f"{a_s[0].dtype})"}
    idx = list(range(copies))
    res["lora_gemm_ms"] = _cold(lambda i: mod.lora_gemm(
        x, ws[i], sizes, a=a_s[i % len(a_s)], bs=b_s[i % len(b_s)], ranks=ranks, scaling=2.0),
        idx, device, rounds) * 1e3
    return res


def floor_record(config: Any, batch: int, context_len: float, step_ms: float | None,
                 device: str, lora: LoraSpec | None = None, weight_dtype: str = "bfloat16",
                 adapter_dtype: str | None = None, gemms: bool = False) -> dict[str, Any]:
    """The sidecar's ``floor`` block and ``pct_of_floor`` for one measured point.

    ``floor``: ``bandwidth_bytes_per_s`` (:func:`read_bandwidth`, measured now), ``bytes_per_step``
    (:func:`step_bytes` parts), ``context_len``, ``floor_ms_per_step`` (total bytes / bandwidth),
    with ``gemms``: ``gemms`` (:func:`cold_gemm_times`) and ``gemm_ms_per_step_cublas`` (sum of
    ``cublas_ms * per_step``); ``error`` set (and the byte fields absent) when the architecture
    has no byte formula. ``pct_of_floor``: :func:`pct_of_floor` of ``step_ms``, ``None`` when
    either is unknown. Returns ``{"floor": ..., "pct_of_floor": ...}``.
    """
    bw = read_bandwidth(device)
    floor: dict[str, Any] = {"bandwidth_bytes_per_s": bw["bytes_per_s"],
                             "bandwidth_buffer_bytes": bw["buffer_bytes"], "device": str(device),
                             "context_len": context_len, "error": None}
    try:
        parts = step_bytes(config, batch, context_len, lora, weight_dtype, adapter_dtype)
    except ValueError as err:
        floor["error"] = str(err)
        return {"floor": floor, "pct_of_floor": None}
    floor["bytes_per_step"] = parts
    floor["floor_ms_per_step"] = parts["total"] / bw["bytes_per_s"] * 1e3
    if gemms:
        rows = cold_gemm_times(config, batch, device, weight_dtype, lora,
                               adapter_dtype or weight_dtype)
        floor["gemms"] = rows
        floor["gemm_ms_per_step_cublas"] = sum(r["cublas_ms"] * r["per_step"]
                                               for r in rows.values())
    pct = (pct_of_floor(parts["total"], step_ms / 1e3, bw["bytes_per_s"])
           if step_ms and step_ms > 0 else None)
    return {"floor": floor, "pct_of_floor": pct}


def lora_of(model: Any) -> tuple[LoraSpec | None, str | None]:
    """``(LoraSpec, adapter dtype name)`` of a PEFT model's ``default`` adapter (r, alpha,
    target modules, the dtype of its first ``lora_A`` tensor); ``(None, None)`` without one."""
    cfg = (getattr(model, "peft_config", None) or {}).get("default")
    if cfg is None:
        return None, None
    dtype = next((str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()
                  if "lora_A" in n), None)
    return LoraSpec(rank=cfg.r, alpha=int(cfg.lora_alpha),
                    targets=tuple(sorted(cfg.target_modules))), dtype
