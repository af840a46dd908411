"""The eval kernel and its pieces: the Hugging Face export (weights and tokenizer) against transformers,
validation loss both ways, KV-cache sampling, evaluation inside a real training run, and the report drawn
from that run's metrics; bad checkpoints and prompts as one-line errors or warnings."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import error_lines, made_once, run_script, train_config

from shared.data import TokenLoader, find_shards
from shared.eval.hf import export_hf
from shared.model.model import GPT
from shared.model_shape import ModelConfig
from shared.runtime.device import make_runtime
from shared.runtime.runtime import Runtime
from shared.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from shared.train.metrics import read_metrics
from shared.train.sampling import generate_tokens, sample_text
from shared.train.validation import validation_loss

transformers = pytest.importorskip("transformers")

SMALL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)
TEXTS = ["Hello, I'm a language model, and I can't   wait!\n\nNew paragraph\twith tabs 123 4567.",
         " leading space, trailing spaces   ", "it's we've they'll I'd 'quoted' don't", "ünïcödé 日本語 🤖 émigré",
         "def f(x):\n    return x ** 2  # comment\n", "<|endoftext|> is special here", ""]


def random_model(seed: int = 0, cfg: ModelConfig = SMALL) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return model


# --- the Hugging Face export ------------------------------------------------------------------------------------

def test_exported_tokenizer_matches_tiktoken_and_pipeline_runs(gpt2_ranks, tmp_path):
    import pydoc_data.topics

    from shared.tokenize.tokenizer import gpt2_encoding

    folder = export_hf(random_model(), tmp_path / "hf", tokenizer=True, ranks_path=gpt2_ranks)
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    merges = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    assert merges[:4] == ["#version: 0.2", "Ġ t", "Ġ a", "h e"] and len(merges) == 50001  # GPT-2's own file
    enc = gpt2_encoding(gpt2_ranks)
    texts = TEXTS + list(pydoc_data.topics.topics.values())[:40]
    for cls in (transformers.AutoTokenizer, transformers.GPT2Tokenizer):
        tok = cls.from_pretrained(folder)
        assert tok.eos_token_id == 50256 and tok.model_max_length == SMALL.block_size
        for text in texts:
            ids = tok.encode(text)
            assert ids == enc.encode(text, allowed_special="all"), text[:60]
            assert tok.decode(ids) == text
    generator = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    out = generator("Hello, I'm a language model,", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("Hello, I'm a language model,")
    assert len(out[0]["generated_text"]) > len("Hello, I'm a language model,")


def test_validation_loss_agrees_with_the_exported_model(demo_data, tmp_path):
    model = random_model(1)
    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    runtime = make_runtime("xla")
    loader = TokenLoader(find_shards(demo_data, "val"), 8, SMALL.block_size, shuffle=False)
    fp32 = validation_loss(runtime.prepare_model(model, False), loader, runtime, 3, bf16=False)
    bf16 = validation_loss(model, loader, runtime, 3, bf16=True)
    loader.state.offset = 0
    with torch.no_grad():
        reference = np.mean([
            torch.nn.functional.cross_entropy(hf(b[:, :-1]).logits.reshape(-1, 50257), b[:, 1:].reshape(-1)).item()
            for b in (torch.from_numpy(loader.next_batch()).long() for _ in range(3))])
    assert abs(fp32 - reference) < 1e-3
    assert abs(bf16 - reference) < 3e-2  # bf16 autocast, as in training
    assert fp32 > 10.0  # a random model: about ln(50257)


# --- sampling --------------------------------------------------------------------------------------------------

def test_kv_cache_generation_matches_full_recompute_and_transformers(tmp_path):
    model = random_model(2)
    prompt = [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    (greedy,) = generate_tokens(model, Runtime("cpu"), prompt, 24, temperature=0)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(24):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert greedy == seq[len(prompt):]
    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=50256)
    assert hf_out[0, len(prompt):].tolist() == greedy
    # Sampling is reproducible from its seed, and differs across seeds.
    a = generate_tokens(model, Runtime("cpu"), prompt, 16, num_samples=2, temperature=0.8, top_k=20, seed=5)
    assert a == generate_tokens(model, Runtime("cpu"), prompt, 16, num_samples=2, temperature=0.8, top_k=20, seed=5)
    assert a != generate_tokens(model, Runtime("cpu"), prompt, 16, num_samples=2, temperature=0.8, top_k=20, seed=6)
    assert a[0] != a[1]
    # On the XLA devices: the same greedy tokens, and a second prompt compiles nothing new.
    runtime = make_runtime("xla")
    xla_model = runtime.prepare_model(random_model(2), False)
    assert generate_tokens(xla_model, runtime, prompt, 24, temperature=0) == [greedy]
    compiles = runtime.compile_count()
    generate_tokens(xla_model, runtime, [464, 3139], 10, num_samples=1, temperature=1.0, seed=1)
    assert runtime.compile_count() == compiles


def test_prompt_longer_than_the_context_is_a_warning(gpt2_ranks):
    from shared.tokenize.tokenizer import gpt2_encoding

    warnings = []
    long_prompt = ("The quick brown fox jumps over the lazy dog. " * 20).strip()  # 200 tokens; the context is 64
    (sample,) = sample_text(random_model(), Runtime("cpu"), [long_prompt], max_new_tokens=16, temperature=0,
                            encoding=gpt2_encoding(gpt2_ranks), warn=warnings.append)
    assert warnings == ["warning: prompt 1 has 200 tokens, longer than the model's 64-token context; using its "
                        "last 32 tokens"]
    assert sample.truncated_prompt and len(sample.tokens) == 16


# --- a real short training run, its in-training evals, then the eval kernel -------------------------------------

@pytest.fixture(scope="module")
def hellaswag_file(gpt2_ranks, tmp_path_factory) -> Path:
    from shared.train.hellaswag import demo_examples, write_jsonl

    folder = made_once(tmp_path_factory, "hellaswag_demo", lambda out: write_jsonl(
        out / "hellaswag_demo.jsonl", demo_examples(24, max_chars=300_000)))
    return folder / "hellaswag_demo.jsonl"


@pytest.fixture(scope="module")
def trained_run(demo_data, hellaswag_file, tmp_path_factory) -> Path:
    """Two training sessions (3 steps, then resumed to 6) with evals every 2 steps, made once for both workers."""
    return made_once(tmp_path_factory, "trained_run", lambda out: train_two_sessions(demo_data, hellaswag_file, out))


def train_two_sessions(demo_data: Path, hellaswag_file: Path, out: Path) -> None:
    from shared.train.trainer import train

    cfg = train_config(preset="tiny", seq_len=32, micro_batch=8, total_batch_tokens=512, warmup_steps=2, log_every=1,
                       eval_every=2, eval_batches=2, progress=False, wandb_project="", data_dir=str(demo_data),
                       out_dir=str(out), total_steps=6, checkpoint_every=0, hellaswag_file=str(hellaswag_file),
                       hellaswag_examples=8, hellaswag_every=4, sample_prompt="The Python interpreter", sample_tokens=8)
    runtime, lines = make_runtime("xla"), []
    assert train(cfg.replace(stop_after_steps=3), runtime, log=lines.append).step == 3
    assert train(cfg, runtime, log=lines.append).step == 6


@pytest.mark.slow
def test_training_logs_val_loss_hellaswag_and_samples(trained_run):
    records = read_metrics(trained_run / "metrics.jsonl")
    hs = [r for r in records if "hellaswag_acc_norm" in r]
    # Validation loss at every eval (each session's start, every 2 steps); HellaSwag at each session's start,
    # every 4 steps and at the run's last step.
    assert [r["step"] for r in records if "val_loss" in r] == [0, 2, 3, 4, 6]
    assert [r["step"] for r in hs] == [0, 3, 4, 6]
    assert all(r["hellaswag_examples"] == 8 and 0 <= r["hellaswag_acc_norm"] <= 1 for r in hs)
    p = hs[-1]["hellaswag_acc_norm"]
    assert hs[-1]["hellaswag_acc_norm_se"] == pytest.approx((p * (1 - p) / 8) ** 0.5, abs=1e-5)
    samples = [r for r in records if "sample" in r]
    assert samples and all(r["sample"].startswith("The Python interpreter") for r in samples)
    steps = [r for r in records if "loss" in r]
    # The evals (and their graphs) inside training do not add compilations once the run is going.
    assert steps[-1]["compiles"] == next(r for r in steps if r["step"] == 5)["compiles"]
    # ...and the training plot draws HellaSwag beside the losses, at every eval that scored it
    from shared.train.metrics import plot_series

    series = plot_series(records)
    assert series["hellaswag"] == [(r["tokens"], r["hellaswag_acc_norm"]) for r in hs]
    assert len(series["val loss"]) >= 3 and len(series["train loss"]) == len(steps)


def eval_kernel(*args, timeout=300):
    return run_script("kernels/eval.py", "--backend", "xla", "--val-tokens", "4096", "--micro-batch", "8",
                      "--max-new-tokens", "12", "--samples-per-prompt", "1", "--prompts", "Hello|The module",
                      *args, timeout=timeout)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A run folder with two checkpoints (steps 3 and 6) of two different random models, saved as training saves
    them: what the tests of bad checkpoints need, without training."""
    run = tmp_path_factory.mktemp("saved_run")
    for step, seed in ((3, 1), (6, 2)):
        model = random_model(seed)
        save_checkpoint(run / "checkpoints", step, model.checkpoint_tensors(), {"none": torch.zeros(1)},
                        {"step": step, "config": {"model": model.config.to_dict()}})
    return run


@pytest.fixture(scope="module")
def evaluated(trained_run, demo_data, hellaswag_file, tmp_path_factory):
    """The eval kernel's run on trained_run, made once for both workers: its folder, and its output."""
    def make(folder: Path) -> None:
        bad = folder / "hellaswag_with_bad_line.jsonl"
        lines = hellaswag_file.read_text().splitlines()
        bad.write_text("\n".join(lines[:3] + ['{"ctx": "broken'] + lines[3:]) + "\n")
        proc = eval_kernel("--checkpoint", str(trained_run), "--data-dir", str(demo_data), "--hellaswag", str(bad),
                           "--out-dir", str(folder / "eval"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = made_once(tmp_path_factory, "evaluated", make)
    return folder / "eval", (folder / "stdout.txt").read_text()


@pytest.mark.slow
def test_eval_kernel_report_and_plots(evaluated, trained_run):
    import matplotlib.image

    out, stdout = evaluated
    assert f"{out.parent / 'hellaswag_with_bad_line.jsonl'}:4: malformed HellaSwag line skipped" in stdout
    for name in ("loss.png", "hellaswag.png", "throughput.png"):
        image = matplotlib.image.imread(out / name)
        assert image.shape[:2] == (450, 800), name
        assert image[..., :3].std() > 0.05, f"{name} is blank"
    report = (out / "report.md").read_text()
    assert "| HellaSwag acc_norm (step 6, 24 examples) |" in report and "| 0.2945 | 0.337 | 0.3752 |" in report
    assert "| validation loss (step 6) |" in report and "3.2924" in report and "**Verdict:**" in report
    assert "- sessions: 2" in report and "malformed HellaSwag line skipped" in report
    assert "```text\nHello" in report and "```text\nThe module" in report
    final = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "eval"]
    assert {k for r in final for k in r} >= {"val_loss", "val_tokens", "hellaswag_acc_norm", "samples"}
    # The history came from the checkpoint: the training records are all there, then the eval's.
    history = read_metrics(list_checkpoints(trained_run / "checkpoints")[-1] / "metrics.jsonl")
    assert read_metrics(out / "metrics.jsonl")[: len(history)] == history


@pytest.mark.slow  # the eval kernel in a new process, on two training sessions (85 s of set-up)
def test_eval_kernel_export_loads_in_transformers(evaluated, trained_run, demo_data):
    out, _ = evaluated
    hf = transformers.GPT2LMHeadModel.from_pretrained(out / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    val = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "eval" and "val_loss" in r)
    loader = TokenLoader(find_shards(demo_data, "val"), 8, 32, shuffle=False)
    with torch.no_grad():
        batches = [torch.from_numpy(loader.next_batch()).long() for _ in range(val["val_tokens"] // 256)]
        ref = np.mean([torch.nn.functional.cross_entropy(hf(b[:, :-1]).logits.reshape(-1, 50257),
                                                         b[:, 1:].reshape(-1)).item() for b in batches])
    assert abs(val["val_loss"] - ref) < 3e-2  # the kernel ran in bf16, like training


def test_corrupt_checkpoint_is_one_line_error_and_the_report_is_kept(saved_run, tmp_path):
    out = tmp_path / "eval"  # an earlier eval's folder: a checkpoint that fails must leave it as it was
    out.mkdir()
    (out / "report.md").write_text("# the earlier report\n")
    (out / "metrics.jsonl").write_text('{"event": "session_start"}\n')
    bad = tmp_path / "step_000006"
    shutil.copytree(list_checkpoints(saved_run / "checkpoints")[-1], bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = eval_kernel("--checkpoint", str(bad), "--data-dir", "off", "--hellaswag", "off", "--out-dir", str(out))
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [f"error: {bad}: model.safetensors fails its sha256 check"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.slow
def test_missing_hellaswag_file_keeps_the_rest_of_the_report(trained_run, tmp_path):
    proc = eval_kernel("--checkpoint", str(trained_run), "--data-dir", "off", "--hellaswag",
                       str(tmp_path / "nope.jsonl"), "--prompts", "", "--no-export", "--out-dir", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert error_lines(proc.stderr)[-1].startswith("error: evaluation finished with errors in: HellaSwag")
    report = (tmp_path / "o" / "report.md").read_text()
    assert "nope.jsonl: cannot read" in report and "| validation loss (step 6) |" in report
    assert json.loads((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()[0])["event"] == "session_start"


@pytest.mark.slow
def test_a_second_eval_keeps_the_first_report_in_previous(evaluated, tmp_path):
    first, _ = evaluated
    out = tmp_path / "o"
    shutil.copytree(first, out, ignore=shutil.ignore_patterns("hf"))
    before = {name: (out / name).read_bytes() for name in ("report.md", "metrics.jsonl", "loss.png")}
    # A model that does not load leaves the folder as it was.
    proc = eval_kernel("--hf-model", str(tmp_path / "no-such-folder"), "--out-dir", str(out))
    assert proc.returncode == 2 and not (out / "previous").exists()
    assert {name: (out / name).read_bytes() for name in before} == before
    # One that loads (the first eval's export) writes a new report; the first one is in previous/.
    proc = eval_kernel("--hf-model", str(first / "hf"), "--data-dir", "off", "--hellaswag", "off", "--prompts", "",
                       "--no-export", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the earlier report in {out} moved to {out / 'previous'}" in proc.stdout
    assert {name: (out / "previous" / name).read_bytes() for name in before} == before
    assert "Hugging Face folder" in (out / "report.md").read_text()
    assert "no validation shards" not in (out / "report.md").read_text()  # --data-dir off is not a warning


def test_damaged_hf_folder_is_a_one_line_error(tmp_path):
    from shared.errors import UserError
    from shared.eval.hf import load_hf

    folder = export_hf(random_model(), tmp_path / "hf")
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"model.safetensors: unreadable"):
        load_hf(folder)
    from safetensors.torch import load_file, save_file

    weights.write_bytes(whole)
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "transformer.ln_f.bias"}, weights)
    with pytest.raises(UserError, match=r"model.safetensors: not a GPT-2 model: the state dict lacks "
                                        r"transformer.ln_f.bias"):
        load_hf(folder)


def test_export_uses_the_newest_checkpoint_that_verifies(saved_run, tmp_path):
    from shared.errors import UserError
    from shared.eval.hf import model_from_checkpoint

    run = tmp_path / "run"
    shutil.copytree(saved_run / "checkpoints", run / "checkpoints")
    older, newest = list_checkpoints(run / "checkpoints")[-2:]
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    model = model_from_checkpoint(run)
    expected = GPT.from_checkpoint(load_checkpoint(older))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values(),
                                                  strict=True))
    with pytest.raises(UserError, match="fails its sha256 check"):  # named directly, it must verify
        model_from_checkpoint(newest)
