"""scripts/bench_flex.py's bad input (a fresh-user trial): each case prints one ``error: ...`` line
naming the fix, exits 2 with no traceback, and does so before any model is built or the ``--out``
folder is created (CPU; the non-tiny shapes are refused with torch's CUDA check patched to False,
so nothing large is ever built). The checks live in nbhelpers.bench.flex_args / flex_ab.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nbhelpers.bench import flex_ab

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/bench_flex.py"
SMOKE = ["--cpu-smoke"]
AB = ["--points", "tiny:fp32:2"]


def _load():
    spec = importlib.util.spec_from_file_location("bench_flex", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bf = _load()


def _refused(argv: list[str], out: Path, capsys) -> str:
    """``main(argv --out out)``'s stderr, once it exited 2 without creating ``out``."""
    with pytest.raises(SystemExit) as exc:
        bf.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line
    assert "Traceback" not in err
    assert not out.exists()  # nothing created, nothing written
    return err


@pytest.mark.parametrize(("argv", "match"), [
    # 1: a point that is no shape:lora:batch
    (["--points", "nonsense"], "--points entry 'nonsense': write shape:lora:batch"),
    # 2: not JSON, the flag named and an example shown
    ([*AB, "--variants", "notjson"], "--variants: 'notjson' is not JSON"),
    ([*SMOKE, "--decode-kernel-options", "notjson"],
     "--decode-kernel-options: 'notjson' is not JSON"),
    ([*SMOKE, "--decode-kernel-options", "[1]"], "must be a JSON object, got [1]"),
    # 3: a bad engine option, RunnerOptions' own message, up front
    ([*AB, "--variants", '{"name":"a","options":{"pdl":"yes"}}'],
     (r"--variants[0] ('a'): RunnerOptions.pdl='yes': must be one of "
      "('auto', 'off', 'on', 'early', 'prefetch')")),
    ([*AB, "--variants", '{"name":"a","options":{"skinny_gemm_cublas":"off"}}'],
     ("--variants[0] ('a'): RunnerOptions.skinny_gemm_cublas='off': must be one of "
      "('auto', 'never')")),
    ([*AB, "--variants", '{"name":"a","options":{"l2_prefetch":"on"}}'],
     ("--variants[0] ('a'): RunnerOptions.l2_prefetch='on': must be one of "
      "('off', 'o_proj')")),
    ([*SMOKE, "--decode-kernel-options", '{"num_warps": 8};{"lora_expand": "fast"}'],
     "--decode-kernel-options part 1: RunnerOptions.lora_expand='fast'"),
    # 4: --sweep checked before the parity / W stages
    ([*SMOKE, "--sweep", "abc"], "--sweep 'abc': 'abc' is no batch size"),
    ([*SMOKE, "--sweep", "8,0"], "'0' is no batch size"),
    # 5: batch 0 and an unknown shape
    (["--points", "qwen3-4b:fp32:0"], "batch 0 must be >= 1"),
    (["--points", "qwen3-5b:fp32:4"], "unknown shape 'qwen3-5b' (did you mean 'qwen3-4b'?)"),
    # 6: counts < 1
    ([*AB, "--rounds", "0"], "--rounds 0: must be >= 1"),
    ([*SMOKE, "--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ([*SMOKE, "--prompt-tokens", "0"], "--prompt-tokens 0: must be >= 1"),
    ([*SMOKE, "--sweep-rounds", "0"], "--sweep-rounds 0: must be >= 1"),
    ([*SMOKE, "--sync-every", "0"], "--sync-every 0: must be >= 1"),
    # 8: a typo in --skip
    ([*SMOKE, "--skip", "parity,swep"],
     "unknown stage(s) ['swep']; the stages are parity_tiny,parity,w,sweep"),
    # a JSON list (notebook 33's -p variants form) or a typo'd key: the CLI's own form shown
    # (fresh-user trial, 2026-12-02: the list form was refused with the list form as the example)
    ([*AB, "--variants", '[{"name": "a"}]'],
     ("--variants[0] = [{'name': 'a'}]: each variant is a dict with a 'name' (letters, digits, "
     "_ . -) and optional 'options', e.g. --variants '{\"name\": \"old\", \"options\": "
     "{\"lora_expand\": \"addmm\"}};{\"name\": \"new\"}'.")),
    ([*AB, "--variants", '{"name": "a", "option": {"sample_kernel": "triton"}}'],
     "has unknown key(s) ['option']: each variant is a dict"),
    ([*AB, "--variants", '{"name": "a", "options": {"sample_kernel": "Triton"}}'],
     ("--variants[0] ('a'): RunnerOptions.sample_kernel='Triton': must be one of "
     "('auto', 'torch', 'triton')")),
    # an engine option inside --decode-kernel-options: flex ignored it on the CPU, so the stage
    # measured the default (fresh-user trial, 2026-12-02)
    ([*SMOKE, "--decode-kernel-options", '{"pdl": "early", "num_warps": 8}'],
     ("--decode-kernel-options part 0: RunnerOptions.decode_kernel_options={'pdl': 'early', "
      "'num_warps': 8}: ['pdl'] are engine options, not kernel options")),
    # --variants only means something with --points
    ([*SMOKE, "--variants", '{"name": "a"}'], "--variants is the A/B mode's and needs --points"),
    # --num-generations: samples per prompt, a divisor of every point's batch, A/B mode only
    (["--points", "tiny:fp32:2,tiny:none:6", "--num-generations", "4"],
     "points ['tiny_fp32_b2', 'tiny_none_b6'] have a batch that is not a multiple of 4"),
    ([*AB, "--num-generations", "0"], "--num-generations 0: must be an int >= 1"),
    ([*SMOKE, "--num-generations", "2"], "--num-generations 2 is the A/B mode's"),
    # shared_prefix is a bool kernel option; not with the fused kernel
    ([*AB, "--variants", '{"name": "a", "options": {"decode_kernel_options": '
      '{"shared_prefix": true, "kernel": "fused"}}}'], "shared_prefix=True needs kernel"),
    ([*AB, "--variants", '{"name": "a", "options": {"shared_prefix": true}}'],
     "'shared_prefix' is an option of the Triton decode kernel: pass decode_attention="),
    ([*AB, "--variants", '{"name": "a", "options": {"decode_attention": "flex", '
      '"decode_kernel_options": {"shared_prefix": true}}}'],
     "decode_attention='flex' would ignore it"),
])
def test_bad_arguments_exit_2_with_one_error_line_and_no_out_folder(argv, match, tmp_path,
                                                                     capsys):
    assert match in _refused(argv, tmp_path / "out", capsys)


@pytest.mark.parametrize(("argv", "match"), [
    (["--points", "qwen3-4b:fp32:4"],
     ("--points qwen3-4b:fp32:4: shape 'qwen3-4b' needs a CUDA GPU and torch sees none here; "
      "use the tiny shape here")),
    (["--points", "tiny:fp32:2,llama_3_2_3b:none:4"], "shape 'llama_3_2_3b' needs a CUDA GPU"),
    ([], ("the staged run builds Qwen3-4B on a CUDA GPU and torch sees none here; use "
          "--cpu-smoke")),
])
def test_non_tiny_shapes_without_cuda_are_refused_before_any_model(argv, match, tmp_path,
                                                                    capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []  # the A/B children and the staged run's model would start here
    monkeypatch.setattr(flex_ab, "run_ab", lambda *a, **k: built.append("run_ab"))
    monkeypatch.setattr(bf.eb, "random_qwen3", lambda *a, **k: built.append("random_qwen3"))
    assert match in _refused(argv, tmp_path / "out", capsys)
    assert built == []


def test_good_arguments_parse_to_checked_values(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing is built by parse
    args = bf.parse(["--points", "qwen3-4b:fp32:4,llama-3-2-3b:none:32", "--variants",
                     '{"name": "old", "options": {"lora_expand": "addmm"}};{"name": "new"}'])
    assert [(p.shape, p.lora, p.batch) for p in args.point_list] == [
        ("qwen3-4b", "fp32", 4), ("llama-3-2-3b", "none", 32)]
    assert [v["name"] for v in args.variant_list] == ["old", "new"]
    args = bf.parse([*SMOKE, "--sweep", "8, 32", "--skip", "parity,sweep",
                     "--decode-kernel-options", '{"num_warps": 8};{"decode_attention": "flex"}'])
    assert (args.sweep_batches, args.skip_stages) == ([8, 32], {"parity", "sweep"})
    assert [(v["tag"], v["decode_kernel_options"]) for v in args.decode_variant_list] == [
        ("w_lora_kopts", {"num_warps": 8}), ("w_lora_kopts_1", None)]


def test_point_shapes_are_the_ones_random_model_builds():
    shapes = flex_ab.point_shapes()
    assert {"qwen3-4b", "tiny", "llama_3_2_3b", "gemma_4_e2b", "tiny_llama"} <= set(shapes)
    with pytest.raises(ValueError, match="point shape 'qwen3-5b': use one of"):
        flex_ab.random_model("qwen3-5b", "cpu")


@pytest.mark.parametrize("argv", [["--points", "nonsense"],
                                  ["--cpu-smoke", "--decode-kernel-options", "notjson"]])
def test_the_command_line_prints_no_traceback(argv, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == "" and not out.exists()


def test_check_only_checks_values_but_not_the_host(tmp_path, capsys, monkeypatch):
    """``--check-only`` (what ``scripts/device/run_step.py --dry-run`` runs for a bench step on
    this GPU-less host): the values are checked as a run would (session 22's ``n22l`` named
    ``llama-3.2-3b``, which ``--help`` had let through), the host's missing GPU is not, and
    nothing is built or written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []
    monkeypatch.setattr(flex_ab, "run_ab", lambda *a, **k: built.append("run_ab"))
    out = tmp_path / "out"
    assert "unknown shape 'llama-3.2-3b' (did you mean 'llama_3_2_3b'?)" in _refused(
        ["--points", "llama-3.2-3b:bf16:32", "--check-only"], out, capsys)
    with pytest.raises(SystemExit) as exc:
        bf.main(["--points", "llama_3_2_3b:bf16:32", "--variants",
                 '{"name": "d", "options": {"pause_gc": true}}', "--check-only", "--out",
                 str(out)])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "arguments ok"
    assert built == [] and not out.exists()
