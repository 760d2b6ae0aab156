import sys
from pathlib import Path

import pytest

from hf_spanattn.ops import tiles

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def small_tiles(monkeypatch):
    """Query-row tiles of 4 rows, so that the tiling shows at the tests' short sequences."""
    monkeypatch.setattr(tiles, "_TILE_ROWS", 4)
    monkeypatch.setattr(tiles, "_MAX_TILES", 100)
