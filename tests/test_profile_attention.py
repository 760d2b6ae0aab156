"""benchmarks/profile_attention.py on a tiny CPU shape: its table parses, and its sums add up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks import profile_attention  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it without CUDA
    pytest.skip("the Triton kernels run on CPU tensors in Triton's interpreter only", allow_module_level=True)


def test_profile_table(capsys):
    """One label on tiles and on triton (Triton's interpreter): per backend the top kernels, the others,
    then the package's Triton kernels, everything else and the total, which the parts add up to."""
    top = 3
    profile_attention.main(["--device", "cpu", "--labels", "score:1000", "--batch", "1", "--heads", "1", "--seq",
                            "16", "--dim", "8", "--warmup", "1", "--calls", "2", "--top", str(top)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert cells[0] == profile_attention.COLUMNS and set(cells[1]) <= {"---", "---:"}
    body = cells[2:]
    assert all(len(row) == len(profile_attention.COLUMNS) for row in body)
    for backend in ("tiles", "triton"):
        rows = [row for row in body if row[:2] == ["score:1000", backend]]
        assert len(rows) == top + 4 and rows[top][2].startswith("(the other ")
        us = [float(row[3]) for row in rows]
        launches = [float(row[4]) for row in rows]
        shares = [float(row[5].removesuffix(" %")) for row in rows]
        assert [row[2] for row in rows[-3:]] == ["= the package's Triton kernels", "= everything else", "= total"]
        assert sum(us[:top + 1]) == pytest.approx(us[-1], rel=1e-3, abs=0.5)
        assert us[-3] + us[-2] == pytest.approx(us[-1], rel=1e-3, abs=0.5) and shares[-1] == 100.0
        assert sum(launches[:top + 1]) == launches[-3] + launches[-2] == launches[-1]
        ours = {row[2] for row in rows[:top]} & set(profile_attention.TRITON_KERNELS)
        if backend == "triton":  # forward, then dQ's and dK's products: each kernel launched once per call
            assert launches[-3] == 3 and us[-3] > 0 and ours
        else:
            assert launches[-3] == 0 and us[-3] == 0 and not ours
