"""`scripts/chain_sessions.py --config X --smoke`: a first-contact run that proves every link of a chain on the
user's own account before a week of quota goes into it, and measures their TPU.

From the config it derives a short chain of its own (`<name>-smoke`, its own kernels and checkpoint dataset):
one tokenize part of about 50M tokens; a train session on the chain's accelerator (for gpt2 at most 32 minutes:
a TPU's start-up with the probes' whole budget, 4 minutes of training counted from the end of the first step, the
checkpoint's publish; it ends once it has trained) that checkpoints and publishes; a second one that
resumes from that checkpoint (the step it starts from is checked); an eval on a subset. It ends with a readiness
report, a row per link, and records the tokens/s it measured for `--plan` (scripts/chain/plan.py). A config's
`smoke` section can change any of SMOKE_DEFAULTS (scripts/chain/config.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from scripts.chain.checkpoint_room import keeps_stable, publish_needs_s
from scripts.chain.config import SMOKE_DEFAULTS, ChainConfig, config_from_dict, one_line
from scripts.chain.limits import MACHINE_SHAPES
from scripts.chain.plan import MEASURED_THROUGHPUT, SHAPE_GENERATION, planned_train, running_shape
from shared.errors import UserError
from shared.kaggle.facts import FACTS_FILE
from shared.kaggle.publish import PUBLISH_RECORD
from shared.train.throughput import Throughput, session_throughput

# What a first contact may cost, said before it starts: gpt2's three sessions at their limits (each a TPU's
# start-up margin, 1,310 s, 4 minutes of training and the publish's 359 s) come to 95.5 minutes.
SMOKE_TPU_BUDGET_S = 100 * 60


def smoke_config(cfg: ChainConfig) -> ChainConfig:
    """The short chain: the same model, batch and machines as `cfg`, its own slugs, two short train sessions,
    one small tokenize part, an eval on a subset; checked like any config."""
    s = {**SMOKE_DEFAULTS, **cfg.smoke}  # the keys were checked with the config
    raw = cfg.raw()
    changes = {"profile_steps": int(s["profile_steps"])}  # a trace to hold against the roofline
    if keeps_stable(cfg.train.config) and not cfg.train.config.lr_schedule.extend:
        changes["keep_stable"] = False  # two short sessions never reach the end of a wsd run's stable phase
    train = {"settings": {**cfg.train.settings, **changes}}
    # With checkpoints in /kaggle/temp (gpt2-large/xl) the session also waits for its own version to settle.
    publish = s["publish_margin_s"] or max(120.0, 60.0 + publish_needs_s(
        cfg.train.config.replace(**changes), cfg.checkpoint_bytes))
    limit = s["session_limit_s"] or math.ceil(s["startup_margin_s"] + publish + s["train_s"])
    if limit <= s["startup_margin_s"] + publish:
        raise UserError(f"{cfg.name}: smoke.session_limit_s {limit:g} leaves no training time after the smoke's "
                        f"start-up ({s['startup_margin_s']:g} s) and publish ({publish:.0f} s) margins; raise it, or "
                        "set it 0 to add smoke.train_s to them")
    raw.update(name=f"{cfg.name}-smoke", slugs={k: f"{v}-smoke" for k, v in cfg.slugs.items()},
               train=train, max_train_sessions=2, max_failed_sessions=1, session_limit_s=limit, session_train_s=0,
               startup_margin_s=s["startup_margin_s"], publish_margin_s=publish, smoke={})
    tok = cfg.tokenize
    if tok.parts:
        shard = min(tok.config.shard_size, int(s["shard_size"]))
        raw["tokenize"] = {**cfg.tokenize.raw(), "parts": 1,
                           "settings": {**tok.settings, "tokens_per_part": int(s["tokens"]), "shard_size": shard}}
    ev = {**cfg.eval.settings, "val_tokens": int(s["val_tokens"]), "kaggle_model": "",
          "samples_per_prompt": 1, "max_new_tokens": 16}
    if cfg.eval.config.hellaswag != "off":
        ev["hellaswag_examples"] = int(s["hellaswag_examples"])
    raw["eval"] = {**cfg.eval.raw(), "settings": ev,
                   "session_limit_s": min(cfg.eval_session_limit_s,
                                          float(s["eval_session_limit_s"] or limit))}
    return config_from_dict(raw, f"{cfg.name} smoke")


def quota_cost_s(smoke: ChainConfig) -> float:
    """The most TPU (or GPU) quota the smoke run can use: each session on the accelerator, at its limit."""
    kind = MACHINE_SHAPES.get(smoke.accelerator)
    if not kind:
        return 0.0
    eval_on_it = smoke.eval.enabled and MACHINE_SHAPES.get(smoke.eval.accelerator) == kind
    return smoke.max_train_sessions * smoke.session_limit_s + int(bool(eval_on_it)) * smoke.eval_session_limit_s


# --- the readiness report ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    link: str
    ok: bool | None  # None: not checkable here (e.g. no TPU on the local Kaggle)
    detail: str

    @property
    def mark(self) -> str:
        return {True: "✓", False: "✗", None: "–"}[self.ok]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _session_records(folder: Path) -> tuple[dict, dict, list[dict]]:
    """(session_start, session_end, all records) of the session whose output is in `folder`: the last session in
    its metrics.jsonl (a resumed run's file starts with the earlier sessions' records)."""
    from shared.train.metrics import last_session_records

    mine = last_session_records(folder / "train" / "metrics.jsonl")
    start = mine[0] if mine else {}
    end = next((r for r in mine if r.get("event") == "session_end"), {})
    return start, end, mine


def readiness_rows(smoke: ChainConfig, workdir: Path, failure: str = "", roofline_settings: dict | None = None,
                   compile_step: Callable | None = None) -> tuple[list[Row], dict]:
    """A row per link, from the state file and what the sessions left in their outputs; and the measurement.
    `roofline_settings`: the run's train settings, whose step the TPU compiler compiled before the smoke started
    (`compile_step`: scripts/tpu_compile_step.py, cached), for the measured step time against its roofline."""
    state = _read_json(workdir / "state.json")
    sessions = state.get("train_sessions", [])
    folders = [workdir / "sessions" / f"train-{s['n']:02d}" for s in sessions]
    s1 = _session_records(folders[0]) if folders else ({}, {}, [])
    s2 = _session_records(folders[1]) if len(folders) > 1 else ({}, {}, [])
    facts = _read_json(folders[0] / FACTS_FILE) if folders else {}
    local = bool(facts.get("session", {}).get("local_kaggle"))
    rows = []
    if smoke.tokenize.parts:
        done = state.get("tokenize", {}).get("0") == "COMPLETE"
        secs = state.get("tokenize_seconds", {}).get("0")
        rows.append(Row("tokenize part", done, f"{smoke.tokenize.config.tokens_per_part:,} tokens"
                        + (f" in {secs:.0f} s" if secs else "") if done else "not complete"))
    rows.append(_packages_row(facts))
    rows.append(_secrets_row(facts))
    rows.append(_device_row(smoke, s1[0], local))
    rows.append(Row("attention kernel", bool(s1[0].get("attention")) or None,
                    s1[0].get("attention") or "not reported"))
    rows.append(_jax_row(s1[0], local))
    rows.append(_resume_row(s1[1], s2[0]))
    rows.append(_compile_row(s1[1], s2[1], local))
    # Session 2's where it measured (no first compile in it: the cache came back), else session 1's.
    throughput, measured_in = next(((found, n) for n, records in ((2, s2[2]), (1, s1[2]))
                                    if (found := session_throughput(records))), (None, 0))
    rate, mfu = (throughput.tokens_per_s, throughput.mfu) if throughput else (None, None)
    rows.append(Row("tokens/s and MFU", bool(throughput),
                    f"{throughput.describe()}{'' if mfu else ', MFU n/a (no TPU)'} (session {measured_in}: "
                    f"{throughput.steps} steps in {throughput.seconds:.1f} s after its first log window)"
                    if throughput else "no step logged after the first log window"))
    rows.append(roofline_row(roofline_settings or {}, (s2 if measured_in == 2 else s1)[0], throughput, local,
                             compile_step))
    rows.append(_profile_row(folders))
    rows.append(_publish_row(sessions, folders))
    gap = (s2[0].get("unix_time") or 0) - (s1[1].get("unix_time") or 0)
    rows.append(Row("session 1 end -> session 2 start", gap > 0 if s2[0] else False,
                    f"{gap:.0f} s (publish, queue, start-up)" if s2[0] and gap > 0 else "no second session"))
    rows.append(_eval_row(smoke, state, workdir))
    if failure:
        rows.append(Row("chain", False, failure))
    train, _ = planned_train(smoke)
    measured = {"accelerator": running_shape(smoke.accelerator), "preset": train.model.preset,
                "seq_len": train.model.shape.block_size, "tokens_per_s": rate, "mfu": mfu,
                "mfu_llmc": throughput.mfu_llmc if throughput else None, "chain": smoke.name,
                "measured_at": time.strftime("%Y-%m-%d %H:%M"), "attention": s1[0].get("attention"),
                "tpu": s1[0].get("tpu"), "local_kaggle": local}
    return rows, measured


def roofline_row(settings: dict, start: dict, throughput: Throughput | None, local: bool,
                 compile_step: Callable | None = None) -> Row:
    """The measured step time beside the TPU compiler's roofline for the same step (the kernel the session's probes
    chose, `micro_batch` as the session resolved it), as a ratio: how far the first real session is from what the
    compiler says the chips could do."""
    link = "step time / roofline"
    if local:
        return Row(link, None, "local Kaggle: its CPUs are no TPU")
    if throughput is None or not start.get("tpu") or not settings:
        return Row(link, None, "no TPU step measured")
    from scripts.chain.plan import STEP_NAMES
    from scripts.tpu_compile_step import KAGGLE_TPUS, TPUS
    from scripts.tpu_compile_step import compile_step as compile_tool
    from shared.config import TrainConfig
    from shared.model.attention import SDPA, SETTING_OF

    tpu = next((name for name in KAGGLE_TPUS if TPUS[name]["generation"] == start["tpu"]), None)
    if tpu is None:
        return Row(link, None, f"no compiler target for TPU {start['tpu']}")
    attention = start.get("attention") or SDPA
    try:
        report = (compile_step or compile_tool)(settings, tpu, lambda _: None, attention=SETTING_OF[attention])
    except Exception as err:  # noqa: BLE001 - no compiler here, or it failed: the row says so, the report goes on
        return Row(link, None, f"not compared: {one_line(str(err))}")
    measured_s = TrainConfig.from_dict(settings).step.total_batch_tokens / throughput.tokens_per_s
    roofline_s = report["step_s"]
    detail = (f"measured {measured_s * 1e3:,.0f} ms a step, the compiler's roofline {roofline_s * 1e3:,.0f} ms "
              f"({measured_s / roofline_s:.2f}x) for the {STEP_NAMES.get(attention, attention)} step at micro-batch "
              f"{report['micro_batch']} on {tpu}")
    if report.get("step_mxu_s"):
        detail += f"; {measured_s / report['step_mxu_s']:.2f}x with its kernels at the head dim's MXU share"
    if start.get("micro_batch") not in (None, report["micro_batch"]):
        detail += f" (the session ran micro-batch {start['micro_batch']})"
    return Row(link, True, detail)


def _profile_row(folders: list[Path]) -> Row:
    traces = sorted(p for folder in folders for p in (folder / "train" / "profile").rglob("*.xplane.pb"))
    if not traces:
        return Row("profile", None, "no trace came back (train.profile_steps 0, or the profiler failed: see the log)")
    size = sum(p.stat().st_size for p in traces)
    return Row("profile", True, f"{len(traces)} trace(s), {size / 1e6:.1f} MB, for TensorBoard's profile plugin: "
                                f"{traces[-1].parent}")


def _packages_row(facts: dict) -> Row:
    packages = facts.get("packages", {})
    if not packages:
        return Row("packages", None, "none asked for, or no facts from session 1")
    parts = []
    for name, how in sorted(packages.items()):
        if how.get("from") == "installed":
            parts.append(f"{name} installed ({how.get('seconds', 0):.0f} s)")
        else:
            parts.append(f"{name} {'in the image' if how.get('from') == 'image' else 'MISSING'}")
    return Row("packages", all(h.get("from") != "missing" for h in packages.values()), ", ".join(parts))


def _secrets_row(facts: dict) -> Row:
    secrets = facts.get("secrets", {})
    if not secrets:
        return Row("secrets", None, "none read in session 1")
    missing = sorted(n for n, found in secrets.items() if not found)
    return Row("secrets", not missing, f"missing: {', '.join(missing)}" if missing
               else f"{', '.join(sorted(secrets))} found")


def _device_row(smoke: ChainConfig, start: dict, local: bool) -> Row:
    if not start:
        return Row("device", False, "session 1 did not start training")
    expected = SHAPE_GENERATION.get(running_shape(smoke.accelerator))
    detail = f"{start.get('device')}, TPU {start.get('tpu') or 'none'}"
    if local:
        return Row("device", None, f"{detail} (the local Kaggle has no TPU)")
    return Row("device", start.get("tpu") == expected if expected else True,
               detail + (f" (expected {expected})" if expected and start.get("tpu") != expected else ""))


def _jax_row(start: dict, local: bool) -> Row:
    """The TPU image's jax, jaxlib and libtpu against those the Pallas kernels are written against (shared/tpu.py
    PLAN_TPU_VERSIONS: splash's backward rule is jax's private one, shared/model/splash.py; the Mosaic version
    ladder is jax's, shared/runtime/mosaic_version.py). The image leaves jax unpinned (docs/kaggle-tpu.md, section 1):
    a rebuild that moves it is a ✗ here, not only a notice in the session's log."""
    from shared.tpu import PLAN_TPU_VERSIONS

    versions = start.get("versions") or {}
    if not versions:
        return Row("jax", None, "session 1 reported no versions")
    here = ", ".join(f"{name} {versions.get(name) or '-'}" for name in (*PLAN_TPU_VERSIONS, "torchax", "mosaic")
                     if name != "mosaic" or versions.get(name))
    if local:
        return Row("jax", None, f"{here} (the local Kaggle has no TPU: its jax is the stand-in's)")
    differ = [name for name, planned in PLAN_TPU_VERSIONS.items() if versions.get(name) != planned]
    if not differ:
        return Row("jax", True, f"{here}: those the kernels are written against")
    planned = ", ".join(f"{name} {PLAN_TPU_VERSIONS[name]}" for name in differ)
    return Row("jax", False, f"{here}; the kernels are written against {planned} (splash's backward rule, the "
                             "Mosaic version ladder: shared/tpu.py PLAN_TPU_VERSIONS)")


def _resume_row(end1: dict, start2: dict) -> Row:
    if not start2:
        return Row("resume", False, "no second session started training")
    ok = start2.get("step") == end1.get("step") and bool(end1)
    return Row("resume", ok, f"session 2 started at step {start2.get('step')}, session 1 ended at "
                             f"{end1.get('step')}")


def _compile_row(end1: dict, end2: dict, local: bool) -> Row:
    if not end1:
        return Row("compile", False, "session 1 did not finish")
    cache = end2.get("compile_cache") or {}
    detail = f"session 1: {end1.get('compile_s', 0):.0f} s"
    if not end2:
        return Row("compile", False, detail + "; no second session")
    hits, unloadable = cache.get("hits", 0), cache.get("unloadable", 0)
    detail += (f"; session 2: {end2.get('compile_s', 0):.0f} s, cache hits {hits}, found but not loadable "
               f"{unloadable}, misses {cache.get('misses', 0)}")
    if local and not hits and unloadable:  # the graphs travelled; torch_xla's CPU backend cannot load them
        return Row("compile", None, detail + " (the CPU backend cannot load compiled graphs)")
    return Row("compile", hits > 0, detail)


def _publish_row(sessions: list[dict], folders: list[Path]) -> Row:
    if not sessions:
        return Row("publish", False, "no session")
    by = sessions[0].get("published_by")
    record = _read_json(folders[0] / PUBLISH_RECORD)
    if by == "session":
        return Row("publish", True, f"in-session ({record.get('seconds', '?')} s)")
    if by == "chain":
        return Row("publish", True, f"from the output by the chain ({record.get('reason') or 'session could not'})")
    return Row("publish", False, "session 1's checkpoint was not published")


def _eval_row(smoke: ChainConfig, state: dict, workdir: Path) -> Row:
    if not smoke.eval.enabled:
        return Row("eval", None, "off in the config")
    ev = state.get("eval") or {}
    if ev.get("status") != "COMPLETE":
        return Row("eval", False, ev.get("message") or ev.get("status") or "not run")
    from shared.train.metrics import read_metrics

    values: dict = {}
    for record in read_metrics(workdir / "eval" / "metrics.jsonl"):
        values.update({k: v for k, v in record.items() if v is not None})
    parts = []
    if "val_loss" in values:
        parts.append(f"val loss {values['val_loss']:.3f} on {values.get('val_tokens', 0):,} tokens")
    if "hellaswag_acc_norm" in values:
        parts.append(f"HellaSwag {values['hellaswag_acc_norm']:.3f} on {values.get('hellaswag_examples')} examples")
    return Row("eval", True, ", ".join(parts) or "complete")


def report_lines(rows: list[Row]) -> list[str]:
    width = max(len(r.link) for r in rows)
    ready = all(r.ok is not False for r in rows)
    return (["readiness report", f"{'link':<{width}}  ok  measured", "-" * (width + 14)]
            + [f"{r.link:<{width}}  {r.mark}   {r.detail}" for r in rows]
            + ["", "ready: every link works" if ready else "not ready: fix the rows marked ✗ first"])


def record_measurement(measured: dict, path: Path = MEASURED_THROUGHPUT) -> None:
    """Append the smoke run's tokens/s for --plan (not from the local Kaggle: its CPUs are no TPU)."""
    if not measured.get("tokens_per_s") or measured.get("local_kaggle"):
        return
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records + [measured], indent=1))


def run_smoke(cfg: ChainConfig, workdir: Path, make_chain, log=print) -> list[Row]:
    """Run the smoke chain (`make_chain(smoke_cfg, workdir)` gives the Chain) and print its readiness report.
    A failing link is a row, not a lost report."""
    smoke = smoke_config(cfg)
    cost = quota_cost_s(smoke)
    kind = (MACHINE_SHAPES.get(smoke.accelerator) or "cpu").upper()
    log(f"smoke run {smoke.name}: one tokenize part, two train sessions of at most "
        f"{smoke.session_limit_s / 60:.0f} min on {smoke.accelerator or 'CPU'}, an eval on a subset (at most "
        f"{smoke.eval_session_limit_s / 60:.0f} min); "
        f"at most {cost / 60:.0f} min of {kind} quota"
        + (f" (over the {SMOKE_TPU_BUDGET_S / 60:.0f} min a first contact should cost: this model's checkpoint "
           "takes long to publish)" if cost > SMOKE_TPU_BUDGET_S else ""))
    failure = ""
    chain = make_chain(smoke, workdir)
    try:
        if not chain.state.data.get("done"):
            chain.run()
    except UserError as err:
        failure = str(err)
        log(f"the smoke run stopped: {failure}")
    rows, measured = readiness_rows(smoke, workdir, failure, cfg.train_settings)
    lines = report_lines(rows)
    for line in lines:
        log(line)
    (workdir / "readiness.md").write_text("\n".join(lines) + "\n")
    (workdir / "readiness.json").write_text(json.dumps({"rows": [dataclasses.asdict(r) for r in rows],
                                                        "measured": measured}, indent=1))
    record_measurement(measured)
    return rows
