"""What the trace receiver accepts (sizes, counts, rates, ranges), a capped gunzip, and a
bounded count of an export's entries before it is parsed."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, fields

from engine.config import ConfigError
from engine.serve.protocol import ApiError
from engine.serve.rate_limit import Rate

IDENTITY = ("", "identity")
GZIP = "gzip"


@dataclass(frozen=True)
class OtlpLimits:
    max_body_bytes: int = 4 << 20
    max_export_bytes: int = 8 << 20
    max_spans: int = 4096
    # resources + scopes + spans of one export: empty ones cost the parser as much as spans
    max_entries: int = 8192
    max_gzip_members: int = 16  # exporters send one
    body_timeout_s: float = 10.0
    rate: Rate = field(default_factory=lambda: Rate(per_second=2000.0, burst=20_000.0))
    # every client together: many addresses cannot multiply the per-client rate
    global_rate: Rate = field(default_factory=lambda: Rate(per_second=10_000.0,
                                                            burst=40_000.0))
    max_text: int = 128
    max_tokens: int = 1 << 24
    max_seconds: float = 86_400.0
    future_s: float = 86_400.0
    earliest: float = 946_684_800.0

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, int | float) and not 0 < value < float("inf"):
                raise ConfigError(item.name, f"must be a finite number > 0, got {value}")
        for name in ("rate", "global_rate"):  # else a full export could never pass
            burst = getattr(self, name).burst
            if burst < self.max_entries:
                raise ConfigError(name, f"burst {burst:g} must be at least max_entries "
                                        f"({self.max_entries})")


def decoded_body(body: bytes, encoding: str, limits: OtlpLimits) -> bytes:
    """The export's protobuf bytes, gunzipped if sent so; 413 past the cap, else 400/415."""
    encoding = encoding.strip().lower()
    if encoding in IDENTITY:
        if len(body) > limits.max_export_bytes:
            raise _too_large(limits)
        return body
    if encoding != GZIP:
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r} is not supported; send gzip "
                            "or no encoding (OTEL_EXPORTER_OTLP_TRACES_COMPRESSION=gzip)")
    return _gunzip(body, limits)


def _gunzip(body: bytes, limits: OtlpLimits) -> bytes:
    # zlib with max_length stops inflating at the cap, so a bomb costs the cap and no more.
    # Each member copies the rest of the body (unused_data): capping the members keeps that
    # linear in the body, where a body of empty members once cost time quadratic in its size.
    out = bytearray()
    rest = body
    members = 0
    try:
        while rest:
            members += 1
            if members > limits.max_gzip_members:
                raise ApiError(400, f"the gzip body holds more than {limits.max_gzip_members} "
                                    "members; send one gzip stream")
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
            room = limits.max_export_bytes - len(out)
            out += inflater.decompress(rest, room + 1)
            if len(out) > limits.max_export_bytes or inflater.unconsumed_tail:
                raise _too_large(limits)
            if not inflater.eof:
                raise ApiError(400, "the gzip body ends early; send the whole compressed "
                                    "export")
            rest = inflater.unused_data
    except zlib.error as exc:
        raise ApiError(400, f"the body is not valid gzip ({exc}); send gzip or no "
                            "Content-Encoding") from None
    return bytes(out)


def _too_large(limits: OtlpLimits) -> ApiError:
    return ApiError(413, f"the export decodes to more than {limits.max_export_bytes} bytes; "
                         "send smaller batches (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)")


def entry_count(body: bytes, limits: OtlpLimits) -> int:
    """Resources + scopes + spans of an ExportTraceServiceRequest's bytes, read from the wire
    format without parsing it; 413 as soon as they pass `max_entries`, so a few KB of empty
    entries cannot cost the parser seconds. Malformed bytes end the count (the parser says why).
    """
    count = 0
    # (start, end, depth): the export (0), a ResourceSpans (1), a ScopeSpans (2)
    stack = [(0, len(body), 0)]
    while stack:
        at, end, depth = stack.pop()
        while at < end:
            tag, at = _varint(body, at)
            if at < 0:
                return count
            wire, number = tag & 7, tag >> 3
            if wire == 0:
                _, at = _varint(body, at)
            elif wire == 1:
                at += 8
            elif wire == 5:
                at += 4
            elif wire == 2:
                size, at = _varint(body, at)
                if at < 0 or at + size > end:
                    return count
                if (depth == 0 and number == 1) or (depth == 1 and number == 2):
                    stack.append((at, at + size, depth + 1))  # a resource's or scope's entries
                if (depth == 0 and number == 1) or (depth == 1 and number == 2) or (
                        depth == 2 and number == 2):
                    count += 1
                    if count > limits.max_entries:
                        raise ApiError(413, f"the export holds more than {limits.max_entries} "
                                            "resources, scopes and spans; send smaller "
                                            "batches (OTEL_BSP_MAX_EXPORT_BATCH_SIZE)")
                at += size
            else:
                return count
            if at < 0:
                return count
    return count


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the position after it; position -1 if it does not end."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    return 0, -1
