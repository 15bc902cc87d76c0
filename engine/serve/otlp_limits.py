"""What the trace receiver accepts (sizes, counts, rates, ranges), and a capped streaming gunzip."""

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
    body_timeout_s: float = 10.0
    rate: Rate = field(default_factory=lambda: Rate(per_second=2000.0, burst=20_000.0))
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
        if self.rate.burst < self.max_spans:  # else a full export could never pass
            raise ConfigError("rate", f"burst {self.rate.burst:g} must be at least max_spans "
                                      f"({self.max_spans})")


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
    out = bytearray()
    rest = body
    try:
        while rest:
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
