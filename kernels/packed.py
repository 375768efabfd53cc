"""Many arrays as one kernel argument: an address table and its spec.

Numba's dispatcher unboxes every array argument of every call (its type looked up, a struct
built, a reference taken and dropped): about 50 ns per array on these machines. A data-path
stage calls its kernel once per burst with 15-40 arrays, so on the small bursts of an engine
group serving twenty switches (5-15 frames) the unboxing cost more than a stage's own work:
an empty ``shape`` call took 2.7 us, an ``aggregate`` call 2.5 us.

Here the caller passes one ``int64`` table instead, a row per array (its address, then its
shape), built once while the arrays stay the same; the kernel rebuilds the arrays from it
with :func:`arrays_at` and a spec that names each array's dtype and dimensions
(``"u1:2 i4:1"``: a 2-D ``uint8`` and a 1-D ``int32``), a string constant of the kernel's
source so that Numba compiles (and caches) one specialisation of it. The rebuilt arrays
borrow the memory (no reference counts): the caller must hold the arrays while the kernel
runs, and build a new table whenever it replaces one of them.
Only C-contiguous arrays of up to :data:`MAX_DIMS` dimensions are accepted, which the
rebuilt arrays' strides assume.

The numpy twin of :func:`arrays_at` is the identity (the arrays themselves): the tests check
that each rebuilt array reads and writes its original's memory, for every dtype and
dimension."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.numpy_support import from_dtype

#: dimensions a table row describes at most
MAX_DIMS = 3
#: columns of a table row: the address, then the shape
TABLE_COLS = 1 + MAX_DIMS
#: spec codes of the dtypes a table carries
DTYPE_CODES = {"u1": np.uint8, "i1": np.int8, "u2": np.uint16, "i2": np.int16,
               "u4": np.uint32, "i4": np.int32, "u8": np.uint64, "i8": np.int64,
               "f4": np.float32, "f8": np.float64, "b1": np.bool_}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def spec_types(spec: str) -> list[types.Array]:
    """The Numba array types a spec names (``ValueError`` naming a bad item)."""
    out = []
    for item in spec.split():
        code, _, nd = item.partition(":")
        if code not in DTYPE_CODES or not nd.isdigit() or not 1 <= int(nd) <= MAX_DIMS:
            raise ValueError(f"array spec item {item!r}: expected CODE:DIMS with CODE in "
                             f"{sorted(DTYPE_CODES)} and 1 <= DIMS <= {MAX_DIMS}")
        out.append(types.Array(from_dtype(np.dtype(DTYPE_CODES[code])), int(nd), "C"))
    return out


def spec_of(arrays) -> str:
    """The spec of ``arrays`` (``ValueError`` for one a table cannot carry)."""
    items = []
    for k, a in enumerate(arrays):
        if not isinstance(a, np.ndarray):
            raise ValueError(f"array table: item {k} is a {type(a).__name__}, not an array")
        if a.dtype not in _CODE_OF or not 1 <= a.ndim <= MAX_DIMS:
            raise ValueError(f"array table: item {k} ({a.dtype}, {a.ndim}-D) is not among "
                             f"{sorted(_CODE_OF)} with 1 to {MAX_DIMS} dimensions")
        if not a.flags.c_contiguous:
            raise ValueError(f"array table: item {k} is not C-contiguous (a view with "
                             "strides): pass a contiguous copy")
        items.append(f"{_CODE_OF[a.dtype]}:{a.ndim}")
    return " ".join(items)


def array_table(arrays, spec: str | None = None) -> np.ndarray:
    """The table of ``arrays`` (addresses and shapes; see the module docstring). With
    ``spec`` (what the kernel's :func:`arrays_at` expects) arrays of another spec are refused,
    naming both: a kernel reading an array as another dtype would read garbage."""
    got = spec_of(arrays)
    if spec is not None and got != spec:
        raise ValueError(f"array table: the kernel expects {spec!r}, the arrays are {got!r}")
    table = np.zeros((len(arrays), TABLE_COLS), np.int64)
    for k, a in enumerate(arrays):
        table[k, 0] = a.ctypes.data
        table[k, 1:1 + a.ndim] = a.shape
    return table


def _array_from_row(context, builder, aty, word):
    """The borrowed C-order array of type ``aty`` that a table row describes (``word(j)``:
    the row's column ``j``)."""
    i64 = ir.IntType(64)
    shape = [word(1 + d) for d in range(aty.ndim)]
    itemsize = context.get_abi_sizeof(context.get_data_type(aty.dtype))
    strides, step = [], ir.Constant(i64, itemsize)
    for d in reversed(range(aty.ndim)):  # C order
        strides.insert(0, step)
        step = builder.mul(step, shape[d])
    ary = context.make_array(aty)(context, builder)
    data = builder.inttoptr(word(0), context.get_data_type(aty.dtype).as_pointer())
    context.populate_array(ary, data=data, shape=cgutils.pack_array(builder, shape),
                           strides=cgutils.pack_array(builder, strides),
                           itemsize=ir.Constant(i64, itemsize), meminfo=None)
    return ary._getvalue()


def _table_ok(table) -> bool:
    return isinstance(table, types.Array) and table.dtype == types.int64 and table.ndim == 2


@intrinsic
def arrays_at(typingctx, table, spec):
    """The arrays of ``table`` (an ``int64[k, TABLE_COLS]`` from :func:`array_table`) as a
    tuple typed by ``spec``, a string constant: borrowed views of the callers' memory."""
    if not (_table_ok(table) and isinstance(spec, types.StringLiteral)):
        return None
    arys = spec_types(spec.literal_value)
    tup = types.Tuple(arys)

    def codegen(context, builder, signature, args):
        tab = context.make_array(signature.args[0])(context, builder, args[0])
        i64 = ir.IntType(64)
        vals = []
        for k, aty in enumerate(arys):
            def word(j, k=k):
                return builder.load(builder.gep(tab.data, [ir.Constant(i64, k * TABLE_COLS + j)]))
            vals.append(_array_from_row(context, builder, aty, word))
        return context.make_tuple(builder, signature.return_type, vals)

    return tup(table, spec), codegen


@intrinsic
def array_at(typingctx, table, row, spec):
    """The array of ``table``'s row ``row`` (a run-time index: for a variable number of
    arrays of one type, such as a node's ports' rings), typed by ``spec``, a string constant
    naming one array type (``"u1:1"``). Like :func:`arrays_at`, no bounds are checked: the
    caller passes a row the table has."""
    if not (_table_ok(table) and isinstance(row, types.Integer)
            and isinstance(spec, types.StringLiteral)):
        return None
    arys = spec_types(spec.literal_value)
    if len(arys) != 1:
        return None
    aty = arys[0]

    def codegen(context, builder, signature, args):
        tab = context.make_array(signature.args[0])(context, builder, args[0])
        i64 = ir.IntType(64)
        base = builder.mul(context.cast(builder, args[1], signature.args[1], types.int64),
                           ir.Constant(i64, TABLE_COLS))

        def word(j):
            return builder.load(builder.gep(tab.data, [builder.add(base, ir.Constant(i64, j))]))

        return _array_from_row(context, builder, aty, word)

    return aty(table, row, spec), codegen
