"""A failed CUDA-graph capture falls back to eager decode, for every registered architecture.

The capture is made to raise (``model_runner.capture_graph`` monkeypatched), with the compiled
elementwise pieces on (``compile_layers=True``: the first fallback swaps in ``model.fx_eager``,
the second decodes without a graph); the tokens and logprobs must equal the plain eager engine's.
Tiny random configs (``_tiny.tiny_model``, ``test_gemma4.tiny_gemma4``), CPU.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import random_prompts, tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.engine import LLM, model_runner
from nbhelpers.engine import llm as llm_module
from nbhelpers.engine.models import list_architectures

SAMPLED = SamplingParams(temperature=1.0, min_p=0.05, top_k=20, max_new_tokens=6,
                         ignore_eos=True, seed=7, n=2)
OPTIONS = {"page_size": 16, "num_pages": 24, "max_model_len": 96}


def _model(arch: str):
    if arch == "Gemma4ForCausalLM":
        from test_gemma4 import tiny_gemma4
        return tiny_gemma4()
    return tiny_model({"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}[arch])


@pytest.mark.parametrize("arch", list_architectures())
def test_failed_capture_decodes_eagerly_with_the_same_tokens(monkeypatch, arch):
    model = _model(arch)
    vocab = model.config.vocab_size
    prompts = random_prompts(2, 5, 12, seed=4, vocab=vocab)
    eager = LLM(model, use_cuda_graphs=False, compile_layers=False, decode_attention="flex",
                **OPTIONS)  # the kernel auto picks with graphs on (CPU eager default: sdpa)
    want = eager.generate(prompts, SAMPLED)
    calls = []

    def fail(*args):
        calls.append(args)
        raise RuntimeError("simulated capture failure")
    monkeypatch.setattr(model_runner, "capture_graph", fail)
    # the capture is simulated, so LLM's CUDA-device check of use_cuda_graphs=True is lifted
    monkeypatch.setattr(llm_module, "check_cuda_graphs", lambda *args: None)
    graphs = LLM(model, use_cuda_graphs=True, compile_layers=True, **OPTIONS)
    assert graphs.runner.model.fx_decode.compiled  # the compiled pieces are in use ...
    with pytest.warns(UserWarning) as record:
        got = graphs.generate(prompts, SAMPLED)
    texts = [str(w.message) for w in record]
    assert any("using the eager pieces" in t for t in texts), texts
    assert any("decoding eagerly" in t for t in texts), texts
    runner = graphs.runner
    assert runner.model.fx_decode is runner.model.fx_eager  # ... until the first fallback
    assert len(calls) == 2 and runner.timings["graph_captures"] == 0
    assert all(st.graph is None for st in runner.states.values())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    torch.testing.assert_close([o.logprobs for o in got], [o.logprobs for o in want])
    graphs.generate(prompts, SAMPLED)
    assert len(calls) == 2  # same weights: the failed bucket is not captured again
