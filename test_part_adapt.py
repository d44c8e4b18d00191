import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import adapt
import runtime

HERE = Path(__file__).resolve().parent
TINY = ["--data", "synth", "--synth_pairs", "40", "--scratch_width", "64", "--scratch_layers", "2",
        "--intra_layers", "1", "--scratch_text_width", "64", "--scratch_text_layers", "1",
        "--scratch_embed_dim", "32", "--batch_size", "8", "--eval_batch_size", "16", "--log_every", "1"]


def run_adapt(*args, env=None, torchrun=False, **kwargs):
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
               else [sys.executable]) + [str(HERE / "adapt.py"), *TINY, *map(str, args)]
    return subprocess.run(command, cwd=HERE, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kwargs)


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    """A 40-pair synthetic dataset, drawn once for this file's tests."""
    root = tmp_path_factory.mktemp("adapt") / "synth"
    import data
    data.ensure_synth(root, data.SynthConfig(pairs=40))
    return root


def test_config_flags_follow_the_dataset_preset_then_the_command_line():
    config = runtime.parse_config(adapt.Config, adapt.PRESETS, ["--data", "spot", "--lr", "3e-4"])
    assert (config.epochs, config.lr, config.clip_lr_scale) == (20, 3e-4, 1e-3)
    with pytest.raises(SystemExit):
        runtime.parse_config(adapt.Config, adapt.PRESETS, ["--data", "spot", "--learning_rate", "3e-4"])


def test_learning_rate_warms_up_linearly_then_follows_the_reference_cosine():
    config = adapt.Config(lr=1e-4, warmup=0.1)
    assert adapt.get_lr(0, 100, config) == 0
    assert adapt.get_lr(5, 100, config) == pytest.approx(0.5e-4)
    # the reference's warmup_cosine is not rescaled after warmup: 0.5(1 + cos(0.1 pi)) = 0.9755
    assert adapt.get_lr(10, 100, config) == pytest.approx(1e-4 * 0.97553, rel=1e-4)
    assert adapt.get_lr(100, 100, config) == pytest.approx(0, abs=1e-12)


def test_adaptation_on_tiny_synth_writes_checkpoints_that_load_without_code(synth_root, tmp_path):
    out = tmp_path / "run"
    result = run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "2")
    assert result.returncode == 0, result.stderr
    for name in ("ckpt_last.pt", "ckpt_best.pt"):
        state = torch.load(out / name, weights_only=True)
        assert {"model", "optimizer", "config", "clip_config", "step", "rng"} <= set(state)
    scores = json.loads((out / "test_retrieval.json").read_text())
    assert 0 <= scores["text_to_pair_R1"] <= 100 and "pair_to_text_R1" in scores
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "split" in r] == ["val", "val", "test"]


def test_an_existing_run_is_not_overwritten_without_resume(synth_root, tmp_path):
    out = tmp_path / "run"
    assert run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "1").returncode == 0
    again = run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "1")
    assert again.returncode == 1 and "--resume" in again.stderr


def test_resume_refuses_a_checkpoint_of_another_model_config(synth_root, tmp_path):
    out = tmp_path / "run"
    assert run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "1").returncode == 0
    other = run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "2", "--resume",
                      "--scratch_width", "128")
    assert other.returncode == 1 and "scratch_width" in other.stderr


def test_torchrun_with_two_cpu_processes_trains_and_only_rank_0_writes(synth_root, tmp_path):
    out = tmp_path / "ddp"
    result = run_adapt("--data_root", synth_root, "--out_dir", out, "--epochs", "1", torchrun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 = 4 x 2 processes" in result.stdout  # the global batch is split over the two processes
    assert sorted(p.name for p in out.iterdir()) == ["ckpt_best.pt", "ckpt_last.pt", "config.json", "log.jsonl",
                                                   "test_retrieval.json"]
    assert torch.load(out / "ckpt_last.pt", weights_only=True)["step"] > 0


def test_a_run_killed_mid_epoch_resumes_and_finishes_with_intact_checkpoints(synth_root, tmp_path):
    out = tmp_path / "run"
    args = ["--data_root", synth_root, "--out_dir", out, "--epochs", "3", "--save_every", "2"]
    command = [sys.executable, str(HERE / "adapt.py"), *TINY, *map(str, args)]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # wait until the first epoch is over (ckpt_best.pt) and a later mid-epoch save happened, then SIGKILL
    deadline = time.time() + 240
    while time.time() < deadline:
        log = out / "log.jsonl"
        lines = log.read_text().splitlines() if log.exists() else []
        steps = [json.loads(line)["step"] for line in lines if "split" not in json.loads(line)]
        if (out / "ckpt_best.pt").exists() and steps and steps[-1] >= 5 and steps[-1] % 4 != 0:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    best_before = torch.load(out / "ckpt_best.pt", weights_only=True)
    result = run_adapt(*args, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"resumed {out / 'ckpt_last.pt'} at step {killed_at}" in result.stdout
    last = torch.load(out / "ckpt_last.pt", weights_only=True)
    total = last["step"]
    assert total > killed_at and total % 3 == 0  # 3 epochs of equal length were completed
    assert len(last["history"]) == 3  # one validation per epoch, none lost or repeated
    best = torch.load(out / "ckpt_best.pt", weights_only=True)
    assert best["best_epoch"] >= best_before["best_epoch"]
    assert not list(out.glob(".*.tmp*"))  # no half-written file left behind
