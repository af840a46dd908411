"""The eval kernel's whole run (`run_eval`): checkpoint -> Hugging Face export -> validation loss -> HellaSwag ->
samples -> report (and, if asked, a Kaggle Model version: shared/kaggle/models.py). The validation loss itself is
the trainer's (shared/train/validation.py)."""

from __future__ import annotations

import shutil
import time
import traceback
from pathlib import Path

from shared.config import EvalConfig
from shared.data import TokenLoader
from shared.eval.report import HELLASWAG_PNG, LOSS_PNG, REPORT_FILE, THROUGHPUT_PNG
from shared.kaggle.models import upload_kaggle_model
from shared.kaggle.secrets import wandb_key
from shared.train.checkpoint import METRICS_FILE
from shared.train.validation import one_pass_batches, validation_loss
from shared.train_sections import saved_settings

# --- the eval kernel ------------------------------------------------------------------------------------------

REPORT_FILES = (REPORT_FILE, METRICS_FILE, LOSS_PNG, HELLASWAG_PNG, THROUGHPUT_PNG)  # what write_report writes


def _keep_previous_report(out: Path, log) -> None:
    """This run rewrites the report from its first minute; an earlier run's report (or a training run's
    metrics, if --out-dir points there) moves to previous/ instead of being lost if this run fails."""
    old = [out / name for name in REPORT_FILES if (out / name).is_file()]
    if not old:
        return
    previous = out / "previous"
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir()
    for path in old:
        path.rename(previous / path.name)
    log(f"the earlier report in {out} moved to {previous}")


def _find_checkpoint(cfg: EvalConfig, log):
    """The checkpoint to evaluate: a named step directory must verify; under a root, the newest that does."""
    from shared.checkpoint_names import CHECKPOINT_PREFIX
    from shared.errors import UserError
    from shared.train.checkpoint import MANIFEST_FILE, checkpoint_at, latest_checkpoint

    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        ckpt, roots = checkpoint_at(path, log), [path, path / "checkpoints"]
    else:
        from shared.kaggle.env import in_session, kaggle_paths

        if not in_session():
            raise UserError("--checkpoint: give a checkpoint, a checkpoints/ root or a run directory")
        roots = sorted({p.parent for p in kaggle_paths().input.rglob(f"{CHECKPOINT_PREFIX}*")
                        if (p / MANIFEST_FILE).exists()})
        ckpt = latest_checkpoint(*roots, log=log)
    if ckpt is None:
        raise UserError(f"--checkpoint: no checkpoint under {', '.join(map(str, roots)) or 'the Kaggle inputs'}")
    return ckpt


def _hellaswag_file(cfg: EvalConfig, out: Path, log) -> Path | None:
    from shared.errors import UserError
    from shared.train.hellaswag import download

    if cfg.hellaswag == "off":
        return None
    if cfg.hellaswag == "demo":  # offline: a HellaSwag-format set made from the demo corpus
        from shared.train.hellaswag import demo_examples, write_jsonl

        return write_jsonl(out / "hellaswag_demo.jsonl", demo_examples(cfg.hellaswag_examples or 200))
    if cfg.hellaswag in ("auto", "download"):
        try:
            return download(out / "hellaswag_val.jsonl", log)
        except UserError as err:
            if cfg.hellaswag == "download":
                raise
            log(f"notice: HellaSwag skipped ({err})")
            return None
    return Path(cfg.hellaswag)


def _val_shards(cfg: EvalConfig):
    from shared.data import find_shards

    if cfg.data_dir == "off":
        return []
    if cfg.data_dir:
        return find_shards(cfg.data_dir, "val")
    from shared.kaggle.env import in_session, kaggle_paths

    return find_shards(str(kaggle_paths().input), "val") if in_session() else []


def run_eval(cfg: EvalConfig, runtime=None, log=print) -> dict:
    """The eval kernel: every stage writes its result to metrics.jsonl and rewrites the report, so a failure
    later on never loses what was already found. Raises UserError at the end if any stage failed."""
    from shared.errors import UserError
    from shared.eval.hf import export_hf, load_hf
    from shared.eval.report import write_report
    from shared.model.model import GPT
    from shared.runtime.device import make_runtime
    from shared.tokenize.tokenizer import gpt2_encoding
    from shared.train.metrics import MetricsLogger

    started = time.monotonic()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / METRICS_FILE
    notes: list[str] = []

    def warn(message: str) -> None:
        log(message)
        notes.append(message.removeprefix("warning: "))

    # --- the model, and the run's history ------------------------------------------------------------------
    info: dict = {}
    train_cfg: dict = {}
    ckpt = None
    if cfg.hf_model:
        model, step, tokens = load_hf(cfg.hf_model), 0, 0
        info["model"] = f"Hugging Face folder {cfg.hf_model}"
    else:
        ckpt = _find_checkpoint(cfg, log)
        model = GPT.from_checkpoint(ckpt)
        step, tokens = ckpt.step, int(ckpt.state.get("tokens", 0))
        train_cfg = saved_settings(ckpt.state["config"].get("train", {}), "the checkpoint's config")
        info["checkpoint"] = f"{ckpt.path} (step {step} of {train_cfg.get('total_steps', '?')}, {tokens:,} tokens)"
    _keep_previous_report(out, log)  # only now: a model that does not load leaves the folder as it was
    if ckpt is not None and (ckpt.path / METRICS_FILE).exists():
        shutil.copyfile(ckpt.path / METRICS_FILE, metrics_path)
    model.eval()
    mc = model.config
    info["model shape"] = (f"{mc.n_layer} layers, {mc.n_head} heads, {mc.n_embd} wide, {mc.block_size} context, "
                           f"{model.num_params() / 1e6:.2f}M parameters")
    samples: list[dict] = []

    def report() -> Path:
        return write_report(out, metrics_path, info, samples, notes)

    report()
    log(f"report: {out / 'report.md'} (training history only so far)")
    failed: list[str] = []

    def stage(name: str, fn) -> None:
        try:
            fn()
        except UserError as err:
            log(f"error: {name}: {err}")
            notes.append(f"error: {name}: {err}")
            failed.append(name)
        except Exception as err:  # noqa: BLE001 - one stage's bug must not cost the stages after it
            traceback.print_exc()
            first = str(err).splitlines()[0] if str(err) else ""
            log(f"error: {name}: {type(err).__name__}: {first}")
            notes.append(f"error: {name}: {type(err).__name__}: {first}")
            failed.append(name)
        report()

    # --- export first: the model people can use does not wait for the evaluation -------------------------
    def export() -> None:
        folder = export_hf(model, out / "hf", tokenizer=True, ranks_path=cfg.ranks_path or None)
        info["Hugging Face export"] = f"{folder} (GPT2LMHeadModel.from_pretrained / pipeline('text-generation'))"
        log(f"exported {folder}")
        if cfg.kaggle_model:
            upload_kaggle_model(folder, cfg.kaggle_model, f"step {step}, {tokens:,} tokens", log)
            info["Kaggle Model"] = cfg.kaggle_model

    if cfg.export:
        stage("export", export)

    runtime = runtime or make_runtime(cfg.backend)
    info["device"] = runtime.description
    runtime.prepare_model(model, fsdp=False)  # moves `model` in place; its return value may be a wrapper
    project = cfg.wandb_project or train_cfg.get("wandb_project", "")
    run_name = train_cfg.get("run_name") or Path(train_cfg.get("out_dir", "eval")).name
    logger = MetricsLogger(out, max(step, 1), step, {"eval": vars(cfg)}, project, run_name, progress=False,
                           log=log, wandb_key=wandb_key() if project else None)
    summary: dict = {"step": step, "tokens": tokens}

    def record(values: dict) -> None:
        summary.update(values)
        logger.write({"event": "eval", "step": step, "tokens": tokens, **values})

    # --- validation loss ------------------------------------------------------------------------------------
    def val() -> None:
        shards = _val_shards(cfg)
        if not shards:
            if cfg.data_dir != "off":
                warn("warning: no validation shards (--data-dir); validation loss skipped")
            return
        batch = max(runtime.num_devices, -(-cfg.micro_batch // runtime.num_devices) * runtime.num_devices)
        loader = TokenLoader(shards, batch, mc.block_size, shuffle=False)
        batches = one_pass_batches(loader, cfg.val_tokens)
        if batches == 0:
            raise UserError(f"{shards[0].parent}: no validation shard holds one batch of {batch}x{mc.block_size}")
        t0 = time.monotonic()
        loss = validation_loss(model, loader, runtime, batches, cfg.bf16)
        n = batches * loader.tokens_per_batch
        info["validation data"] = f"{len(shards)} shard(s) in {shards[0].parent}, {n:,} tokens scored"
        record({"val_loss": loss, "val_tokens": n})
        log(f"validation loss {loss:.4f} over {n:,} tokens ({time.monotonic() - t0:.0f}s)")

    stage("validation loss", val)

    # --- HellaSwag --------------------------------------------------------------------------------------------
    def hellaswag() -> None:
        from shared.train.hellaswag import evaluate

        path = _hellaswag_file(cfg, out, log)
        if path is None:
            return
        t0 = time.monotonic()
        result = evaluate(model, runtime, path, cfg.hellaswag_examples, cfg.hellaswag_batch, cfg.bf16, warn=warn)
        info["HellaSwag data"] = f"{path} ({result.examples} examples)"
        record(result.to_record())
        log(f"HellaSwag: acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f} over {result.examples} examples "
            f"({time.monotonic() - t0:.0f}s)")

    stage("HellaSwag", hellaswag)

    # --- samples ----------------------------------------------------------------------------------------------
    def sample() -> None:
        from shared.train.sampling import sample_text

        prompts = [p for p in cfg.prompts.split("|") if p.strip()]
        if not prompts:
            return
        enc = gpt2_encoding(cfg.ranks_path or None)
        found = sample_text(model, runtime, prompts, cfg.max_new_tokens, cfg.samples_per_prompt, cfg.temperature,
                            cfg.top_k, cfg.seed, cfg.bf16, enc, warn=warn)
        samples[:] = [{"prompt": s.prompt, "text": s.text} for s in found]
        record({"samples": [s.prompt + s.text for s in found]})
        for s in found:
            log(f"sample: {(s.prompt + s.text)!r}")

    stage("samples", sample)
    logger.close()
    info["evaluation time"] = f"{time.monotonic() - started:.0f}s"
    path = report()
    log(f"report: {path}")
    summary["report"] = str(path)
    if failed:
        raise UserError(f"evaluation finished with errors in: {', '.join(failed)} (report kept at {path})")
    return summary
