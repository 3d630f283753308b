"""The pipeline runtime: :class:`PipelineStage` (a module on one coordinate of the ``pp``
mesh dim) and the schedules (:class:`ScheduleGPipe`, :class:`Schedule1F1B`,
:class:`ScheduleInterleaved1F1B`, :class:`ScheduleInterleavedZeroBubble`), which are one
executor running the action lists of :mod:`dtensor.pipelining._schedules`.

How a step runs (every schedule):

1. One small all-gather over the pp communicator of each rank's batch shape and target
   shape (``bad input``: a micro-batch count that does not divide the batch raises
   :class:`PipelineError` on every rank at once), also what tells every rank that the
   shapes changed.
2. Receives are posted early: on the first step (or after the batch shape changed) a
   stage's input buffers are allocated when a 12-value header with the dtype and shape of
   the previous stage's output arrives (sent once, with the first micro-batch), its output
   gradient buffers after its first forward; on later steps every receive of the step is
   posted before the first action. Buffers are reused step after step.
3. The rank runs its action list in order: ``F`` (forward of one micro-batch; the output
   goes to the next stage by ``Comm.isend``), ``B`` (backward; the input gradient goes
   upstream), ``I`` / ``W`` (the zero-bubble halves, split by the autograd engine:
   ``I`` is :func:`~dtensor.local.grad_engine.backward_input`, the stage input's gradient,
   sent at once, which leaves the parameters' part of each node for later; ``W`` runs that
   part, :meth:`~dtensor.local.grad_engine.WeightWork.run`, into the parameters' ``.grad``).
   Each action's times and waits go to ``schedule.timeline`` (:class:`TimelineEvent`);
   each message carries a :class:`Message` (stage, micro-batch, direction) as its ``what=``
   for the observers.
4. Parameters tied across stages (the GPT's head and token embedding, see
   :func:`dtensor.pipelining.pipeline_split`) have their gradients summed between the ranks
   that hold them (point-to-point, the same sum in the same order on each).
5. The last stage's per-micro-batch losses are broadcast over pp (one ``Bcast`` of ``m``
   float64 values) and appended to ``losses`` on every rank that passes a list.

Gradients are those of the mean over micro-batches (PyTorch's ``scale_grads=True``): each
micro-batch's loss is scaled by ``1/m`` before its backward.

Stage inputs and outputs are local :class:`dtensor.Tensor` s (one per stage boundary; TP
and FSDP beside the pipeline keep their DTensors inside the stage, as the parallel styles'
``use_local_output`` does); numpy arrays on the CPU only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from placements.errors import PipelineError
from placements.meta import is_floating

from ..dispatch.entry_points import FUNCTIONS
from ..distributed.dtensor import DTensor
from ..distributed.mesh import DeviceMesh
from ..local import grad_engine as _ag
from ..local.factory import from_numpy
from ..local.tensor import Tensor
from ..nn import Module
from ._schedules import Action, Message, TimelineEvent, make_schedule
from ._split import ties_of

__all__ = [
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
]

_HEADER = 12  # int64 values: 2 for the dtype name, 1 for ndim, up to 9 dims
_MAX_STAGES = 64  # per rank, in the construction check
_ACT, _GRAD, _HEAD, _TIE = range(4)


class PipelineStage:
    """One pipeline stage: ``submodule`` (``.submod``) is stage ``stage_index`` of
    ``num_stages``, on pp coordinate ``stage_index % pp_size`` of ``mesh``. **Local**.

    Parameters
    ----------
    submodule : dt.nn.Module
        The stage's module (for a ``dt.nn`` model split by
        :func:`dtensor.pipelining.pipeline_split`, one of its stage modules).
    stage_index, num_stages : int
    mesh : DeviceMesh
        The 1-D ``pp`` mesh (``mesh["pp"]`` of a larger one); replaces PyTorch's device and
        process group. Its communicator carries the activations and gradients.

    Raises
    ------
    PipelineError
        A mesh that is not 1-D, a stage index outside ``[0, num_stages)``.
    """

    def __init__(self, submodule: Module, stage_index: int, num_stages: int,
                 mesh: DeviceMesh) -> None:
        if not isinstance(submodule, Module):
            raise PipelineError(f"PipelineStage: submodule must be a dt.nn.Module, got "
                                f"{type(submodule).__name__}")
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
            shape = getattr(mesh, "shape", type(mesh).__name__)
            raise PipelineError(f"PipelineStage: mesh must be the 1-D pp mesh (mesh['pp']), "
                                f"got {shape}")
        if not (isinstance(num_stages, int) and num_stages >= 1
                and isinstance(stage_index, int) and 0 <= stage_index < num_stages):
            raise PipelineError(f"PipelineStage: stage_index {stage_index!r} is not in "
                                f"[0, num_stages={num_stages!r})")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.mesh = mesh
        self.comm = mesh.get_group(0)
        self.pp_size = mesh.size(0)
        self.pp_rank = mesh.get_coordinate()[0]
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1

    def rank_of(self, stage: int) -> int:
        """The pp rank that holds ``stage``. **Local**."""
        return stage % self.pp_size

    def __repr__(self) -> str:
        return (f"PipelineStage({self.stage_index}/{self.num_stages}, pp rank "
                f"{self.pp_rank}/{self.pp_size})")


class _StageState:
    """What one stage keeps during a step: the micro-batch inputs and outputs for the
    backward, the receive buffers (kept across steps) and the requests."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.in_meta: tuple[np.dtype, tuple[int, ...]] | None = None
        self.out_meta: tuple[np.dtype, tuple[int, ...]] | None = None
        self.act_bufs: list[np.ndarray] = []
        self.grad_bufs: list[np.ndarray] = []
        self.act_reqs: list[Any] = []
        self.grad_reqs: list[Any] = []
        self.head: np.ndarray | None = None
        self.head_req: Any = None
        self.cache: dict[int, tuple] = {}
        self.local_in: dict[int, Tensor] = {}  # handed over in memory (same rank)
        self.local_grad: dict[int, Tensor] = {}

    def reset(self) -> None:
        self.in_meta = self.out_meta = None
        self.act_bufs, self.grad_bufs = [], []


def _encode_meta(arr: np.ndarray) -> np.ndarray:
    if arr.ndim > _HEADER - 3:
        raise PipelineError(f"pipeline: a stage output of {arr.ndim} dims (at most "
                            f"{_HEADER - 3})")
    head = np.zeros(_HEADER, np.int64)
    head[:2] = np.frombuffer(str(arr.dtype).encode().ljust(16)[:16], np.int64)
    head[2] = arr.ndim
    head[3:3 + arr.ndim] = arr.shape
    return head


def _decode_meta(head: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
    name = head[:2].tobytes().decode().strip()
    nd = int(head[2])
    return _np_dtype(name), tuple(int(d) for d in head[3:3 + nd])


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # lazy: third-party, only for bfloat16 activations

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _as_array(t: object, what: str) -> np.ndarray:
    """The C-contiguous numpy data of a local stage output or gradient."""
    if isinstance(t, DTensor):
        raise PipelineError(f"pipeline: {what} is a DTensor; stage boundaries carry local "
                            "Tensors (use use_local_output=True / to_local() at the stage's end)")
    if not isinstance(t, Tensor):
        raise PipelineError(f"pipeline: {what} must be one dt.Tensor, got {type(t).__name__}")
    arr = t.detach().numpy()
    if not isinstance(arr, np.ndarray):
        raise PipelineError(f"pipeline: {what} must live on the CPU")
    return np.ascontiguousarray(arr)


class _PipelineSchedule:
    """The executor shared by every schedule (see the module docstring)."""

    _kind = ""

    def __init__(self, stages: list[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None, scale_grads: bool) -> None:
        name = type(self).__name__
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise PipelineError(f"{name}: needs PipelineStage objects, got {stages!r}")
        first = stages[0]
        if any(s.comm is not first.comm for s in stages):
            raise PipelineError(f"{name}: the stages of a rank must share one pp mesh")
        if loss_fn is None or not callable(loss_fn):
            raise PipelineError(f"{name}: loss_fn must be a callable (output, target) -> loss")
        self._name = name
        self._stages = {s.stage_index: s for s in stages}
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._scale = 1.0 / n_microbatches if scale_grads and isinstance(
            n_microbatches, int) and n_microbatches > 0 else 1.0
        self.comm = first.comm
        self.pp_size = first.pp_size
        self.pp_rank = first.pp_rank
        self.num_stages = first.num_stages
        self._check_layout(stages)
        self.pipeline_order: dict[int, list[Action]] = dict(enumerate(make_schedule(
            self._kind, self.num_stages, self.pp_size, n_microbatches)))
        self.actions = self.pipeline_order[self.pp_rank]
        self._state = {i: _StageState(s) for i, s in self._stages.items()}
        self._shape_key: tuple | None = None
        self._ties = self._tie_groups()
        #: **Local**: this rank's :class:`TimelineEvent` s of the last step, in action order
        #: (what ``dt.debug.visualize_schedule`` gathers and the benchmark's bubble reads)
        self.timeline: list[TimelineEvent] = []
        self._ready = 0.0
        self.step_time = 0.0

    # -- construction check (collective) ------------------------------------------------
    def _check_layout(self, stages: list[PipelineStage]) -> None:
        """Every rank's stages against the mesh and the schedule, checked together: one
        all-gather of a few ints over pp, then the same verdict on every rank."""
        m = self._n_microbatches
        mine = [s.stage_index for s in stages][:_MAX_STAGES]
        row = np.full(3 + _MAX_STAGES, -1, np.int64)
        row[0] = self.num_stages if all(s.num_stages == self.num_stages for s in stages) else -2
        row[1] = m if isinstance(m, int) else -1
        row[2] = len(stages)
        row[3:3 + len(mine)] = mine
        rows = self.comm.allgather_ints(row, what=f"{self._name} stages")
        n, p = self.num_stages, self.pp_size
        problems = []
        if (rows[:, 0] != n).any():
            problems.append(f"the ranks disagree on num_stages ({sorted(set(rows[:, 0]))}, "
                            "-2: a rank with stages of different counts)")
        if (rows[:, 1] != rows[0, 1]).any() or rows[0, 1] < 1:
            problems.append(f"n_microbatches must be the same int >= 1 on every rank, got "
                            f"{rows[:, 1].tolist()}")
        held = {}
        for r in range(p):
            for s in rows[r, 3:3 + rows[r, 2]]:
                held.setdefault(int(s), []).append(r)
        wrong = {s: rs for s, rs in held.items() if rs != [s % p]}
        if wrong:
            problems.append("stage s must be on pp rank s % pp_size, got " + ", ".join(
                f"stage {s} on rank(s) {rs}" for s, rs in sorted(wrong.items())))
        missing = sorted(set(range(n)) - set(held))
        if missing:
            problems.append(f"stages {missing} are on no rank")
        if n < p:
            problems.append(f"{n} stages on a pp mesh of {p} ranks: ranks "
                            f"{list(range(n, p))} hold none")
        elif n % p:
            problems.append(f"{n} stages do not divide among {p} pp ranks")
        elif self._single and n != p:
            problems.append(f"runs one stage per pp rank, but there are {n} stages for {p} "
                            f"ranks (use ScheduleInterleaved1F1B or "
                            f"ScheduleInterleavedZeroBubble)")
        if not problems and 4 * n * int(rows[0, 1]) > 32767:
            problems.append(f"{n} stages x {rows[0, 1]} micro-batches exceed the message tags")
        if problems:
            raise PipelineError(f"{self._name}: " + "; ".join(problems))

    _single = False

    @property
    def n_microbatches(self) -> int:
        """The micro-batch count of every step. **Local**."""
        return self._n_microbatches

    def _tie_groups(self) -> list[list[tuple[int, Any]]]:
        """Per group of tied parameters (those of a split model that live in several
        stages): ``(stage, parameter or None)`` for every stage of the group, the parameter
        where this rank holds the stage."""
        groups: dict[str, dict[int, Any]] = {}
        for i, st in self._stages.items():
            for key, stages in ties_of(st.submod).items():
                g = groups.setdefault(key, dict.fromkeys(stages))
                g[i] = st.submod.get_parameter(stages[i])
        return [sorted(g.items()) for _, g in sorted(groups.items())]

    # -- the step --------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None,
             **kwargs: Any) -> Any:
        """Run one training step of the pipeline. **Collective** over the pp mesh (and
        over the meshes the stages' modules communicate on).

        ``step(x)`` on the rank of the first stage (its inputs, split along dim 0 into
        ``n_microbatches``), ``step(target=y, losses=losses)`` on the rank of the last
        stage, ``step()`` elsewhere (a rank holding both passes both). Gradients
        accumulate into the parameters' ``.grad``. ``losses``, where given on any rank,
        is extended with the ``n_microbatches`` losses (0-d float32 Tensors).

        Returns
        -------
        The last stage's output for the whole batch (micro-batch outputs concatenated
        along dim 0) on the rank of the last stage, None elsewhere.

        Raises
        ------
        PipelineError
            On every rank at once: a micro-batch count that does not divide the batch, no
            input on the first stage's rank, no target on the last stage's.
        """
        t0 = time.perf_counter()
        m = self._n_microbatches
        xs = self._microbatches(args)
        ys = self._microbatches((target,) if target is not None else ())
        self._agree(args, target, sorted(kwargs))
        origin = time.perf_counter()  # the timeline's 0: every rank leaves _agree together
        self._post_receives()
        self.timeline = []
        outs: dict[int, Tensor] = {}
        loss_vals = np.zeros(m, np.float64)
        sends: list[tuple[Any, np.ndarray]] = []
        for a in self.actions:
            self._ready = 0.0
            s0 = time.perf_counter()
            st = self._state[a.stage]
            if a.kind == "F":
                self._forward(st, a.mb, xs, ys, outs, loss_vals, sends)
            else:
                self._backward(st, a, sends)
            s1 = time.perf_counter()
            if len(sends) > 8 and self.comm.test_all([r for r, _ in sends]):
                sends.clear()
            self.timeline.append(TimelineEvent(a.stage, a.mb, a.kind, s0 - origin, s1 - origin,
                                               max(self._ready - s0, 0.0),
                                               time.perf_counter() - s1))
        s1 = time.perf_counter()
        self._sum_tied(sends)
        self.comm.wait_all([r for r, _ in sends])
        if self.timeline:
            self.timeline[-1] = self.timeline[-1]._replace(
                send_wait=self.timeline[-1].send_wait + time.perf_counter() - s1)
        last = self.num_stages - 1
        self.comm.bcast_array(loss_vals, root=last % self.pp_size, what=f"{self._name} losses")
        if losses is not None:
            losses.extend(from_numpy(np.asarray(v, np.float32)) for v in loss_vals)
        self.step_time = time.perf_counter() - t0
        if last in self._stages:
            return FUNCTIONS["cat"]([outs[i] for i in range(m)], 0)
        return None

    def _microbatches(self, args: tuple) -> list[tuple]:
        m = self._n_microbatches
        parts = []
        for x in args:
            x = from_numpy(np.asarray(x)) if isinstance(x, np.ndarray) else x
            if not isinstance(x, Tensor) or x.ndim == 0 or x.shape[0] % m:
                return []  # reported by _agree on every rank
            b = x.shape[0] // m
            parts.append([x[i * b:(i + 1) * b] for i in range(m)])
        return [tuple(p[i] for p in parts) for i in range(m)] if parts else []

    def _agree(self, args: tuple, target: Any, keywords: list[str]) -> None:
        """The collective input check and shape agreement of a step (see the module
        docstring)."""
        row = np.full(2 * (2 + _HEADER - 3) + 1, -1, np.int64)
        row[-1] = len(keywords)
        for k, x in enumerate((args[0] if args else None, target)):
            if x is None:
                continue
            shape = tuple(x.shape) if hasattr(x, "shape") else ()
            off = k * (2 + _HEADER - 3)
            row[off] = 1 if isinstance(x, (Tensor, np.ndarray)) and len(shape) else 0
            row[off + 1] = len(shape)
            row[off + 2:off + 2 + min(len(shape), _HEADER - 3)] = shape[:_HEADER - 3]
        rows = self.comm.allgather_ints(row, what=f"{self._name}.step shapes")
        m, p, n = self._n_microbatches, self.pp_size, self.num_stages
        w = 2 + _HEADER - 3
        problems = []
        for k, stage, what, how in ((0, 0, "input", "step(x)"),
                                    (1, n - 1, "target", "step(target=y)")):
            r = stage % p
            has, nd = rows[r, k * w], rows[r, k * w + 1]
            if has != 1:
                problems.append(f"stage {stage} (pp rank {r}) needs its {what}: call {how} "
                                f"there with a dt.Tensor or numpy array of at least 1 dim")
            elif rows[r, k * w + 2] % m:
                problems.append(f"the {what} batch of {rows[r, k * w + 2]} on stage {stage} "
                                f"(pp rank {r}) does not split into n_microbatches={m}")
            del nd
        bad = [r for r in range(p) if rows[r, -1] > 0]
        if bad:
            problems.append(f"keyword inputs are not supported (given on pp ranks {bad}); "
                            "pass the first stage's inputs positionally")
        if problems:
            raise PipelineError(f"{self._name}.step: " + "; ".join(problems))
        key = tuple(rows[0 % p, :w].tolist())
        if key != self._shape_key:
            self._shape_key = key
            for st in self._state.values():
                st.reset()

    def _post_receives(self) -> None:
        m = self._n_microbatches
        for st in self._state.values():
            s = st.stage
            prev_remote = not s.is_first and s.rank_of(s.stage_index - 1) != s.pp_rank
            next_remote = not s.is_last and s.rank_of(s.stage_index + 1) != s.pp_rank
            st.act_reqs = [None] * m
            st.grad_reqs = [None] * m
            st.head_req = None
            if prev_remote:
                if st.in_meta is None:
                    st.head = np.zeros(_HEADER, np.int64)
                    st.head_req = s.comm.irecv(st.head, s.rank_of(s.stage_index - 1),
                                               self._tag(_HEAD, s.stage_index - 1, 0),
                                               Message(s.stage_index, -1, "header",
                                                       s.stage_index - 1))
                else:
                    self._post_acts(st)
            if next_remote and st.out_meta is not None:
                self._post_grads(st)

    def _tag(self, kind: int, stage: int, mb: int) -> int:
        return (kind * self.num_stages + stage) * self._n_microbatches + mb

    def _post_acts(self, st: _StageState) -> None:
        s, m = st.stage, self._n_microbatches
        dtype, shape = st.in_meta
        if not st.act_bufs:
            st.act_bufs = [np.empty(shape, dtype) for _ in range(m)]
        src = s.rank_of(s.stage_index - 1)
        st.act_reqs = [s.comm.irecv(st.act_bufs[i], src, self._tag(_ACT, s.stage_index - 1, i),
                                    Message(s.stage_index, i, "activation", s.stage_index - 1))
                       for i in range(m)]

    def _post_grads(self, st: _StageState) -> None:
        s, m = st.stage, self._n_microbatches
        dtype, shape = st.out_meta
        if not st.grad_bufs:
            st.grad_bufs = [np.empty(shape, dtype) for _ in range(m)]
        src = s.rank_of(s.stage_index + 1)
        st.grad_reqs = [s.comm.irecv(st.grad_bufs[i], src,
                                     self._tag(_GRAD, s.stage_index + 1, i),
                                     Message(s.stage_index, i, "gradient", s.stage_index + 1))
                        for i in range(m)]

    # -- actions ---------------------------------------------------------------------
    def _input(self, st: _StageState, mb: int, xs: list[tuple]) -> tuple:
        s = st.stage
        if s.is_first:
            return xs[mb]
        if s.rank_of(s.stage_index - 1) == s.pp_rank:
            x = st.local_in.pop(mb)
        else:
            if st.in_meta is None:
                s.comm.wait_all([st.head_req])
                st.in_meta = _decode_meta(st.head)
                self._post_acts(st)
            s.comm.wait_all([st.act_reqs[mb]])
            self._ready = time.perf_counter()
            x = from_numpy(st.act_bufs[mb])
        if is_floating(x.dtype):
            x.requires_grad_(True)
        return (x,)

    def _forward(self, st: _StageState, mb: int, xs: list[tuple], ys: list[tuple],
                 outs: dict, loss_vals: np.ndarray, sends: list) -> None:
        s = st.stage
        inputs = self._input(st, mb, xs)
        out = s.submod(*inputs)
        if s.is_last:
            outs[mb] = out.detach()
            loss = self._loss_fn(out, ys[mb][0])
            lv = loss.to_local() if isinstance(loss, DTensor) else loss
            loss_vals[mb] = float(lv.detach().numpy())
            st.cache[mb] = (inputs, loss * self._scale)
            return
        st.cache[mb] = (inputs, out)
        if s.rank_of(s.stage_index + 1) == s.pp_rank:
            self._state[s.stage_index + 1].local_in[mb] = out.detach()
            return
        arr = _as_array(out, f"the output of stage {s.stage_index}")
        dest = s.rank_of(s.stage_index + 1)
        if st.out_meta is None:
            st.out_meta = (arr.dtype, arr.shape)
            head = _encode_meta(arr)
            sends.append((s.comm.isend(head, dest, self._tag(_HEAD, s.stage_index, 0), Message(
                s.stage_index, -1, "header", s.stage_index + 1)), head))
            self._post_grads(st)
        elif (arr.dtype, arr.shape) != st.out_meta:
            raise PipelineError(f"{self._name}: stage {s.stage_index} gave an output of "
                                f"{arr.dtype}{list(arr.shape)} for micro-batch {mb}, the first "
                                f"was {st.out_meta[0]}{list(st.out_meta[1])}")
        sends.append((s.comm.isend(arr, dest, self._tag(_ACT, s.stage_index, mb), Message(
            s.stage_index, mb, "activation", s.stage_index + 1)), arr))

    def _out_grad(self, st: _StageState, mb: int) -> Tensor | None:
        s = st.stage
        if s.is_last:
            return None
        if s.rank_of(s.stage_index + 1) == s.pp_rank:
            return st.local_grad.pop(mb)
        s.comm.wait_all([st.grad_reqs[mb]])
        self._ready = time.perf_counter()
        return from_numpy(st.grad_bufs[mb])

    def _backward(self, st: _StageState, a: Action, sends: list) -> None:
        s = st.stage
        if a.kind == "W":
            st.cache.pop(a.mb).run()
            return
        inputs, out = st.cache[a.mb]
        g = self._out_grad(st, a.mb)
        x = inputs[0] if not s.is_first else None
        if a.kind == "B":
            st.cache.pop(a.mb)
            _ag.backward([out], [g] if g is not None else None)
            gx = x.grad if x is not None else None
        else:  # I: the input gradient now, the weight gradient at W (split in the engine)
            params = [p for p in s.submod.parameters() if p.requires_grad]
            gxs, st.cache[a.mb] = _ag.backward_input(
                [out], [g] if g is not None else None, [x] if x is not None else [], params)
            gx = gxs[0] if x is not None else None
        if x is None:
            return
        if gx is None:
            raise PipelineError(f"{self._name}: stage {s.stage_index}'s output does not depend "
                                f"on its input (micro-batch {a.mb})")
        if s.rank_of(s.stage_index - 1) == s.pp_rank:
            self._state[s.stage_index - 1].local_grad[a.mb] = gx
            return
        arr = _as_array(gx, f"the input gradient of stage {s.stage_index}")
        dest = s.rank_of(s.stage_index - 1)
        sends.append((s.comm.isend(arr, dest, self._tag(_GRAD, s.stage_index, a.mb), Message(
            s.stage_index, a.mb, "gradient", s.stage_index - 1)), arr))

    def _sum_tied(self, sends: list) -> None:
        """Sum the gradients of parameters tied across stages between their ranks."""
        for k, group in enumerate(self._ties):
            mine = [p for _, p in group if p is not None]
            if not mine:
                continue
            ranks = sorted({st % self.pp_size for st, _ in group})
            grads = [p.grad for p in mine if p.grad is not None]
            local = None
            for g in grads:
                a = (g.to_local() if isinstance(g, DTensor) else g).numpy()
                local = a.copy() if local is None else local + a
            if local is None:
                local = np.zeros(_local_shape(mine[0]), _np_dtype(str(mine[0].dtype)))
            parts = {self.pp_rank: local}
            reqs = []
            tag = self._tag(_TIE, 0, 0) + k
            here = min(st for st, p in group if p is not None)
            for r in ranks:
                if r != self.pp_rank:
                    what = Message(here, -1, "tied", min(st for st, _ in group
                                                         if st % self.pp_size == r))
                    parts[r] = np.empty_like(local)
                    reqs.append(self.comm.irecv(parts[r], r, tag, what))
                    reqs.append(self.comm.isend(local, r, tag, what))
            self.comm.wait_all(reqs)
            total = parts[ranks[0]].copy()
            for r in ranks[1:]:
                total += parts[r]
            for p in mine:
                if p.grad is None:
                    p.grad = _like(p, total.copy())
                else:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numpy()[...] = total


def _local_shape(p: Any) -> tuple[int, ...]:
    return tuple((p.to_local() if isinstance(p, DTensor) else p).shape)


def _like(p: Any, arr: np.ndarray) -> Any:
    if isinstance(p, DTensor):
        return DTensor.from_local(from_numpy(arr), p.device_mesh, p.placements,
                                  shape=p.shape, stride=p.stride())
    return from_numpy(arr)


class PipelineScheduleSingle(_PipelineSchedule):
    """A schedule of one stage per pp rank (PyTorch's base class of that name)."""

    _single = True

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable | None = None, scale_grads: bool = True) -> None:
        if isinstance(stage, Sequence):
            raise PipelineError(f"{type(self).__name__}: takes one PipelineStage (use "
                                "ScheduleInterleaved1F1B for several per rank)")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)


class PipelineScheduleMulti(_PipelineSchedule):
    """A schedule of several stages per pp rank (PyTorch's base class of that name)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, scale_grads: bool = True) -> None:
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        super().__init__(stages, n_microbatches, loss_fn, scale_grads)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: every micro-batch's forward, then every backward. **Collective** to build
    (one all-gather over pp checks the stages; see :class:`PipelineStage`). Peak
    activations: ``n_microbatches`` micro-batches per stage."""

    _kind = "gpipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward: stage ``r`` runs ``pp_size - r - 1`` warm-up forwards,
    then alternates. **Collective** to build. Same bubble as GPipe, peak activations
    ``pp_size - r`` micro-batches."""

    _kind = "1f1b"


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Megatron): ``num_stages / pp_size`` stages per rank, stage ``s`` on
    pp rank ``s % pp_size``. **Collective** to build."""

    _kind = "interleaved_1f1b"


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """The interleaved schedule with the backward split into the input gradient ``I``
    (sent upstream at once) and the weight gradient ``W`` (deferred into the bubbles);
    stage 0, which has no input gradient to send, keeps whole backwards. **Collective** to
    build. The autograd engine splits each backward
    (:func:`~dtensor.local.grad_engine.backward_input`: ``I`` leaves the weight edges of
    each node for ``W``, which does not walk the graph again)."""

    _kind = "zero_bubble"
