# Types of the part of msgpack the project calls: msgpack (1.x) ships no stubs and no py.typed, so without
# these mypy takes both for Any and every caller of packb needs a type: ignore. Checked against msgpack 1.2.
from collections.abc import Callable
from typing import Any

def packb(
    o: object, *, use_bin_type: bool = ..., default: Callable[[Any], object] | None = ..., **kwargs: object
) -> bytes: ...

# What it decodes is whatever the bytes hold: callers check its shape.
def unpackb(packed: bytes | bytearray | memoryview, *, raw: bool = ..., **kwargs: object) -> Any: ...
