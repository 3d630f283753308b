"""Timing and reporting helpers shared by the benchmarks in ``launch/bench/``.

Two ways to time:

* :func:`per_call_us` for fast calls (microseconds): each sample runs the call in a
  batched loop of ``number`` calls and divides, so timer overhead disappears.
* :func:`each_call_us` for slow calls (collectives, big copies): each sample times one
  call; with a communicator the ranks meet at a barrier before every call.

Both warm up first and return all samples; :func:`summary` reduces them to the median
(the figure to report on a noisy machine) plus spread. Under MPI, :func:`worst_rank`
turns a per-rank figure into the slowest rank's. :func:`bench_args` and
:func:`emit` give every benchmark the same ``--repeat`` / ``--out`` options and the same
JSON output (stdout, and a file when asked).

For calls that may communicate and whose cost spans orders of magnitude (an op from 8x8 to
4096x4096), :func:`worst_rank_median_us` agrees on the calls per sample across the ranks
(:func:`agreed_number`) and sizes the number of samples to a time budget.

Reporting: :func:`bench_args` (or :func:`parser` for a script's own options) gives a command
line whose ``--help`` shows every default (:class:`HelpFormatter`); :func:`table` lays out
rows as an aligned text table (or a markdown one) and :func:`emit` prints the JSON document
followed by that table, so a run ends with something a person can read; :class:`Progress`
prints one line per finished piece of a long run on standard error (``--quiet`` silences
it); :func:`save_png` draws a chart, or says clearly why it could not.
:func:`torch_process_group` starts the gloo process group that PyTorch's DTensor runs on,
for the benchmarks that compare with it. :func:`numpy_gelu`, :func:`numpy_softmax` and
:func:`numpy_layer_norm` are the numpy twins the benchmarks time next to dtensor's ops.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np


def per_call_us(
    fn: Callable[[], Any],
    *,
    repeat: int = 15,
    number: int | None = None,
    warmup: int = 100,
    target_s: float = 0.005,
) -> list[float]:
    """Microseconds per call of ``fn`` for each of ``repeat`` batched samples. **Local**.

    Parameters
    ----------
    fn : callable
        Called with no arguments; its result is dropped.
    repeat : int
        Number of samples.
    number : int, optional
        Calls per sample; by default chosen so that one sample lasts about ``target_s``.
    warmup : int
        Calls made before timing (and before choosing ``number``).
    target_s : float
        Duration of one sample when ``number`` is not given.
    """
    clock = time.perf_counter_ns
    for _ in range(warmup):
        fn()
    if number is None:
        number = 1
        while True:
            start = clock()
            for _ in range(number):
                fn()
            if clock() - start >= target_s * 1e9:
                break
            number *= 2
    samples = []
    for _ in range(repeat):
        start = clock()
        for _ in range(number):
            fn()
        samples.append((clock() - start) / number / 1e3)
    return samples


def each_call_us(
    fn: Callable[[], Any], *, repeat: int = 30, warmup: int = 3, comm: Any = None
) -> list[float]:
    """Microseconds of each of ``repeat`` single calls of ``fn``.

    **Collective** when ``comm`` is given (every rank must call it with the same
    ``repeat`` and ``warmup``): the ranks meet at a barrier before each call, so every
    sample starts together. **Local** otherwise.
    """
    clock = time.perf_counter_ns
    samples = []
    for i in range(warmup + repeat):
        if comm is not None:
            comm.Barrier()
        start = clock()
        fn()
        elapsed = clock() - start
        if i >= warmup:
            samples.append(elapsed / 1e3)
    return samples


def agreed_number(fn: Callable[[], Any], comm: Any, target_s: float) -> tuple[int, float]:
    """Calls per sample so that a sample lasts ``target_s`` on the slowest rank. **Collective**.

    Doubles the number of calls from 1 until ``number`` calls take at least ``target_s`` on
    the slowest rank (one call when a single call takes longer). Every rank gets the same
    answer, so calls that communicate stay matched.

    Returns
    -------
    (int, float)
        The number of calls and the slowest rank's seconds for that many calls.
    """
    clock = time.perf_counter
    number = 1
    while True:
        start = clock()
        for _ in range(number):
            fn()
        elapsed = worst_rank(clock() - start, comm)
        if elapsed >= target_s:
            return number, elapsed
        number *= 2


def worst_rank_median_us(
    fn: Callable[[], Any],
    comm: Any,
    *,
    budget_s: float,
    target_s: float = 0.002,
    min_repeat: int = 3,
    max_repeat: int = 15,
    warmup: int = 1,
) -> tuple[float, int]:
    """The slowest rank's median microseconds per call of ``fn``. **Collective**.

    After ``warmup`` calls the ranks agree on the calls per sample (:func:`agreed_number`,
    samples of about ``target_s``); the number of samples is what fits in ``budget_s``,
    clamped to ``[min_repeat, max_repeat]``. Every rank makes the same calls.

    Returns
    -------
    (float, int)
        The median over this rank's samples, maximum over the ranks, in microseconds; and
        the number of samples taken.
    """
    for _ in range(warmup):
        fn()
    comm.Barrier()
    number, sample_s = agreed_number(fn, comm, target_s)
    repeat = min(max(int(budget_s / sample_s), min_repeat), max_repeat)
    samples = per_call_us(fn, repeat=repeat, number=number, warmup=0)
    return worst_rank(statistics.median(samples), comm), repeat


def torch_process_group(comm: Any) -> Callable[[], None] | None:
    """Start PyTorch's gloo process group over the ranks of ``comm``. **Collective**.

    Rank ``r`` of ``comm`` is rank ``r`` of the group; the ranks meet through a file store
    whose path rank 0 chooses and broadcasts (no port to pick). Sets PyTorch to one thread
    per rank, as the launcher does for BLAS.

    Returns
    -------
    callable or None
        The teardown (destroys the group, removes the store file), or None when torch is
        not importable (on every rank alike).
    """
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        return None
    torch.set_num_threads(1)
    path = None
    if comm.rank == 0:
        fd, path = tempfile.mkstemp(prefix="dtensor_bench_store_")
        os.close(fd)
        os.unlink(path)
    path = comm.bcast(path, root=0)
    store = tdist.FileStore(path, comm.size)
    tdist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)

    def teardown() -> None:
        tdist.destroy_process_group()
        if comm.rank == 0 and os.path.exists(path):
            os.unlink(path)

    return teardown


def numpy_gelu(a: Any) -> Any:
    """GELU in numpy, the tanh form (numpy has no erf): the closest numpy computation of the
    same size. **Local**."""
    return 0.5 * a * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))


def numpy_softmax(a: Any) -> Any:
    """Softmax over the last axis in numpy (max-shifted). **Local**."""
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def numpy_layer_norm(a: Any, weight: Any, bias: Any, eps: float = 1e-5) -> Any:
    """Layer norm over the last axis in numpy (biased variance), scaled and shifted.
    **Local**."""
    c = a - a.mean(axis=-1, keepdims=True)
    var = (c * c).mean(axis=-1, keepdims=True)
    return c / np.sqrt(var + eps) * weight + bias


def summary(samples: list[float]) -> dict[str, float]:
    """Median, min, max and count of timing samples (microseconds). **Local**."""
    return {
        "median_us": round(statistics.median(samples), 3),
        "min_us": round(min(samples), 3),
        "max_us": round(max(samples), 3),
        "samples": len(samples),
    }


def worst_rank(value: float, comm: Any) -> float:
    """The largest ``value`` over the ranks of ``comm`` (MPI MAX). **Collective**."""
    from mpi4py import MPI

    return comm.allreduce(value, op=MPI.MAX)


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` rounded for reports (inf when the denominator is 0)."""
    return round(numerator / denominator, 2) if denominator else float("inf")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default after its help (not for flags that default
    to off, nor for options without a default); list defaults are written as they are
    typed (``8 2048`` for ``nargs``, ``64,256`` for a comma-separated option). The
    description and the epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if ("%(default)" in help or not action.option_strings or default is None
                or default is False or default is argparse.SUPPRESS):
            return help
        if isinstance(default, (list, tuple)):
            sep = " " if action.nargs in ("+", "*") else ","
            text = sep.join(str(v) for v in default)
        else:
            text = str(default)
        return f"{help} (default: {text.replace('%', '%%')})"


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the defaults (:class:`HelpFormatter`).
    **Local**."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def bench_args(description: str, argv: list[str] | None = None, *, repeat: int = 30,
               **extra: Any) -> Any:
    """Parse the options every benchmark has: ``--repeat``, ``--out`` and ``--quiet``.
    **Local**.

    ``repeat`` is the default of ``--repeat``; ``extra`` maps further flag names (without
    dashes; ``_`` becomes ``-``) to ``argparse`` keyword dicts. ``--help`` shows every
    default.
    """
    p = parser(description)
    p.add_argument("--repeat", type=int, default=repeat, help="timing samples per figure")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--quiet", action="store_true", help="no progress lines (on stderr)")
    for name, kwargs in extra.items():
        p.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return p.parse_args(argv)


class Progress:
    """Progress lines of a long run, on standard error: ``name: [i/total] what (12.3 s)``,
    the seconds since the start. **Local**: create it on every rank, it prints on the
    ranks where ``enabled`` (pass ``rank == 0 and not args.quiet``).

    Call it with a message after each finished piece (``step`` advances the count; pass
    ``step=False`` for a line about the piece under way). ``total`` may be set later.
    """

    def __init__(self, name: str, total: int | None = None, *, enabled: bool = True) -> None:
        self.name, self.total, self.enabled = name, total, enabled
        self.done = 0
        self.start = time.perf_counter()

    def __call__(self, message: str, *, step: bool = True) -> None:
        self.done += step
        if not self.enabled:
            return
        count = "" if not step else (
            f"[{self.done}/{self.total}] " if self.total else f"[{self.done}] ")
        seconds = time.perf_counter() - self.start
        print(f"{self.name}: {count}{message} ({seconds:.1f} s)", file=sys.stderr, flush=True)


def fmt(value: Any) -> str:
    """One table cell: ``-`` for None, ``yes``/``no`` for booleans, floats to 3-4
    significant digits (``1234``, ``12.3``, ``0.123``, ``1.2e-05``). **Local**."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return str(value) if value else "0"
        mag = abs(value)
        if mag >= 99.95 or (value == int(value) and mag >= 10):
            return f"{value:.0f}"
        if mag >= 9.995:
            return f"{value:.1f}"
        if mag >= 0.9995:
            return f"{value:.2f}"
        if mag >= 0.00995:
            return f"{value:.3f}"
        return f"{value:.1e}"
    return str(value)


def _numeric(text: str) -> bool:
    try:
        float(text.rstrip("x%"))
    except ValueError:
        return text == "-"
    return True


def table(head: Sequence[str], rows: Iterable[Sequence[Any]], *, title: str | None = None,
          notes: Sequence[str] = (), markdown: bool = False, align: str | None = None) -> str:
    """Rows as a compact table: a title line (optional), the header, a rule, the rows, then
    notes (one line each). **Local**.

    Cells go through :func:`fmt` unless they are strings. Columns whose cells are all
    numbers are right-aligned; ``align`` sets each column instead (``l``, ``r``, or ``c``
    for markdown's centred). Text tables separate columns by two spaces; ``markdown`` gives
    ``| a | b |`` rows with an alignment rule (``|---|---:|``).
    """
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    if align is None:
        align = "".join("r" if cells and all(_numeric(r[i]) for r in cells) else "l"
                        for i in range(len(head)))
    lines = [title] if title else []
    if markdown:
        rule = {"l": "---", "r": "---:", "c": ":---:"}
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(rule[a] for a in align) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in cells]
    else:
        widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(head)]

        def line(row: Sequence[str]) -> str:
            return "  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                             for c, w, a in zip(row, widths, align)).rstrip()

        lines.append(line(head))
        lines.append("  ".join("-" * w for w in widths))
        lines += [line(r) for r in cells]
    lines += list(notes)
    return "\n".join(lines)


def save_png(path: str, draw: Callable[[Any], Any], *, flag: str = "--png") -> bool:
    """Draw a chart with ``draw(pyplot)`` (which returns the figure) and write it to
    ``path``; print where it went. **Local** (call it on one rank).

    Returns False, after printing why (``flag: matplotlib is not installed ...; no chart
    written to path``), when matplotlib cannot be imported.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{flag}: matplotlib is not installed (pip install 'dtensor[bench]'); "
              f"no chart written to {path}", flush=True)
        return False
    fig = draw(plt)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    print(f"{flag}: chart written to {path}", flush=True)
    return True


def environment() -> dict[str, Any]:
    """Machine facts that belong next to any timing. **Local**."""
    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def emit(result: dict[str, Any], out: str | None, report: str | None = None) -> None:
    """Print ``result`` as JSON and then ``report`` (the run's :func:`table`, so that it is
    what a terminal shows last); when ``out`` is given, write the JSON there too.
    **Local**."""
    text = json.dumps(result, indent=2, sort_keys=False)
    sys.stdout.write(text + "\n")
    if report:
        sys.stdout.write("\n" + report + "\n")
    sys.stdout.flush()
    if out:
        with open(out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
