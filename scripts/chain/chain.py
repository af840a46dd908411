"""The chain: from one config, the tokenize parts, then train sessions until total_steps, then the eval kernel,
each stage recorded in the state file so that a chain killed at any point continues where it was."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

from scripts.chain.checkpoints import newest_proven
from scripts.chain.client import KaggleClient
from scripts.chain.config import ChainConfig
from scripts.chain.context import StageContext
from scripts.chain.eval_stage import EvalStage
from scripts.chain.limits import shape_notices
from scripts.chain.notebooks import NotebooksStage, ask_on_terminal
from scripts.chain.state import State
from scripts.chain.tokenize_stage import TokenizeStage
from scripts.chain.train_stage import TrainStage
from shared.checkpoint_names import checkpoint_name
from shared.errors import UserError


class Chain:
    """The stages over one client and one state file: `chain.client` (Kaggle calls), `chain.ctx` (what the
    stages share: pushing once, waiting for a version), `chain.notebooks`, `chain.tokenize`, `chain.train`,
    `chain.eval`. `on_new_notebooks(lines)`: what happens once the chain has created notebooks whose secrets the
    user must attach (default: wait on a terminal, else stop; see scripts/chain/notebooks.py)."""

    def __init__(self, cfg: ChainConfig, workdir: str | os.PathLike, api=None, log: Callable[[str], None] = print,
                 sleep: Callable[[float], None] = time.sleep,
                 on_new_notebooks: Callable[[list[str]], None] = ask_on_terminal):
        self.cfg = cfg
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state = State(self.workdir / "state.json")
        self.client = KaggleClient(cfg.client, api=api, user=cfg.user, log=log, sleep=sleep)
        self.ctx = StageContext(cfg, self.client, self.state, self.workdir)
        self.tokenize, self.train, self.eval = TokenizeStage(self.ctx), TrainStage(self.ctx), EvalStage(self.ctx)
        parts = {f"tokenize-part-{n}": functools.partial(self.tokenize.build, n)
                 for n in range(cfg.tokenize.parts)}
        self.notebooks = NotebooksStage(self.ctx, {"train": self.train.build, "eval": self.eval.build, **parts},
                                        on_new_notebooks)

    def connect(self) -> None:
        self.client.connect()

    def check_inputs(self) -> None:
        """Every input the config names exists, before anything is pushed."""
        cfg, client = self.cfg, self.client
        for ref in [*cfg.tokenize.inputs, *cfg.token_datasets, *cfg.eval.inputs]:
            if not client.dataset_exists(ref):
                raise UserError(f"dataset {ref} does not exist (or is not visible to {client.user}); check the config")
        for ref in cfg.token_kernels:
            version, _ = client.kernel_info(ref)
            if not version:
                raise UserError(f"kernel {ref} does not exist (or is not visible to {client.user}); check "
                                "token_kernels")

    def reopen(self) -> None:
        """A finished chain run again with a higher total_steps trains on (train.extend: from where the stable
        phase ended) and evaluates the new final checkpoint; its earlier eval is kept as eval-step_NNNNNN/."""
        cfg, data = self.cfg, self.state.data
        final = int(data.get("final_step") or 0)
        if cfg.total_steps <= max(final, int(data.get("total_steps") or 0)):
            raise UserError(f"this chain is already finished (step {final} of total_steps {cfg.total_steps}; results "
                            f"in {self.workdir}); raise total_steps to train further")
        used = len(data.get("train_sessions") or [])
        if cfg.max_train_sessions and used >= cfg.max_train_sessions:
            raise UserError(f"this chain has used its max_train_sessions ({used} of {cfg.max_train_sessions}); raise "
                            f"it too to train on to total_steps {cfg.total_steps}")
        earlier = data.pop("eval", None)
        if earlier:
            kept = self.workdir / f"eval-{checkpoint_name(final)}"
            if Path(earlier.get("dir", "")).is_dir() and not kept.exists():
                Path(earlier["dir"]).rename(kept)
                earlier["dir"] = str(kept)
            data.setdefault("earlier_evals", []).append({**earlier, "step": final})
        self.state.pushes.pop("eval", None)  # the new final checkpoint gets an eval session of its own
        data["done"] = False
        self.state.save()
        self.ctx.log(f"chain {cfg.name} finished at step {final}; training on to total_steps {cfg.total_steps}"
                     + (" (train.extend: from where the stable phase ended)"
                        if cfg.train.config.lr_schedule.extend else ""))

    def run(self) -> dict:
        cfg, data, log = self.cfg, self.state.data, self.ctx.log
        if data.get("done"):
            self.reopen()
        self.connect()
        log(f"chain {cfg.name}: {cfg.total_steps} steps on {cfg.accelerator or 'CPU'} as {self.client.user}; "
            f"state {self.state.path}")
        for notice in shape_notices({cfg.accelerator, cfg.eval.accelerator, cfg.tokenize.accelerator}):
            log(notice)
        self.check_inputs()
        self.train.check_work_left()
        self.notebooks.run()
        self.tokenize.run()
        self.train.run()
        self.eval.run()
        # The step read from the newest version of the checkpoint dataset holding the newest checkpoint of the two;
        # total_steps kept: only a higher one trains on.
        ckpt_ref, _, final_step = newest_proven(self.ctx)
        data.update(done=True, final_step=final_step, total_steps=cfg.total_steps)
        self.state.save()
        log(f"done: step {data['final_step']} of {cfg.total_steps} in {len(data['train_sessions'])} train sessions.")
        log(f"results: {self.workdir}  (metrics.jsonl, loss.png, sessions/ with each session's log, eval/)")
        log(f"checkpoint: Kaggle dataset {ckpt_ref}")
        return data
