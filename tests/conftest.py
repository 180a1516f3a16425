"""Shared fixtures: small real models and a temporary results database."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"

TINY_CNN = '''
import torch
from torch import nn


class Tiny(nn.Module):
    input_shape = (3, 32, 32)

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
        )

    def forward(self, x):
        return self.body(x)


def build():
    torch.manual_seed(0)
    return Tiny()


def no_shape():
    return nn.Linear(4, 2)


def not_a_module():
    return 42
'''


_SUITE_CACHE: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """The suite's ONNX exports and engine caches go to a folder of its own, removed at the end.

    Tests build models with fresh random weights, so every run exports new files: left in the
    user's `~/.cache/infermux`, runs of the suite would fill the disk.
    """
    global _SUITE_CACHE
    if "INFERMUX_CACHE_DIR" not in os.environ:
        _SUITE_CACHE = tempfile.mkdtemp(prefix="infermux-suite-cache-")
        os.environ["INFERMUX_CACHE_DIR"] = _SUITE_CACHE
    # Started in the background by a shell without job control (`make test &` in a script),
    # the suite inherits SIGINT ignored, and so would every `python -m infermux` it starts:
    # Python leaves an ignored SIGINT ignored, so the Ctrl-C tests' processes would never see
    # theirs (the bench ran to its end, the served run outlived its 90 s wait).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SUITE_CACHE is not None:
        shutil.rmtree(_SUITE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path to a Python file defining a tiny CNN; `<path>:build` is a model reference."""
    path = tmp_path_factory.mktemp("models") / "tiny.py"
    path.write_text(TINY_CNN)
    return str(path)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "results.db"


def worker_children(pid: int) -> list:
    """`pid`'s process-hosted worker children (psutil processes), at any depth below it.

    Forked from the worker template they carry its name (`infermux-worker`); started as fresh
    interpreters, their command line names `infermux.runtime._child`.
    """
    import psutil

    from infermux.runtime._zygote import WORKER_NAME

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name() == WORKER_NAME or "infermux.runtime._child" in " ".join(
                    child.cmdline()):
                found.append(child)
    return found


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m infermux ARGS` in a fresh process, as a user would."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "infermux", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT,
    )
def invoke_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the `infermux` command line in this process: its exit code, stdout and stderr.

    The same entry point (`infermux.cli.main`) a user's process runs, without starting an
    interpreter and importing torch again for each command; `run_cli` is for the tests whose
    subject is the process itself (signals, tracebacks, the `python -m infermux` entry).
    """
    from infermux.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: int
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"COLUMNS": "200", **(env or {})}.items():
            mp.setenv(key, value)
        mp.setattr(sys, "argv", ["infermux", *args])  # what a run stores as its command
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["infermux", *args], code, out.getvalue(), err.getvalue())


TINY = "tests/tiny_models.py"

MS = 1_000_000


class Clock:
    """A fake nanosecond clock for the dispatcher's `clock_ns`: time moves only when told."""

    def __init__(self) -> None:
        self.ns = 1_000 * MS

    def __call__(self) -> int:
        return self.ns

    def advance(self, ms: float) -> None:
        self.ns += int(ms * MS)


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


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A fresh INFERMUX_CACHE_DIR for one test module (ONNX exports, engine caches)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERMUX_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def cpu():
    """The whole-CPU unit of this machine."""
    from infermux.units import discover

    unit = discover(with_runtimes=False).get("cpu")
    assert unit is not None
    return unit


# -- networks of several inputs (tests/test_iospec.py, tests/test_multi_input.py) ----------

TWO_INPUTS = '''
import torch
from torch import nn


class TwoInputs(nn.Module):
    """Float features and int64 ids (a bag of embeddings) → 4 scores."""

    inputs = [{"name": "features", "dtype": "float32", "shape": [16]},
              {"name": "ids", "dtype": "int64", "shape": ["seq"], "high": 50}]
    outputs = ["scores"]
    default_dims = {"seq": 8}

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(32, 4)

    def forward(self, features, ids):
        return self.head(torch.cat([features, self.embed(ids).mean(1)], dim=1))


def build():
    torch.manual_seed(0)
    return TwoInputs()
'''


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory, module_cache_dir):
    """(factory reference, ONNX file exported from it with a dynamic batch and sequence)."""
    import warnings

    import torch

    from infermux.models import load_model

    folder = tmp_path_factory.mktemp("two")
    (folder / "two.py").write_text(TWO_INPUTS)
    factory = f"{folder / 'two.py'}:build"
    module = load_model(factory).module
    onnx_path = folder / "two.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(2, 16), torch.zeros(2, 8, dtype=torch.long)),
                          str(onnx_path), input_names=["features", "ids"],
                          output_names=["scores"], dynamo=False,
                          dynamic_axes={"features": {0: "batch"}, "ids": {0: "batch", 1: "seq"},
                                        "scores": {0: "batch"}})
    return factory, str(onnx_path)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, module_cache_dir):
    """A folder holding a two-layer BERT's config.json (random weights, nothing downloaded)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("tinybert")
    transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100).save_pretrained(str(folder))
    return f"hf:{folder}"
