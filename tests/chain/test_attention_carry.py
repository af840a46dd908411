"""A kernel a session found hung or failed is carried forward (scripts/chain/attention_carry.py): the chain starts
the next session from the kernel after it and says so; on the local Kaggle, with sessions whose probes hang
(tests/chain/probe_hang/sitecustomize.py), the pushed settings name flash, then SDPA, which trains."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import REPO

from scripts.chain.attention_carry import carried_attention, probe_results
from shared.errors import UserError
from shared.runtime.attention_probe import hung_line

HUNG = ("error: stopping before training: the splash-attention kernel's probe gave no answer within 15 minutes "
        "(what was left of the session's budget for its kernel probes); its compile or run may still hold the TPU, "
        "which the first training step and torch_xla's exit would wait for (--attention flash skips it)")


def test_the_next_session_starts_past_the_last_kernel_a_session_found_hung_or_failed():
    assert carried_attention("auto", []) == ("splash", "")
    hung = {"n": 1, "attention_probes": {"splash": "hung"}}
    assert carried_attention("auto", [hung]) == ("flash", "session 1's splash-attention probe hung")
    # A failed probe (its session fell back and trained on) is carried too; a passed one is not.
    failed = {"n": 2, "attention_probes": {"splash": "failed", "flash": "passed"}}
    assert carried_attention("auto", [failed]) == ("flash", "session 2's splash-attention probe failed")
    both = {"n": 3, "attention_probes": {"flash": "hung"}}
    assert carried_attention("auto", [hung, both]) == ("sdpa", "session 3's flash-attention probe hung")
    # Never back: the flash session that followed carries splash's failure on.
    assert carried_attention("auto", [hung, {"n": 2, "attention_probes": {"flash": "passed"}}])[0] == "flash"
    # A setting already past the kernel stays; SDPA is the end.
    assert carried_attention("flash", [hung]) == ("flash", "")
    assert carried_attention("sdpa", [hung, both]) == ("sdpa", "")


def test_a_sessions_probe_results_come_from_its_facts_or_its_hung_probes_line(tmp_path):
    facts = tmp_path / "session-facts.json"
    facts.write_text(json.dumps({"attention_probes": {"splash": {"result": "failed", "micro_batch": 128,
                                                                 "why": "it differs from SDPA"},
                                                      "flash": {"result": "passed", "micro_batch": 64}},
                                 "packages": {}}))
    assert probe_results(facts, None) == {"splash": "failed", "flash": "passed"}
    # The facts did not come back: the session's last error line names the kernel whose probe hung.
    assert probe_results(tmp_path / "none.json", HUNG) == {"splash": "hung"}
    assert probe_results(tmp_path / "none.json", "error: something else") == {}
    # The line the chain reads is the one a session stops on.
    assert probe_results(tmp_path / "none.json", "error: " + hung_line("flash", UserError("no answer"))) == {
        "flash": "hung"}


@pytest.mark.slow
def test_a_chain_carries_a_hung_kernel_forward_to_the_next_session(local_kaggle, tmp_path, demo_data, image_pythons,
                                                                   monkeypatch):
    """Every Pallas kernel's probe hangs in these sessions (a v5e as their selection sees it, 128 tokens, which both
    kernels tile): session 1 stops on splash's; the chain pushes session 2 from flash, which hangs too, and session
    3 from SDPA, which trains to total_steps. Each said in the chain's output; none pushed the same settings again."""
    from test_chain import DEMO, first_contact, run_chain, session_log, write_config
    from test_chain_datasets import upload_tokens

    lk = local_kaggle
    # The sessions' environment is this process's (scripts/local_kaggle/sessions.py session_env).
    path = [str(REPO / "tests" / "chain" / "probe_hang"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    upload_tokens(lk, tmp_path, "alice/hang-tokens", demo_data)
    config = write_config(tmp_path / "hang.json", name="hang-run", tokenize={}, eval={"enabled": False},
                          token_datasets=["alice/hang-tokens"], total_steps=2, max_failed_sessions=3,
                          train={**DEMO["train"], "seq_len": 128, "total_batch_tokens": 1024})
    work, ref = tmp_path / "w", "alice/hang-run-train"
    first_contact(lk, config, work, attach=False)
    proc = run_chain(lk, config, work, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert ('train session 2 starts from the flash attention kernel (train.attention "flash"): session 1\'s '
            "splash-attention probe hung") in proc.stdout
    assert ('train session 3 starts from the sdpa attention kernel (train.attention "sdpa"): session 2\'s '
            "flash-attention probe hung") in proc.stdout
    # The settings each session was pushed with (its built kernel's source), the quick save first.
    versions = lk.app.state["kernels"][ref]["versions"]
    pushed = [re.findall(r'"attention": "(\w+)"', (lk.root / "kernels" / ref / str(v["number"]) / "source.txt")
                         .read_text()) for v in versions]
    assert [v["status"] for v in versions] == ["COMPLETE", "ERROR", "ERROR", "COMPLETE"]
    assert pushed[1:] == [[], ["flash"], ["sdpa"]]  # session 1: the config's (auto, its default)
    sessions = json.loads((work / "state.json").read_text())["train_sessions"]
    assert [(s.get("attention"), s.get("attention_probes"), s["step_after"]) for s in sessions] == [
        (None, {"splash": "hung"}, 0), ("flash", {"flash": "hung"}, 0), ("sdpa", None, 2)]
    first, second = (session_log(work / "sessions" / f"train-0{n}") for n in (1, 2))
    assert "probing attention kernels: splash, then flash, at most 3 s in all" in first
    # The probe had what was left of the 3-s budget when it started: 3 s, or a few ms less on a loaded machine.
    hung = re.search(r"error: stopping before training: the splash-attention kernel's probe gave no answer within "
                     r"(\d+(?:\.\d+)?) s", first)
    assert hung and 2.5 <= float(hung.group(1)) <= 3.0, first[-2000:]
    assert "probing attention kernels: flash, at most 3 s in all" in second
    assert "probing" not in session_log(work / "sessions" / "train-03")
