"""Bad input to the public API found by a fresh-user trial, second round: each is refused before
any engine state is built, with a message that names the fix (CPU; tiny random models from
``tests/engine/_tiny.py``).

Covers ``LLM(max_model_len=N)`` above the model's context (and its override), text where token
ids are due (``LLM(eos_token_id=...)``, ``SamplingParams(stop_token_ids=...)``,
``SamplingParams(eos_token_id=...)``), ``share_prefix`` that is not a bool, the
``sampling_params=`` alias on every rollout backend, and ``LLM.last_stats``' per-call vs
cumulative keys.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from _tiny import tiny_model

from nbhelpers.config import SamplingParams
from nbhelpers.token_ids import TokenIdsError

OPTIONS = {"page_size": 16, "num_pages": 24, "max_model_len": 96}
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")  # config.max_position_embeddings = 512


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if the engine model is built (every check must come first)."""
    from nbhelpers.engine import llm
    built = []
    monkeypatch.setattr(llm, "ModelRunner", lambda *a, **k: built.append(a))
    return built


# ------------------------------------------------------------- 1: max_model_len vs the context
def test_max_model_len_above_the_context_names_both_numbers_and_the_fix(model, no_build):
    from nbhelpers.engine import LLM
    with pytest.raises(ValueError) as err:
        LLM(model, page_size=16, num_pages=8, max_model_len=1024)
    msg = str(err.value)
    assert "max_model_len=1024" in msg and "max_position_embeddings=512" in msg
    assert "Lower max_model_len to <= 512" in msg and "allow_long_max_model_len=True" in msg
    assert not no_build


def test_the_override_and_the_default_of_max_model_len(model):
    from nbhelpers.engine import LLM
    long = LLM(model, page_size=16, num_pages=8, max_model_len=1024,
               allow_long_max_model_len=True)
    assert long.opt.max_model_len == 1024
    assert LLM(model, page_size=16, num_pages=8).opt.max_model_len == 512  # min(2048, context)
    assert LLM(model, page_size=16, num_pages=8, max_model_len=512).opt.max_model_len == 512
    with pytest.raises(TypeError, match=r"allow_long_max_model_len='yes'\): pass True or False"):
        LLM(model, page_size=16, num_pages=8, allow_long_max_model_len="yes")


def test_a_config_without_a_context_is_not_checked():
    from nbhelpers.engine.llm_checks import fit_max_model_len, model_context_len
    assert model_context_len(SimpleNamespace()) is None
    assert fit_max_model_len(SimpleNamespace(), {"max_model_len": 10**6}, False) == {
        "max_model_len": 10**6}
    nested = SimpleNamespace(get_text_config=lambda: SimpleNamespace(max_position_embeddings=64))
    assert model_context_len(nested) == 64  # multimodal configs: the text config's context


def test_flex_backend_default_fits_a_short_context():
    from nbhelpers.backends.flex import build_llm
    short = tiny_model("qwen3")
    short.config.max_position_embeddings = 256
    assert build_llm(short, [511], kv_tokens=512).opt.max_model_len == 256  # not 1024


# ------------------------------------------------------------- 2: token ids, never text
@pytest.mark.parametrize("eos", ["x", "</s>", [1.0], {"eos": 2}])
def test_llm_eos_token_id_that_is_not_int_ids_is_a_type_error(model, no_build, eos):
    from nbhelpers.engine import LLM
    with pytest.raises(TypeError, match=r"LLM: eos_token_id=.*pass .*\[tokenizer\.eos_token_id\]"):
        LLM(model, eos_token_id=eos, **OPTIONS)
    assert not no_build


@pytest.mark.parametrize("eos, ids", [(5, {5}), (np.int64(5), {5}), ([5, 6], {5, 6}),
                                      ((7,), {7}), (None, {511})])
def test_llm_eos_token_id_takes_an_int_or_ints(model, eos, ids):
    from nbhelpers.engine import LLM
    assert LLM(model, eos_token_id=eos, **OPTIONS).eos_ids == ids  # None: model.config's


@pytest.mark.parametrize("given", ["ab", ["a"], [1, "</s>"], [2.0]])
def test_stop_token_ids_of_text_are_a_type_error_naming_the_field(given):
    with pytest.raises(TypeError) as err:
        SamplingParams(stop_token_ids=given)
    assert isinstance(err.value, TokenIdsError) and isinstance(err.value, ValueError)  # old catch
    assert "SamplingParams.stop_token_ids=" in str(err.value)
    assert "[tokenizer.eos_token_id]" in str(err.value)


def test_sampling_params_eos_token_id_names_where_eos_belongs():
    with pytest.raises(TypeError, match=r"SamplingParams\(eos_token_id=\.\.\.\): the EOS ids are "
                                        r"the engine's.*LLM\(model, eos_token_id=\[\.\.\.\]\).*"
                                        r"stop_token_ids=\[\.\.\.\]"):
        SamplingParams(eos_token_id="x")


# ------------------------------------------------------------- 3: share_prefix is a bool
@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_share_prefix_must_be_a_bool(model, no_build, value):
    from nbhelpers.engine import LLM
    with pytest.raises(TypeError, match=rf"LLM\(share_prefix={value!r}\): pass True or False"):
        LLM(model, share_prefix=value, **OPTIONS)
    assert not no_build


def test_share_prefix_bools_still_work(model):
    from nbhelpers.engine import LLM
    grpo = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, n=2)
    on = LLM(model, share_prefix=True, **OPTIONS).generate([[1, 2, 3]], grpo)
    off = LLM(model, share_prefix=False, **OPTIONS).generate([[1, 2, 3]], grpo)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


# ------------------------------------------------------------- 5: sampling_params= everywhere
ENGINES = ["hf_generate", "hf_cb", "cb_sync", "unsloth", "vllm", "flex"]


@pytest.mark.parametrize("name", ENGINES)
def test_every_backend_generate_takes_the_vllm_keyword(name):
    from nbhelpers.backends import get_backend
    backend = get_backend(name)
    with pytest.raises(TypeError, match=rf"{name}\.generate\(prompts, sampling\): pass the "
                                        r"SamplingParams once.*sampling_params= also works"):
        backend.generate([[1, 2]], GREEDY, sampling_params=GREEDY)
    with pytest.raises(TypeError, match=r"pass the SamplingParams once"):
        backend.generate([[1, 2]])
    with pytest.raises(TypeError, match=r"takes nbhelpers\.config\.SamplingParams, got dict"):
        backend.generate([[1, 2]], sampling_params={"temperature": 0})
    with pytest.raises(RuntimeError, match=r"before load\(\)"):  # alias accepted, then not loaded
        backend.generate([[1, 2]], sampling_params=GREEDY)


def test_the_alias_gives_the_same_tokens_on_flex_and_hf_generate(model):
    from nbhelpers.backends import get_backend
    from nbhelpers.engine import LLM
    flex, hf = get_backend("flex"), get_backend("hf_generate")
    flex.llm = LLM(model, **OPTIONS)
    hf.model, hf.eos, hf.pad_id = model, [511], 0
    for backend in (flex, hf):
        positional = backend.generate([[1, 2, 3]], GREEDY)[0].token_ids
        assert backend.generate([[1, 2, 3]], sampling_params=GREEDY)[0].token_ids == positional
        assert len(positional) == 3


# ------------------------------------------------------------- 6: last_stats
def test_last_stats_counters_are_per_call_and_totals_cumulative(model):
    from nbhelpers.engine import LLM
    llm = LLM(model, **OPTIONS)
    llm.generate([[1, 2, 3]], GREEDY)
    first = dict(llm.last_stats)
    llm.generate([[1, 2, 3, 4]], GREEDY)
    second = llm.last_stats
    assert first["prefill_tokens"] == 3 and second["prefill_tokens"] == 4  # this call only
    assert second["total_prefill_tokens"] == 7  # since construction
    assert second["decode_steps"] == first["decode_steps"]
    assert second["total_decode_steps"] == 2 * first["decode_steps"]
    assert second["total_decode_s"] >= second["decode_s"] > 0
    llm.reset_timings()
    llm.generate([[1, 2]], GREEDY)
    assert llm.last_stats["prefill_tokens"] == llm.last_stats["total_prefill_tokens"] == 2


@pytest.mark.parametrize("backend_name", ["hf_generate", "hf_cb", "vllm", "flex"])
def test_every_backend_generate_names_the_fix_for_vllm_keywords(backend_name):
    """``backend.generate(prompts, max_tokens=8)`` (vLLM's call) is a TypeError naming
    ``SamplingParams(max_new_tokens=...)``, raised before any engine work (checked on the class:
    no model needs to load)."""
    import importlib
    mod = importlib.import_module(f"nbhelpers.backends.{backend_name}")
    cls = next(v for v in vars(mod).values() if isinstance(v, type)
               and getattr(v, "name", None) == backend_name and hasattr(v, "generate"))
    fake = object.__new__(cls)
    with pytest.raises(TypeError, match=r"max_new_tokens"):
        cls.generate(fake, [[1, 2]], max_tokens=8)
    with pytest.raises(TypeError, match=r"not implemented|penalt"):
        cls.generate(fake, [[1, 2]], presence_penalty=0.5)
