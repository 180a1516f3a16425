import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "tests/tiny_models.py"


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    # Factory references like tests/tiny_models.py:tiny_cnn are relative to the repository root.
    monkeypatch.chdir(ROOT)


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


needs_two_cores = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPU cores for two core-set units"
)

sys.path.insert(0, str(ROOT / "src"))
