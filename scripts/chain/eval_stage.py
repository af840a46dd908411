"""The eval stage: one session of the eval kernel on the final checkpoint (val loss, HellaSwag, samples, the
report); its output, less the 🤗 export, comes back to `<workdir>/eval`. A failed eval is a warning: the
training it reports on is done and published."""

from __future__ import annotations

from pathlib import Path

from scripts.chain.build import KERNEL_SOURCES, REPO, build_kernel
from scripts.chain.checkpoints import checkpoint_refs
from scripts.chain.client import ApiFailure, log_error_line
from scripts.chain.context import StageContext
from scripts.chain.tokenize_stage import data_sources


class EvalStage:
    def __init__(self, ctx: StageContext):
        self.ctx = ctx

    def run(self) -> None:
        ctx = self.ctx
        if not ctx.cfg.eval.enabled:
            return
        if (ctx.state.data.get("eval") or {}).get("status") == "COMPLETE":
            return
        if not (REPO / KERNEL_SOURCES["eval"]).exists():
            ctx.log("notice: kernels/eval.py does not exist yet; skipping the eval kernel")
            return
        ref = ctx.ref(ctx.cfg.slug("eval"))
        ctx.log(f"eval: {ref}")
        version = ctx.push_once("eval", ref, self.build)
        status, message, secs = ctx.wait(ref, f"{ref} v{version}", "eval")
        dest = ctx.workdir / "eval"
        try:
            ctx.client.download_output(ref, dest, pattern=r"^(?!hf/)", version=version)
        except ApiFailure as err:
            ctx.log(f"  warning: could not download the eval output ({err})")
        ctx.state.data["eval"] = {"version": version, "status": status, "message": message, "dir": str(dest)}
        ctx.state.save()
        if status == "COMPLETE":
            ctx.log(f"  eval done in {secs:.0f}s: report in {dest}")
        else:
            error = log_error_line(dest, ref)
            ctx.log(f"  warning: the eval kernel ended {status.lower()} ({message})"
                    + (f"; its last error line: {error}" if error else "") + f"; its log is in {dest}")

    def expected_checkpoint(self) -> dict:
        """The step and dataset version the last train session left: a session mounting an older version fetches
        this one (shared/kaggle/bootstrap.py), so the eval never reports on an older checkpoint."""
        sessions = self.ctx.state.data.get("train_sessions") or []
        last = sessions[-1] if sessions else {}
        # The checkpoint dataset the last session left its checkpoint in (a state from before the two: the first)
        dataset = last.get("ckpt_ref_after") or checkpoint_refs(self.ctx)[0]
        return {"dataset": dataset, "expect_step": last.get("step_after", 0),
                "expect_version": last.get("ckpt_version_after", 0)}

    def build(self, push_id: str) -> Path:
        """The eval kernel on the checkpoint dataset, with the first token part's validation shards."""
        ctx, cfg, ev = self.ctx, self.ctx.cfg, self.ctx.cfg.eval
        expected = self.expected_checkpoint()  # the checkpoint dataset holding the newest checkpoint of the two
        ckpt_ref = expected["dataset"]
        _datasets, kernels, _ = data_sources(ctx)
        settings = {"out_dir": "{working}", **ev.settings}
        if kernels and "data_dir" not in settings:
            settings["data_dir"] = "{input:" + kernels[0] + "}"
        return build_kernel("eval", ctx.workdir / "build" / "eval", user=ctx.client.user, slug=cfg.slug("eval"),
                            settings=settings, kernel_type=cfg.kernel_type,
                            accelerator=ev.accelerator, internet=True,
                            dataset_sources=[ckpt_ref] + list(ev.inputs), kernel_sources=kernels[:1],
                            checkpoint_dataset={"resume_setting": "checkpoint", **expected},
                            push_id=push_id)
