"""The skips the test suite expects, and the pytest plugin that fails a run on any other.

:data:`EXPECTED` is the one list of skip reasons a run may report: each entry is a regular
expression that must match a skip's whole reason, the condition it stands for (world
size, fast-path mode, no GPU, extension not built when that is allowed, platform), and a
check that the condition holds in this process. :class:`SkipPolicy` (registered by the
conftests of ``tests/unit`` and ``tests/mpi`` through :func:`register`):

- prints the path dtensor's ops take (``fastpath: compiled, used`` or ``fastpath: python
  path (why)``), read from dtensor itself, in the report header (alone under ``-q``);
- turns a skip whose reason no entry allows (or whose entry's condition does not hold
  here) into a failed session, listing each such test id with its reason;
- says so in the summary when every test of the session skipped;
- writes the session's counts to the JSON file named by ``DTENSOR_TEST_REPORT`` when that
  is set (the test runner, ``python -m launch test``, reads it for its summary).

Under MPI every rank checks its own skips and sets its own exit status (skips depend on
the world size only, so all ranks agree); only the rank that prints pytest's report (rank
0) writes the report file, and a rank that has no terminal report writes its unexpected
skips to stderr.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import dtensor as dt
import fastpath

#: Environment variable naming the JSON file that receives a session's counts.
REPORT_ENV = "DTENSOR_TEST_REPORT"
_PLUGIN_NAME = "dtensor-skips"
_SKIPPED_PREFIX = "Skipped: "


def _always() -> bool:
    return True


def _ext_missing_and_allowed() -> bool:
    return not fastpath.AVAILABLE and os.environ.get("DTENSOR_REQUIRE_EXT") != "1"


def _fastpath_off() -> bool:
    return not fastpath.ENABLED


def _no_torch() -> bool:
    return importlib.util.find_spec("torch") is None


@dataclass(frozen=True)
class Expected:
    """An expected skip: ``pattern`` matches the whole reason, ``why`` names the condition
    and ``holds()`` says whether that condition is true in this process."""

    pattern: str
    why: str
    holds: Callable[[], bool] = _always

    def allows(self, reason: str) -> bool:
        return re.fullmatch(self.pattern, reason, re.DOTALL) is not None and self.holds()


EXPECTED: tuple[Expected, ...] = (
    # world size (MPI stages run at 1, 2, 3 and 4 ranks)
    Expected(
        r"Test requires \d+ MPI processes, only \d+ MPI processes specified, skipping test",
        "world size below the test's min_size",
    ),
    Expected(r"(the )?(2x2 mesh )?needs (exactly )?4 ranks", "world size is not 4"),
    Expected(r"(3-D meshes are|a 3-D mesh) (tested|runs) at 4 ranks .*", "no 3-D mesh here"),
    Expected(r"see test_sampled_pairs_3d", "no 3-D mesh here"),
    # fast-path mode: DTENSOR_FASTPATH=0 or the extension not built
    Expected(
        r"compiled fast path not enabled \(not built or disabled\)",
        "fast path off",
        _fastpath_off,
    ),
    Expected(r"kernels are used only when enabled", "fast path off", _fastpath_off),
    Expected(r"the compiled fast path is not available", "fast path off", _fastpath_off),
    # extension not built, where DTENSOR_REQUIRE_EXT=1 does not demand it
    Expected(
        r"(compiled extension not built|the compiled twins are not built"
        r"|fastpath extension not built: .*)",
        "extension not built",
        _ext_missing_and_allowed,
    ),
    Expected(
        r"DTENSOR_REQUIRE_EXT is not 1",
        "extension not required",
        lambda: os.environ.get("DTENSOR_REQUIRE_EXT") != "1",
    ),
    # no GPU (or no cupy)
    Expected(r"no GPU: .*", "no GPU"),
    Expected(r"device binding is a GPU matter", "GPU-only case on the CPU device"),
    # platform and environment
    Expected(r"no memfd here, or DTENSOR_SHM=0", "no shared segments"),
    Expected(r"no shared segments here \(DTENSOR_SHM=0\)", "no shared segments"),
    Expected(r"needs fork", "no fork on this platform"),
    Expected(r"no memfd here: pooled buffers behave as plain ones", "no page pool (no memfd)"),
    Expected(r"uses Hydra's -genv", "mpiexec is not MPICH's Hydra"),
    Expected(r"no mpiexec found next to the Python interpreter or on PATH: .*", "no mpiexec"),
    Expected(
        r"the default allocator runs with DTENSOR_ALLOCATOR=nocache",
        "DTENSOR_ALLOCATOR=nocache",
        lambda: os.environ.get("DTENSOR_ALLOCATOR") == "nocache",
    ),
    Expected(
        r"a watchdog or an observer is configured from outside",
        "a debug check configured by the environment",
    ),
    Expected(r"torch is not installed", "no torch", _no_torch),
)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report, as ``-rs`` prints it (no ``Skipped:`` prefix)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix(_SKIPPED_PREFIX)


def expected(reason: str) -> Expected | None:
    """The entry of :data:`EXPECTED` that allows ``reason`` here, or None."""
    return next((e for e in EXPECTED if e.allows(reason)), None)


def fastpath_mode() -> str:
    """The path dtensor's ops take in this process: ``compiled, used`` or ``python path (why)``."""
    status = dt.debug.fastpath_status()
    return "compiled, used" if status["active"] else f"python path ({status['reason']})"


class SkipPolicy:
    """The pytest plugin: counts outcomes, and fails the session on an unexpected skip."""

    def __init__(self, label: str = "") -> None:
        self.label = label  # prefixes what a process without a terminal report writes
        self.mode = fastpath_mode()  # before any test toggles the front
        self.passed = 0
        self.failed = 0
        self.skipped: list[tuple[str, str]] = []  # (test id, reason)
        self.unexpected: list[tuple[str, str]] = []

    def _skip(self, nodeid: str, reason: str) -> None:
        self.skipped.append((nodeid, reason))
        if expected(reason) is None:
            self.unexpected.append((nodeid, reason))

    def pytest_report_header(self) -> str:
        return f"fastpath: {self.mode}"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None and (not tr.showheader or tr.no_header):  # -q: the line alone
            tr.write_line(f"fastpath: {self.mode}")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self._skip(report.nodeid, skip_reason(report))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed += 1
        elif report.skipped and not hasattr(report, "wasxfail"):
            self._skip(report.nodeid, skip_reason(report))
        elif report.passed and report.when == "call":
            self.passed += 1

    def _unexpected_lines(self) -> list[str]:
        return [f"{nodeid}: {reason}" for nodeid, reason in self.unexpected]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        config = session.config
        if config.pluginmanager.get_plugin("terminalreporter") is None:
            if self.unexpected:  # an MPI rank other than 0: its own verdict, on stderr
                lines = self._unexpected_lines()
                sys.stderr.write("".join(f"{self.label}unexpected skip: {x}\n" for x in lines))
                sys.stderr.flush()
            return
        path = os.environ.get(REPORT_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(
                    {
                        "passed": self.passed,
                        "failed": self.failed,
                        "skipped": len(self.skipped),
                        "unexpected": len(self.unexpected),
                        "fastpath": self.mode,
                    },
                    f,
                )

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr = terminalreporter
        if self.skipped and not self.passed and not self.failed:
            reasons = Counter(reason for _, reason in self.skipped)
            tr.section("every test skipped", yellow=True, bold=True)
            for reason, count in reasons.most_common():
                tr.write_line(f"{count} x {reason}")
        if self.unexpected:
            tr.section("unexpected skips (the session fails)", red=True, bold=True)
            tr.write_line(
                "each reason below matches no entry of tests/skips.py EXPECTED whose "
                "condition holds here:",
                red=True,
            )
            for line in self._unexpected_lines():
                tr.write_line(f"UNEXPECTED SKIP {line}", red=True)


def register(config: pytest.Config, label: str = "") -> None:
    """Register :class:`SkipPolicy` once per session (from a conftest's ``pytest_configure``).

    ``label`` prefixes the lines a process without pytest's terminal report (an MPI rank
    other than 0) writes to stderr, e.g. ``"[rank 2] "``.
    """
    if config.pluginmanager.get_plugin(_PLUGIN_NAME) is None:
        config.pluginmanager.register(SkipPolicy(label), _PLUGIN_NAME)
