"""Parsing of untrusted serialized messages: size limit first, then protobuf, never anything else."""

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from shoal.protocol.errors import MalformedPayloadError

M = TypeVar("M", bound=Message)


def parse_message(message_type: type[M], data: bytes, *, max_bytes: int) -> M:
    """Parses `data` as `message_type`, refusing more than `max_bytes` before looking inside.

    Raises MalformedPayloadError (reason `too_large` or `unparsable`) instead of protobuf's own errors.
    """
    if len(data) > max_bytes:
        raise MalformedPayloadError("too_large", f"{len(data)} bytes exceed the limit of {max_bytes}")
    message = message_type()
    try:
        message.ParseFromString(data)
    except DecodeError as error:
        raise MalformedPayloadError("unparsable", f"not a valid {message_type.__name__}: {error}") from None
    return message
