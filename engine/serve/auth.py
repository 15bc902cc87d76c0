"""The admin endpoints' bearer token: where it comes from and how it is checked.

Without a configured token the admin endpoints are off (403), so a server started without one
cannot be retuned by whoever reaches its port.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.requests import Request

from engine.errors import EngineError
from engine.serve.protocol import ApiError

TOKEN_ENV = "TOKENFLOW_ADMIN_TOKEN"


def load_admin_token(token_file: Path | None = None) -> str | None:
    """The token from `token_file` if given, else from $TOKENFLOW_ADMIN_TOKEN, else None."""
    if token_file is None:
        return os.environ.get(TOKEN_ENV, "").strip() or None
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise EngineError(f"cannot read the admin token file {token_file}: {exc.strerror}; "
                          "point --admin-token-file at a readable file") from exc
    if not token:
        raise EngineError(f"the admin token file {token_file} is empty; write a token into it")
    return token


def require_admin(request: Request, token: str | None) -> None:
    """Raise 403 when admin is off, 401 unless the bearer token matches (constant time)."""
    if token is None:
        raise ApiError(403, f"the admin API is off: start the server with {TOKEN_ENV} set or "
                            "--admin-token-file", kind="permission_error")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                             token.encode()):
        raise ApiError(401, "missing or wrong bearer token; send 'Authorization: Bearer TOKEN'",
                       kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
