"""The tokenize stage: one kernel per part of the corpus (`tokenize.parts`), each reading the previous part's
output to continue the document stream where it stopped; a part that fails is pushed again, up to
max_failed_sessions times in a row. Also where the train and eval kernels find the token parts."""

from __future__ import annotations

from pathlib import Path

from scripts.chain.build import build_kernel
from scripts.chain.client import log_error_line
from scripts.chain.context import StageContext
from scripts.chain.notebooks import QUICK_SAVE_ID
from shared.errors import UserError
from shared.tokenize.manifest import MANIFEST, read_manifest


def token_part_ref(ctx: StageContext, part: int) -> str:
    return ctx.ref(ctx.cfg.slug(f"tokenize-part-{part}"))


def data_sources(ctx: StageContext) -> tuple[list[str], list[str], str]:
    """(token datasets, kernels whose output holds token parts, the train kernel's data_dir naming them all)."""
    parts = ctx.cfg.tokenize.parts
    kernels = [token_part_ref(ctx, p) for p in range(parts)] + list(ctx.cfg.token_kernels)
    datasets = list(ctx.cfg.token_datasets)
    data_dir = ",".join("{input:" + r + "}" for r in kernels + datasets)
    return datasets, kernels, data_dir


class TokenizeStage:
    def __init__(self, ctx: StageContext):
        self.ctx = ctx

    def run(self) -> None:
        ctx = self.ctx
        parts = ctx.cfg.tokenize.parts
        done = ctx.state.data.setdefault("tokenize", {})
        for part in range(parts):
            if done.get(str(part)) == "COMPLETE":
                continue
            self.run_part(part, parts)
            self.check_part_tokens(part, parts)
            done[str(part)] = "COMPLETE"
            ctx.state.save()

    def check_part_tokens(self, part: int, parts: int) -> None:
        """A part that reached its session's deadline ended cleanly with fewer tokens than tokens_per_part
        (shared/tokenize/part.py): the next part continues the stream from where it stopped, so no document is
        lost or read twice, but the run holds fewer tokens than planned. Say so once, with the shortfall."""
        ctx = self.ctx
        dest = ctx.workdir / "sessions" / f"tokenize-{part}"
        ctx.client.download_output(token_part_ref(ctx, part), dest, pattern=f"^{MANIFEST}$")
        manifest = read_manifest(dest / MANIFEST, others="skip") if (dest / MANIFEST).exists() else None
        if manifest is None or manifest.get("stop_reason") != "session_deadline":
            return
        made, planned = int(manifest.get("num_tokens") or 0), int(manifest.get("tokens_per_part") or 0)
        ctx.state.data.setdefault("tokenize_short", {})[str(part)] = planned - made
        then = f"part {part + 1} continues the stream from there; " if part + 1 < parts else ""
        ctx.log(f"notice: tokenize part {part} reached its session's deadline with {made:,} of its {planned:,} "
                f"tokens: {then}the run holds {planned - made:,} tokens fewer than planned (training starts a new "
                "epoch over the parts where it runs out)")

    def run_part(self, part: int, parts: int) -> None:
        """Push part `part` until a session of it completes (a part complete before the chain's state knew of
        it is not pushed again)."""
        ctx = self.ctx
        ref = token_part_ref(ctx, part)
        failures = 0
        for attempt in range(1, ctx.cfg.max_failed_sessions + 2):
            key = f"tokenize-{part}-{attempt}"
            if key not in ctx.state.pushes:
                version, source = ctx.client.kernel_info(ref)
                # A version saved without running (the notebook made for its HF_TOKEN secret) is no finished part.
                if version and attempt == 1 and QUICK_SAVE_ID not in source:
                    status, _ = ctx.client.kernel_status(ref, version)
                    if status == "COMPLETE":
                        ctx.log(f"tokenize part {part}: {ref} already complete (version {version}); not pushed")
                        return
            ctx.log(f"tokenize part {part + 1}/{parts}: {ref}")
            version = ctx.push_once(key, ref, lambda pid: self.build(part, pid))
            status, message, secs = ctx.wait(ref, f"{ref} v{version}", key)
            if status == "COMPLETE":
                ctx.log(f"  part {part} done in {secs:.0f}s")
                ctx.state.data.setdefault("tokenize_seconds", {})[str(part)] = round(secs, 1)
                return
            failures += 1
            logs = ctx.workdir / "sessions" / f"tokenize-{part}-{attempt}"
            ctx.client.download_output(ref, logs, pattern=r"^$", version=version)
            error = log_error_line(logs, ref)
            ctx.log(f"  part {part} failed: {message or status}" + (f"; its last error line: {error}" if error else "")
                    + f"; log in {logs}")
            if failures >= ctx.cfg.max_failed_sessions:
                raise UserError(f"tokenize part {part} failed {failures} time{'s' if failures > 1 else ''} in a row "
                                f"(last: {error or message or status}); see {logs}")

    def build(self, part: int, push_id: str) -> Path:
        ctx, t = self.ctx, self.ctx.cfg.tokenize
        settings = {"progress": False, **t.settings, "part": part, "out_dir": "{working}"}
        kernel_sources = []
        if part > 0:
            prev = token_part_ref(ctx, part - 1)
            settings["prev_dir"] = "{input:" + prev + "}"
            kernel_sources.append(prev)
        return build_kernel("tokenize", ctx.workdir / "build" / f"tokenize-part-{part}", user=ctx.client.user,
                            slug=token_part_ref(ctx, part).split("/")[1], settings=settings,
                            kernel_type=ctx.cfg.kernel_type, accelerator=t.accelerator,
                            dataset_sources=list(t.inputs), kernel_sources=kernel_sources, push_id=push_id)
