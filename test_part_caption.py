import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import caption
import runtime

HERE = Path(__file__).resolve().parent
TINY_CLIP = ["--synth_pairs", "40", "--scratch_width", "64", "--scratch_layers", "2", "--intra_layers", "1",
             "--scratch_text_width", "64", "--scratch_text_layers", "1", "--scratch_embed_dim", "64"]
TINY_DECODER = ["--synth_pairs", "40", "--decoder_layers", "1", "--decoder_heads", "2", "--decoder_ffn", "128",
                "--batch_size", "8", "--eval_batch_size", "32", "--log_every", "1"]


def run(script, *args, **kwargs):
    return subprocess.run([sys.executable, str(HERE / script), "--data", "synth", *map(str, args)], cwd=HERE,
                          capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    """A 40-pair synthetic dataset and a tiny stage-1 checkpoint, made once for this file's tests."""
    base = tmp_path_factory.mktemp("caption")
    result = run("adapt.py", *TINY_CLIP, "--data_root", base / "synth", "--out_dir", base / "adapt", "--epochs", "1",
                 "--batch_size", "8")
    assert result.returncode == 0, result.stderr
    return {"root": base / "synth", "encoder": base / "adapt" / "ckpt_best.pt"}


def stage2(stage1, out, *args, **kwargs):
    return run("caption.py", *TINY_DECODER, "--data_root", stage1["root"], "--encoder_ckpt", stage1["encoder"],
               "--out_dir", out, *args, **kwargs)


def test_warmup_linear_schedule_matches_the_reference():
    config = caption.Config(lr=1e-4, warmup=0.1)
    assert caption.get_lr(5, 100, config) == pytest.approx(0.5e-4)
    assert caption.get_lr(10, 100, config) == pytest.approx(1e-4)
    assert caption.get_lr(55, 100, config) == pytest.approx(0.5e-4)
    assert caption.get_lr(100, 100, config) == 0.0


def test_training_on_cached_features_then_eval_writes_predictions_scores_and_grid(stage1, tmp_path):
    out = tmp_path / "cap"
    result = stage2(stage1, out, "--epochs", "2")
    assert result.returncode == 0, result.stderr
    assert len(list((out / "features").glob("*.npy"))) == 3  # train, val, test, each encoded once
    evaluated = stage2(stage1, out, "--eval")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "encoding" not in evaluated.stdout  # the cached test features were reused
    predictions = json.loads((out / "test_predictions.json").read_text())
    ids = {p["image_id"] for p in predictions}
    assert any(i.endswith("_n") for i in ids) and any(not i.endswith("_n") for i in ids)  # change + distractor
    table = json.loads((out / "test_scores.json").read_text())
    assert {"total", "semantic change", "distractor"} <= set(table["scores"])
    assert set(table["scores"]["total"]) >= {"BLEU_4", "METEOR", "ROUGE_L", "CIDEr"}
    assert (out / "test_grid.png").stat().st_size > 10_000
    state = torch.load(out / "ckpt_best.pt", weights_only=True)  # loads without running code
    assert state["encoder_sha256"] == caption.sha256_file(stage1["encoder"])


def test_pair_prints_a_caption_and_rejects_missing_or_non_image_files(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    before = next((stage1["root"] / "images").iterdir())
    after = stage1["root"] / "sc_images" / before.name.replace("default", "semantic")
    result = stage2(stage1, out, "--pair", before, after)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()  # one caption, whatever a 1-epoch model says
    missing = stage2(stage1, out, "--pair", before, tmp_path / "nothing.png")
    assert missing.returncode == 1 and "nothing.png" in missing.stderr and "missing" in missing.stderr
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    not_image = stage2(stage1, out, "--pair", before, text)
    assert not_image.returncode == 1 and "notes.png" in not_image.stderr and "not an image" in not_image.stderr


def test_a_corrupt_captioner_checkpoint_is_named_in_the_error(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    best = out / "ckpt_best.pt"
    best.write_bytes(best.read_bytes()[:1000])
    result = stage2(stage1, out, "--eval")
    assert result.returncode == 1 and str(best) in result.stderr and "corrupt" in result.stderr


def test_a_run_killed_during_training_resumes_and_keeps_every_checkpoint_loadable(stage1, tmp_path):
    out = tmp_path / "cap"
    args = ["--epochs", "4", "--save_every", "2", "--batch_size", "4"]
    command = [sys.executable, str(HERE / "caption.py"), "--data", "synth", *TINY_DECODER,
               "--data_root", str(stage1["root"]), "--encoder_ckpt", str(stage1["encoder"]), "--out_dir", str(out),
               *args]
    process = subprocess.Popen(command, cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for the first epoch's checkpoints and a later step, then SIGKILL
        log = out / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        if (out / "ckpt_best.pt").exists() and records and "split" not in records[-1] and records[-1]["step"] % 2:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = torch.load(out / "ckpt_last.pt", weights_only=True)["step"]
    result = stage2(stage1, out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"at step {killed_at}" in result.stdout
    last = torch.load(out / "ckpt_last.pt", weights_only=True)
    assert last["step"] > killed_at and len(last["history"]) + last["bad_epochs"] >= 1
    assert [h["epoch"] for h in last["history"]] == list(range(len(last["history"])))  # no epoch lost or repeated
    for name in ("ckpt_best.pt", "ckpt_last.pt"):
        runtime.load_checkpoint(out / name)
    assert not list(out.glob(".*.tmp*"))


def test_resuming_with_another_decoder_config_is_refused(stage1, tmp_path):
    out = tmp_path / "cap"
    assert stage2(stage1, out, "--epochs", "1").returncode == 0
    result = stage2(stage1, out, "--epochs", "2", "--resume", "--decoder_ffn", "256")
    assert result.returncode == 1 and "decoder_ffn" in result.stderr
