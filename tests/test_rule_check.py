"""benchmarks/rule_check.py on a tiny GPT-2: the standard rule's gradients are the stock ones, and the
backends agree with the float64 tiles; score:1000's are not the stock ones."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks import rule_check  # noqa: E402

DATA = Path(__file__).parents[2] / "shared" / "data"
pytestmark = pytest.mark.skipif(not (DATA / "gpt2-tokenizer").is_dir(), reason="needs ../shared/data")
TINY = ["--data", str(DATA), "--chars", "30000", "--seq", "32", "--dim", "16", "--heads", "2", "--layers", "2",
        "--batch", "2", "--warm", "2", "--backends", "tiles,fused"]


def tables(text: str) -> list[list[list[float]]]:
    """The numbers of each Markdown table's body rows (first cell dropped)."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|") and "---" not in line and not line.startswith("| layer") \
                and not line.startswith("| backend"):
            rows.append([float(cell) for cell in line.strip("|").split("|")[1:]])
        elif rows and not line.startswith("|"):
            found, rows = found + [rows], []
    return found


@pytest.mark.parametrize("rule,same", [("standard:QKV111", True), ("score:1111", True), ("score:1000", False)])
def test_rule_check_compares_gradients_with_the_standard_and_the_float64_backend(rule, same, capsys):
    chosen = os.environ.get("HF_SPANATTN_BACKEND")
    rule_check.main(TINY + ["--rule", rule])
    assert os.environ.get("HF_SPANATTN_BACKEND") == chosen  # picked per backend, then left as it was
    per_layer, backends = tables(capsys.readouterr().out)
    assert len(per_layer) == 2 and len(backends) == 2
    ratios_and_cosines = [x for row in per_layer for x in row]
    assert all(x == pytest.approx(1, abs=1e-4) for x in ratios_and_cosines) == same
    assert all(0 <= x < 1e-5 for row in backends for x in row)  # fp32 against float64
