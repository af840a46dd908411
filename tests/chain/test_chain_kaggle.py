"""What the chain must get right against the real Kaggle (docs/kaggle-api.md): a finished status read right after
a push may be the previous version's; CANCEL_REQUESTED is not an end; 403 is not "missing"; session limits and
checkpoint sizes are checked at config load; outputs stream to disk; one W&B run per chain; keys stay masked."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from helpers import REPO
from kaggle_fixtures import USER, write_kernel

from scripts.chain.chain import Chain
from scripts.chain.client import ApiFailure
from scripts.chain.config import _check_built, config_from_dict
from shared.config import EvalConfig, TokenizeConfig, TrainConfig
from shared.errors import UserError
from shared.model_shape import MODEL_PRESETS

BASE = {"name": "unit-run", "token_datasets": ["alice/tokens"]}


class StatusApi:
    """kernels_status answering from a script of statuses (the last one repeats)."""

    def __init__(self, statuses: list[str]):
        self.statuses, self.reads = list(statuses), 0

    def kernels_status(self, ref):
        status = self.statuses[min(self.reads, len(self.statuses) - 1)]
        self.reads += 1
        return SimpleNamespace(status=status, failure_message="")


def status_chain(tmp_path: Path, api, pushed_ago_s: float, **cfg) -> tuple[Chain, list[str]]:
    """A chain that pushed "train-1" `pushed_ago_s` ago without learning its version number (the fallback: the
    newest version's status stands in)."""
    lines: list[str] = []
    chain = Chain(config_from_dict({**BASE, **cfg}), tmp_path / "chain", api=api, log=lines.append,
                  sleep=lambda s: None)
    chain.state.pushes["train-1"] = {"push_id": "x", "version": 0, "pushed": time.time() - pushed_ago_s}
    return chain, lines


def test_without_its_version_a_finished_status_right_after_a_push_waits_for_the_new_version(tmp_path):
    # The previous version's COMPLETE, read twice before the new version shows as queued: not this session's end.
    api = StatusApi(["COMPLETE", "COMPLETE", "QUEUED", "RUNNING", "ERROR"])
    chain, lines = status_chain(tmp_path, api, pushed_ago_s=1)
    status, _, _ = chain.ctx.wait("alice/unit-run-train", "train v2", "train-1")
    assert (status, api.reads) == ("ERROR", 5)
    assert any("not seen queued or running yet; taking complete as the previous version's" in ln for ln in lines)
    assert chain.state.pushes["train-1"]["seen_active"] is True
    # Long after the push (a session that ended between polls, or a restarted chain), COMPLETE counts at once.
    api = StatusApi(["COMPLETE"])
    chain, _ = status_chain(tmp_path / "later", api, pushed_ago_s=700)
    assert chain.ctx.wait("alice/unit-run-train", "train v2", "train-1")[0] == "COMPLETE" and api.reads == 1


VERSIONED_PROBE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {repo!r})  # scripts/ is not installed: the checkout's
from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict
chain = Chain(config_from_dict({base}), {work!r}, log=lambda _: None, sleep=lambda s: None)
chain.connect()
chain.state.pushes["train-2"] = {{"push_id": "x", "version": 2, "pushed": 0}}
newest = chain.client.kernel_status("alice/unit-run-train")
status = chain.ctx.wait("alice/unit-run-train", "train v2", "train-2")[:2]
files = chain.client.download_output("alice/unit-run-train", Path({out!r}), version=1)
sources = [chain.client.kernel_info("alice/unit-run-train", v) for v in (1, 2, 3)]
print(json.dumps({{"newest": newest, "status": status, "files": sorted(Path(f).name for f in files),
                  "v1": Path({out!r}, "which.txt").read_text(), "sources": sources}}))
"""


def test_the_chain_reads_the_status_and_output_of_the_version_it_pushed(local_kaggle, tmp_path):
    """Status and output are asked for by version label ("v2"), so a status call that still describes the
    previous version (an injected stale status) cannot end the wait early."""
    lk = local_kaggle
    kdir = write_kernel(tmp_path / "k", "alice/unit-run-train", "open('which.txt', 'w').write('v1')\n")
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/unit-run-train") == ("COMPLETE", None)
    write_kernel(kdir, "alice/unit-run-train", "import time\ntime.sleep(3)\nraise SystemExit(3)\n")
    lk.cli("kernels", "push", "-p", str(kdir))
    lk.app.inject("stale_status", kernel="alice/unit-run-train", count=1000)
    probe = VERSIONED_PROBE.format(repo=str(REPO), base=json.dumps(BASE), work=str(tmp_path / "chain"),
                                   out=str(tmp_path / "out"))
    result = json.loads(lk.python(probe, timeout=120).stdout.strip().splitlines()[-1])
    assert result["newest"] == ["COMPLETE", ""]  # unlabelled: version 1's, though version 2 runs
    assert result["status"] == ["ERROR", "Kernel process exited with code 3"]
    assert result["files"] == ["unit-run-train.log", "which.txt"] and result["v1"] == "v1"
    # Each version's own source, by its label (how a push that landed before a restart is found).
    (one, v1), (two, v2), (three, v3) = result["sources"]
    assert one == two == 2 and "write('v1')" in v1 and "SystemExit(3)" in v2 and (three, v3) == (0, "")
    # A bare version number is not a label (404), as on Kaggle.
    from scripts.local_kaggle import ApiError

    with pytest.raises(ApiError) as err:
        lk.app.api(USER, "kernels.KernelsApiService", "GetKernelSessionStatus",
                   {"userName": USER, "kernelSlug": "unit-run-train", "versionLabel": "2"})
    assert err.value.status == 404


def test_cancel_requested_is_not_an_end(tmp_path):
    api = StatusApi(["RUNNING", "CANCEL_REQUESTED", "CANCEL_REQUESTED", "CANCEL_ACKNOWLEDGED"])
    chain, _ = status_chain(tmp_path, api, pushed_ago_s=1)
    assert chain.ctx.wait("alice/unit-run-train", "train v2", "train-1")[0] == "CANCEL_ACKNOWLEDGED"
    assert api.reads == 4


def http_error(status: int, message: str = "") -> requests.HTTPError:
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps({"code": status, "message": message}).encode()
    return requests.HTTPError(message, response=response)


def test_a_forbidden_dataset_or_kernel_is_an_error_not_missing(tmp_path):
    class Api:
        def __init__(self, status):
            self.status = status

        def dataset_status(self, ref):
            raise http_error(self.status, "Permission 'datasets.get' was denied")

        def build_kaggle_client(self):
            raise http_error(self.status, "Permission 'kernels.get' was denied")

    chain = Chain(config_from_dict(BASE), tmp_path / "c", api=Api(403), log=lambda _: None)
    chain.client.user = "alice"
    with pytest.raises(UserError) as err:
        chain.client.dataset_exists("bob/private-data")
    assert str(err.value) == ("dataset bob/private-data: Kaggle refuses alice access (HTTP 403); it is another "
                              "user's private dataset, or the credentials are wrong")
    with pytest.raises(UserError, match=r"^kernel bob/private-kernel: Kaggle refuses alice access \(HTTP 403\)"):
        chain.client.kernel_info("bob/private-kernel")
    missing = Chain(config_from_dict(BASE), tmp_path / "m", api=Api(404), log=lambda _: None)
    assert missing.client.dataset_exists("bob/gone") is False and missing.client.kernel_info("bob/gone") == (0, "")


def test_session_limits_over_what_kaggle_allows_are_refused_at_load():
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "session_limit_s": 32401})
    assert str(err.value) == "config: session_limit_s 32401 is over the 9 h Kaggle allows a TPU session (TpuV5E8)"
    assert config_from_dict({**BASE, "accelerator": "", "session_limit_s": 43200}).session_limit_s == 43200
    with pytest.raises(UserError) as err:  # 12 h is often quoted for a GPU; no primary source says so
        config_from_dict({**BASE, "accelerator": "NvidiaTeslaT4", "session_limit_s": 32401})
    assert str(err.value) == "config: session_limit_s 32401 is over the 9 h Kaggle allows a GPU session (NvidiaTeslaT4)"
    # At Kaggle's maximum no sessionTimeoutSeconds is sent ("must be lower than the global maximum"); below it, is.
    assert Chain(config_from_dict(BASE), "/tmp/unused-chain", api=None).ctx.session_timeout() is None
    short = Chain(config_from_dict({**BASE, "session_limit_s": 3600}), "/tmp/unused-chain", api=None)
    assert short.ctx.session_timeout() == "3600" == short.ctx.session_timeout("train-2")
    assert short.ctx.session_timeout("tokenize-0-1") is None  # a tokenize part gets its machine's own limit


def test_the_eval_session_has_its_own_limit_checked_against_its_own_machine():
    # Unset, the eval gets the train sessions' limit; set, its own, sent as the eval push's timeout only.
    short = Chain(config_from_dict({**BASE, "session_limit_s": 3600}), "/tmp/unused-chain", api=None)
    assert short.ctx.session_timeout("eval") == "3600"
    own = Chain(config_from_dict({**BASE, "session_limit_s": 3000, "eval": {"session_limit_s": 600}}),
                "/tmp/unused-chain", api=None)
    assert (own.ctx.session_timeout("eval"), own.ctx.session_timeout("train-1")) == ("600", "3000")
    # An eval on a CPU may run 12 h (no timeout sent at that maximum), a TPU eval only 9 h.
    cpu_eval = config_from_dict({**BASE, "eval": {"accelerator": "", "session_limit_s": 43200}})
    assert Chain(cpu_eval, "/tmp/unused-chain", api=None).ctx.session_timeout("eval") is None
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "eval": {"session_limit_s": 43200}})
    assert str(err.value) == ("config: eval.session_limit_s 43200 is over the 9 h Kaggle allows a TPU session "
                              "(TpuV5E8)")
    for bad in (0, -5, "600", True):
        with pytest.raises(UserError) as err:
            config_from_dict({**BASE, "eval": {"session_limit_s": bad}})
        assert str(err.value) == f"config: eval.session_limit_s must be a number of seconds > 0, got {bad!r}"


def test_checkpoints_are_placed_where_they_fit_and_the_publish_margin_grows_with_them():
    gpt2 = config_from_dict({**BASE, "train": {"preset": "gpt2"}})
    assert "checkpoint_dir" not in gpt2.train.settings and gpt2.publish_margin_s == 1200  # 1.5 GB checkpoints
    xl = config_from_dict({**BASE, "train": {"preset": "gpt2-xl"}})
    size = MODEL_PRESETS["gpt2-xl"].checkpoint_bytes()
    assert 18e9 < size < 19.5e9
    assert xl.train.settings["checkpoint_dir"] == "{temp}/checkpoints" and xl.train.settings["keep_checkpoints"] == 1
    assert xl.train.settings["keep_stable"] is False  # in /kaggle/temp it would go with the session
    # The upload, and the session's wait for its version (the checkpoint has no copy in the output).
    assert xl.publish_margin_s == pytest.approx(600 + size / 10e6 + 600)  # one upload, a deleting publish too
    assert xl.time_budget == xl.session_limit_s - xl.startup_margin_s - xl.publish_margin_s
    large = config_from_dict({**BASE, "train": {"preset": "gpt2-large"}})  # 9.3 GB: 3 on disk overflow 20 GB
    assert large.train.settings["checkpoint_dir"] == "{temp}/checkpoints"
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "train": {"preset": "gpt2-large", "keep_checkpoints": 2}})
    assert str(err.value) == (
        "config: 2 kept checkpoints of 9.3 GB (3 while one is written, 27.9 GB) overflow the session's 20 GB output; "
        "set train.checkpoint_dir to \"{temp}/checkpoints\" and train.keep_checkpoints to 1")
    medium = config_from_dict({**BASE, "train": {"preset": "gpt2-medium", "keep_checkpoints": 2}})  # 3 x 4.3 GB
    assert "checkpoint_dir" not in medium.train.settings
    wsd = {"preset": "gpt2-medium", "schedule": "wsd", "keep_checkpoints": 3}  # 4 + the stable one: 5 x 4.3 GB
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "train": wsd})
    assert str(err.value) == (
        "config: 3 kept checkpoints of 4.3 GB (4 while one is written and the stable-phase one, 21.3 GB) overflow "
        "the session's 20 GB output; set train.checkpoint_dir to \"{temp}/checkpoints\" and train.keep_checkpoints "
        "to 1")
    assert "checkpoint_dir" not in config_from_dict({**BASE, "train": {**wsd, "keep_stable": False}}).train.settings
    assert config_from_dict({**BASE, "publish_margin_s": 30}).publish_margin_s == 30  # an explicit margin stays


def test_a_config_is_built_then_checked_unchanged_and_the_stages_read_its_typed_sections():
    """Loading checks what the file gives, builds the config (checkpoints placed, the publish margin sized) and checks
    the built one without changing it; each section holds its settings as given (what the kernels are built with)
    and their typed forms, every default filled, built at load; a config changed later is loaded again."""
    raw = {**BASE, "train": {"preset": "gpt2-xl"}, "tokenize": {"parts": 2, "settings": {"shard_size": 1000}},
           "eval": {"settings": {"val_tokens": 4096}, "inputs": ["alice/hs"]}}
    xl = config_from_dict(raw)
    assert raw["train"] == {"preset": "gpt2-xl"} and raw["eval"] == {"settings": {"val_tokens": 4096},
                                                                     "inputs": ["alice/hs"]}
    built = dataclasses.asdict(xl)
    _check_built(xl, "config")
    assert dataclasses.asdict(xl) == built
    train = xl.train.config
    session, schedule = train.session, train.lr_schedule
    assert (session.checkpoint_dir, session.keep_checkpoints, session.keep_stable) == ("{temp}/checkpoints", 1, False)
    assert (schedule.total_steps, schedule.schedule) == (xl.total_steps, "cosine")
    assert train.optim.lr == TrainConfig().optim.lr
    assert xl.train.config is train  # built once
    tok = xl.tokenize
    assert (tok.parts, tok.settings, tok.inputs, tok.accelerator, tok.hf_token) == (2, {"shard_size": 1000}, (), "",
                                                                                   False)
    assert (tok.config.shard_size, tok.config.tokens_per_part) == (1000, TokenizeConfig().tokens_per_part)
    ev = xl.eval
    assert (ev.enabled, ev.settings, ev.inputs) == (True, {"val_tokens": 4096}, ("alice/hs",))
    assert (ev.accelerator, ev.session_limit_s, ev.kind) == (xl.accelerator, xl.session_limit_s, "tpu")
    assert (ev.config.val_tokens, ev.config.hellaswag) == (4096, EvalConfig().hellaswag)
    xl = xl.with_train(schedule="wsd")  # a config changed later (a test's probe does): loaded again
    assert xl.train.config.lr_schedule.schedule == "wsd"
    assert xl.version_bytes == xl.checkpoint_bytes  # none kept in temp
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "eval": {"enabled": 0}})
    assert str(err.value) == "config: eval.enabled must be true or false, got 0"


def test_an_explicit_publish_margin_shorter_than_the_publish_is_refused_at_load():
    """A copied example's 1200 s with a larger model: the session would be killed mid-upload, output unsaved."""
    for preset, words, need in (
            ("gpt2-large", "1 x 9.3 GB at an assumed 10 MB/s (uploaded once, a deleting publish too) + the "
                           "session's 600-s wait for its version", 1529),
            ("gpt2-xl", "1 x 19 GB at an assumed 10 MB/s (uploaded once, a deleting publish too) + the session's "
                        "600-s wait for its version", 2469)):
        with pytest.raises(UserError) as err:
            config_from_dict({**BASE, "publish_margin_s": 1200, "train": {"preset": preset}})
        assert str(err.value) == (f"config: publish_margin_s 1200 is shorter than publishing takes: {words}, "
                                  f"~{need} s; raise it or set 0 (sized for you)")
        assert config_from_dict({**BASE, "publish_margin_s": need + 1, "train": {"preset": preset}}).time_budget > 0
    # A wsd run publishes the stable-phase checkpoint beside the newest: two checkpoints of 4.3 GB, once.
    with pytest.raises(UserError, match=r"publish_margin_s 600 is shorter than publishing takes: 2 x 4.3 GB .* ~852"):
        config_from_dict({**BASE, "publish_margin_s": 600, "train": {"preset": "gpt2-medium", "schedule": "wsd"}})
    assert config_from_dict({**BASE, "publish_margin_s": 600, "train": {"preset": "gpt2-medium"}})  # one, once: 426 s


def test_a_chain_extends_a_wsd_run_whose_stable_phase_checkpoint_travels_and_refuses_one_that_cannot():
    """train.extend needs the stable-phase checkpoint in the dataset: a wsd run keeps it (and the publish margin
    counts its upload beside the newest); without it, or on cosine, one line before anything is pushed."""
    wsd = config_from_dict({**BASE, "train": {"preset": "gpt2-medium", "schedule": "wsd", "extend": True}})
    cosine = config_from_dict({**BASE, "train": {"preset": "gpt2-medium"}})
    size = wsd.checkpoint_bytes  # 4.3 GB: 3 of them (and the stable one) fit the output
    assert size > 4e9 and wsd.train.settings["extend"] is True and "checkpoint_dir" not in wsd.train.settings
    assert wsd.publish_margin_s == pytest.approx(600 + 2 * size / 10e6)  # both checkpoints, once, at 10 MB/s
    assert cosine.publish_margin_s == 1200  # one checkpoint, once: 600 + ~426 s, under the 1200-s floor
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "train": {"schedule": "wsd", "extend": True, "keep_stable": False}})
    assert str(err.value) == (
        "config: train.extend trains on from the checkpoint where the stable phase ended, and train.keep_stable is "
        "false; before the decay starts, raise total_steps instead (docs/recipe.md section 6)")
    with pytest.raises(UserError) as err:
        config_from_dict({**BASE, "train": {"preset": "gpt2-xl", "schedule": "wsd", "extend": True}})
    assert str(err.value) == (
        "config: train.extend trains on from the checkpoint where the stable phase ended, and the checkpoints of a "
        "model this large live in /kaggle/temp, where none is kept; before the decay starts, raise total_steps "
        "instead (docs/recipe.md section 6)")
    with pytest.raises(UserError, match=r"^config: train: --extend needs --schedule wsd"):
        config_from_dict({**BASE, "train": {"extend": True}})


def test_a_finished_chain_trains_on_only_once_total_steps_is_raised_and_keeps_its_earlier_eval(tmp_path):
    done = {"format": 1, "pushes": {"eval": {"push_id": "eval-1", "version": 3}}, "train_sessions": [],
            "events": [], "done": True, "final_step": 4, "total_steps": 6,
            "eval": {"version": 3, "status": "COMPLETE", "message": "", "dir": str(tmp_path / "eval")}}
    (tmp_path / "state.json").write_text(json.dumps(done))
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.md").write_text("step 4")
    for total in (4, 6):  # a chain stopped by max_train_sessions at step 4 of 6 is finished too
        chain = Chain(config_from_dict({**BASE, "total_steps": total}), tmp_path, api=None, log=lambda _: None)
        with pytest.raises(UserError) as err:
            chain.run()
        assert str(err.value) == (f"this chain is already finished (step 4 of total_steps {total}; results in "
                                  f"{tmp_path}); raise total_steps to train further")
    (tmp_path / "state.json").write_text(json.dumps({**done, "train_sessions": [{"n": 1}, {"n": 2}]}))
    chain = Chain(config_from_dict({**BASE, "total_steps": 8, "max_train_sessions": 2}), tmp_path, api=None,
                  log=lambda _: None)
    with pytest.raises(UserError) as err:
        chain.reopen()
    assert str(err.value) == ("this chain has used its max_train_sessions (2 of 2); raise it too to train on to "
                              "total_steps 8")
    (tmp_path / "state.json").write_text(json.dumps(done))
    lines = []
    chain = Chain(config_from_dict({**BASE, "total_steps": 8}), tmp_path, api=None, log=lines.append)
    chain.reopen()
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["done"] is False and "eval" not in state and state["pushes"] == {}
    assert state["earlier_evals"] == [{**done["eval"], "dir": str(tmp_path / "eval-step_000004"), "step": 4}]
    assert (tmp_path / "eval-step_000004" / "report.md").read_text() == "step 4" and not (tmp_path / "eval").exists()
    assert lines == ["chain unit-run finished at step 4; training on to total_steps 8"]


def test_one_wandb_run_per_chain_resumed_by_every_session(tmp_path):
    from shared.train.metrics import wandb_run_id

    first = Chain(config_from_dict(BASE), tmp_path / "a", api=None, log=lambda _: None)
    run_id = first.train.wandb_run_id()
    assert run_id.startswith("unit-run-") and len(run_id) == len("unit-run-") + 8
    again = Chain(config_from_dict(BASE), tmp_path / "a", api=None, log=lambda _: None)  # a restarted chain
    assert again.train.wandb_run_id() == run_id
    other = Chain(config_from_dict(BASE), tmp_path / "b", api=None, log=lambda _: None)  # a second chain
    assert other.train.wandb_run_id() != run_id
    first.client.user = "alice"
    folder = first.train.build("push-1")
    code = next(folder.glob("*.py")).read_text()
    assert f'"wandb_run_id": "{run_id}"' in code and '"run_name": "unit-run"' in code
    with pytest.raises(UserError, match="train.wandb_run_id is set by the chain"):
        config_from_dict({**BASE, "train": {"wandb_run_id": "x"}})
    assert wandb_run_id("alice/run 1") == "alice-run-1" and wandb_run_id("//") == "run"


def test_a_key_from_kaggle_json_is_masked_in_every_message(tmp_path, monkeypatch):
    from shared.kaggle.credential import kaggle_api_class
    from shared.kaggle.publish import kaggle_api

    fake_key = "0123456789abcdef0123456789abcdef"
    config_dir = tmp_path / "kaggle-config"
    config_dir.mkdir()
    (config_dir / "kaggle.json").write_text(json.dumps({"username": "alice", "key": fake_key}))
    (config_dir / "kaggle.json").chmod(0o600)
    for name in ("KAGGLE_KEY", "KAGGLE_USERNAME", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KAGGLE_CONFIG_DIR", str(config_dir))
    api_class = kaggle_api_class()  # kaggle reads KAGGLE_CONFIG_DIR once, at import, which may have been before
    monkeypatch.setattr(api_class, "config_dir", str(config_dir))
    monkeypatch.setattr(api_class, "config", str(config_dir / "kaggle.json"))
    api = kaggle_api(from_secrets=False)
    lines: list[str] = []
    chain = Chain(config_from_dict({**BASE, "retry_attempts": 2}), tmp_path / "c", api=api, log=lines.append,
                  sleep=lambda s: None)

    def leaky():
        raise requests.ConnectionError(f"auth alice:{fake_key} refused")  # transient: logged, then retried

    with pytest.raises(ApiFailure) as err:
        chain.client.call("dataset alice/x", leaky)
    assert "***" in str(err.value) and all("***" in line for line in lines) and lines
    assert fake_key not in str(err.value) + "\n".join(lines)


def test_output_downloads_stream_to_disk(local_kaggle, tmp_path):
    """A 48 MB output file arrives whole while the client's Python heap never holds more than a few MB of it."""
    lk = local_kaggle
    code = ("import os, hashlib\nblob = os.urandom(48 << 20)\nopen('big.bin', 'wb').write(blob)\n"
            "os.makedirs('train', exist_ok=True)\nopen('train/small.txt', 'w').write('hello')\n"
            "print(hashlib.sha256(blob).hexdigest())\n")
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", "alice/big-output", code)))
    assert lk.wait("alice/big-output", timeout=60) == ("COMPLETE", None)
    probe = f"""
import hashlib, json, tracemalloc
import sys
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})  # scripts/ is not installed: the checkout's
from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict
chain = Chain(config_from_dict({json.dumps(BASE)}), {str(tmp_path / 'chain')!r}, log=lambda _: None)
chain.connect()
tracemalloc.start()
files = chain.client.download_output("alice/big-output", Path({str(tmp_path / 'out')!r}))
peak = tracemalloc.get_traced_memory()[1]
only = chain.client.download_output("alice/big-output", Path({str(tmp_path / 'only')!r}), pattern=r"^train/")
print(json.dumps({{"files": sorted(Path(f).name for f in files), "peak": peak, "only": [Path(f).name for f in only],
                  "sha": hashlib.sha256(Path({str(tmp_path / 'out' / 'big.bin')!r}).read_bytes()).hexdigest()}}))
"""
    result = json.loads(lk.python(probe, timeout=120).stdout.strip().splitlines()[-1])
    log = (tmp_path / "out" / "big-output.log").read_text()
    assert result["sha"] in log  # the bytes the session wrote, as it hashed them
    assert result["files"] == ["big-output.log", "big.bin", "small.txt"]
    assert result["only"] == ["small.txt", "big-output.log"]
    assert result["peak"] < 8 << 20, result["peak"]
    assert (tmp_path / "out" / "train" / "small.txt").read_text() == "hello"
    assert not list((tmp_path / "out").glob(".*.partial"))


def test_templates_ask_for_the_tpu_their_machine_shape_names(tmp_path):
    from scripts.chain.build import build_kernel
    from scripts.chain.limits import MACHINE_SHAPES

    for kernel in ("train", "eval"):
        template = json.loads((REPO / "kernel-metadata" / f"{kernel}.json").read_text())
        assert template["machine_shape"] == "TpuV5E8" and template["enable_tpu"] is True
        assert template["enable_gpu"] is False
    for shape, kind in [("NvidiaTeslaT4", "gpu"), ("TpuV5E8", "tpu"), ("", "cpu")]:
        folder = build_kernel("train", tmp_path / (shape or "cpu"), user="alice", slug="unit-run-train",
                              accelerator=shape)
        meta = json.loads((folder / "kernel-metadata.json").read_text())
        assert (meta["enable_gpu"], meta["enable_tpu"]) == (kind == "gpu", kind == "tpu")
        assert meta.get("machine_shape", "") == shape and MACHINE_SHAPES.get(shape, "cpu") == kind
    with pytest.raises(UserError, match="at least 5"):
        build_kernel("train", tmp_path / "short", user="alice", slug="abcd")


def test_model_config_counts_checkpoint_bytes_like_the_model():
    from shared.model.model import GPT

    for preset in ("tiny", "gpt2"):
        model = GPT(MODEL_PRESETS[preset])
        assert MODEL_PRESETS[preset].num_params() == model.num_params()
        stored = sum(v.numel() for v in model.checkpoint_tensors().values())
        assert MODEL_PRESETS[preset].checkpoint_bytes() == 3 * 4 * stored


@pytest.mark.parametrize("layout", ["<slug>", "datasets/<owner>/<slug>", "notebooks/<owner>/<slug>"])
def test_the_train_kernel_finds_its_inputs_on_every_mount_layout(tmp_path, monkeypatch, layout):
    """The data (a kernel's output) and the checkpoint dataset, mounted as each layout docs/kaggle-api.md lists."""
    from shared.kaggle.bootstrap import resolve_build
    from shared.kaggle.env import LOCAL_ROOT_ENV
    from shared.kaggle.publish import MANIFEST

    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path))
    mounts = {}
    for ref in ("alice/unit-run-tokens-part-0", "alice/unit-run-checkpoints"):
        owner, slug = ref.split("/")
        mounts[ref] = tmp_path / "input" / layout.replace("<owner>", owner).replace("<slug>", slug)
        mounts[ref].mkdir(parents=True)
    (mounts["alice/unit-run-checkpoints"] / MANIFEST).write_text(json.dumps({"step": 12, "files": {}}))
    build = {"settings": {"data_dir": "{input:alice/unit-run-tokens-part-0}", "out_dir": "{working}/train"},
             "checkpoint_dataset": {"dataset": "alice/unit-run-checkpoints", "resume_setting": "resume_from",
                                    "publish": True, "expect_step": 12}}
    built = resolve_build(build, log=lambda _: None)
    settings = built.settings
    assert (built.publish.dataset, built.publish.input_step) == ("alice/unit-run-checkpoints", 12)
    assert settings["data_dir"] == str(mounts["alice/unit-run-tokens-part-0"])
    assert Path(settings["resume_from"]).resolve().is_relative_to(tmp_path)
    with pytest.raises(UserError) as err:
        resolve_build({"settings": {"data_dir": "{input:alice/not-attached}"}}, log=lambda _: None)
    assert str(err.value) == (f"input 'alice/not-attached' is not attached to this kernel (looked in "
                              f"{tmp_path}/input/not-attached, {tmp_path}/input/datasets/alice/not-attached, "
                              f"{tmp_path}/input/notebooks/alice/not-attached)")


class DatasetApi:
    """GetDataset (current version 3, with `own` as each read's status of version 3 in versions[]) and
    GetDatasetStatus (`status`, naming no version), counted."""

    def __init__(self, own: list[str], status: list[str]):
        self.own, self.status, self.reads, self.status_reads = own, status, 0, 0

    def build_kaggle_client(self):
        import contextlib
        from types import SimpleNamespace

        def get_dataset(request):
            self.reads += 1
            own = self.own[min(self.reads, len(self.own)) - 1]
            versions = [SimpleNamespace(version_number=n, status="ready" if n < 3 else own) for n in (1, 2, 3)]
            return SimpleNamespace(current_version_number=3, versions=versions)

        def get_dataset_status(request):
            self.status_reads += 1
            return SimpleNamespace(status=self.status[min(self.status_reads, len(self.status)) - 1])

        service = SimpleNamespace(get_dataset=get_dataset, get_dataset_status=get_dataset_status)
        return contextlib.nullcontext(SimpleNamespace(datasets=SimpleNamespace(dataset_api_client=service)))


def test_a_failed_dataset_version_ends_the_wait_at_once(tmp_path):
    # Version 3's own entry names no status Kaggle's sources list: GetDatasetStatus decides (processing, then failed).
    api = DatasetApi(own=[""], status=["blobs_received", "blobs_received", "failed"])
    chain = Chain(config_from_dict(BASE), tmp_path / "c", api=api, log=lambda _: None, sleep=lambda s: None)
    with pytest.raises(UserError) as err:
        chain.client.wait_dataset_version("alice/unit-run-checkpoints", 2)
    assert str(err.value) == "dataset alice/unit-run-checkpoints: its version 3 is failed on Kaggle; see the " \
                             "dataset's page"
    assert api.status_reads == 3


def test_a_versions_own_status_is_read_before_the_status_that_names_no_version(tmp_path):
    # GetDatasetStatus still describes an older version ("ready"); version 3's own entry says it is processing.
    api = DatasetApi(own=["Processing", "Processing", "Ready"], status=["ready"])
    chain = Chain(config_from_dict(BASE), tmp_path / "c", api=api, log=lambda _: None, sleep=lambda s: None)
    assert chain.client.dataset_version("alice/unit-run-checkpoints") == (3, "processing")
    assert chain.client.wait_dataset_version("alice/unit-run-checkpoints", 2) == 3
    assert api.reads == 3 and api.status_reads == 0  # GetDatasetStatus never asked: each read named its version


def test_the_chain_names_each_shape_kaggle_may_run_on_another():
    from scripts.chain.limits import shape_notices

    assert shape_notices({"TpuV5E8", "", "NvidiaTeslaT4"}) == []
    assert shape_notices({"TpuV38", "NvidiaTeslaA100", "TpuV6E8"}) == [
        "notice: NvidiaTeslaA100 may be open only to some accounts (competitions, Kaggle admins); where it is not, "
        "Kaggle may run the sessions on its default (NvidiaTeslaT4) instead: each train session's metrics.jsonl "
        "(session_start) names the device it got",
        "notice: TpuV38 is retired (not in Kaggle's Sep 2026 accelerator list): Kaggle runs these sessions on "
        "TpuV5E8 instead; set TpuV5E8 in the config to say so"]


def test_a_sessions_last_error_line_is_read_from_its_log_as_kaggle_or_as_plain_text_writes_it(tmp_path):
    from scripts.chain.client import log_error_line

    entries = [{"stream_name": "stdout", "time": 0.1, "data": "train kernel, build x\nerror: not this one\n"},
               {"stream_name": "stderr", "time": 0.2, "data": "warning: noise\nerror: an earlier line\n"},
               {"stream_name": "stdout", "time": 0.3, "data": "a chunk that ends mid-line"},
               {"stream_name": "stderr", "time": 0.4, "data": "error: the session's own line\n"},
               {"stream_name": "stdout", "time": 0.5, "data": "  not an error: indented\n"}]
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "run-train.log").write_text(json.dumps(entries))  # as download_output names it
    assert log_error_line(tmp_path / "k", "alice/run-train") == "error: the session's own line"
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "run-train.log").write_text("starting\nerror: a plain log's line\ndone\n")
    assert log_error_line(tmp_path / "p", "alice/run-train") == "error: a plain log's line"
    (tmp_path / "k" / "run-eval.log").write_text(json.dumps([{"data": "all went well\n"}]))
    assert log_error_line(tmp_path / "k", "alice/run-eval") is None
    assert log_error_line(tmp_path / "k", "alice/no-such-run") is None
    (tmp_path / "k" / "run-odd.log").write_text("404\n")  # plain text that parses as JSON, but is no log of entries
    assert log_error_line(tmp_path / "k", "alice/run-odd") is None
