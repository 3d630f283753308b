"""``dt.pipelining``: pipeline parallelism on a ``pp`` mesh dim, with PyTorch's names.

- :class:`PipelineStage` ``(submodule, stage_index, num_stages, mesh)``: a stage on pp
  coordinate ``stage_index % pp_size`` of the 1-D ``mesh`` (``mesh["pp"]``);
- schedules (data: per rank a list of :class:`Action` s, run by one executor):
  :class:`ScheduleGPipe`, :class:`Schedule1F1B` (one stage per rank),
  :class:`ScheduleInterleaved1F1B` and :class:`ScheduleInterleavedZeroBubble` (several);
  ``schedule.step(x)`` on the first stage, ``step(target=y, losses=losses)`` on the last,
  ``step()`` elsewhere; ``schedule.timeline``: this rank's measured
  :class:`TimelineEvent` s of the last step (``dt.debug.visualize_schedule`` draws them);
- :func:`pipeline_split` / :func:`equal_cost_split_points`: a ``dt.nn`` model split into
  stage modules by module path or by equal cost, with full parameter names;
- pricing (:mod:`._options`): :func:`bubble`, :func:`pipeline_seconds`, :func:`in_flight`,
  :func:`ring_factor`, :func:`stage_shares` and :class:`PipelineOptions`, the pipeline and
  context degrees :func:`dtensor.auto_shard` searches;
- :func:`full_state_dict`: the whole model's state on every rank, for ``dt.save`` (a
  checkpoint that loads into any strategy); ``dt.load(stage.submod.state_dict(), path)``
  loads any strategy's checkpoint into the stages.
"""

from ._options import (
    SCHEDULES,
    PipelineOptions,
    bubble,
    in_flight,
    pipeline_seconds,
    ring_factor,
    stage_shares,
)
from ._runtime import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from ._schedules import (
    Action,
    Message,
    TimelineEvent,
    bubble_fraction,
    comm_pairs,
    make_schedule,
    simulate,
)
from ._split import equal_cost_split_points, pipeline_split, ties_of
from ._state import full_state_dict

__all__ = [
    "SCHEDULES",
    "Action",
    "Message",
    "PipelineOptions",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "TimelineEvent",
    "bubble",
    "bubble_fraction",
    "comm_pairs",
    "equal_cost_split_points",
    "full_state_dict",
    "in_flight",
    "make_schedule",
    "pipeline_seconds",
    "pipeline_split",
    "ring_factor",
    "simulate",
    "stage_shares",
    "ties_of",
]
