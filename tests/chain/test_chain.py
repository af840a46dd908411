"""The chain of Kaggle sessions (scripts/chain_sessions.py) on the local Kaggle through the real kaggle client:
tokenize parts, train sessions ended by their time limit that resume from the checkpoint dataset, eval; the
final parameters equal one uninterrupted run; a killed chain continues without pushing a session twice."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import REPO, error_lines, example_config, importable_in, run_script
from kaggle_fixtures import KEY, USER, client_env, write_dataset
from safetensors.torch import load_file

from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict, load_config
from shared.errors import UserError
from shared.kaggle.credential import ATTACHED_KEY, NOTEBOOK_TOKEN
from shared.train.metrics import read_metrics

DEMO = example_config("chain-demo.json")


def chain_script():
    spec = importlib.util.spec_from_file_location("chain_sessions", REPO / "scripts" / "chain_sessions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_config(path: Path, **changes) -> Path:
    """The demo's config with `changes`, polling every 0.5 s at most (the demo's 2 s would add about a second to
    each of a test chain's waits)."""
    cfg = {k: v for k, v in DEMO.items() if not k.startswith("_")}
    cfg["poll_max_s"] = 0.5
    cfg.update(changes)
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run_chain(lk, config: Path, workdir: Path, *extra: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, str(REPO / "scripts" / "chain_sessions.py"), "--config", str(config),
                           "--workdir", str(workdir), *extra], env=env or lk.env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


NOTEBOOKS_STOP = "error: attach the secrets named above, then run the same command again; no session has started"


def first_contact(lk, config: Path, workdir: Path, attach: bool = True) -> None:
    """A new chain's first run: it saves the train notebook without running it, names the secrets to attach and
    stops; the user attaches them (as on the notebook's page), or (`attach` False) goes on without."""
    proc = run_chain(lk, config, workdir)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [NOTEBOOKS_STOP], proc.stdout + proc.stderr
    ref = f"{USER}/{json.loads(config.read_text())['name']}-train"
    # Saved on no accelerator: a notebook opened to attach secrets starts no TPU session (the pushes name it).
    assert [(v["quick_save"], v["machine_shape"], v["accelerator"]) for v in lk.app.state["kernels"][ref]["versions"]
            ] == [(True, None, None)]
    if attach:
        lk.app.attach_secret(ref, "KAGGLE_USERNAME", USER)
        lk.app.attach_secret(ref, "KAGGLE_KEY", KEY)


def upload(lk, tmp_path: Path, ref: str, files: dict) -> None:
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / ref.replace("/", "_"), ref, files)))


def session_log(folder: Path) -> str:
    (log,) = folder.glob("*.log")
    return "".join(e["data"] for e in json.loads(log.read_text()))


def version_push_id(lk, ref: str, number: int) -> str:
    source = (lk.root / "kernels" / ref / str(number) / "source.txt").read_text()
    (push_id,) = set(re.findall(r'"push_id": "([^"]+)"', source))
    return push_id


def version_log(lk, ref: str, number: int) -> str:
    return "".join(e["data"] for e in lk.app.kernels.log_events(lk.app.state["kernels"][ref], number))


def assert_pushed_once_each(lk, ref: str) -> None:
    """No push reached Kaggle twice: every version of `ref` carries its own push id."""
    ids = [version_push_id(lk, ref, v["number"]) for v in lk.app.state["kernels"][ref]["versions"]]
    assert len(set(ids)) == len(ids), (ref, ids)


def final_tensors(folder: Path) -> dict:
    tensors = load_file(folder / "model.safetensors")
    tensors.update({f"opt.{k}": v for k, v in load_file(folder / "optimizer.safetensors").items()})
    return tensors


def losses(metrics: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(metrics) if "loss" in r]


@pytest.mark.slow
def test_chain_end_to_end_resumes_bit_exactly_and_survives_a_kill(local_kaggle, tmp_path, gpt2_ranks,
                                                                  image_pythons, busy_core):
    """With a core taken from it (busy_core): start-up is slower, the sessions longer. The uninterrupted run it is
    compared with runs with that core taken too: XLA:CPU compiles for the cores a process may use, and torch_xla
    2.8's steps on one core and on two differ in their last bits (56 of tiny's 84 tensors after 20 steps)."""
    lk = local_kaggle
    files = chain_script().make_demo_corpus(tmp_path / "corpus", 400_000)
    upload(lk, tmp_path, "alice/gpt2-demo-corpus", {f.name: f.read_bytes() for f in files})
    # Sessions sized as the demo's are: the first 10 steps, each later one 20 s of training (session_train_s; more
    # where 10 steps take longer) from the end of its first step, then 20 s to publish (82 MB at the assumed
    # 10 MB/s, twice where the publish deletes the older versions), all within session_limit_s.
    config = write_config(tmp_path / "chain.json", publish_margin_s=20, session_train_s=20)
    assert DEMO["startup_margin_s"] == 90
    workdir = tmp_path / "chain"
    # First contact: the chain saves the train notebook without running it, names the secrets to attach on its
    # page, and stops before any session (no terminal to wait on).
    contact = run_chain(lk, config, workdir)
    assert contact.returncode == 2, contact.stdout[-3000:] + contact.stderr[-3000:]
    assert ("attach the secrets KAGGLE_USERNAME, KAGGLE_KEY to the train notebook: "
            "https://www.kaggle.com/code/alice/gpt2-demo-train (Add-ons > Secrets)") in contact.stdout
    assert "if attaching opens an editor session, stop it (Run > Stop Session) before going on" in contact.stdout
    assert error_lines(contact.stderr) == [NOTEBOOKS_STOP]
    kernels = lk.app.state["kernels"]
    assert sorted(kernels) == ["alice/gpt2-demo-train"]  # the eval notebook reads no secret here
    assert [(v["status"], v["quick_save"], v["outputs_saved"]) for v in kernels["alice/gpt2-demo-train"]["versions"]
            ] == [("COMPLETE", True, False)]
    assert lk.app.accounts.secrets_of("alice/gpt2-demo-train") == {}
    lk.app.attach_secret("alice/gpt2-demo-train", "KAGGLE_USERNAME", USER)
    lk.app.attach_secret("alice/gpt2-demo-train", "KAGGLE_KEY", KEY)
    # Session 1 cannot version the checkpoint dataset itself, with its token nor then with the attached key: the
    # chain publishes it from the session's output.
    lk.app.inject("http", match="CreateDatasetVersion", status=400, message="Injected refusal", count=2)
    out_log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, str(REPO / "scripts/chain_sessions.py"), "--config", str(config),
                              "--workdir", str(workdir)], env=lk.env, cwd=REPO, stdout=out_log, stderr=out_log)
    state_path = workdir / "state.json"
    deadline = time.monotonic() + 600  # a limit on a hung chain only: two tokenize parts and a 100-s session

    def second_session_pushed() -> bool:
        try:
            sessions = json.loads(state_path.read_text())["train_sessions"]
        except (OSError, ValueError, KeyError):
            return False
        return len(sessions) >= 2 and bool(sessions[1].get("version"))

    while not second_session_pushed():
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # mid-run: session 2 is queued or running
    first.wait()
    out_log.close()
    # The restarted chain meets transient API errors: a failed push and a flaky status call are retried. From now
    # on the sessions' own notebook tokens may not write datasets: they publish with the attached key instead.
    lk.app.notebook_token_writes = False
    lk.app.inject("http", match="SaveKernel", status=500, message="Injected server error", count=1)
    lk.app.inject("http", match="GetKernelSessionStatus", status=503, count=2)
    second = run_chain(lk, config, workdir, timeout=1200)  # two sessions and the eval's (at most 600 s)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    out = second.stdout
    assert "retrying" in out, out
    assert "train session 3 of 3 (max_train_sessions" in out
    assert "tokens/s" in out and "quota left" in out and "logs:" in out and "plot:" in out
    assert f"results: {workdir}" in out

    # Each session was pushed exactly once: three train versions after the quick save, one per tokenize part, one
    # eval.
    kernels = lk.app.state["kernels"]
    train_versions = kernels["alice/gpt2-demo-train"]["versions"]
    assert [v["status"] for v in train_versions] == ["COMPLETE"] * 4, [v["failure_message"] for v in train_versions]
    assert_pushed_once_each(lk, "alice/gpt2-demo-train")
    chain_output = (tmp_path / "first.log").read_text() + out
    for ref in ("alice/gpt2-demo-tokens-part-0", "alice/gpt2-demo-tokens-part-1", "alice/gpt2-demo-eval"):
        versions = kernels[ref]["versions"]
        assert versions[-1]["status"] == "COMPLETE", (ref, [v["failure_message"] for v in versions])
        assert_pushed_once_each(lk, ref)
        # A session that failed on its own (none is injected here) is one the chain saw, said so and pushed
        # again; its reason is reported so that a failure on another machine can be read in the test output.
        for v in versions[:-1]:
            assert v["status"] == "ERROR" and f"failed: {v['failure_message']}" in chain_output, (ref, v)
            warnings.warn(f"{ref} v{v['number']} failed and was pushed again: {v['failure_message']}\n"
                          f"{version_log(lk, ref, v['number'])[-3000:]}", stacklevel=1)
    state = json.loads(state_path.read_text())
    assert [s["version"] for s in state["train_sessions"]] == [2, 3, 4]
    assert [s.get("published_by") for s in state["train_sessions"]] == ["chain", "session", "session"]

    # The first session ended after its 10 steps, every later one by its clock, its training sized from the step
    # time the sessions before it measured, each resuming from where the previous one published.
    assert [line.split(":")[0] for line in chain_output.splitlines() if " lasts " in line] == [
        f"train session {n} lasts at most {s['limit_s']:g} s (session_limit_s)"
        for n, s in enumerate(state["train_sessions"], 1)]
    assert all(s["train_s"] >= 20 for s in state["train_sessions"][1:])
    first_session = state["train_sessions"][0]
    assert first_session["limit_s"] == DEMO["session_limit_s"] and first_session["step_after"] == 10
    assert all(s["startup_s"] > 0 for s in state["train_sessions"])
    steps = [0]
    for n in (1, 2, 3):
        log = session_log(workdir / "sessions" / f"train-{n:02d}")
        assert ("(stop_after_steps)" if n == 1 else "(time_budget)") in log and KEY not in log
        if n == 1:
            assert "warning: could not publish step" in log and "Injected refusal" in log
            assert f"publishing to alice/gpt2-demo-checkpoints with {NOTEBOOK_TOKEN}" in log
        else:
            assert "publish: checkpoint step" in log
        if n == 3:  # session 2 may have proven its credential before the token lost its right to write
            assert (f"notice: {NOTEBOOK_TOKEN} (scope resources.admin:*, expires not stated) cannot publish to "
                    "alice/gpt2-demo-checkpoints (HTTP 403)") in log
            assert f"publishing to alice/gpt2-demo-checkpoints with {ATTACHED_KEY}" in log
        if n > 1:  # from the dataset the session before published to: the first, then the second
            resumed_from = "alice/gpt2-demo-checkpoints" + ("-b" if n == 3 else "")
            assert f"resuming from {resumed_from} (step {steps[-1]})" in log
        steps.append(state["train_sessions"][n - 1]["step_after"])
    assert steps[1] < steps[2] < steps[3] == state["final_step"]
    datasets = lk.app.state["datasets"]
    versions = datasets["alice/gpt2-demo-checkpoints"]["versions"]
    # The sessions publish to the two checkpoint datasets in turn, each to the one not holding the checkpoint it
    # resumed from. Session 3's publish would leave 3 versions in the first (keep_dataset_versions 2): its one
    # create deletes the older ones there, while the second still holds session 2's checkpoint.
    assert [(v["notes"], bool(v.get("deleted"))) for v in versions] == [
        ("Initial release", True), (f"checkpoint at step {steps[1]} (published by the chain)", True),
        (f"checkpoint at step {steps[3]}", False)]
    assert [(v["notes"], bool(v.get("deleted"))) for v in datasets["alice/gpt2-demo-checkpoints-b"]["versions"]] \
        == [("Initial release", False), (f"checkpoint at step {steps[2]}", False)]

    # The sessions ran in the images' interpreters (train and eval: TPU; tokenize: CPU), installed what those lack
    # into their own temp folders, and left the images as they were.
    assert lk.app.settings.pythons == {"tpu": str(image_pythons["tpu"]), "gpu": str(image_pythons["cpu"]),
                                       "cpu": str(image_pythons["cpu"])}
    for n in (1, 2, 3):
        log = session_log(workdir / "sessions" / f"train-{n:02d}")
        assert re.search(r"torch 2\.8\.0(\+\w+)?, torch_xla 2\.8\.0", log), log[:3000]
        assert "installed kaggle==2.2.4, six==1.17.0 for publishing checkpoints in " in log
    for ref in ("alice/gpt2-demo-tokens-part-0", "alice/gpt2-demo-eval"):
        assert "installed tiktoken==0.14.0 for" in version_log(lk, ref, kernels[ref]["versions"][-1]["number"])
    assert importable_in(image_pythons["tpu"], ("kaggle", "tiktoken", "wandb")) == []
    assert importable_in(image_pythons["cpu"], ("kaggle", "tiktoken", "wandb")) == ["kaggle"]

    # The eval kernel's report came back.
    assert (workdir / "eval" / "report.md").exists() and (workdir / "loss.png").exists()
    report = (workdir / "eval" / "report.md").read_text()  # every plot has data: HellaSwag on the demo set too
    assert re.search(r"\| HellaSwag acc_norm \(step \d+, 40 examples\) \| [01]\.\d+ \|", report), report

    # One uninterrupted run of the same number of steps on the same tokens ends with the same parameters.
    data = []
    for part in (0, 1):
        dest = tmp_path / "tokens" / f"part-{part}"
        lk.cli("kernels", "output", f"alice/gpt2-demo-tokens-part-{part}", "-p", str(dest))
        data.append(str(dest))
    train = DEMO["train"]
    args = [f"--{k.replace('_', '-')}={v}" for k, v in train.items()]
    ref_dir = tmp_path / "reference"
    proc = run_script("kernels/train.py", *args, "--no-progress", "--total-steps", str(DEMO["total_steps"]),
                      "--stop-after-steps", str(steps[3]), "--data-dir", ",".join(data), "--out-dir", str(ref_dir),
                      timeout=300, python=str(image_pythons["tpu"]))  # the sessions' torch/torch_xla
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = tmp_path / "final"
    lk.cli("datasets", "download", "alice/gpt2-demo-checkpoints", "-p", str(final), "--unzip")
    ref_ckpt = ref_dir / "checkpoints" / f"step_{steps[3]:06d}"
    a, b = final_tensors(final), final_tensors(ref_ckpt)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"
    assert losses(final / "metrics.jsonl") == losses(ref_ckpt / "metrics.jsonl")
    assert [h[0] for h in losses(final / "metrics.jsonl")] == list(range(1, steps[3] + 1))

    # Run again: the chain is finished, a one-line error, nothing pushed.
    again = run_chain(lk, config, workdir)
    assert again.returncode == 2 and error_lines(again.stderr)[0].startswith("error: this chain is already finished")
    assert len(lk.app.state["kernels"]["alice/gpt2-demo-train"]["versions"]) == 4


def test_a_retired_accelerator_is_run_on_its_successor_and_the_chain_says_so(local_kaggle, tmp_path):
    lk = local_kaggle
    upload(lk, tmp_path, "alice/gpt2-demo-corpus", {"docs.jsonl": b'{"text": "x"}\n'})
    proc = run_chain(lk, write_config(tmp_path / "c.json", name="old-tpu", accelerator="TpuV38"), tmp_path / "w")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [NOTEBOOKS_STOP]
    assert ("notice: TpuV38 is retired (not in Kaggle's Sep 2026 accelerator list): Kaggle runs these sessions on "
            "TpuV5E8 instead; set TpuV5E8 in the config to say so") in proc.stdout
    (version,) = lk.app.state["kernels"]["alice/old-tpu-train"]["versions"]
    assert (version["machine_shape"], version["accelerator"]) == (None, None)  # quick-saved on no accelerator
    # A push that names the retired shape runs on its successor (as the chain's pushes after the quick save).
    lk.app.api(USER, "kernels.KernelsApiService", "SaveKernel", {
        "slug": "alice/old-tpu-train", "newTitle": "old tpu train", "text": "print(1)", "language": "python",
        "kernelType": "script", "machineShape": "TpuV38"})
    version = lk.app.state["kernels"]["alice/old-tpu-train"]["versions"][-1]
    assert (version["machine_shape"], version["accelerator"]) == ("TpuV5E8", "tpu")


def test_the_notebooks_that_read_secrets_are_named_with_their_secrets():
    from scripts.chain.notebooks import needed_secrets

    base = {k: v for k, v in DEMO.items() if not k.startswith("_")}
    assert needed_secrets(config_from_dict(base)) == {"train": ["KAGGLE_USERNAME", "KAGGLE_KEY"]}
    wandb = config_from_dict({**base, "train": {**base["train"], "wandb_project": "gpt2"}})
    assert needed_secrets(wandb) == {"train": ["KAGGLE_USERNAME", "KAGGLE_KEY", "WANDB_API_KEY"],
                                     "eval": ["WANDB_API_KEY"]}
    model = config_from_dict({**base, "eval": {**base["eval"], "settings": {"kaggle_model": "alice/gpt2/pyTorch/a"}}})
    assert needed_secrets(model) == {"train": ["KAGGLE_USERNAME", "KAGGLE_KEY"],
                                     "eval": ["KAGGLE_USERNAME", "KAGGLE_KEY"]}
    assert needed_secrets(model, ("KAGGLE_API_TOKEN",)) == {"train": ["KAGGLE_API_TOKEN"],
                                                            "eval": ["KAGGLE_API_TOKEN"]}  # a user with an API token
    off = config_from_dict({**base, "eval": {"enabled": False, "settings": {"kaggle_model": "alice/gpt2/pyTorch/a"}}})
    assert needed_secrets(off) == {"train": ["KAGGLE_USERNAME", "KAGGLE_KEY"]}
    hub = config_from_dict({**base, "tokenize": {**base["tokenize"], "hf_token": True}})  # one notebook a part
    assert needed_secrets(hub) == {"train": ["KAGGLE_USERNAME", "KAGGLE_KEY"], "tokenize-part-0": ["HF_TOKEN"],
                                   "tokenize-part-1": ["HF_TOKEN"]}
    assert hub.slug("tokenize-part-1") == "gpt2-demo-tokens-part-1"
    with pytest.raises(UserError, match=r"^config: tokenize.hf_token must be true or false .*got 'yes'$"):
        config_from_dict({**base, "tokenize": {**base["tokenize"], "hf_token": "yes"}})


# --- restarts without a second push --------------------------------------------------------------------------

class Killed(BaseException):
    pass


class FakeApi:
    """Just enough of KaggleApi for push_once: versions with their pushed source."""

    def __init__(self, kill_after_push: bool = False, kill_before_push: bool = False):
        self.sources: list[str] = []
        self.kill_after_push, self.kill_before_push = kill_after_push, kill_before_push

    def kernels_push(self, folder, timeout=None):
        if self.kill_before_push:
            raise Killed()
        self.sources.append(next(Path(folder).glob("*.txt")).read_text())
        if self.kill_after_push:
            raise Killed()  # the push landed; the chain died before it could record the version

        class Resp:
            error = None
            version_number = len(self.sources)
            invalid_dataset_sources: list = []
            invalid_kernel_sources: list = []

        return Resp()


def fake_chain(tmp_path: Path, api: FakeApi) -> Chain:
    cfg = config_from_dict({"name": "unit-run", "token_datasets": ["alice/t"]})
    chain = Chain(cfg, tmp_path / "chain", api=api, log=lambda *_: None)
    chain.client.kernel_info = lambda ref, version=0: (
        len(api.sources), api.sources[version - 1] if version else api.sources[-1] if api.sources else "")
    return chain


def build_dummy(tmp_path: Path):
    def build(push_id: str) -> Path:
        folder = tmp_path / "build"
        folder.mkdir(exist_ok=True)
        (folder / "code.txt").write_text(f"print('hi')  # {push_id}")
        return folder

    return build


@pytest.mark.parametrize("kill", ["after_push", "before_push"])
def test_a_chain_killed_around_a_push_pushes_once(tmp_path, kill):
    api = FakeApi(kill_after_push=kill == "after_push", kill_before_push=kill == "before_push")
    with pytest.raises(Killed):
        fake_chain(tmp_path, api).ctx.push_once("train-1", "alice/unit-run-train", build_dummy(tmp_path))
    api.kill_after_push = api.kill_before_push = False
    restarted = fake_chain(tmp_path, api)  # a new process: the state comes from the file
    assert restarted.ctx.push_once("train-1", "alice/unit-run-train", build_dummy(tmp_path)) == 1
    assert len(api.sources) == 1
    assert restarted.ctx.push_once("train-1", "alice/unit-run-train", build_dummy(tmp_path)) == 1
    assert len(api.sources) == 1
    assert restarted.ctx.push_once("train-2", "alice/unit-run-train", build_dummy(tmp_path)) == 2


def test_a_push_that_landed_before_a_kill_is_found_by_its_version_label_behind_a_newer_push(tmp_path):
    api = FakeApi(kill_after_push=True)
    with pytest.raises(Killed):
        fake_chain(tmp_path, api).ctx.push_once("train-1", "alice/unit-run-train", build_dummy(tmp_path))
    api.sources.append("print('pushed from the UI meanwhile')")  # version 2, not the chain's
    api.kill_after_push = False
    restarted = fake_chain(tmp_path, api)
    assert restarted.ctx.push_once("train-1", "alice/unit-run-train", build_dummy(tmp_path)) == 1
    assert len(api.sources) == 2  # found as version 1: not pushed again


# --- bad input ------------------------------------------------------------------------------------------------

def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown key.*max_sessions"):
        config_from_dict({"max_sessions": 3, "token_datasets": ["a/b"]})
    with pytest.raises(UserError, match="unknown accelerator 'TpuV99'"):
        config_from_dict({"accelerator": "TpuV99", "token_datasets": ["a/b"]})
    for length in ("total_steps", "max_steps"):  # the run's length, by its name and its old name
        with pytest.raises(UserError, match="train.total_steps is set by the chain"):
            config_from_dict({"train": {length: 3}, "token_datasets": ["a/b"]})
    with pytest.raises(UserError, match="unknown train setting.*batch"):
        config_from_dict({"train": {"batch": 3}, "token_datasets": ["a/b"]})
    with pytest.raises(UserError, match="leaves no training time"):
        config_from_dict({"session_limit_s": 60, "token_datasets": ["a/b"]})
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(UserError, match="not valid json"):
        load_config(bad)
    real = load_config(REPO / "examples" / "chain-gpt2-124m.json")
    assert real.time_budget == 32400 - 1310 - 1200 and real.train.settings["preset"] == "gpt2"
    toml = tmp_path / "run.toml"
    toml.write_text('name = "toml-run"\ntoken_datasets = ["a/b"]\n[train]\npreset = "gpt2"\n')
    assert load_config(toml).train.settings == {"preset": "gpt2"}


def test_the_train_section_may_hold_its_settings_under_settings_as_tokenize_and_eval_do():
    """One shape for the three stage sections: the train settings under `settings` load as the older shape (settings
    directly in `train`) does; a built config written out loads back to itself, and a changed one is checked."""
    flat = config_from_dict({"token_datasets": ["a/b"], "train": {"preset": "gpt2", "lr": 0.001}})
    shaped = config_from_dict({"token_datasets": ["a/b"], "train": {"settings": {"model": {"preset": "gpt2"},
                                                                                  "optim": {"lr": 0.001}}}})
    assert shaped == flat and shaped.train.settings == {"preset": "gpt2", "lr": 0.001}
    assert (shaped.train.config.optim.lr, shaped.train.config.lr_schedule.total_steps) == (0.001, shaped.total_steps)
    assert config_from_dict(flat.raw()) == flat
    assert flat.with_train(lr=0.002).train.config.optim.lr == 0.002 and flat.train.config.optim.lr == 0.001
    with pytest.raises(UserError) as err:
        flat.with_train(lr=-1)
    assert str(err.value).startswith("config: train: ")
    with pytest.raises(UserError) as err:
        config_from_dict({"token_datasets": ["a/b"], "train": {"settings": {"preset": "gpt2"}, "lr": 0.001}})
    assert str(err.value) == "config: unknown train key(s) lr; known: settings"
    with pytest.raises(UserError) as err:
        config_from_dict({"token_datasets": ["a/b"], "eval": ["x"]})
    assert str(err.value) == "config: eval must be a section ({\"key\": value, ...}), got ['x']"


@pytest.mark.slow
def test_bad_input_gives_one_line_errors_and_loses_nothing(local_kaggle, tmp_path):
    lk = local_kaggle
    upload(lk, tmp_path, "alice/some-tokens", {"x_train_000001.bin": b"\0" * 64})
    base = dict(tokenize={}, token_datasets=["alice/some-tokens"], eval={"enabled": False}, session_limit_s=75,
                startup_margin_s=20, publish_margin_s=20)

    no_creds = client_env(lk.app, tmp_path / "nocreds", user=None, key=None)
    proc = run_chain(lk, write_config(tmp_path / "a.json", **base), tmp_path / "w1", env=no_creds)
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: Kaggle credentials not found: set KAGGLE_API_TOKEN (an API token, from kaggle.com/settings/api) or "
        "KAGGLE_USERNAME and KAGGLE_KEY (or ~/.kaggle/access_token, ~/.kaggle/kaggle.json; in a kernel: the Kaggle "
        "secret KAGGLE_API_TOKEN, or KAGGLE_USERNAME and KAGGLE_KEY)"]
    assert proc.stdout.count("\n") <= 1

    proc = run_chain(lk, write_config(tmp_path / "b.json", **{**base, "token_datasets": ["alice/no-such-tokens"]}),
                     tmp_path / "w2")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: dataset alice/no-such-tokens does not exist (or is not visible to alice); check the config"]
    proc = run_chain(lk, write_config(tmp_path / "c.json", **{**base, "token_kernels": ["alice/no-such-kernel"]}),
                     tmp_path / "w3")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: kernel alice/no-such-kernel does not exist (or is not visible to alice); check token_kernels"]
    assert lk.app.state["kernels"] == {}

    # A checkpoint dataset already at total_steps: nothing to do, and its versions stay as they were.
    manifest = json.dumps({"format": 1, "step": 40, "files": {}})
    upload(lk, tmp_path, "alice/done-run-checkpoints", {"checkpoint.json": manifest, "model.safetensors": b"m"})
    proc = run_chain(lk, write_config(tmp_path / "d.json", **base, name="done-run", total_steps=40), tmp_path / "w4")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: nothing to train: checkpoint dataset alice/done-run-checkpoints already holds step 40 of "
        "total_steps 40 (raise total_steps to train further)"]
    assert len(lk.app.state["datasets"]["alice/done-run-checkpoints"]["versions"]) == 1

    # Sessions that fail without progress: the chain gives up after max_failed_sessions in a row.
    for _ in range(2):
        lk.app.inject("session_error", kernel="alice/failing-run-train", message="TPU could not be allocated")
    config = write_config(tmp_path / "f.json", **base, name="failing-run", max_failed_sessions=2)
    first_contact(lk, config, tmp_path / "w6")
    proc = run_chain(lk, config, tmp_path / "w6")
    assert proc.returncode == 2 and error_lines(proc.stderr) == [
        "error: stopping: 2 train sessions in a row made no progress (last: TPU could not be allocated); logs in "
        f"{tmp_path / 'w6' / 'sessions'}"]
    assert "session 2 error" in proc.stdout
    assert len(lk.app.state["kernels"]["alice/failing-run-train"]["versions"]) == 3  # the quick save, two sessions
    assert [v["notes"] for v in lk.app.state["datasets"]["alice/failing-run-checkpoints"]["versions"]] == [
        "Initial release"]

    # A tokenize part that stops on its own error: the chain names the part's last line, not only its exit code.
    tokenize = {"parts": 1, "inputs": ["alice/some-tokens"],
                "settings": {"data_files": "{input:alice/some-tokens}/*.jsonl", "tokens_per_part": 1000}}
    config = write_config(tmp_path / "t.json", **{**base, "token_datasets": [], "tokenize": tokenize},
                          name="bad-tokens", max_failed_sessions=1)
    first_contact(lk, config, tmp_path / "w7")
    proc = run_chain(lk, config, tmp_path / "w7")
    assert proc.returncode == 2
    mount = lk.root / "kernels" / "alice" / "bad-tokens-tokens-part-0" / "1" / "kaggle" / "input" / "some-tokens"
    logs = tmp_path / "w7" / "sessions" / "tokenize-0-1"
    assert error_lines(proc.stderr) == [f"error: tokenize part 0 failed 1 time in a row (last: error: --data-files: "
                                        f"no file matches {mount}/*.jsonl); see {logs}"]
    assert (f"  part 0 failed: Kernel process exited with code 2; its last error line: error: --data-files: no file "
            f"matches {mount}/*.jsonl; log in {logs}") in proc.stdout

    # Too little weekly TPU quota left for one more session: stop before pushing.
    lk.app.quota_s["tpu"] = 30.0
    config = write_config(tmp_path / "e.json", **base, name="quota-run")
    first_contact(lk, config, tmp_path / "w5")  # a quick save runs nothing: it needs no quota
    proc = run_chain(lk, config, tmp_path / "w5")
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert line.startswith("error: stopping: the weekly TPU quota would be exceeded: 0.01 h left of 0.00833333 h")
    assert "run the chain again then (it continues at step 0)" in line
    assert [v["quick_save"] for v in lk.app.state["kernels"]["alice/quota-run-train"]["versions"]] == [True]


# --- a session that cannot see the checkpoint the chain saw -------------------------------------------------------

def test_a_session_that_does_not_find_the_expected_checkpoint_refuses_to_start_over(tmp_path, monkeypatch):
    from shared.kaggle.bootstrap import resolve_build
    from shared.kaggle.env import LOCAL_ROOT_ENV
    from shared.kaggle.publish import MANIFEST

    for sub in ("input", "working", "temp"):
        (tmp_path / sub).mkdir()
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path))
    build = {"settings": {"out_dir": "{working}/train"},
             "checkpoint_dataset": {"dataset": "alice/run-checkpoints", "resume_setting": "resume_from",
                                    "publish": True, "expect_step": 32}}
    with pytest.raises(UserError, match=r"alice/run-checkpoints holds step 32, but this session finds no "
                                        r"checkpoint in its inputs; not starting over"):
        resolve_build(build, log=lambda _: None)
    mounted = tmp_path / "input" / "run-checkpoints"  # an older version of the dataset
    mounted.mkdir()
    (mounted / MANIFEST).write_text(json.dumps({"step": 20, "files": {}}))
    with pytest.raises(UserError, match=r"holds step 32, but this session sees step 20 in .*run-checkpoints"):
        resolve_build(build, log=lambda _: None)
    # The first session of a chain expects nothing and starts fresh.
    first = {**build, "checkpoint_dataset": {**build["checkpoint_dataset"], "expect_step": 0}}
    (mounted / MANIFEST).unlink()
    built = resolve_build(first, log=lambda _: None)
    assert built.settings == {"out_dir": str(tmp_path / "working" / "train")}
    assert (built.publish.dataset, built.publish.input_step) == ("alice/run-checkpoints", None)


def test_quota_fields_left_out_mean_zero_and_a_zipped_manifest_is_read(tmp_path):
    import datetime
    import zipfile

    from kagglesdk.kernels.types.kernels_api_service import (
        ApiAcceleratorQuota,
        ApiGetAcceleratorQuotaStatisticsResponse,
    )

    from scripts.chain.client import normalize_single_download

    quota = ApiAcceleratorQuota()
    quota.total_time_allowed = datetime.timedelta(hours=20)  # no time_used: nothing used this week
    resp = ApiGetAcceleratorQuotaStatisticsResponse()
    resp.tpu_quota = quota

    class QuotaApi:
        def quota_view(self):
            return resp

    chain = Chain(config_from_dict({**{k: v for k, v in DEMO.items() if not k.startswith("_")}}, "demo"),
                  tmp_path / "w", api=QuotaApi(), log=lambda _: None)
    assert chain.train.quota_left_s()[:2] == (72000.0, 72000.0)
    quota.time_used = datetime.timedelta(hours=2)
    quota.time_reserved = datetime.timedelta(hours=9)  # a session running now
    assert chain.train.quota_left_s()[:2] == (9 * 3600.0, 72000.0)

    dest = tmp_path / "probe"
    dest.mkdir()
    with zipfile.ZipFile(dest / "checkpoint.json.zip", "w") as z:
        z.writestr("checkpoint.json", json.dumps({"step": 7}))
    normalize_single_download(dest, "checkpoint.json")
    assert json.loads((dest / "checkpoint.json").read_text()) == {"step": 7}
