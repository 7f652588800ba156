"""The committed generated code is what the .proto files produce, and parsing enforces its size limit."""

import pytest

from shoal.protocol import EncodedTensor, MalformedPayloadError, generate, parse_message


def test_regenerating_reproduces_the_committed_code(tmp_path):
    written = generate.generate(tmp_path)
    protos = {p.stem for p in generate.proto_files()}
    assert protos == {"tensor", "payload", "swarm", "coordinator"}
    expected = {f"{name}_pb2.{ext}" for name in protos for ext in ("py", "pyi")}
    assert {p.name for p in written} == expected | {"coordinator_pb2_grpc.py"}  # the only service
    for path in written:
        committed = generate.HERE / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed} is stale: python -m shoal.protocol.generate"
        )


def test_every_field_and_enum_value_is_commented():
    for proto in generate.proto_files():
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            code = line.split("//")[0].strip()
            if code.endswith(";") and not code.startswith(("syntax", "package", "import")):
                previous = lines[number - 1].strip()
                assert "//" in line or previous.startswith("//"), f"{proto.name}:{number + 1} has no comment"


def test_parse_refuses_oversized_input_before_parsing():
    data = EncodedTensor(shape=[3], values=b"\0" * 100).SerializeToString()
    with pytest.raises(MalformedPayloadError) as error:
        parse_message(EncodedTensor, data, max_bytes=len(data) - 1)
    assert error.value.reason == "too_large"
    assert parse_message(EncodedTensor, data, max_bytes=len(data)).shape == [3]


def test_parse_turns_protobuf_errors_into_malformed_payload():
    with pytest.raises(MalformedPayloadError) as error:
        parse_message(EncodedTensor, b"\x0a\xff\xff\xff", max_bytes=100)
    assert error.value.reason == "unparsable"
