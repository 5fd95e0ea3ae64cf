"""Build a model on the meta device, then give it exactly the values eager construction would have given.

``build_on_meta(fn, seed=...)`` calls ``fn()`` with the default device set to ``meta`` (no memory, no random
numbers drawn) while a dispatch mode **records** every operation the construction runs: the parameters'
``empty``, the ``normal_``/``uniform_``/``randn`` draws of the constructors and of custom inits (the LM's
``_init_weights``, ``ExpertBank.reset_parameters``, the routers'), fills, divisions, copies, constants made
with ``torch.tensor``. ``replay(model, emit)`` later runs that recording again on the CPU, in the same order,
from the same generator states, so every draw consumes the random stream exactly as eager construction did
(same op, same shape, same strides, same generator), and calls ``emit(name, tensor)`` once per parameter and
buffer with its full value as soon as that value is final. Nothing else is kept, so the peak is one full
tensor plus whatever the construction itself keeps alive at that point: a value that is overwritten before
anyone reads it (a ``nn.Linear``'s own init, redrawn by the LM's ``_init_weights``) is drawn into a scratch
tensor and dropped at once, and operations whose results nobody uses (``empty``, views) are not run at all.
After dropping a large tensor the replay hands the C heap's free pages back to the OS
(``mode.cpu_allocator.release_free_memory``): glibc would otherwise keep them resident.

``mode.parallel.materialize`` is the user of ``replay``: it puts the model (parallelized or not) on its device
with ``to_empty`` and copies each emitted value, or only this rank's shard of it, into place. This module
has no ``torch.distributed``: the recording and the replay are plain torch.

Random numbers. The replay draws from the CPU default generator (and from any ``torch.Generator`` the
construction passed explicitly), set to the states the recording saw: the state when ``build_on_meta`` began
and any re-seeding inside ``fn`` (``torch.manual_seed`` between draws). ``build_on_meta`` replays once right
away with nothing kept (the draws only), so it leaves the global generator where eager construction would
have left it, and everything after it (``parallelize``, training, random MoD routing) sees the stream an
eager run sees. A replay restores the generators it used when it ends (``restore_rng=True``).

Not recordable, refused with a ``MetaInitError`` that says why: a draw on a real device inside ``fn`` (its
state could not be replayed in order), parameters or buffers that ``fn`` left on a real device, a tensor made
outside ``fn`` that the construction read, a CPU constant changed between building and replaying, a CUDA
generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mode.cpu_allocator import release_free_memory

M = TypeVar("M", bound=nn.Module)  # the module a build function returns

_META = torch.device("meta")
# in-place ops that overwrite every element of ``self`` without reading it (when ``self`` spans its storage)
_OVERWRITES = {
    "normal_",
    "uniform_",
    "fill_",
    "zero_",
    "copy_",
    "random_",
    "exponential_",
    "bernoulli_",
    "log_normal_",
    "cauchy_",
    "geometric_",
}
_DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.asarray)
_RECORD_ATTR = "_mode_meta_record"
_TRIM_BYTES = 1 << 20  # dropping a storage this large hands the heap's free pages back to the OS


class MetaInitError(ValueError):
    """A model built on meta cannot be recorded, replayed or used as asked (the message says why): a
    ``ValueError``, as every user mistake in this library."""


@dataclass(frozen=True)
class _Ref:
    """A meta tensor as the replay rebuilds it: a view of storage ``key``."""

    key: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Const:
    """A real tensor the construction read (``torch.tensor(...)`` data): checked unchanged at replay."""

    tensor: Tensor
    version: int


@dataclass
class _Op:
    func: Callable[..., Any] | None  # an OpOverload; None for a generator-state event
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    reads: frozenset = frozenset()  # storages whose values the op reads (partial writes read too)
    partial: frozenset = frozenset()  # storages the op writes in part (also in ``reads``)
    overwrites: frozenset = frozenset()  # storages every element of which the op writes, reading none
    created: tuple = ()  # (key, _Ref, output index) of the storages the op creates
    rng: bool = False  # consumes random numbers: always replayed
    generator: torch.Generator | None = None  # event: the generator to set (None: the CPU default)
    state: Tensor | None = None  # event: its state


@dataclass
class MetaRecord:
    """What ``build_on_meta`` recorded: the operations, each storage's size, which storage (and view of it)
    each parameter and buffer name ended on, and the generator states around the construction."""

    ops: list[_Op]
    nbytes: dict[int, int]
    names: dict[str, _Ref]  # every parameter and buffer name (tied and shared ones included)
    rng_start: Tensor  # the CPU default generator when fn began
    rng_end: Tensor | None = None  # ... and where eager construction leaves it (set by the first replay)
    hooks: list = field(default_factory=list)  # the forward pre-hooks that refuse to run before materializing
    materialized: bool = False


# -- recording ---------------------------------------------------------------------------------------------


def _is_rng(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


class _DataOnCPU(TorchFunctionMode):
    """``torch.tensor(data)`` on meta keeps no data and dispatches no op: make it on the CPU instead and move
    it to meta, which the recorder sees (``_to_copy`` of a CPU constant)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DATA_CONSTRUCTORS and args and not isinstance(args[0], Tensor):
            dev = kwargs.get("device")
            if dev is None or torch.device(dev).type == "meta":
                requires_grad = kwargs.pop("requires_grad", False)
                real = func(*args, **{**kwargs, "device": "cpu"})
                return real.to(_META).requires_grad_(requires_grad)
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.nbytes: dict[int, int] = {}
        self.keep: list[Tensor] = []  # every meta tensor seen: their storages stay alive, so keys stay unique
        self.last_state: dict = {None: torch.get_rng_state()}  # generator (None: CPU default) -> state seen

    def _ref(self, t: Tensor) -> _Ref:
        self.keep.append(t)
        return _Ref(t.untyped_storage()._cdata, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _convert(self, x):
        if isinstance(x, Tensor):
            if x.is_meta:
                return self._ref(x)
            return _Const(x, x._version)
        if isinstance(x, torch.device) and x.type == "meta":
            return _META
        return x

    def _note_generator(self, func, args, kwargs) -> None:
        """Before a draw: if the generator's state is not the one last seen (``fn`` re-seeded it), record the
        new state, to be set at that point of the replay."""
        gen = kwargs.get("generator")
        if gen is None:
            names = [a.name for a in func._schema.arguments]
            if "generator" in names and names.index("generator") < len(args):
                gen = args[names.index("generator")]
        if gen is not None and gen.device.type != "cpu":
            raise MetaInitError(
                f"a draw on a {gen.device.type} generator while building on meta: the replay draws "
                "on the CPU; use the default generator or a CPU torch.Generator"
            )
        state = torch.get_rng_state() if gen is None else gen.get_state()
        last = self.last_state.get(gen)
        if last is None or not torch.equal(last, state):
            self.ops.append(_Op(None, generator=gen, state=state))
            self.last_state[gen] = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, Tensor)]
        flat_out = [x for x in pytree.tree_leaves(out) if isinstance(x, Tensor)]
        rng = _is_rng(func)
        if not any(t.is_meta for t in flat_in + flat_out):
            if rng:
                raise MetaInitError(
                    f"{func}: a random draw on {flat_out[0].device if flat_out else 'a real device'} "
                    "while building on meta; build every tensor on meta (no device=...) so that the "
                    "replay can draw it in order"
                )
            return out  # real tensors only (a constant being made): its result enters as a constant
        reads, partial, overwrites = set(), set(), set()
        for i, a in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            is_write = a.alias_info is not None and a.alias_info.is_write
            for t in pytree.tree_leaves(value):
                if not (isinstance(t, Tensor) and t.is_meta):
                    continue
                key = t.untyped_storage()._cdata
                if key not in self.nbytes:
                    raise MetaInitError(
                        f"{func}: uses a meta tensor made outside the function given to "
                        "build_on_meta; build every tensor of the model inside it"
                    )
                if (
                    is_write
                    and i == 0
                    and func.overloadpacket.__name__ in _OVERWRITES
                    and t.is_contiguous()  # (a dense permutation counts as a partial write: conservative)
                    and t.numel() * t.element_size() == t.untyped_storage().nbytes()
                ):
                    overwrites.add(key)
                else:
                    reads.add(key)
                    if is_write:
                        partial.add(key)
        new = [(j, t) for j, t in enumerate(flat_out) if t.is_meta and t.untyped_storage()._cdata not in self.nbytes]
        if not (rng or partial or overwrites or new):
            return out  # a view or a metadata query: the replay rebuilds views from their storage
        if rng:
            self._note_generator(func, args, kwargs)
        created = []
        for j, t in new:
            key = t.untyped_storage()._cdata
            if key not in self.nbytes:  # (two outputs on one new storage: the first makes it)
                self.nbytes[key] = t.untyped_storage().nbytes()
                created.append((key, self._ref(t), j))
        r_args, r_kwargs = pytree.tree_map(self._convert, (args, kwargs))
        self.ops.append(
            _Op(
                func, r_args, r_kwargs, frozenset(reads), frozenset(partial), frozenset(overwrites), tuple(created), rng
            )
        )
        return out


def build_on_meta(fn: Callable[[], nn.Module], *, seed: int | None = None) -> nn.Module:
    """``fn()`` built on the meta device and recorded, for ``mode.parallel.materialize``: an ``nn.Module``
    with no memory behind its parameters and buffers. ``seed``: ``torch.manual_seed(seed)`` first, as an
    eager build would do (else the global generator's current state is the one eager construction would
    start from). Leaves the global generator where ``fn()`` built eagerly would have left it."""
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r}: must be an int or None")
        torch.manual_seed(seed)
    model, record = _record(fn)
    setattr(model, _RECORD_ATTR, record)
    _replay(record, None, restore_rng=False)  # the draws only: the generators end where eager construction's do
    record.rng_end = torch.get_rng_state()
    guard_forward(model)
    return model


def build_draws_only(fn: Callable[[], M]) -> M:
    """``fn()`` built on the meta device, the generators advanced exactly as building it eagerly advances them
    (each draw made into a scratch tensor and dropped at once); nothing is kept to materialize it. For code
    that stands in for an eager construction whose values it does not need, but whose draws later ones
    follow (``mode.parallel.ep_model.shard_experts`` on a model built on meta)."""
    model, record = _record(fn)
    _replay(record, None, restore_rng=False)
    return model


def _record(fn: Callable[[], M]) -> tuple[M, MetaRecord]:
    if not callable(fn):
        raise TypeError(f"fn={type(fn).__name__}: must be a callable that builds the model, e.g. lambda: LM(cfg)")
    recorder = _Recorder()
    rng_start = torch.get_rng_state()
    with torch.device("meta"), _DataOnCPU(), recorder:
        model = fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"fn() returned {type(model).__name__}: must return an nn.Module")
    if not torch.equal(torch.get_rng_state(), recorder.last_state[None]):
        recorder.ops.append(_Op(None, generator=None, state=torch.get_rng_state()))  # re-seeded after its draws
    names = {}
    for kind, items in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, t in items:
            if not t.is_meta:
                raise MetaInitError(
                    f"{kind} {name!r}: is on {t.device}, not meta; build_on_meta records tensors "
                    "built on the default device (no explicit device=...) inside fn"
                )
            key = t.untyped_storage()._cdata
            if key not in recorder.nbytes:
                raise MetaInitError(f"{kind} {name!r}: was made outside fn; build every tensor of the model inside it")
            names[name] = _Ref(key, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
    recorder.keep.clear()
    return model, MetaRecord(recorder.ops, recorder.nbytes, names, rng_start)


def guard_forward(model: nn.Module) -> None:
    """(Re-)register, first in line on every module, the hook that refuses a forward before materializing
    (``parallelize`` calls it again: FSDP's own hooks, registered later, would otherwise run first)."""
    record = meta_record(model)
    assert record is not None, "guard_forward: called on a model built on meta only"
    for hook in record.hooks:
        hook.remove()
    record.hooks[:] = [m.register_forward_pre_hook(_refuse_meta_forward, prepend=True) for m in model.modules()]


def _refuse_meta_forward(module: nn.Module, args) -> None:
    raise MetaInitError(
        f"{type(module).__name__}: is still on the meta device (built by build_on_meta); call "
        "mode.parallel.materialize(model, device) first (after parallelize, if you shard it)"
    )


def meta_record(model: nn.Module) -> MetaRecord | None:
    """The recording ``build_on_meta`` attached to ``model`` (None for a model built otherwise)."""
    return getattr(model, _RECORD_ATTR, None)


def is_meta_built(model: nn.Module) -> bool:
    """Built by ``build_on_meta`` and not materialized yet."""
    record = meta_record(model)
    return record is not None and not record.materialized


# -- replay ------------------------------------------------------------------------------------------------


def _plan(record: MetaRecord, names) -> tuple[list[bool], list[list[int]], list[list[int]]]:
    """Which ops to run (every draw, or a write whose value is read later or is a final value of ``names``),
    and, per op, the storages to emit after it (a final value: its last use) and to drop after it (a value
    nobody reads again: the next use overwrites it, or there is none). One backward pass: liveness. When the
    values of ``names`` need no random number, no draw runs at all."""
    live, dead = _liveness(record, names, draws=False)
    if any(live[i] and op.rng for i, op in enumerate(record.ops)):  # a random value: then the whole stream
        live, dead = _liveness(record, names, draws=True)
    final = {record.names[n].key for n in names}
    last: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        if live[i] and op.func is not None:
            for k in _touched(op):
                last[k] = i
    emits: list[list[int]] = [[] for _ in record.ops]
    for k in final:
        emits[last[k]].append(k)
    drops = [sorted(set(dead[i]) | set(emits[i])) for i in range(len(record.ops))]
    return live, emits, drops


def _touched(op: _Op) -> set:
    return {*op.reads, *op.overwrites, *(k for k, _, _ in op.created)}


def _liveness(record: MetaRecord, names, draws: bool) -> tuple[list[bool], list[list[int]]]:
    needed = {record.names[n].key for n in names}  # storages whose current value is still to be used
    live = [False] * len(record.ops)
    dead: list[list[int]] = [[] for _ in record.ops]
    for i in range(len(record.ops) - 1, -1, -1):
        op = record.ops[i]
        if op.func is None:
            live[i] = draws
            continue
        made = {k for k, _, _ in op.created}
        if (draws and op.rng) or (made | op.overwrites | op.partial) & needed:
            live[i] = True
            dead[i] = [k for k in _touched(op) if k not in needed]  # after this op, nobody reads it again
            needed -= op.overwrites | made
            needed |= op.reads
    if needed:
        raise MetaInitError("the recording reads a storage it never made (a tensor built outside fn)")
    return live, dead


def _view(storage, ref: _Ref) -> Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.shape, ref.stride)


def replay(
    model: nn.Module, emit: Callable[[str, Tensor], None] | None, *, restore_rng: bool = True, names=None
) -> None:
    """Run ``model``'s recording again on the CPU and call ``emit(name, value)`` for every parameter and buffer
    name (tied names each get the same value), as soon as the value is final; ``value`` is a CPU tensor valid
    during the call only (copy what you keep). ``emit=None``: the draws only. ``restore_rng``: leave the
    generators as they were before the call (else where eager construction leaves them). ``names``: only
    these (default: every name); what they do not need is not computed (no draw at all unless one of them is
    random)."""
    record = meta_record(model)
    if record is None:
        raise MetaInitError(f"{type(model).__name__}: was not built by build_on_meta (nothing to replay)")
    _replay(record, emit, restore_rng, names)


def _replay(record: MetaRecord, emit, restore_rng: bool, names=None) -> None:
    names = set(record.names if names is None else names)
    by_key: dict[int, list[str]] = {}
    for name in names:
        by_key.setdefault(record.names[name].key, []).append(name)
    live, emits, drops = _plan(record, names)
    full_stream = any(live[i] and op.rng for i, op in enumerate(record.ops))
    generators = {op.generator for op in record.ops if op.func is None and op.generator is not None}
    saved = (torch.get_rng_state(), {g: g.get_state() for g in generators})
    bound: dict[int, object] = {}  # storage key -> the CPU storage holding its current value

    def real(x):
        if isinstance(x, _Ref):
            return _view(bound[x.key], x)
        if isinstance(x, _Const):
            if x.tensor._version != x.version:
                raise MetaInitError(
                    "a CPU tensor read while building on meta changed before the replay; build constants inside fn"
                )
            return x.tensor
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    try:
        torch.set_rng_state(record.rng_start)
        with torch.no_grad():
            for i, op in enumerate(record.ops):
                if op.func is None:
                    state = cast(Tensor, op.state)  # a generator-state event carries its state
                    (op.generator.set_state if op.generator is not None else torch.set_rng_state)(state)
                    continue
                if not live[i]:
                    continue
                for k in op.overwrites:
                    if k not in bound:  # nothing kept from before: a fresh scratch of the storage's size
                        bound[k] = torch.empty(record.nbytes[k], dtype=torch.uint8, device="cpu").untyped_storage()
                args, kwargs = pytree.tree_map(real, (op.args, op.kwargs), is_leaf=lambda x: isinstance(x, _Ref))
                out = [t for t in pytree.tree_leaves(op.func(*args, **kwargs)) if isinstance(t, Tensor)]
                for k, ref, j in op.created:
                    _bind(bound, k, ref, out[j], record.nbytes[k])
                if emit is not None:
                    for k in emits[i]:
                        for name in by_key[k]:
                            emit(name, _view(bound[k], record.names[name]))
                for k in drops[i]:
                    del bound[k]
                del out, args, kwargs  # nothing of this op outlives it but what ``bound`` keeps
                if any(record.nbytes[k] >= _TRIM_BYTES for k in drops[i]):
                    release_free_memory()  # else glibc keeps the freed blocks resident (mode.cpu_allocator)
        if record.rng_end is not None and full_stream:  # every replay draws the stream the first one drew
            assert torch.equal(torch.get_rng_state(), record.rng_end), "the replay drew another random stream"
    finally:
        if restore_rng:
            torch.set_rng_state(saved[0])
            for g, state in saved[1].items():
                g.set_state(state)


def _bind(bound: dict, key: int, ref: _Ref, out: Tensor, nbytes: int) -> None:
    storage = out.untyped_storage()
    if (
        storage.nbytes() == nbytes
        and out.storage_offset() == ref.offset
        and tuple(out.stride()) == ref.stride
        and out.dtype == ref.dtype
    ):
        bound[key] = storage
        return
    bound[key] = torch.empty(nbytes, dtype=torch.uint8, device="cpu").untyped_storage()  # the meta layout, as recorded
    _view(bound[key], ref).copy_(out)
