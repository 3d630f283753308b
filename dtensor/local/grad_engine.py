"""The autograd engine: per-tensor autograd state, grad mode, backward nodes, version
counters and the reverse-mode walk.

It knows no op and no mesh: it works on any tensor class whose instances have an ``_ag``
slot (None for a tensor without autograd state: most tensors) and support ``+`` and
``_autograd_ones()``. :mod:`dtensor.dispatch` records nodes for the ops of the table (the
backward formulas are in the op records); :mod:`dtensor.distributed` records
``redistribute``, ``from_local`` and ``to_local`` and plugs in how a DTensor leaf's
gradient is laid out (:func:`set_leaf_layout`); :mod:`dtensor.autograd` records the calls
of custom Functions (:class:`FunctionNode`) and :mod:`dtensor.utils` checkpointed calls,
whose recomputation collects the gradients of the leaves it reaches
(``run_backward(leaves=)``).

The graph, as in PyTorch: a tensor that requires grad holds an :class:`AutogradMeta`; a
leaf's accumulates ``.grad``, a non-leaf's points at the :class:`Node` that made it
(``grad_fn``) and which of its outputs it is. A node holds its formula, what the formula
needs (the op's bound arguments, of the tensors only those the formula reads and stand-ins
of the others' layout; its output when the formula reads it) and one edge per
input: the input's meta (which names the input's node and output index, or is a leaf's),
None for an input that needs no gradient. :func:`run_backward` counts the dependencies of every node reachable from the roots,
then runs each node once all gradients that reach it have been summed.

Saved tensors are checked against version counters: every in-place op bumps the version of
the memory it writes (:func:`bump_version`, keyed by the array that owns the memory, so
every view of it shares one counter); a node records the versions of what it saves and a
backward through it after a change raises, as in PyTorch.

On the compiled path the autograd state and the nodes' attributes are compiled classes
(``fastpath.dispatch.AutogradMeta`` and ``NodeBase``, with the same attributes and
constructors as the Python ones here), which the compiled recorder makes without running
Python code; a compiled node stops counting its saved tensors' versions as it goes.

Zero-bubble pipelines split a backward in two (:func:`backward_input`, then
:meth:`WeightWork.run`): the input half walks only the nodes that lead to the stage input,
running the formulas of those with weight edges for their input edges only (the ``need``
mask, :func:`needed`), and the weight half runs the rest once; see the section below.

While :func:`run_backward` walks the graph, :func:`in_backward` is true and
:func:`current_backward` names the op whose node runs (its formula, the summing of the
gradients it produces and their accumulation into leaves): the debug tools attribute the
collectives of backward to that op.

Process-wide switch: autograd is *active* from the first time a tensor requires grad
(:func:`activate`); until then the installed variants do not look at it at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import fastpath as _fp
from placements.errors import AutogradError
from placements.meta import dtype_kind

from .tensor import Tensor

__all__ = [
    "AutogradMeta",
    "FunctionNode",
    "Node",
    "WeightWork",
    "activate",
    "backward",
    "backward_input",
    "bump_version",
    "current_backward",
    "edge_of",
    "enable_grad",
    "grad",
    "in_backward",
    "install_api",
    "is_active",
    "is_grad_enabled",
    "make_leaf",
    "needed",
    "no_grad",
    "on_activate",
    "owner",
    "queue_callback",
    "record",
    "run_backward",
    "save",
    "set_grad_enabled",
    "set_leaf_layout",
    "unsave",
    "version_of",
    "zero_grads",
]


# -- grad mode ----------------------------------------------------------------------------------
class _Mode:
    """Whether ops record (``enabled``); read on every recorded variant's call (the
    compiled twin, ``fastpath.dispatch.GradMode``, is read by the compiled front too)."""

    __slots__ = ("enabled",)

    def __init__(self) -> None:
        self.enabled = True


MODE = _fp.dispatch.GradMode() if _fp.ENABLED else _Mode()


def is_grad_enabled() -> bool:
    """Whether ops record backward nodes now (PyTorch's ``torch.is_grad_enabled``). **Local**."""
    return MODE.enabled


class set_grad_enabled:
    """Turn recording on or off: a function call, a context manager or a decorator
    (``torch.set_grad_enabled``). **Local**. Grad mode is per process (not per thread)."""

    def __init__(self, mode: bool = False) -> None:
        self.prev = MODE.enabled
        self.mode = bool(mode)
        MODE.enabled = self.mode

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        MODE.enabled = self.prev

    def __call__(self, fn: Callable) -> Callable:
        mode = self.mode
        MODE.enabled = self.prev  # used as a decorator: the mode applies inside fn only

        def wrapped(*args, **kwargs):
            prev = MODE.enabled
            MODE.enabled = mode
            try:
                return fn(*args, **kwargs)
            finally:
                MODE.enabled = prev

        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        wrapped.__doc__ = getattr(fn, "__doc__", None)
        return wrapped


class no_grad(set_grad_enabled):
    """``with dt.no_grad():`` ops inside record nothing (also a decorator). **Local**."""

    def __init__(self) -> None:
        self.prev = MODE.enabled
        self.mode = False

    def __enter__(self) -> None:
        self.prev = MODE.enabled
        MODE.enabled = False

    def __call__(self, fn: Callable) -> Callable:
        return set_grad_enabled.__call__(self, fn)


class enable_grad(set_grad_enabled):
    """``with dt.enable_grad():`` recording on inside a ``no_grad`` block (also a
    decorator). **Local**."""

    def __init__(self) -> None:
        self.prev = MODE.enabled
        self.mode = True

    def __enter__(self) -> None:
        self.prev = MODE.enabled
        MODE.enabled = True

    def __call__(self, fn: Callable) -> Callable:
        return set_grad_enabled.__call__(self, fn)


# -- activation ---------------------------------------------------------------------------------
_ACTIVE = False
_ON_ACTIVATE: list[Callable[[], None]] = []


def on_activate(fn: Callable[[], None]) -> None:
    """Call ``fn()`` once when autograd becomes active (at once if it is). **Local**."""
    _ON_ACTIVATE.append(fn)
    if _ACTIVE:
        fn()


def is_active() -> bool:
    """Whether autograd is active (a tensor has required grad since the start). **Local**."""
    return _ACTIVE


def activate() -> None:
    """Make autograd active (the first time a tensor requires grad). **Local**."""
    global _ACTIVE
    if not _ACTIVE:
        _ACTIVE = True
        for fn in _ON_ACTIVATE:
            fn()


# -- per-tensor state -----------------------------------------------------------------------------
class _AutogradMeta:
    """The autograd state of one tensor (its ``_ag`` slot).

    ``requires_grad``; ``grad`` (a leaf's accumulated gradient); ``grad_fn`` (the node that
    made a non-leaf, None for a leaf) and ``output_nr`` (which of its outputs);
    ``layout`` (for a DTensor leaf: its spec, the layout its gradient gets; None
    otherwise); ``view`` (for a view made by recorded view ops: how it derives from its
    base, which an in-place write through the view rewrites (see
    :mod:`dtensor.dispatch.tape`); None otherwise).
    """

    __slots__ = ("grad", "grad_fn", "layout", "output_nr", "requires_grad", "view")

    def __init__(self, requires_grad: bool = True, grad_fn: Node | None = None,
                 output_nr: int = 0, layout: object = None) -> None:
        self.requires_grad = requires_grad
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.layout = layout
        self.view = None


#: The autograd state's class: the compiled one (the same attributes and constructor, which
#: the compiled recorder makes without running Python code) when the extension is used.
AutogradMeta = _fp.dispatch.AutogradMeta if _fp.ENABLED else _AutogradMeta


def make_leaf(t: object, requires_grad: bool, layout: object = None) -> None:
    """Set ``t.requires_grad`` (``requires_grad_``): a leaf's state, kept with its ``.grad``.
    **Local**."""
    meta = t._ag
    if meta is None:
        if requires_grad:
            activate()
            t._ag = AutogradMeta(True, None, 0, layout)
        return
    meta.requires_grad = bool(requires_grad)


# -- version counters -------------------------------------------------------------------------------
# Versions of the memory of saved tensors, keyed by id() of the array that owns the memory:
# [version, number of saved references]. A saved reference keeps the array alive, so the id
# is not reused while it is counted here.
_VERSIONS: dict[int, list] = {}


def owner(t: object) -> object:
    """The array owning ``t``'s memory (a Tensor's or a DTensor's local tensor's): views
    of one memory have one owner. **Local**."""
    arr = t._arr if type(t) is Tensor else t._local._arr
    base = arr.base
    return arr if base is None else base


def version_of(t: object) -> int:
    """The version counter of ``t``'s memory (0 until an in-place op writes it while a
    saved tensor is counted). **Local**."""
    e = _VERSIONS.get(id(owner(t)))
    return 0 if e is None else e[0]


def bump_version(t: object) -> None:
    """Count an in-place write to ``t``'s memory (called by every in-place op while autograd
    is active). **Local**."""
    if _VERSIONS:
        e = _VERSIONS.get(id(owner(t)))
        if e is not None:
            e[0] += 1


def _check(saved: tuple, node: Node) -> None:
    """Raise when the memory of a saved tensor (an entry of ``node.saved``: see
    :func:`save`) was written in place since it was saved."""
    key, version, name, t, _ = saved
    now = _VERSIONS[key][0]
    if now != version:
        raise AutogradError(
            f"{node.op}: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation: the {name} of shape {tuple(t.shape)}, "
            f"saved by {node.name()}, is at version {now}; expected version "
            f"{version} instead. Hint: clone() it before the in-place op, or do the "
            "in-place op after backward."
        )


def _py_unsave(saved: Sequence) -> None:
    """Stop counting the saved references ``saved`` (their node goes or is released)."""
    versions = _VERSIONS
    for s in saved:
        key = s[0]
        e = versions.get(key)
        if e is not None:
            e[1] -= 1
            if e[1] <= 0:
                del versions[key]


#: Stop counting saved entries (of :func:`save`): their node goes or is released, or the
#: node that would hold them is not made. **Local**. The compiled twin on the compiled path
#: (compiled nodes call it as they go).
unsave = _fp.dispatch.unsave if _fp.ENABLED else _py_unsave
if _fp.ENABLED:
    _fp.dispatch.set_versions(_VERSIONS)


# -- nodes ------------------------------------------------------------------------------------------
def _camel(op: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in op.strip("_").split("_")) or "Op"


class _NodeBase:
    """The attributes and constructor of a backward node (:class:`Node`); on the compiled
    path ``fastpath.dispatch.NodeBase``, whose nodes the compiled recorder makes without
    running Python code."""

    __slots__ = ("__weakref__", "ctx", "edges", "formula", "n_outputs", "op", "out",
                 "released", "saved")

    def __init__(self, op: str, formula: Callable, edges: Sequence, ctx: object,
                 out: object = None, n_outputs: int = 1, saved: Sequence = ()) -> None:
        self.op = op
        self.formula = formula
        self.edges = edges
        self.ctx = ctx
        self.out = out
        self.n_outputs = n_outputs
        self.saved = saved
        self.released = False


class Node(_fp.dispatch.NodeBase if _fp.ENABLED else _NodeBase):
    """One backward node (``grad_fn``): the formula of one recorded op call.

    ``op`` the op's name; ``formula(node, grads)`` returns one gradient (or None) per
    edge; ``edges`` one per input: its AutogradMeta (of a leaf, or naming the node and
    output that made it), None where the input needs no gradient; ``ctx`` what the
    formula reads (the bound arguments, ...), ``out`` the saved output (when the formula
    reads it), ``n_outputs`` the number of outputs; ``saved`` the version records of what
    it saves.
    """

    __slots__ = ()

    def name(self) -> str:
        """PyTorch's node name: ``AddBackward0``, ``MatmulBackward0``..."""
        return f"{_camel(self.op)}Backward0"

    @property
    def next_functions(self) -> tuple:
        """``((node or None, output_nr), ...)``, one per edge (a leaf's is its
        AccumulateGrad stand-in, the leaf's :class:`AutogradMeta`)."""
        return tuple((None, 0) if m is None else
                     (m, 0) if m.grad_fn is None else (m.grad_fn, m.output_nr)
                     for m in self.edges)

    def release(self) -> None:
        """Free what the formula reads (after a backward without ``retain_graph``)."""
        saved = self.saved
        if saved:
            self.saved = ()
            unsave(saved)
        self.ctx = self.out = None
        self.released = True

    def apply(self, grads: list) -> Sequence:
        if self.released:
            raise AutogradError(
                f"{self.op}: Trying to backward through the graph a second time (or directly "
                "access saved tensors after they have already been freed). Saved "
                "intermediate values of the graph are freed when you call .backward() or "
                "autograd.grad(). Specify retain_graph=True if you need to backward through "
                f"the graph a second time (node {self.name()})."
            )
        for s in self.saved:
            _check(s, self)
        return self.formula(self, grads)

    def __repr__(self) -> str:
        return f"<{self.name()}>"


if _fp.ENABLED:
    _SavingNode = Node  # (a compiled node stops counting its saved entries as it goes)
else:
    class _SavingNode(Node):
        """A node that saves tensors (:func:`record` makes one when ``saved`` is not
        empty): going, it stops counting their versions (a node without saves has no
        finalizer)."""

        __slots__ = ()

        def __del__(self) -> None:
            saved = self.saved
            if saved:
                unsave(saved)


class FunctionNode(_SavingNode):
    """The node of a call of a custom ``dt.autograd.Function`` (``op`` is the class name):
    named as PyTorch names it, ``ExpBackward`` for a Function ``Exp``."""

    __slots__ = ()

    def name(self) -> str:
        return f"{self.op}Backward"


# -- leaf layout (DTensor leaves) -----------------------------------------------------------------
_LEAF_LAYOUT: Callable | None = None


def set_leaf_layout(fn: Callable[[object, object], object]) -> None:
    """Plug in ``fn(grad, layout)``: a leaf's gradient laid out as its ``meta.layout`` says
    (a DTensor's spec: the gradient is redistributed to the leaf's placements). **Local**."""
    global _LEAF_LAYOUT
    _LEAF_LAYOUT = fn


def _for_leaf(g: object, meta: AutogradMeta) -> object:
    if meta.layout is not None and _LEAF_LAYOUT is not None:
        return _LEAF_LAYOUT(g, meta.layout)
    return g


# Post-accumulate-grad hooks, keyed by id() of a leaf's AutogradMeta: [weakref to the
# leaf, {handle id: hook}] (the compiled AutogradMeta has no room for them; the entry keeps
# the meta alive, so its id is not reused while hooks are registered).
_POST_ACC: dict[int, list] = {}
_HOOK_IDS = iter(range(1, 1 << 62))


class _HookHandle:
    """What ``register_post_accumulate_grad_hook`` returns: ``remove()`` unregisters."""

    __slots__ = ("key", "n")

    def __init__(self, key: int, n: int) -> None:
        self.key, self.n = key, n

    def remove(self) -> None:
        entry = _POST_ACC.get(self.key)
        if entry is not None:
            entry[2].pop(self.n, None)
            if not entry[2]:
                del _POST_ACC[self.key]


def _register_post_accumulate_grad_hook(self, hook: Callable) -> _HookHandle:
    """Call ``hook(tensor)`` each time a backward pass has accumulated a gradient into
    this leaf's ``.grad`` (PyTorch's ``register_post_accumulate_grad_hook``); returns a
    handle whose ``remove()`` unregisters it. **Local**.

    The hook is kept until the tensor goes. Tensors are not tracked by the cycle
    collector: a hook that holds the tensor (or the module that holds it) strongly keeps
    both alive for good; hold such owners through a weak reference.

    Raises
    ------
    AutogradError
        ``self`` is not a leaf that requires grad.
    """
    meta = self._ag
    if meta is None or not meta.requires_grad or meta.grad_fn is not None:
        raise AutogradError(
            "register_post_accumulate_grad_hook: post accumulate grad hooks cannot be "
            "registered on non-leaf tensors or tensors that do not require grad"
        )
    key = id(meta)
    entry = _POST_ACC.get(key)
    if entry is None:
        # the entry goes with the tensor (a hook that held the tensor would keep it alive)
        entry = _POST_ACC[key] = [weakref.ref(self, lambda _: _POST_ACC.pop(key, None)),
                                  meta, {}]
    n = next(_HOOK_IDS)
    entry[2][n] = hook
    return _HookHandle(id(meta), n)


def _accumulate(meta: AutogradMeta, g: object) -> None:
    g = _for_leaf(g, meta)
    if meta.grad is None:
        # Note: a new tensor; the incoming gradient may be shared with other edges
        meta.grad = g.clone() if hasattr(g, "clone") else g
    else:
        meta.grad = meta.grad + g
    if _POST_ACC:
        entry = _POST_ACC.get(id(meta))
        if entry is not None:
            t = entry[0]()
            if t is not None:
                for hook in list(entry[2].values()):
                    hook(t)


# Callbacks queued for the end of the outermost running backward pass (queue_callback)
_CALLBACKS: list[Callable[[], None]] = []


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once the backward pass that runs now has finished its walk (PyTorch's
    ``Variable._execution_engine.queue_callback``): in the order queued, after the last
    node, before ``backward`` returns; a callback may queue another. **Local**.

    Raises
    ------
    AutogradError
        No backward pass is running.
    """
    if not _WALK.active:
        raise AutogradError("queue_callback: no backward pass is running")
    _CALLBACKS.append(fn)


# -- the walk ---------------------------------------------------------------------------------------
def _add_to_slot(buffers: dict, node: Node, nr: int, g: object) -> None:
    """Sum ``g`` into the buffer of ``node``'s output ``nr`` (``buffers``: ``{node: [g per
    output]}``; the node's list is made on first use, also for a None ``g``). **Local**.
    The full walk (:func:`_walk`) inlines this per edge."""
    buf = buffers.get(node)
    if buf is None:
        buf = buffers[node] = [None] * node.n_outputs
    if g is not None:
        buf[nr] = g if buf[nr] is None else buf[nr] + g


def _seed_roots(roots: Iterable, on_leaf: Callable[[AutogradMeta, object], None]) -> dict:
    """A backward pass's first gradient buffers: each root's gradient summed into its node's
    output slot (``{node: [g per output]}``); a root that is a leaf goes to ``on_leaf``.
    **Local**."""
    buffers: dict = {}
    for (target, nr), g in roots:
        if isinstance(target, Node):
            _add_to_slot(buffers, target, nr, g)
        else:
            on_leaf(target, g)
    return buffers


def _capture_outputs(node: Node, grads: list, capture: dict, results: list) -> None:
    """Add the gradients reaching ``node``'s outputs to the results asked for them
    (``capture[(id(node), output_nr)]``: result indices). **Local**."""
    for nr, g in enumerate(grads):
        js = capture.get((id(node), nr))
        if js is not None and g is not None:
            for j in js:
                results[j] = g if results[j] is None else results[j] + g


def _leaf_summer(leaf_deps: dict, sink: Callable[[AutogradMeta, object], None]
                 ) -> Callable[[AutogradMeta, object], None]:
    """A leaf's gradient delivery for one backward pass: its gradients are summed until the
    last of its ``leaf_deps[id(meta)]`` edges has delivered, then ``sink(meta, total)`` runs
    once (a total of None: not at all); a leaf without a count (an edge a formula added while
    the pass ran, e.g. a checkpoint's) goes to ``sink`` at once. Consumes ``leaf_deps``.
    **Local**."""
    sums: dict = {}

    def deliver(meta: AutogradMeta, g: object) -> None:
        key = id(meta)
        if key not in leaf_deps:
            if g is not None:
                sink(meta, g)
            return
        total = sums.get(key)
        if g is not None:
            total = g if total is None else total + g
        left = leaf_deps[key] - 1
        if left:
            leaf_deps[key] = left
            sums[key] = total
            return
        del leaf_deps[key]
        sums.pop(key, None)
        if total is not None:
            sink(meta, total)

    return deliver


class _Walk:
    """Where a backward pass is: ``active`` while one runs, ``op`` the op whose node runs
    (None between nodes), ``mask`` ``(node, need)`` while one half of a split backward
    runs ``node`` for the edges ``need`` marks only (see :func:`needed`)."""

    __slots__ = ("active", "mask", "op")

    def __init__(self) -> None:
        self.active = False
        self.op: str | None = None
        self.mask: tuple | None = None


_WALK = _Walk()


def in_backward() -> bool:
    """Whether a backward pass is running now. **Local**."""
    return _WALK.active


def current_backward() -> str | None:
    """The op whose backward node runs now (its formula, the summing of its gradients and
    their accumulation into leaves), or None (outside backward, or between nodes: the
    accumulation of the roots' own gradients). **Local**."""
    return _WALK.op


def _root(t: object, i: int, op: str) -> tuple:
    meta = t._ag
    if meta is None or not meta.requires_grad:
        raise AutogradError(
            f"{op}: element {i} of tensors does not require grad and does not have a grad_fn"
        )
    return (meta.grad_fn, meta.output_nr) if meta.grad_fn is not None else (meta, 0)


def _seed(t: object, g: object, i: int, op: str) -> object:
    if g is None:
        if t.numel() != 1:
            raise AutogradError(
                f"{op}: grad can be implicitly created only for scalar outputs (element {i} "
                f"has shape {tuple(t.shape)}); pass gradient="
            )
        return t._autograd_ones()
    if tuple(g.shape) != tuple(t.shape):
        raise AutogradError(
            f"{op}: Mismatch in shape: grad_output[{i}] has a shape of {tuple(g.shape)} and "
            f"output[{i}] has a shape of {tuple(t.shape)}."
        )
    return g


def run_backward(tensors: Sequence, grad_tensors: Sequence, retain_graph: bool,
                 inputs: Sequence | None = None, op: str = "backward",
                 allow_unused: bool = False, create_graph: bool = False,
                 leaves: dict | None = None) -> list | None:
    """Backpropagate from ``tensors`` (seeded with ``grad_tensors``, None for 1 of a
    one-element tensor). **Collective** when a DTensor's backward redistributes.

    Without ``inputs``: accumulates into the leaves' ``.grad`` (and retained non-leaves').
    With ``inputs``: returns their gradients (None where unused and ``allow_unused``)
    and touches no ``.grad``. ``create_graph``: the formulas run with grad mode on, so
    the gradients have a graph of their own (higher-order gradients). ``leaves`` (a dict,
    without ``inputs``): every leaf's gradient goes there instead of its ``.grad``, as
    ``id(meta) -> [meta, gradient]`` in the order the leaves are reached (a checkpoint's
    recomputation finds the leaves its function read).
    """
    results = _pass(lambda: _walk(tensors, grad_tensors, retain_graph, inputs, op,
                                  create_graph, leaves))
    if inputs is None:
        return None
    for j, r in enumerate(results):
        if r is None and not allow_unused:
            raise AutogradError(
                f"{op}: One of the differentiated Tensors (input {j}) appears to not have been "
                "used in the graph. Set allow_unused=True if this is the desired behavior."
            )
    return results


def _pass(run: Callable[[], object]) -> object:
    """``run()`` as one backward pass: :func:`in_backward` true meanwhile; the callbacks
    queued (:func:`queue_callback`) run after it when it is the outermost pass."""
    walk = _WALK
    prev = walk.active, walk.op
    outer = not prev[0]
    walk.active, walk.op = True, None
    try:
        result = run()
        if outer:
            callbacks = _CALLBACKS
            while callbacks:
                callbacks.pop(0)()
    finally:
        walk.active, walk.op = prev
        if outer:
            _CALLBACKS.clear()
    return result


def _walk(tensors: Sequence, grad_tensors: Sequence, retain_graph: bool,
          inputs: Sequence | None, op: str, create_graph: bool, leaves: dict | None) -> list:
    """:func:`run_backward`'s walk; the gradients of ``inputs`` (empty without)."""
    walk = _WALK
    with set_grad_enabled(create_graph):
        roots = []
        for i, (t, g) in enumerate(zip(tensors, grad_tensors)):
            target = _root(t, i, op)
            roots.append((target, _seed(t, g, i, op)))
        capture: dict = {}
        if inputs is not None:
            for j, x in enumerate(inputs):
                meta = x._ag
                if meta is None or not meta.requires_grad:
                    raise AutogradError(
                        f"{op}: element {j} of the inputs does not require grad"
                    )
                key = meta if meta.grad_fn is None else (meta.grad_fn, meta.output_nr)
                capture.setdefault(id(key) if key is meta else (id(key[0]), key[1]), []).append(j)
        results: list = [None] * (len(inputs) if inputs is not None else 0)

        def to_leaf(meta: AutogradMeta, g: object) -> None:
            if leaves is not None and meta.grad_fn is None:
                found = leaves.get(id(meta))
                if found is None:
                    leaves[id(meta)] = [meta, g]
                else:
                    found[1] = found[1] + g
                return
            js = capture.get(id(meta))
            if js is not None:
                for j in js:
                    results[j] = g if results[j] is None else results[j] + g
            elif inputs is None and meta.grad_fn is None:
                _accumulate(meta, g)

        # dependencies: how many edges reach each node (and each leaf) from the roots
        deps: dict = {}
        leaf_deps: dict = {}
        seen = set()
        stack = [t for (t, _), _ in roots if isinstance(t, Node)]
        for n in stack:
            seen.add(n)
        while stack:
            n = stack.pop()
            for e in n.edges:
                if e is None:
                    continue
                m = e.grad_fn
                if m is not None:
                    deps[m] = deps.get(m, 0) + 1
                    if m not in seen:
                        seen.add(m)
                        stack.append(m)
                else:
                    leaf_deps[id(e)] = leaf_deps.get(id(e), 0) + 1
        # a leaf's gradients are summed until its last edge has delivered, then accumulated
        # once (its hooks run once per pass, its layout is applied once)
        deliver = _leaf_summer(leaf_deps, to_leaf)
        buffers = _seed_roots(roots, to_leaf)
        ready = [n for n in buffers if deps.get(n, 0) == 0]
        done = []
        while ready:
            node = ready.pop()
            grads = buffers.pop(node)
            walk.op = node.op
            _capture_outputs(node, grads, capture, results)
            if all(g is None for g in grads):
                in_grads = (None,) * len(node.edges)
            else:
                in_grads = node.apply(grads)
            done.append(node)
            for e, g in zip(node.edges, in_grads):
                if e is None:
                    continue
                target = e.grad_fn
                if target is not None:
                    nr = e.output_nr
                    if g is not None:
                        buf = buffers.setdefault(target, [None] * target.n_outputs)
                        buf[nr] = g if buf[nr] is None else buf[nr] + g
                    else:
                        buffers.setdefault(target, [None] * target.n_outputs)
                    deps[target] -= 1
                    if deps[target] == 0:
                        ready.append(target)
                else:
                    deliver(e, g)
            walk.op = None
        if not retain_graph:
            for node in done:
                node.release()
    return results


def _as_seq(x: object) -> tuple:
    if isinstance(x, (list, tuple)):
        return tuple(x)
    return (x,)


def grad(outputs: object, inputs: object, grad_outputs: object = None,
         retain_graph: bool | None = None, create_graph: bool = False,
         allow_unused: bool = False) -> tuple:
    """Gradients of ``outputs`` with respect to ``inputs`` (``torch.autograd.grad``).

    **Collective** when the backward of a DTensor op communicates; **Local** otherwise.
    Leaves' ``.grad`` are left alone. ``create_graph=True``: the gradients are computed
    by recorded ops, so they can be differentiated again (higher-order gradients);
    ``retain_graph`` then defaults to True.

    Returns
    -------
    tuple
        One gradient per input (None for an unused input when ``allow_unused``).

    Raises
    ------
    AutogradError
        An output or input that does not require grad, a non-scalar output without its
        ``grad_outputs``, a second pass through freed nodes, an unused input.
    """
    outs = _as_seq(outputs)
    ins = _as_seq(inputs)
    gos = (None,) * len(outs) if grad_outputs is None else _as_seq(grad_outputs)
    if len(gos) != len(outs):
        raise AutogradError(
            f"autograd.grad: grad_outputs has {len(gos)} entries for {len(outs)} outputs"
        )
    retain = create_graph if retain_graph is None else retain_graph
    return tuple(run_backward(outs, gos, bool(retain), ins, "autograd.grad",
                              allow_unused, bool(create_graph)))


def backward(tensors: object, grad_tensors: object = None, retain_graph: bool | None = None,
             create_graph: bool = False, inputs: object = None) -> None:
    """Accumulate the gradients of ``tensors`` into the leaves (``torch.autograd.backward``).

    **Collective** when the backward of a DTensor op communicates; **Local** otherwise.
    ``inputs``: accumulate into these leaves only. ``create_graph``: the accumulated
    gradients have a graph (see :func:`grad`); ``retain_graph`` then defaults to True.
    """
    outs = _as_seq(tensors)
    gos = (None,) * len(outs) if grad_tensors is None else _as_seq(grad_tensors)
    retain = bool(create_graph if retain_graph is None else retain_graph)
    if inputs is None:
        run_backward(outs, gos, retain, create_graph=bool(create_graph))
        return
    ins = _as_seq(inputs)
    grads = run_backward(outs, gos, retain, ins, "backward", True, bool(create_graph))
    for x, g in zip(ins, grads):
        if g is not None:
            _accumulate(x._ag, g)


# -- the split backward (zero-bubble pipelines) ----------------------------------------------------
# A zero-bubble schedule runs each micro-batch's backward in two halves: I, the gradient of
# the stage input (sent upstream at once), and W, the weights' gradients, later, where the
# pipeline would otherwise idle. backward_input walks only the nodes that lead to the inputs
# and, at each of them that also has edges toward the weights, computes the input edges'
# gradients only (the formula's ``need`` mask, :func:`needed`) and stashes the node with the
# gradient it received; WeightWork.run computes the stashed nodes' other edges and walks the
# subgraph that leads only to the weights (a transpose or redistribute of a weight, FSDP's
# gather), accumulating into ``.grad`` as backward does (each weight once, its
# post-accumulate-grad hooks then). The two halves together run each formula once per edge.
def needed(node: Node) -> list:
    """Which of ``node``'s edges its formula computes a gradient for now: each edge that
    leads to a tensor requiring grad or, while one half of a split backward runs ``node``
    (:func:`backward_input`, :meth:`WeightWork.run`), that half's edges; the formula may
    skip the others' work (the ``need`` of :class:`dtensor.ops.table.Backward`). **Local**."""
    m = _WALK.mask
    if m is not None and m[0] is node:
        return list(m[1])
    return [e is not None for e in node.edges]


def _apply_part(node: Node, grads: list, mask: list) -> Sequence:
    """``node.apply(grads)`` for the edges ``mask`` marks (a formula that ignores
    :func:`needed` may give the others too: the caller decides what to keep)."""
    walk = _WALK
    prev = walk.mask
    walk.mask = (node, mask)
    try:
        return node.apply(grads)
    finally:
        walk.mask = prev


def _survey(roots: list, capture: dict) -> tuple[dict, dict, dict]:
    """One pass over the graph below the nodes ``roots``: how many edges reach each node
    and each leaf (``id(meta)``), and, per node, whether it leads to a captured input
    (``capture``: keys as :func:`_walk` makes them), children before parents."""
    deps: dict = {}
    leaf_deps: dict = {}
    to_input: dict = {}
    for r in roots:
        stack = [r]
        while stack:
            n = stack[-1]
            if n in to_input:
                stack.pop()
                continue
            below = False
            for e in n.edges:
                if e is not None:
                    m = e.grad_fn
                    if m is not None and m not in to_input:
                        stack.append(m)
                        below = True
            if below:  # (back to n once its children are known)
                continue
            stack.pop()
            hit = False
            for e in n.edges:
                if e is None:
                    continue
                m = e.grad_fn
                if m is None:
                    leaf_deps[id(e)] = leaf_deps.get(id(e), 0) + 1
                    hit = hit or id(e) in capture
                else:
                    deps[m] = deps.get(m, 0) + 1
                    hit = hit or to_input[m] or (id(m), e.output_nr) in capture
            to_input[n] = hit
    return deps, leaf_deps, to_input


class WeightWork:
    """The weight half of a split backward (what :func:`backward_input` left): the nodes
    that were run for their input edges only, with the gradients they received, and the
    subgraph that leads only to the weights. :meth:`run` computes it once.

    It holds the stashed nodes' saved tensors and output gradients until it runs (what a
    stashed node saved for its input edges alone is a weight in the common case, held by
    its module anyway; the nodes of the input half alone were freed when it ended).
    """

    __slots__ = ("_buffers", "_deps", "_later", "_leaf_deps", "_ran", "_retain", "_stash",
                 "_weights")

    def __init__(self, buffers: dict, deps: dict, leaf_deps: dict, stash: list, later: list,
                 weights: set, retain: bool) -> None:
        self._buffers = buffers
        self._deps = deps
        self._leaf_deps = leaf_deps
        self._stash = stash
        self._later = later
        self._weights = weights
        self._retain = retain
        self._ran = False

    @property
    def pending(self) -> int:
        """How many stashed nodes wait for :meth:`run` (0 once it ran). **Local**."""
        return 0 if self._ran else len(self._stash)

    def run(self) -> None:
        """Accumulate the weights' gradients into their ``.grad`` (each weight once, with
        the sum of its gradients; its post-accumulate-grad hooks then), in the order a full
        backward reaches them, and free the graph (unless the split kept it).

        **Collective** when the backward of a DTensor op communicates (FSDP's
        reduce-scatter runs here); **Local** otherwise. Callbacks queued during it
        (:func:`queue_callback`) run at its end.

        Raises
        ------
        AutogradError
            A second call; a saved tensor changed in place since the forward.
        """
        if self._ran:
            raise AutogradError("WeightWork.run: the weight half of this backward already ran")
        self._ran = True
        _pass(self._walk)

    def _walk(self) -> None:
        walk = _WALK
        buffers, deps, leaf_deps, weights = self._buffers, self._deps, self._leaf_deps, \
            self._weights
        ready: list = []

        def to_weight(meta: AutogradMeta, g: object) -> None:
            if id(meta) in weights:
                _accumulate(meta, g)

        to_leaf = _leaf_summer(leaf_deps, to_weight)

        def deliver(e: AutogradMeta, g: object) -> None:
            target = e.grad_fn
            if target is None:
                to_leaf(e, g)
                return
            _add_to_slot(buffers, target, e.output_nr, g)
            deps[target] -= 1
            if deps[target] == 0:
                ready.append(target)

        done = []
        with set_grad_enabled(False):
            for meta, g, counted in self._later:
                if counted:
                    to_leaf(meta, g)
                elif g is not None and id(meta) in weights:  # a root that is a weight
                    _accumulate(meta, g)
            ready.extend(n for n in buffers if deps.get(n, 0) == 0)
            stash = self._stash
            self._stash = self._later = ()
            i = 0
            while True:
                while ready:  # the subgraph that leads to the weights only: whole nodes
                    node = ready.pop()
                    grads = buffers.pop(node)
                    walk.op = node.op
                    edges = node.edges
                    if all(g is None for g in grads):
                        res = (None,) * len(edges)
                    else:
                        res = node.apply(grads)
                    done.append(node)
                    for e, g in zip(node.edges, res):
                        if e is not None:
                            deliver(e, g)
                    walk.op = None
                if i == len(stash):
                    break
                node, grads, again, kept = stash[i]
                i += 1
                walk.op = node.op
                for e, g in kept:  # computed by the input half already
                    deliver(e, g)
                if grads is not None:  # the other edges, from the gradient the node got
                    res = _apply_part(node, grads, again)
                    done.append(node)
                    for e, g, k in zip(node.edges, res, again):
                        if k:
                            deliver(e, g)
                walk.op = None
        self._buffers = self._deps = self._leaf_deps = {}
        if not self._retain:
            for node in done:
                node.release()


def backward_input(outputs: object, grad_outputs: object, inputs: Sequence,
                   weights: Sequence, retain_graph: bool = False) -> tuple[list, WeightWork]:
    """The input half of a split backward (zero-bubble pipelines, PyTorch's
    ``stage_backward_input``): the gradients of ``inputs`` now, the weights' later.

    **Collective** when the backward of a DTensor op communicates; **Local** otherwise.
    Walks only the nodes that lead to ``inputs``; a node among them that also has edges
    toward other tensors (the weights) computes its input edges' gradients only and is
    kept, with the gradient it received, for the returned :class:`WeightWork`, whose
    ``run()`` computes the rest and accumulates into the ``weights``' ``.grad`` exactly as
    ``backward(outputs, grad_outputs, inputs=weights)`` would (same formulas, same sums).
    Leaves other than ``weights`` get no ``.grad``; no ``.grad`` changes before ``run()``.
    The nodes used by the input half only are freed at its end (unless ``retain_graph``),
    the others when ``run()`` ends. Gradients carry no graph (no ``create_graph``).

    Parameters
    ----------
    outputs, grad_outputs
        As :func:`backward`'s ``tensors`` and ``grad_tensors`` (None: 1 for a one-element
        output).
    inputs
        Tensors that require grad (a stage's input); may be empty (all the work is then
        the weight half's).
    weights
        Leaves that require grad (a stage's parameters), none of them in ``inputs``.

    Returns
    -------
    (list, WeightWork)
        One gradient per input (None where the outputs do not depend on it) and the weight
        half, to ``run()`` once.

    Raises
    ------
    AutogradError
        An output or input that does not require grad, a weight that is not a leaf that
        requires grad or is also an input, a non-scalar output without its gradient, a
        second pass through freed nodes.
    """
    outs = _as_seq(outputs)
    gos = (None,) * len(outs) if grad_outputs is None else _as_seq(grad_outputs)
    if len(gos) != len(outs):
        raise AutogradError(
            f"backward_input: grad_outputs has {len(gos)} entries for {len(outs)} outputs"
        )
    box: list = []
    results = _pass(lambda: _input_half(outs, gos, tuple(inputs), tuple(weights),
                                        bool(retain_graph), box))
    return results, box[0]


def _input_half(outs: tuple, gos: tuple, ins: tuple, ws: tuple, retain: bool,
                box: list) -> list:
    """:func:`backward_input`'s walk; puts its :class:`WeightWork` in ``box``."""
    op = "backward_input"
    walk = _WALK
    with set_grad_enabled(False):
        roots = [(_root(t, i, op), _seed(t, g, i, op)) for i, (t, g) in enumerate(zip(outs, gos))]
        capture: dict = {}
        captured_nodes = []
        for j, x in enumerate(ins):
            meta = x._ag
            if meta is None or not meta.requires_grad:
                raise AutogradError(f"{op}: element {j} of the inputs does not require grad")
            if meta.grad_fn is None:
                capture.setdefault(id(meta), []).append(j)
            else:
                key = (id(meta.grad_fn), meta.output_nr)
                if key not in capture:
                    captured_nodes.append((meta.grad_fn, meta.output_nr, key))
                capture.setdefault(key, []).append(j)
        weights = set()
        for k, w in enumerate(ws):
            meta = w._ag
            if meta is None or not meta.requires_grad or meta.grad_fn is not None:
                raise AutogradError(
                    f"{op}: weight {k} (shape {tuple(w.shape)}) is not a leaf that requires grad"
                )
            if id(meta) in capture:
                raise AutogradError(f"{op}: weight {k} (shape {tuple(w.shape)}) is also one "
                                    "of the inputs")
            weights.add(id(meta))
        deps, leaf_deps, to_input = _survey(
            list(dict.fromkeys(t for (t, _), _ in roots if isinstance(t, Node))), capture)
        results: list = [None] * len(ins)
        later: list = []  # leaf gradients the weight half delivers: (meta, g, counted edge)

        def root_leaf(target: AutogradMeta, g: object) -> None:
            js = capture.get(id(target))
            if js is None:
                later.append((target, g, False))
            for j in js or ():
                results[j] = g if results[j] is None else results[j] + g

        buffers = _seed_roots(roots, root_leaf)
        ready = [n for n in buffers if to_input[n] and deps.get(n, 0) == 0]
        done = []  # nodes whose formula does not run again
        # (node, its gradients or None, the edges the weight half computes, [(edge, g)] of
        # those the input half computed: a formula may give more than it was asked for)
        stash = []
        while ready:
            node = ready.pop()
            grads = buffers.pop(node)
            walk.op = node.op
            _capture_outputs(node, grads, capture, results)
            edges = list(node.edges)
            mask = []
            for e in edges:
                if e is None:
                    mask.append(False)
                else:
                    m = e.grad_fn
                    mask.append(id(e) in capture if m is None else
                                to_input[m] or (id(m), e.output_nr) in capture)
            rest = [e is not None and not k for e, k in zip(edges, mask)]
            split = any(rest)
            empty = all(g is None for g in grads)
            if empty:
                res = (None,) * len(edges)
            elif split:
                res = _apply_part(node, grads, mask)
            else:
                res = node.apply(grads)
            n0 = len(edges)
            kept = []  # the other edges' gradients that the formula gave anyway
            again = [False] * n0  # the other edges the weight half runs the formula for
            for i, g in enumerate(res):
                if i >= n0:  # an edge the formula added (a checkpoint's leaves)
                    later.append((node.edges[i], g, True))
                    continue
                e = edges[i]
                if e is None:
                    continue
                if rest[i]:
                    if g is None and not empty:
                        again[i] = True
                    else:
                        kept.append((e, g))
                    continue
                m = e.grad_fn
                if m is None:
                    for j in capture[id(e)]:
                        results[j] = g if results[j] is None else results[j] + g
                    continue
                _add_to_slot(buffers, m, e.output_nr, g)
                deps[m] -= 1
                if deps[m] == 0 and to_input[m]:
                    ready.append(m)
            if not split:
                done.append(node)
            elif any(again):
                stash.append((node, grads, again, kept))
            else:  # (a formula that gave every gradient: the weight half only delivers)
                stash.append((node, None, None, kept))
                done.append(node)
            walk.op = None
        for node, nr, key in captured_nodes:  # inputs whose nodes lead to no other input
            if not to_input.get(node, True):
                g = buffers.get(node, (None,) * (nr + 1))[nr]
                if g is not None:
                    for j in capture[key]:
                        results[j] = g if results[j] is None else results[j] + g
        if not retain:
            for node in done:
                node.release()
    box.append(WeightWork(buffers, deps, leaf_deps, stash, later, weights, retain))
    return results


# -- the tensor API (installed on Tensor here and on DTensor by dtensor.distributed) -----------------
def _requires_grad(self) -> bool:
    """Whether gradients are computed for this tensor."""
    meta = self._ag
    return meta is not None and meta.requires_grad


def _set_requires_grad(self, value: bool) -> None:
    self.requires_grad_(value)


def _requires_grad_(self, requires_grad: bool = True):
    """Set ``requires_grad`` in place; returns self. **Local**.

    Only floating and complex tensors can require grad; only a leaf's flag can change.
    """
    meta = self._ag
    if meta is not None and meta.grad_fn is not None:
        if not requires_grad:
            raise AutogradError(
                "requires_grad_: you can only change requires_grad flags of leaf variables. "
                "If you want to use a computed variable in a subgraph that doesn't require "
                "differentiation use var_no_grad = var.detach()."
            )
        return self
    if requires_grad and dtype_kind(self.dtype) not in "fc":
        raise AutogradError(
            "requires_grad_: only Tensors of floating point and complex dtype can require "
            f"gradients (got {self.dtype})"
        )
    make_leaf(self, requires_grad, self._grad_layout())
    return self


def _grad(self):
    """The accumulated gradient of a leaf (None until a backward reaches it); settable."""
    meta = self._ag
    return None if meta is None else meta.grad


def _set_grad(self, value) -> None:
    meta = self._ag
    if meta is None:
        if value is None:
            return
        meta = self._ag = AutogradMeta(False, None, 0, self._grad_layout())
    if value is not None and tuple(value.shape) != tuple(self.shape):
        raise AutogradError(
            f"grad: assigned grad has shape {tuple(value.shape)} but the tensor has shape "
            f"{tuple(self.shape)}"
        )
    meta.grad = value


def _grad_fn(self):
    """The node that made this tensor (None for a leaf or a tensor without grad)."""
    meta = self._ag
    return None if meta is None else meta.grad_fn


def _is_leaf(self) -> bool:
    """True unless the tensor was made by a recorded op (PyTorch's ``is_leaf``)."""
    meta = self._ag
    return meta is None or meta.grad_fn is None


def _version(self) -> int:
    """The version counter of the tensor's memory (bumped by in-place ops). **Local**."""
    return version_of(self)


def _backward(self, gradient=None, retain_graph: bool | None = None, create_graph: bool = False,
              inputs=None) -> None:
    """Accumulate the gradient of this tensor into the leaves' ``.grad``.

    **Collective** for a DTensor whose backward communicates; **Local** otherwise.
    ``gradient`` defaults to 1 for a one-element tensor. The graph is freed unless
    ``retain_graph`` (which defaults to ``create_graph``). ``create_graph=True``: the
    gradients have a graph of their own (higher-order gradients).

    Raises
    ------
    AutogradError
        A tensor that does not require grad, a non-scalar without ``gradient``, a second
        backward through freed nodes, a saved tensor changed in place since.
    """
    backward((self,), (gradient,), retain_graph, create_graph, inputs)


def install_api(cls: type) -> None:
    """Give ``cls`` (Tensor, DTensor) the autograd attributes: ``requires_grad``,
    ``requires_grad_``, ``grad``, ``grad_fn``, ``is_leaf``, ``_version``, ``backward`` and
    ``register_post_accumulate_grad_hook``.
    The class provides ``_grad_layout()`` (a leaf's gradient layout) and
    ``_autograd_ones()`` (the implicit gradient of a one-element tensor). **Local**."""
    cls.requires_grad = property(_requires_grad, _set_requires_grad, doc=_requires_grad.__doc__)
    cls.requires_grad_ = _requires_grad_
    cls.grad = property(_grad, _set_grad, doc=_grad.__doc__)
    cls.grad_fn = property(_grad_fn, doc=_grad_fn.__doc__)
    cls.is_leaf = property(_is_leaf, doc=_is_leaf.__doc__)
    cls._version = property(_version, doc=_version.__doc__)
    cls.backward = _backward
    cls.register_post_accumulate_grad_hook = _register_post_accumulate_grad_hook


install_api(Tensor)


# -- recording ------------------------------------------------------------------------------------
def edge_of(x: object) -> AutogradMeta | None:
    """The graph edge of an op input: its AutogradMeta, or None when ``x`` is not a tensor
    that requires grad. **Local**."""
    meta = getattr(x, "_ag", None)
    return meta if meta is not None and meta.requires_grad else None


def record(op: str, formula: Callable, edges: Sequence, outputs: Sequence, ctx: object = None,
           out: object = None, saved: Sequence = (), node_type: type | None = None) -> Node:
    """Make the node of one op call and attach it to its floating outputs (the others, and
    None entries, do not require grad). **Local**. ``node_type``: a subclass of
    :class:`Node` to make (:class:`FunctionNode`)."""
    kind = node_type or (_SavingNode if saved else Node)
    node = kind(op, formula, edges, ctx, out, len(outputs), saved)
    if len(outputs) == 1:
        o = outputs[0]
        if o is not None and dtype_kind(o.dtype) in "fc":
            o._ag = AutogradMeta(True, node, 0)
        return node
    for i, o in enumerate(outputs):
        if o is not None and dtype_kind(o.dtype) in "fc":
            o._ag = AutogradMeta(True, node, i)
    return node


def save(t: object, name: str) -> tuple:
    """Record ``t``'s version for the checks of a node that reads it (``name``: which of
    its values it is, for the error): an entry of the node's ``saved`` (:func:`record`),
    counted until the node goes or is released. **Local**."""
    own = owner(t)
    key = id(own)
    e = _VERSIONS.get(key)
    if e is None:
        e = _VERSIONS[key] = [0, 0]
    e[1] += 1
    # (the owner keeps the key unique while the entry is counted)
    return (key, e[0], name, t, own)


def zero_grads(params: Iterable, set_to_none: bool = True) -> None:
    """Reset the gradients of ``params``: to None (default), or to zeros in place (what a
    module's and an optimizer's ``zero_grad`` do). **Local**."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            with no_grad():
                p.grad.zero_()
