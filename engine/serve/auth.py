"""Bearer tokens: without a configured admin token the admin endpoints are off (403)."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.requests import Request

from engine.errors import EngineError
from engine.serve.protocol import ApiError

TOKEN_ENV = "TOKENFLOW_ADMIN_TOKEN"


def load_admin_token(token_file: Path | None = None) -> str | None:
    return load_token(token_file, env=TOKEN_ENV, flag="--admin-token-file", what="admin")


def load_token(token_file: Path | None, *, env: str, flag: str, what: str) -> str | None:
    if token_file is None:
        value = os.environ.get(env)
        if value is not None and not value.strip():  # as an empty file is: a mistake, said
            raise EngineError(f"${env} is set but empty; put the {what} token in it, or "
                              "unset it")
        return None if value is None else value.strip()
    try:
        token = token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise EngineError(f"cannot read the {what} token file {token_file}: {exc.strerror}; "
                          f"point {flag} at a readable file") from exc
    except UnicodeDecodeError:
        raise EngineError(f"the {what} token file {token_file} is not UTF-8 text; write the "
                          "token into it as text") from None
    if not token:
        raise EngineError(f"the {what} token file {token_file} is empty; write a token into it")
    return token


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an `Authorization` header value is `Bearer <token>` (constant time)."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              token.encode())


def require_admin(request: Request, token: str | None) -> None:
    """Raise 403 when admin is off, 401 unless the bearer token matches (constant time)."""
    if token is None:
        raise ApiError(403, f"the admin API is off: start the server with {TOKEN_ENV} set or "
                            "--admin-token-file", kind="permission_error")
    if not bearer_matches(request.headers.get("authorization", ""), token):
        raise ApiError(401, "missing or wrong bearer token; send 'Authorization: Bearer TOKEN'",
                       kind="authentication_error", headers={"WWW-Authenticate": "Bearer"})
