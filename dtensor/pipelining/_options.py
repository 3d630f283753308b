"""Pricing pipelines and context parallelism: the bubble, the stages' shares of a model, the
micro-batches in flight, and :class:`PipelineOptions`, the pipeline and context degrees that
:func:`dtensor.auto_shard` searches (``auto_shard(..., pipeline=PipelineOptions(model))``).

The formulas (pure, **Local**; the GPT predictor of ``launch/examples/gpt_predict.py`` uses
them too):

- step time of ``m`` micro-batches on ``p`` pp ranks whose slowest rank takes ``t`` seconds
  per micro-batch (forward and backward of all its stages): ``(m + p - 1) t`` for GPipe and
  1F1B, ``(v m + p - 1) t / v`` for interleaved 1F1B with ``v`` stages per rank; the bubble
  (idle share) ``(p - 1) / (m + p - 1)`` and ``(p - 1) / (v m + p - 1)``;
- micro-batches whose activations a rank holds at its peak: ``m`` under GPipe,
  ``min(m, p - rank)`` under 1F1B, under interleaved ``min(v m, 2 (p - 1 - rank) + (v - 1) p
  + 1)`` stage-micro-batches (each ``1 / v`` of the rank's activations; 1F1B's count for
  ``v = 1``);
- ring attention over ``c`` ranks: a rank computes ``c`` blocks of ``(S / c)^2`` query-key
  pairs; causal with load balancing (two mirrored chunks per rank), the diagonal block in
  full and half of each of the other ``c - 1`` (the rest is masked and skipped):
  :func:`ring_factor` ``= 1 + (c - 1) / 2`` blocks (``c`` without a mask). Its key/value
  blocks travel ``c - 1`` times in forward and twice that in backward (keys and values, then
  their gradients), beside the blocks' compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from placements.errors import PipelineError

from ..nn import Module
from ._split import _unit_cost, _units, equal_cost_split_points

__all__ = ["SCHEDULES", "PipelineOptions", "bubble", "in_flight", "pipeline_seconds",
           "ring_factor", "stage_shares"]

#: Schedules priced: GPipe, 1F1B (one stage per rank), interleaved 1F1B (``v`` per rank).
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise PipelineError(f"pipeline pricing: unknown schedule {schedule!r}; choose from "
                            f"{SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise PipelineError(f"pipeline pricing {schedule}: pp={p}, microbatches={m}, "
                            f"stages_per_rank={v} must be >= 1")
    if v != 1 and schedule != "interleaved":
        raise PipelineError(f"pipeline pricing {schedule}: stages_per_rank={v} needs the "
                            "interleaved schedule")


def bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The idle share of a pipelined step: ``(p - 1) / (m + p - 1)`` (GPipe, 1F1B),
    ``(p - 1) / (v m + p - 1)`` (interleaved). **Local**.

    Raises
    ------
    PipelineError
        An unknown schedule, a degree or count < 1, ``v > 1`` without interleaving.
    """
    _check(schedule, p, m, v)
    slots = v * m if schedule == "interleaved" else m
    return (p - 1) / (slots + p - 1)


def pipeline_seconds(stage_s: float, schedule: str, p: int, m: int, v: int = 1
                     ) -> tuple[float, float]:
    """``(step, bubble)`` seconds of ``m`` micro-batches whose slowest rank takes
    ``stage_s`` per micro-batch (all its stages, forward and backward). **Local**."""
    _check(schedule, p, m, v)
    slots = v * m if schedule == "interleaved" else m
    per = v if schedule == "interleaved" else 1
    total = (slots + p - 1) * stage_s / per
    return total, total - m * stage_s


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> float:
    """Micro-batches of activations (in units of all of the rank's stages) that pp rank
    ``rank`` holds at its peak. **Local**."""
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:  # interleaving one stage per rank is 1F1B
        return float(min(m, p - rank))
    return min(v * m, 2 * (p - 1 - rank) + (v - 1) * p + 1) / v


def ring_factor(c: int, causal: bool = True) -> float:
    """Blocks of ``(S / c)^2`` query-key pairs a rank of ring attention over ``c`` ranks
    computes (see the module docstring). **Local**."""
    return 1 + (c - 1) / 2 if causal else float(c)


def stage_shares(model: Module, n_stages: int, cost: str = "flops"
                 ) -> tuple[list[float], list[float], list[int]]:
    """``(compute, params, layers)`` per stage of :func:`pipeline_split`'s equal-cost split of
    ``model`` into ``n_stages``: each stage's share of the model's ``cost`` (see
    :func:`equal_cost_split_points`) and of its parameter count, and its layer count.
    **Local**.

    Raises
    ------
    PipelineError
        More stages than layers.
    """
    points = set(equal_cost_split_points(model, n_stages, cost))
    comp, par, layers = [0.0], [0.0], [0]
    for path, mod, is_layer in _units(model):
        if path in points:
            comp.append(0.0)
            par.append(0.0)
            layers.append(0)
        comp[-1] += _unit_cost(mod, cost)
        par[-1] += _unit_cost(mod, "params")
        layers[-1] += int(is_layer)
    tc, tp = sum(comp) or 1.0, sum(par) or 1.0
    return [c / tc for c in comp], [q / tp for q in par], layers


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline and context-parallel dimensions :func:`dtensor.auto_shard` prices
    beside the placements (``auto_shard(..., pipeline=PipelineOptions(model))``). **Local**.

    A variant takes ``pp x cp`` ranks of mesh dim 0 (the data-parallel dim; the variant's
    placements run on the mesh with dim 0 divided by them): ``pp`` stages of ``model``'s
    equal-cost split, ``microbatches`` per step under ``schedule`` (``stages_per_rank``
    stages per rank when interleaved), and ring attention over ``cp`` ranks. It is priced
    from a traced plan's prediction (:meth:`price`): each rank's data-parallel replica
    holds ``pp x cp`` times the batch of the plan's rank; its micro-batch's forward and
    backward take the largest stage's compute share of the plan's (scaled to the
    micro-batch), the optimizer the largest stage's share of the parameters; the
    activations at stage boundaries travel at the calibration's point-to-point constants
    (the fill and the drain on the critical path, the rest beside the compute).

    Attributes
    ----------
    model : Module
        The ``dt.nn`` model the step function runs (split as :func:`pipeline_split`).
    degrees, microbatches, cp_degrees, stages_per_rank : tuple of int
        The values searched (1 = no pipeline, one micro-batch, no context parallelism).
    schedules : tuple of str
        Of :data:`SCHEDULES`.
    causal : bool
        The attention's mask (ring attention's work, :func:`ring_factor`).
    boundary_width : int, optional
        Elements per token of the activation between stages (default: the last dim of the
        first layer's first parameter, a transformer's ``d_model``).
    """

    model: Module
    degrees: tuple[int, ...] = (1, 2, 4)
    microbatches: tuple[int, ...] = (1, 2, 4, 8)
    schedules: tuple[str, ...] = ("1f1b",)
    stages_per_rank: tuple[int, ...] = (1,)
    cp_degrees: tuple[int, ...] = (1,)
    causal: bool = True
    boundary_width: int | None = None
    _shares: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, Module):
            raise PipelineError(f"PipelineOptions: model must be a dt.nn.Module, got "
                                f"{type(self.model).__name__}")
        for name in ("degrees", "microbatches", "stages_per_rank", "cp_degrees"):
            vals = tuple(getattr(self, name))
            if not vals or any(not isinstance(x, int) or x < 1 for x in vals):
                raise PipelineError(f"PipelineOptions: {name}={vals!r} must be ints >= 1")
            object.__setattr__(self, name, vals)
        bad = [s for s in self.schedules if s not in SCHEDULES]
        if bad or not self.schedules:
            raise PipelineError(f"PipelineOptions: schedules={self.schedules!r}; choose from "
                                f"{SCHEDULES}")
        object.__setattr__(self, "schedules", tuple(self.schedules))

    def width(self) -> int:
        """Elements per token at a stage boundary. **Local**."""
        if self.boundary_width is not None:
            return int(self.boundary_width)
        for _, mod, is_layer in _units(self.model):
            if is_layer:
                for p in mod.parameters():
                    return int(p.shape[-1])
        raise PipelineError("PipelineOptions: the model has no layer with parameters; give "
                            "boundary_width")

    def variants(self, dim0: int, batch: int) -> list[dict[str, Any]]:
        """The variants that fit a mesh whose dim 0 has ``dim0`` ranks, for a step of
        ``batch`` samples per data-parallel rank of the plan: ``pp x cp`` divides ``dim0``,
        ``microbatches`` divides a replica's ``pp x cp x batch`` samples, ``pp`` stages x
        ``stages_per_rank`` no more than the layers. **Local**."""
        layers = sum(1 for _, _, is_layer in _units(self.model) if is_layer)
        out = []
        for p in self.degrees:
            for c in self.cp_degrees:
                if dim0 % (p * c):
                    continue
                for m in (self.microbatches if p > 1 else (1,)):
                    if (p * c * batch) % m:
                        continue
                    for s in (self.schedules if p > 1 else ("1f1b",)):
                        for v in (self.stages_per_rank if s == "interleaved" else (1,)):
                            if p * v <= max(layers, 1) and (p > 1 or v == 1):
                                out.append({"pp": p, "cp": c, "microbatches": m,
                                            "schedule": s, "stages_per_rank": v})
        return out

    def price(self, variant: Mapping[str, Any], base: Mapping[str, float],
              p2p: tuple[float, float]) -> dict[str, float]:
        """The step of ``variant`` from a plan's prediction ``base`` (per rank: ``forward_s``,
        ``backward_s``, ``optimizer_s``, ``persistent_bytes``, ``activation_bytes``,
        ``peak_bytes``, ``attention_s``, ``attention_kv_bytes`` (the keys and values of the
        forward's attention calls), ``attention_calls``, ``tokens`` (per rank), ``itemsize``); ``p2p`` the point-to-point ``(alpha_s, beta_bytes_per_s)``. Returns
        ``time_s``, ``peak_bytes``, ``bubble_fraction``, ``bubble_s``, ``p2p_bytes``.
        **Local**."""
        p, c, m = variant["pp"], variant["cp"], variant["microbatches"]
        s, v = variant["schedule"], variant["stages_per_rank"]
        alpha, beta = p2p
        grow = p  # a replica's samples per rank of the variant, relative to the plan's
        comp, par = [1.0], [1.0]
        if p > 1:
            if p * v not in self._shares:
                self._shares[p * v] = stage_shares(self.model, p * v)
            comp, par, _ = self._shares[p * v]
        rank_comp = [sum(comp[r::p]) for r in range(p)]
        rank_par = [sum(par[r::p]) for r in range(p)]
        attn = base["attention_s"]
        fb = base["forward_s"] + base["backward_s"] + attn * (ring_factor(c, self.causal) / c - 1)
        ring_s = ring_bytes = 0.0
        if c > 1:  # the ring's blocks beside the attention's compute
            ring_bytes = 3 * (c - 1) * base["attention_kv_bytes"]
            calls = max(base["attention_calls"], 1)
            ring_s = max(0.0, 3 * (c - 1) * calls * alpha + ring_bytes / beta
                         - attn * ring_factor(c, self.causal) / c)
        stage_s = max(rank_comp) * (fb + ring_s) * grow / m
        step, bubble_s = pipeline_seconds(stage_s, s, p, m, v)
        boundary = base["tokens"] * grow / m * self.width() * base["itemsize"]
        sends = [sum((st < p * v - 1) + (st > 0) for st in range(r, p * v, p)) for r in range(p)]
        p2p_bytes = max(sends) * m * boundary * (p > 1) + ring_bytes * grow * max(rank_comp)
        exposed = 2 * (p - 1) * (alpha + boundary / beta)
        time = step + exposed + max(rank_par) * base["optimizer_s"]
        transient = max(0.0, base["peak_bytes"] - base["persistent_bytes"]
                        - base["activation_bytes"])
        peak = max(base["persistent_bytes"] * rank_par[r] + transient * grow / m
                   + base["activation_bytes"] * rank_comp[r] * grow / m
                   * in_flight(s, p, m, r, v) for r in range(p))
        return {"time_s": time, "peak_bytes": math.ceil(peak),
                "bubble_fraction": bubble(s, p, m, v), "bubble_s": bubble_s,
                "p2p_bytes": int(p2p_bytes)}

