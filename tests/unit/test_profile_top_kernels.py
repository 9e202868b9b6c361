"""``bench.profile``'s per-kernel list (``top_kernels``) from a fake ``torch.profiler`` trace: the
list and its remainder add up to the class totals and the kernel count, the extraction keeps only
device events, and bad input is refused. The real trace is the H200's
(``profile_decode_step``, every flex bench sidecar's ``breakdown.profile``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from nbhelpers.bench import profile as pr

CUDA, CPU = "cuda", "cpu"
# (name, device us over 3 steps, launches over 3 steps): a decode step's shape, 4B-like names
TRACE = [("nvjet_hsh_64x8_2x1_v_bz_splitK_TNT", 4200.0, 432),
         ("_skinny_gemm_kernel", 3900.0, 540), ("_lora_expand_gemm", 1300.0, 432),
         ("_add_norm_kernel", 900.0, 219), ("_act_mul_kernel", 640.0, 108),
         ("_qk_rope_cache_kernel", 610.0, 108), ("_paged_decode_kernel", 750.0, 108),
         ("void at::native::radixSortKVInPlace", 120.0, 3), ("triton_poi_fused_add_0", 30.0, 3)]
TRACE += [(f"tiny_elementwise_{i}", 1.5 + i, 3) for i in range(30)]


def test_top_kernels_sum_to_the_class_totals():
    steps = 3
    prof = pr.summarize_kernels(TRACE, steps)
    top, rest = prof["top_kernels"], prof["top_kernels_rest"]
    assert len(top) == pr.TOP_KERNELS and rest["kernels"] == len(TRACE) - pr.TOP_KERNELS
    ms = [k["ms_per_step"] for k in top]
    assert ms == sorted(ms, reverse=True) and top[0]["name"].startswith("nvjet")
    assert math.isclose(sum(ms) + rest["ms_per_step"], prof["kernel_ms_total"], rel_tol=1e-12)
    assert math.isclose(sum(k["launches_per_step"] for k in top) + rest["launches_per_step"],
                        prof["kernels_per_step"], rel_tol=1e-12)
    assert prof["kernels_per_step"] == sum(c for _, _, c in TRACE) / steps
    assert math.isclose(prof["kernel_ms_total"], sum(us for _, us, _ in TRACE) / 1e3 / steps)
    full = pr.summarize_kernels(TRACE, steps, top=len(TRACE))["top_kernels"]
    for cls, total in prof["kernel_ms_per_step"].items():  # each class = its kernels' sum
        assert math.isclose(sum(k["ms_per_step"] for k in full if k["class"] == cls), total)
    by_name = {k["name"]: k for k in top}
    assert by_name["_lora_expand_gemm"]["class"] == "gemm"
    assert by_name["_add_norm_kernel"]["class"] == "elementwise/other"
    assert by_name["_add_norm_kernel"]["launches_per_step"] == 73
    assert math.isclose(by_name["_act_mul_kernel"]["us_per_launch"], 640.0 / 108)
    assert pr.kernel_breakdown(prof)["gemm_ms"] == prof["kernel_ms_per_step"]["gemm"]


def test_kernel_rows_keeps_device_events_with_time():
    events = [SimpleNamespace(key="k_new", device_type=CUDA, device_time_total=12.0, count=2),
              SimpleNamespace(key="k_old", device_type=CUDA, device_time_total=None,
                              cuda_time_total=5.0, count=1),  # older torch: cuda_time_total
              SimpleNamespace(key="aten::mm", device_type=CPU, device_time_total=40.0, count=4),
              SimpleNamespace(key="k_idle", device_type=CUDA, device_time_total=0.0, count=1)]
    assert pr.kernel_rows(events, CUDA) == [("k_new", 12.0, 2), ("k_old", 5.0, 1)]


def test_summarize_refuses_bad_input():
    with pytest.raises(ValueError, match="at least one step"):
        pr.summarize_kernels(TRACE, 0)
    with pytest.raises(ValueError, match="time -1"):
        pr.summarize_kernels([("k", -1.0, 1)], 1)
    empty = pr.summarize_kernels([], 2)
    assert empty["top_kernels"] == [] and empty["kernel_ms_total"] == 0
    assert empty["top_kernels_rest"] == {"kernels": 0, "ms_per_step": 0, "launches_per_step": 0}


@pytest.mark.parametrize(("name", "cls"), [("_skinny_lora", "gemm"), ("_mlp_block_kernel", "gemm"), ("_skinny_gemm", "gemm"),
                                           ("nvjet_hsh_64x8_2x1_v_bz_splitK_TNT", "gemm"),
                                           ("triton_tem_fused_flex_attention_0", "attention"),
                                           ("_add_norm_kernel", "elementwise/other")])
def test_kernel_class_of_the_engine_kernels(name, cls):
    """The LoRA-epilogue GEMM (``lora_expand="epilogue"``) counts as gemm, not elementwise."""
    assert pr.kernel_class(name) == cls
