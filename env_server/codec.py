"""Conversions between numpy / gymnasium objects and the envfleet.v1 messages (both sides use them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from env_server.protocol import MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb

__all__ = [
    "CodecError",
    "UnsupportedSpaceError",
    "Unsendable",
    "MAX_COMPACT_BOX_BYTES",
    "AUTORESET_TO_PROTO",
    "AUTORESET_FROM_PROTO",
    "compact_bounds",
    "MAX_STRING_ARRAY_BYTES",
    "MAX_VALUE_NODES",
    "Path",
    "Where",
    "decode_autoreset_mode",
    "decode_space",
    "decode_tensor",
    "decode_value",
    "encode_space",
    "encode_tensor",
    "encode_value",
    "key_text",
    "np_dtype",
]


class CodecError(ValueError):
    """A value cannot be encoded, or a message cannot be decoded; the text names where."""


class UnsupportedSpaceError(CodecError):
    """A gymnasium space that the protocol does not carry (e.g. Text, Graph, Sequence)."""


_DTYPES: dict[np.dtype, pb.DType] = {
    np.dtype(np.bool_): pb.DTYPE_BOOL,
    np.dtype(np.int8): pb.DTYPE_INT8,
    np.dtype(np.uint8): pb.DTYPE_UINT8,
    np.dtype(np.int16): pb.DTYPE_INT16,
    np.dtype(np.uint16): pb.DTYPE_UINT16,
    np.dtype(np.int32): pb.DTYPE_INT32,
    np.dtype(np.uint32): pb.DTYPE_UINT32,
    np.dtype(np.int64): pb.DTYPE_INT64,
    np.dtype(np.uint64): pb.DTYPE_UINT64,
    np.dtype(np.float16): pb.DTYPE_FLOAT16,
    np.dtype(np.float32): pb.DTYPE_FLOAT32,
    np.dtype(np.float64): pb.DTYPE_FLOAT64,
}
# Wire dtypes are always little-endian.
_FROM_PROTO: dict[int, np.dtype] = {v: k.newbyteorder("<") for k, v in _DTYPES.items()}

AUTORESET_TO_PROTO = {
    gym.vector.AutoresetMode.NEXT_STEP: pb.AUTORESET_MODE_NEXT_STEP,
    gym.vector.AutoresetMode.SAME_STEP: pb.AUTORESET_MODE_SAME_STEP,
    gym.vector.AutoresetMode.DISABLED: pb.AUTORESET_MODE_DISABLED,
}
AUTORESET_FROM_PROTO = {v: k for k, v in AUTORESET_TO_PROTO.items()}


def decode_autoreset_mode(code: pb.AutoresetMode, where: Where = "autoreset_mode") -> gym.vector.AutoresetMode:
    """The gymnasium autoreset mode of a wire ``AutoresetMode`` value; CodecError naming ``where``
    otherwise: AUTORESET_MODE_UNSPECIFIED (0), a mode not set, told apart from a mode newer than this side."""
    try:
        return AUTORESET_FROM_PROTO[code]
    except KeyError:
        pass
    known = "AUTORESET_MODE_NEXT_STEP (1), AUTORESET_MODE_SAME_STEP (2) or AUTORESET_MODE_DISABLED (3)"
    if code == pb.AUTORESET_MODE_UNSPECIFIED:
        raise CodecError(f"{where}: not set (AUTORESET_MODE_UNSPECIFIED); required: {known}")
    raise CodecError(
        f"{where}: unknown autoreset mode {code} (a mode newer than this side's envfleet: upgrade it); this side "
        f"knows {known}"
    )


# A tensor may not claim more elements than this (2**31), whatever its data says: a guard against
# shapes whose product overflows or asks for absurd allocations.
_MAX_ELEMENTS = 1 << 31
# Nor more dimensions than this (numpy's own limit is 32 or 64, depending on its version).
_MAX_DIMS = 32
# The string arrays of one value (a request's actions or options, a response's infos) may take at
# most this many bytes once decoded, in all; encode_value counts them as decode_value does. numpy stores every
# string of an array as wide as the longest, 4 bytes a character: without a bound, a message of a
# few KB (one long string and many empty ones) would ask for GBs. Decoded, a value's strings may
# take as much memory as the largest message may take on the wire.
MAX_STRING_ARRAY_BYTES = MAX_MESSAGE_BYTES
# Nor may one value hold more values than this, itself and the nested ones (every dict entry, list
# or tuple item and object-array item is one, whatever it holds: an array is one). Each becomes
# Python objects, a numpy array for an array, of 15 to ~450 bytes decoded (an empty string array the
# most), from as little as 4 bytes on the wire: without a bound, a 64 MiB message could ask for GBs.
# Real values hold far fewer: an observation or action is one array or a dict/tuple of a few; a
# step's infos, tens of keys, and under SameStep autoreset an object array of one item per env,
# each an env's own info dict: ~12 values per env for a 1024-env server of 10-key infos, 12,000.
# At most ~45 MB decoded. (Not bounded here: protobuf's parse of the message, before it is decoded,
# ~60-150 bytes a value: a request of 64 MiB of tiny values takes > 1 GB to parse.)
MAX_VALUE_NODES = 100_000


def _dtype_code(dtype: np.dtype, where: str) -> pb.DType:
    code = _DTYPES.get(dtype.newbyteorder("=")) if dtype.byteorder in "<>" else _DTYPES.get(dtype)
    if code is None:
        supported = ", ".join(sorted(str(d) for d in _DTYPES))
        raise CodecError(f"{where}: dtype {dtype} cannot be sent; supported dtypes: {supported}")
    return code


# The wire dtypes this side knows, as an error lists them.
_DTYPE_NAMES = "DTYPE_BOOL (1), DTYPE_INT8..DTYPE_UINT64 (2-9), DTYPE_FLOAT16..DTYPE_FLOAT64 (10-12)"


def np_dtype(code: int, where: Where = "dtype", *, required: str = "") -> np.dtype:
    """The numpy dtype of a wire ``DType`` value; CodecError naming ``where`` otherwise.

    DTYPE_UNSPECIFIED (0) is a dtype not set (a peer that left the field out: proto3 sends no zero),
    said so, with ``required`` (why the field needs one, what to send) where given, else the valid
    ones; only another number is one this side does not know, which a newer envfleet may send.
    """
    try:
        return _FROM_PROTO[code]
    except KeyError:
        pass
    if code == pb.DTYPE_UNSPECIFIED:
        raise CodecError(f"{where}: not set (DTYPE_UNSPECIFIED); {required or f'expected one of {_DTYPE_NAMES}'}")
    raise CodecError(
        f"{where}: unknown dtype {code} (a dtype newer than this side's envfleet: upgrade it); this side knows "
        f"{_DTYPE_NAMES}"
    )


# ---------------------------------------------------------------------------------------------
# Tensors


def encode_tensor(array: Any, out: pb.Tensor, where: str = "tensor") -> pb.Tensor:
    """Fill ``out`` with ``array`` (any array-like of a supported dtype) and return it."""
    arr = np.asarray(array)
    out.dtype = _dtype_code(arr.dtype, where)
    out.shape[:] = arr.shape
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _LITTLE):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    out.data = arr.tobytes()
    return out


def decode_tensor(
    tensor: pb.Tensor, where: Where = "tensor", *, writeable: bool = False, expected: str = ""
) -> np.ndarray:
    """The array a ``Tensor`` carries: a read-only view of the message's bytes, no copy; with
    ``writeable``, a copy of them (for an env, which may change its action in place).

    ``expected``: what the field holds (``"4 float64 rewards, one per env"``), which the error for an
    empty Tensor says: no dtype, shape or data is a field the peer did not set (proto3 reads a field
    left out as an empty message), not a dtype this side does not know.
    """
    dtype = _FROM_PROTO.get(tensor.dtype)
    if dtype is None:  # (raises, naming where: a Path's text is made only then)
        if not tensor.shape and not tensor.data and tensor.dtype == pb.DTYPE_UNSPECIFIED:
            raise CodecError(f"{where}: not set (an empty Tensor: no dtype, shape or data){_expected(expected)}")
        dtype = np_dtype(tensor.dtype, f"{where}.dtype")
    shape = tuple(tensor.shape)
    count = _element_count(shape, where)
    data = tensor.data  # (read once: each read of the field makes a new bytes object)
    if len(data) != count * dtype.itemsize:
        raise CodecError(
            f"{where}.data: shape {list(shape)} of {dtype.newbyteorder('=')} needs "
            f"{count * dtype.itemsize} bytes, got {len(data)}"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    if not _LITTLE:
        arr = arr.astype(dtype.newbyteorder("="))  # (a copy: writeable)
    elif writeable:
        arr = arr.copy()
    return arr


_LITTLE = np.little_endian


def _expected(what: str) -> str:
    return f": expected {what}" if what else ""


# ---------------------------------------------------------------------------------------------
# Where in a value: error messages name it.


class Path:
    """Where in a value being decoded: ``parent`` and one step down (a dict key, or an index), said as
    ``actions['obs'][3]``. Only an error's message says it, so its text is made then, not at every
    step down (a decoded value of many nested dicts would make one string per level, each holding
    the keys above it: a request of 3.7 MB of long keys 45 dicts deep took 89 MB that way); and it
    is bounded, whatever the keys sent: each key shown up to _KEY_CHARS characters, and at most
    _HEAD_STEPS + _TAIL_STEPS steps (the first and the last)."""

    __slots__ = ("parent", "step")

    def __init__(self, parent: Where, step: str | int) -> None:
        self.parent = parent
        self.step = step

    def __str__(self) -> str:
        steps: list[str | int] = []
        place: Where = self
        while isinstance(place, Path):
            steps.append(place.step)
            place = place.parent
        steps.reverse()
        if len(steps) > _HEAD_STEPS + _TAIL_STEPS:
            left_out = len(steps) - _HEAD_STEPS - _TAIL_STEPS
            shown = [_step_text(x) for x in steps[:_HEAD_STEPS]] + [f"[... {left_out} levels ...]"]
            shown += [_step_text(x) for x in steps[-_TAIL_STEPS:]]
        else:
            shown = [_step_text(x) for x in steps]
        return str(place) + "".join(shown)

    def __repr__(self) -> str:
        return f"Path({str(self)!r})"


Where = str | Path
"""What names a place in a value for error messages: a plain name (``"actions"``), or a :class:`Path` in it."""

# A key longer than this is shown cut, with its length.
_KEY_CHARS = 40
# A path deeper than _HEAD_STEPS + _TAIL_STEPS shows its first and last steps, and how many are left out.
_HEAD_STEPS = 3
_TAIL_STEPS = 5


def _step_text(step: str | int) -> str:
    return f"[{step}]" if isinstance(step, int) else f"[{key_text(step)}]"


def key_text(key: Any) -> str:
    """A dict key a client sent, as an error shows it: its repr, a str cut to _KEY_CHARS characters (with
    its length), any other key's repr cut likewise."""
    if isinstance(key, str) and len(key) > _KEY_CHARS:
        return f"{key[:_KEY_CHARS]!r}... ({len(key)} characters)"
    text = repr(key)
    return text if len(text) <= _KEY_CHARS else f"{text[:_KEY_CHARS]}..."


# ---------------------------------------------------------------------------------------------
# Values: arrays, nested dicts/tuples, and the plain Python values found in infos.


class _Budget:
    """What the rest of one value may still take, decoded: bytes of string arrays, and values
    (the value itself is counted already). Encoding charges what decoding will, in the same order."""

    __slots__ = ("nodes", "strings")

    def __init__(self) -> None:
        self.strings = MAX_STRING_ARRAY_BYTES
        self.nodes = MAX_VALUE_NODES - 1

    def take_nodes(self, count: int, what: str, where: Where) -> None:
        """Charge the ``count`` items of a container (``what``: "a list", ...), before any is decoded."""
        if count > self.nodes:
            total = MAX_VALUE_NODES - self.nodes + count
            raise CodecError(
                f"{where}: more than {MAX_VALUE_NODES} values/arrays in one value ({what} of {count} items makes "
                f"{total}; every dict entry, list or tuple item and object-array item counts one, nested ones "
                "too); send many numbers or strings as one numpy array"
            )
        self.nodes -= count

    def take_string_bytes(self, count: int, width: int, where: Where, suffix: str = "") -> None:
        """Charge a string array of ``count`` strings of up to ``width`` characters."""
        need = _string_bytes(count, width)
        if need > self.strings:
            limit = MAX_STRING_ARRAY_BYTES
            at_most = (
                f"at most {limit}"
                if self.strings == limit
                else f"only {self.strings} of the {limit} that the string arrays of one value may take are left"
            )
            what = f"of up to {width} characters would take" if width > 1 else "would take at least"
            raise CodecError(
                f"{where}: a string array of {count} strings {what} {need} bytes decoded (numpy stores every "
                f"string as wide as the longest, 4 bytes a character); {at_most}{suffix}"
            )
        self.strings -= need

    def give_back_string_bytes(self, count: int, width: int) -> None:
        """Undo :meth:`take_string_bytes`'s charge of the same array (one that goes as something else)."""
        self.strings += _string_bytes(count, width)


def _string_bytes(count: int, width: int) -> int:
    """What a string array of ``count`` strings of up to ``width`` characters takes decoded (numpy's 4 bytes a
    character, every string as wide as the longest)."""
    return count * width * 4


Unsendable = Callable[[Any, str, str], Any]
"""``unsendable(value, where, reason)`` -> what :func:`encode_value` sends in place of ``value``, a part
that has no wire form (its type, a dict key of it, its dtype, an int past 64 bits; ``reason`` says which,
as the CodecError would), found at ``where``: its repr, say; or it raises CodecError to refuse. What it
gives is encoded in turn, with the same ``unsendable``: it must not give back what it was given."""


def encode_value(obj: Any, out: pb.Value, where: str = "value", *, unsendable: Unsendable | None = None) -> pb.Value:
    """Fill ``out`` with ``obj`` and return it; raises CodecError naming ``where`` otherwise.

    What is encoded, :func:`decode_value` decodes: the same bounds (MAX_STRING_ARRAY_BYTES,
    MAX_VALUE_NODES) hold for the whole of ``obj``, counted as the receiver counts them.

    ``unsendable``: what to send instead of a part of ``obj`` that no wire form carries (the server's
    infos: an env may put anything there, and one value must not cost the step); without it, such a
    part raises CodecError. Bounds exceeded raise either way.
    """
    if unsendable is None and type(obj) is np.ndarray and obj.dtype.kind not in "OU":  # (the hot path: obs, actions)
        encode_tensor(obj, out.tensor, where)  # (no budget to charge; its dtype is checked before it is written)
        return out
    return _encode_value(obj, out, where, _Budget(), unsendable)


def _cannot_send(
    obj: Any, out: pb.Value, where: str, reason: str, budget: _Budget, unsendable: Unsendable | None
) -> None:
    """Send what ``unsendable`` gives for ``obj`` instead, or raise CodecError "``where``: ``reason``" without it."""
    if unsendable is None:
        raise CodecError(f"{where}: {reason}")
    out.Clear()  # (what was written of ``obj`` before its problem showed; nothing of it was charged)
    _encode_value(unsendable(obj, where, reason), out, where, budget, unsendable)


def _encode_value(obj: Any, out: pb.Value, where: str, budget: _Budget, unsendable: Unsendable | None) -> pb.Value:
    """:func:`encode_value`, charging ``budget`` (shared with the rest of the value) what decoding will."""
    # Order matters: bool before int (bool is an int), numpy scalars before Python numbers.
    if isinstance(obj, np.ndarray):
        kind = obj.dtype.kind
        if kind == "O":
            budget.take_nodes(obj.size, "an object array", where)
            out.objects.shape[:] = obj.shape
            for i, item in enumerate(obj.flat):
                _encode_value(item, out.objects.values.add(), f"{where}[{i}]", budget, unsendable)
        elif kind == "U":
            # The width the receiver's array will have: that of the longest string (at least 1).
            width = 1 if obj.size * 4 > budget.strings else max(1, int(np.char.str_len(obj).max(initial=0)))
            budget.take_string_bytes(obj.size, width, where, "; it cannot be sent")
            try:
                out.strings.values.extend(str(s) for s in obj.flat)
            except UnicodeEncodeError as err:
                budget.give_back_string_bytes(obj.size, width)  # (what goes instead is charged)
                _cannot_send(obj, out, where, _not_unicode(err), budget, unsendable)
                return out
            out.strings.shape[:] = obj.shape
        else:
            _encode_array(obj, out, out.tensor, where, budget, unsendable)
    elif isinstance(obj, np.generic):
        if isinstance(obj, np.str_):
            _encode_text(str(obj), out, where, budget, unsendable)
        else:
            _encode_array(obj, out, out.scalar, where, budget, unsendable)
    elif obj is None:
        out.none.SetInParent()
    elif isinstance(obj, bool):
        out.boolean = obj
    elif isinstance(obj, int):
        if -(1 << 63) <= obj < (1 << 63):
            out.int64 = obj
        else:
            _cannot_send(obj, out, where, f"int {obj} does not fit in 64 bits", budget, unsendable)
    elif isinstance(obj, float):
        out.float64 = obj
    elif isinstance(obj, str):
        _encode_text(obj, out, where, budget, unsendable)
    elif isinstance(obj, bytes):
        out.raw = obj
    elif isinstance(obj, Mapping):
        # (every key checked before any item is encoded or charged: unsendable's value replaces it whole)
        bad = next((key for key in obj if not isinstance(key, str) or not _unicode(key)), _ALL_STR)
        if bad is not _ALL_STR:
            if isinstance(bad, str):
                reason = f"dict key {bad!r} is not valid Unicode (a lone surrogate); it cannot be sent"
            else:
                reason = f"dict key {bad!r} is a {type(bad).__name__}; only str keys can be sent"
            _cannot_send(obj, out, where, reason, budget, unsendable)
            return out
        budget.take_nodes(len(obj), "a dict", where)
        out.map.SetInParent()
        for key, item in obj.items():
            out.map.keys.append(key)
            _encode_value(item, out.map.values.add(), f"{where}[{key!r}]", budget, unsendable)
    elif isinstance(obj, tuple):
        budget.take_nodes(len(obj), "a tuple", where)
        out.tuple.SetInParent()
        for i, item in enumerate(obj):
            _encode_value(item, out.tuple.values.add(), f"{where}[{i}]", budget, unsendable)
    elif isinstance(obj, list):
        budget.take_nodes(len(obj), "a list", where)
        out.list.SetInParent()
        for i, item in enumerate(obj):
            _encode_value(item, out.list.values.add(), f"{where}[{i}]", budget, unsendable)
    else:
        reason = (
            f"cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}; "
            "supported: numpy arrays and scalars, dict (str keys), tuple, list, str, bytes, int, float, bool, None"
        )
        _cannot_send(obj, out, where, reason, budget, unsendable)
    return out


_ALL_STR = object()  # (no dict key that is not a str)


def _unicode(text: str) -> bool:
    """Whether ``text`` can be sent (protobuf's strings are UTF-8: no lone surrogates, which a str decoded
    with errors="surrogateescape" holds: a file name or an environment variable of bytes that are not UTF-8)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_unicode(err: UnicodeEncodeError) -> str:
    """Why a str cannot be sent, from the error its encoding raised."""
    return f"a str that is not valid Unicode ({err.object[err.start : err.end]!r} at {err.start}: a lone surrogate)"


def _encode_text(text: str, out: pb.Value, where: str, budget: _Budget, unsendable: Unsendable | None) -> None:
    """``text`` into ``out``, or what ``unsendable`` gives where it cannot be sent."""
    try:
        out.text = text
    except UnicodeEncodeError as err:
        _cannot_send(text, out, where, _not_unicode(err), budget, unsendable)


def _encode_array(
    obj: np.ndarray | np.generic,
    out: pb.Value,
    tensor: pb.Tensor,
    where: str,
    budget: _Budget,
    unsendable: Unsendable | None,
) -> None:
    """Encode a numeric array or scalar into ``tensor`` (a field of ``out``), or send what ``unsendable``
    gives where its dtype has no wire form (complex, datetime, bytes, ...)."""
    try:
        encode_tensor(obj, tensor, where)  # (the dtype is checked before anything is written)
    except CodecError as err:
        if unsendable is None:
            raise
        _cannot_send(obj, out, where, str(err).removeprefix(f"{where}: "), budget, unsendable)


def decode_value(value: pb.Value, where: Where = "value", *, writeable: bool = False) -> Any:
    """The Python object a ``Value`` carries (inverse of :func:`encode_value`).

    Its arrays are read-only views of the message's bytes; with ``writeable``, copies: what the
    server hands an env (actions, reset options), which may change them in place as it may under
    gymnasium's own vector envs (``np.clip(action, ..., out=action)``). The items of object arrays are
    always copies (an env's own values under gymnasium: final_obs, say).

    Raises CodecError for a message that cannot be decoded, including one that would take more
    memory than it may (see MAX_STRING_ARRAY_BYTES and MAX_VALUE_NODES), never MemoryError.
    """
    try:
        if value.WhichOneof("kind") == "tensor":  # (the hot path: observations, actions; nothing to charge)
            return decode_tensor(value.tensor, where, writeable=writeable)
        return _decode_value(value, where, _Budget(), writeable)
    except MemoryError as err:
        message = f"{where}: too large to decode (MemoryError: {err})"
    # (raised here, outside the except block: the MemoryError's traceback, and the frames and
    # partial results it holds, are freed now, not when the CodecError is)
    raise CodecError(message)


def _decode_value(value: pb.Value, where: Where, budget: _Budget, writeable: bool) -> Any:
    """:func:`decode_value`, charging ``budget`` (shared with the rest of the value)."""
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        return decode_tensor(value.tensor, where, writeable=writeable)
    if kind == "scalar":
        scalar = decode_tensor(value.scalar, where)
        if scalar.ndim != 0:
            raise CodecError(f"{where}: a scalar must have an empty shape, got {list(scalar.shape)}")
        return scalar[()]
    if kind == "map":
        keys, values = value.map.keys, value.map.values
        if len(keys) != len(values):
            raise CodecError(f"{where}: map has {len(keys)} keys but {len(values)} values")
        if len(set(keys)) != len(keys):
            raise CodecError(f"{where}: map has duplicate keys")
        budget.take_nodes(len(values), "a dict", where)
        return {k: _decode_value(v, Path(where, k), budget, writeable) for k, v in zip(keys, values, strict=False)}
    if kind == "tuple":
        budget.take_nodes(len(value.tuple.values), "a tuple", where)
        return tuple(_decode_value(v, Path(where, i), budget, writeable) for i, v in enumerate(value.tuple.values))
    if kind == "list":
        budget.take_nodes(len(value.list.values), "a list", where)
        return [_decode_value(v, Path(where, i), budget, writeable) for i, v in enumerate(value.list.values)]
    if kind == "objects":
        shape = _checked_shape(value.objects.shape, len(value.objects.values), where)
        budget.take_nodes(len(value.objects.values), "an object array", where)
        arr = np.empty(len(value.objects.values), dtype=object)
        for i, v in enumerate(value.objects.values):
            # (writeable copies: an object array holds what an env gave, its own arrays under gymnasium,
            # such as final_obs; at episode ends, or values without arrays: no cost on a step's hot path)
            arr[i] = _decode_value(v, Path(where, i), budget, True)
        return arr.reshape(shape)
    if kind == "strings":
        return _decode_strings(value.strings, where, budget)
    if kind == "text":
        return value.text
    if kind == "float64":
        return value.float64
    if kind == "int64":
        return value.int64
    if kind == "boolean":
        return value.boolean
    if kind == "raw":
        return value.raw
    if kind == "none":
        return None
    raise CodecError(_empty_oneof(value, where, "value"))


def _empty_oneof(msg: pb.Value | pb.Space, where: Where, what: str) -> str:
    """Why ``msg`` (a Value or a Space: a oneof, of which none of the kinds this side knows is set) cannot
    be decoded: nothing set at all is a field the peer left out (proto3 reads it as an empty message);
    anything else is a kind this side does not know (its fields come as unknown ones), which a newer
    envfleet may send."""
    if msg.ByteSize() == 0:
        return f"{where}: not set (an empty {type(msg).__name__}: none of its kinds is set)"
    return (
        f"{where}: {what} of a kind this side does not know (none of the kinds it knows is set; one newer than "
        "this side's envfleet: upgrade it)"
    )


def _decode_strings(strings: pb.StringArray, where: Where, budget: _Budget) -> np.ndarray:
    """The numpy string array ``strings`` carries, once its shape and the memory it would take are checked."""
    values = strings.values
    count = len(values)
    shape = _checked_shape(strings.shape, count, where)
    # The array's width, found one string at a time (a list of them all could itself be large);
    # not even looked for where the strings are too many at 1 character each (numpy's least width).
    width = 1 if count * 4 > budget.strings else max(1, max(map(len, values), default=0))
    budget.take_string_bytes(count, width, where)
    arr = np.fromiter(values, dtype=f"<U{width}", count=count)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _element_count(shape: tuple[int, ...], where: Where) -> int:
    """How many elements an array of ``shape`` has; CodecError for a shape numpy cannot make: too
    many dimensions, a negative one, or too large, zero-sized dimensions aside (numpy refuses
    (0, 2**31, 2**31) as it refuses (2**31, 2**31))."""
    if len(shape) > _MAX_DIMS:
        raise CodecError(f"{where}.shape: expected at most {_MAX_DIMS} dimensions, got {len(shape)}")
    count = nonzero = 1
    for dim in shape:
        if dim < 0:
            raise CodecError(f"{where}.shape: dimensions must be >= 0, got {list(shape)}")
        count *= dim
        nonzero *= max(dim, 1)
        if nonzero > _MAX_ELEMENTS:
            raise CodecError(
                f"{where}.shape: {list(shape)} is too large (its nonzero dimensions make more than "
                f"{_MAX_ELEMENTS} elements)"
            )
    return count


def _checked_shape(shape: Any, count: int, where: Where) -> tuple[int, ...]:
    dims = tuple(shape)
    total = _element_count(dims, where)
    if total != count:
        raise CodecError(f"{where}: shape {list(dims)} needs {total} values, got {count}")
    return dims


# ---------------------------------------------------------------------------------------------
# Spaces

_INT64 = np.iinfo(np.int64)  # (DiscreteSpace's n and start)


def encode_space(
    space: gym.Space[Any], out: pb.Space | None = None, where: str = "space", *, compact: bool = False
) -> pb.Space:
    """The message describing ``space`` in full; UnsupportedSpaceError for spaces we do not carry.

    ``compact``: a Box's bounds (and unbounded masks) that hold one value in every element go as that
    value with the Box's shape (BoxSpace.shape), for a peer that said it reads them so
    (GetSpecRequest.accepts_compact_bounds): a camera's bounds take bytes, not twice a frame's."""
    out = pb.Space() if out is None else out
    if isinstance(space, gym.spaces.Discrete | gym.spaces.Box | gym.spaces.MultiDiscrete):
        # (a dtype the wire has no code for, float128 say: the space cannot be carried, as a Text space cannot)
        try:
            _dtype_code(space.dtype, f"{where}.dtype")
        except CodecError as err:
            raise UnsupportedSpaceError(f"{err} (the dtype of {space})") from None
    if isinstance(space, gym.spaces.Discrete):
        n, start = int(space.n), int(space.start)
        if not (_INT64.min <= start and start + n - 1 <= _INT64.max and n <= _INT64.max):  # (uint64's may not be)
            raise UnsupportedSpaceError(
                f"{where}: {space} has values up to {start + n - 1}; envfleet carries Discrete spaces whose "
                "values are within int64"
            )
        out.discrete.n, out.discrete.start = n, start
        out.discrete.dtype = _dtype_code(space.dtype, where)
    elif isinstance(space, gym.spaces.Box):
        fields = [("low", space.low), ("high", space.high)]
        if space.dtype.kind != "f":  # (an integer Box made with infinite bounds: its bounds cannot say so)
            for name, bounded in (("unbounded_below", space.bounded_below), ("unbounded_above", space.bounded_above)):
                if not bounded.all():
                    fields.append((name, ~bounded))
        for name, array in fields:
            # (a Box of one element or none is sent as it is: nothing to save, and no shape to send)
            one = _one_value(array) if compact and array.size > 1 else None
            encode_tensor(array if one is None else one, getattr(out.box, name), f"{where}.{name}")
            if one is not None:
                out.box.shape[:] = space.shape
    elif isinstance(space, gym.spaces.MultiDiscrete):
        encode_tensor(space.nvec, out.multi_discrete.nvec, f"{where}.nvec")
        encode_tensor(space.start, out.multi_discrete.start, f"{where}.start")
    elif isinstance(space, gym.spaces.MultiBinary):
        out.multi_binary.shape[:] = space.shape
        out.multi_binary.flat = isinstance(space.n, int)
    elif isinstance(space, gym.spaces.Tuple):
        out.tuple.SetInParent()
        for i, sub in enumerate(space.spaces):
            encode_space(sub, out.tuple.spaces.add(), f"{where}[{i}]", compact=compact)
    elif isinstance(space, gym.spaces.Dict):
        out.dict.SetInParent()
        for key, sub in space.spaces.items():
            if not isinstance(key, str):  # (the wire's keys are strings; a learner's would differ from the env's)
                raise UnsupportedSpaceError(
                    f"{where}: {space} (Dict) has the key {key!r} ({type(key).__name__}); envfleet carries Dict "
                    "spaces whose keys are str"
                )
            out.dict.keys.append(key)
            encode_space(sub, out.dict.spaces.add(), f"{where}[{key!r}]", compact=compact)
    else:
        raise UnsupportedSpaceError(
            f"{where}: {space} ({type(space).__name__}) is not supported; envfleet carries Discrete, Box, "
            "MultiDiscrete, MultiBinary, and Tuple/Dict of these"
        )
    return out


def _one_value(array: np.ndarray) -> np.ndarray | None:
    """``array``'s one value, as an array of shape (), where every element has the same bits (so -0.0 and 0.0
    differ, and a NaN is the same as the same NaN only: the value sent is each element's, bit for bit); None
    otherwise, or for an empty array."""
    flat = array.reshape(-1)
    if not flat.size:
        return None
    bits = flat.view(f"u{flat.dtype.itemsize}")  # (bool, ints, floats: 1, 2, 4 or 8 bytes an element)
    if not (bits == bits[0]).all():
        return None
    return flat[:1].reshape(())


_BOX_FIELDS = ("low", "high", "unbounded_below", "unbounded_above")


def compact_bounds(msg: pb.Space) -> pb.Space:
    """A copy of ``msg`` whose Boxes send compact what :func:`encode_space` with ``compact`` would (bounds and
    masks of one value in every element, as that value, with the Box's shape): the same message whichever form
    the server sent, so that the spaces of two servers (one older than compact bounds, one not) compare as
    their spaces do. A Box this side cannot read, or whose fields disagree, stays as it came."""
    out = pb.Space()
    out.CopyFrom(msg)
    _compact_in_place(out)
    return out


def _compact_in_place(msg: pb.Space) -> None:
    kind = msg.WhichOneof("kind")
    if kind == "tuple":
        for sub in msg.tuple.spaces:
            _compact_in_place(sub)
    elif kind == "dict":
        for sub in msg.dict.spaces:
            _compact_in_place(sub)
    elif kind == "box" and not msg.box.shape:
        box = msg.box
        try:
            arrays = {name: decode_tensor(getattr(box, name)) for name in _BOX_FIELDS if box.HasField(name)}
        except CodecError:
            return
        shapes = {array.shape for array in arrays.values()}
        if len(shapes) != 1 or "low" not in arrays or arrays["low"].size <= 1:
            return
        for name, array in arrays.items():
            one = _one_value(array)
            if one is not None:
                encode_tensor(one, getattr(box, name))
                box.shape[:] = array.shape


# Compact Boxes of one space may take at most this many bytes, a bound's worth, once made full (what the
# learner's gymnasium Box holds, twice): a few bytes on the wire could otherwise ask for 2**31 float64s (16
# GB) a bound. More than this is more than any message carries of the space's samples (an observation,
# an action), so no env that could be served is refused.
MAX_COMPACT_BOX_BYTES = MAX_MESSAGE_BYTES


def decode_space(msg: pb.Space, where: str = "space") -> gym.Space[Any]:
    """The gymnasium space a ``Space`` message describes, its Boxes' bounds at full shape or compact
    (see :func:`encode_space`); CodecError naming the field for one that does not describe a space."""
    return _decode_space(msg, where, [MAX_COMPACT_BOX_BYTES])


def _decode_space(msg: pb.Space, where: str, room: list[int]) -> gym.Space[Any]:
    """:func:`decode_space`; ``room``: the bytes that compact Boxes of the space may still take made full."""
    kind = msg.WhichOneof("kind")
    try:
        if kind == "discrete":
            d = msg.discrete
            dtype = np_dtype(d.dtype, f"{where}.dtype", required=_DISCRETE_DTYPE)
            if d.start + d.n - 1 > _INT64.max:  # (each is an int64; their last value must be one too)
                raise CodecError(
                    f"{where}: Discrete with n {d.n} and start {d.start} has values past int64 (up to "
                    f"{d.start + d.n - 1}); expected start + n - 1 <= {_INT64.max}"
                )
            return gym.spaces.Discrete(d.n, start=d.start, dtype=dtype)
        if kind == "box":
            return _decode_box(msg.box, where, room)
        if kind == "multi_discrete":
            nvec = decode_tensor(
                msg.multi_discrete.nvec,
                f"{where}.nvec",
                expected="the number of values of each element, of the MultiDiscrete's shape and dtype",
            )
            start = decode_tensor(
                msg.multi_discrete.start, f"{where}.start", expected="the smallest value of each element, as nvec"
            )
            return gym.spaces.MultiDiscrete(nvec, dtype=nvec.dtype, start=start)
        if kind == "multi_binary":
            shape = list(msg.multi_binary.shape)
            flat = msg.multi_binary.flat and len(shape) == 1
            return gym.spaces.MultiBinary(shape[0] if flat else shape)
        if kind == "tuple":
            return gym.spaces.Tuple([_decode_space(s, f"{where}[{i}]", room) for i, s in enumerate(msg.tuple.spaces)])
        if kind == "dict":
            pairs = [
                (k, _decode_space(s, f"{where}[{k!r}]", room))
                for k, s in zip(msg.dict.keys, msg.dict.spaces, strict=False)
            ]
            return gym.spaces.Dict(dict(pairs), sort_keys=False)
    except CodecError:
        raise
    except (ValueError, TypeError, AssertionError) as err:
        raise CodecError(f"{where}: invalid {kind} space: {err}") from err
    raise CodecError(_empty_oneof(msg, where, "space"))


def _decode_box(box: pb.BoxSpace, where: str, room: list[int]) -> gym.spaces.Box:
    """The Box a ``BoxSpace`` describes, each field at full shape or compact (shape [], with ``box.shape``)."""
    low = decode_tensor(box.low, f"{where}.low", expected="the Box's lower bounds, of its shape and dtype")
    high = decode_tensor(box.high, f"{where}.high", expected="the Box's upper bounds, as low")
    masks = {
        name: decode_tensor(getattr(box, name), f"{where}.{name}", expected="a bool array of the Box's shape")
        for name in ("unbounded_below", "unbounded_above")
        if box.HasField(name)  # (an integer Box made with infinite bounds)
    }
    fields = {"low": low, "high": high, **masks}
    if box.shape:
        shape = tuple(box.shape)
        count = _element_count(shape, where)  # (its errors name f"{where}.shape")
        # (in the widest field's dtype, which np.full below makes: a float64 high beside a uint8 low takes 8 times
        # low's bytes)
        dtype = max((array.dtype for array in fields.values()), key=lambda d: d.itemsize)
        need = count * dtype.itemsize
        if need > room[0]:
            left = "" if room[0] == MAX_COMPACT_BOX_BYTES else f" (only {room[0]:,} are left of them)"
            raise CodecError(
                f"{where}.shape: {list(shape)} of {dtype.newbyteorder('=')} would take {need:,} bytes a bound; "
                f"expected compact Boxes of at most {MAX_COMPACT_BOX_BYTES:,} bytes in one space{left}, more "
                "than a message can carry of its samples"
            )
        room[0] -= need
        for name, array in fields.items():
            if array.ndim == 0:  # (compact: one value for every element)
                fields[name] = np.full(shape, array, dtype=array.dtype)
            elif array.shape != shape:
                raise CodecError(
                    f"{where}.{name}: expected shape {list(shape)} (the Box's, BoxSpace.shape) or [] (one value for "
                    f"every element), got {list(array.shape)}"
                )
    else:
        compact = [name for name, array in fields.items() if array.ndim == 0]
        full = [name for name, array in fields.items() if array.ndim != 0]
        if compact and full:
            raise CodecError(
                f"{where}.shape: not set, but {compact[0]} is one value (shape [], compact) and {full[0]} has shape "
                f"{list(fields[full[0]].shape)}; expected the Box's shape beside a compact bound"
            )
    shape = fields["low"].shape
    for name in masks:
        mask = fields[name]
        if mask.dtype != np.bool_ or mask.shape != shape:
            raise CodecError(
                f"{where}.{name}: expected a bool array of shape {list(shape)}, got {mask.dtype} of shape "
                f"{list(mask.shape)}"
            )
    space = gym.spaces.Box(low=fields["low"], high=fields["high"], dtype=low.dtype)
    for name in masks:
        bounded = "bounded_below" if name == "unbounded_below" else "bounded_above"
        setattr(space, bounded, getattr(space, bounded) & ~fields[name])
    return space


# (the proto's "(gymnasium's default is int64)" read as optional to one server's author: it is not)
_DISCRETE_DTYPE = (
    "a DiscreteSpace's dtype is required: the integer dtype of its samples, DTYPE_INT64 for gymnasium's Discrete "
    "default (any of DTYPE_INT8..DTYPE_UINT64)"
)
