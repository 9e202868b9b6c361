"""``torch.compile`` of a GRPO trainer's policy (and reference) forward, with a per-run report.

Contract: :func:`compile_trainer_models` compiles, in place, the decoder backbone
(``get_decoder()``: embeddings + transformer layers + final norm) of the innermost HF causal LM of
the trainer's policy (under PEFT's wrappers, so the training forward, TRL's log-prob pass and
``model.generate`` all go through it) and of ``trainer.ref_model`` when there is one, with
``nn.Module.compile(mode=...)``, after the trainer is built (issue 6, item 3): as one graph
(``scope="backbone"``) or one decoder layer at a time (``scope="layers"``, regional compilation,
:data:`COMPILE_SCOPES`; ``compile_scope="auto"`` picks per backend, :func:`resolve_compile_scope`).
The LM head stays eager: TRL 1.15 patches the LM's forward (``_fused_forward``,
trl/trainer/utils.py) to run the backbone and then its own Triton log-prob kernel
(``trl/kernels/chunked_logprob.py``), and with the whole LM compiled inductor failed to build that
kernel on the H200 (torch 2.11, triton 3.6, 2026-11-30: "Loop-carried variable m has initial type
fp32 but is re-assigned to fp64",
``executed/phase2_grpo/20_grpo_equivalence/20261130T110443Z_h200_039c472.ipynb``); on the CPU the
same region gave graph breaks on ``aten.nonzero`` (``hidden_states[mask]``).
vLLM keeps its own
compilation: its engine never calls these modules. The flex engine reads the modules' tensors,
not their forward, so compiling changes only the trainer side for it.

:class:`CompileWatch` is a context manager that measures, for the code run inside it, the dynamo
counters (``torch._dynamo.utils.counters``: graph breaks with their reasons, unique graphs, frames)
and the recompiles (records of the ``torch._dynamo.guards.__recompiles`` logger, enabled with
``torch._logging.set_logs(recompiles=True)``; the first lines of each reason are kept).
:meth:`CompileWatch.report` returns a JSON-ready dict; :meth:`CompileWatch.snapshot` the same
counts so far, read live inside the block (the per-step progress lines of
:class:`nbhelpers.grpo.progress.ProgressWriter`). Both carry ``compile_s``: seconds dynamo spent
compiling frames inside the block (``torch._dynamo.utils.compilation_time_metrics``
``"_compile.compile_inner"``, the backend's compile included; ``None`` where this torch lacks
that record). The counts cover everything dynamo compiled
inside the block: with the flex backend that includes the engine's own ``flex_attention`` wrapper
(its recompiles name ``_flex_attention_hop_wrapper``). Seen on the CPU (tiny Llama, TRL 1.15.0,
torch 2.13) when the whole LM was compiled: ``default`` mode gave 4 graph breaks, all
``aten.nonzero`` in TRL's ``_fused_forward``, and one recompile per new sequence length.

Run::

    with CompileWatch("default") as watch:
        f = torch.compile(torch.nn.Linear(4, 4)); f(torch.randn(2, 4)); f(torch.randn(3, 4))
    print(watch.report())   # 1 recompile (dynamic shape), 0 graph breaks
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Self

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
"""``compile_mode`` values: ``none`` = eager; the others are ``torch.compile`` modes."""
COMPILE_SCOPES = ("auto", "backbone", "layers")
"""``compile_scope`` values (:func:`resolve_compile_scope`): what one ``torch.compile`` call
covers. ``backbone``: the decoder backbone as one graph (embeddings, every layer, final norm);
``layers``: each decoder layer compiled on its own, PyTorch's "regional compilation" recipe
(tutorial ``recipes/regional_compilation``): the layers share one code object, so dynamo compiles
the first and reuses it for the others; ``auto``: :func:`resolve_compile_scope`."""
LAYER_SCOPE_BACKENDS = ("flex", "vllm")
"""Backends whose rollouts never run the policy's HF forward (their engines read its tensors or a
synced copy), so the trainer's forwards, all without a KV cache (TRL 1.15's ``_fused_forward``
passes ``use_cache=False``), are the only calls into the compiled layers. ``hf_generate`` and
``hf_cb`` generate through the layers with a KV cache, and each layer's ``layer_idx`` indexes
that cache: compiled per layer, every layer guards on its own index and recompiles (on the CPU,
tiny Qwen3, torch 2.13: one recompile per layer until dynamo's ``recompile_limit`` of 8)."""
COMPILE_DYNAMIC = {"auto": None, "on": True, "off": False}
"""Notebook words for ``compile_dynamic`` -> ``torch.compile(dynamic=)``: ``auto`` (our default,
torch's: static shapes, dynamic after the first recompile), ``on`` (the reference's
``--compile_dynamic`` default, Unsloth's GRPO notebook), ``off`` (static: one graph per shape)."""
_RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
_COMPILE_TIME_KEY = "_compile.compile_inner"
"""``compilation_time_metrics`` entry timing one dynamo frame compile (torch 2.4 .. 2.13)."""


def compile_seconds() -> float | None:
    """Seconds this process spent in dynamo frame compiles so far (``_compile.compile_inner`` of
    ``torch._dynamo.utils.compilation_time_metrics``, summed; 0.0 before any); ``None`` when this
    torch has no such record."""
    import torch._dynamo.utils as dyn
    metrics = getattr(dyn, "compilation_time_metrics", None)
    if not isinstance(metrics, dict):
        return None
    return float(sum(metrics.get(_COMPILE_TIME_KEY, ())))


def check_compile_mode(mode: str | None) -> str:
    """``mode`` normalised (``None`` -> ``"none"``). Raises ``ValueError`` naming the choices."""
    mode = "none" if mode in (None, "") else mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={mode!r}: use one of {COMPILE_MODES}.")
    return mode


def compile_dynamic_flag(word: str | bool | None) -> bool | None:
    """``torch.compile(dynamic=)`` for a :data:`COMPILE_DYNAMIC` word (a bool or ``None`` passes
    through). Raises ``ValueError`` naming the words."""
    if word is None or isinstance(word, bool):
        return word
    if word not in COMPILE_DYNAMIC:
        raise ValueError(f"compile_dynamic={word!r}: use one of {tuple(COMPILE_DYNAMIC)}.")
    return COMPILE_DYNAMIC[word]


KV_CACHE_BACKENDS = ("hf_generate", "hf_cb")
"""Backends that generate through the policy's HF layers with a KV cache: ``layers`` is refused
for them (:func:`resolve_compile_scope`)."""


def resolve_compile_scope(scope: str | None, backend: str) -> str:
    """``"backbone"`` or ``"layers"`` for a :data:`COMPILE_SCOPES` word and a GRPO backend:
    ``auto`` (``None`` and ``""`` too) is ``layers`` for :data:`LAYER_SCOPE_BACKENDS` and
    ``backbone`` for the others. Why ``layers``: one layer's graph compiles once per grad mode
    instead of the whole backbone's (on the CPU, a 6-layer tiny Qwen3, torch 2.13, forward +
    backward at four lengths: compile about 31 s with a cold inductor cache, 3.9 s warm, against
    117 s for the backbone; the same 3 recompiles; logits equal to eager within 3e-7. On an H100,
    Qwen3-4B: 40 s of compiling in a 10-step flex run, whose first step took 36 s, against 252 s
    for the backbone's first step on the H200 in session 17). ``backend=""`` checks the word only
    (the runner's parameter check).

    Raises:
        ValueError: ``scope`` is not one of :data:`COMPILE_SCOPES`, or ``layers`` with a backend
            of :data:`KV_CACHE_BACKENDS` (its generation would recompile every layer until
            dynamo's recompile limit, after which the layers, training forwards included, run
            eager: seen on the CPU, tiny Qwen3, torch 2.13).
    """
    scope = "auto" if scope in (None, "") else scope
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope={scope!r}: use one of {COMPILE_SCOPES}.")
    if scope == "auto":
        return "layers" if backend in LAYER_SCOPE_BACKENDS else "backbone"
    if scope == "layers" and backend in KV_CACHE_BACKENDS:
        raise ValueError(f"compile_scope='layers' with backend={backend!r}: its generation runs "
                         "the compiled layers with a KV cache indexed by each layer's layer_idx, "
                         "so every layer recompiles until dynamo's limit and then runs eager, "
                         "training included; use compile_scope='auto' or 'backbone' for "
                         f"{backend!r} ('layers' is for {LAYER_SCOPE_BACKENDS}).")
    return scope


def decoder_layers(model: Any) -> Any:
    """The ``nn.ModuleList`` of decoder layers of :func:`backbone` (``.layers``, or ``.h`` for
    GPT-2-style models); ``None`` when it has neither."""
    bb = backbone(model)
    for name in ("layers", "h"):
        layers = getattr(bb, name, None)
        if layers is not None and hasattr(layers, "__len__") and len(layers):
            return layers
    return None


def innermost_lm(model: Any) -> Any:
    """The HF ``PreTrainedModel`` under accelerate / PEFT wrappers (``get_base_model``)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone(model: Any) -> Any:
    """The decoder backbone of :func:`innermost_lm` (``get_decoder()``; the LM itself when it has
    none)."""
    lm = innermost_lm(model)
    get = getattr(lm, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None and dec is not lm else lm


def compile_trainer_models(trainer: Any, mode: str, dynamic: bool | None = None,
                           scope: str = "backbone") -> list[str]:
    """Compile the policy's (and reference model's) decoder backbone in place (module
    docstring); returns what was compiled, e.g. ``["policy"]``. ``dynamic``:
    ``torch.compile``'s dynamic-shape switch (the reference's ``--compile_dynamic``, on there by
    default; ``None`` = torch's default: static first, dynamic after the first recompile).
    ``scope``: ``"backbone"`` (one ``compile`` of the backbone) or ``"layers"`` (each decoder layer
    compiled in place, :data:`COMPILE_SCOPES`; embeddings and the final norm stay eager; a
    model without a layer list, :func:`decoder_layers` ``None``, gets its backbone compiled: a
    caller that reports the scope checks that first, as :func:`nbhelpers.grpo.train` does).

    Raises:
        ValueError: unknown ``mode`` (see :data:`COMPILE_MODES`) or ``scope`` (not
            ``backbone`` / ``layers``: resolve ``auto`` first, :func:`resolve_compile_scope`).
    """
    if scope not in ("backbone", "layers"):
        raise ValueError(f"compile_trainer_models: scope={scope!r}: use 'backbone' or 'layers' "
                         "(resolve 'auto' with resolve_compile_scope(scope, backend)).")
    if check_compile_mode(mode) == "none":
        return []
    done = []
    for name, model in (("policy", trainer.model), ("ref_model", trainer.ref_model)):
        if model is None:
            continue
        layers = decoder_layers(model) if scope == "layers" else None
        for module in [backbone(model)] if layers is None else layers:
            module.compile(mode=mode, dynamic=dynamic)
        done.append(name)
    return done


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append("\n".join(record.getMessage().splitlines()[:3]))


class CompileWatch:
    """Counts graph breaks and recompiles inside a ``with`` block (see module docstring)."""

    def __init__(self, mode: str = "default", max_reasons: int = 10,
                 dynamic: bool | None = None, scope: str | None = None):
        self.mode, self.max_reasons = check_compile_mode(mode), max_reasons
        self.dynamic, self.scope = dynamic, scope
        self._handler = _Collect()
        self._before: dict[str, Counter] = {}
        self._after: dict[str, Counter] = {}
        self._seconds: list[float | None] = [None, None]  # compile_seconds() at enter, at exit
        self._entered = False

    def __enter__(self) -> Self:
        import torch
        import torch._dynamo.utils as dyn
        self._before = {k: Counter(v) for k, v in dyn.counters.items()}
        self._seconds, self._entered = [compile_seconds(), None], True
        torch._logging.set_logs(recompiles=True)
        logger = logging.getLogger(_RECOMPILE_LOGGER)
        logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch
        import torch._dynamo.utils as dyn
        self._after = {k: Counter(v) for k, v in dyn.counters.items()}
        self._seconds[1] = compile_seconds()
        logging.getLogger(_RECOMPILE_LOGGER).removeHandler(self._handler)
        torch._logging.set_logs(recompiles=False)

    def _delta(self, group: str, after: dict[str, Counter]) -> Counter:
        after_g, before = after.get(group, Counter()), self._before.get(group, Counter())
        return Counter({k: after_g[k] - before.get(k, 0) for k in after_g
                        if after_g[k] - before.get(k, 0) > 0})

    def report(self) -> dict[str, Any]:
        """``{compile_mode, compile_dynamic, compile_scope, graph_breaks, graph_break_reasons,
        recompiles, recompile_reasons, unique_graphs, frames_total, frames_ok, compile_s}`` for
        the watched block (counts, ints; ``compile_s`` seconds or ``None``, module docstring)."""
        return self._counts(self._after, self._seconds[1])

    def snapshot(self) -> dict[str, Any]:
        """:meth:`report`'s keys for the block so far, read live from dynamo's counters while
        the ``with`` block runs (cheap: no device sync, a dict copy and a sum).

        Raises:
            RuntimeError: the ``with`` block was never entered.
        """
        if not self._entered:
            raise RuntimeError("CompileWatch.snapshot: enter the `with` block first.")
        import torch._dynamo.utils as dyn
        return self._counts(dyn.counters, compile_seconds())

    def _counts(self, after: Any, seconds: float | None) -> dict[str, Any]:
        breaks, stats, frames = (self._delta(g, after) for g in ("graph_break", "stats", "frames"))
        reasons = Counter(self._handler.messages)
        before = self._seconds[0]
        spent = None if seconds is None or before is None else round(seconds - before, 3)
        if spent == 0.0 and frames.get("total", 0):
            spent = None  # frames compiled but no time recorded: this torch names it otherwise
        return {"compile_mode": self.mode, "compile_dynamic": self.dynamic,
                "compile_scope": self.scope, "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": dict(breaks.most_common(self.max_reasons)),
                "recompiles": len(self._handler.messages),
                "recompile_reasons": dict(reasons.most_common(self.max_reasons)),
                "unique_graphs": stats.get("unique_graphs", 0),
                "frames_total": frames.get("total", 0), "frames_ok": frames.get("ok", 0),
                "compile_s": spent}
