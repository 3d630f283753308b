"""Whole-model sharding search: predict, rank and choose placements before running them.

:func:`auto_shard` (``dt.auto_shard``) traces training steps of candidate placement
assignments, prices them (compute per op class and collectives: :mod:`._predict`) and
solves for the fastest assignment within a memory budget (:mod:`._search`, :mod:`._solve`);
it returns a :class:`ShardingPlan`. With ``pipeline=dt.pipelining.PipelineOptions(model)``
it also prices pipelined and context-parallel variants (pipeline degree, micro-batches,
schedule, ring-attention degree) of every traced assignment and records the chosen one in
:attr:`ShardingPlan.pipeline`. On a real mesh it can first measure the user's step in a
few layouts and refit the calibration's compute scale and fixed costs to it
(``fit_step=True``). :func:`calibrate` measures this machine's collectives and kernels and
stores them for reuse (:mod:`._calibrate`).
"""

from ._calibrate import Calibration, default_path, fit_to_steps, load_calibration
from ._measure import calibrate
from ._plan import Candidate, ShardingPlan, StepFit
from ._predict import Prediction, candidate_placements, predict_step
from ._search import auto_shard
from ._solve import Problem, Solution, solve

__all__ = [
    "Calibration",
    "Candidate",
    "Prediction",
    "Problem",
    "ShardingPlan",
    "Solution",
    "StepFit",
    "auto_shard",
    "calibrate",
    "candidate_placements",
    "default_path",
    "fit_to_steps",
    "load_calibration",
    "predict_step",
    "solve",
]
