"""Cost model of redistribute steps: latency plus bytes over bandwidth, per collective.

This module owns :class:`CostModel` (alpha-beta constants per collective kind, optionally per
mesh dim), the process-wide default model (loaded from ``DTENSOR_COST_MODEL``), and the byte
and time estimates of plan steps (:func:`step_bytes`, :func:`step_cost`, :func:`plan_cost`).

Traffic per rank, for a step on a mesh dim of ``k`` coordinates and ``T`` the bytes of the
largest local block involved (largest over all coordinates, so every rank computes the same
estimate):

==================  ===================  =====================================
all_gather          ``(k-1)/k * T``       T: the gathered block (after)
reduce_scatter      ``(k-1)/k * T``       T: the partial block (before)
all_reduce          ``2(k-1)/k * T``      T: the block (before)
all_to_all          ``(k-1)/k * T``       T: the larger of before and after
local steps         0                     (cost: a small constant ``local_s``)
==================  ===================  =====================================

A collective's time is ``alpha_s + bytes / beta_bytes_per_s``. Defaults suit shared-memory
MPI on one machine (alpha 5 us, beta 5 GB/s); a calibration script can write a JSON file and
point ``DTENSOR_COST_MODEL`` at it (or put the JSON itself in the variable)::

    {"alpha_s": 5e-6, "beta_bytes_per_s": 5e9, "local_s": 1e-7,
     "per_kind": {"all_to_all": {"alpha_s": 8e-6}},
     "per_mesh_dim": {"1": {"default": {"beta_bytes_per_s": 1e9}}}}

Lookup order for (kind, mesh dim): ``per_mesh_dim[m][kind]``, ``per_mesh_dim[m]["default"]``,
``per_kind[kind]``, the top-level values; a missing field falls through to the next level.

Two link tiers: the values above price collectives among the ranks of one host (shared
memory). A mesh dim whose groups hold ranks of several hosts (``mesh.dim_spans_hosts``, see
:mod:`redistribute.hosts`) crosses the network and is priced with ``inter_host`` (default
20 us and 1.25 GB/s, a 10 Gb/s Ethernet link; calibrate it for InfiniBand), unless
``per_mesh_dim`` names that dim::

    {"inter_host": {"alpha_s": 3e-6, "beta_bytes_per_s": 2.4e10}}

Pure: no communication.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from placements.errors import ConfigError
from placements.layout import max_local_shape
from placements.meta import FLOAT32, DtypeTable
from placements.spec import DTensorSpec
from placements.types import Placement

__all__ = [
    "COMM_KINDS",
    "WIDENED",
    "CostModel",
    "block_bytes",
    "buffer_bytes",
    "default_cost_model",
    "plan_cost",
    "set_default_cost_model",
    "spans_hosts",
    "step_bytes",
    "step_cost",
    "transfer_bytes",
    "transfer_cost",
]

#: dtype -> the dtype its reductions run in: MPI has no bfloat16 datatype (moves are bytes
#: and need none), so its data is widened to float32, reduced, and rounded once on return.
WIDENED = DtypeTable({}, lambda bf16: {bf16: FLOAT32})

#: Collective kinds a cost model prices (the ``kind`` of the communicating steps).
COMM_KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

ENV_VAR = "DTENSOR_COST_MODEL"

_FIELDS = ("alpha_s", "beta_bytes_per_s")

#: The default network tier (a 10 Gb/s Ethernet link) and its key in a model's table.
_INTER_HOST = {"alpha_s": 2e-5, "beta_bytes_per_s": 1.25e9}
_NET = "inter_host"

# kind -> (traffic factor for a group of k, which local block sizes T)
_TRAFFIC: dict[str, tuple[Callable[[int], float], str]] = {
    "all_gather": (lambda k: (k - 1) / k, "after"),
    "reduce_scatter": (lambda k: (k - 1) / k, "before"),
    "all_reduce": (lambda k: 2 * (k - 1) / k, "before"),
    "all_to_all": (lambda k: (k - 1) / k, "larger"),
}


def _check_number(where: str, value: Any, positive: bool = False) -> float:
    """A finite float >= 0 (> 0 when ``positive``)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"cost model: {where}={value!r} is not a number") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"cost model: {where}={value!r} must be finite and {bound}")
    return number


def _check_entry(where: str, entry: Any) -> dict[str, float]:
    """Validate one {alpha_s?, beta_bytes_per_s?} mapping; return it as floats."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"cost model: {where} must be a mapping with {_FIELDS}, got {entry!r}")
    unknown = set(entry) - set(_FIELDS)
    if unknown:
        raise ConfigError(
            f"cost model: unknown field(s) {sorted(unknown)} in {where}; allowed: {_FIELDS}"
        )
    return {
        name: _check_number(f"{where}.{name}", value, positive=name == "beta_bytes_per_s")
        for name, value in entry.items()
    }


def _check_kind(where: str, kind: Any, extra: tuple[str, ...] = ()) -> str:
    if kind not in COMM_KINDS + extra:
        raise ConfigError(
            f"cost model: unknown collective kind {kind!r} in {where}; "
            f"allowed: {', '.join(COMM_KINDS + extra)}"
        )
    return kind


class CostModel:
    """Alpha-beta cost model of collectives, per kind and optionally per mesh dim.

    Immutable and hashable (plans are cached per cost model).

    Parameters
    ----------
    alpha_s : float
        Latency of one collective, seconds.
    beta_bytes_per_s : float
        Bandwidth, bytes per second.
    local_s : float
        Cost of a step without communication (a view or a local fill).
    per_kind : mapping, optional
        ``{kind: {"alpha_s": a, "beta_bytes_per_s": b}}`` overrides for the kinds in
        :data:`COMM_KINDS` (either field may be left out).
    per_mesh_dim : mapping, optional
        ``{mesh_dim: {kind or "default": {...}}}`` overrides for one mesh dim.
    inter_host : mapping, optional
        ``{"alpha_s": a, "beta_bytes_per_s": b}`` of the network between hosts: the tier of
        a mesh dim that spans hosts (either field may be left out; defaults 20 us and
        1.25 GB/s).
    """

    __slots__ = ("_hash", "_overrides", "_table", "alpha_s", "beta_bytes_per_s", "inter_host",
                 "local_s")

    def __init__(
        self,
        alpha_s: float = 5e-6,
        beta_bytes_per_s: float = 5e9,
        *,
        local_s: float = 1e-7,
        per_kind: Mapping[str, Mapping[str, float]] | None = None,
        per_mesh_dim: Mapping[int | str, Mapping[str, Mapping[str, float]]] | None = None,
        inter_host: Mapping[str, float] | None = None,
    ) -> None:
        top = {
            "alpha_s": _check_number("alpha_s", alpha_s),
            "beta_bytes_per_s": _check_number("beta_bytes_per_s", beta_bytes_per_s, True),
        }
        local_s = _check_number("local_s", local_s)
        net = {**_INTER_HOST, **_check_entry("inter_host", inter_host or {})}
        kinds = {
            _check_kind("per_kind", k): _check_entry(f"per_kind[{k!r}]", v)
            for k, v in (per_kind or {}).items()
        }
        dims: dict[int, dict[str, dict[str, float]]] = {}
        for m, entries in (per_mesh_dim or {}).items():
            try:
                m_int = int(m)
            except (TypeError, ValueError):
                raise ConfigError(f"cost model: per_mesh_dim key {m!r} is not an int") from None
            if not isinstance(entries, Mapping):
                raise ConfigError(f"cost model: per_mesh_dim[{m!r}] must be a mapping")
            dims[m_int] = {
                _check_kind(f"per_mesh_dim[{m!r}]", k, ("default",)): _check_entry(
                    f"per_mesh_dim[{m!r}][{k!r}]", v
                )
                for k, v in entries.items()
            }
        table: dict[tuple[str, int | None], tuple[float, float]] = {}
        for kind in COMM_KINDS:
            base = {**top, **kinds.get(kind, {})}
            table[kind, None] = (base["alpha_s"], base["beta_bytes_per_s"])
            table[kind, _NET] = (net["alpha_s"], net["beta_bytes_per_s"])
            for m, entries in dims.items():
                merged = {**base, **entries.get("default", {}), **entries.get(kind, {})}
                table[kind, m] = (merged["alpha_s"], merged["beta_bytes_per_s"])
        overrides = (
            tuple(sorted((k, tuple(sorted(v.items()))) for k, v in kinds.items())),
            tuple(
                sorted(
                    (m, tuple(sorted((k, tuple(sorted(v.items()))) for k, v in e.items())))
                    for m, e in dims.items()
                )
            ),
        )
        setter = object.__setattr__
        setter(self, "alpha_s", top["alpha_s"])
        setter(self, "beta_bytes_per_s", top["beta_bytes_per_s"])
        setter(self, "local_s", local_s)
        setter(self, "inter_host", (net["alpha_s"], net["beta_bytes_per_s"]))
        setter(self, "_overrides", overrides)
        setter(self, "_table", table)
        setter(self, "_hash", hash((top["alpha_s"], top["beta_bytes_per_s"], local_s, overrides,
                                    self.inter_host)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CostModel is immutable; cannot set {name!r}")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CostModel):
            return NotImplemented
        return (self.alpha_s, self.beta_bytes_per_s, self.local_s, self._overrides,
                self.inter_host) == (
            other.alpha_s,
            other.beta_bytes_per_s,
            other.local_s,
            other._overrides,
            other.inter_host,
        )

    def __repr__(self) -> str:
        return f"CostModel.from_dict({self.to_dict()!r})"

    def params(
        self, kind: str, mesh_dim: int | None = None, inter_host: bool = False
    ) -> tuple[float, float]:
        """``(alpha_s, beta_bytes_per_s)`` of collective ``kind`` on ``mesh_dim``; of the
        ``inter_host`` tier when the dim spans hosts and ``per_mesh_dim`` does not name it.
        **Local**."""
        found = self._table.get((kind, mesh_dim))
        if inter_host and found is None:
            found = self._table.get((kind, _NET))
        if found is None:
            found = self._table.get((kind, None))
            if found is None:
                _check_kind("params()", kind)
        return found

    def collective_time(
        self, kind: str, nbytes: float, mesh_dim: int | None = None, inter_host: bool = False
    ) -> float:
        """Estimated seconds of one collective moving ``nbytes`` per rank (over the network
        tier when ``inter_host``). **Local**."""
        alpha, beta = self.params(kind, mesh_dim, inter_host)
        return alpha + nbytes / beta

    def to_dict(self) -> dict[str, Any]:
        """The model as a JSON-ready dict (the format :meth:`from_dict` reads). **Local**."""
        per_kind, per_dim = self._overrides
        return {
            "alpha_s": self.alpha_s,
            "beta_bytes_per_s": self.beta_bytes_per_s,
            "local_s": self.local_s,
            "per_kind": {k: dict(v) for k, v in per_kind},
            "per_mesh_dim": {str(m): {k: dict(v) for k, v in e} for m, e in per_dim},
            "inter_host": dict(zip(_FIELDS, self.inter_host)),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """Build a model from a dict in the JSON format of this module. **Local**."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"cost model: expected a JSON object, got {data!r}")
        allowed = ("alpha_s", "beta_bytes_per_s", "local_s", "per_kind", "per_mesh_dim",
                   "inter_host")
        unknown = set(data) - set(allowed)
        if unknown:
            raise ConfigError(
                f"cost model: unknown key(s) {sorted(unknown)}; allowed: {', '.join(allowed)}"
            )
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a model from a JSON file. **Local**."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cost model: cannot read {os.fspath(path)!r}: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the model as JSON, the format :meth:`load` reads. **Local**."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def from_env(cls) -> CostModel:
        """The model named by ``DTENSOR_COST_MODEL`` (a JSON file path or inline JSON). **Local**.

        Unset or empty: the defaults.
        """
        value = os.environ.get(ENV_VAR, "").strip()
        if not value:
            return cls()
        if value.startswith("{"):
            try:
                return cls.from_dict(json.loads(value))
            except json.JSONDecodeError as e:
                raise ConfigError(f"cost model: {ENV_VAR} holds invalid JSON: {e}") from e
        return cls.load(value)


_default: CostModel | None = None


def default_cost_model() -> CostModel:
    """The process-wide cost model (read from ``DTENSOR_COST_MODEL`` on first use). **Local**."""
    global _default
    if _default is None:
        _default = CostModel.from_env()
    return _default


def set_default_cost_model(model: CostModel | None) -> None:
    """Replace the process-wide cost model; None re-reads the environment on next use. **Local**.

    Every rank must set the same model, or ranks may choose different plans.
    """
    global _default
    _default = model


def block_bytes(spec: DTensorSpec, placements: tuple[Placement, ...]) -> int:
    """Bytes of the largest local block of ``spec``'s tensor under ``placements``. **Local**."""
    return math.prod(max_local_shape(spec.shape, spec.mesh_shape, placements)) * spec.dtype.itemsize


def transfer_bytes(kind: str, group_size: int, before_bytes: int, after_bytes: int) -> int:
    """Bytes one rank moves in a step of ``kind`` (0 for local kinds). **Local**.

    Parameters
    ----------
    kind : str
        The step kind.
    group_size : int
        Number of coordinates of the step's mesh dim.
    before_bytes, after_bytes : int
        Largest local block before and after the step (:func:`block_bytes`).
    """
    traffic = _TRAFFIC.get(kind)
    if traffic is None:
        return 0
    factor, side = traffic
    if side == "before":
        block = before_bytes
    elif side == "after":
        block = after_bytes
    else:
        block = max(before_bytes, after_bytes)
    return round(factor(group_size) * block)


def transfer_cost(
    kind: str,
    mesh_dim: int,
    group_size: int,
    nbytes: int,
    cost_model: CostModel,
    inter_host: bool = False,
) -> float:
    """Seconds of a step of ``kind`` moving ``nbytes`` per rank on ``mesh_dim`` (a dim
    that spans hosts when ``inter_host``). **Local**.

    Local kinds, and collectives over a single coordinate, cost ``cost_model.local_s``.
    """
    if kind not in _TRAFFIC or group_size == 1:
        return cost_model.local_s
    return cost_model.collective_time(kind, nbytes, mesh_dim, inter_host)


def spans_hosts(mesh: Any, mesh_dim: int) -> bool:
    """Whether mesh dim ``mesh_dim`` of ``mesh`` crosses hosts (its ``dim_spans_hosts``;
    False for a mesh without it). **Local**."""
    spans = getattr(mesh, "dim_spans_hosts", None)
    return bool(spans) and bool(spans[mesh_dim])


def step_bytes(step: Any, spec: DTensorSpec) -> int:
    """Bytes one rank sends/receives in ``step`` (the largest over all ranks). **Local**.

    Parameters
    ----------
    step : Step
        A step of a plan (see :mod:`redistribute.plan`).
    spec : DTensorSpec
        The plan's source spec (mesh, global shape, dtype); the step's own ``before`` and
        ``after`` give the placements.

    Returns
    -------
    int
        0 for steps without communication.
    """
    return transfer_bytes(
        step.kind,
        spec.mesh_shape[step.mesh_dim],
        block_bytes(spec, step.before),
        block_bytes(spec, step.after),
    )


def buffer_bytes(step: Any, spec: DTensorSpec) -> int:
    """Bytes of the largest buffer the step's collective touches on a rank (the largest
    over ranks). **Local**.

    This is what :class:`dtensor.debug.CommDebugMode` counts for the collective (the
    gathered output of an all-gather, the input of a reduce-scatter, the block of an
    all-reduce, the larger side of an all-to-all; a reduction of a dtype of
    :data:`WIDENED` in the widened dtype, as the executor runs it), so a plan shown by
    ``explain`` and the record of running it agree. :func:`step_bytes` is the traffic the
    cost model prices. 0 for steps without communication.
    """
    if not step.communicates:
        return 0
    nbytes = max(block_bytes(spec, step.before), block_bytes(spec, step.after))
    wide = WIDENED.get(spec.dtype) if hasattr(step, "reduce_op") else None
    return nbytes if wide is None else nbytes // spec.dtype.itemsize * wide.itemsize


def step_cost(step: Any, spec: DTensorSpec, cost_model: CostModel | None = None) -> float:
    """Estimated seconds of ``step``. **Local**.

    A step without communication, or on a mesh dim of size 1, costs ``local_s``.

    Parameters
    ----------
    step : Step
        A step of a plan.
    spec : DTensorSpec
        The plan's source spec.
    cost_model : CostModel, optional
        Defaults to :func:`default_cost_model`.
    """
    return transfer_cost(
        step.kind,
        step.mesh_dim,
        spec.mesh_shape[step.mesh_dim],
        step_bytes(step, spec),
        cost_model or default_cost_model(),
        spans_hosts(spec.mesh, step.mesh_dim),
    )


def plan_cost(
    steps: Iterable[Any], spec: DTensorSpec, cost_model: CostModel | None = None
) -> float:
    """Estimated seconds of a whole plan (sum of its steps). **Local**.

    Parameters
    ----------
    steps : iterable of Step
        The plan.
    spec : DTensorSpec
        The plan's source spec.
    cost_model : CostModel, optional
        Defaults to :func:`default_cost_model`.
    """
    model = cost_model or default_cost_model()
    return sum(step_cost(s, spec, model) for s in steps)
