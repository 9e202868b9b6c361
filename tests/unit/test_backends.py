"""nbhelpers.backends: registry, sampling translation, hf_generate == hf_cb == cb_sync (greedy),
engines that are not installed, vLLM translation without vLLM, CB sizing.

Tiny model: ``tiny-qwen3`` in float32 (fetched once by the fixture). Run:
``pytest tests/unit/test_backends.py -q`` (~1 min on 2 cores).
"""

from __future__ import annotations

import importlib.util
import queue
from types import SimpleNamespace

import pytest
import torch

from nbhelpers import models
from nbhelpers.backends import BACKENDS, BackendNotInstalled, _common, get_backend, resolve
from nbhelpers.backends.cb_sync import is_finished
from nbhelpers.backends.hf_cb import cb_sizing
from nbhelpers.backends.vllm import completions_from_vllm, llm_kwargs, vllm_sampling_kwargs
from nbhelpers.config import LoraSpec, ModelSpec, SamplingParams

SPEC = ModelSpec("tiny-qwen3", kind="random", dtype="float32")
LORA = LoraSpec(rank=4, alpha=8)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=[None, LORA], ids=["base", "lora"])
def loaded(request, tmp_path_factory):
    models.fetch_assets("tiny-qwen3")
    backends = {}
    for name in ("hf_generate", "hf_cb", "cb_sync"):
        b = get_backend(name)
        b.load(SPEC, request.param, device="cpu")
        backends[name] = b
    yield backends
    for b in backends.values():
        b.close()


def test_registry_names_variants_and_unknown():
    for name in ("hf_generate", "hf_cb", "cb_sync", "unsloth", "vllm", "flex", "hf_cb_nograph"):
        assert name in BACKENDS
    assert resolve("hf_cb_nograph") == ("hf_cb", {"use_cuda_graph": False})
    b = get_backend("hf_cb_nograph")
    assert b.name == "hf_cb_nograph" and b.default_options == {"use_cuda_graph": False}
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        get_backend("nope")


def test_greedy_tokens_identical_across_hf_backends(loaded):
    outs = {n: b.generate(PROMPTS, GREEDY) for n, b in loaded.items()}
    ref = [c.token_ids for c in outs["hf_generate"]]
    assert all(len(t) == GREEDY.max_new_tokens for t in ref)
    for name in ("hf_cb", "cb_sync"):
        assert [c.token_ids for c in outs[name]] == ref, name
        assert [c.prompt_ids for c in outs[name]] == PROMPTS
        assert {c.finish_reason for c in outs[name]} == {"length"}


def test_seeded_sampling_with_n_is_prompt_major_and_reproducible(loaded):
    sp = SamplingParams(temperature=1.0, min_p=0.1, seed=7, n=2, max_new_tokens=4,
                        ignore_eos=True)
    for name, b in loaded.items():
        first, again = b.generate(PROMPTS, sp), b.generate(PROMPTS, sp)
        assert [c.prompt_ids for c in first] == [p for p in PROMPTS for _ in range(2)], name
        assert [c.token_ids for c in first] == [c.token_ids for c in again], name
    # continuous batching with and without the background thread sample the same tokens
    cb, sync = loaded["hf_cb"].generate(PROMPTS, sp), loaded["cb_sync"].generate(PROMPTS, sp)
    assert [c.token_ids for c in cb] == [c.token_ids for c in sync]


def test_lora_changes_greedy_tokens():
    models.fetch_assets("tiny-qwen3")
    base = get_backend("hf_cb")
    base.load(SPEC, None, device="cpu")
    lora = get_backend("hf_cb")
    lora.load(SPEC, LORA, device="cpu")
    a, b = base.generate(PROMPTS, GREEDY), lora.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in a] != [c.token_ids for c in b]
    base.close()
    lora.close()


def test_generation_kwargs_translate_vllm_meanings():
    kw = _common.generation_kwargs(SamplingParams(top_k=-1, min_p=0.1), eos=[2], pad_id=2)
    assert kw["top_k"] is None and kw["min_p"] == 0.1 and kw["do_sample"] and kw["top_p"] is None
    assert kw["eos_token_id"] == [2]
    greedy = _common.generation_kwargs(SamplingParams(temperature=0, top_k=5), eos=[2], pad_id=2)
    assert not greedy["do_sample"] and greedy["top_k"] is None
    assert _common.generation_kwargs(SamplingParams(ignore_eos=True), [2], 2)["eos_token_id"] == -1
    stop_only = SamplingParams(ignore_eos=True, stop_token_ids=(7,))
    assert _common.generation_kwargs(stop_only, [2], 2)["eos_token_id"] == [7]
    done = _common.trim_completion([1], [5, 2, 7, 9], stop_only, eos=[2])
    assert done.token_ids == [5, 2, 7] and done.finish_reason == "stop"
    model, _ = models.load_model("tiny-qwen3", dtype="float32")
    procs = model._get_logits_processor(_common.generation_config(
        SamplingParams(top_k=-1, min_p=0.1, temperature=0.7), [2], 2))
    names = {type(p).__name__ for p in procs}
    assert "MinPLogitsWarper" in names and "TemperatureLogitsWarper" in names
    assert "TopKLogitsWarper" not in names


def test_prompt_and_sampling_validation(loaded):
    b = loaded["hf_cb"]
    for bad in ([], [[]], [[1, -2]], [["a"]]):
        with pytest.raises(ValueError, match="prompts"):
            b.generate(bad, GREEDY)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_hf_cb_option_errors():
    b = get_backend("hf_cb")
    with pytest.raises(ValueError, match="unknown engine options"):
        b.load(SPEC, None, device="cpu", max_tokens=3)
    with pytest.raises(ValueError, match="attn_implementation"):
        b.load(SPEC, None, device="cpu", attn_implementation="sdpa")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cuda_graph=True needs a CUDA device"):
            b.load(SPEC, None, device="cpu", use_cuda_graph=True)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="FA4 installed")
def test_fa4_attention_without_fa4_names_the_extra():
    with pytest.raises(BackendNotInstalled, match=r"\.\[fa4\]"):
        get_backend("hf_cb_fa4").load(SPEC, None, device="cpu",
                                      attn_implementation="paged|flash_attention_4")


@pytest.mark.parametrize("name,extra", [("vllm", "vllm"), ("unsloth", "unsloth")])
def test_missing_engine_names_its_extra(name, extra):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(BackendNotInstalled, match=rf"pip install -e '\.\[{extra}\]'"):
        get_backend(name).load(SPEC, None)


def test_cb_sizing_reproduces_workload_w_settings():
    lens = [132, 169] + [151] * 26 + [152] * 4  # 32 prompts, sum 4835 (W: mean 151.1)
    assert sum(lens) == 4835
    s = cb_sizing(lens, 512)
    assert (s.num_blocks, s.max_batch_tokens, s.max_requests_per_batch) == (120, 4864, 32)
    with pytest.raises(ValueError):
        cb_sizing([], 512)


def test_cb_sync_is_not_finished_while_requests_wait_in_the_queue():
    q: queue.Queue = queue.Queue()
    idle = SimpleNamespace(has_pending_requests=lambda: False)
    q.put("request")  # the reference driver's start-up exit: queue full, scheduler empty
    assert not is_finished(q, idle, scheduled=False)
    q.get()
    assert is_finished(q, idle, scheduled=False)
    assert not is_finished(q, idle, scheduled=True)


def test_vllm_translation_without_vllm():
    kw = vllm_sampling_kwargs(SamplingParams(top_k=-1, min_p=0.1, seed=3, n=4,
                                             max_new_tokens=512, ignore_eos=True))
    assert kw == {"n": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.1, "seed": 3,
                  "max_tokens": 512, "ignore_eos": True, "stop_token_ids": []}
    assert vllm_sampling_kwargs(SamplingParams(top_k=20), logprobs=True)["logprobs"] == 0
    llm = llm_kwargs("/m", ModelSpec("qwen3-4b", kind="random"), LoraSpec(rank=32),
                     {"gpu_memory_utilization": 0.3, "adapter_path": "/a"})
    assert llm["load_format"] == "dummy" and llm["enable_lora"] and llm["max_lora_rank"] == 32
    assert llm["gpu_memory_utilization"] == 0.3 and "adapter_path" not in llm
    assert llm["max_model_len"] == 1024 and llm["max_num_seqs"] == 32
    with pytest.raises(ValueError, match="max_lora_rank"):
        llm_kwargs("/m", SPEC, LoraSpec(rank=64), {"max_lora_rank": 32})


def test_completions_from_vllm_outputs():
    lp = [{7: SimpleNamespace(logprob=-0.5)}, {2: SimpleNamespace(logprob=-1.0)}]
    sample = SimpleNamespace(token_ids=[7, 2], logprobs=lp, finish_reason="stop")
    other = SimpleNamespace(token_ids=[9, 9, 9], logprobs=None, finish_reason="length")
    outs = completions_from_vllm([[1, 2]], [SimpleNamespace(outputs=[sample, other])])
    assert outs[0].logprobs == [-0.5, -1.0] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == [9, 9, 9] and outs[1].finish_reason == "length"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_the_same_greedy_tokens():
    spec = ModelSpec("tiny-qwen3", kind="random", dtype="bfloat16")
    outs = []
    for name in ("hf_cb", "hf_cb_nograph", "cb_sync"):
        b = get_backend(name)
        b.load(spec, None, **b.default_options)
        outs.append([c.token_ids for c in b.generate(PROMPTS, GREEDY)])
        b.close()
    assert outs[0] == outs[1] == outs[2]


def _fa4_ready() -> bool:
    from nbhelpers.shims import flash_attn4
    return torch.cuda.is_available() and flash_attn4.fa4_installed()


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_ready(), reason="needs a CUDA GPU and flash-attn-4 (the fa4 bundle "
                    "staged on the H200: scripts/device/step_table.py f4a/f4c)")
def test_gpu_hf_cb_fa4_generates_what_sdpa_does():
    """hf_cb with paged|flash_attention_4 (through nbhelpers.shims.flash_attn4's fix of
    transformers 5.17's positional varlen call) completes every request with the greedy
    tokens of paged|sdpa on a tiny bf16 Qwen3 (the H200 run of 2026-12-03 failed every request
    before the fix)."""
    spec = ModelSpec("tiny-qwen3", kind="random", dtype="bfloat16")
    outs = {}
    for attn in ("paged|sdpa", "paged|flash_attention_4"):
        b = get_backend("hf_cb")
        b.load(spec, None, **{**b.default_options, "attn_implementation": attn})
        outs[attn] = [c.token_ids for c in b.generate(PROMPTS, GREEDY)]
        b.close()
    assert all(len(t) == GREEDY.max_new_tokens for t in outs["paged|flash_attention_4"])
    # bf16 kernels may round differently: the first tokens must agree, and most of the rest
    fa4, sdpa = outs["paged|flash_attention_4"], outs["paged|sdpa"]
    assert [t[:3] for t in fa4] == [t[:3] for t in sdpa], outs
    same = sum(a == b for x, y in zip(fa4, sdpa) for a, b in zip(x, y))
    assert same >= 0.8 * sum(map(len, sdpa)), outs


def test_hf_cb_reuses_its_manager_until_sampling_changes(loaded):
    b = loaded["hf_cb"]
    b.generate(PROMPTS, GREEDY)
    manager = b.model._cached_continuous_batching_manager
    b.generate(PROMPTS, GREEDY)
    assert b.model._cached_continuous_batching_manager is manager  # persistent, not rebuilt
    b.generate(PROMPTS, SamplingParams(temperature=0.5, max_new_tokens=3, ignore_eos=True))
    assert b.model._cached_continuous_batching_manager is not manager  # new logits processors


def _engine_ready(module: str) -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec(module) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vllm", "unsloth"])
def test_gpu_engines_generate_every_token_with_lora(name):
    if not _engine_ready(name):
        pytest.skip(f"needs a CUDA GPU and {name} installed")
    spec = models.get_spec("smollm2-135m-instruct")  # real weights: Unsloth needs a folder
    opts = {"gpu_memory_utilization": 0.2, "max_model_len": 256} if name == "vllm" else {}
    b = get_backend(name)
    b.load(spec, LoraSpec(rank=8, alpha=16), **opts)
    outs = b.generate(PROMPTS, GREEDY)
    b.close()
    assert [len(c.token_ids) for c in outs] == [GREEDY.max_new_tokens] * len(PROMPTS)


def test_fa4_nograph_variant_needs_cuda():
    from nbhelpers.run.host_checks import needs_cuda
    assert resolve("hf_cb_fa4_nograph") == ("hf_cb", {
        "attn_implementation": "paged|flash_attention_4", "use_cuda_graph": False})
    assert needs_cuda("hf_cb_fa4_nograph") and needs_cuda("hf_cb_fa4")
    assert not needs_cuda("hf_cb_nograph")


@pytest.mark.parametrize("value,expected", [
    (True, True), (False, False), ([False, True], (False, True)), ((True, False), (True, False))])
def test_cuda_graph_setting_accepts_a_bool_or_a_varlen_decode_pair(value, expected):
    from nbhelpers.backends.hf_cb import cuda_graph_setting
    assert cuda_graph_setting(value) == expected


@pytest.mark.parametrize("value", ["yes", 1, [True], [True, False, True], [1, 0], None])
def test_a_bad_use_cuda_graph_is_refused_before_the_model_loads(value, monkeypatch):
    def no_load(*_a, **_k):
        raise AssertionError("the model loaded before the option was checked")

    monkeypatch.setattr(_common, "load_hf", no_load)
    with pytest.raises(ValueError, match=r"use_cuda_graph=.*\[varlen, decode\] pair"):
        get_backend("hf_cb").load(SPEC, None, device="cpu", use_cuda_graph=value)


def test_the_pair_reaches_transformers_config_and_the_sidecar_info():
    models.fetch_assets("tiny-qwen3")
    b = get_backend("hf_cb")
    try:
        b.load(SPEC, None, device="cpu", use_cuda_graph=[False, False])
        b.size_for_workload(PROMPTS, GREEDY)
        assert b.cb_config(GREEDY).use_cuda_graph == (False, False)
        assert b.info["use_cuda_graph"] == [False, False]
        out = b.generate(PROMPTS, GREEDY)
        assert [len(c.token_ids) for c in out] == [GREEDY.max_new_tokens] * len(PROMPTS)
        assert b.info["use_cuda_graph"] == [False, False]
    finally:
        b.close()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cuda_graph=True needs a CUDA device"):
            get_backend("hf_cb").load(SPEC, None, device="cpu", use_cuda_graph=[False, True])


def test_graphs_on_the_cpu_are_refused_before_the_model_loads(monkeypatch):
    """``device='cpu'`` with any CUDA graph path on: refused naming the value given, before
    ``load_hf`` (helper-16's trial: the model loaded first and stayed on the failed backend)."""
    def no_load(*_a, **_k):
        raise AssertionError("the model loaded before the option was checked")

    monkeypatch.setattr(_common, "load_hf", no_load)
    for value in (True, [False, True], (True, False)):
        b = get_backend("hf_cb")
        with pytest.raises(ValueError, match=r"use_cuda_graph=.* needs a CUDA device"):
            b.load(SPEC, None, device="cpu", use_cuda_graph=value)
        assert b.model is None
    with pytest.raises(ValueError, match=r"'watchdgo_s': did you mean 'watchdog_s'"):
        get_backend("cb_sync").load(SPEC, None, device="cpu", watchdgo_s=3)
