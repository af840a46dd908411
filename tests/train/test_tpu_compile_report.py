"""scripts/tpu_compile.py --tpu-python: the step compiled again with another libtpu, and the line that says how its
collectives inside the loop differ, from canned reports (no second virtualenv, nothing compiled)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scripts.tpu_compile_report import compare_lines
from shared.errors import UserError


def canned(libtpu: str, inside: list[tuple[str, int, int]], ceiling: float, ceiling_mxu: float) -> dict:
    """A report as scripts/tpu_compile.py analyse writes one, with the given collectives inside the loop."""
    gib = 2**30
    return {"tpu": "v5e-8", "device_kind": "TPU v5 lite", "devices": 8, "versions": {"jax": "x", "libtpu": libtpu},
            "compile_s": 100.0, "preset": "gpt2", "micro_batch": 128, "grad_accum_steps": 4,
            "attention": "pallas-splash", "activation_checkpointing": False, "scan_layers": False, "fsdp": False,
            "memory": {"arguments": gib, "outputs": gib, "aliased": gib, "temps": gib, "code": 0, "peak": 0,
                       "compiler_total": 2 * gib},
            "peak_bytes": 2 * gib, "hbm_bytes": 16 * gib, "fits": True, "free_fraction": 0.875,
            "collectives": [{"kind": k, "where": "inside", "count": n, "bytes": b} for k, n, b in inside]
            + [{"kind": "all-reduce", "where": "outside", "count": 3, "bytes": 340_200_000}],
            "flops": 1e12, "model_flops": 1e12, "hbm_traffic": 1e9, "roofline_ops_s": 0.4, "kernel_calls": 96,
            "kernel_flops": 7.4e12, "kernel_s": 0.0377, "collective_s": 0.0018, "step_s": 0.436,
            "mfu_ceiling": ceiling, "head_dim": 64, "mxu_width": 128, "mxu_efficiency": 0.5, "kernel_mxu_s": 0.0754,
            "step_mxu_s": 0.4737, "mfu_ceiling_mxu": ceiling_mxu}


OLD = canned("0.0.17", [], 0.656, 0.604)
NEW = canned("0.0.42.1", [("all-reduce", 1, 77_266_944)], 0.641, 0.592)


def test_the_comparison_says_which_all_reduce_the_newer_libtpu_put_inside_the_loop():
    assert compare_lines(OLD, NEW) == [
        "libtpu 0.0.42.1: all-reduce inside the loop 1, 77.3 MB per micro-step (0.0.17: 0)",
        "libtpu 0.0.42.1: MFU ceiling 64.1% (0.0.17: 65.6%), with the kernels at the head dim's MXU share 59.2% "
        "(0.0.17: 60.4%)"]


def test_the_comparison_names_every_kind_either_puts_inside_the_loop_with_the_others_count_and_bytes():
    old = canned("0.0.17", [("all-reduce", 2, 20_000_000), ("collective-permute", 4, 8_000_000)], 0.5, 0.4)
    new = canned("0.0.42.1", [("all-reduce", 2, 20_000_000)], 0.5, 0.4)
    assert compare_lines(old, new)[:2] == [
        "libtpu 0.0.42.1: all-reduce inside the loop 2, 20.0 MB per micro-step (0.0.17: 2, 20.0 MB)",
        "libtpu 0.0.42.1: collective-permute inside the loop 0, 0.0 MB per micro-step (0.0.17: 4, 8.0 MB)"]


def test_a_step_one_libtpu_refused_is_said_so_and_not_compared():
    refused = {**canned("0.0.42.1", [], 0, 0), "compiler_says": "Ran out of memory in memory space hbm."}
    assert compare_lines(OLD, refused) == ["libtpu 0.0.42.1 against 0.0.17: libtpu 0.0.42.1 refused the step, "
                                           "nothing to compare"]


def test_tpu_python_compiles_the_step_twice_and_prints_both_reports_and_the_comparison(monkeypatch, capsys, tmp_path):
    import scripts.tpu_compile as tool

    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    calls = []

    def fake_compile(settings, tpu, log=print, keep=None, attention=None, trace_only=None, python=None):
        calls.append((tpu, attention or settings.get("attention"), keep, python))  # --attention: the train setting
        return dict(NEW if python else OLD)

    monkeypatch.setattr(tool, "compile_step", fake_compile)
    monkeypatch.setattr(sys, "argv", ["tpu_compile.py", "--preset", "gpt2", "--attention", "splash",
                                      "--tpu-python", str(python), "--keep", str(tmp_path / "keep")])
    tool.main()
    assert calls == [("v5e-8", "splash", tmp_path / "keep", None),
                     ("v5e-8", "splash", tmp_path / "keep" / "tpu-python", python)]
    out = capsys.readouterr().out
    assert "libtpu 0.0.42.1: all-reduce inside the loop 1, 77.3 MB per micro-step (0.0.17: 0)\n" in out
    assert out.count("MFU ceiling: ") == 2 and "libtpu 0.0.17): gpt2" in out and "libtpu 0.0.42.1): gpt2" in out


@pytest.mark.parametrize("extra, error", [
    (["--tpu-python", "/nonexistent/bin/python"], "--tpu-python /nonexistent/bin/python: no such interpreter"),
    (["--tpu-python", sys.executable, "--analyse", "DIR"], "--tpu-python compiles the step: it does not go with"),
])
def test_tpu_python_refuses_a_missing_interpreter_and_analyse_in_one_line(monkeypatch, extra, error):
    import scripts.tpu_compile as tool

    monkeypatch.setattr(tool, "compile_step", lambda *a, **k: pytest.fail("nothing is compiled"))
    monkeypatch.setattr(sys, "argv", ["tpu_compile.py", "--preset", "gpt2", *extra])
    with pytest.raises(UserError, match="^" + error.replace("(", r"\(")) as raised:
        tool.main()
    assert "\n" not in str(raised.value) and Path(sys.executable).exists()
