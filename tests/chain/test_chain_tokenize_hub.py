"""The chain's tokenize stage reading FineWeb-Edu's layout from the local Hugging Face Hub (scripts/local_hub.py) inside
local Kaggle sessions, which reach it as the internet (issue 31)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from helpers import REPO
from kaggle_fixtures import write_dataset

from scripts.local_hub import LocalHub, build_fineweb_like
from shared.data import read_shard
from shared.kaggle.facts import FACTS_FILE
from shared.tokenize.tokenizer import EOT_TOKEN, gpt2_encoding

PROBE = """
import json, sys
sys.path.insert(0, {repo!r})
from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict
chain = Chain(config_from_dict(json.loads({config!r})), {work!r},
              on_new_notebooks=lambda lines: print(*lines, sep="\\n"))
chain.connect()
{body}
print("RESULT " + json.dumps(chain.state.data.get("tokenize")))
"""


def _documents() -> list[str]:
    from pydoc_data.topics import topics

    return [p for _, text in sorted(topics.items()) for p in text.split("\n\n") if p.strip()]


@pytest.mark.slow
def test_the_chain_tokenizes_two_parts_from_a_gated_hub_with_the_token_secret_through_a_503_outage(
        local_kaggle, tmp_path, gpt2_ranks, image_pythons, monkeypatch):
    """tokenize.hf_token: the part notebooks are saved first, the user attaches HF_TOKEN to each, and the parts read
    a Hub that refuses anonymous requests, in the CPU image's stand-in (datasets 4.0.0, huggingface_hub 1.11.0:
    scripts/image_pins/kaggle-cpu.txt), whose client sends no timeout of its own on the revision's pin: part 0's
    first connection sends nothing, and is cut and retried (issue 50)."""
    lk = local_kaggle
    docs = _documents()
    build_fineweb_like(tmp_path / "hub", docs, files=3, row_group_rows=97)
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ranks", "alice/gpt2-ranks",
                                                         {"gpt2.tiktoken": gpt2_ranks.read_bytes()})))
    token = "hf_chain-test-token-51c2"
    with LocalHub(tmp_path / "hub", token=token) as hub:
        # What the sessions inherit from the local Kaggle (this process): the Hub's address, a cache of their own.
        for name, value in {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_TOKEN": "",
                            "HF_UPDATE_DOWNLOAD_COUNTS": "0", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}.items():
            monkeypatch.setenv(name, value)
        hub.add_fault("503", match="002_00000", count=6, retry_after=0)  # part 1's reads, past the library's retries
        hub.add_fault("silence", match="/api/datasets/", stall_s=600)  # part 0's first request: pinning the revision
        config = {"name": "hub-run", "poll_initial_s": 0.2, "poll_max_s": 1, "eval": {"enabled": False},
                  "tokenize": {"parts": 2, "hf_token": True, "inputs": ["alice/gpt2-ranks"], "settings": {
                      "ranks_path": "{input:alice/gpt2-ranks}/gpt2.tiktoken", "tokens_per_part": 70_000,
                      "shard_size": 20_000, "processes": 1, "batch_docs": 64, "retry_wait_s": 0.2}}}
        def probe(body: str):
            code = PROBE.format(repo=str(REPO), config=json.dumps(config), work=str(tmp_path / "chain"), body=body)
            return lk.python(textwrap.dedent(code), timeout=600)

        contact = probe("chain.notebooks.run()")  # first contact: the notebooks that read secrets, saved
        for part in (0, 1):
            page = f"https://www.kaggle.com/code/alice/hub-run-tokens-part-{part}"
            assert f"attach the secret HF_TOKEN to the tokenize-part-{part} notebook: {page} (Add-ons > Secrets)" \
                in contact.stdout
            lk.app.attach_secret(f"alice/hub-run-tokens-part-{part}", "HF_TOKEN", token)
        proc = probe("chain.tokenize.run()")
        assert json.loads(proc.stdout.splitlines()[-1].removeprefix("RESULT ")) == {"0": "COMPLETE", "1": "COMPLETE"}
        assert (hub.faults_served()["503"], hub.faults_served()["silence"]) == (6, 1)
    kernels = lk.app.state["kernels"]
    tokens, logs = [], {}
    for part in (0, 1):
        ref = f"alice/hub-run-tokens-part-{part}"
        saved, version = kernels[ref]["versions"]  # saved for its secret, then pushed once: the outage was ridden
        assert saved["quick_save"] and not version["quick_save"]  # out in the session, not by another push
        out = lk.app.kernels.output_dir(ref, version["number"])
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["source"]["dataset"] == "HuggingFaceFW/fineweb-edu" and manifest["complete"]
        assert manifest["source"]["revision"] == hub.sha("HuggingFaceFW/fineweb-edu")
        libraries = manifest["libraries"]
        assert (libraries["datasets"], libraries["huggingface_hub"]) == ("4.0.0", "1.11.0")  # the image's, as is
        assert "datasets" not in json.loads((out / FACTS_FILE).read_text()).get("packages", {})
        tokens += [np.asarray(read_shard(out / s["name"])) for s in manifest["shards"]]
        logs[part] = "".join(e["data"] for e in lk.app.kernels.log_events(kernels[ref], version["number"]))
    enc = gpt2_encoding(gpt2_ranks)
    expected = np.array([t for d in docs for t in [EOT_TOKEN, *enc.encode_ordinary(d)]], dtype=np.uint16)
    got = np.concatenate(tokens)
    np.testing.assert_array_equal(got, expected[:got.size])
    assert got.size == expected.size  # the two parts hold the whole stream, in order
    assert all("with the HF_TOKEN secret" in log for log in logs.values())
    assert all(token not in log and "installed datasets" not in log for log in logs.values())
    (cut,) = [line for line in logs[0].splitlines() if line.startswith("retrying:")]
    assert cut.startswith("retrying: HuggingFaceFW/fineweb-edu's revision (nothing received for 2 s, the connection "
                          "was cut: ")
    (retry,) = [line for line in logs[1].splitlines() if line.startswith("retrying:")]
    assert "HTTP 503" in retry and "reopening the stream at document" in retry
