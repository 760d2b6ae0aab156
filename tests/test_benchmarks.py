"""The benchmark scripts' command lines on tiny shapes (nothing here is timed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks import train_step  # noqa: E402


@pytest.mark.parametrize("chosen", [None, "fused"])
def test_train_step_leaves_the_backend_variable_as_it_found_it(chosen, monkeypatch, capsys):
    """Each backend is picked through HF_SPANATTN_BACKEND; the script used to leave the last one set."""
    if chosen is None:
        monkeypatch.delenv("HF_SPANATTN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("HF_SPANATTN_BACKEND", chosen)
    train_step.main(["--peak", "score:1000 [tiles]", "--seq", "8", "--batch", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak"] >= 0
    assert train_step.os.environ.get("HF_SPANATTN_BACKEND") == chosen
