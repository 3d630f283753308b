"""Real text for the GPT examples: the docstrings of Python's standard library and of numpy
(every machine with dtensor has both), gathered in a fixed order, as byte-level tokens.

- :func:`docstring_text` walks the standard library's and numpy's source files in sorted
  order (test folders left out) and joins every module, class and function docstring
  (``ast``, nothing imported); the result is cached per Python and numpy version.
- :class:`ByteData` splits a byte string into a training part and a held-out validation
  tail, and draws batches: the global batch of a step is a function of the seed and the
  step only, so every strategy sees the same data, and each data-parallel rank takes its
  own rows of it (:meth:`launch.examples.gpt_strategies.Run.inputs`).
"""

from __future__ import annotations

import ast
import os
import sysconfig
from pathlib import Path

import numpy as np

VOCAB = 256  # byte-level tokens


def _docstrings(root: Path) -> list[str]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages",
                                                      "__pycache__", "idlelib"))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(folder, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        out.append(doc)
    return out


def _cache_path() -> Path:
    import sys

    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dtensor"
    ver = f"py{sys.version_info.major}.{sys.version_info.minor}-np{np.__version__}"
    return base / f"docstrings-{ver}.txt"


def docstring_text(cache: bool = True) -> bytes:
    """The standard library's and numpy's docstrings, UTF-8, in a fixed order. **Local**.

    Parsing takes several seconds; the text is cached under ``~/.cache/dtensor`` (written
    to a temporary name and renamed, so ranks that race write the same file)."""
    path = _cache_path()
    if cache and path.exists():
        return path.read_bytes()
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(np.__file__).parent]
    text = "\n\n".join(d for root in roots for d in _docstrings(root)).encode("utf-8")
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(text)
            os.replace(tmp, path)
        except OSError:
            pass
    return text


class ByteData:
    """Byte tokens with a held-out validation tail (``val_fraction`` of the bytes).

    ``batch(step, batch_size, seq)`` gives ``(idx, targets)``, int64 arrays of shape
    ``(batch_size, seq)``: windows of the training part at offsets drawn from
    ``(seed, step)``; ``split="val"`` draws from the validation part. **Local**.
    """

    def __init__(self, data: bytes, val_fraction: float = 0.1, seed: int = 0) -> None:
        arr = np.frombuffer(data, dtype=np.uint8)
        n_val = max(int(len(arr) * val_fraction), 1)
        self.train = arr[:-n_val]
        self.val = arr[-n_val:]
        self.seed = seed

    def batch(self, step: int, batch_size: int, seq: int, split: str = "train") -> tuple:
        part = self.train if split == "train" else self.val
        if len(part) <= seq + 1:
            raise ValueError(f"ByteData: the {split} part has {len(part)} bytes, fewer than a "
                             f"window of {seq + 1}")
        rng = np.random.default_rng((self.seed, step, 0 if split == "train" else 1))
        starts = rng.integers(0, len(part) - seq - 1, batch_size)
        rows = np.stack([part[s:s + seq + 1] for s in starts]).astype(np.int64)
        return rows[:, :-1].copy(), rows[:, 1:].copy()

    def unigram_loss(self) -> float:
        """The cross entropy (nats) of predicting every validation byte by the training
        bytes' frequencies: the baseline a model must beat. **Local**."""
        counts = np.bincount(self.train, minlength=VOCAB).astype(np.float64) + 1.0
        p = counts / counts.sum()
        return float(-np.log(p[self.val]).mean())
