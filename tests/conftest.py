import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels run in Triton's interpreter on CPU tensors; this must precede Triton's first
    # import (Transformers imports it), so it is set here rather than in tests/test_triton.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_spanattn.ops import blocks, tile_engine, tiles  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def environment_as_before():
    """os.environ as it was before the test: Transformers 4's TrainingArguments writes ACCELERATE_USE_FSDP, FSDP_*
    and ACCELERATE_MIXED_PRECISION into it, which every later Trainer of the process reads (an FSDP plugin that
    cannot start on a CPU; bf16 autocast where a run asked for none)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def backward_parts_at_any_size(monkeypatch):
    """The backward pass in parts also at the tests' small batches, where it takes them whole
    (`tile_engine._MIN_PART`), so that its parts and their joining show there; `monkeypatch.undo()` in a
    test gives back the package's value."""
    monkeypatch.setattr(tile_engine, "_MIN_PART", 1)


@pytest.fixture
def small_tiles(monkeypatch):
    """Query-row tiles of 4 rows, so that the tiling shows at the tests' short sequences, and
    per-block stacks of a row or two, so that the per-block rule cuts its tiles into rows."""
    monkeypatch.setattr(tiles, "_TILE_ROWS", 4)
    monkeypatch.setattr(tiles, "_MAX_TILES", 100)
    monkeypatch.setattr(blocks, "_STACK_ELEMENTS", 200)


@pytest.fixture
def recomputed_tiles(monkeypatch):
    """The probabilities recomputed in the backward pass at every length, in tiles of 16 rows."""
    monkeypatch.setattr(tile_engine, "_KEPT_ROWS", 0)
    monkeypatch.setattr(tile_engine, "_RECOMPUTED_ROWS", 0)


@pytest.fixture
def partly_kept_tiles(monkeypatch):
    """Every other probability tile kept by the forward pass, the others recomputed (with `small_tiles`,
    tiles of 4 rows)."""
    monkeypatch.setattr(tile_engine, "_kept_tiles", lambda mask, *_: [i % 2 == 0 for i in range(len(mask.tiles))])
