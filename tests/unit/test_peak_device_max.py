"""The card's estimated peak (``peak_mem_device_max_gib``): its arithmetic, its record per GRPO
step, and the tables / memory goal preferring it over the step-end reading.

Why: transformers' continuous batching frees its paged cache before the step ends, so the
step-end reading (``peak_mem_device_gib``) showed hf_cb with FA4 at 18.0 GiB on the H200 while
its allocated peak was 70.9 GiB (2026-12-03, ``*221837Z_h200_48b88b7__hf_cb.json``).
"""
from __future__ import annotations

import types

import pandas as pd
import pytest
import torch

from nbhelpers import stats
from nbhelpers.grpo.compare_tables import peak_gib, perf_goal

GIB = 2**30


def _fake_cuda(monkeypatch, *, free, total, reserved, max_reserved, max_allocated):
    fake = types.SimpleNamespace(
        is_available=lambda: True, mem_get_info=lambda: (free, total),
        memory_reserved=lambda: reserved, max_memory_reserved=lambda: max_reserved,
        max_memory_allocated=lambda: max_allocated)
    monkeypatch.setattr(torch, "cuda", fake)


def test_device_max_is_peak_reserved_plus_what_lies_outside_the_allocator(monkeypatch):
    # a CB-like step: 71 GiB reserved at its peak, freed to 17 by the end; 1 GiB of context
    _fake_cuda(monkeypatch, free=122 * GIB, total=140 * GIB, reserved=17 * GIB,
               max_reserved=71 * GIB, max_allocated=70 * GIB)
    mem = stats.peak_memory_gib()
    assert mem["device"] == pytest.approx(18.0)
    assert mem["device_max"] == pytest.approx(72.0)  # 71 peak reserved + 1 outside
    assert mem["allocated"] == pytest.approx(70.0)


def test_device_max_never_reads_below_what_is_in_use_now(monkeypatch):
    # the allocator's counters reset after the memory was taken: in use now wins
    _fake_cuda(monkeypatch, free=100 * GIB, total=140 * GIB, reserved=45 * GIB,
               max_reserved=10 * GIB, max_allocated=5 * GIB)
    mem = stats.peak_memory_gib()
    assert mem["device"] == pytest.approx(40.0) and mem["device_max"] == pytest.approx(40.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU branch: peak RSS for all three")
def test_cpu_reports_peak_rss_for_every_key():
    mem = stats.peak_memory_gib()
    assert mem["allocated"] == mem["device"] == mem["device_max"] > 0


def test_statistics_callback_records_and_summarises_the_peak(monkeypatch):
    from nbhelpers.grpo.callbacks import StatisticsCallback
    readings = iter([{"allocated": 1.0, "device": 2.0, "device_max": 5.0},
                     {"allocated": 1.5, "device": 2.5, "device_max": 4.0}])
    monkeypatch.setattr("nbhelpers.grpo.callbacks.peak_memory_gib", lambda: next(readings))
    cb = StatisticsCallback()
    for step in (1, 2):
        cb.on_step_begin(None, None, None)
        cb.on_step_end(None, types.SimpleNamespace(global_step=step), None)
    assert [r["peak_mem_device_max_gib"] for r in cb.records] == [5.0, 4.0]
    summary = cb.summary(skip_first=0)
    assert summary["peak_mem_device_max_gib"] == 5.0 and summary["peak_mem_device_gib"] == 2.5


def test_peak_gib_prefers_the_estimated_peak_and_falls_back_for_older_records():
    assert peak_gib({"peak_mem_device_gib": 18.0, "peak_mem_device_max_gib": 72.0}) == 72.0
    assert peak_gib({"peak_mem_device_gib": 18.0}) == 18.0  # before 2026-12-04
    assert peak_gib({"peak_mem_device_gib": 18.0, "peak_mem_device_max_gib": float("nan")}) == 18.0
    assert peak_gib({"peak_mem_device_gib": None}) is None


def test_memory_goal_uses_the_estimated_peak_where_recorded():
    frame = pd.DataFrame([
        {"backend": "hf_generate", "step_time_s_median": 20.0, "peak_mem_device_gib": 22.0,
         "peak_mem_device_max_gib": None, "error": None},
        {"backend": "flex", "step_time_s_median": 1.3, "peak_mem_device_gib": 23.0,
         "peak_mem_device_max_gib": 30.0, "error": None},
        {"backend": "vllm", "step_time_s_median": 1.7, "peak_mem_device_gib": 60.0,
         "peak_mem_device_max_gib": 64.0, "error": None}]).set_index("backend")
    out = perf_goal(frame, ("NVIDIA H200", "qwen3-4b", "g4 b4x1 256tok"))
    assert out["memory_limit_gib"] == pytest.approx(24.0)  # hf_generate 22 (no max) + 2
    assert out["memory_ratio"] == pytest.approx(30.0 / 64.0)
    assert out["step_ratio"] == pytest.approx(1.3 / 1.7)
    assert out["met_issue13"] is False  # step 0.76 <= 0.8, but 30 GiB > 24: the peak decides
