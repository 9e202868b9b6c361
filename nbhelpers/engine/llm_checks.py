"""The argument checks of :class:`nbhelpers.engine.llm.LLM`: each refuses bad input before any
engine state is built, with a message that names the fix.

Contract: :func:`normalize_prompts` reads ``generate``'s prompts (:func:`check_generate_kwargs`
its other keywords); the others check constructor arguments (:func:`check_causal_lm` the model,
:func:`check_options` names, :func:`check_limits` scheduler limits,
:func:`check_cuda_graphs`, :func:`check_flag` booleans, :func:`eos_ids` the stop ids,
:func:`fit_max_model_len` the context length against the model's). Pure functions over plain
values and the HF config; imports only the engine's own modules and :mod:`nbhelpers.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Mapping
from typing import Any

from nbhelpers.config import token_ids
from nbhelpers.engine.model_runner import BUCKETS, RunnerOptions
from nbhelpers.engine.runner_option_hints import kernel_option_hint
from nbhelpers.engine.runner_options import option_names

LLM_ARGS = ("eos_token_id", "max_num_seqs", "max_prefill_tokens", "share_prefix",
            "allow_long_max_model_len")
"""``LLM``'s own keyword arguments (the rest are :class:`RunnerOptions` fields)."""


def check_causal_lm(model: Any) -> None:
    """Raise ``TypeError`` unless ``model`` (or the model under its PEFT wrapper) is a loaded HF
    causal LM: parameters, a config and an LM head (``lm_head``), so a base ``LlamaModel`` /
    ``Qwen3Model`` (``causal_lm.model``) is refused before the engine reads its layers."""
    if not hasattr(model, "parameters") or not hasattr(model, "config"):
        raise TypeError(f"LLM(model) takes a loaded HF causal LM, got {type(model).__name__}: "
                        "e.g. nbhelpers.models.load_model(name)[0].")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "lm_head", None) is None:
        raise TypeError(f"LLM(model): {type(base).__name__} has no LM head (lm_head), so it "
                        "cannot give next-token logits: pass the *ForCausalLM model (e.g. "
                        "transformers.AutoModelForCausalLM.from_pretrained(...) or "
                        "nbhelpers.models.load_model(name)[0]), not its .model.")


PROMPT_KEYS = ("prompt_token_ids",)
"""The keys a dict prompt may have: vLLM's ``TokensPrompt`` form (``{"prompt_token_ids": ids}``,
vllm/inputs/data.py); no multi-modal data, no text (``TextPrompt``'s ``prompt``)."""


def _dict_prompt(i: int, row: Any) -> Any:
    """The ids of vLLM's ``TokensPrompt`` ``{"prompt_token_ids": ids}``; ``TypeError`` naming
    the fix for text (``{"prompt": ...}``) or any other key."""
    if "prompt" in row and "prompt_token_ids" not in row:
        raise TypeError(f"prompt {i} is a vLLM TextPrompt ({{'prompt': text}}): the flex engine "
                        "takes token ids: pass {'prompt_token_ids': tokenizer(text).input_ids} "
                        "or the id list itself.")
    if other := sorted(str(k) for k in row if k not in PROMPT_KEYS):
        raise TypeError(f"prompt {i}: dict prompts take only {list(PROMPT_KEYS)} (vLLM's "
                        f"TokensPrompt), got the key(s) {other}: drop them, or pass the id "
                        "list itself.")
    if "prompt_token_ids" not in row:
        raise TypeError(f"prompt {i} is an empty dict: pass {{'prompt_token_ids': ids}}.")
    return row["prompt_token_ids"]


def normalize_prompts(prompts: Any) -> list[list[int]]:
    """``prompts`` as a list of token-id lists: any iterable of sequences of ints (a generator is
    read once; 1-D tensors/arrays become lists), each also as vLLM's ``TokensPrompt``
    ``{"prompt_token_ids": ids}`` (:data:`PROMPT_KEYS`).

    Raises:
        TypeError: a string, a flat list of ints, ids that are not ints, a tokenizer's
            ``BatchEncoding`` (or any mapping) instead of its ``input_ids``, or a dict prompt
            with text or other keys (the message says what to pass instead).
    """
    if isinstance(prompts, (str, bytes)):
        raise TypeError("LLM.generate takes token ids, not text: pass "
                        "[tokenizer(text).input_ids, ...].")
    if isinstance(prompts, Mapping) and "prompt_token_ids" in prompts:
        raise TypeError("LLM.generate(prompts) got one TokensPrompt dict: wrap it in a list, "
                        "[{'prompt_token_ids': ids}].")
    if isinstance(prompts, Mapping):  # BatchEncoding is a UserDict: list() would give its keys
        what = ("a tokenizer BatchEncoding" if "input_ids" in prompts
                else f"a {type(prompts).__name__} with keys {sorted(map(str, prompts))[:4]}")
        raise TypeError(f"LLM.generate(prompts) got {what}: pass its .input_ids as a list of "
                        "lists, e.g. tokenizer(texts).input_ids (no padding and no "
                        "return_tensors: pad ids would become prompt tokens).")
    try:
        rows = list(prompts)
    except TypeError as exc:
        raise TypeError(f"LLM.generate(prompts): a list of token-id lists is expected, got "
                        f"{type(prompts).__name__}.") from exc
    out = []
    for i, row in enumerate(rows):
        if isinstance(row, (int, float)) and not isinstance(row, bool):
            raise TypeError("LLM.generate(prompts) got a flat list of ids: wrap one prompt as "
                            "[prompt_ids].")
        if isinstance(row, Mapping):
            row = _dict_prompt(i, row)
        if isinstance(row, (str, bytes)):
            raise TypeError(f"prompt {i} is text: pass tokenizer(text).input_ids.")
        row = row.tolist() if hasattr(row, "tolist") else list(row)
        bad = next((t for t in row if isinstance(t, bool)
                    or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise TypeError(f"prompt {i}: token ids must be ints, got {type(bad).__name__} "
                            f"{bad!r}.")
        out.append([int(t) for t in row])
    return out


def check_options(options: dict[str, Any]) -> None:
    """Raise ``TypeError`` for an ``LLM(**options)`` name that is no RunnerOptions field (the
    message names the closest fields, up to two, those containing the typed name or contained
    in it first, and lists them all)."""
    known = option_names()
    if unknown := sorted(set(options) - known):
        hints = [kernel_option_hint(u) or (c and f"{u!r}: did you mean "
                                           f"{' or '.join(map(repr, c))}?")
                 for u in unknown for c in [_close(u, known | set(LLM_ARGS))]]
        hint = "; ".join(h for h in hints if h)
        raise TypeError(f"LLM: unknown option(s) {unknown}{' (' + hint + ')' if hint else ''}"
                        f". Options: {', '.join(LLM_ARGS)} and the RunnerOptions fields "
                        f"{sorted(known)}.")


def _close(name: str, names: set[str]) -> list[str]:
    """Up to two suggestions for a mistyped option ``name``: fields that contain it or that it
    contains (``pdl_prefetch`` -> ``pdl_prefetch_mib``), then difflib's closest."""
    longer = sorted(n for n in names if len(name) >= 3 and name in n)
    inside = longer + sorted(n for n in names if len(n) >= 3 and n in name and n not in longer)
    fuzzy = difflib.get_close_matches(name, sorted(names), n=2)
    return list(dict.fromkeys(inside + fuzzy))[:2]


def check_limits(max_num_seqs: Any, max_prefill_tokens: Any) -> None:
    """Raise ``ValueError`` unless ``max_num_seqs`` is an int in ``[1, BUCKETS[-1]]`` (sequences
    decoding at once; the largest decode batch bucket is 512) and ``max_prefill_tokens`` an
    int >= 1 (tokens per prefill step; a longer prompt still prefills alone)."""
    for name, value, high, what in (
            ("max_num_seqs", max_num_seqs, BUCKETS[-1],
             f"sequences decoding at once; {BUCKETS[-1]} is the largest decode batch"),
            ("max_prefill_tokens", max_prefill_tokens, None, "prompt tokens per prefill step")):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
        if not ok or (high is not None and value > high):
            span = f"in [1, {high}]" if high is not None else ">= 1"
            raise ValueError(f"LLM({name}={value!r}): pass an int {span} ({what}).")


def check_flag(name: str, value: Any, meaning: str) -> None:
    """Raise ``TypeError`` unless ``value`` is a ``bool`` (a string such as ``'no'`` is truthy,
    so it would silently mean True)."""
    if not isinstance(value, bool):
        raise TypeError(f"LLM({name}={value!r}): pass True or False ({meaning}); got "
                        f"{type(value).__name__}, and any non-empty string counts as True.")


def check_cuda_graphs(model: Any, use_cuda_graphs: Any) -> None:
    """Raise ``ValueError`` for ``use_cuda_graphs=True`` when ``model``'s parameters are not on a
    CUDA device (graphs cannot be captured there; ``None`` already means on iff CUDA)."""
    if use_cuda_graphs is not True:
        return
    param = next(iter(model.parameters()), None)
    if param is None or not param.is_cuda:
        where = "no parameters" if param is None else f"parameters on {param.device}"
        raise ValueError(f"LLM(use_cuda_graphs=True): CUDA graphs need the model on a CUDA "
                         f"device, this one has {where}: leave use_cuda_graphs=None (on iff "
                         "CUDA) or pass use_cuda_graphs=False on the CPU, or move the model to "
                         "CUDA first (model.to('cuda')).")


def eos_ids(config: Any, eos_token_id: Any) -> frozenset[int]:
    """The ids that end a sequence: ``eos_token_id`` (an int or a sequence of ints), else
    ``config.eos_token_id`` (``None``: none); each in ``[0, vocab_size)`` of the (text) config,
    as prompt ids are (an id outside could never be sampled, so the sequence would never stop).

    Raises:
        nbhelpers.token_ids.TokenIdsError: (a ``TypeError``) text, floats or a mapping, naming
            the fix.
        ValueError: an id < 0 or >= ``vocab_size`` (names the range and where the id came from).
    """
    owner = "model.config.eos_token_id" if eos_token_id is None else "LLM: eos_token_id"
    given = getattr(config, "eos_token_id", None) if eos_token_id is None else eos_token_id
    ids = frozenset(token_ids(owner, given, allow_single=True))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, numbers.Integral) and (bad := sorted(t for t in ids
                                                               if not 0 <= t < vocab)):
        fix = ("pass LLM(model, eos_token_id=tokenizer.eos_token_id)" if eos_token_id is None
               else "pass the tokenizer's id, e.g. eos_token_id=tokenizer.eos_token_id")
        raise ValueError(f"{owner}={given!r}: {bad} outside the vocabulary [0, vocab_size="
                         f"{vocab}), so it could never be sampled and never end a sequence: "
                         f"{fix}.")
    return ids


def model_context_len(config: Any) -> int | None:
    """The model's context in tokens: ``max_position_embeddings`` of its (text) config, or
    ``None`` when the config has none (then nothing is checked)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


DEFAULT_MAX_MODEL_LEN = next(f.default for f in dataclasses.fields(RunnerOptions)
                             if f.name == "max_model_len")


def fit_max_model_len(config: Any, options: dict[str, Any], allow_long: Any) -> dict[str, Any]:
    """``options`` with ``max_model_len`` fitted to the model's context (vLLM's rule,
    ``_get_and_verify_max_len`` in vllm/config: the default is the smaller of the engine's
    default, 2048, and the model's context; a larger value given on purpose is refused unless
    overridden, as ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` does there).

    Raises:
        TypeError: ``allow_long`` (``allow_long_max_model_len``) not a bool.
        ValueError: an explicit ``max_model_len`` above ``config.max_position_embeddings``
            without ``allow_long_max_model_len=True``; names both numbers and the fix.
    """
    check_flag("allow_long_max_model_len", allow_long,
               "True lets max_model_len exceed config.max_position_embeddings")
    context = model_context_len(config)
    if context is None:
        return options
    if "max_model_len" not in options:
        return {**options, "max_model_len": min(DEFAULT_MAX_MODEL_LEN, context)}
    value = options["max_model_len"]
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_int and value > context and not allow_long:  # a non-int: RunnerOptions names the fix
        raise ValueError(f"LLM(max_model_len={value}): the model's context is {context} tokens "
                         f"(config.max_position_embeddings={context}); positions past it were "
                         f"never trained. Lower max_model_len to <= {context} (prompt + "
                         "max_new_tokens), or pass allow_long_max_model_len=True to use "
                         f"{value} anyway (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1).")
    return options


_GENERATE_ONLY = {
    "use_tqdm": "the flex engine shows no progress bar: leave it out",
    "lora_request": "the engine runs the PEFT model's live LoRA (nbhelpers.engine.lora): load the "
                    "adapter into the model, leave lora_request out",
}


def check_generate_kwargs(kwargs: dict[str, Any], owner: str = "LLM") -> None:
    """Raise ``TypeError`` naming the fix for a keyword ``<owner>.generate`` does not take (the
    flex ``LLM`` and every rollout backend of ``nbhelpers.backends``):
    ``max_tokens`` and the other sampling names (``SamplingParams`` fields, or the vLLM names
    of :data:`nbhelpers.config_types.UNSUPPORTED_SAMPLING_ARGS`) belong in the
    ``SamplingParams``; vLLM's ``use_tqdm`` / ``lora_request`` are not supported."""
    from nbhelpers.config import UNSUPPORTED_SAMPLING_ARGS, SamplingParams
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    for name in kwargs:
        if name == "max_tokens":
            fix = ("the length limit is a sampling setting: pass "
                   "SamplingParams(max_new_tokens=...) (vLLM's max_tokens)")
        elif name in fields:
            fix = f"sampling settings go in the SamplingParams: SamplingParams({name}=...)"
        elif name in UNSUPPORTED_SAMPLING_ARGS:
            fix = UNSUPPORTED_SAMPLING_ARGS[name]
        elif name in _GENERATE_ONLY:
            fix = _GENERATE_ONLY[name]
        else:
            fix = ("unexpected keyword argument: generate takes prompts, sampling (or "
                   "sampling_params=)")
        raise TypeError(f"{owner}.generate({name}=...): {fix}.")
