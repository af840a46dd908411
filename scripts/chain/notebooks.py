"""Before any session: the notebooks that read secrets exist, and the user knows which secrets to attach where.

On Kaggle a secret is attached to one notebook, on its page (Add-ons > Secrets), and only once that notebook
exists; no API call attaches one (docs/kaggle-tpu.md, section 6). So the first time the chain meets a config, it
saves the train notebook (and the eval notebook, when that reads secrets) without running it (kagglesdk's
QUICK_SAVE), on no accelerator, and names, a line each, the secrets to attach and the page to attach them on, and
that an editor session opened meanwhile should be stopped. It then waits for the
user (asked on a terminal; otherwise it stops and the same command continues), so that no session starts before
its secrets can exist.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from scripts.chain.context import StageContext
from shared.errors import UserError
from shared.kaggle.credential import CREDENTIAL_NAMES, credential_secrets

WANDB_SECRET = "WANDB_API_KEY"
HF_SECRET = "HF_TOKEN"
QUICK_SAVE_ID = "quick-save"  # the push id a notebook saved without running is built with
KAGGLE_CODE_URL = "https://www.kaggle.com/code/"


def needed_secrets(cfg, kaggle: tuple[str, ...] = CREDENTIAL_NAMES) -> dict[str, list[str]]:
    """{kernel name: the secrets it reads} for the kernels of this config that read any; `kaggle`: the secrets that
    carry the user's Kaggle credential (`credential_secrets`: KAGGLE_API_TOKEN for a user who signs in with an API
    token, else KAGGLE_USERNAME and KAGGLE_KEY)."""
    # The user's own project only: TrainConfig's default one is used where a key exists, none asked for.
    wandb = bool(cfg.train.settings.get("wandb_project"))
    needs = {"train": [*kaggle] + ([WANDB_SECRET] if wandb else [])}
    ev = cfg.eval
    if ev.enabled:
        names = list(kaggle) if ev.config.kaggle_model else []
        if ev.config.wandb_project or wandb:
            names.append(WANDB_SECRET)
        if names:
            needs["eval"] = names
    if cfg.tokenize.hf_token:  # each part is a notebook of its own
        for part in range(cfg.tokenize.parts):
            needs[f"tokenize-part-{part}"] = [HF_SECRET]
    return needs


def attach_line(kernel: str, ref: str, names: list[str] | tuple[str, ...]) -> str:
    """What the user does for notebook `ref`: which secrets to attach, and on which page."""
    return (f"attach the secret{'s' if len(names) > 1 else ''} {', '.join(names)} to the {kernel} notebook: "
            f"{KAGGLE_CODE_URL}{ref} (Add-ons > Secrets)")


def ask_on_terminal(lines: list[str]) -> None:
    """The default for new notebooks: on a terminal, wait for Enter; otherwise stop (the same command goes on)."""
    if sys.stdin is not None and sys.stdin.isatty():
        input("attach them, then press Enter to go on (Ctrl-C to stop; the same command continues later) ")
        return
    raise UserError("attach the secrets named above, then run the same command again; no session has started")


class NotebooksStage:
    def __init__(self, ctx: StageContext, builders: dict[str, Callable[[str], object]],
                 on_new: Callable[[list[str]], None] = ask_on_terminal):
        """`builders`: kernel name -> build(push_id) -> the built folder; `on_new`: called with the lines that
        name the secrets to attach, when this run created notebooks (it returns once they are attached)."""
        self.ctx = ctx
        self.builders = builders
        self.on_new = on_new

    def run(self) -> list[str]:
        """Create the notebooks that read secrets and do not exist yet; returns the refs created."""
        ctx = self.ctx
        created, lines = [], []
        for kernel, names in needed_secrets(ctx.cfg, credential_secrets(ctx.client.api)).items():
            ref = ctx.ref(ctx.cfg.slug(kernel))
            version, _ = ctx.client.kernel_info(ref)
            if version == 0:
                folder = self.builders[kernel](QUICK_SAVE_ID)
                version = ctx.client.quick_save(folder)
                created.append(ref)
                ctx.log(f"created the {kernel} notebook {ref} (version {version}, saved without running)")
            lines.append(attach_line(kernel, ref, names))
        if created:
            lines.append("the notebooks are saved on no accelerator; if attaching opens an editor session, stop it "
                         "(Run > Stop Session) before going on: each session the chain pushes names its own machine")
            for line in lines:
                ctx.log(line)
            self.on_new(lines)
        return created
