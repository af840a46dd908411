"""A test fault for local Kaggle sessions (tests/chain/test_attention_carry.py puts this folder on their PYTHONPATH):
the session's attention selection sees a v5e, and every Pallas kernel's probe hangs, as a kernel whose compile or
run never comes back on a TPU does: the probe's thread blocks for ever inside the kernel, on the session's own XLA
devices, and the session's probe budget (3 s here, 15 minutes on Kaggle) runs out. Nothing else in the session is
changed: the patch goes in when the session imports shared/runtime/xla_runtime.py (the copy its bootstrap unpacked),
on it and on shared/runtime/attention_select.py (which makes the kernels), and the generation is the v5e's only
while the kernels are chosen."""

import importlib.abc
import importlib.util
import sys
import threading

NEVER = threading.Event()  # never set: a hung compile or run
PROBE_BUDGET_S = 3.0


def _patch(module) -> None:
    import shared.runtime.attention_probe as attention_probe
    import shared.runtime.attention_select as attention_select
    from shared.tpu import TPU_GENERATIONS

    attention_probe.PROBE_BUDGET_S, attention_probe.PROBE_FLOOR_S = PROBE_BUDGET_S, 0.0
    runtime = module.XlaRuntime
    select = runtime.select_attention

    def select_on_a_v5e(self, *args, **kwargs):
        real, self.tpu_generation = self.tpu_generation, TPU_GENERATIONS["v5e"]
        try:
            return select(self, *args, **kwargs)
        finally:
            self.tpu_generation = real

    def hanging_kernel(mesh, kind, instead):
        def hangs(q, k, v):
            NEVER.wait()

        return hangs

    runtime.select_attention = select_on_a_v5e
    attention_select.make_kernel = hanging_kernel


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _PatchRuntimeOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "shared.runtime.xla_runtime":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        spec.loader = _PatchingLoader(spec.loader)
        return spec


sys.meta_path.insert(0, _PatchRuntimeOnImport())
