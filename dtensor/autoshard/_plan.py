"""The result of :func:`dtensor.auto_shard`: :class:`ShardingPlan`.

This module owns the plan object (the chosen placements, their prediction, the table of
the assignments weighed, the fit of the calibration to measured steps: :class:`StepFit`)
and :meth:`ShardingPlan.apply`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from placements.errors import ArgumentError
from placements.types import Placement, placement_list

from ..distributed.dtensor import DTensor, distribute_tensor
from ._calibrate import Calibration
from ._predict import Prediction, as_array

__all__ = ["Candidate", "ShardingPlan", "StepFit"]


@dataclass(frozen=True)
class Candidate:
    """One assignment the search traced and priced.

    ``sources`` says why it was traced: ``start`` (the given placements), ``base`` (a
    round's base), ``single`` (one tensor moved from the round's base), ``pair`` (two
    moved), ``solver`` (a solution of the cost table), ``min-memory`` (the solver's smallest
    plan, traced when nothing else fits the budget)."""

    placements: Mapping[str, tuple[Placement, ...]]
    prediction: Prediction
    sources: tuple[str, ...]
    fits: bool

    def label(self) -> str:
        """``name=S(0),R ...`` of the tensors not replicated everywhere."""
        parts = [f"{n}={','.join(p.short() for p in pl)}" for n, pl in self.placements.items()
                 if any(not p.is_replicate() for p in pl)]
        return " ".join(parts) or "all replicated"


@dataclass(frozen=True)
class StepFit:
    """The user's step measured in a few layouts before the search, and the terms
    fitted to it (``auto_shard(..., fit_step=True)``).

    Attributes
    ----------
    layouts : list of dict of str to tuple of Placement
        The measured layouts (the given placements, data-parallel inputs, every parameter
        sharded), each of every parameter and searched input.
    measured_s : list of float
        Their measured step seconds (slowest rank, median).
    predicted_s : list of float
        Their predictions with the given calibration.
    fitted_s : list of float
        Their predictions with the fitted one (the one the search priced with).
    compute_scale, entry_s, sync_s : float
        The fitted terms: the factor on the kernels' seconds, the fixed costs per op entry
        and per collective.
    """

    layouts: list[dict[str, tuple[Placement, ...]]]
    measured_s: list[float]
    predicted_s: list[float]
    fitted_s: list[float]
    compute_scale: float
    entry_s: float
    sync_s: float


@dataclass
class ShardingPlan:
    """What :func:`dtensor.auto_shard` chose.

    Attributes
    ----------
    placements : dict of str to tuple of Placement
        Per parameter, its placements.
    input_placements : dict of str to tuple of Placement
        Per input the search placed, its placements (see :meth:`apply_inputs`).
    predicted_time : float
        Seconds of one training step of this plan (a trace of what the dispatcher runs,
        priced; see :mod:`dtensor.autoshard._predict`).
    predicted_peak_bytes : int
        Per-rank peak memory of that step (the largest rank).
    prediction : Prediction
        The whole prediction (compute, communication, phases, memory terms).
    candidates : list of Candidate
        Every assignment traced, cheapest first.
    memory_budget : int or None
    solver : str
        The backend that solved the cost tables (``milp`` or ``bnb``).
    mesh : DeviceMesh
        The mesh the plan is for.
    calibration : Calibration or None
        The calibration the search priced with (with ``step_fit``, the fitted one):
        :func:`~dtensor.autoshard.predict_step` with it predicts the plan again.
    step_fit : StepFit or None
        The measured steps and the fit, when the search fitted the calibration to the step.
    pipeline : dict or None
        With ``auto_shard(..., pipeline=PipelineOptions(...))``: the chosen pipeline and
        context-parallel variant (``pp``, ``cp``, ``microbatches``, ``schedule``,
        ``stages_per_rank``) with its priced ``time_s``, ``peak_bytes``,
        ``bubble_fraction``, ``bubble_s`` and ``p2p_bytes`` (``pp`` and ``cp`` ranks come
        out of mesh dim 0: the placements run on the mesh with dim 0 divided by
        ``pp x cp``); :attr:`predicted_time` and :attr:`predicted_peak_bytes` are then the
        variant's. None without pipeline options.
    pipeline_candidates : list of dict
        Every variant priced for the chosen placements, fastest first (each with ``fits``).
    """

    placements: dict[str, tuple[Placement, ...]]
    input_placements: dict[str, tuple[Placement, ...]]
    prediction: Prediction
    candidates: list[Candidate] = field(default_factory=list)
    memory_budget: int | None = None
    solver: str = ""
    mesh: Any = None
    calibration: Calibration | None = None
    step_fit: StepFit | None = None
    pipeline: dict[str, Any] | None = None
    pipeline_candidates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def predicted_time(self) -> float:
        return self.pipeline["time_s"] if self.pipeline else self.prediction.time_s

    @property
    def predicted_peak_bytes(self) -> int:
        return self.pipeline["peak_bytes"] if self.pipeline else self.prediction.peak_bytes

    @property
    def pp_degree(self) -> int:
        """Pipeline stages of the plan (1: none)."""
        return self.pipeline["pp"] if self.pipeline else 1

    @property
    def microbatches(self) -> int:
        """Micro-batches per step (1: none)."""
        return self.pipeline["microbatches"] if self.pipeline else 1

    @property
    def cp_degree(self) -> int:
        """Context-parallel ranks (ring attention) of the plan (1: none)."""
        return self.pipeline["cp"] if self.pipeline else 1

    def _pipeline_text(self) -> str:
        v = self.pipeline
        if not v:
            return ""
        sched = (f" {v['schedule']}" + (f" v={v['stages_per_rank']}"
                                        if v["stages_per_rank"] > 1 else "")
                 if v["pp"] > 1 else "")
        return (f"pp {v['pp']} x {v['microbatches']} micro-batches{sched} (bubble "
                f"{v['bubble_fraction']:.0%}, p2p {v['p2p_bytes'] / 2**20:.1f} MiB), "
                f"cp {v['cp']}; ")

    def table(self, limit: int | None = None) -> str:
        """The candidates weighed, cheapest first, as an aligned text table: predicted
        step time (compute + communication), collectives, peak memory, whether it fits the
        budget and why it was traced; the chosen one marked ``*``. **Local**."""
        head = ("", "predicted us", "compute us", "comm us", "colls", "peak KiB", "fits",
                "traced as", "placements")
        rows = [head]
        chosen = {**self.placements, **self.input_placements}
        for c in self.candidates[:limit]:
            p = c.prediction
            rows.append(("*" if dict(c.placements) == chosen else "",
                         f"{p.time_s * 1e6:.1f}", f"{p.compute_s * 1e6:.1f}",
                         f"{p.comm_s * 1e6:.1f}", str(p.collectives),
                         f"{p.peak_bytes / 1024:.1f}", "yes" if c.fits else "no",
                         ",".join(c.sources), c.label()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        budget = "none" if self.memory_budget is None else f"{self.memory_budget / 1024:.1f} KiB"
        lines.append(f"{len(self.candidates)} assignments traced; solver {self.solver}; "
                     f"memory budget {budget}")
        if self.pipeline:
            lines.append(f"pipeline: {self._pipeline_text().rstrip('; ')}; "
                         f"{len(self.pipeline_candidates)} variants priced")
        return "\n".join(lines)

    def __str__(self) -> str:
        body = ", ".join(f"{n}: {placement_list(p)}" for n, p in
                         {**self.placements, **self.input_placements}.items())
        return (f"ShardingPlan(~{self.predicted_time * 1e6:.1f} us/step, peak "
                f"{self.predicted_peak_bytes / 1024:.1f} KiB; {self._pipeline_text()}{body})")

    def _place(self, values: Mapping[str, Any], layouts: Mapping[str, Sequence[Placement]],
               what: str) -> dict[str, Any]:
        missing = set(layouts) - set(values)
        if missing:
            raise ArgumentError(f"ShardingPlan.{what}: no value for {sorted(missing)}")
        out = dict(values)
        for name, pl in layouts.items():
            v = values[name]
            if isinstance(v, DTensor):
                grad = v.requires_grad
                moved = v.detach().redistribute(v.device_mesh, list(pl))
                out[name] = moved.requires_grad_() if grad else moved
            else:
                out[name] = distribute_tensor(as_array(v), self.mesh, list(pl),
                                              src_data_rank=None)
        return out

    def apply(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with each parameter of the plan in its placements: a DTensor is
        redistributed (a new leaf that requires grad when the given one did); an array
        (numpy or a local tensor holding the global values, the same on every rank) is
        distributed. Other entries are passed through. **Collective**."""
        return self._place(params, self.placements, "apply")

    def apply_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """``inputs`` with each input the search placed in its placements, as
        :meth:`apply`. **Collective**."""
        return self._place(inputs, self.input_placements, "apply_inputs")
