"""The op table: one record (:class:`OpInfo`) per op, and :func:`declare`, which makes one.

A record holds everything dtensor knows about an op, in one place:

- its name and local kernel, and how a call binds to the kernel's parameters (which take
  tensors, which are the decision-relevant static arguments, the defaults);
- its variants: the public function (``dt.<name>``), the Tensor/DTensor method, the
  in-place form (``name_``, a record of its own, made by :func:`declare`) and the python
  operators it serves;
- its sharding rule (registered under the op's name in :mod:`placements.rules`, by the
  rule family or by the record itself) with the static parameters the rule reads, and, for
  ops whose local computation depends on the chosen strategy, its ``local_fn``;
- the sample family the strategy validator draws its calls from;
- its backward formula (:class:`Backward`), or :data:`NOT_DIFFERENTIABLE`;
- its compute class (``cost``), which prices its local work in :func:`dtensor.auto_shard`.

The dispatcher (:mod:`dtensor.dispatch`) installs the methods, operators and functions of
every record and builds the propagation-cache key from its static parameters; the
validator and the debug tools read the same records. Nothing here runs at call time.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from placements.errors import SignatureError
from placements.rules import register_rule, rule_statics

from ..local.tensor import Tensor

__all__ = [
    "NOT_DIFFERENTIABLE",
    "OPS",
    "Backward",
    "OpInfo",
    "Operator",
    "add_record",
    "declare",
    "declare_method",
    "get_op",
]

_KIND = inspect.Parameter


@dataclass(frozen=True, slots=True)
class Operator:
    """One python operator an op serves.

    ``dunder`` is its name (``"__add__"``); ``form`` how a DTensor's operator calls the op
    (``"binary"``: ``op(self, other)``; ``"reflected"``: ``op(other, self)``;
    ``"compare"``: binary, NotImplemented for an operand that is not tensor-like;
    ``"unary"``: ``op(self)``); ``local`` the local Tensor's implementation (it returns
    NotImplemented for an operand type it does not take, so that python tries the other
    operand).
    """

    dunder: str
    form: str
    local: Callable


@dataclass(frozen=True, slots=True)
class Backward:
    """An op's backward formula (autograd), declared in its op record (the family modules of
    :mod:`dtensor.ops`).

    ``fn(g, v, out, need, fns)`` returns one gradient (or None) per tensor argument, in the
    order of the op's tensor parameters (a variadic parameter's elements one by one): ``g``
    is the output's gradient (with ``multi``: the list of every output's gradient, None for
    those that got none), ``v`` the call's bound arguments in parameter order, ``out`` the
    output (None unless ``out``), ``need`` which arguments need a gradient now (the formula
    may skip the others' work; one it gives anyway is kept where its argument requires grad:
    a split backward's input half takes a weight gradient that comes free so), ``fns`` the
    public dispatching functions (``fns.cat``, ``fns.zeros_like``...; the recorder passes
    them, :mod:`dtensor.dispatch.tape`). The formula is written with ordinary tensor ops
    (methods and ``fns``), so that on DTensors the sharding rules place the gradients; the
    recorder reduces each gradient to its argument's shape (broadcasting) and casts it to
    its dtype. ``save`` names the tensor parameters whose
    values the formula reads: the node keeps those (a backward after an in-place change to
    them raises) and, of every other argument that is an intermediate of the graph (has a
    ``grad_fn``), only a stand-in of its layout (shape, dtype, a DTensor's spec; no
    memory), which the formula may ask for its shape or build zeros like; leaves and
    tensors that require no grad (parameters, inputs, indices, masks) are kept as they are.
    ``rng``: the formula reads the random generator's state from before the call (given
    as ``out``), to draw the op's random numbers again (dropout's mask).
    ``fn`` None: the op is not differentiable (:data:`NOT_DIFFERENTIABLE`).
    """

    fn: Callable | None
    save: tuple[str, ...] = ()
    out: bool = False
    multi: bool = False
    rng: bool = False


#: The ``backward`` of an op whose outputs never require grad (comparisons, integer ops,
#: argmax...).
NOT_DIFFERENTIABLE = Backward(None)


@dataclass(frozen=True, slots=True, eq=False)
class OpInfo:
    """One op of the table.

    Attributes
    ----------
    name : str
        Public name (``"add"``, ``"sum"``, ``"matmul"``...); also the cache key's op id and
        the name of its sharding rule.
    kernel : callable
        The local kernel, called as ``kernel(*bound_values_in_params_order)`` with local
        Tensors in place of DTensors (python scalars passed through).
    params : tuple of str
        Parameter names in the kernel's positional order.
    tensor_params : tuple of str
        The parameters that may hold a tensor-like value (Tensor, DTensor, python scalar);
        they become ``OpSchema.args`` in this order. For a ``variadic`` parameter every
        element is one argument.
    static_params : tuple of str
        Decision-relevant non-tensor parameters (``OpSchema.static``, part of the cache key).
    defaults : mapping
        Default values of parameters that may be omitted.
    variadic : str or None
        Name of a parameter that holds a sequence of tensors (``cat``'s tensors, ``einsum``'s
        operands).
    local_fn : callable or None
        For ops whose local computation depends on the chosen strategy or on global metadata
        (``mean`` over a sharded dim is a local sum times 1/N_global): called once per cache
        entry as ``local_fn(schema, strategy)`` and returns the kernel to use for it.
    inplace : bool
        The op writes its first tensor argument (validated before any write).
    function : callable or None
        The public local function ``dt.<name>`` (PyTorch's signature); dtensor exports its
        dispatching twin. None: the op has no public function (a method only).
    method : callable or None
        The local Tensor method form (``self`` first). Installed on Tensor unless the class
        defines it; DTensor gets a dispatching method of the same name. None: no method.
    method_args : tuple of int or None
        Where the method's arguments go: the op's argument ``i`` is the method's argument
        ``method_args[i]`` (``self`` is argument 0). None: in order. ``x.where(cond, y)``
        is ``where(cond, x, y)``: ``(1, 0, 2)``.
    aliases : tuple of str
        Other method names of the op (``negative`` for ``neg``).
    operators : tuple of Operator
        The python operators the op serves.
    samples : str or None
        The strategy validator's sample family (``"unary"``, ``"reduce"``...); None: the
        validator has no samples for it.
    backward : Backward or None
        The backward formula (autograd); :data:`NOT_DIFFERENTIABLE` for an op whose outputs
        never require grad; None: no formula yet (recording it raises).
    cost : str
        The class of its local compute, whose measured throughput prices it
        (:func:`dtensor.autoshard._calibrate.op_class`): ``"matmul"`` (products),
        ``"nn"`` (reductions, scans, softmax, norms, losses), ``"view"`` (views and
        reorderings, a fixed cost) or ``"pointwise"`` (any other op that computes).
    raw : str or None
        The *raw form* that may serve a repeated call from compiled code, on the local
        ndarrays, when it gives exactly what the kernel would (decided once per cache
        entry by :func:`dtensor.dispatch.compiled.raw_form`, which implements each form
        once): ``"pointwise"`` (a local function with a ``spec``: its ufunc or array
        kernel), ``"view"`` (reshape to the local output shape), ``"t"``, ``"getitem"``
        (basic indexing), ``"copy"`` (clone/contiguous), ``"sum"``, ``"mean"``,
        ``"extreme"`` (amax/amin), ``"softmax"`` (over the last dim), ``"matmul"``. None:
        the kernel always runs.
    """

    name: str
    kernel: Callable
    params: tuple[str, ...]
    tensor_params: tuple[str, ...]
    static_params: tuple[str, ...] = ()
    defaults: Mapping[str, object] = field(default_factory=dict)
    variadic: str | None = None
    local_fn: Callable | None = None
    inplace: bool = False
    function: Callable | None = None
    method: Callable | None = None
    method_args: tuple[int, ...] | None = None
    aliases: tuple[str, ...] = ()
    operators: tuple[Operator, ...] = ()
    samples: str | None = None
    backward: Backward | None = None
    cost: str = "pointwise"
    raw: str | None = None

    @property
    def rule(self) -> str:
        """The name its sharding rule is registered under (the op's name)."""
        return self.name

    @property
    def quiet(self) -> bool:
        """Whether its kernel runs with numpy's floating-point errors ignored (PyTorch gives
        inf and nan without a warning): every op of dtensor's own that computes. Ops that
        only view or move data (sample families ``view``, ``expand_as``) need not, and a
        user's kernel (:func:`dtensor.register_op`, no sample family) keeps its warnings.
        """
        return self.samples is not None and self.samples not in MOVES_ONLY


#: Sample families of ops that only view or move data: numpy reports no floating-point error
#: in them, so they do not run quietly (:attr:`OpInfo.quiet`).
MOVES_ONLY = frozenset(("view", "expand_as"))


OPS: dict[str, OpInfo] = {}


def add_record(info: OpInfo) -> OpInfo:
    """Add ``info`` to the table (replacing a record of the same name). **Local**."""
    OPS[info.name] = info
    return info


def get_op(name: str) -> OpInfo:
    """The table entry of ``name``. **Local**."""
    return OPS[name]


def _adapter(fn: Callable, npos: int, kwonly: tuple[str, ...]) -> Callable:
    """``kernel(*values)`` calling ``fn(*values[:npos], **{kwonly: values[npos:]})``."""
    if len(kwonly) == 1:
        (name,) = kwonly

        def kernel1(*values):
            return fn(*values[:npos], **{name: values[npos]})

        kernel1.__name__ = kernel1.__qualname__ = getattr(fn, "__name__", "kernel")
        kernel1.quiet = getattr(fn, "quiet", False)  # quiet when fn is (see base.quiet_function)
        return kernel1

    def kernel(*values):
        return fn(*values[:npos], **dict(zip(kwonly, values[npos:])))

    kernel.__name__ = kernel.__qualname__ = getattr(fn, "__name__", "kernel")
    kernel.quiet = getattr(fn, "quiet", False)
    return kernel


def _signature(name: str, fn: Callable, variadic: str | None) -> tuple[tuple, dict, tuple]:
    """``(params, defaults, keyword-only params)`` of ``fn`` (``out`` dropped)."""
    params: list[str] = []
    defaults: dict[str, object] = {}
    kwonly: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "out":
            continue
        if p.kind == _KIND.VAR_POSITIONAL:
            if p.name != variadic:
                raise SignatureError(
                    f"op table: {name}'s *{p.name} needs params= (a hand-described signature)"
                )
        elif p.kind == _KIND.KEYWORD_ONLY:
            kwonly.append(p.name)
        params.append(p.name)
        if p.default is not p.empty:
            defaults[p.name] = p.default
    return tuple(params), defaults, tuple(kwonly)


def declare(
    name: str,
    fn: Callable,
    tensors: tuple[str, ...] = ("input",),
    *,
    rule: Callable | None = None,
    static: tuple[str, ...] = (),
    params: tuple[str, ...] | None = None,
    defaults: Mapping[str, object] | None = None,
    variadic: str | None = None,
    local_fn: Callable | None = None,
    function: bool = True,
    method: bool | Callable = True,
    method_args: tuple[int, ...] | None = None,
    writes: bool = False,
    aliases: tuple[str, ...] = (),
    operators: tuple[Operator, ...] = (),
    inplace: Callable | None = None,
    inplace_operators: tuple[Operator, ...] = (),
    samples: str | None = None,
    backward: Backward | None = None,
    cost: str = "pointwise",
    raw: str | None = None,
) -> OpInfo:
    """Declare op ``name`` (and its in-place form) in the table. **Local**.

    Parameters
    ----------
    name : str
        The op's name (its rule is registered under it).
    fn : callable
        The local function. Its signature gives the parameters and defaults (keyword-only
        parameters are passed by an adapter; ``out`` is not a parameter), unless ``params``
        describes a kernel that takes ``*args`` (``Tensor.view(*shape)``...).
    tensors : tuple of str
        The tensor-like parameters.
    rule : callable, optional
        The op's sharding rule (a pure function of metadata, see :mod:`placements.rules`),
        registered under ``name`` (and ``name_``). Without it the rule registered under
        ``name`` in :mod:`placements.rules` serves.
    static : tuple of str
        With ``rule``: the decision-relevant static parameters it reads (declared with the
        rule, they form the propagation-cache key). Otherwise they come from the rule's
        registration (:func:`placements.rules.rule_statics`).
    params, defaults : optional
        A hand-described signature: the kernel is then called with the values in
        ``params`` order.
    variadic, local_fn :
        As in :class:`OpInfo`.
    function : bool
        Export ``dt.<name>`` (``fn`` is the local function).
    method : bool or callable
        Give Tensor and DTensor a method ``name``: True uses ``fn`` as the Tensor method
        (or the one the Tensor class defines), a callable is the Tensor method form.
    method_args :
        As in :class:`OpInfo`.
    writes : bool
        The op itself writes its first argument (``copy_``, ``fill_``).
    aliases, operators, samples, backward, cost :
        As in :class:`OpInfo`.
    raw : str, optional
        As in :class:`OpInfo`; by default ``"pointwise"`` for a local function that
        carries an elementwise ``spec`` (its short path), else None. The in-place form has
        none. The in-place form records with ``backward`` too (the
        recorder keeps a copy of the input when the formula reads it).
    inplace : callable, optional
        The in-place kernel (``fn``'s signature, writes its first argument): declares the op
        ``name_`` as a method, with the same tensors, statics and samples.
    inplace_operators : tuple of Operator
        The operators of the in-place form (``__iadd__``...).
    """
    names = (name, name + "_") if inplace is not None else (name,)
    if rule is not None:
        register_rule(*names, static=static)(rule)
    static = rule_statics(name)
    if params is None:
        params, sig_defaults, kwonly = _signature(name, fn, variadic)
        kernel = _adapter(fn, len(params) - len(kwonly), kwonly) if kwonly else fn
    else:
        sig_defaults, kernel, kwonly = {}, fn, ()
    info = OpInfo(
        name,
        kernel,
        tuple(params),
        tuple(tensors),
        tuple(static),
        dict(sig_defaults if defaults is None else defaults),
        variadic,
        local_fn,
        writes,
        fn if function else None,
        (fn if method is True else method) or None,
        method_args,
        tuple(aliases),
        tuple(operators),
        samples,
        backward,
        cost,
        raw if raw is not None or not function or getattr(fn, "spec", None) is None
        else "pointwise",
    )
    add_record(info)
    if inplace is not None:
        add_record(
            replace(
                info,
                name=name + "_",
                kernel=_adapter(inplace, len(params) - len(kwonly), kwonly) if kwonly else inplace,
                local_fn=None,
                inplace=True,
                function=None,
                method=inplace,
                method_args=None,
                aliases=(),
                operators=tuple(inplace_operators),
                raw=None,
            )
        )
    return info


def declare_method(
    name: str,
    params: tuple[str, ...] = ("input",),
    tensors: tuple[str, ...] = ("input",),
    kernel: Callable | None = None,
    **kw: object,
) -> OpInfo:
    """Declare op ``name`` whose kernel is a method the Tensor class defines (``view``,
    ``clone``, ``to``...; ``kernel`` overrides it): no public function, a hand-described
    signature ``params``; other arguments as for :func:`declare`. **Local**."""
    return declare(name, kernel or getattr(Tensor, name), tensors, params=params,
                   function=False, **kw)
