"""Engine-side live LoRA: projections that read the HF / PEFT modules' own tensors at call time.

Contract: :class:`LiveLinear` wraps one ``nn.Linear`` or one PEFT ``lora.Linear``. It holds the
module, not its tensors, and reads ``base_layer.weight``, ``lora_A[adapter].weight`` ``[r, in]`` and
``lora_B[adapter].weight`` ``[out, r]`` on every call, so an in-place optimizer update is seen by
the next rollout with no merge and no copy. The arithmetic is PEFT's ``lora.Linear.forward``
(peft/tuners/lora/layer.py): ``y = base(x); y = y + lora_B(lora_A(x.to(A.dtype))) * scaling`` cast
back to the base output dtype. Dropout is off (inference). One adapter only.

:class:`LiveGroup` serves projections that read the same input (q/k/v, gate/up): at construction
the parts' base weights and LoRA A are re-pointed (``param.data = view``) to row slices of one fused
buffer each, so one GEMM serves all parts with no copy per call and the optimizer's in-place
updates land in the fused buffer; LoRA B adds in place into each part's output slice with the
scaling folded into ``addmm_`` (see the class docstring), or, with ``lora_expand="triton"``, as
one Triton launch for all parts (:mod:`nbhelpers.engine.kernels.lora_expand`). With
``lora_fused="triton"`` decode calls (at most ``lora_gemm.MAX_ROWS`` rows) run the base GEMM and
its LoRA as one kernel (:mod:`nbhelpers.engine.kernels.lora_gemm`) where the per-shape tuner
(:mod:`nbhelpers.engine.kernels.lora_gemm_tune`) found it faster than that path; that path lives
in :mod:`nbhelpers.engine.lora_fused` (:class:`LoraFusedGemm`, one per group). With the runner
option ``skinny_gemm`` on (``"auto"`` on CUDA) the base GEMM of decode calls (<= 32 rows by default, or
``skinny_gemm_max_rows``) runs as a split-K Triton kernel where its tuner found it faster than
cuBLAS (:mod:`nbhelpers.engine.skinny_linear`).

:func:`storage_signature` lists the ``data_ptr`` of every tensor a captured graph reads; the runner
re-captures when it changes (an optimizer or ``load_state_dict`` that replaced storage).
"""

from __future__ import annotations

from typing import Any

from nbhelpers.engine.lora_fused import (  # noqa: F401 (re-exported: public names)
    LORA_FUSED_MODES,
    LoraFusedGemm,
    check_kernel_mode,
    check_lora_fused,
)
from nbhelpers.engine.lora_pending import PendingLora, add_lora_b, defer
from nbhelpers.engine.lora_shadow import (
    fuse_shadow,
    lora_versions,
    refresh_shadow,
    stale_shadow,
)

LORA_DTYPES = ("adapter", "model")
"""What LoRA is computed in: the adapter's own dtype (PEFT's order) or the base model's dtype
from shadow copies refreshed per weight version (:meth:`LiveGroup.set_lora_dtype`)."""

LORA_EXPAND_MODES = ("addmm", "triton", "consumer", "epilogue")
"""How LiveGroup adds LoRA B: one ``addmm_`` per part, one Triton kernel per group, inside the
kernel that reads the projection next (decode with ``fused_elementwise="triton"``; else as
``"triton"``: :mod:`nbhelpers.engine.lora_pending`), or inside the skinny decode GEMM's epilogue
(``ext`` groups the skinny kernel serves; else as ``"triton"``:
:mod:`nbhelpers.engine.kernels.skinny_lora_epilogue`)."""


def check_lora_dtype(mode: str) -> str:
    """``mode`` if valid (:func:`~nbhelpers.engine.lora_fused.check_kernel_mode` over
    :data:`LORA_DTYPES`)."""
    return check_kernel_mode("lora_dtype", mode, LORA_DTYPES)


def check_lora_expand(mode: str) -> str:
    """``mode`` if valid (:func:`~nbhelpers.engine.lora_fused.check_kernel_mode` over
    :data:`LORA_EXPAND_MODES`; ``"consumer"`` / ``"epilogue"`` need triton as ``"triton"``
    does)."""
    import importlib.util
    check_kernel_mode("lora_expand", mode, LORA_EXPAND_MODES)
    if mode in ("consumer", "epilogue") and importlib.util.find_spec("triton") is None:
        raise ValueError(f"lora_expand={mode!r} needs the triton package (pip install "
                         "triton); use lora_expand='addmm'.")
    return mode


def _adapter_of(module: Any) -> str | None:
    if not hasattr(module, "lora_A"):
        return None
    active = list(getattr(module, "active_adapters", []) or [])
    if len(active) != 1:
        raise ValueError(f"flex engine: LoRA module has active adapters {active}; exactly one "
                         "adapter is supported (set_adapter(name) first).")
    adapter = active[0] if active[0] in module.lora_A else None
    if adapter is not None:
        _check_plain_lora(module, adapter)
    return adapter


def _check_plain_lora(module: Any, adapter: str) -> None:
    """``ValueError`` for PEFT LoRA variants the engine's ``y + s * B(A(x))`` does not compute:
    DoRA (``use_dora``: a magnitude vector rescales the whole output) and ``lora_bias`` (B with
    a bias): silently running them as plain LoRA gave other tokens than PEFT (helper-26's
    trial, 2026-12-08: |dlogprob| up to 0.24 on a tiny Qwen3)."""
    if (getattr(module, "use_dora", {}) or {}).get(adapter, False):
        raise ValueError(f"flex engine: adapter {adapter!r} uses DoRA (LoraConfig(use_dora=True)),"
                         " which the engine does not compute; train a plain LoRA adapter, or "
                         "merge it (model.merge_and_unload()) before building the engine.")
    if getattr(module.lora_B[adapter], "bias", None) is not None:
        raise ValueError(f"flex engine: adapter {adapter!r} has a LoRA B bias "
                         "(LoraConfig(lora_bias=True)), which the engine does not compute; use "
                         "lora_bias=False, or merge the adapter (model.merge_and_unload()).")


class LiveLinear:
    """``y = x @ W^T (+ bias) (+ scaling * (x @ A^T) @ B^T)`` on the module's live tensors.

    Shapes: ``x [..., in]`` -> ``[..., out]``.
    """

    def __init__(self, module: Any):
        self.module = module
        self.sync_adapter()

    def sync_adapter(self) -> None:
        """(Re-)read the module's active adapter (at construction, and in the group's
        live-weights check: PEFT ``set_adapter`` after the engine was built). Raises
        ``ValueError`` when not exactly one adapter is active."""
        self.adapter = _adapter_of(self.module)
        self.base = self.module.base_layer if self.adapter is not None else self.module

    def config(self) -> tuple:
        """``(adapter, has_lora, scaling)``: what decides the math besides the tensors (PEFT's
        ``scaling`` is a Python float, read at fuse time and baked into captured graphs)."""
        if self.adapter is None:
            return (None, False, None)
        return (self.adapter, self.has_lora, float(self.module.scaling[self.adapter]))

    @property
    def has_lora(self) -> bool:
        m = self.module
        return (self.adapter is not None and not getattr(m, "merged", False)
                and not getattr(m, "disable_adapters", False))

    def lora_tensors(self) -> tuple[Any, Any, float]:
        m, a = self.module, self.adapter
        return m.lora_A[a].weight, m.lora_B[a].weight, float(m.scaling[a])

    def base_out(self, x: Any) -> Any:
        import torch.nn.functional as F
        return F.linear(x, self.base.weight, self.base.bias)

    def add_lora(self, y: Any, xa: Any) -> Any:
        """``y + B(xa) * scaling`` in PEFT's dtype order; ``xa = x @ A^T`` ``[..., r]``."""
        import torch.nn.functional as F
        _, b, scaling = self.lora_tensors()
        return (y + F.linear(xa, b) * scaling).to(y.dtype)

    def __call__(self, x: Any) -> Any:
        import torch.nn.functional as F
        y = self.base_out(x)
        if not self.has_lora:
            return y
        a, _, _ = self.lora_tensors()
        return self.add_lora(y, F.linear(x.to(a.dtype), a))

    def tensors(self) -> list[Any]:
        out = [self.base.weight] + ([self.base.bias] if self.base.bias is not None else [])
        return out + (list(self.lora_tensors()[:2]) if self.has_lora else [])


class LiveGroup:
    """Projections reading one input (q/k/v, gate/up; or one projection): few GEMMs, live tensors.

    With ``fuse`` (the default; runner option ``fuse_lora_a``) and more than one part, the parts'
    tensors are re-pointed once, at construction, to contiguous row slices of fused buffers
    (``param.data = view``: the same ``Parameter`` objects, so HF/PEFT modules, ``save_pretrained``
    and an existing optimizer keep working; no extra memory, no per-call copy): base weights
    ``W [sum(out), in]`` (biases likewise) and LoRA ``A [sum(r), in]``. One call is then
    ``y = x @ W^T``, ``xa = x @ A^T`` and one in-place ``y_i.addmm_(xa_i, B_i^T, alpha=scaling)``
    per part into its column slice of ``y`` (PEFT's ``y + B(A(x)) * scaling`` with the scaling and
    the add folded into the GEMM; with fp32 adapters on a bf16 base, in an fp32 copy of ``y``
    cast back once, PEFT's dtype order). ``lora_B`` stays
    the module's own tensor (a block-diagonal fused B would be one GEMM but non-contiguous views,
    which HF ``save_pretrained`` rejects). An optimizer's in-place update lands in the fused buffer (live LoRA). If storage
    is replaced later (``.to()``, ``load_state_dict(assign=True)``) the group re-fuses on its next
    eager call (the runner re-captures its CUDA graphs on the storage-signature change first).
    ``lora_expand="triton"`` (:meth:`set_lora_expand`) replaces the per-part ``addmm_`` by one
    kernel over all parts, same dtype order, on CUDA (or under ``TRITON_INTERPRET=1``) when
    :func:`nbhelpers.engine.kernels.lora_expand.supported`; otherwise the ``addmm_`` path runs. In that
    mode fp32 adapters on a 16-bit base (TRL's GRPO default) also get A as one Triton launch
    reading the 16-bit input (:mod:`nbhelpers.engine.kernels.lora_shrink`) instead of cast + fp32 GEMM.
    ``lora_expand="consumer"`` is ``"triton"`` plus :meth:`deferred`, which leaves B to the kernel
    that reads the output next (:mod:`nbhelpers.engine.lora_pending`).

    Shapes: ``x [..., in]`` -> list of ``[..., out_i]`` (views of one ``[..., sum(out)]`` output).
    """

    def __init__(self, modules: list[Any], fuse_lora_a: bool = True,
                 lora_expand: str = "addmm"):
        self.parts = [LiveLinear(m) for m in modules]
        self.fuse_lora_a = fuse_lora_a
        self.sizes = [p.base.weight.shape[0] for p in self.parts]
        self._fused: dict[str, Any] | None = None
        self._state: tuple = ()
        self._expand: Any = None
        self._lora_gemm = LoraFusedGemm()  # lora_fused="triton" path (lora_fused.py)
        self.lora_fused = "off"
        self.lora_dtype = "adapter"
        self._versions: tuple = ()
        self._skinny: Any = None  # skinny_linear.SkinnyLinear (runner option skinny_gemm)
        self.checked = False  # True inside one LLM.generate (ModelRunner.begin_generate)
        self.set_lora_expand(lora_expand)
        self.refresh()

    def set_lora_dtype(self, mode: str) -> None:
        """``"adapter"`` (PEFT's dtype order on the adapter's own tensors) or ``"model"``: fp32
        adapters on a 16-bit base are computed in the base dtype from shadow copies (A's rows
        joined to the base weight buffer, B beside it) that :meth:`refresh` re-copies whenever
        the trainer's tensors changed (their ``_version`` counter: an optimizer step in place),
        so the next rollout still sees every update with no user call; one cast per weight
        version instead of an fp32 GEMM per decode step. Raises ``ValueError`` for another mode.
        """
        self.lora_dtype = check_lora_dtype(mode)
        self._state = ()  # fuse again under the new mode
        self.refresh()

    def set_lora_expand(self, mode: str, one_part_rows: int = 0) -> None:
        """``"addmm"``, ``"triton"`` (see the class docstring) or ``"consumer"`` (as ``"triton"``,
        and :meth:`deferred` may leave B to the consumer kernel); raises ``ValueError`` as
        :func:`check_lora_expand`. ``one_part_rows`` (runner option
        ``lora_consumer_one_part_rows``): in ``"consumer"`` mode a one-part group (o_proj,
        down_proj) defers too from that many rows (0: never; :func:`.lora_pending.defers_rows`).
        """
        self.lora_expand = check_lora_expand(mode)
        self.one_part_rows = one_part_rows
        self._expand = self._shrink = None
        if mode in ("triton", "consumer", "epilogue"):  # imported here, not per call (traced)
            from nbhelpers.engine.kernels import lora_expand as expand_module
            from nbhelpers.engine.kernels import lora_shrink as shrink_module
            self._expand, self._shrink = expand_module, shrink_module

    def set_lora_fused(self, mode: str) -> None:
        """``"off"`` or ``"triton"`` (module docstring); raises ``ValueError`` as
        :func:`check_lora_fused`."""
        self.lora_fused = self._lora_gemm.set_mode(mode)

    def set_skinny_gemm(self, route: Any) -> None:
        """Run the base GEMM through ``route`` (a :class:`.skinny_linear.SkinnyLinear`, which
        picks the split-K kernel or ``F.linear`` per call), or ``F.linear`` for ``None``."""
        self._skinny = route if route is not None and route.enabled else None

    def _lora_fusable(self) -> bool:
        if not all(p.has_lora for p in self.parts):
            return False
        ts = [p.lora_tensors() for p in self.parts]
        return len({(a.dtype, b.dtype, a.device, s) for a, b, s in ts}) == 1

    def _fuse_storage(self) -> dict[str, Any] | None:
        """Allocate the fused buffers and re-point the parts' tensors to views of them.

        With LoRA A in the base dtype and no bias, A's rows join the base buffer
        (``[sum(out) + sum(r), in]``: one GEMM gives ``y`` and ``xa``); else A gets its own.
        """
        ws = [p.base.weight for p in self.parts]
        bs = [p.base.bias for p in self.parts]
        if (len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1
                or len({b is None for b in bs}) != 1):
            return None  # mixed parts: per-part path
        lora = self._lora_fusable()
        a_list = [p.lora_tensors()[0] for p in self.parts] if lora else []
        if lora and bs[0] is None and self._wants_shadow(ws[0], a_list[0]):
            return self._fuse_shadow(ws, a_list)
        ext = lora and bs[0] is None and a_list[0].dtype == ws[0].dtype
        if len(self.parts) == 1 and not ext:
            return None  # nothing to fuse: the live-tensor path
        fused: dict[str, Any] = {"W": _repoint(ws + a_list if ext else ws), "ext": ext,
                                 "n_out": sum(self.sizes), "lora": lora}
        fused["bias"] = _repoint(bs) if bs[0] is not None else None
        if lora:
            fused["A"] = None if ext else _repoint(a_list)
            fused["B"] = [p.lora_tensors()[1] for p in self.parts]  # live, contiguous
            fused["scaling"] = self.parts[0].lora_tensors()[2]
        return fused

    def _wants_shadow(self, w: Any, a: Any) -> bool:
        import torch
        return (self.lora_dtype == "model" and a.dtype == torch.float32
                and w.dtype in (torch.bfloat16, torch.float16))

    def _fuse_shadow(self, ws: list[Any], a_list: list[Any]) -> dict[str, Any]:
        fused = fuse_shadow(self.parts, ws, a_list)  # lora_shadow.py
        self._versions = lora_versions(self.parts)
        return fused

    def _refresh_shadow(self) -> None:
        self._versions = refresh_shadow(self._fused, self.parts, self._versions)

    def _current_state(self) -> tuple:
        return (tuple(t.data_ptr() for t in self.tensors()),
                tuple(p.config() for p in self.parts))

    def _fuse_again_if_changed(self) -> None:
        """Re-read each part's adapter, then fuse again when the storage or a part's
        :meth:`LiveLinear.config` changed since the last fuse (``fuse_lora_a`` only)."""
        for p in self.parts:
            p.sync_adapter()
        if self.fuse_lora_a and self._current_state() != self._state:
            self._fused = self._fuse_storage()
            self._state = self._current_state()

    def refresh(self) -> None:
        """Fuse again if storage was replaced, adapters toggled or switched (PEFT
        ``set_adapter``) or the LoRA scaling changed since the last fuse (host-side; the runner
        calls it once per ``LLM.generate``, ``ModelRunner.begin_generate``)."""
        self._fuse_again_if_changed()
        if self._fused is not None and "shadow" in self._fused:
            self._refresh_shadow()

    def stale_shadows(self) -> tuple[list[Any], list[Any]] | None:
        """:meth:`refresh` except the shadow copy: fuse again if needed, then ``(the trainer's
        A/B, their shadows)`` when any changed since the last copy (recorded as copied: the
        caller must copy them, :func:`.lora_shadow.refresh_all`), else ``None``."""
        self._fuse_again_if_changed()
        if self._fused is None or "shadow" not in self._fused:
            return None
        self._versions, stale = stale_shadow(self._fused, self.parts, self._versions)
        return stale

    def _buffers(self) -> dict[str, Any] | None:
        """Fused (or single-part live) tensors for the GEMM path, or ``None`` for per-part."""
        import torch
        # traced: refreshed before; checked: the runner refreshed every group at the start of
        # this LLM.generate call, and weights cannot change inside it (begin_generate)
        # (is_compiling first: a trace must not read, and so guard on, the flag)
        if self.fuse_lora_a and not torch.compiler.is_compiling() and not self.checked:
            self.refresh()
        if self._fused is not None and self._fused["lora"] == any(p.has_lora for p in self.parts):
            return self._fused
        if len(self.parts) > 1:  # LoRA on some parts only (or mixed dtypes): per part
            return None
        p = self.parts[0]
        out = {"W": p.base.weight, "bias": p.base.bias, "ext": False, "lora": p.has_lora,
               "n_out": self.sizes[0]}
        if p.has_lora:
            out["A"], b, out["scaling"] = p.lora_tensors()
            out["B"] = [b]
        return out

    def gemm_weight(self) -> Any:
        """The weight buffer the base GEMM reads: ``W [sum(out), in]``, with LoRA A's rows
        below it in the ``ext`` layout (``[sum(out) + sum(r), in]``), or ``None`` when the parts
        run one by one (runner option ``l2_prefetch`` reads it into L2)."""
        f = self._buffers()
        return None if f is None else f["W"]

    def __call__(self, x: Any) -> list[Any]:
        f = self._buffers()
        if f is None:
            return [p(x) for p in self.parts]
        x2 = x.reshape(-1, x.shape[-1])
        fused = self._lora_gemm
        y = fused(x2, f, self.sizes, self._ranks, self._cublas_path) if fused.enabled else None
        if y is None:
            y = self._cublas_path(x2, f)
        return self.split_out(y, x.shape)

    def split_out(self, y: Any, x_shape: Any) -> list[Any]:
        """``y [N, sum(out)]`` as the per-part outputs ``[..., out_i]`` (views)."""
        y = y.view(*x_shape[:-1], y.shape[-1])
        return list(y.split(self.sizes, dim=-1)) if len(self.parts) > 1 else [y]

    def deferred(self, x: Any) -> tuple[list[Any], PendingLora | None]:
        """:meth:`__call__` with LoRA B left to the consumer kernel (``lora_expand="consumer"``):
        ``(base outputs, PendingLora)``, or ``(self(x), None)`` where the mode does not apply
        (:func:`nbhelpers.engine.lora_pending.defer`). The caller must pass the record to a
        kernel that adds it, or call its ``apply()``."""
        return defer(self, x)

    def _base_gemm(self, x2: Any, f: dict[str, Any]) -> Any:
        """``x2 @ W^T (+ bias)`` ``[N, rows of W]``: cuBLAS, or the skinny kernel in decode."""
        import torch.nn.functional as F
        if self._skinny is not None:
            return self._skinny(x2, f["W"], f["bias"])
        return F.linear(x2, f["W"], f["bias"])

    def _cublas_path(self, x2: Any, f: dict[str, Any]) -> Any:
        """Base GEMM (:meth:`_base_gemm`), then LoRA A and B as configured: ``[N, sum(out)]``
        (``lora_expand="epilogue"``: one skinny launch where it serves, ``SkinnyLinear``)."""
        if self.lora_expand == "epilogue" and f["lora"] and f["ext"] and self._skinny is not None:
            y = self._skinny.lora_epilogue(x2, f, self.sizes, self._ranks())
            if y is not None:
                return y
        y = self._base_gemm(x2, f)  # [N, sum(out)] (+ [N, sum(r)] when ext)
        if f["lora"]:
            n = f["n_out"]
            y, xa = (y[:, :n], y[:, n:]) if f["ext"] else (y, self._lora_a(x2, f["A"]))
            y = add_lora_b(y, xa, f["B"], self.sizes, self._ranks(), f["scaling"], self._expand)
        return y

    def _lora_a(self, x2: Any, a: Any) -> Any:
        """``x2.to(A.dtype) @ A^T`` ``[N, sum(r)]``: one Triton launch for fp32 A on a 16-bit
        input when enabled (:mod:`nbhelpers.engine.kernels.lora_shrink`), else cast + ``F.linear``."""
        import torch.nn.functional as F
        ls = self._shrink
        if ls is not None and ls.supported(x2, a):
            return ls.lora_shrink(x2, a)
        return F.linear(x2.to(a.dtype), a)

    def _ranks(self) -> list[int]:
        return [p.lora_tensors()[0].shape[0] for p in self.parts]

    def tensors(self) -> list[Any]:
        return [t for p in self.parts for t in p.tensors()]


def _repoint(tensors: list[Any]) -> Any:
    """Concatenate along dim 0 into a new buffer and set each ``t.data`` to its row slice.

    Tensors that already are consecutive row slices of one buffer (an earlier engine fused them)
    are left alone and that buffer is returned as a view (no copy).
    """
    import torch
    cols = tensors[0].shape[1:]
    row = tensors[0][0].numel() * tensors[0].element_size()
    starts = [sum(t.shape[0] for t in tensors[:i]) for i in range(len(tensors))]
    if all(t.is_contiguous() and t.shape[1:] == cols and t.untyped_storage().data_ptr()
           == tensors[0].untyped_storage().data_ptr()
           and t.data_ptr() == tensors[0].data_ptr() + s * row
           for t, s in zip(tensors, starts)):
        total = starts[-1] + tensors[-1].shape[0]
        return tensors[0].detach().as_strided((total, *cols), tensors[0].stride())
    with torch.no_grad():
        buf = torch.cat([t.detach() for t in tensors], 0)
        start = 0
        for t in tensors:
            n = t.shape[0]
            t.data = buf[start:start + n]
            start += n
    return buf


def storage_signature(groups: list[Any]) -> tuple:
    """``data_ptr`` of every tensor the projections read (changes when storage is replaced), then
    each part's :meth:`LiveLinear.config` (adapter, LoRA on/off, scaling: a captured graph bakes
    them in, so a switched adapter, ``disable_adapter()``, a merge or a new scaling recaptures)."""
    return (tuple(t.data_ptr() for g in groups for t in g.tensors())
            + tuple(p.config() for g in groups for p in g.parts))
