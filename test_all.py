"""Tests for every file of the project, in the order of the README's file list.

Run them with:  python -m pytest test_all.py -q

Tests that compare against known answers in ../shared (OpenAI's own CLIP outputs, the coco-caption
toolkit's scores) skip with the reason when that folder is missing, and fail instead under CI=true.
"""
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("CLIP4IDC_SHARED", HERE.parent / "shared"))


def shared(*parts) -> Path:
    """The path of a file in ../shared; skip the test when it is missing (fail under CI=true)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        message = f"{path} is missing: the known-answer vectors live in ../shared beside the checkout"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path
