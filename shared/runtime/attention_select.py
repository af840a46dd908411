"""A session's attention selection over torch_xla's mesh, made apart from the runtime: the Pallas kernels made over
the mesh (jax's splash attention, torch_xla's flash attention), each probed once at the session's own shapes within
the session's probe budget, and the `AttentionChoice` returned, which the session gives its model and its step.
Nothing of it is kept on the runtime (which is process-wide): each selection has its own budget. Which kernels, in
which order, and the loop that tries them, are shared/model/attention.py's; the probe itself is
shared/runtime/attention_probe.py's.

The image's jax may not be the one this torch_xla was built against (Kaggle's TPU image pairs torch_xla 2.8.0 with
jax 0.7.x, docs/kaggle-tpu.md), and Mosaic compiles a kernel per shape: each kernel runs forward and backward at the
session's shapes, sharded as training shards them, and is kept only if it runs and agrees with SDPA, rather than
dying (or training wrong) at the first step."""

from __future__ import annotations

from collections.abc import Callable

from shared.errors import UserError, describe_error, within
from shared.kaggle.facts import record_fact
from shared.model.attention import FLASH, AttentionChoice, candidates, choose
from shared.runtime.attention_probe import (
    PROBE_TIMEOUT_S,
    ProbeBudget,
    ProbeHung,
    end_at_exit_without_device_wait,
    hung_line,
    probe_attention_kernel,
)
from shared.runtime.mosaic_version import pin_version as pin_mosaic_version
from shared.runtime.mosaic_version import plan_for_libtpu as plan_mosaic_for_libtpu
from shared.runtime.mosaic_version import readable_version as readable_mosaic_version

Shape = tuple[int, int, int, int]


def select_on_mesh(runtime, batch: int, n_head: int, seq_len: int, head_dim: int, setting: str = "auto",
                   batch_for: Callable[[str], int] | None = None) -> AttentionChoice:
    """The attention a session on `runtime` (an XlaRuntime: its mesh, device, TPU generation) runs for a model of
    these shapes, `batch` sequences per micro-step over all devices; `setting`: TrainConfig.attention, the kernel to
    start from; `batch_for(kind)`: the micro-batch each kernel would train at, which its one probe runs at."""
    generation = runtime.tpu_generation.name if runtime.tpu_generation else None
    if runtime.tpu_generation and runtime.tpu_generation.pallas_flash_attention:  # before any kernel is lowered
        said = plan_mosaic_for_libtpu()
        if said:
            print(said, flush=True)
    probes = MeshProbes(runtime)
    return choose(candidates(generation, seq_len, setting), (batch, n_head, seq_len, head_dim),
                  lambda kind, instead: make_kernel(runtime.mesh, kind, instead),
                  probe=lambda name, kernel, instead, shape: probes.probe_and_record(name, kernel, shape, instead),
                  start=probes.start, devices=runtime.num_devices, batch_for=batch_for)


class MeshProbes:
    """One selection's probes on `runtime`'s devices, all within one budget (started by `start`)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.budget: ProbeBudget | None = None

    def start(self, kernels: list[str]) -> None:
        """Say which kernels this selection probes, and in what time: the budget all its probes share starts."""
        self.budget = ProbeBudget()
        if kernels:
            print(self.budget.start_line(kernels), flush=True)

    def probe_and_record(self, name: str, kernel: Callable, shape: Shape, instead: str) -> str | None | bool:
        """`probe`, its result kept in the session's facts (`attention_probes`: passed, failed or hung, at which
        micro-batch), which the chain reads back to start its next session past a kernel that hung or failed
        (scripts/chain/attention_carry.py)."""
        fact = {"micro_batch": shape[0]}
        try:
            failure = self.probe(name, kernel, shape, instead)
        except ProbeHung as err:
            record_fact("attention_probes", name, {**fact, "result": "hung", "why": str(err)})
            raise
        if failure is not False:  # False: not probed (the budget spent)
            record_fact("attention_probes", name, {**fact, "result": "failed" if failure else "passed",
                                                   **({"why": failure} if failure else {})})
        return failure

    def probe(self, name: str, kernel: Callable, shape: Shape, instead: str) -> str | None | bool:
        """None where `kernel` runs and agrees with SDPA at `shape`; else why not, in a line (the attention loop,
        shared/model/attention.py `choose`, says it). Within what is left of the selection's probe budget: none
        left, a notice ending with `instead` and False; a probe that outlasts it stops the session (ProbeHung: its
        graph may hold the device, docs/tpu-throughput.md)."""
        budget = self.budget = self.budget or ProbeBudget()
        try:
            failure = self._within(budget, name, kernel, shape, instead)
            version = readable_mosaic_version(failure or "")
            if version is not None and pin_mosaic_version(version):
                # jax serialized the kernel for a newer libtpu than this one (Kaggle's image: jax 0.7.2, libtpu
                # 0.0.17): lowered again at the version libtpu names, and probed again.
                print(f"notice: this libtpu reads Pallas kernels up to Mosaic version {version}, older than jax "
                      f"serializes them at; the {name}-attention kernel is lowered at version {version}", flush=True)
                failure = self._within(budget, name, kernel, shape, instead)
        except ProbeHung as err:
            if self.runtime.device_type == "TPU":  # the exit must not wait for the device either
                end_at_exit_without_device_wait()
            raise ProbeHung(hung_line(name, err)) from None
        return failure

    def _within(self, budget: ProbeBudget, name: str, kernel: Callable, shape: Shape,
                instead: str) -> str | None | bool:
        """The probe's line (None: it passed) in what is left of `budget`; False, said, where too little is."""
        if not budget.allows_a_probe():
            print(budget.spent_line(name, instead), flush=True)
            return False
        runtime = self.runtime
        return probe_attention_kernel(kernel, shape, runtime.device, runtime.shard_batch, runtime.sync,
                                      timeout_s=budget.left())


def make_kernel(mesh, kind: str, instead: str) -> Callable | None:
    """Pallas kernel `kind` over `mesh`, or None (said) where it does not import (`instead`: what happens then)."""
    return flash_attention_kernel(mesh) if kind == FLASH else splash_attention_kernel(mesh, instead)


def splash_attention_kernel(mesh, instead: str = "trying the flash-attention kernel") -> Callable | None:
    """jax's splash attention (q, k, v) -> out over `mesh` (shared/model/splash.py), or None where it may not run.
    Asked only where shared/model/attention.py puts it (its TPU, switches and sequence length) and the flash
    kernel's jax came: here torchax for `call_jax` (installed in a session whose image has none; one that does not
    import is a notice ending with `instead`)."""
    from shared.kaggle.packages import provide
    from shared.model.splash import splash_attention

    problem = provide("torchax", "jax's splash attention")
    if problem:
        print(f"notice: {problem}; {instead}", flush=True)
        return None

    def import_kernel():
        import jax  # noqa: F401
        import torchax  # noqa: F401
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # noqa: F401

    try:  # bounded like the probe, which it precedes
        within(PROBE_TIMEOUT_S, import_kernel)
    except Exception as err:  # noqa: BLE001 - a torchax or jax that does not fit this torch_xla: flash instead
        print(f"notice: importing jax's splash attention gave {describe_error(err)}; {instead}", flush=True)
        return None
    return splash_attention(mesh)


def flash_attention_kernel(mesh) -> Callable | None:
    """torch_xla's Pallas flash attention (q, k, v) -> out over `mesh`, or None where jax (torch_xla[pallas]) does
    not import. Asked only where shared/model/attention.py puts a Pallas kernel (a generation whose Mosaic compiles
    it: not v2/v3, nor an unknown TPU, nor a CPU)."""

    def import_kernel():
        import jax  # noqa: F401
        from torch_xla.experimental.custom_kernel import flash_attention

        return flash_attention

    try:  # importing jax may load libtpu's plugin: bounded like the probe, which it precedes
        flash_attention = within(PROBE_TIMEOUT_S, import_kernel)
    except ImportError:
        return None
    except UserError as err:
        print(f"notice: importing jax for the Pallas flash-attention kernel gave {err}; using SDPA", flush=True)
        return None

    def tpu_flash_attention(q, k, v):
        return flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5,
                               partition_spec=("data", None, None, None), mesh=mesh)

    return tpu_flash_attention
