"""The local Kaggle, driven by the real `kaggle` CLI (2.2.x) and KaggleApi, exactly as users and the chain
script will drive Kaggle: kernels push/status/output/logs/list, datasets create/version/status/files/download,
secrets, the session limit, quota, faults, restarts and bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap

import pytest
from kaggle_fixtures import (
    KAGGLE_BIN,
    KEY,
    REPO,
    USER,
    client_env,
    load_local_kaggle_module,
    save_without_running,
    wait_for,
    write_dataset,
    write_kernel,
)

from scripts.local_kaggle import ApiError
from shared.errors import UserError
from shared.kaggle import env as kaggle_env
from shared.kaggle import secrets as kaggle_secrets

READ_INPUT_KERNEL = textwrap.dedent(
    """
    from shared.kaggle.env import kaggle_paths
    paths = kaggle_paths()
    text = (paths.input_dir("alice/words-data") / "words.txt").read_text()
    (paths.working / "sub").mkdir()
    (paths.working / "sub" / "upper.txt").write_text(text.upper())
    (paths.temp / "scratch.bin").write_bytes(b"x" * 10)
    print("read", len(text), "chars; cwd is working:", __import__("os").getcwd() == str(paths.working))
    """
)


@pytest.mark.slow  # a kernel session in a new process, and a dozen kaggle CLI processes (the marker's definition)
def test_push_runs_kernel_with_dataset_input_and_output_downloads(local_kaggle, tmp_path):
    lk = local_kaggle
    out = lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", "alice/words-data",
                                                                   {"words.txt": "hello kaggle\n"})))
    assert "Dataset is being created" in out.stdout
    assert lk.cli("datasets", "status", "alice/words-data").stdout.strip() == "ready"

    kdir = write_kernel(tmp_path / "k", "alice/read-words", READ_INPUT_KERNEL, dataset_sources=["alice/words-data"])
    lk.app.queue_delay_s = 3600.0  # held in the queue (however slow the CLI calls) until released below
    out = lk.cli("kernels", "push", "-p", str(kdir))
    assert "Kernel version 1 successfully pushed" in out.stdout
    first = lk.cli("kernels", "status", "alice/read-words").stdout
    assert 'has status "KernelWorkerStatus.QUEUED"' in first
    lk.app.queue_delay_s = 0.2  # released
    assert lk.wait("alice/read-words") == ("COMPLETE", None)
    assert 'has status "KernelWorkerStatus.COMPLETE"' in lk.cli("kernels", "status", "alice/read-words").stdout

    dest = tmp_path / "out"
    lk.cli("kernels", "output", "alice/read-words", "-p", str(dest))
    assert (dest / "sub" / "upper.txt").read_text() == "HELLO KAGGLE\n"
    assert not (dest / "scratch.bin").exists()  # temp is not output
    log = json.loads((dest / "read-words.log").read_text())
    assert log[0]["stream_name"] == "stdout" and set(log[0]) == {"stream_name", "time", "data"}
    assert log[0]["data"] == "read 13 chars; cwd is working: True\n"
    assert "read 13 chars" in lk.cli("kernels", "logs", "alice/read-words").stdout

    listing = lk.cli("kernels", "list", "--mine").stdout
    assert "alice/read-words" in listing
    # A second version runs again and becomes what status/output report.
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/read-words") == ("COMPLETE", None)
    assert [v["number"] for v in lk.app.state["kernels"]["alice/read-words"]["versions"]] == [1, 2]

    # Another kernel reads that kernel's output as an input (kernel_sources), read-only.
    code = textwrap.dedent("""
        import os
        from shared.kaggle.env import kaggle_paths
        src = kaggle_paths().input_dir("alice/read-words")
        print(sorted(os.listdir(src)), (src / "sub" / "upper.txt").read_text().strip(),
              oct(os.stat(src).st_mode & 0o777))
        """)
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k2", "alice/reads-output", code,
                                                     kernel_sources=["alice/read-words"])))
    assert lk.wait("alice/reads-output") == ("COMPLETE", None)
    assert "['sub'] HELLO KAGGLE 0o555" in lk.cli("kernels", "logs", "alice/reads-output").stdout


def test_dataset_versions_download_newest_and_keep_old(local_kaggle, tmp_path):
    lk = local_kaggle
    folder = write_dataset(tmp_path / "ds", "alice/ckpt-store", {"a.bin": b"\x00" * 1000, "note.txt": "one"})
    lk.cli("datasets", "create", "-p", str(folder))
    write_dataset(folder, "alice/ckpt-store", {"note.txt": "two", "b.bin": os.urandom(300_000)})
    out = lk.cli("datasets", "version", "-p", str(folder), "-m", "second")
    assert "Dataset version is being created" in out.stdout
    files = lk.cli("datasets", "files", "alice/ckpt-store").stdout
    assert "b.bin" in files and "a.bin" not in files

    dest = tmp_path / "dl"
    lk.cli("datasets", "download", "alice/ckpt-store", "-p", str(dest), "--unzip")
    assert sorted(p.name for p in dest.iterdir()) == ["b.bin", "note.txt"]
    assert (dest / "note.txt").read_text() == "two"
    assert (dest / "b.bin").read_bytes() == (folder / "b.bin").read_bytes()

    old = tmp_path / "dl-v1"
    lk.cli("datasets", "download", "alice/ckpt-store/1", "-p", str(old), "--unzip")
    assert (old / "note.txt").read_text() == "one" and (old / "a.bin").stat().st_size == 1000
    one = tmp_path / "one"
    lk.cli("datasets", "download", "alice/ckpt-store", "-f", "note.txt", "-p", str(one))
    assert (one / "note.txt").read_text() == "two"

    # The Python API the chain script and the train kernel use.
    res = lk.python(textwrap.dedent(f"""
        import json
        from kaggle.api.kaggle_api_extended import KaggleApi
        api = KaggleApi(); api.authenticate()
        r = api.dataset_create_version({str(folder)!r}, "third", quiet=True)
        print(json.dumps([r.status, r.error, api.dataset_status("alice/ckpt-store", format="json")]))
        """))
    status, error, st = json.loads(res.stdout.strip().splitlines()[-1])
    assert (status, error or None, json.loads(st)) == ("Ok", None, {"status": "ready", "current_version_number": 3})
    versions = lk.app.state["datasets"]["alice/ckpt-store"]["versions"]
    assert [v["number"] for v in versions] == [1, 2, 3]
    assert [v["notes"] for v in versions] == ["Initial release", "second", "third"]
    for v in versions:  # every version's files are still on disk
        vdir = lk.root / "datasets" / "alice" / "ckpt-store" / str(v["number"])
        assert sorted(p.name for p in vdir.iterdir()) == sorted(f["name"] for f in v["files"])


def test_secrets_are_attached_to_a_notebook_reach_it_and_never_its_logs(local_kaggle, tmp_path):
    lk = local_kaggle
    secret = "s3cr3t-" + os.urandom(8).hex()
    with pytest.raises(ApiError) as err:  # only a notebook that exists has secrets
        lk.app.attach_secret("alice/uses-secret", "WANDB_API_KEY", secret)
    assert err.value.status == 404
    code = textwrap.dedent("""
        import hashlib
        from shared.kaggle.env import kaggle_paths
        from shared.kaggle.secrets import get_secret
        value = get_secret("WANDB_API_KEY")
        (kaggle_paths().working / "digest.txt").write_text(hashlib.sha256(value.encode()).hexdigest())
        try:
            get_secret("NOT_SET")
        except Exception as err:
            print("missing:", err)
        """)
    kdir = write_kernel(tmp_path / "k", "alice/uses-secret", code)
    lk.cli("kernels", "push", "-p", str(kdir))  # a new notebook: no secrets yet
    assert lk.wait("alice/uses-secret") == ("ERROR", "Kernel process exited with code 1")
    assert "'WANDB_API_KEY' is not attached to this notebook" in lk.cli("kernels", "logs", "alice/uses-secret").stdout
    lk.app.attach_secret("alice/uses-secret", "WANDB_API_KEY", secret)
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/uses-secret") == ("COMPLETE", None)
    dest = tmp_path / "out"
    lk.cli("kernels", "output", "alice/uses-secret", "-p", str(dest))
    assert (dest / "digest.txt").read_text() == hashlib.sha256(secret.encode()).hexdigest()
    log = (dest / "uses-secret.log").read_text()
    assert "'NOT_SET' is not attached" in log and secret not in log
    for path in lk.root.rglob("*"):  # the value lives only in the secrets store
        if path.is_file() and path.name != "secrets.json":
            assert secret.encode() not in path.read_bytes(), path


SESSION_VERSIONS_DATASET = textwrap.dedent(
    """
    import json, os
    from shared.kaggle.env import kaggle_paths
    from shared.kaggle.secrets import get_secret
    os.environ["KAGGLE_USERNAME"] = get_secret("KAGGLE_USERNAME")
    os.environ["KAGGLE_KEY"] = get_secret("KAGGLE_KEY")
    folder = kaggle_paths().temp / "ckpt"
    folder.mkdir()
    (folder / "step.txt").write_text("step 100")
    (folder / "dataset-metadata.json").write_text(json.dumps({"id": "alice/run-ckpt"}))
    try:
        # `import kaggle` signs in (kaggle 2.0.2 on the CPU image too), so the import can meet the network
        from kaggle.api.kaggle_api_extended import KaggleApi
        api = KaggleApi()
        api.authenticate()  # the session's own token first: introspected over the API (kaggle 2.2.4)
        print("status before:", api.dataset_status("alice/run-ckpt"))
        r = api.dataset_create_version(str(folder), "checkpoint at step 100", quiet=True)
        print("versioned:", r.status)
    except Exception as err:
        print("api failed:", type(err).__name__, err)
        raise SystemExit(1)
    """
)


@pytest.mark.slow
def test_kernel_versions_a_dataset_from_inside_its_session(local_kaggle, tmp_path):
    """The train kernel's checkpoint path: the Kaggle API from inside a session, credentials from secrets."""
    lk = local_kaggle
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", "alice/run-ckpt", {"step.txt": "step 0"})))
    kdir = write_kernel(tmp_path / "k", "alice/ckpt-writer", SESSION_VERSIONS_DATASET, enable_internet=True)
    save_without_running(lk, kdir)  # the notebook exists: its secrets can be attached
    lk.app.attach_secret("alice/ckpt-writer", "KAGGLE_USERNAME", USER)
    lk.app.attach_secret("alice/ckpt-writer", "KAGGLE_KEY", KEY)
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/ckpt-writer") == ("COMPLETE", None), lk.cli("kernels", "logs", "alice/ckpt-writer").stdout
    logs = lk.cli("kernels", "logs", "alice/ckpt-writer").stdout
    assert "status before: ready" in logs and "versioned: Ok" in logs and KEY not in logs
    dest = tmp_path / "dl"
    lk.cli("datasets", "download", "alice/run-ckpt", "-p", str(dest), "--unzip")
    assert (dest / "step.txt").read_text() == "step 100"
    assert [v["notes"] for v in lk.app.state["datasets"]["alice/run-ckpt"]["versions"]] == [
        "Initial release", "checkpoint at step 100"]

    # Without internet the session cannot reach the API: the call fails at once, nothing is versioned.
    write_kernel(kdir, "alice/ckpt-writer", SESSION_VERSIONS_DATASET, enable_internet=False)
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/ckpt-writer") == ("ERROR", "Kernel process exited with code 1")
    assert "api failed: ProxyError" in lk.cli("kernels", "logs", "alice/ckpt-writer").stdout
    assert len(lk.app.state["datasets"]["alice/run-ckpt"]["versions"]) == 2


@pytest.mark.slow
def test_session_limit_hard_kills_and_discards_output(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.app.session_limit_s = 1.5
    code = "from shared.kaggle.env import kaggle_paths\n(kaggle_paths().working / 'partial.txt').write_text('x')\n" \
           "print('sleeping', flush=True)\nimport time\ntime.sleep(120)\n"
    kdir = write_kernel(tmp_path / "k", "alice/sleeper-kernel", code)
    lk.cli("kernels", "push", "-p", str(kdir))
    status, message = lk.wait("alice/sleeper-kernel", timeout=20)
    assert status == "ERROR" and "time limit of 1.5 seconds" in message
    v = lk.app.state["kernels"]["alice/sleeper-kernel"]["versions"][-1]
    assert 1.4 < v["ended"] - v["started"] < 8
    out = lk.cli("kernels", "status", "alice/sleeper-kernel").stdout
    assert "KernelWorkerStatus.ERROR" in out and "time limit" in out
    dest = tmp_path / "out"
    lk.cli("kernels", "output", "alice/sleeper-kernel", "-p", str(dest))
    assert not (dest / "partial.txt").exists()
    assert "sleeping" in (dest / "sleeper-kernel.log").read_text()

    # `kaggle kernels push -t` lowers the limit for one version.
    lk.app.session_limit_s = 100
    lk.cli("kernels", "push", "-p", str(kdir), "-t", "1")
    status, message = lk.wait("alice/sleeper-kernel", timeout=20)
    assert status == "ERROR" and "time limit of 1 seconds" in message


def test_working_cap_stops_the_session(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.app.working_cap_bytes = 100_000
    code = "import time\nopen('big.bin', 'wb').write(b'0' * 200_000)\ntime.sleep(30)\n"
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", "alice/too-much-output", code)))
    status, message = lk.wait("alice/too-much-output", timeout=20)
    assert status == "ERROR" and "over its 100000-byte limit" in message


@pytest.mark.slow
def test_accelerator_quota_is_counted_and_enforced(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.app.quota_s["tpu"] = 90.0
    quick = write_kernel(tmp_path / "q", "alice/tpu-quick", "import time\ntime.sleep(1)\n", enable_tpu=True)
    lk.cli("kernels", "push", "-p", str(quick))
    assert lk.wait("alice/tpu-quick") == ("COMPLETE", None)
    used = lk.app.quota_used_s(USER, "tpu")
    assert 1.0 <= used < 90.0 and lk.app.quota_used_s(USER, "gpu") == 0  # at least the session's sleep
    assert lk.app.state["kernels"]["alice/tpu-quick"]["versions"][0]["machine_shape"] == "TpuV5E8"
    table = lk.cli("quota").stdout
    tpu_row = next(line for line in table.splitlines() if line.startswith("TPU"))
    assert tpu_row.split()[3] == "0.03h"  # total 90 s shows as 0.03h

    lk.app.quota_s["tpu"] = used + 1.5  # 1.5 s left: the next session is stopped when they run out
    slow = write_kernel(tmp_path / "s", "alice/tpu-slow", "import time\ntime.sleep(30)\n", machine_shape="TpuV5E8")
    lk.cli("kernels", "push", "-p", str(slow))
    status, message = lk.wait("alice/tpu-slow", timeout=20)
    assert status == "ERROR" and "quota" in message
    assert lk.app.quota_used_s(USER, "tpu") == used + 1.5  # charged up to the allowance, not past it

    out = lk.cli("kernels", "push", "-p", str(quick))
    assert "Kernel push error: Your weekly TPU quota" in out.stdout
    # CPU kernels are not limited by accelerator quota.
    cpu = write_kernel(tmp_path / "c", "alice/cpu-kernel", "print('cpu')\n")
    lk.cli("kernels", "push", "-p", str(cpu))
    assert lk.wait("alice/cpu-kernel") == ("COMPLETE", None)


@pytest.mark.slow
def test_http_faults_reach_the_client(local_kaggle, tmp_path):
    lk = local_kaggle
    kdir = write_kernel(tmp_path / "k", "alice/faulty-calls", "print('ok')\n")
    lk.app.inject("http", match="SaveKernel", status=500, message="Injected server error")
    out = lk.cli("kernels", "push", "-p", str(kdir), check=False)
    assert out.returncode == 1 and "Injected server error" in out.stderr
    assert "alice/faulty-calls" not in lk.app.state["kernels"]  # nothing was pushed

    lk.cli("kernels", "push", "-p", str(kdir))
    lk.wait("alice/faulty-calls")
    lk.app.inject("http", match="GetKernelSessionStatus", status=429, retry_after=0, count=1)
    out = lk.cli("kernels", "status", "alice/faulty-calls", check=False)
    assert out.returncode == 1 and "429" in out.stderr
    assert "COMPLETE" in lk.cli("kernels", "status", "alice/faulty-calls").stdout  # the fault was used up

    # The client itself retries 429 on blob uploads and dataset creation (Retry-After honoured).
    lk.app.inject("http", match="StartBlobUpload", status=429, retry_after=0, count=2)
    lk.app.inject("http", match="upload", status=503, count=1)  # the PUT: the client resumes
    folder = write_dataset(tmp_path / "ds", "alice/retried-data", {"x.txt": "payload"})
    lk.cli("datasets", "create", "-p", str(folder))
    dest = tmp_path / "dl"
    lk.cli("datasets", "download", "alice/retried-data", "-p", str(dest), "--unzip")
    assert (dest / "x.txt").read_text() == "payload"

    lk.app.inject("http", match="download", status=500, message="blob store down")
    out = lk.cli("datasets", "download", "alice/retried-data", "-f", "x.txt", "-p", str(tmp_path / "d2"), check=False)
    assert out.returncode == 1 and "blob store down" in out.stderr and not (tmp_path / "d2" / "x.txt").exists()


@pytest.mark.slow
def test_session_error_and_kill_faults(local_kaggle, tmp_path):
    lk = local_kaggle
    kdir = write_kernel(tmp_path / "k", "alice/chaos-kernel",
                        "import time\nprint('step 1', flush=True)\ntime.sleep(0.3)\nprint('step 2', flush=True)\n"
                        "time.sleep(30)\n")
    lk.app.inject("session_error", kernel="alice/chaos-kernel", message="TPU could not be allocated")
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/chaos-kernel") == ("ERROR", "TPU could not be allocated")

    lk.app.inject("kill", kernel="alice/chaos-kernel", on_log=r"step 2", message="Preempted at step 2")
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/chaos-kernel", timeout=20) == ("ERROR", "Preempted at step 2")
    out = lk.cli("kernels", "status", "alice/chaos-kernel").stdout
    assert 'Failure message: "Preempted at step 2"' in out

    lk.app.inject("kill", kernel="alice/chaos-kernel", after_s=0.5)
    lk.cli("kernels", "push", "-p", str(kdir))
    status, message = lk.wait("alice/chaos-kernel", timeout=20)
    assert status == "ERROR" and "Injected fault" in message

    # An operator kill through the admin endpoint (for a server in another process).
    module = load_local_kaggle_module()
    lk.cli("kernels", "push", "-p", str(kdir))
    wait_for(lambda: lk.app.kernel_status("alice/chaos-kernel")[0] == "RUNNING")
    module.admin_call(lk.root, lk.app.port, "kill", {"kernel": "alice/chaos-kernel", "message": "Admin kill"})
    assert lk.wait("alice/chaos-kernel") == ("ERROR", "Admin kill")

    # A kernel that fails by itself.
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "f", "alice/failing-kernel", "raise SystemExit(3)\n")))
    assert lk.wait("alice/failing-kernel") == ("ERROR", "Kernel process exited with code 3")


@pytest.mark.slow
def test_restart_keeps_datasets_kernels_and_outputs(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", "alice/words-data",
                                                             {"words.txt": "persist me\n"})))
    kdir = write_kernel(tmp_path / "k", "alice/read-words", READ_INPUT_KERNEL, dataset_sources=["alice/words-data"],
                        kernel_type="notebook")
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/read-words") == ("COMPLETE", None)
    sleeper = write_kernel(tmp_path / "s", "alice/long-runner", "import time\ntime.sleep(60)\n")
    lk.cli("kernels", "push", "-p", str(sleeper))
    wait_for(lambda: lk.app.kernel_status("alice/long-runner")[0] == "RUNNING")

    lk.restart(queue_delay_s=0.2)
    assert "COMPLETE" in lk.cli("kernels", "status", "alice/read-words").stdout
    out = lk.cli("kernels", "status", "alice/long-runner").stdout
    assert "ERROR" in out and "server stopped" in out
    dest = tmp_path / "out"
    lk.cli("kernels", "output", "alice/read-words", "-p", str(dest))
    assert (dest / "sub" / "upper.txt").read_text() == "PERSIST ME\n"
    lk.cli("datasets", "version", "-p", str(write_dataset(tmp_path / "ds", "alice/words-data", {"words.txt": "v2"})),
           "-m", "after restart")
    assert [v["number"] for v in lk.app.state["datasets"]["alice/words-data"]["versions"]] == [1, 2]
    lk.cli("kernels", "push", "-p", str(kdir))  # version 2 of the kernel, after the restart
    assert lk.wait("alice/read-words") == ("COMPLETE", None)
    assert len(lk.app.state["kernels"]["alice/read-words"]["versions"]) == 2


@pytest.mark.slow
def test_bad_input_gives_clear_errors_and_loses_nothing(local_kaggle, tmp_path):
    lk = local_kaggle
    no_creds = client_env(lk.app, tmp_path / "nocreds", user=None, key=None)
    out = lk.cli("kernels", "status", "alice/some-kernel", env=no_creds, check=False)
    assert out.returncode == 1 and "Authentication required" in out.stdout
    wrong = client_env(lk.app, tmp_path / "wrong", user=USER, key="not-" + KEY)
    out = lk.cli("datasets", "status", "alice/some-data", env=wrong, check=False)
    assert out.returncode == 1 and "Authentication required" in out.stdout

    out = lk.cli("kernels", "status", "alice/no-such-kernel", check=False)
    assert out.returncode == 1 and "Kernel 'alice/no-such-kernel' not found" in out.stderr
    out = lk.cli("kernels", "output", "alice/no-such-kernel", "-p", str(tmp_path / "o"), check=False)
    assert out.returncode == 1 and "not found" in out.stderr
    out = lk.cli("datasets", "download", "alice/no-such-data", "-p", str(tmp_path / "d"), check=False)
    assert out.returncode == 1 and "Dataset 'alice/no-such-data' not found" in out.stderr
    out = lk.cli("datasets", "files", "alice/no-such-data", check=False)
    assert out.returncode == 1 and "not found" in out.stderr

    kdir = write_kernel(tmp_path / "k", "alice/bad-accel", "print(1)\n", machine_shape="TpuV99")
    out = lk.cli("kernels", "push", "-p", str(kdir), check=False)
    assert out.returncode == 1 and "Unknown machine_shape 'TpuV99'" in out.stderr and "TpuV6E8" in out.stderr
    out = lk.cli("kernels", "push", "-p", str(kdir), "--accelerator", "NvidiaTeslaT4")
    assert "successfully pushed" in out.stdout
    kdir = write_kernel(tmp_path / "k2", "alice/missing-input", "print(1)\n", dataset_sources=["alice/no-such-data"])
    out = lk.cli("kernels", "push", "-p", str(kdir))
    assert "not valid dataset sources" in out.stdout and "alice/no-such-data" in out.stdout
    kdir = write_kernel(tmp_path / "k3", "bob/not-mine-kernel", "print(1)\n")
    out = lk.cli("kernels", "push", "-p", str(kdir), check=False)
    assert out.returncode == 1 and "Permission denied" in out.stderr

    # Versioning a dataset that does not exist creates nothing; creating one that exists overwrites nothing.
    folder = write_dataset(tmp_path / "ds", "alice/no-such-data", {"a.txt": "a"})
    out = lk.cli("datasets", "version", "-p", str(folder), "-m", "x", check=False)
    assert out.returncode == 1 and "Dataset 'alice/no-such-data' not found" in out.stderr
    assert "alice/no-such-data" not in lk.app.state["datasets"]
    folder = write_dataset(tmp_path / "ds", "alice/real-data", {"a.txt": "first"})
    lk.cli("datasets", "create", "-p", str(folder))
    write_dataset(folder, "alice/real-data", {"a.txt": "second"})
    out = lk.cli("datasets", "create", "-p", str(folder))
    assert "already in use" in out.stdout
    lk.app.inject("http", match="CreateDatasetVersion", status=500, count=10)  # a version push that fails
    out = lk.cli("datasets", "version", "-p", str(folder), "-m", "lost?", check=False)
    assert out.returncode == 1
    (version,) = lk.app.state["datasets"]["alice/real-data"]["versions"]
    assert (lk.root / "datasets/alice/real-data/1/a.txt").read_text() == "first" and version["number"] == 1


def test_kaggle_env_outside_and_inside_sessions(tmp_path, monkeypatch):
    for var in (kaggle_env.LOCAL_ROOT_ENV, kaggle_env.LOCAL_SECRETS_ENV, "KAGGLE_KERNEL_RUN_TYPE", "MY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    if not kaggle_env.KAGGLE_ROOT.joinpath("input").is_dir():
        assert not kaggle_env.is_kaggle() and not kaggle_env.is_local_kaggle()
        with pytest.raises(UserError, match="not inside a Kaggle session"):
            kaggle_env.kaggle_paths()
    with pytest.raises(UserError, match="'MY_TOKEN' is not set"):
        kaggle_secrets.get_secret("MY_TOKEN")
    monkeypatch.setenv("MY_TOKEN", "env-value")
    assert kaggle_secrets.get_secret("MY_TOKEN") == "env-value"

    root = tmp_path / "kaggle"
    (root / "input" / "datasets" / "alice" / "shards").mkdir(parents=True)
    (root / "working").mkdir()
    secrets_file = tmp_path / "secrets.json"
    secrets_file.write_text(json.dumps({"HF_TOKEN": "hf-123"}))
    monkeypatch.setenv(kaggle_env.LOCAL_ROOT_ENV, str(root))
    monkeypatch.setenv(kaggle_env.LOCAL_SECRETS_ENV, str(secrets_file))
    assert kaggle_env.is_local_kaggle() and not kaggle_env.is_kaggle()
    paths = kaggle_env.kaggle_paths()
    assert (paths.input, paths.working, paths.temp) == (root / "input", root / "working", root / "temp")
    assert paths.temp.is_dir()
    assert paths.input_dir("alice/shards") == root / "input" / "datasets" / "alice" / "shards"
    with pytest.raises(UserError, match="not attached"):
        paths.input_dir("alice/other")
    assert kaggle_secrets.get_secret("HF_TOKEN") == "hf-123"
    with pytest.raises(UserError) as err:
        kaggle_secrets.get_secret("MY_TOKEN")  # the local store, not the environment, inside a session
    assert "env-value" not in str(err.value)


def test_server_cli_and_admin_endpoint(tmp_path):
    """`serve` in its own process, users/secrets added from the command line, faults through the admin API."""
    import subprocess
    import sys

    module = load_local_kaggle_module()
    script = ["-m", "scripts.local_kaggle"]  # run from the repository root
    root = tmp_path / "root"
    subprocess.run([sys.executable, *script, "user-add", "--root", str(root), USER], input=KEY + "\n", text=True,
                   check=True, cwd=REPO)
    with pytest.raises(subprocess.CalledProcessError):  # no such notebook yet
        subprocess.run([sys.executable, *script, "secret-attach", "--root", str(root), "alice/admin-tool", "TOKEN"],
                       input="t0k\n", text=True, check=True, cwd=REPO, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAGGLE_")}
    server = subprocess.Popen([sys.executable, *script, "serve", "--root", str(root), "--port", "0",
                               "--session-limit", "5", "--queue-delay", "0.1"], env=env, stdout=subprocess.PIPE,
                              text=True, cwd=REPO)
    try:
        line = server.stdout.readline()
        port = int(line.rsplit(" ", 1)[1])
        app = module.LocalKaggle.__new__(module.LocalKaggle)  # only for client_env's proxy URL
        app.port = port
        cenv = client_env(app, tmp_path / "home")
        module.admin_call(root, port, "fault", {"kind": "http", "match": "ListKernels", "status": 500,
                                                "message": "admin-injected"})
        cli = [str(KAGGLE_BIN)]
        out = subprocess.run(cli + ["kernels", "list", "--mine"], env=cenv, capture_output=True, text=True)
        assert out.returncode == 1 and "admin-injected" in out.stderr
        out = subprocess.run(cli + ["kernels", "list", "--mine"], env=cenv, capture_output=True, text=True)
        assert out.returncode == 0 and "Not found" in out.stdout
        kdir = write_kernel(tmp_path / "tool", "alice/admin-tool", "print('hi')")
        out = subprocess.run(cli + ["kernels", "push", "-p", str(kdir)], env=cenv, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        with pytest.raises(RuntimeError, match="403"):
            (root / "admin_token").write_text("wrong")
            module.admin_call(root, port, "clear-faults")
    finally:
        server.terminate()
        server.wait(10)
    assert not (root / "secrets.json").exists()
    subprocess.run([sys.executable, *script, "secret-attach", "--root", str(root), "alice/admin-tool", "TOKEN"],
                   input="t0k\n", text=True, check=True, cwd=REPO)
    assert json.loads((root / "secrets.json").read_text()) == {"alice/admin-tool": {"TOKEN": "t0k"}}
    assert (root / "secrets.json").stat().st_mode & 0o077 == 0


def test_a_modelled_disk_is_what_the_session_reads_and_filling_it_stops_the_session(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.app.settings.disk_bytes = 1_000_000
    # The session reads the disk it is given (shared/kaggle/disk.py), then writes past it into /kaggle/temp;
    # hard links to a file count once.
    code = (f"import os, sys, time\nsys.path.insert(0, {str(REPO)!r})\n"
            "from shared.kaggle.disk import disk_usage\n"
            "from shared.kaggle.env import kaggle_paths\npaths = kaggle_paths()\n"
            "(paths.temp / 'a.bin').write_bytes(b'0' * 400_000)\n"
            "os.link(paths.temp / 'a.bin', paths.temp / 'a-link.bin')\n"
            "print('disk', *disk_usage(paths.temp, paths.working), flush=True)\n"
            "time.sleep(1)\n"
            "(paths.temp / 'b.bin').write_bytes(b'0' * 700_000)\ntime.sleep(30)\n")
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", "alice/fills-its-disk", code)))
    status, message = lk.wait("alice/fills-its-disk", timeout=30)
    assert status == "ERROR" and message.startswith("No space left on device: /kaggle/working and /kaggle/temp hold ")
    assert message.endswith(" bytes of a 1000000-byte disk; the session was stopped")
    dest = tmp_path / "out"
    lk.cli("kernels", "output", "alice/fills-its-disk", "-p", str(dest))
    free, total = map(int, re.search(r"disk (\d+) (\d+)", (dest / "fills-its-disk.log").read_text()).groups())
    assert total == 1_000_000 and 590_000 <= free <= 600_000  # 400 kB once, though linked twice
