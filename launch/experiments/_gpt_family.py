"""The GPT of :mod:`launch.examples.gpt` as a model family of the strategy sweep's ``--train``
mode: ``--model gpt-tiny`` and ``--model gpt-small`` (the configs of
:data:`launch.examples.gpt_predict.CONFIGS`; ``--size`` is not read).

Strategies: those of :mod:`launch.examples.gpt_strategies` that the issue's sweep covers
(``local``, ``dp``, ``fsdp``, ``tp``, ``tp_sp``, ``fsdp_tp``, ``hsdp``), then the pipelined
and context-parallel ones of :mod:`launch.experiments._gpt_pp` (``pp2_m2``, ``pp2_m4``,
``cp2`` at 2 ranks; ``pp2_fsdp2_m2``, ``pp4_m2``... and ``cp4`` at 4: :data:`PP_DEGREES`,
:data:`MICROBATCHES`, :data:`CP_DEGREES`, set by :meth:`GPTFamily.set_dimensions`,
predicted as ``pp`` / ``pp_fsdp`` with 1F1B and ``cp``), as far as they run at the job's
rank count: ``fsdp_tp`` and ``hsdp`` at 4 ranks (a 2x2 mesh), ``tp`` and
``tp_sp`` where the ranks divide the heads and the sequence (gpt-small's 6 heads do not
split over 4 ranks). Each is built by :func:`launch.examples.gpt_strategies.build` from the
same seed and fed the same global batch (each data-parallel rank its rows).

The predictor is :func:`launch.examples.gpt_predict.predict` (metadata only): the step's
time (kernels from the calibration's throughputs, collectives from its cost model, FSDP's
prefetch on a second lane) and its peak memory on the largest rank, counted from before the
model was built, with the sweep's optimizer and ``clip_grad_norm_``. The sweep hands it the
calibration of this machine (:meth:`GPTFamily.use_calibration`), as ``--auto`` does
(measured, when none is stored, at the sizes of ``launch/bench/calibrate.py``:
:data:`CALIBRATION_SIZES`).

The calibration times each kernel class in short samples, which see a core while the process
holds it; a step of a GPT takes seconds, and on a machine whose cores are shared (other jobs,
more ranks than cores) it gets only the process's share of them. So, unless ``--no-fit``,
the calibration's ``compute_scale`` is fitted to the measured step of ``local`` (the first
strategy, which runs no collective: its step is kernels and op entries only):
:meth:`GPTFamily.fit_step`. Every other strategy's step is then predicted with it; the report
gives the Spearman correlation without ``local`` as well. FSDP's prefetched all-gathers run
beside the compute only where a rank has a spare core (they progress in a worker thread);
with one core per rank (or fewer) they are priced in line (``predict(overlap=False)``). For the same reason the sweep
times the strategies in turns (``interleave``: all built first, then one step of each per
pass), so that a load that changes over the minutes of a sweep slows them alike.

The GPT is a module, not a ``step_fn(params, inputs)``: it has no functional form for
:func:`dtensor.auto_shard` (:meth:`GPTFamily.auto_model` is None). The sweep then chooses
among the named strategies by the predictor (the smallest predicted step among those whose
predicted peak fits the memory budget) and reports the choice against the best measured.

No ``gpt-medium``: one measured step of a 12-layer, d_model 768, sequence 512 GPT takes
tens of seconds per rank on a small CPU machine, and the sweep runs about ten per strategy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import dtensor as dt
from launch.examples._training import make_optimizer
from launch.examples.gpt import GPT, GPTConfig
from launch.examples.gpt import batch as make_batch
from launch.examples.gpt_predict import CONFIGS, predict
from launch.examples.gpt_strategies import Run, build, supported
from launch.experiments._families import Prediction, register_family
from launch.experiments._gpt_pp import ContextStep, PhasedStep, PipelineStep, parse

__all__ = ["BATCH", "GPTFamily", "GPTStep"]

#: The strategies the sweep runs, in report order (those that run at the job's size).
SWEPT = ("local", "dp", "fsdp", "tp", "tp_sp", "fsdp_tp", "hsdp")
#: The calibration a sweep measures for the GPT when none is stored: the N x N float32
#: tensors and samples of ``launch/bench/calibrate.py`` (the GPT's collectives move MiBs;
#: the quick calibration of ``--auto``, up to 384 x 384 in 15 samples, priced its collectives
#: several times too high on a loaded machine).
CALIBRATION_SIZES, CALIBRATION_REPEAT = (64, 256, 1024), 30
#: The collectives' N: up to 2048 x 2048 (16 MiB). FSDP gathers a gpt-small block's 7 MiB in
#: one collective, and a 2-rank all-gather that moves 4 MiB at about 5 GB/s moves 7-43 MiB at
#: about 2 GB/s (out of the caches); fitted to 4 MiB at most, FSDP's step was priced 15 %
#: short and below dp's.
CALIBRATION_COMM_SIZES = (64, 256, 1024, 2048)
#: The pipeline degrees, micro-batch counts and context-parallel degrees the sweep adds
#: (``--pp-degrees``, ``--microbatches``, ``--cp-degrees``): ``pp{p}_m{m}`` where ``p`` is
#: the job's ranks, ``pp{p}_fsdp{d}_m{m}`` where ``p x d`` is, ``cp{c}`` where ``c`` is.
PP_DEGREES, MICROBATCHES, CP_DEGREES = (2, 4), (2, 4), (2, 4)
#: Global batch (sequences) per family: divisible by 2 and 4 data-parallel ranks.
BATCH = {"tiny": 8, "small": 4}
LR = 1e-3


def _mesh_shape(strategy: str, world: int) -> tuple[int, ...]:
    dims = parse(strategy)
    if dims is not None and "pp" in dims:
        return (dims["pp"], dims["dp"]) if dims["dp"] > 1 else (dims["pp"],)
    return (2, 2) if strategy in ("fsdp_tp", "hsdp") else (world,)


def _predicted(strategy: str) -> tuple[str, dict[str, Any]]:
    """The predictor's strategy name and keywords of a swept strategy."""
    dims = parse(strategy)
    if dims is None:
        return strategy, {}
    if "cp" in dims:
        return "cp", {}
    return ("pp_fsdp" if dims["dp"] > 1 else "pp"), {"microbatches": dims["m"],
                                                     "schedule": "1f1b"}


class GPTStep(PhasedStep):
    """One training step of the GPT under a strategy (a sweep :class:`Step`): the model of
    ``run`` on this rank's share of one global batch, the sweep's optimizer and
    ``clip_grad_norm_``."""

    def __init__(self, run: Run, cfg: GPTConfig, batch: int, optimizer: str,
                 clip: float) -> None:
        self.strategy_run = run
        self.mesh = run.mesh
        self.inputs = run.inputs(*make_batch(cfg, batch, 0))
        self.params = list(run.model.parameters())
        self.optimizer_name = optimizer
        self.opt = make_optimizer(optimizer, self.params, LR)
        self.clip = clip
        self.loss: Any = None

    def forward(self) -> None:
        self.opt.zero_grad()
        self.loss = self.strategy_run.model(*self.inputs)

    def backward(self) -> None:
        self.loss.backward()

    def optimizer(self) -> None:
        dt.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()

    def loss_value(self) -> float:
        """The global batch's mean loss (the data-parallel ranks' averaged). **Collective**."""
        return self.strategy_run.loss_value(self.loss)


class GPTFamily:
    """``gpt-<size>``: the GPT of :data:`launch.examples.gpt_predict.CONFIGS` ``[size]`` (see
    the module docstring)."""

    def __init__(self, size: str) -> None:
        self.size = size
        self.cfg = CONFIGS[size]
        self.batch = BATCH[size]
        self.name = f"gpt-{size}"
        self.calibration: dt.autoshard.Calibration | None = None
        self.fit = True
        self.overlap: bool | None = None  # FSDP's prefetch beside the compute: a spare core
        self.interleave = True  # steps of seconds: timed in turns (see the module docstring)
        self.calibration_sizes, self.calibration_repeat = CALIBRATION_SIZES, CALIBRATION_REPEAT
        self.calibration_comm_sizes = CALIBRATION_COMM_SIZES
        self.fitted: list[str] = []
        self.fit_info: dict[str, float] | None = None
        self.pp_degrees, self.microbatches, self.cp_degrees = PP_DEGREES, MICROBATCHES, CP_DEGREES
        with dt.nn.abstract_parameters():  # the shapes, without data
            model = GPT(self.cfg)
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self._skipped: dict[str, str] = {}

    def strategies(self, world: int) -> list[str]:
        """The swept strategies that run at ``world`` ranks (the rest, with the reason, go
        to :meth:`note`). **Local**."""
        out, self._skipped = [], {}
        for s in SWEPT:
            if not supported(s, world):
                self._skipped[s] = f"needs 4 ranks, this job has {world}"
            elif s in ("tp", "tp_sp") and (self.cfg.n_head % world
                                           or self.cfg.block_size % world):
                self._skipped[s] = (f"{self.cfg.n_head} heads (sequence {self.cfg.block_size}) "
                                    f"do not split over {world} ranks")
            elif s != "local" and self.batch % (2 if s == "fsdp_tp" else world):
                self._skipped[s] = f"a batch of {self.batch} does not split over the ranks"
            else:
                out.append(s)
        return out + self._parallel_dims(world)

    def set_dimensions(self, pp_degrees: Sequence[int] = PP_DEGREES,
                       microbatches: Sequence[int] = MICROBATCHES,
                       cp_degrees: Sequence[int] = CP_DEGREES) -> None:
        """The pipeline degrees, micro-batch counts and context degrees swept (empty: none).
        **Local**."""
        self.pp_degrees = tuple(int(v) for v in pp_degrees)
        self.microbatches = tuple(int(v) for v in microbatches)
        self.cp_degrees = tuple(int(v) for v in cp_degrees)

    def _parallel_dims(self, world: int) -> list[str]:
        """The pipelined and context-parallel strategies at ``world`` ranks (the rest, with
        the reason, go to :meth:`note`)."""
        out = []
        for p in self.pp_degrees:
            if world % p:
                self._skipped[f"pp{p}"] = f"{world} ranks are not a multiple of {p}"
                continue
            if p > self.cfg.n_layer:
                self._skipped[f"pp{p}"] = f"{self.cfg.n_layer} blocks do not fill {p} stages"
                continue
            d = world // p
            per = self.batch // d
            for m in self.microbatches:
                name = f"pp{p}_m{m}" if d == 1 else f"pp{p}_fsdp{d}_m{m}"
                if self.batch % d or per % m:
                    self._skipped[name] = (f"{m} micro-batches do not split a replica's "
                                           f"{per} sequences")
                else:
                    out.append(name)
        for c in self.cp_degrees:
            if c != world:
                self._skipped[f"cp{c}"] = f"runs on all ranks: needs {c}, the job has {world}"
            elif self.cfg.block_size % (2 * c):
                self._skipped[f"cp{c}"] = (f"a sequence of {self.cfg.block_size} does not "
                                           f"split into 2 x {c} chunks")
            else:
                out.append(f"cp{c}")
        return out

    def build(self, strategy: str, *, optimizer: str, clip: float) -> Any:
        """**Collective** (except ``local``)."""
        dims = parse(strategy)
        if dims is not None and "cp" in dims:
            return ContextStep(self.cfg, self.batch, dims["cp"], optimizer, LR, clip)
        if dims is not None:
            return PipelineStep(self.cfg, self.batch, dims["pp"], dims["dp"], dims["m"],
                                optimizer, LR, clip)
        return GPTStep(build(strategy, self.cfg, seed=0), self.cfg, self.batch, optimizer,
                       clip)

    def reference_loss(self, *, optimizer: str, clip: float) -> float:
        """The first loss of the whole batch on local tensors. **Local**."""
        step = GPTStep(build("local", self.cfg, seed=0), self.cfg, self.batch, optimizer, clip)
        step.forward()
        return float(step.loss.item())

    def use_calibration(self, calibration: dt.autoshard.Calibration | None,
                        fit: bool = True) -> None:
        """Price the steps with ``calibration`` (None: built-in constants); ``fit``: fit its
        compute scale to the measured ``local`` step (:meth:`fit_step`). **Local**."""
        self.calibration = calibration
        self.fit = fit

    def _spare_core(self) -> bool:
        """Whether each rank of this node has more than one core (**Collective** on the
        first call: the node's ranks are counted once)."""
        if self.overlap is None:
            from mpi4py import MPI  # lazy: launch-side MPI for the node's ranks

            node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
            ranks = node.size
            node.Free()
            cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1)
            self.overlap = cores > ranks
        return self.overlap

    def _predict(self, strategy: str, step: GPTStep, calibration: Any) -> Any:
        from mpi4py import MPI  # lazy: launch-side MPI for the world size

        name, kw = _predicted(strategy)
        return predict(self.cfg, name, _mesh_shape(strategy, MPI.COMM_WORLD.size),
                       self.batch, calibration=calibration,
                       optimizer=lambda params: make_optimizer(step.optimizer_name, params,
                                                               LR),
                       clip=step.clip, overlap=self._spare_core(), **kw)

    def fit_step(self, strategy: str, step: GPTStep, step_us: float) -> None:
        """Fit the calibration's ``compute_scale`` to the measured step of ``local`` (see
        the module docstring): the predicted step is ``fixed + compute_scale x work`` (two
        predictions, at scales 0 and 1, give both terms), and the scale is the one that
        predicts ``step_us``. Other strategies are not fitted to. **Local** (``step_us`` is
        the same on every rank)."""
        if strategy != "local" or not self.fit:
            return
        cal = self.calibration or dt.autoshard.Calibration()
        fixed = self._predict(strategy, step, replace(cal, compute_scale=0.0)).time_s
        work = self._predict(strategy, step, replace(cal, compute_scale=1.0)).time_s - fixed
        scale = (step_us * 1e-6 - fixed) / work if work > 0 else 0.0
        if scale <= 0:  # the fixed terms alone exceed the measurement: nothing to fit
            return
        self.fit_info = {"before": cal.compute_scale, "compute_scale": scale,
                         "predicted_before_us": (fixed + cal.compute_scale * work) * 1e6}
        self.calibration = replace(cal, compute_scale=scale)
        self.fitted = ["local"]

    def predict(self, strategy: str, step: GPTStep) -> Prediction:
        """:func:`launch.examples.gpt_predict.predict` of the strategy at this job's size,
        with the step's optimizer and clipping. **Local** (every rank alike)."""
        p = self._predict(strategy, step, self.calibration)
        return Prediction({"forward": None, "backward": None, "optimizer": None},
                          p.time_s * 1e6, peak_bytes=p.peak_bytes)

    def auto_model(self) -> None:
        return None

    def named_layouts(self, mesh: Any) -> dict[str, dict[str, tuple]]:
        return {}

    def note(self) -> str | None:
        parts = [f"{s} not run ({why})" for s, why in self._skipped.items()]
        parts.append(f"batch {self.batch} x {self.cfg.block_size} tokens; predictor: "
                     "launch/examples/gpt_predict.py (whole step and peak memory)")
        if self.overlap is False:
            parts.append("one core (or less) per rank: FSDP's prefetched all-gathers priced "
                         "in line with the compute, not beside it")
        f = self.fit_info
        if f is not None:
            parts.append(f"compute scale fitted to the measured local step: "
                         f"{f['before']:.2f} -> {f['compute_scale']:.2f} (local predicted "
                         f"{f['predicted_before_us'] / 1e3:.1f} ms before the fit)")
        elif not self.fit:
            parts.append("--no-fit: the calibration's compute scale as it is")
        return "; ".join(parts)


register_family("gpt-tiny", lambda size: GPTFamily("tiny"),
                "the GPT of launch/examples/gpt.py, 2 layers, d_model 64, sequence 64, "
                "batch 8 (local, dp, fsdp, tp, tp_sp, pp2_m2, pp2_m4, cp2; fsdp_tp, hsdp, "
                "pp2_fsdp2_m2/m4, cp4 at 4 ranks)")
register_family("gpt-small", lambda size: GPTFamily("small"),
                "the GPT of launch/examples/gpt.py, 6 layers, d_model 384, sequence 256, "
                "batch 4 (slow on a small CPU machine: seconds per step)")
