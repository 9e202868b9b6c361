"""``scripts/device/epilogue_probe.py --tiny``: the H200 probe of the LoRA-epilogue GEMM runs on
tiny shapes in Triton's interpreter, prints its table (one row per group, rows, config) and
writes a JSON whose every variant has a time and whose epilogue agrees with the default path.
The real shapes and CUDA-graph timing run on the H200 (``python3
scripts/device/epilogue_probe.py``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the probe's kernels need the triton package")

from nbhelpers.engine.kernels import skinny_gemm as sg
from nbhelpers.engine.kernels import skinny_lora_epilogue as ep

if not sg.INTERPRETED:
    pytest.skip("--tiny runs in the interpreter (TRITON_INTERPRET=1, a CPU host); on a CUDA host "
                "run the probe itself", allow_module_level=True)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts/device/epilogue_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("epilogue_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_probe_prints_the_table_and_writes_json(tmp_path, capsys):
    probe, kernel = _probe(), ep._skinny_lora
    rc = probe.main(["--tiny", "--out", str(tmp_path), "--rows", "4,32",
                     "--configs", "n64_k128_s2_w4_st3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads((tmp_path / "epilogue_probe.json").read_text())
    rows = data["rows"]
    assert [(r["group"], r["M"]) for r in rows] == [("qkv", 4), ("qkv", 32), ("gate_up", 4),
                                                    ("gate_up", 32)]
    for r in rows:
        assert set(r["us"]) == set(probe.VARIANTS) and min(r["us"].values()) > 0, r
        assert r["errors"] == {} and r["epilogue_rel_err"] <= probe.MAX_REL_ERR, r
        assert r["epilogue_dns_rel_err"] == r["epilogue_rel_err"]  # same math, other build
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("group"))
    assert all(v in lines[head] for v in (*probe.VARIANTS, "epi/default"))
    assert [line.split()[:3] for line in lines[head + 1:head + 5]] == [
        [g, str(m), "n64_k128_s2_w4_st3"] for g, m in [("qkv", 4), ("qkv", 32), ("gate_up", 4),
                                                         ("gate_up", 32)]]
    assert data["tiny"] and data["unit"] == "us per launch"
    assert all(not cnt.any() for _, _, cnt in ep._WORKSPACES.values())
    assert ep._skinny_lora is kernel  # the epilogue_dns rebuild was put back


def test_unknown_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a candidate"):
        _probe().main(["--tiny", "--out", str(tmp_path), "--rows", "4", "--groups", "qkv",
                       "--configs", "n999_k1_s1_w4_st3"])
