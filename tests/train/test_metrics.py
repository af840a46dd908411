"""Run logging: JSONL records, and W&B that never crashes training nor shows its key."""

import json

from shared.train.metrics import MetricsLogger, read_metrics

FAKE_KEY = "local-0123456789abcdef0123456789abcdef01234567"


def test_jsonl_records_and_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path, 10, 0, {}, wandb_project="", progress=False, log=lambda _: None)
    logger.write({"step": 1, "loss": 3.25, "mfu": float("nan")})
    logger.write({"step": 2, "loss": 3.0})
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 3.25, "mfu": None},
                                                        {"step": 2, "loss": 3.0}]
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])  # strict JSON: no NaN literals


def test_no_key_is_a_one_line_notice(tmp_path):
    lines = []
    MetricsLogger(tmp_path, 10, 0, {}, wandb_project="p", progress=False, log=lines.append, wandb_key=None).close()
    assert lines == ["notice: no W&B key found (WANDB_API_KEY); logging to metrics.jsonl only"]


def test_network_down_is_a_one_line_notice_without_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    lines = []
    logger = MetricsLogger(tmp_path, 10, 0, {"lr": 1e-3}, wandb_project="p", progress=False, log=lines.append,
                           wandb_key=FAKE_KEY)
    logger.write({"step": 1, "loss": 2.0})
    logger.close()
    assert len(lines) == 1 and lines[0].startswith("notice: W&B unreachable (127.0.0.1")
    out = capsys.readouterr()
    assert FAKE_KEY not in lines[0] + out.out + out.err
    assert FAKE_KEY not in (tmp_path / "metrics.jsonl").read_text()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]
