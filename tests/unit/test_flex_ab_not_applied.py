"""The A/B table says when a variant's options ran otherwise on this host (fresh-user trial,
2026-12-02: on the CPU ``{"pdl": "early", "sample_kernel": "triton"}`` ran the default kernels,
and the table showed its tok/s 15 % below the default's with nothing saying both were the same
code)."""

from nbhelpers.bench.flex_ab import ab_table
from nbhelpers.bench.flex_ab_figures import not_applied

CPU_RESOLVED = {"decode_attention": "sdpa", "prefill_attention": "sdpa", "lora_expand": "addmm",
                "skinny_gemm": "off", "skinny_gemm_cublas": None, "pdl": False,
                "pdl_mode": "off", "sample_kernel": "torch"}  # a tiny CPU A/B child's record


def _side(name, options, resolved=CPU_RESOLVED, tok=1000.0):
    return {"point": {"shape": "tiny", "lora": "none", "batch": 2},
            "variant": {"name": name, "options": options}, "decode_tok_per_s_median": tok,
            "breakdown": {"decode_step_ms": 1.5, "resolved": resolved}, "floor": {}}


def test_options_the_host_resolved_otherwise_are_named_with_what_ran():
    side = _side("early", {"pdl": "early", "sample_kernel": "triton", "lora_expand": "addmm",
                           "decode_attention": "auto", "sync_every": 4,
                           "skinny_gemm_cublas": "never"})
    assert not_applied(side) == {"pdl": ("early", "off"), "sample_kernel": ("triton", "torch"),
                                 "skinny_gemm_cublas": ("never", "off")}
    gpu = dict(CPU_RESOLVED, pdl=True, pdl_mode="early", sample_kernel="triton")
    assert not_applied(_side("early", {"pdl": "early", "sample_kernel": "triton"}, gpu)) == {}
    assert not_applied({"variant": {"name": "old", "options": {"pdl": "on"}}}) == {}  # no record


def test_the_ab_table_marks_such_a_variant_and_leaves_the_others():
    rows = ab_table([_side("default", {}, tok=1179.0),
                     _side("early", {"pdl": "early", "sample_kernel": "triton"}, tok=996.0)])
    assert rows[2].startswith("| tiny none b2 | default | 1179 | 1.50 |")
    assert rows[3].startswith("| tiny none b2 | early (ran pdl=off, sample_kernel=torch) | 996 |")


def test_a_prefetch_budget_without_the_prefetch_mode_reads_ignored():
    """``pdl_prefetch_mib`` alone is recorded as ``None`` (helper-9's probe, 2026-12-03: the
    table read ``ran pdl_prefetch_mib=off``); with ``pdl="prefetch"`` resolved it applied."""
    cpu = dict(CPU_RESOLVED, pdl_prefetch_mib=None)
    assert not_applied(_side("b8", {"pdl_prefetch_mib": 8}, cpu)) == {
        "pdl_prefetch_mib": (8, "ignored (pdl is not 'prefetch')")}
    gpu = dict(CPU_RESOLVED, pdl=True, pdl_mode="prefetch", pdl_prefetch_mib=8)
    assert not_applied(_side("b8", {"pdl": "prefetch", "pdl_prefetch_mib": 8}, gpu)) == {}
