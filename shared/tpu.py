"""Which TPU this host has, read from what a TPU VM really exposes (docs/kaggle-tpu.md, section 3): the
generation's per-chip figures, the PCI probe torch_xla itself uses, and the XLA environment for hosts without one.

Stdlib only: the session checks (shared/kaggle/env.py) and the runtime's setup ask these before torch_xla is imported.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TpuGeneration:
    """What the trainer needs to know of a TPU generation (Google Cloud's per-chip figures, docs/tpu-throughput.md)."""

    name: str  # "v3", "v5e", ...
    peak_bf16_per_chip: float
    devices_per_chip: int  # torch_xla devices per chip: v2/v3 expose each of a chip's 2 TensorCores
    hbm_gib_per_device: float
    pallas_flash_attention: bool  # Mosaic (Pallas) compiles the bf16 flash-attention kernel

    @property
    def peak_bf16_per_device(self) -> float:
        return self.peak_bf16_per_chip / self.devices_per_chip


# What `--plan` compiles the train step with (scripts/setup.sh's .venv-tpu, Kaggle's TPU image pins: libtpu 0.0.17,
# and the jax 0.7.2 that resolved at one build of it): a session whose versions differ says so, as its compiles,
# memory and Mosaic version may not be those the plan saw.
PLAN_TPU_VERSIONS = {"jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.17"}

TPU_GENERATIONS = {g.name: g for g in (
    TpuGeneration("v2", 45e12, 2, 8, False),
    TpuGeneration("v3", 123e12, 2, 16, False),
    TpuGeneration("v4", 275e12, 1, 32, True),
    TpuGeneration("v5e", 197e12, 1, 16, True),
    TpuGeneration("v5p", 459e12, 1, 95, True),
    TpuGeneration("v6e", 918e12, 1, 32, True),
)}

# TPU_ACCELERATOR_TYPE / the metadata server's accelerator type ("v3-8", "v5litepod-8", "v6e-8", "v5p-8"), or
# a PJRT device_kind ("TPU v3", "TPU v5 lite", "TPU v6 lite", "TPU v5"), to a generation name.
_ACCELERATOR_TYPE = re.compile(r"^(?:tpu)?v(\d)(litepod|lite|e|p)?(?:-\d+)?$")
_DEVICE_KIND = re.compile(r"^tpu v(\d)\s*(lite|e|p)?", re.IGNORECASE)


def _generation_name(major: str, variant: str | None) -> str | None:
    name = f"v{major}" + {"litepod": "e", "lite": "e", "e": "e", "p": "p"}.get(variant or "", "")
    if name == "v5":  # PJRT calls a v5p just "TPU v5"
        name = "v5p"
    return name if name in TPU_GENERATIONS else None


def parse_tpu_generation(text: str) -> str | None:
    """"v3-8", "v5litepod-8", "v6e-8", "TPU v5 lite", ... -> "v3", "v5e", "v6e"; None when not a known TPU."""
    text = (text or "").strip()
    m = _ACCELERATOR_TYPE.match(text.lower()) or _DEVICE_KIND.match(text)
    return _generation_name(m.group(1), m.group(2) and m.group(2).lower()) if m else None


# Google's PCI vendor id and the TPU chips' device ids, as torch_xla lists them (torch_xla/_internal/tpu.py):
# how torch_xla itself decides that a host has TPU chips, with no network call.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = {"0x0027": "v3", "0x005e": "v4", "0x0063": "v5e", "0x006f": "v6e"}  # 0x0027 is v2 or v3


def tpu_pci_devices(pci_root: str = "/sys/bus/pci/devices") -> list[str]:
    """The PCI device ids of this host's TPU chips (empty without TPU chips)."""
    found = []
    for vendor in sorted(glob.glob(os.path.join(pci_root, "*", "vendor"))):
        try:
            if Path(vendor).read_text().strip() != GOOGLE_PCI_VENDOR:
                continue
            device = (Path(vendor).parent / "device").read_text().strip()
        except OSError:
            continue
        if device in TPU_PCI_DEVICES:
            found.append(device)
    return found


def detect_tpu_generation(env: dict | None = None, device_attributes: dict | None = None,
                          tpu_type: Callable[[], str] | None = None,
                          pci_root: str = "/sys/bus/pci/devices") -> tuple[str | None, str]:
    """(generation, where it was read) of this TPU host, from what a TPU VM really exposes, in order: the
    TPU_ACCELERATOR_TYPE variable, the chips' PCI device ids, torch_xla's `_internal.tpu.get_tpu_type()` (the
    VM's metadata server), then a PJRT `device_kind` attribute (torch_xla documents only core_on_chip,
    num_cores, coords and name for TPU devices). (None, what was seen) when none names a known generation."""
    env = os.environ if env is None else env
    accelerator_type = env.get("TPU_ACCELERATOR_TYPE", "")
    if name := parse_tpu_generation(accelerator_type):
        return name, f"TPU_ACCELERATOR_TYPE={accelerator_type}"
    chips = tpu_pci_devices(pci_root)
    if chips:
        name = TPU_PCI_DEVICES[chips[0]]
        return name, f"{len(chips)} TPU chips on PCI (device {chips[0]}{', v2 or v3' if name == 'v3' else ''})"
    if tpu_type is not None:
        try:
            found = tpu_type()
        except Exception as err:  # no metadata server, or an unparsable reply: try the next source
            found = f"unavailable ({type(err).__name__})"
        if name := parse_tpu_generation(found):
            return name, f"TPU metadata accelerator type {found}"
    kind = str((device_attributes or {}).get("device_kind", ""))
    if name := parse_tpu_generation(kind):
        return name, f"PJRT device_kind {kind!r}"
    return None, f"unknown TPU (TPU_ACCELERATOR_TYPE={accelerator_type!r}, device attributes {device_attributes})"


def tpu_devices_present(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """TPU chips on this host: on PCI (as torch_xla checks), or as /dev/accel* (v2-v4) or /dev/vfio/<n> (v5e+)."""
    return bool(tpu_pci_devices(pci_root) or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def default_xla_env() -> None:
    """PJRT_DEVICE, where unset, before torch_xla's runtime starts: TPU on a host with TPU chips, else torch_xla's
    CPU backend with 8 devices (the same SPMD path as a v3-8/v5e-8 board).

    Asking for the TPU by name matters: left to choose, torch_xla 2.8 (torch_xla/runtime.py) logs "Defaulting to
    PJRT_DEVICE=CPU" when its own probe (the PCI device ids it knows) misses the chips, and a session would train
    on one CPU device; told TPU, it fails loudly instead.

    TORCHINDUCTOR_COMPILE_THREADS 1, where unset: importing torch_xla imports torch's inductor, which otherwise
    starts a pool of compile workers (a process that imports torch) that an XLA step never uses."""
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if tpu_devices_present() else "CPU"
    if os.environ["PJRT_DEVICE"] == "CPU":
        os.environ.setdefault("CPU_NUM_DEVICES", "8")


# Memory arithmetic for `auto_micro_batch` (docs/tpu-throughput.md section 5), bytes:
# fp32 weights 4 + gradients 4 + AdamW moments 8 + autocast's bf16 copies 2 + the accumulation loop's accumulators 4
STATIC_BYTES_PER_PARAM = 22
# per layer and token, in units of C: LayerNorm inputs (fp32) 8, matmul inputs (bf16) 14, attention 8, GELU 8
ACTIVATION_BYTES_PER_LAYER_TOKEN_PER_C = 38
# The head per token per vocabulary entry, and without flash attention per head per T x T (the scores and
# probabilities). The chunked loss head (shared/model/loss_head.py) keeps no [tokens x vocab] for the backward: 2
# bytes cover a bf16 chunk of logits in flight. Checked against the TPU compiler's own totals (docs/tpu-throughput.md
# section 10): gpt2's step grows 0.25 GiB (v5e) and 0.32 GiB (v6e) a sequence a chip with flash, under the 0.43 GiB
# counted here; with activation checkpointing, gpt2-medium's and gpt2-large's picks rise a power of two (8 to 16 a
# chip on v5e, 16 to 32 on v6e), where the compiler puts them at 9.7 and 22.6 GiB. The 6 it replaces predated the
# chunked head and held those two at half of what fits. SDPA's scores and probabilities take 6 bytes (fp32 scores,
# bf16 probabilities), which with the head's 2 still covers the 1.27 GiB a sequence the compiler measured for SDPA.
HEAD_BYTES_PER_TOKEN_PER_VOCAB = 2
SDPA_SCORE_BYTES = 6
# With fsdp, each layer's activations count 1.5 times: the compiler's step keeps copies of the checkpointed block
# inputs beside them (they lead its peak live buffers for gpt2-xl), and its totals at fsdp's picks stand at 93-95%
# of HBM, with the next larger refused (gpt2-large on both TPUs, gpt2-xl on v6e). Set from those compiles; 1.5
# keeps every fsdp pick the compiler accepted (docs/tpu-throughput.md section 10).
FSDP_LAYER_ACTIVATION_FACTOR = 1.5
HBM_USABLE_FRACTION = 0.85  # what XLA's buffers may take; the rest for its workspace, fragmentation, the runtime
CPU_MICRO_BATCH_PER_DEVICE = 2  # no TPU (or an unknown one): the project's default 16 over 8 devices


def activation_bytes_per_sequence(n_layer: int, n_head: int, n_embd: int, vocab_size: int, seq_len: int,
                                  attention: str, activation_checkpointing: bool = False, fsdp: bool = False) -> int:
    """Bytes the backward pass keeps per sequence: each layer's activations (only the block input, 4C per token,
    with activation checkpointing, plus one layer recomputed at a time; FSDP_LAYER_ACTIVATION_FACTOR times that with
    fsdp), the head's chunk of logits, and with SDPA (no Pallas kernel) the T x T scores and probabilities of every
    head."""
    per_layer = ACTIVATION_BYTES_PER_LAYER_TOKEN_PER_C * n_embd * seq_len
    if attention == "sdpa":  # a Pallas kernel (flash, splash) keeps no T x T in HBM
        per_layer += SDPA_SCORE_BYTES * n_head * seq_len * seq_len
    layers = (n_layer * 4 * n_embd * seq_len + per_layer) if activation_checkpointing else n_layer * per_layer
    if fsdp:
        layers = int(FSDP_LAYER_ACTIVATION_FACTOR * layers)
    return layers + HEAD_BYTES_PER_TOKEN_PER_VOCAB * vocab_size * seq_len


def auto_micro_batch(generation: str | None, attention: str, model, seq_len: int, num_devices: int,
                     activation_checkpointing: bool = False, fsdp: bool = False) -> int:
    """Sequences per micro-step over all `num_devices` (the config's micro_batch) for `model` (a ModelConfig: n_layer,
    n_head, n_embd, vocab_size, num_params()) at `seq_len` on TPU `generation` ("v5e", "v6e", ...; None: no TPU)
    with `attention` ("sdpa", "pallas-flash" or "pallas-splash"): the largest power of two per device whose
    parameters, gradients, AdamW state (sharded over the devices with fsdp) and activations fit HBM_USABLE_FRACTION
    of the device's HBM (TPU_GENERATIONS, Google Cloud's per-chip figures), at least 1 per device."""
    gen = TPU_GENERATIONS.get(generation or "")
    if gen is None:
        return CPU_MICRO_BATCH_PER_DEVICE * num_devices
    static, per_sequence, usable = _hbm_budget(gen, attention, model, seq_len, num_devices,
                                               activation_checkpointing, fsdp)
    room = usable - static
    per_device = 1
    while (2 * per_device) * per_sequence <= room:
        per_device *= 2
    return per_device * num_devices


def smallest_step_bytes(generation: str | None, attention: str, model, seq_len: int, num_devices: int,
                        activation_checkpointing: bool = False, fsdp: bool = False) -> tuple[int, int] | None:
    """(bytes a device needs for one sequence per micro-step, the bytes auto_micro_batch lets it use) on TPU
    `generation` by the same arithmetic, or None off a TPU. Where the first exceeds the second no micro-batch
    fits, as where gpt2-large's replicated state (22 bytes a parameter, 17 GB) meets a 16 GB v5e chip."""
    gen = TPU_GENERATIONS.get(generation or "")
    if gen is None:
        return None
    static, per_sequence, usable = _hbm_budget(gen, attention, model, seq_len, num_devices,
                                               activation_checkpointing, fsdp)
    return int(static + per_sequence), int(usable)


def _hbm_budget(gen, attention: str, model, seq_len: int, num_devices: int, activation_checkpointing: bool,
                fsdp: bool) -> tuple[float, float, float]:
    """(a device's static bytes: parameters, gradients, AdamW state, sharded with fsdp; the activation bytes of one
    sequence; the bytes its buffers may use) on TPU generation `gen`."""
    static = STATIC_BYTES_PER_PARAM * model.num_params() // (num_devices if fsdp else 1)
    per_sequence = activation_bytes_per_sequence(model.n_layer, model.n_head, model.n_embd, model.vocab_size,
                                                 seq_len, attention, activation_checkpointing, fsdp)
    return static, per_sequence, HBM_USABLE_FRACTION * gen.hbm_gib_per_device * 2**30


def activation_checkpointing_on(setting: str, n_layer: int, generation: str | None) -> bool:
    """--activation-checkpointing as the step runs it: on or off as set; auto turns it on where the TPU's memory
    needs it (24+ layers, gpt2-medium up, on 16 GB devices; 36+, gpt2-large up, on larger ones), never without a
    TPU. The step (shared.runtime.step.plan_step) and the micro-batch it is sized for (micro_batch_for) both ask
    here."""
    if setting != "auto":
        return setting == "on"
    gen = TPU_GENERATIONS.get(generation or "")
    return gen is not None and n_layer >= (24 if gen.hbm_gib_per_device <= 16 else 36)


def micro_batch_for(cfg, generation: str | None, attention: str, num_devices: int) -> int:
    """The micro-batch `--micro-batch auto` means for TrainConfig `cfg` on this machine: `auto_micro_batch` (with
    activation checkpointing as the step will run it), lowered to the largest power of two per device whose
    micro-steps make up the step's batch exactly."""
    model = cfg.model.shape
    checkpointing = activation_checkpointing_on(cfg.step.activation_checkpointing, model.n_layer, generation)
    most = auto_micro_batch(generation, attention, model, model.block_size, num_devices,
                            activation_checkpointing=checkpointing, fsdp=cfg.step.fsdp)
    sequences = cfg.step.total_batch_tokens // model.block_size  # validate() made sure num_devices divides it
    per_device = most // num_devices
    while per_device > 1 and sequences % (per_device * num_devices):
        per_device //= 2
    return per_device * num_devices
