"""Model families of the strategy sweep's training modes, and the registry that names them.

A *family* is what ``strategy_sweep.py --train`` needs to measure a model under its named
strategies: the strategies it has at a given number of ranks, a step built under each (its
phases timed one by one), the reference loss, and a *predictor* that says, per strategy,
what the cost model expects. ``--train --auto`` also needs the model in the functional form
that :func:`dtensor.auto_shard` searches (``step_fn(params, inputs)``, parameter and input
arrays) and the named strategies as placements.

The interface (:class:`Family`; any object with these members will do):

``name``, ``shapes``
    Shown in the reports and stored in the JSON (``shapes``: parameter name -> global shape).
``strategies(world) -> list[str]``
    The named strategies to run at ``world`` ranks, in report order.
``build(strategy, optimizer=, clip=) -> Step``
    **Collective**. The model, its parameters and one batch laid out as ``strategy`` says,
    with an optimizer (:data:`launch.examples._training.OPTIMIZERS` names it) and
    ``clip_grad_norm_(clip)``. A :class:`Step` has ``mesh`` (None when local),
    ``forward()`` (sets ``loss``), ``backward()``, ``optimizer()`` (clipping and the
    optimizer step) and ``run()`` (the three in turn).
``reference_loss(optimizer=, clip=) -> float``
    **Collective** where the reference communicates. The first loss of the reference run
    (on local tensors); every strategy's first loss is compared with it.
``predict(strategy, step) -> Prediction``
    **Collective**. The family's predictor, called after the step was measured (it may run
    the step's phases, e.g. under :func:`dtensor.debug.explain`): the predicted
    microseconds of each phase's collectives and, when the family predicts whole steps, of
    the step. ``--train`` prints them beside the measurements, with the Spearman rank
    correlation of predicted and measured step times when at least three strategies have
    one.
``auto_model() -> TrainModel | None``
    The model for ``--train --auto`` (:class:`launch.examples._training.TrainModel`:
    ``loss``, ``init()``, ``batch(0)``, ``shapes``), or None when the family has no
    functional form.
``named_layouts(mesh) -> dict[str, dict[str, tuple[Placement, ...]]]``
    The named strategies that ``--auto`` measures beside the search's plans, as placements
    of every parameter and input on ``mesh``.
``note() -> str | None``
    A line for the report (e.g. why a strategy does not run), or None.
``use_calibration(calibration, fit=True)`` (optional)
    A family whose predictor prices steps from a calibration of this machine has it:
    ``--train`` then finds or measures one as ``--auto`` does (``--calibration``,
    ``--no-calibrate``, ``--recalibrate``) and hands it over before the sweep (``fit``:
    False under ``--no-fit``).
``calibration_sizes``, ``calibration_repeat``, ``calibration_comm_sizes`` (optional)
    The N of the N x N tensors and the samples per point of the calibration ``--train``
    measures for such a family when none is stored (default: ``--auto``'s quick one), and the
    N of its collectives' tensors where they should reach further (default: the same N).
``interleave`` (optional)
    True: ``--train`` builds every strategy first and times their steps in turns (as
    ``--interleave``), for steps long enough that the machine's load changes between them.
``fit_step(strategy, step, step_us)`` and ``fitted`` (optional)
    Called with each strategy's measured step (median microseconds, slowest rank) before
    its prediction: the family may fit its predictor's terms to it. ``fitted`` names the
    strategies it was fitted to; the report gives the Spearman correlation without them.

When every strategy's prediction has a step time, ``--train`` also *chooses* a strategy
by the predictor, as :func:`dtensor.auto_shard` would for a model without a functional
form: the smallest predicted step among those whose predicted peak (``Prediction.
peak_bytes``; None: not predicted, it fits) is within ``--memory-budget``, and reports the
choice's measured step against the best measured one.

:func:`register_family` adds a family under a name that ``--model`` then accepts;
:func:`resolve` turns ``--model`` into a family: a registered name, or
``package.module:function`` for a user's own model (:func:`load_user_model`, whose contract
is :data:`USER_MODEL_CONTRACT`). The built-in families ``mlp`` and ``transformer`` are the
training models of :mod:`launch.examples._training` (:class:`FunctionalFamily`: ``local``,
``dp``, ``tp``, ``2d``; the predictor is the cost model's price of the collectives that
``explain`` traces in forward and backward).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

import dtensor as dt
from dtensor.debug import explain
from launch.examples._training import (
    TrainModel,
    loss_value,
    make_optimizer,
    mesh_for,
    mlp_model,
    place,
    transformer_model,
)

__all__ = [
    "USER_MODEL_CONTRACT",
    "Family",
    "FunctionalFamily",
    "ModelSpecError",
    "Prediction",
    "Step",
    "family_names",
    "load_user_model",
    "register_family",
    "resolve",
]

R = dt.Replicate()
PHASES = ("forward", "backward", "optimizer")

USER_MODEL_CONTRACT = """\
--model package.module:function sweeps your own model. The function is called with no
arguments (or with size=the --size value, when it has a parameter named size) and returns

    (step_fn, params, inputs)       or       (step_fn, params, inputs, tp)

the arguments of dt.auto_shard(step_fn, params, inputs, mesh):
  step_fn(params, inputs) -> loss   a 0-d tensor built from dt ops, so that the same
                                    function runs on local tensors and on DTensors;
  params   dict name -> numpy float array: the parameters' global initial values, the same
           on every rank (draw them from a fixed seed);
  inputs   dict name -> numpy array: one step's batch, global, the same on every rank;
           data parallelism splits dim 0 of each (an input named "mask" stays replicated);
           keep constants in step_fn's closure;
  tp       optional dict name -> placement (dt.Shard(d) or dt.Replicate()) of each
           parameter over the tensor-parallel mesh dim (missing names: replicated).
--train runs local, dp and, with tp, tp and 2d; --train --auto searches every parameter's
and input's placements. Example: launch/examples/sweep_model.py
(--model launch.examples.sweep_model:build)."""


class ModelSpecError(ValueError):
    """A ``--model`` value that names no family, or a user's model function that breaks
    :data:`USER_MODEL_CONTRACT`."""


# -- the interface --------------------------------------------------------------------------------
class Step(Protocol):
    """One training step of a model under a strategy, phase by phase."""

    mesh: Any
    loss: Any

    def forward(self) -> None: ...

    def backward(self) -> None: ...

    def optimizer(self) -> None: ...

    def run(self) -> None: ...


@dataclass(frozen=True)
class Prediction:
    """What a family's predictor expects of one strategy: ``comm_us``, the collectives'
    microseconds per phase (None where not predicted); ``step_us``, the whole step's
    (None when the predictor does not price steps); ``peak_bytes``, the step's peak
    allocated bytes on the largest rank counted from before the model was built (the
    sweep's ``peak_with_state_bytes``; None when not predicted)."""

    comm_us: Mapping[str, float | None]
    step_us: float | None = None
    peak_bytes: int | None = None


class Family(Protocol):
    """A model family of the sweep (see the module docstring)."""

    name: str
    shapes: Mapping[str, tuple[int, ...]]

    def strategies(self, world: int) -> list[str]: ...

    def build(self, strategy: str, *, optimizer: str, clip: float) -> Step: ...

    def reference_loss(self, *, optimizer: str, clip: float) -> float: ...

    def predict(self, strategy: str, step: Step) -> Prediction: ...

    def auto_model(self) -> TrainModel | None: ...

    def named_layouts(self, mesh: Any) -> dict[str, dict[str, tuple]]: ...

    def note(self) -> str | None: ...


_FAMILIES: dict[str, tuple[Callable[[str], Family], str]] = {}


def register_family(name: str, factory: Callable[[str], Family], description: str) -> None:
    """Make ``--model name`` build ``factory(size)`` (``size``: the ``--size`` value).
    **Local**. A name with ``:`` would read as a user's ``module:function``."""
    if ":" in name:
        raise ValueError(f"register_family: {name!r}: a family's name has no ':'")
    _FAMILIES[name] = (factory, description)


def family_names() -> dict[str, str]:
    """Registered family names and their one-line descriptions. **Local**."""
    return {n: d for n, (_, d) in _FAMILIES.items()}


def resolve(spec: str, size: str) -> Family:
    """The family ``--model spec`` names: a registered one, or a user's
    ``package.module:function``. **Local**.

    Raises
    ------
    ModelSpecError
        When ``spec`` names nothing, or the user's function breaks the contract.
    """
    if spec in _FAMILIES:
        return _FAMILIES[spec][0](size)
    if ":" in spec:
        return FunctionalFamily(load_user_model(spec, size))
    raise ModelSpecError(f"--model {spec!r}: not a model family ({', '.join(_FAMILIES)}) "
                         "nor package.module:function")


# -- the functional family ------------------------------------------------------------------------
class FunctionalStep:
    """One training step of a :class:`TrainModel` on placed parameters and batch, split
    into its phases (a :class:`Step`)."""

    def __init__(self, model: TrainModel, params: dict[str, Any], batch: dict[str, Any],
                 optimizer: str, clip: float, mesh: Any = None) -> None:
        self.model = model
        self.params = params
        self.batch = batch
        self.mesh = mesh
        self.opt = make_optimizer(optimizer, list(self.params.values()), 1e-3)
        self.clip = clip
        self.loss: Any = None

    @classmethod
    def named(cls, model: TrainModel, strategy: str, optimizer: str,
              clip: float) -> FunctionalStep:
        """The step of a named strategy of :mod:`launch.examples._training`.
        **Collective** unless ``local``."""
        mesh = mesh_for(strategy)
        return cls(model, place(model, strategy, mesh, model.init()),
                   place(model, strategy, mesh, model.batch(0), batch=True), optimizer, clip,
                   mesh)

    def forward(self) -> None:
        self.opt.zero_grad()
        self.loss = self.model.loss(self.params, self.batch)

    def backward(self) -> None:
        self.loss.backward()

    def optimizer(self) -> None:
        dt.nn.utils.clip_grad_norm_(list(self.params.values()), self.clip)
        self.opt.step()

    def run(self) -> None:
        self.forward()
        self.backward()
        self.optimizer()


def predicted_comm_us(step: Step) -> dict[str, float | None]:
    """Cost-model microseconds per phase of the collectives :func:`dtensor.debug.explain`
    traces for one forward and backward of ``step`` (which then takes its optimizer step);
    the optimizer phase is not traced (None). **Collective**."""
    traced = explain(lambda: (step.forward(), step.backward()))
    out: dict[str, float | None] = {"forward": 0.0, "backward": 0.0, "optimizer": None}
    for o in traced.ops:
        out[o.phase] += sum(c.seconds for c in o.collectives if c.communicates) * 1e6
    step.optimizer()
    return out


class FunctionalFamily:
    """A :class:`TrainModel` (the training examples' models, or a user's) under ``local``,
    ``dp`` and, when it has tensor-parallel placements, ``tp`` and ``2d``
    (:mod:`launch.examples._training` defines them and their meshes; ``2d`` runs on
    ``(n/2, 2)``, ``(1, 2)`` at 2 ranks, ``(n, 1)`` for odd n). The predictor prices the
    collectives ``explain`` traces (:func:`predicted_comm_us`); it does not price steps."""

    def __init__(self, model: TrainModel) -> None:
        self.model = model
        self.name = model.name
        self.shapes = dict(model.shapes)

    def strategies(self, world: int) -> list[str]:
        return ["local", "dp", *(["tp", "2d"] if self.model.tp is not None else [])]

    def build(self, strategy: str, *, optimizer: str, clip: float) -> FunctionalStep:
        return FunctionalStep.named(self.model, strategy, optimizer, clip)

    def reference_loss(self, *, optimizer: str, clip: float) -> float:
        step = FunctionalStep.named(self.model, "local", optimizer, clip)
        step.forward()
        return loss_value(step.loss)

    def predict(self, strategy: str, step: Step) -> Prediction:
        return Prediction(predicted_comm_us(step))

    def auto_model(self) -> TrainModel:
        return self.model

    def named_layouts(self, mesh: Any) -> dict[str, dict[str, tuple]]:
        """``replicated``; ``dp`` (the batch split over every mesh dim); with tensor-parallel
        placements, ``tp`` (each parameter's over every mesh dim) and, on a 2-D mesh,
        ``2d`` (dp over mesh dim 0, tp over mesh dim 1). A ``mask`` input stays replicated.
        **Local**."""
        params, batch = list(self.model.shapes), list(self.model.batch(0))
        k = mesh.ndim
        rep = (R,) * k

        def lay(param: Callable[[str], tuple], data: tuple) -> dict[str, tuple]:
            out = {n: param(n) for n in params}
            out.update({n: rep if n == "mask" else data for n in batch})
            return out

        out = {"replicated": lay(lambda n: rep, rep),
               "dp": lay(lambda n: rep, (dt.Shard(0),) * k)}
        tp = self.model.tp
        if tp is not None:
            out["tp"] = lay(lambda n: (tp[n],) * k, rep)
            if k == 2:
                out["2d"] = lay(lambda n: (R, tp[n]), (dt.Shard(0), R))
        return out

    def note(self) -> str | None:
        if self.model.tp is None:
            return ("tp and 2d not run: the model gives no tensor-parallel placements "
                    "(return (step_fn, params, inputs, tp))")
        return None


TRANSFORMER_SIZES = {"tiny": (2, 4, 16, 2, 32), "small": (4, 16, 64, 4, 256),
                     "medium": (8, 64, 128, 8, 1024)}  # batch, seq, dim, heads, vocab
MLP_SIZES = {"tiny": (8, 16, 32), "small": (64, 128, 512), "medium": (256, 512, 2048)}
SIZES = tuple(MLP_SIZES)

register_family("mlp", lambda size: FunctionalFamily(mlp_model(*MLP_SIZES[size])),
                "the two-layer MLP of the training examples (batch, dim, hidden: "
                + "; ".join(",".join(map(str, v)) for v in MLP_SIZES.values()) + ")")
register_family("transformer",
                lambda size: FunctionalFamily(transformer_model(*TRANSFORMER_SIZES[size])),
                "a transformer block of the training examples (batch, seq, dim, heads, "
                "vocab: " + "; ".join(",".join(map(str, v)) for v in TRANSFORMER_SIZES.values())
                + ")")


# -- users' models --------------------------------------------------------------------------------
def _arrays(what: str, spec: str, value: Any, floating: bool) -> dict[str, np.ndarray]:
    if not isinstance(value, Mapping) or not value:
        raise ModelSpecError(f"--model {spec}: {what} must be a non-empty dict of name -> "
                             f"numpy array, got {type(value).__name__}")
    out = {}
    for name, a in value.items():
        arr = np.asarray(a)
        if not isinstance(name, str) or arr.dtype == object:
            raise ModelSpecError(f"--model {spec}: {what}[{name!r}] must be a numpy array under "
                                 f"a str name, got {type(a).__name__}")
        if floating and not np.issubdtype(arr.dtype, np.floating):
            raise ModelSpecError(f"--model {spec}: parameter {name!r} has dtype {arr.dtype}; "
                                 "parameters are floating point (they get gradients)")
        if not floating and arr.ndim == 0:
            raise ModelSpecError(f"--model {spec}: input {name!r} is 0-d; inputs have a batch "
                                 "dim 0 (keep constants in step_fn's closure)")
        out[name] = arr
    return out


def load_user_model(spec: str, size: str = "small") -> TrainModel:
    """The model that ``package.module:function`` returns, checked against
    :data:`USER_MODEL_CONTRACT`. **Local** (the function runs on every rank alike).

    Raises
    ------
    ModelSpecError
        The module or function cannot be found, or what it returns breaks the contract
        (the message says which part).
    """
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise ModelSpecError(f"--model {spec!r}: expected package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelSpecError(f"--model {spec}: cannot import {module_name!r}: {e}") from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ModelSpecError(f"--model {spec}: {module_name} has no function {func_name!r}")
    try:
        takes_size = "size" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_size = False
    got = fn(size=size) if takes_size else fn()
    if not isinstance(got, (tuple, list)) or len(got) not in (3, 4):
        raise ModelSpecError(f"--model {spec}: {func_name}() must return (step_fn, params, "
                             f"inputs) or (step_fn, params, inputs, tp), got "
                             f"{type(got).__name__}\n\n{USER_MODEL_CONTRACT}")
    step_fn, params, inputs = got[:3]
    if not callable(step_fn):
        raise ModelSpecError(f"--model {spec}: step_fn must be callable, got "
                             f"{type(step_fn).__name__}")
    params = _arrays("params", spec, params, floating=True)
    inputs = _arrays("inputs", spec, inputs, floating=False)
    clash = sorted(set(params) & set(inputs))
    if clash:
        raise ModelSpecError(f"--model {spec}: names {clash} are both parameters and inputs")
    tp = None
    if len(got) == 4 and got[3] is not None:
        given = got[3]
        if not isinstance(given, Mapping):
            raise ModelSpecError(f"--model {spec}: tp must be a dict of parameter name -> "
                                 f"placement, got {type(given).__name__}")
        unknown = sorted(set(given) - set(params))
        if unknown:
            raise ModelSpecError(f"--model {spec}: tp names {unknown}, which are not "
                                 f"parameters ({', '.join(params)})")
        for name, p in given.items():
            if not isinstance(p, (dt.Shard, dt.Replicate)):
                raise ModelSpecError(f"--model {spec}: tp[{name!r}] = {p!r}; use dt.Shard(d) "
                                     "or dt.Replicate()")
        tp = {n: given.get(n, R) for n in params}

    def batch(step: int) -> dict[str, np.ndarray]:
        return {n: a.copy() for n, a in inputs.items()}

    return TrainModel(spec, {n: tuple(a.shape) for n, a in params.items()}, tp, batch,
                      step_fn, values=params)
