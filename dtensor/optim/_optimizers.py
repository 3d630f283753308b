"""The optimizers of :mod:`dtensor.optim` (the base class, SGD, Adam and AdamW; see the
package's docstring)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import fastpath as _fp
from placements.errors import ArgumentError

from ..distributed.dtensor import DTensor, distribute_tensor
from ..local.grad_engine import bump_version, enable_grad, no_grad, zero_grads
from ..local.tensor import Tensor

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]

_TENSORS = (Tensor, DTensor)
# the compiled Adam(W) update (one pass per parameter), or None (the tensor ops serve)
_KERNELS = _fp.kernels if _fp.ENABLED else None


class _Required:
    """The default of an option that has none (``lr`` of SGD in old PyTorch): must be given."""

    def __repr__(self) -> str:
        return "<required parameter>"


required = _Required()


class Optimizer:
    """Base class: parameter groups, per-parameter state, ``zero_grad`` and state dicts.

    Parameters
    ----------
    params : iterable of Tensor/DTensor, or of dicts
        The parameters, or parameter groups: dicts with ``"params"`` and any of the
        optimizer's options (the others take ``defaults``).
    defaults : mapping
        The optimizer's options and their defaults.
    """

    def __init__(self, params: Iterable[Any], defaults: Mapping[str, Any]) -> None:
        self.defaults = dict(defaults)
        #: Per-parameter state, keyed by the parameter (tensors hash by identity).
        self.state: dict[Any, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        if isinstance(params, _TENSORS):
            raise ArgumentError(
                f"{type(self).__name__}: params argument given to the optimizer should be an "
                f"iterable of Tensors or dicts, but got {type(params).__name__}"
            )
        groups = list(params)
        if not groups:
            raise ArgumentError(f"{type(self).__name__}: optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for group in groups:
            self.add_param_group(group)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params"]
        return "\n".join(lines) + "\n)"

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        """Add a group of parameters (a dict with ``"params"`` and options). **Local**."""
        name = type(self).__name__
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise ArgumentError(f"{name}: a parameter group is a dict with a 'params' entry")
        group = dict(param_group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, _TENSORS) else list(params)
        for p in group["params"]:
            if not isinstance(p, _TENSORS):
                raise ArgumentError(
                    f"{name}: can't optimize a non-tensor parameter of type {type(p).__name__}"
                )
            if not p.is_leaf:
                raise ArgumentError(f"{name}: can't optimize a non-leaf Tensor")
        for key, default in self.defaults.items():
            if default is required and key not in group:
                raise ArgumentError(f"{name}: parameter group didn't specify a value of {key}")
            group.setdefault(key, default)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in group["params"]) or len(
            {id(p) for p in group["params"]}
        ) != len(group["params"]):
            raise ArgumentError(f"{name}: some parameters appear in more than one parameter group")
        self._check_group(group)
        self.param_groups.append(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Validate a group's options (subclasses)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: to None (default), or to zeros in place. **Local**."""
        zero_grads(self._params(), set_to_none)

    def _params(self) -> list[Any]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, PyTorch's layout: per-parameter state under the
        parameters' indices (in group order), and the groups' options with those indices.
        The state's tensors are the optimizer's own (not copies). **Local**."""
        index = {id(p): i for i, p in enumerate(self._params())}
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        state = {index[id(p)]: dict(s) for p, s in self._state_items()}
        return {"state": state, "param_groups": groups}

    def _state_items(self) -> list[tuple[Any, dict[str, Any]]]:
        return [(p, self.state[p]) for p in self._params() if p in self.state]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict`: the groups' options, and the state of each
        parameter, copied into tensors laid out like the parameter (a saved local or
        DTensor state is taken as global values). **Local** for local tensors; for DTensor
        parameters it is **Collective** when a saved state tensor has other placements than
        the parameter (it is redistributed).

        Raises
        ------
        ArgumentError
            When the groups or their sizes differ from this optimizer's.
        """
        name = type(self).__name__
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ArgumentError(
                f"{name}.load_state_dict: loaded state dict has {len(groups)} parameter "
                f"groups; the optimizer has {len(self.param_groups)}"
            )
        for mine, saved in zip(self.param_groups, groups):
            if len(mine["params"]) != len(saved["params"]):
                raise ArgumentError(
                    f"{name}.load_state_dict: loaded state dict contains a parameter group "
                    f"of {len(saved['params'])} parameters that doesn't match the size of "
                    f"optimizer's group ({len(mine['params'])})"
                )
        by_index = {}
        for mine, saved in zip(self.param_groups, groups):
            for p, i in zip(mine["params"], saved["params"]):
                by_index[i] = p
        new_state: dict[Any, dict[str, Any]] = {}
        for i, entries in state_dict["state"].items():
            p = by_index.get(int(i))
            if p is None:
                continue
            new_state[p] = {k: _like(p, v) for k, v in entries.items()}
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.state = new_state

    @no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` (run
        with grad enabled) when given. **Local** on local parameters; on DTensor
        parameters every rank must call it (it runs the same ops on every shard), and it
        moves no data."""
        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group, self.state.setdefault(p, {}))
        return loss

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError


def _like(p: Any, value: Any) -> Any:
    """A loaded state value for parameter ``p``: tensors as new tensors laid out like ``p``
    (same dtype; on ``p``'s mesh with its placements for a DTensor parameter); a 0-d
    tensor (a step count) and python values as they are."""
    if not isinstance(value, _TENSORS):
        return value
    if value.ndim == 0 and tuple(p.shape) != ():
        return value.detach().clone()
    if isinstance(p, DTensor):
        if isinstance(value, DTensor):
            if value.device_mesh is p.device_mesh:
                value = value.redistribute(p.device_mesh, p.placements)
                return value.detach().clone().to(p.dtype)
            value = value.full_tensor()
        return distribute_tensor(value.numpy(), p.device_mesh, p.placements).to(p.dtype)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().clone().to(p.dtype)


def _check(name: str, what: str, value: float, low: float = 0.0, high: float | None = None):
    if not (value >= low) or (high is not None and not value < high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ArgumentError(f"{name}: invalid {what}: {value} (expected {bound})")


class SGD(Optimizer):
    """Stochastic gradient descent, PyTorch's ``torch.optim.SGD``.

    Per parameter, with ``g`` its gradient (``-g`` when ``maximize``)::

        g = g + weight_decay * p
        buf = g (first step) or momentum * buf + (1 - dampening) * g
        g = g + momentum * buf (nesterov) or buf      # when momentum != 0
        p = p - lr * g

    Parameters
    ----------
    params : iterable
        Parameters or parameter groups.
    lr : float
    momentum, dampening, weight_decay : float
    nesterov, maximize : bool
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov, "maximize": maximize}
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        _check("SGD", "learning rate", group["lr"])
        _check("SGD", "momentum value", group["momentum"])
        _check("SGD", "weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ArgumentError("SGD: Nesterov momentum requires a momentum and zero dampening")

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        g = -grad if group["maximize"] else grad
        wd, momentum = group["weight_decay"], group["momentum"]
        if wd != 0:
            g = g.add(p, alpha=wd)
        if momentum != 0:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1 - group["dampening"])
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        p.add_(g, alpha=-group["lr"])


class Adam(Optimizer):
    """Adam, PyTorch's ``torch.optim.Adam`` (``decoupled_weight_decay=True``: AdamW).

    Per parameter at step ``t``, with ``g`` its gradient (``-g`` when ``maximize``)::

        g = g + weight_decay * p                  # Adam (L2)
        p = p * (1 - lr * weight_decay)           # AdamW (decoupled)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)                     # amsgrad: v_max in place of v below
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The state holds ``step`` (a python int here; PyTorch keeps a 0-d tensor), ``exp_avg``,
    ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``.

    Without amsgrad, with the compiled extension enabled, a parameter whose data, gradient
    and moments are contiguous float32/float64 host arrays of one dtype (local Tensors, or
    DTensors of one spec without Partial) is updated in one compiled pass
    (``fastpath._kernels.adam_step``: the same arithmetic, element by element); the tensor
    ops serve every other parameter, and all with ``DTENSOR_FASTPATH=0``.

    Parameters
    ----------
    params : iterable
    lr : float
    betas : (float, float)
    eps, weight_decay : float
    amsgrad, maximize, decoupled_weight_decay : bool
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
    ) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "amsgrad": amsgrad, "maximize": maximize,
                    "decoupled_weight_decay": decoupled_weight_decay}
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        _check(name, "learning rate", group["lr"])
        _check(name, "epsilon value", group["eps"])
        _check(name, "beta parameter at index 0", group["betas"][0], 0.0, 1.0)
        _check(name, "beta parameter at index 1", group["betas"][1], 0.0, 1.0)
        _check(name, "weight_decay value", group["weight_decay"])

    def _update(self, p: Any, grad: Any, group: dict[str, Any], state: dict[str, Any]) -> None:
        g = -grad if group["maximize"] else grad
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = p.detach().clone().zero_()
            state["exp_avg_sq"] = p.detach().clone().zero_()
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = p.detach().clone().zero_()
        t = state["step"] = int(state["step"]) + 1  # a loaded 0-d tensor too
        if not group["amsgrad"] and _fused_adam(p, grad, state, group, t):
            return
        if wd != 0:
            if group["decoupled_weight_decay"]:
                p.mul_(1 - lr * wd)
            else:
                g = g.add(p, alpha=wd)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if group["amsgrad"]:
            vmax = state["max_exp_avg_sq"]
            vmax.copy_(vmax.maximum(v))
            v = vmax
        denom = v.sqrt().div_(math.sqrt(1 - beta2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))


def _local_arrays(p: Any, *others: Any) -> list | None:
    """The local arrays of ``p`` and ``others``: local Tensors, or DTensors of ``p``'s spec
    without a Partial placement (each rank's shard is then updated as the ops would update
    it); None otherwise."""
    if type(p) is Tensor:
        return [t._arr for t in (p, *others)] if all(type(t) is Tensor for t in others) else None
    if not isinstance(p, DTensor):
        return None
    spec = p._spec
    if any(pl.is_partial() for pl in spec.placements):
        return None
    if not all(isinstance(t, DTensor) and t._spec == spec for t in others):
        return None
    return [t._local._arr for t in (p, *others)]


def _fused_adam(p: Any, grad: Any, state: dict[str, Any], group: dict[str, Any],
                t: int) -> bool:
    """One Adam(W) step of ``p`` (step count ``t``) in one compiled pass over its (local)
    data, when the compiled extension is enabled and ``p``, its gradient and its moments are
    contiguous float32/float64 host arrays of one dtype and layout; False (nothing done)
    otherwise, and the ops of :meth:`Adam._update` serve. The same arithmetic in the same
    order, element by element (equal within float32 rounding). **Local**."""
    if _KERNELS is None:
        return False
    m, v = state["exp_avg"], state["exp_avg_sq"]
    arrays = _local_arrays(p, grad, m, v)
    if arrays is None:
        return False
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    decoupled = group["decoupled_weight_decay"]
    ok = _KERNELS.adam_step(
        *arrays, -1.0 if group["maximize"] else 1.0,
        0.0 if decoupled else wd, 1 - lr * wd if decoupled and wd != 0 else 1.0,
        beta1, beta2, lr / (1 - beta1**t), math.sqrt(1 - beta2**t), eps)
    if ok:
        for x in (p, m, v):
            bump_version(x._local if isinstance(x, DTensor) else x)
    return ok


class AdamW(Adam):
    """AdamW, PyTorch's ``torch.optim.AdamW``: :class:`Adam` with decoupled weight decay
    (default 0.01)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         decoupled_weight_decay=True)
