"""Every supported space, dtype and value round-trips through the codec (property-based)."""

from __future__ import annotations

from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector.utils import batch_space
from hypothesis import given, settings
from hypothesis import strategies as st

from env_server import codec
from env_server.rpc import env_pb2 as pb
from tests.compare import assert_same

INT_DTYPES: list[type[np.integer]] = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
FLOAT_DTYPES: list[type[np.floating]] = [np.float16, np.float32, np.float64]
ALL_DTYPES: list[type[np.generic]] = [np.bool_, *INT_DTYPES, *FLOAT_DTYPES]

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def boxes(draw: st.DrawFn) -> gym.spaces.Box:
    dtype = draw(st.sampled_from([*INT_DTYPES, *FLOAT_DTYPES]))
    shape = draw(shapes)
    if np.dtype(dtype).kind == "f":
        low = draw(st.sampled_from([-np.inf, -10.0, -1.0, 0.0]))
        high = draw(st.sampled_from([np.inf, 1.0, 10.0]))
    else:
        assert issubclass(dtype, np.integer)
        info = np.iinfo(dtype)
        low = draw(st.integers(int(info.min), 0))
        high = draw(st.integers(1, int(min(info.max, 2**62))))
        # (gymnasium makes a signed integer Box with infinite bounds unbounded there; not int64's, as
        # batch_space forgets it and the batch's sample() overflows computing int64's whole range)
        if info.min < 0 and dtype is not np.int64:
            low, high = draw(st.sampled_from([low, -np.inf])), draw(st.sampled_from([high, np.inf]))
    return gym.spaces.Box(low=low, high=high, shape=shape, dtype=dtype)


@st.composite
def discretes(draw: st.DrawFn) -> gym.spaces.Discrete[Any]:
    dtypes: list[type[np.integer]] = [np.int32, np.int64, np.uint8]
    dtype = draw(st.sampled_from(dtypes))
    if dtype is np.uint8:
        return gym.spaces.Discrete(draw(st.integers(1, 200)), start=draw(st.integers(0, 50)), dtype=dtype)
    return gym.spaces.Discrete(draw(st.integers(1, 1000)), start=draw(st.integers(-50, 50)), dtype=dtype)


@st.composite
def multi_discretes(draw: st.DrawFn) -> gym.spaces.MultiDiscrete:
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple))
    nvec = draw(st.lists(st.integers(1, 9), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    start = draw(st.lists(st.integers(-5, 5), min_size=len(nvec), max_size=len(nvec)))
    return gym.spaces.MultiDiscrete(np.array(nvec).reshape(shape), start=np.array(start).reshape(shape))


multi_binaries = st.one_of(
    st.integers(1, 6).map(gym.spaces.MultiBinary), shapes.filter(bool).map(lambda s: gym.spaces.MultiBinary(list(s)))
)
leaf_spaces = st.one_of(boxes(), discretes(), multi_discretes(), multi_binaries)
spaces = st.recursive(
    leaf_spaces,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda s: gym.spaces.Tuple(s)),
        st.dictionaries(st.text("abcdefgh_", min_size=1, max_size=6), children, min_size=1, max_size=3).map(
            lambda d: gym.spaces.Dict(d, sort_keys=False)
        ),
    ),
    max_leaves=6,
)


def _boundedness(space: gym.Space[Any]) -> Any:
    """Each Box's bounded_below and bounded_above, in the space's nesting (gymnasium's == leaves them out)."""
    if isinstance(space, gym.spaces.Box):
        return space.bounded_below.tolist(), space.bounded_above.tolist()
    if isinstance(space, gym.spaces.Tuple | gym.spaces.Dict):
        subs = space.spaces.items() if isinstance(space, gym.spaces.Dict) else enumerate(space.spaces)
        return [(key, _boundedness(sub)) for key, sub in subs]
    return None


def roundtrip(obj: Any) -> Any:
    msg = codec.encode_value(obj, pb.Value())
    return codec.decode_value(pb.Value.FromString(msg.SerializeToString()))


@settings(max_examples=200, deadline=None)
@given(spaces, st.integers(0, 2**32 - 1))
def test_space_and_samples_round_trip(space: gym.Space[Any], seed: int) -> None:
    msg = codec.encode_space(space)
    decoded = codec.decode_space(pb.Space.FromString(msg.SerializeToString()))
    assert decoded == space
    assert type(decoded) is type(space)
    assert repr(_boundedness(decoded)) == repr(_boundedness(space))  # (which sample() draws from)
    # Compact bounds (uniform ones as one value): the same space, and the message a full one compacts to.
    compact = codec.encode_space(space, compact=True)
    assert codec.compact_bounds(msg) == compact
    from_compact = codec.decode_space(pb.Space.FromString(compact.SerializeToString()))
    assert from_compact == space and repr(_boundedness(from_compact)) == repr(_boundedness(space))
    space.seed(seed)
    sample = space.sample()
    assert_same(roundtrip(sample), sample)
    batched = batch_space(space, 3)
    batched.seed(seed)
    batch = batched.sample()
    assert_same(roundtrip(batch), batch)
    assert batched.contains(roundtrip(batch))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 5), max_size=4), st.integers(0, 2**32 - 1))
def test_tensors_of_every_dtype_and_shape_round_trip(dtype: Any, shape: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    arr = np.asarray(rng.random(shape) * 100).astype(dtype)
    back = codec.decode_tensor(pb.Tensor.FromString(codec.encode_tensor(arr, pb.Tensor()).SerializeToString()))
    assert_same(back, arr)
    assert_same(roundtrip(arr), arr)
    if arr.ndim:
        swapped = arr.astype(arr.dtype.newbyteorder(">"))  # big-endian input goes out little-endian
        assert np.array_equal(roundtrip(swapped), arr)


info_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from(ALL_DTYPES).map(lambda d: np.arange(4).astype(d)),
    st.sampled_from(ALL_DTYPES).map(lambda d: np.dtype(d).type(1)),
)
info_values = st.recursive(
    info_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=5), children, max_size=3),
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(info_values)
@pytest.mark.slow
def test_info_values_round_trip(value: Any) -> None:
    assert_same(roundtrip(value), value)


def test_gymnasium_vector_infos_round_trip() -> None:
    objects = np.full(3, None, dtype=object)
    objects[1] = "text"
    objects[2] = np.zeros(2)
    infos = {
        "t": np.array([1, 2, 3]),
        "_t": np.array([True, True, False]),
        "label": objects,
        "_label": np.array([False, True, True]),
        "names": np.array(["a", "bb", "c"]),
        "episode": {"r": np.array([1.0, 0.0, 2.0]), "_r": np.array([True, False, True])},
        "_episode": np.array([True, False, True]),
    }
    assert_same(roundtrip(infos), infos)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"ok": 1, "bad": object()}, "value['bad']: cannot send a value of type builtins.object"),
        ({"nested": {"when": complex(1, 2)}}, "value['nested']['when']"),
        ({1: "int key"}, "dict key 1"),
        ({"big": 2**70}, "does not fit in 64 bits"),
        ({"c": np.zeros(2, dtype=np.complex64)}, "dtype complex64 cannot be sent"),
    ],
)
def test_unencodable_values_name_the_key(value: Any, fragment: str) -> None:
    with pytest.raises(codec.CodecError, match=None) as info:
        codec.encode_value(value, pb.Value())
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("tensor", "fragment"),
    [
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\0" * 4), "needs 8 bytes, got 4"),
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0"), "actions.dtype: not set (DTYPE_UNSPECIFIED)"),
        (pb.Tensor(dtype=cast(pb.DType, 77), shape=[1], data=b"\0"), "actions.dtype: unknown dtype 77"),
        (pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[-1], data=b""), "must be >= 0"),
        (pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[2**40, 2**40], data=b""), "more than"),
        # Zero elements, but numpy cannot make that shape all the same (a case the fuzz test found).
        (pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[0, 2**31, 2**31], data=b""), "is too large"),
    ],
)
def test_malformed_tensors_are_rejected(tensor: pb.Tensor, fragment: str) -> None:
    with pytest.raises(codec.CodecError) as info:
        codec.decode_tensor(tensor, "actions")
    assert fragment in str(info.value) and "actions" in str(info.value)


def test_a_tensor_left_out_is_said_not_set_with_what_was_expected() -> None:
    """A peer that leaves a Tensor field out (a server of another language that sends no rewards) sends
    nothing: read as an empty Tensor, it was said to have an "unknown or unset dtype 0" and to need an
    upgrade."""
    expected = "4 float64 rewards, one per env"
    with pytest.raises(codec.CodecError) as info:
        codec.decode_tensor(pb.Tensor(), "rewards", expected=expected)
    assert str(info.value) == f"rewards: not set (an empty Tensor: no dtype, shape or data): expected {expected}"
    with pytest.raises(codec.CodecError, match=r"^terminations: not set \(an empty Tensor: no dtype, shape or data\)$"):
        codec.decode_tensor(pb.Tensor(), "terminations")
    # Only the dtype left out: that is said, with the dtypes there are; no upgrade advised.
    with pytest.raises(codec.CodecError) as info:
        codec.decode_tensor(pb.Tensor(shape=[4], data=bytes(32)), "rewards", expected=expected)
    text = str(info.value)
    assert text.startswith("rewards.dtype: not set (DTYPE_UNSPECIFIED); expected one of DTYPE_BOOL (1), "), text
    assert "DTYPE_FLOAT16..DTYPE_FLOAT64 (10-12)" in text and "newer" not in text and "upgrade" not in text
    # A dtype number this side does not know: a newer peer's.
    with pytest.raises(codec.CodecError, match=r"^rewards.dtype: unknown dtype 13 \(a dtype newer than this side's"):
        codec.decode_tensor(pb.Tensor(dtype=cast(pb.DType, 13), shape=[4], data=bytes(32)), "rewards")


def test_a_space_without_its_dtype_or_bounds_is_said_not_set() -> None:
    """DiscreteSpace.dtype is required ("gymnasium's default is int64" in the proto read as optional to a
    server's author, who then got "unknown or unset dtype 0")."""
    discrete = pb.Space(discrete=pb.DiscreteSpace(n=3))
    with pytest.raises(codec.CodecError) as info:
        codec.decode_space(discrete, "action_space")
    assert str(info.value) == (
        "action_space.dtype: not set (DTYPE_UNSPECIFIED); a DiscreteSpace's dtype is required: the integer dtype "
        "of its samples, DTYPE_INT64 for gymnasium's Discrete default (any of DTYPE_INT8..DTYPE_UINT64)"
    )
    discrete.discrete.dtype = pb.DTYPE_INT64
    assert codec.decode_space(discrete, "action_space") == gym.spaces.Discrete(3)
    box = codec.encode_space(gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
    box.box.ClearField("high")
    with pytest.raises(codec.CodecError, match=r"^observation_space.high: not set \(an empty Tensor: .*\): expected"):
        codec.decode_space(box, "observation_space")
    multi = codec.encode_space(gym.spaces.MultiDiscrete([2, 3]))
    multi.multi_discrete.nvec.ClearField("dtype")
    with pytest.raises(codec.CodecError, match=r"^space.nvec.dtype: not set \(DTYPE_UNSPECIFIED\); expected one"):
        codec.decode_space(multi)


def test_a_value_or_space_left_out_is_told_from_one_of_a_newer_kind() -> None:
    """Nothing set: a field the peer left out (was: "empty, or one of a kind newer than this side's
    envfleet: upgrade it" either way); a field this side does not know set: a newer peer's."""
    with pytest.raises(codec.CodecError, match=r"^observations: not set \(an empty Value: none of its kinds is set\)$"):
        codec.decode_value(pb.Value(), "observations")
    with pytest.raises(codec.CodecError, match=r"^action_space: not set \(an empty Space: none of its kinds is set\)$"):
        codec.decode_space(pb.Space(), "action_space")
    newer = pb.Value.FromString(b"\x98\x06\x01")  # (field 99, which no envfleet.v1 Value has yet)
    with pytest.raises(codec.CodecError, match=r"^infos: value of a kind this side does not know .* upgrade it\)$"):
        codec.decode_value(newer, "infos")


def test_an_autoreset_mode_left_out_is_said_not_set() -> None:
    with pytest.raises(codec.CodecError) as info:
        codec.decode_autoreset_mode(pb.AUTORESET_MODE_UNSPECIFIED)
    assert str(info.value) == (
        "autoreset_mode: not set (AUTORESET_MODE_UNSPECIFIED); required: AUTORESET_MODE_NEXT_STEP (1), "
        "AUTORESET_MODE_SAME_STEP (2) or AUTORESET_MODE_DISABLED (3)"
    )


@pytest.mark.parametrize("shape", [[2**31, 2**31, 2**31, 0, 0], [0, 2**31, 2**31]])
def test_object_and_string_arrays_too_large_to_shape_are_rejected_even_when_empty(shape: list[int]) -> None:
    for field in ("objects", "strings"):
        value = pb.Value()
        getattr(value, field).shape.extend(shape)
        with pytest.raises(codec.CodecError, match=r"actions\.shape: .* is too large"):
            codec.decode_value(value, "actions")


def test_unsupported_space_names_itself() -> None:
    with pytest.raises(codec.UnsupportedSpaceError, match="Text"):
        codec.encode_space(gym.spaces.Dict({"a": gym.spaces.Text(5)}))


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Discrete(3, start=2**63, dtype=np.uint64), gym.spaces.Discrete(2**63 + 5, dtype=np.uint64)],
    ids=["start", "n"],
)
def test_a_discrete_whose_values_pass_int64_is_unsupported_not_a_crash(space: gym.Space[Any]) -> None:
    """DiscreteSpace's n and start are int64: a uint64 Discrete past it is refused by name, as a Text space is."""
    with pytest.raises(codec.UnsupportedSpaceError, match=r"action: Discrete\(.*\) has values up to 92233720368547758"):
        codec.encode_space(space, where="action")
    edge = gym.spaces.Discrete(3, start=2**63 - 3, dtype=np.uint64)  # (its last value is int64's largest)
    assert codec.decode_space(codec.encode_space(edge)) == edge
    # Nor is one a peer sends decoded (n and start each an int64, their sum past it).
    msg = codec.encode_space(edge)
    msg.discrete.n = 5
    with pytest.raises(
        codec.CodecError, match=r"space: Discrete with n 5 and start 9223372036854775805 has values past"
    ):
        codec.decode_space(msg)


def test_an_integer_box_s_unbounded_elements_and_a_malformed_mask() -> None:
    """gymnasium keeps an integer Box made with infinite bounds unbounded there (its bounds are the dtype's
    limits): sample() draws small values, not from the dtype's whole range. The wire says which."""
    space = gym.spaces.Box(np.array([0, -np.inf, -np.inf]), np.array([np.inf, 3, np.inf]), dtype=np.int32)
    msg = codec.encode_space(space)
    decoded = cast(gym.spaces.Box, codec.decode_space(pb.Space.FromString(msg.SerializeToString())))
    assert decoded.bounded_below.tolist() == [True, False, False]
    assert decoded.bounded_above.tolist() == [False, True, False]
    space.seed(1)
    decoded.seed(1)
    assert_same(decoded.sample(), space.sample())
    # Every element bounded (and every float Box, whose bounds hold the infinities): no mask on the wire.
    for bounded in (gym.spaces.Box(-3, 3, (2,), np.int64), gym.spaces.Box(-np.inf, np.inf, (2,))):
        assert not codec.encode_space(bounded).box.HasField("unbounded_below")
    codec.encode_tensor(np.ones(4, dtype=bool), msg.box.unbounded_above)
    with pytest.raises(
        codec.CodecError,
        match=r"space\.unbounded_above: expected a bool array of shape \[3\], got bool of shape \[4\]",
    ):
        codec.decode_space(msg)


def test_typical_values_round_trip_within_the_bounds() -> None:
    # Atari-like: a stack of uint8 frames per env; infos of a few hundred keys; SameStep's per-env
    # final infos (an object array of dicts); and as many values as one value may have.
    frames = np.random.default_rng(0).integers(0, 255, (64, 4, 84, 84), dtype=np.uint8)
    assert_same(roundtrip(frames), frames)
    assert_same(
        roundtrip({"pixels": frames, "ram": frames[:, 0, 0, :].copy()}), {"pixels": frames, "ram": frames[:, 0, 0, :]}
    )
    final_info = np.empty(1024, dtype=object)
    for i in range(1024):
        final_info[i] = {f"stat{k}": np.float64(k) for k in range(10)}
    infos = {f"key{i}": np.arange(1024) for i in range(300)}
    infos.update(final_info=final_info, _final_info=np.ones(1024, dtype=bool), names=np.array(["a"] * 1024))
    assert_same(roundtrip(infos), infos)
    most = [None] * (codec.MAX_VALUE_NODES - 1)  # with the list itself: MAX_VALUE_NODES
    assert len(roundtrip(most)) == len(most)
    with pytest.raises(codec.CodecError, match=rf"^value: more than {codec.MAX_VALUE_NODES} values/arrays"):
        codec.encode_value([*most, None], pb.Value())


string_values = st.recursive(
    st.one_of(
        st.none(),
        st.integers(0, 9),
        st.lists(st.text("ab", max_size=6), max_size=6).map(lambda s: np.array(s, dtype=str)),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text("xyz", min_size=1, max_size=2), children, max_size=4),
        st.lists(children, min_size=1, max_size=3).map(lambda items: np.array([*items, None], dtype=object)[:-1]),
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(string_values)
def test_encode_refuses_exactly_what_decode_would(value: Any) -> None:
    """The bounds of one value (its strings' bytes, its number of values), counted by encode as by
    decode: what one sends, the other takes; what it refuses, the other would, with the same words."""
    unbounded = codec.encode_value(value, pb.Value(), "infos")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codec, "MAX_STRING_ARRAY_BYTES", 100)
        patch.setattr(codec, "MAX_VALUE_NODES", 12)
        try:
            sent = codec.encode_value(value, pb.Value(), "infos")
        except codec.CodecError as err:
            with pytest.raises(codec.CodecError) as refused:
                codec.decode_value(unbounded, "infos")
            assert str(err) == str(refused.value) + ("; it cannot be sent" if "string array" in str(err) else "")
        else:
            assert_same(codec.decode_value(pb.Value.FromString(sent.SerializeToString()), "infos"), value)


def test_a_map_with_a_key_twice_is_refused() -> None:
    """A map (a dict on the wire) that holds a key twice is refused: decoded, the second value silently
    replaced the first."""
    value = pb.Value()
    value.map.SetInParent()
    for key in ("a", "a"):
        value.map.keys.append(key)
        value.map.values.add().int64 = 1
    with pytest.raises(codec.CodecError, match=r"^options: map has duplicate keys"):
        codec.decode_value(value, "options")


def test_a_scalar_with_a_shape_is_refused() -> None:
    """A scalar sent as a tensor of shape [2] is refused, not decoded as an array where a number was meant."""
    scalar = pb.Value()
    codec.encode_tensor(np.zeros(2, np.float32), scalar.scalar)
    with pytest.raises(codec.CodecError, match=r"^infos\['x'\]: a scalar must have an empty shape, got \[2\]"):
        codec.decode_value(pb.Value(map=pb.ValueMap(keys=["x"], values=[scalar])), "infos")


def test_a_tensor_with_more_data_than_its_shape_takes_is_refused() -> None:
    """The data must be exactly as long as the shape and dtype say: bytes left over are refused as too few
    are, not ignored."""
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2], data=b"\0" * 17)
    with pytest.raises(codec.CodecError, match=r"^actions\.data: shape \[2\] of int64 needs 16 bytes, got 17"):
        codec.decode_tensor(tensor, "actions")


def test_object_and_string_arrays_of_two_dimensions_keep_their_shape() -> None:
    """Object and string arrays come back in their shape, not flattened, with every string uncut
    (the empty one included)."""
    objects = np.empty((2, 2), dtype=object)
    objects[:] = [[1, "a"], [None, 2.5]]
    back = roundtrip(objects)
    assert back.shape == (2, 2) and back.tolist() == objects.tolist()
    strings = np.array([["ab", "cde"], ["", "f"]])
    back = roundtrip({"s": strings})["s"]
    assert back.shape == (2, 2) and back.tolist() == strings.tolist()


# Boxes of every kind of bounds: (space, which of low/high/unbounded_below/unbounded_above go compact)
_BOUNDS: list[tuple[str, gym.spaces.Box, set[str]]] = [
    ("uint8 image", gym.spaces.Box(0, 255, (48, 64, 3), np.uint8), {"low", "high"}),
    ("float infinities", gym.spaces.Box(-np.inf, np.inf, (5,), np.float32), {"low", "high"}),
    ("float per element", gym.spaces.Box(np.array([-1.0, -2.0]), np.array([1.0, np.inf]), dtype=np.float64), set()),
    ("float high only", gym.spaces.Box(np.array([-1.0, -2.0], np.float16), 3.0, (2,), np.float16), {"high"}),
    ("float -0.0 and 0.0", gym.spaces.Box(np.array([0.0, -0.0], np.float32), 1.0, (2,), np.float32), {"high"}),
    (
        "int unbounded everywhere",
        gym.spaces.Box(-np.inf, np.inf, (2, 3), np.int32),
        {"low", "high", "unbounded_below", "unbounded_above"},
    ),
    (
        "int unbounded in one element",
        gym.spaces.Box(np.array([-np.inf, 0, 0]), np.inf, (3,), np.int64),
        {"high", "unbounded_above"},
    ),
    ("int per element", gym.spaces.Box(np.array([0, 1]), np.array([5, 5]), dtype=np.int16), {"high"}),
    ("bool", gym.spaces.Box(0, 1, (2, 2), cast(Any, np.bool_)), {"low", "high"}),
    ("uint64", gym.spaces.Box(0, 2**64 - 1, (3,), np.uint64), {"low", "high"}),
    ("one element", gym.spaces.Box(0, 255, (1, 1), np.uint8), set()),
    ("shape ()", gym.spaces.Box(-1.0, 1.0, (), np.float32), set()),
    ("no element", gym.spaces.Box(0.0, 1.0, (0, 3), np.float32), set()),
]


def _assert_same_box(got: gym.spaces.Box, want: gym.spaces.Box) -> None:
    """gymnasium's == compares bounds with allclose, and not bounded_below/above: every part, exactly."""
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    for name in ("low", "high", "bounded_below", "bounded_above"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert mine.dtype == theirs.dtype and mine.tobytes() == theirs.tobytes(), name


@pytest.mark.parametrize(("space", "compact"), [b[1:] for b in _BOUNDS], ids=[b[0] for b in _BOUNDS])
def test_a_box_decodes_the_same_from_full_and_compact_bounds(space: gym.spaces.Box, compact: set[str]) -> None:
    full = codec.encode_space(space)
    assert not full.box.shape and full == codec.encode_space(space, compact=False)
    sent = codec.encode_space(space, compact=True)
    sent_compact = {name for name in codec._BOX_FIELDS if sent.box.HasField(name) and not getattr(sent.box, name).shape}
    assert (sent_compact if sent.box.shape else set()) == compact
    assert list(sent.box.shape) == (list(space.shape) if compact else [])
    assert sent == full if not compact else sent.ByteSize() < full.ByteSize()
    for msg in (full, sent):
        decoded = codec.decode_space(pb.Space.FromString(msg.SerializeToString()))
        assert isinstance(decoded, gym.spaces.Box)
        _assert_same_box(decoded, space)
    assert codec.compact_bounds(full) == sent


def test_dict_and_tuple_spaces_send_their_boxes_compact_and_decode_the_same() -> None:
    space = gym.spaces.Dict(
        {
            "camera": gym.spaces.Box(0, 255, (8, 8, 3), np.uint8),
            "nested": gym.spaces.Tuple(
                (
                    gym.spaces.Box(np.array([0.0, 1.0], np.float32), 2.0, (2,)),
                    gym.spaces.Discrete(3),
                    gym.spaces.MultiBinary(2),
                )
            ),
        }
    )
    sent = codec.encode_space(space, compact=True)
    camera, nested = sent.dict.spaces
    assert list(camera.box.shape) == [8, 8, 3] and not camera.box.low.shape and not camera.box.high.shape
    assert list(nested.tuple.spaces[0].box.shape) == [2] and list(nested.tuple.spaces[0].box.low.shape) == [2]
    decoded = codec.decode_space(sent)
    assert decoded == space
    assert isinstance(decoded, gym.spaces.Dict)
    _assert_same_box(decoded["camera"], space["camera"])  # type: ignore[arg-type]
    assert codec.compact_bounds(codec.encode_space(space)) == sent


def _compact_box() -> pb.Space:
    return codec.encode_space(gym.spaces.Box(-np.inf, np.inf, (2, 3), np.int32), compact=True)


def _set_shape(dims: list[int]) -> Any:
    def change(msg: pb.Space) -> None:
        msg.box.shape[:] = dims

    return change


def _full_high(msg: pb.Space) -> None:
    codec.encode_tensor(np.full((2, 3), 7, np.int32), msg.box.high)


def _no_shape_full_high(msg: pb.Space) -> None:
    _full_high(msg)
    msg.box.ClearField("shape")


def _other_full_high(msg: pb.Space) -> None:
    codec.encode_tensor(np.full((3, 2), 7, np.int32), msg.box.high)


def _mask_of_ints(msg: pb.Space) -> None:
    codec.encode_tensor(np.array(1, np.int8), msg.box.unbounded_below)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (_set_shape([2, -3]), r"space\.shape: dimensions must be >= 0, got \[2, -3\]"),
        (_set_shape([1] * 33), r"space\.shape: expected at most 32 dimensions, got 33"),
        (_set_shape([2**20, 2**20]), r"space\.shape: \[1048576, 1048576\] is too large \(its nonzero dimensions"),
        (
            _set_shape([2**14, 2**14]),
            r"space\.shape: \[16384, 16384\] of int32 would take 1,073,741,824 bytes a bound; expected compact Boxes "
            r"of at most 67,108,864 bytes in one space, more than a message can carry of its samples",
        ),
        (
            _other_full_high,
            r"space\.high: expected shape \[2, 3\] \(the Box's, BoxSpace\.shape\) or \[\] \(one value for every "
            r"element\), got \[3, 2\]",
        ),
        (
            _no_shape_full_high,
            r"space\.shape: not set, but low is one value \(shape \[\], compact\) and high has shape \[2, 3\]; "
            r"expected the Box's shape beside a compact bound",
        ),
        (_mask_of_ints, r"space\.unbounded_below: expected a bool array of shape \[2, 3\], got int8 of shape \[2, 3\]"),
    ],
    ids=["negative", "too many dims", "element overflow", "over 64 MiB", "disagreeing", "shape missing", "mask dtype"],
)
def test_a_malformed_compact_box_is_refused_naming_the_field(change: Any, error: str) -> None:
    msg = _compact_box()
    assert codec.decode_space(msg) == gym.spaces.Box(-np.inf, np.inf, (2, 3), np.int32)
    change(msg)
    with pytest.raises(codec.CodecError, match=error):
        codec.decode_space(msg)


def test_compact_boxes_of_one_space_share_the_64_mib_they_may_take() -> None:
    """Each under 64 MiB, together over it: a few bytes on the wire cannot ask for GBs of bounds."""
    half = gym.spaces.Box(0, 255, (40 * 1024 * 1024,), np.uint8)  # (40 MiB each, sent as 2 values)
    msg = codec.encode_space(gym.spaces.Tuple((half, half)), compact=True)
    assert msg.ByteSize() < 100
    with pytest.raises(
        codec.CodecError,
        match=r"space\[1\]\.shape: \[41943040\] of uint8 would take 41,943,040 bytes a bound; expected compact "
        r"Boxes of at most 67,108,864 bytes in one space \(only 25,165,824 are left of them\)",
    ):
        codec.decode_space(msg)


def test_a_compact_bound_wider_than_low_counts_its_own_bytes() -> None:
    """The 64 MiB are counted in the widest field's dtype, the one np.full makes: a uint8 low with a float64 high,
    both compact, of 2**26 elements would otherwise pass as 64 MiB and make a 512 MiB high (~1 GB at the peak)."""
    msg = pb.Space()
    codec.encode_tensor(np.array(0, np.uint8), msg.box.low)
    codec.encode_tensor(np.array(1.0, np.float64), msg.box.high)
    msg.box.shape[:] = [8192, 8192]
    with pytest.raises(
        codec.CodecError,
        match=r"space\.shape: \[8192, 8192\] of float64 would take 536,870,912 bytes a bound; expected compact "
        r"Boxes of at most 67,108,864 bytes in one space",
    ):
        codec.decode_space(msg)
    msg.box.shape[:] = [4, 4]  # (a small one of mixed dtypes decodes as before: gymnasium casts high to low's dtype)
    space = codec.decode_space(msg)
    assert isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and space.high.tolist() == [[1] * 4] * 4
