"""``dt.optim.lr_scheduler``: learning-rate schedulers with PyTorch's names and semantics.

A scheduler adjusts the ``"lr"`` of each of its optimizer's parameter groups. As in
PyTorch 2.x: construction (with ``last_epoch=-1``) sets ``"initial_lr"`` in every group
(kept when present) and takes it as :attr:`LRScheduler.base_lrs`, then makes the initial
step (epoch 0); :meth:`LRScheduler.step` is called once per iteration, after the
optimizer's ``step()``; :meth:`LRScheduler.get_last_lr` gives the learning rates it last
set. The schedules use PyTorch's recursive (chainable) forms, so their values match
``torch.optim.lr_scheduler`` step by step, float for float.

:class:`LambdaLR`, :class:`StepLR`, :class:`ExponentialLR`, :class:`LinearLR`,
:class:`CosineAnnealingLR` and :class:`SequentialLR` (which runs schedulers one after the
other: the warmup-then-cosine recipe is ``SequentialLR(opt, [LinearLR(...),
CosineAnnealingLR(...)], milestones=[warmup])``). ``state_dict()`` holds every attribute
but the optimizer (LambdaLR saves its lambdas only when they are callable objects, as
their ``__dict__``; SequentialLR saves its schedulers' state dicts).

Every method is **Local**: learning rates are python floats, the same on every rank when
every rank makes the same calls.
"""

from __future__ import annotations

import math
import types
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from placements.errors import ArgumentError, DTypeError

from ._optimizers import Optimizer

__all__ = [
    "CosineAnnealingLR",
    "ExponentialLR",
    "LRScheduler",
    "LambdaLR",
    "LinearLR",
    "SequentialLR",
    "StepLR",
]


def _lrs(optimizer: Optimizer) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


class LRScheduler:
    """Base class of the schedulers: subclasses compute the next learning rates in
    :meth:`get_lr` (and, optionally, the closed form at :attr:`last_epoch` in
    ``_get_closed_form_lr``).

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer whose groups' ``"lr"`` it sets.
    last_epoch : int
        The index of the last epoch: ``-1`` (default) starts the schedule; another value
        resumes it, and needs ``"initial_lr"`` in every group.

    Raises
    ------
    DTypeError
        When ``optimizer`` is not a :class:`dtensor.optim.Optimizer`.
    ArgumentError
        When resuming (``last_epoch != -1``) and a group has no ``"initial_lr"``.
    """

    _is_initial: bool = False

    def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
        if not isinstance(optimizer, Optimizer):
            raise DTypeError(f"{type(optimizer).__name__} is not an Optimizer")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if "initial_lr" not in group:
                    raise ArgumentError(
                        f"{type(self).__name__}: param 'initial_lr' is not specified in "
                        f"param_groups[{i}] when resuming scheduler with last_epoch "
                        f"{last_epoch} >= 0"
                    )
        #: The groups' ``"initial_lr"``: the learning rates the schedule starts from.
        self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
        #: The index of the last epoch (step) the scheduler made.
        self.last_epoch = last_epoch
        self._initial_step()

    def _initial_step(self) -> None:
        """Reset the step count and make the initial step."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer. **Local**."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (load the optimizer's state too). **Local**."""
        self.__dict__.update(state_dict)

    def get_last_lr(self) -> list[float]:
        """The learning rates the scheduler last set, one per parameter group. **Local**."""
        return self._last_lr

    def get_lr(self) -> list[float]:
        """The learning rates of the next step, one per group (the scheduler's rule; use
        :meth:`get_last_lr` for the current ones). **Local**."""
        raise NotImplementedError

    def step(self) -> None:
        """Advance the schedule by one step and set the groups' ``"lr"``; call it after
        the optimizer's ``step()``. **Local**."""
        self._step_count += 1
        self._update_lr()

    def _update_lr(self, epoch: int | None = None) -> None:
        """Move to the next epoch (``get_lr``) or to ``epoch`` (the closed form when the
        scheduler has one), and set the groups' learning rates."""
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values, strict=True):
            group["lr"] = lr
        self._last_lr: list[float] = _lrs(self.optimizer)


class LambdaLR(LRScheduler):
    """Each group's learning rate is its initial one times ``lr_lambda(epoch)``, PyTorch's
    ``torch.optim.lr_scheduler.LambdaLR``.

    Parameters
    ----------
    optimizer : Optimizer
    lr_lambda : callable or list of callables
        A function of the epoch (an int) giving the factor, or one per parameter group.
    last_epoch : int

    Raises
    ------
    ArgumentError
        When a list of lambdas does not have one per parameter group.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
        last_epoch: int = -1,
    ) -> None:
        self.optimizer = optimizer
        n = len(optimizer.param_groups)
        if not isinstance(lr_lambda, (list, tuple)):
            self.lr_lambdas = [lr_lambda] * n
        else:
            if len(lr_lambda) != n:
                raise ArgumentError(
                    f"LambdaLR: expected {n} lr_lambdas (one per parameter group), "
                    f"but got {len(lr_lambda)}"
                )
            self.lr_lambdas = list(lr_lambda)
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer; a lambda is saved
        (as its ``__dict__``) only when it is a callable object, not a function or a
        lambda (``None`` in its place). **Local**."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [
            None if isinstance(fn, types.FunctionType) else fn.__dict__.copy()
            for fn in self.lr_lambdas
        ]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`; a saved callable object's attributes are
        restored into this scheduler's one. ``state_dict`` is left as it was. **Local**."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
        for idx, fn in enumerate(state_dict["lr_lambdas"]):
            if fn is not None:
                self.lr_lambdas[idx].__dict__.update(fn)

    def get_lr(self) -> list[float]:
        """Each initial learning rate times its lambda at :attr:`last_epoch`. **Local**."""
        return [
            base_lr * lmbda(self.last_epoch)
            for lmbda, base_lr in zip(self.lr_lambdas, self.base_lrs, strict=True)
        ]


class StepLR(LRScheduler):
    """Multiply the learning rates by ``gamma`` every ``step_size`` epochs, PyTorch's
    ``torch.optim.lr_scheduler.StepLR``.

    Parameters
    ----------
    optimizer : Optimizer
    step_size : int
        The period of the decay, in epochs.
    gamma : float
        The factor of the decay (default 0.1).
    last_epoch : int
    """

    def __init__(
        self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1
    ) -> None:
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current learning rates, times ``gamma`` when :attr:`last_epoch` is a nonzero
        multiple of ``step_size``. **Local**."""
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return _lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        return [
            base_lr * self.gamma ** (self.last_epoch // self.step_size)
            for base_lr in self.base_lrs
        ]


class ExponentialLR(LRScheduler):
    """Multiply the learning rates by ``gamma`` every epoch, PyTorch's
    ``torch.optim.lr_scheduler.ExponentialLR``.

    Parameters
    ----------
    optimizer : Optimizer
    gamma : float
        The factor of the decay.
    last_epoch : int
    """

    def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1) -> None:
        self.gamma = gamma
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The current learning rates times ``gamma`` (unchanged at the initial step).
        **Local**."""
        if self._is_initial:
            return _lrs(self.optimizer)
        return [group["lr"] * self.gamma for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        return [base_lr * self.gamma**self.last_epoch for base_lr in self.base_lrs]


class LinearLR(LRScheduler):
    """Scale the learning rates by a factor going linearly from ``start_factor`` to
    ``end_factor`` over ``total_iters`` epochs (then kept), PyTorch's
    ``torch.optim.lr_scheduler.LinearLR`` (the usual warmup).

    Parameters
    ----------
    optimizer : Optimizer
    start_factor : float
        The factor at epoch 0, in ``(0, 1]`` (default 1/3).
    end_factor : float
        The factor from epoch ``total_iters`` on, in ``[0, 1]`` (default 1).
    total_iters : int
        The number of epochs the factor takes to get to ``end_factor`` (default 5).
    last_epoch : int

    Raises
    ------
    ArgumentError
        When a factor is out of its range.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        total_iters: int = 5,
        last_epoch: int = -1,
    ) -> None:
        if start_factor > 1.0 or start_factor <= 0:
            raise ArgumentError(
                "LinearLR: starting multiplicative factor expected to be greater than 0 and "
                f"less or equal to 1, but got start_factor={start_factor}"
            )
        if end_factor > 1.0 or end_factor < 0:
            raise ArgumentError(
                "LinearLR: ending multiplicative factor expected to be between 0 and 1, "
                f"but got end_factor={end_factor}"
            )
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = total_iters
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The next learning rates: the current ones times ``start_factor`` at epoch 0,
        then times the ratio of successive factors up to ``total_iters``. **Local**."""
        if self.last_epoch == 0:
            return [group["lr"] * self.start_factor for group in self.optimizer.param_groups]
        if self._is_initial or self.last_epoch > self.total_iters:
            return _lrs(self.optimizer)
        delta = self.end_factor - self.start_factor
        ratio = 1.0 + delta / (self.total_iters * self.start_factor
                               + (self.last_epoch - 1) * delta)
        return [group["lr"] * ratio for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        factor = self.start_factor + (self.end_factor - self.start_factor) * min(
            self.total_iters, self.last_epoch) / self.total_iters
        return [base_lr * factor for base_lr in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """Anneal the learning rates from their initial values to ``eta_min`` along a half
    cosine over ``T_max`` epochs, PyTorch's ``torch.optim.lr_scheduler.CosineAnnealingLR``:
    approximately ``eta_min + (base_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2``,
    computed in PyTorch's recursive form (so past ``T_max`` the rates rise again, a
    period of ``2 * T_max``).

    Parameters
    ----------
    optimizer : Optimizer
    T_max : int
        The number of epochs of the half period.
    eta_min : float
        The smallest learning rate (default 0).
    last_epoch : int
    """

    def __init__(
        self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1
    ) -> None:
        self.T_max = T_max
        self.eta_min = eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        """The next learning rates, from the current ones (PyTorch's recursion). **Local**."""
        groups = self.optimizer.param_groups
        if self._is_initial:
            return _lrs(self.optimizer)
        if self._step_count == 1 and self.last_epoch > 0:
            return [
                self.eta_min + (base_lr - self.eta_min)
                * (1 + math.cos(self.last_epoch * math.pi / self.T_max)) / 2
                for base_lr in self.base_lrs
            ]
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:
            return [
                group["lr"] + (base_lr - self.eta_min) * (1 - math.cos(math.pi / self.T_max)) / 2
                for base_lr, group in zip(self.base_lrs, groups, strict=True)
            ]
        return [
            (1 + math.cos(math.pi * self.last_epoch / self.T_max))
            / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max))
            * (group["lr"] - self.eta_min) + self.eta_min
            for group in groups
        ]

    def _get_closed_form_lr(self) -> list[float]:
        return [
            self.eta_min + (base_lr - self.eta_min)
            * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
            for base_lr in self.base_lrs
        ]


class SequentialLR(LRScheduler):
    """Run schedulers one after the other, switching at the milestones, PyTorch's
    ``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[i]`` runs from epoch
    ``milestones[i - 1]`` on (starting its own schedule, epoch 0, there).

    Construction resets the groups' ``"lr"`` to their ``"initial_lr"``, undoes the initial
    step of each scheduler and makes the first scheduler's one.

    Parameters
    ----------
    optimizer : Optimizer
        The optimizer of every scheduler.
    schedulers : list of LRScheduler
    milestones : list of int
        The epochs at which the next scheduler takes over, one fewer than the schedulers.
    last_epoch : int

    Raises
    ------
    ArgumentError
        When there is no scheduler, a scheduler belongs to another optimizer, or the number
        of milestones is not one fewer than the number of schedulers.
    DTypeError
        When a scheduler has no ``optimizer`` attribute.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedulers: Sequence[LRScheduler],
        milestones: Sequence[int],
        last_epoch: int = -1,
    ) -> None:
        name = type(self).__name__
        if len(schedulers) < 1:
            raise ArgumentError(f"{name} expects at least one scheduler, but got no scheduler")
        for idx, scheduler in enumerate(schedulers):
            if not hasattr(scheduler, "optimizer"):
                raise DTypeError(
                    f"{name}: the scheduler at index {idx} ({type(scheduler).__name__}) "
                    "should have `optimizer` as its attribute"
                )
            if scheduler.optimizer is not optimizer:
                raise ArgumentError(
                    f"{name} expects all schedulers to belong to the same optimizer, but got "
                    f"scheduler {type(scheduler).__name__} at index {idx} with "
                    f"{type(scheduler.optimizer).__name__} object at "
                    f"{id(scheduler.optimizer):#x}, which is different from the "
                    f"{type(optimizer).__name__} object at {id(optimizer):#x}"
                )
        if len(milestones) != len(schedulers) - 1:
            raise ArgumentError(
                f"{name} expects number of schedulers provided to be one more than the number "
                f"of milestone points, but got number of schedulers {len(schedulers)} and the "
                f"number of milestones to be equal to {len(milestones)}"
            )
        self._schedulers = list(schedulers)
        self._milestones = list(milestones)
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"]
        self._undo(self)
        idx = bisect_right(self._milestones, 0)
        self._schedulers[idx]._initial_step()
        self._last_lr = self._schedulers[idx].get_last_lr()

    def _undo(self, sched: Any) -> None:
        """Undo the initial step of the schedulers (recursively, into nested ones)."""
        if hasattr(sched, "_schedulers"):
            for s in sched._schedulers:
                self._undo(s)
        elif hasattr(sched, "last_epoch"):
            sched.last_epoch -= 1

    def step(self) -> None:
        """Advance by one step: the scheduler of the new epoch steps (or starts its
        schedule, at its milestone). **Local**."""
        self.last_epoch += 1
        idx = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[idx]
        if idx > 0 and self._milestones[idx - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the optimizer, with the schedulers'
        state dicts under ``"_schedulers"``. **Local**."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, the schedulers' ones into this scheduler's
        schedulers. ``state_dict`` is left as it was. **Local**."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "_schedulers"})
        for scheduler, state in zip(self._schedulers, state_dict["_schedulers"], strict=True):
            scheduler.load_state_dict(state)
