"""Validation inside training: the loss over the validation shard(s), sharded over all devices like training, and
the periodic evaluation every `eval_every` steps (validation loss, the model's health, a HellaSwag subset, one
sample). The eval kernel (shared/eval/evaluate.py) uses the same validation loss. HellaSwag scoring and sampling
(shared/train/hellaswag.py, shared/train/sampling.py) are imported only where a run asks for them."""

from __future__ import annotations

import torch

from shared.data import TokenLoader
from shared.train.health import health_record


@torch.no_grad()
def validation_loss(model: torch.nn.Module, loader: TokenLoader, runtime, batches: int, bf16: bool = True) -> float:
    """Mean loss over the first `batches` batches of `loader` (rewound each time, so evals are comparable);
    at most one pass, so that no batch counts twice."""
    batches = min(batches, loader.batches_per_pass())
    rewind(loader)
    total = torch.zeros((), device=runtime.device)
    runtime.sync()  # `total` as device data: every batch below is then the same graph
    for _ in range(batches):
        batch = runtime.batch_to_device(loader.next_batch())
        with runtime.autocast(bf16):
            _, loss = model(batch[:, :-1], batch[:, 1:])
        total += loss.detach().float()
        runtime.sync()
    return runtime.mean_across(total).item() / batches  # under DDP each process saw its own rows


def rewind(loader: TokenLoader) -> None:
    """The loader back at its first batch (validation reads the same batches every time)."""
    loader.state.epoch = loader.state.shard_index = loader.state.offset = 0


def first_rows(loader: TokenLoader, rows: int):
    """The first `rows` rows of the loader's first batch (the loader rewound first; its next read starts over)."""
    rewind(loader)
    batch = loader.next_batch()
    rewind(loader)
    return batch[: min(rows, batch.shape[0])]


def one_pass_batches(loader: TokenLoader, max_tokens: int = 0) -> int:
    """Batches in one pass over `loader`'s shards (a batch never spans two shards), at most `max_tokens`."""
    total = loader.batches_per_pass()
    if max_tokens:
        total = min(total, max(1, max_tokens // loader.tokens_per_batch))
    return total


# --- inside training ------------------------------------------------------------------------------------------

_hellaswag_cache: dict[tuple, object] = {}  # (file, examples, block size) -> Encoded, or the error met loading it
_warned: set[str] = set()


def _warn_once(log):
    def warn(message: str) -> None:
        if message not in _warned:
            _warned.add(message)
            log(message)
    return warn


def _training_hellaswag(path: str, examples: int, block_size: int, log):
    """The encoded HellaSwag subset for in-training evals (a seeded random `examples` of the file, 0: all), read once
    per process; None if it cannot be."""
    from shared.errors import UserError
    from shared.train.hellaswag import encode, read_jsonl, sample_examples, truncation_warning

    key = (path, examples, block_size)
    if key not in _hellaswag_cache:
        try:
            data = encode(sample_examples(read_jsonl(path, warn=log), examples), block_size)
            if data.truncated:
                log(truncation_warning(data, block_size))
            _hellaswag_cache[key] = data
        except UserError as err:
            log(f"warning: HellaSwag during training is off: {err}")
            _hellaswag_cache[key] = None
    return _hellaswag_cache[key]


def periodic_eval(model, runtime, cfg, step: int, tokens: int, val_loader: TokenLoader | None, logger,
                  hellaswag: bool = True) -> dict:
    """The evaluation every `cfg.evals.eval_every` steps: validation loss and the model's health (weight RMS and the
    largest attention logit, shared/train/health.py; when there are validation shards), HellaSwag (with `hellaswag`)
    on `cfg.evals.hellaswag_examples` seeded random examples of `cfg.evals.hellaswag_file` (when set), and one sample
    from `cfg.evals.sample_prompt` (when set). Each result is one record in the metrics JSONL (and W&B).

    All of it runs with fixed shapes (the same batches, rows and cache every time), so after the first eval it
    compiles nothing new; the sample uses its own seeded generator and leaves the training RNG alone.
    """
    log = getattr(logger, "log", print)
    results: dict = {}
    if val_loader is not None:
        results["val_loss"] = validation_loss(model, val_loader, runtime, cfg.evals.eval_batches, cfg.step.bf16)
        logger.write({"step": step, "tokens": tokens, "val_loss": results["val_loss"]})
        health = health_record(model, runtime, first_rows(val_loader, runtime.num_devices), cfg.step.bf16)
        results.update(health)
        logger.write({"step": step, "tokens": tokens, **health})
    block_size = model.config.block_size
    evals = cfg.evals
    if hellaswag and evals.hellaswag_file:
        data = _training_hellaswag(evals.hellaswag_file, evals.hellaswag_examples, block_size, log)
        if data is not None:
            from shared.train.hellaswag import score

            # About one training micro-batch of tokens per forward pass: the memory training already needs.
            rows = max(1, cfg.step.micro_batch * block_size // data.length)
            result = score(model, runtime, data, rows, cfg.step.bf16)
            results.update(result.to_record())
            logger.write({"step": step, "tokens": tokens, **result.to_record()})
    if evals.sample_prompt:
        from shared.train.sampling import sample_text

        (sample,) = sample_text(model, runtime, [evals.sample_prompt], evals.sample_tokens,
                                seed=cfg.model.seed, bf16=cfg.step.bf16, warn=_warn_once(log))
        results["sample"] = sample.prompt + sample.text
        logger.write({"step": step, "tokens": tokens, "sample": results["sample"]})
    return results
