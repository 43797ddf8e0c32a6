"""The one check the service makes itself: the shape of a protobuf request.

Everything about a request's content (token ids inside the vocabulary, chat
roles, sampling ranges, stop strings, lengths against ``max_model_len``) is
checked once, by the engine's own types (``SamplingParams``, ``InputProcessor``);
the interceptor turns the engine's field names into protobuf paths
(``convert.proto_field``). What only the protobuf knows stays here: which
member of the ``input`` oneof is set.
"""

from __future__ import annotations

from nanoserve.engine.errors import InvalidRequestError
from nanoserve.v1 import generation_pb2 as pb


def input_kind(request: pb.GenerateRequest | pb.TokenizeRequest) -> str:
    """The member of the ``input`` oneof that is set; InvalidRequestError("input") when none is."""
    kind: str | None = request.WhichOneof("input")
    if kind is None:
        *others, last = (field.name for field in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        names = f"{', '.join(others)} or {last}"
        raise InvalidRequestError("input", f"give exactly one of {names}; none was set")
    return kind
