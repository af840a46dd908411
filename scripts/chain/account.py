"""What `--plan` reads of the user's Kaggle account: the weekly accelerator quota and the user's private datasets
(what they take of the private-dataset quota). One attempt each, no retries, and nothing refused where it cannot be
read: the plan must not hang on a machine without network or credentials, and goes on without them."""

from __future__ import annotations

import dataclasses

from scripts.chain.client import KaggleClient
from scripts.chain.config import ChainConfig, one_line
from scripts.chain.limits import MACHINE_SHAPES


def plan_client(cfg: ChainConfig) -> KaggleClient:
    """A client that tries once and says nothing."""
    return KaggleClient(dataclasses.replace(cfg.client, retry_attempts=1), user=cfg.user, log=lambda _: None)


def read_quota(cfg: ChainConfig) -> tuple[tuple[float, float, str] | None, str]:
    """The account's weekly quota when credentials exist ((left, allowed, reset), ''), else (None, why not)."""
    client = plan_client(cfg)
    try:
        client.connect()
        return client.quota_left_s(MACHINE_SHAPES.get(cfg.accelerator)), ""
    except Exception as err:  # no credentials, no network, an old client: the plan goes on without the quota
        return None, one_line(str(err)) or type(err).__name__


def list_private_datasets(cfg: ChainConfig) -> tuple[dict[str, int] | None, str]:
    """({ref: bytes} of the user's private datasets other than the chain's checkpoint datasets, ''), or (None, why
    not) without credentials or network."""
    client = plan_client(cfg)
    try:
        client.connect()
        datasets = client.private_datasets()
    except Exception as err:  # no credentials, no network: the plan goes on with the whole quota
        return None, one_line(str(err)) or type(err).__name__
    ckpts = {client.ref(cfg.slug("checkpoints")), client.ref(cfg.slug("checkpoints-b"))}
    return {ref: size for ref, size in datasets.items() if ref not in ckpts}, ""
