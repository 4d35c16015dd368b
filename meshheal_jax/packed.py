"""Structs of many small fields kept as a few arrays, one per dtype.

A slot of the JAX engine has ~30 fields. Kept as ~30 arrays, every select between two versions of
a slot (a branch taken or not, a slot that takes a task or not) is ~30 XLA kernels, and every loop
carries and copies ~30 buffers: XLA's CPU backend fuses elementwise work into one kernel per
output array, not several outputs into one kernel. `packed` keeps the fields of one dtype as
columns of one array (a "block"), so such a select is one kernel per dtype; a field is read as a
slice of its block (which fuses into whatever reads it) and `replace` writes the fields it is
given by building their blocks anew from slices and the new values (one fused concatenation).

    @packed
    class Pair:
        FIELDS = (("t", jnp.int32, ()), ("route", jnp.int32, 10), ("ok", jnp.bool_, ()),
                  ("covered", jnp.bool_, None))  # None: the rest of its block (its last field)

    x = Pair.make(t=1, route=jnp.zeros(10), ok=True, covered=jnp.zeros(7, bool))
    x.t, x.route, x.covered          # views of the blocks, any leading axes (vmap, streams, rounds)
    x = x.replace(t=2, ok=False)     # what dataclasses.replace does for a dataclass

The struct is a pytree whose leaves are the blocks, with the leading axes of the fields and a
last axis of columns; tree_map, vmap, where and indexing see the blocks. Works on numpy blocks
too (the host reads records' fields the same way).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Column(NamedTuple):
    block: int
    start: int
    width: int | None  # None: to the end of the block
    scalar: bool


def _layout(fields) -> tuple[tuple[np.dtype, ...], dict[str, Column]]:
    dtypes: list[np.dtype] = []
    columns: dict[str, Column] = {}
    offsets: list[int | None] = []
    for name, dtype, width in fields:
        dtype = np.dtype(dtype)
        if dtype not in dtypes:
            dtypes.append(dtype)
            offsets.append(0)
        b = dtypes.index(dtype)
        if offsets[b] is None:
            raise TypeError(f"field {name!r} follows a field of width None (the rest of its block)")
        if name in columns:
            raise TypeError(f"field {name!r} listed twice")
        scalar = width == ()
        columns[name] = Column(b, offsets[b], 1 if scalar else width, scalar)
        offsets[b] = None if width is None else offsets[b] + (1 if scalar else width)
    return tuple(dtypes), columns


def packed(cls):
    """Make `cls` (which lists FIELDS = ((name, dtype, width), ...); width () for a scalar, an int
    for a vector, None for the rest of the block) a frozen pytree of one array per dtype."""
    dtypes, columns = _layout(cls.FIELDS)
    names = tuple(name for name, _, _ in cls.FIELDS)

    def view(name):
        column = columns[name]

        def get(self):
            block = self.blocks[column.block]
            if column.scalar:
                return block[..., column.start]
            stop = None if column.width is None else column.start + column.width
            return block[..., column.start : stop]

        get.__name__ = name
        return property(get)

    def _block(self, b: int, changes: dict) -> jax.Array:
        """Block b with the fields in `changes` written: a select against its column positions per
        field (elementwise, so it fuses with its neighbours)."""
        out = self.blocks[b]
        width = out.shape[-1]
        position = np.arange(width)
        for name, value in changes.items():
            column = columns[name]
            if column.block != b:
                continue
            value = jnp.asarray(value).astype(dtypes[b])
            stop = width if column.width is None else column.start + column.width
            inside = (position >= column.start) & (position < stop)
            if column.scalar:
                spread = value[..., None]
            else:  # the vector's entries at its columns (the others masked out)
                pad = [(0, 0)] * (value.ndim - 1) + [(column.start, width - stop)]
                spread = jnp.pad(value, pad)
            out = jnp.where(inside, spread, out)
        return out

    def replace(self, **changes):
        unknown = set(changes) - set(names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        touched = {columns[name].block for name in changes}
        return type(self)(
            tuple(self._block(b, changes) if b in touched else x for b, x in enumerate(self.blocks))
        )

    @classmethod
    def make(klass, **values):
        """A struct from every field's value (leading axes broadcast together)."""
        missing = [name for name in names if name not in values]
        if missing or set(values) - set(names):
            raise TypeError(f"{klass.__name__}.make needs exactly its fields; missing {missing}, "
                            f"unknown {sorted(set(values) - set(names))}")  # fmt: skip
        arrays = {name: jnp.asarray(values[name]) for name in names}
        lead = jnp.broadcast_shapes(*(
            a.shape if columns[n].scalar else a.shape[:-1] for n, a in arrays.items()))  # fmt: skip
        blocks = []
        for b, dtype in enumerate(dtypes):
            parts = []
            for name in names:
                column, a = columns[name], arrays[name].astype(dtype)
                if column.block == b:
                    a = a[..., None] if column.scalar else a
                    parts.append(jnp.broadcast_to(a, lead + a.shape[-1:]))
            blocks.append(jnp.concatenate(parts, axis=-1))
        return klass(tuple(blocks))

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in names}

    namespace = {"__annotations__": {"blocks": tuple}, "__doc__": cls.__doc__, "__module__": cls.__module__,
                 "__qualname__": cls.__qualname__, "FIELDS": cls.FIELDS, "NAMES": names, "COLUMNS": columns,
                 "DTYPES": dtypes, "_block": _block, "replace": replace, "make": make, "as_dict": as_dict}  # fmt: skip
    namespace.update({name: view(name) for name in names})
    new = dataclasses.dataclass(frozen=True)(type(cls.__name__, (), namespace))
    return jax.tree_util.register_dataclass(new, data_fields=["blocks"], meta_fields=[])
