"""Every bench_flex command line in scripts/device/step_table.py passes bench_flex's own argument
checks on the CPU (CUDA reported present, nothing built), so a device call never spends its
minutes on a typo in a variant's JSON or an engine option."""

import importlib.util
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tables(monkeypatch):
    import torch
    monkeypatch.syspath_prepend(str(REPO / "scripts/device"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = importlib.util.spec_from_file_location("bench_flex_script", REPO / "scripts/bench_flex.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import step_table
    yield step_table, bench
    sys.modules.pop("step_table", None)


def test_every_bench_args_string_parses(tables, tmp_path):
    table, bench = tables
    jobs = [over["args"] for _, _, js in table.STEPS.values() for nb, over, *_ in js
            if nb == table.BENCH and "args" in over]
    assert len(jobs) >= 5 and any("epilogue" in a for a in jobs)
    for args in jobs:
        bench.parse(shlex.split(args.replace("$OUT", str(tmp_path))))  # SystemExit on a bad one
    assert not any(tmp_path.iterdir())  # parsing creates nothing


def test_every_notebook_job_plans_under_its_profile(tables):
    """Each notebook job's ``-p`` overrides pass ``plan_parameters`` under the profile it names
    (``@profile``, default h200), and the runner's command line carries that profile and no
    ``@profile`` override."""
    import yaml

    from nbhelpers.run.params import plan_parameters
    table, _ = tables
    import run_step
    jobs = [(nb, over) for _, _, js in table.STEPS.values() for nb, over, *_ in js
            if not nb.endswith(".py")]
    realistic = [o for _, o in jobs if o.get(run_step.PROFILE_KEY) == "h200_realistic"]
    assert realistic, "the realistic preset's steps (rv4, rf1) are gone from the table"
    for nb, over in jobs:
        profile, rest = run_step.job_profile(over)
        params = {k: run_step.AB_EXAMPLE if v == "@ab" else yaml.safe_load(v)
                  for k, v in rest.items()}
        plan_parameters([REPO / nb], profile, params, REPO)
        cmd = run_step._job_command(nb, over, 0, {}, print)
        assert cmd[cmd.index("--profile") + 1] == profile
        assert run_step.PROFILE_KEY not in cmd
    assert run_step.PROFILE_KEY in realistic[0], "job_profile changed the table's dict"
