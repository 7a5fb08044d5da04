"""The committed stubs are exactly what the pinned generator makes from proto/."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh() -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) generates the stubs")
    result = subprocess.run([sys.executable, "proto/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_message_and_field_is_commented() -> None:
    """The proto is the contract: each message, enum, rpc and field has a comment above it or beside it."""
    lines = (ROOT / "proto/envfleet/v1/env.proto").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        text = line.strip()
        is_decl = text.startswith(("message ", "enum ", "rpc ", "service ")) or (
            text.endswith(";") and "=" in text and not text.startswith(("//", "option", "syntax", "package"))
        )
        if not is_decl:
            continue
        above = lines[i - 1].strip() if i else ""
        if "//" in text or above.startswith("//"):
            continue
        # Self-explanatory enum values and fields in a commented block are fine when the enum says what they are.
        if text.startswith(("DTYPE_", "AUTORESET_")):
            continue
        missing.append(f"{i + 1}: {text}")
    assert not missing, "uncommented declarations:\n" + "\n".join(missing)


def _generator() -> Any:
    """proto/generate.py as a module (it is a script, not in a package)."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) compiles the proto")
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _contract_of(generate: Any, tmp_path: Path, edit: tuple[str, str]) -> dict[str, Any]:
    """The wire contract of env.proto with ``edit`` (old, new: one occurrence) made to it."""
    text = (ROOT / "proto/envfleet/v1/env.proto").read_text()
    old, new = edit
    assert text.count(old) == 1, old
    root = tmp_path / "proto"
    (root / "envfleet/v1").mkdir(parents=True)
    (root / "envfleet/v1/env.proto").write_text(text.replace(old, new))
    (tmp_path / "out").mkdir()
    contract: dict[str, Any] = generate.generate(tmp_path / "out", proto_root=root)
    return contract


@pytest.mark.parametrize(
    ("edit", "broken"),
    [
        (("  DType dtype = 1;", "  int32 dtype = 1;"), "Tensor#1"),  # a field's type
        (("  bytes data = 3;", "  bytes payload = 3;"), "Tensor#3"),  # its name (JSON and generated code use it)
        (("  bytes data = 3;", "  bytes data = 4;"), "Tensor#3"),  # its number
        (("  DTYPE_FLOAT64 = 12;", ""), "DType.DTYPE_FLOAT64"),  # an enum value
        (("  DTYPE_FLOAT64 = 12;", "  DTYPE_DOUBLE = 12;"), "DType.DTYPE_FLOAT64"),  # its name (JSON, code)
        (("  bytes data = 3;", '  bytes data = 3 [json_name = "payload"];'), "Tensor#3"),  # its JSON name
        (  # a map made a list of the same entries: the same bytes, but a list in JSON
            (
                "  map<string, string> versions = 13;",
                "  message P { string key = 1; string value = 2; }\n  repeated P versions = 13;",
            ),
            "EnvSpec#13 EnvSpec.VersionsEntry#1 EnvSpec.VersionsEntry#2",  # (the entry type goes too)
        ),
        (("rpc StepStream(stream StepRequest)", "rpc StepStream(StepRequest)"), "EnvService/StepStream"),
        (("  rpc Release(ReleaseRequest) returns (ReleaseResponse);", ""), "EnvService/Release"),
    ],
)
def test_a_proto_that_breaks_the_wire_is_refused(tmp_path: Path, edit: tuple[str, str], broken: str) -> None:
    """wire.json holds envfleet.v1's contract: generate.py refuses a proto that removes or changes any of it."""
    generate = _generator()
    breaks = generate.wire_breaks(generate.recorded_wire(), _contract_of(generate, tmp_path, edit))
    assert [b.split(" ")[0] for b in breaks] == broken.split()
    with pytest.raises(
        SystemExit,
        match=f"(?s)proto/envfleet/v1/env.proto breaks the proto/envfleet/v1/wire.json wire contract.*{broken.split()[0]}",
    ):
        generate.refuse_breaks(breaks)


def test_an_enum_alias_is_an_addition(tmp_path: Path) -> None:
    generate = _generator()
    edit = ("  DTYPE_UNSPECIFIED = 0;", "  option allow_alias = true;\n  DTYPE_UNSPECIFIED = 0;\n  DTYPE_DOUBLE = 12;")
    contract = _contract_of(generate, tmp_path, edit)
    recorded = generate.recorded_wire()
    assert generate.wire_breaks(recorded, contract) == []
    assert contract.keys() - recorded.keys() == {"DType.DTYPE_DOUBLE"}


def test_a_proto_that_adds_to_the_wire_is_accepted_and_recorded(tmp_path: Path) -> None:
    generate = _generator()
    edit = ("  bytes data = 3;", "  bytes data = 3;\n  // a new field\n  uint32 version = 4;")
    contract = _contract_of(generate, tmp_path, edit)
    recorded = generate.recorded_wire()
    assert generate.wire_breaks(recorded, contract) == []
    assert contract.keys() - recorded.keys() == {"Tensor#4"}
    assert contract["Tensor#4"]["name"] == "version"


def test_what_a_newer_peer_may_send_is_refused_as_possibly_newer() -> None:
    """A dtype, space kind or autoreset mode this side does not know is named, with the hint that the
    peer may be newer (new values are additions to the wire, which a v1 peer of today cannot read)."""
    from env_server import codec
    from env_server.rpc import env_pb2 as pb

    newer = "newer than this side's envfleet: upgrade it"
    with pytest.raises(codec.CodecError, match=rf"^tensor.dtype: unknown dtype 99 \(a dtype {newer}\)"):
        codec.decode_tensor(pb.Tensor(dtype=99, shape=[1], data=b"\0"))  # type: ignore[arg-type]
    # (field 99 of a kind this side has not: kept as an unknown field, as a newer peer's would be)
    unknown_kind = b"\x98\x06\x01"
    with pytest.raises(codec.CodecError, match=f"^space: space of a kind this side does not know .*{newer}"):
        codec.decode_space(pb.Space.FromString(unknown_kind))
    with pytest.raises(codec.CodecError, match=f"^value: value of a kind this side does not know .*{newer}"):
        codec.decode_value(pb.Value.FromString(unknown_kind))
    with pytest.raises(codec.CodecError, match=rf"^autoreset_mode: unknown autoreset mode 4 \(a mode {newer}\)"):
        codec.decode_autoreset_mode(4)  # type: ignore[arg-type]
    assert codec.decode_autoreset_mode(pb.AUTORESET_MODE_SAME_STEP).value == "SameStep"


def test_the_stubs_are_made_by_the_pinned_generator_and_the_grpcio_floor_takes_them() -> None:
    """A grpcio-tools other than the pinned one called the committed stubs stale, and its stubs, made as asked,
    needed a grpcio newer than the floor pyproject declares (GRPC_GENERATED_VERSION: a newer one refuses older)."""
    generate = _generator()
    pinned = generate.pinned_generator()
    made_by = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (ROOT / "env_server/rpc/env_pb2_grpc.py").read_text())
    floor = re.search(r'"grpcio>=([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert made_by is not None and floor is not None and made_by.group(1) == pinned == floor.group(1)
    generate.check_generator(pinned, pinned)
    with pytest.raises(
        SystemExit,
        match=rf"^generate: grpcio-tools 9\.9\.9 is installed, but the stubs are made by the "
        rf"pinned {re.escape(pinned)} \(pyproject.toml's dev extra\): pip install grpcio-tools==",
    ):
        generate.check_generator("9.9.9", pinned)
