"""Shim trl_guided_decoding on both paths: vLLM without the old name (patched), vLLM that still
has it or no vLLM at all (untouched). vLLM is faked in ``sys.modules``. Run:
``pytest tests/unit/test_shims_trl_guided_decoding.py -q``.
"""

from __future__ import annotations

import sys
import types

from nbhelpers.shims import trl_guided_decoding as shim


class StructuredOutputsParams:
    def __init__(self, regex=None, json=None):
        self.regex, self.json = regex, json


def _fake_vllm(monkeypatch, **attrs) -> types.ModuleType:
    vllm = types.ModuleType("vllm")
    sp = types.ModuleType("vllm.sampling_params")
    for k, v in attrs.items():
        setattr(sp, k, v)
    vllm.sampling_params = sp
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    return sp


def test_new_vllm_gets_the_alias(monkeypatch):
    sp = _fake_vllm(monkeypatch, StructuredOutputsParams=StructuredOutputsParams)
    assert shim.needed() and shim.apply()
    from vllm.sampling_params import GuidedDecodingParams  # the import TRL < 0.2x does

    assert GuidedDecodingParams(regex="a+").regex == "a+"
    assert sp.GuidedDecodingParams is StructuredOutputsParams
    assert not shim.apply()  # idempotent


def test_old_vllm_is_untouched(monkeypatch):
    old = type("GuidedDecodingParams", (), {})
    sp = _fake_vllm(monkeypatch, GuidedDecodingParams=old,
                    StructuredOutputsParams=StructuredOutputsParams)
    assert not shim.needed() and not shim.apply()
    assert sp.GuidedDecodingParams is old


def test_without_vllm_nothing_happens(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", None)
    assert not shim.needed() and not shim.apply()
