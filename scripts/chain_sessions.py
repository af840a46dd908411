#!/usr/bin/env python3
"""Train GPT-2 on Kaggle as a chain of sessions: tokenize parts, train sessions that resume from a checkpoint
dataset, then the eval kernel. Restartable: run the same command again after a kill and it continues.

    python scripts/chain_sessions.py --local-demo          # the whole chain on a local Kaggle, ~2 minutes
    python scripts/chain_sessions.py --config my-run.json --plan  # what it will do; pushes nothing, no credentials
    python scripts/chain_sessions.py --config my-run.json --smoke  # first contact: every link, ~40 min of TPU
    python scripts/chain_sessions.py --config my-run.json  # on Kaggle (KAGGLE_USERNAME/KAGGLE_KEY or kaggle.json)

The config (JSON or TOML; see examples/chain-demo.json and scripts/chain/config.py's ChainConfig) names the model and
batch (`train`), the token parts (`tokenize`), `total_steps`, the `accelerator` and the slugs. The train
kernel needs the Kaggle secrets KAGGLE_USERNAME and KAGGLE_KEY attached to its notebook (Add-ons > Secrets) to
publish its checkpoint: on its first run the chain saves that notebook without running it and says which secrets to
attach on which page. A session that cannot publish leaves its checkpoint in its output, and this script publishes it
from there (a model whose checkpoints must live in /kaggle/temp stops before training instead).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.chain.chain import Chain  # noqa: E402
from scripts.chain.config import load_config  # noqa: E402
from shared.errors import UserError, run_cli  # noqa: E402

DEMO_CONFIG = REPO / "examples" / "chain-demo.json"
DEMO_USER, DEMO_KEY = "alice", "local-demo-key"


def make_demo_corpus(folder: Path, max_chars: int) -> list[Path]:
    """Python's own documentation as a jsonl corpus (real English text, offline), and GPT-2's BPE ranks."""
    from shared.tokenize.demo_corpus import demo_documents
    from shared.tokenize.tokenizer import fetch_gpt2_ranks

    folder.mkdir(parents=True, exist_ok=True)
    docs = folder / "docs.jsonl"
    with open(docs, "w", encoding="utf-8") as f:
        for text in demo_documents(max_chars):
            f.write(json.dumps({"text": text}) + "\n")
    ranks = folder / "gpt2.tiktoken"
    shutil.copyfile(fetch_gpt2_ranks(), ranks)
    return [docs, ranks]


def ensure_corpus_dataset(chain: Chain, ref: str, max_chars: int) -> None:
    """Upload the demo corpus as a dataset (once) for the tokenize kernel to read."""
    from shared.kaggle.publish import push_dataset_folder, write_dataset_folder

    if chain.client.dataset_exists(ref):
        return
    files = make_demo_corpus(chain.workdir / "corpus", max_chars)
    folder = write_dataset_folder(chain.workdir / "corpus-upload", ref, "GPT-2 demo corpus", files)
    chain.client.call(f"create dataset {ref}", push_dataset_folder, chain.client.api, folder, ref, "demo corpus")
    print(f"uploaded the demo corpus ({files[0].stat().st_size / 1e6:.1f} MB of Python documentation) as {ref}")


def local_demo(args) -> dict:
    """Start a local Kaggle under the work dir with a user, upload the demo corpus, and run the chain against it,
    attaching the secrets to the notebooks the chain creates."""
    workdir = Path(args.workdir or REPO / "runs" / "chain-demo")
    state = workdir / "chain" / "state.json"
    if state.exists() and json.loads(state.read_text()).get("done"):
        print(f"the previous demo in {workdir} finished; starting a new one")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config or DEMO_CONFIG, overrides=_overrides(args))
    from scripts.chain.notebooks import needed_secrets
    from scripts.chain.smoke import run_smoke, smoke_config
    from scripts.local_kaggle import LocalKaggle

    run_cfg = smoke_config(cfg) if args.smoke else cfg
    app = LocalKaggle(workdir / "kaggle", users={DEMO_USER: DEMO_KEY}, queue_delay_s=0.2,
                      session_limit_s=max(cfg.session_limit_s, run_cfg.session_limit_s,
                                          cfg.eval_session_limit_s)).start()

    def attach_secrets(lines: list[str]) -> None:
        """What the user does on each new notebook's page (Add-ons > Secrets), done for them here."""
        values = {"KAGGLE_USERNAME": DEMO_USER, "KAGGLE_KEY": DEMO_KEY}
        for kernel, names in needed_secrets(run_cfg).items():
            for name in names:
                if name in values:
                    app.attach_secret(f"{DEMO_USER}/{run_cfg.slug(kernel)}", name, values[name])
        print("local demo: attached them, as you would on each notebook's page")

    for var in [v for v in os.environ if v.startswith("KAGGLE_")]:
        del os.environ[var]
    os.environ.update(app.client_env(DEMO_USER, DEMO_KEY))
    os.environ["KAGGLE_CONFIG_DIR"] = str(workdir / "kaggle-config")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    print(f"local Kaggle on port {app.port}, state in {workdir / 'kaggle'}; {session_words(run_cfg)}")
    def make_chain(chain_cfg, chain_dir: Path) -> Chain:
        chain = Chain(chain_cfg, chain_dir, on_new_notebooks=attach_secrets)
        chain.connect()
        for ref in chain_cfg.tokenize.inputs:
            ensure_corpus_dataset(chain, ref, args.demo_chars)
        return chain

    try:
        if args.smoke:
            return {"readiness": run_smoke(cfg, workdir / "chain", make_chain)}
        result = make_chain(cfg, workdir / "chain").run()
        print(f"demo results: {workdir / 'chain'} (loss.png, metrics.jsonl, sessions/*/ logs, eval/report.md); "
              f"the local Kaggle's files: {workdir / 'kaggle'}")
        return result
    finally:
        app.stop()


def session_words(cfg) -> str:
    """How long the train sessions last, in words."""
    from scripts.chain.sizing import MIN_STEPS

    if not cfg.session_train_s:
        return f"train sessions of {cfg.session_limit_s:g} s"
    return (f"each train session trains {cfg.session_train_s:g} s (more where {MIN_STEPS} steps take longer) from the "
            f"end of its first step, whatever its start-up takes, then {cfg.publish_margin_s:g} s to publish, within "
            f"{cfg.session_limit_s:g} s; the first, before anything is measured, {MIN_STEPS} steps: start-up here "
            "(packages, imports, compilation) is most of a session, and varies with the machine's load")


def check_step_fits(cfg) -> None:
    """Before a chain on Kaggle pushes anything: its train step compiled for its TPU by libtpu (cached), refused
    in one line where it does not fit the chips' HBM. A local Kaggle runs its sessions on this machine's CPU."""
    if os.environ.get("KAGGLE_API_ENVIRONMENT") == "LOCALHOST":
        return
    from scripts.chain.plan import compiled_fit

    _, line = compiled_fit(cfg, log=lambda msg: print(msg, flush=True))
    print(f"TPU compiler: {line}", flush=True)


def _overrides(args) -> dict:
    return {"total_steps": args.total_steps, "max_train_sessions": args.max_train_sessions}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="chain config (.json or .toml)")
    parser.add_argument("--workdir", help="state, logs, metrics and plots (default: runs/chain/<name>)")
    parser.add_argument("--local-demo", action="store_true",
                        help="run the whole chain on a local Kaggle (default config examples/chain-demo.json)")
    parser.add_argument("--demo-chars", type=int, default=400_000, help="local demo: characters of corpus text")
    parser.add_argument("--plan", action="store_true",
                        help="print the plan (stages, machines, tokens, sessions, quota, checkpoint, margins) and "
                             "exit; pushes nothing and needs no credentials")
    parser.add_argument("--smoke", action="store_true",
                        help="first contact: a short chain of its own (one small tokenize part, two short train "
                             "sessions (at most 32 min each for gpt2: a TPU's start-up, 4 min of training, the "
                             "publish), an eval on a subset) that proves every link on your account and measures your "
                             "TPU, then a readiness report; under 100 min of TPU quota for gpt2")
    parser.add_argument("--total-steps", type=int, help="override the config's total_steps")
    parser.add_argument("--max-train-sessions", type=int, help="override the config's max_train_sessions")
    args = parser.parse_args(argv)
    if args.local_demo and not args.plan:
        return local_demo(args)
    config = args.config or (str(DEMO_CONFIG) if args.local_demo else "")
    if not config:
        raise UserError("give --config FILE (or --local-demo)")
    cfg = load_config(config, overrides=_overrides(args))
    if args.plan:  # of the chain a command without --plan would run: the smoke chain where --smoke is given
        from scripts.chain.fill import apply_fill, session_fill, unmeasured_line
        from scripts.chain.plan import print_plan
        from scripts.chain.smoke import smoke_config

        fill = None if args.smoke else session_fill(cfg)
        if cfg.fill_session and not args.smoke:
            print(fill.line if fill else unmeasured_line(cfg))
        return print_plan(smoke_config(cfg) if args.smoke else apply_fill(cfg, fill), source=config)
    check_step_fits(cfg)
    if args.smoke:
        from scripts.chain.smoke import run_smoke

        workdir = Path(args.workdir or REPO / "runs" / "chain" / f"{cfg.name}-smoke")
        return {"readiness": run_smoke(cfg, workdir, lambda smoke_cfg, folder: Chain(smoke_cfg, folder))}
    workdir = Path(args.workdir or REPO / "runs" / "chain" / cfg.name)
    if cfg.fill_session:
        from scripts.chain.fill import fixed_fill
        from scripts.chain.state import State

        cfg = fixed_fill(cfg, State(workdir / "state.json"))
    return Chain(cfg, workdir).run()


if __name__ == "__main__":
    try:
        run_cli(main)
    except KeyboardInterrupt:
        print("interrupted; run the same command again to continue", file=sys.stderr)
        raise SystemExit(130) from None
