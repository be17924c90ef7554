"""API keys → principal (tenant): with a tenants file (``--tenants``) each key's hash names
its tenant and key-less requests go to the file's default tenant (or get 401); otherwise
``--api-key`` values are accepted and everything is the ``default`` tenant."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.config import ServerConfig


@dataclass(frozen=True)
class Principal:
    tenant: str = "default"
    admin: bool = False


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip() or None
    return None


def _matches(key: str | None, allowed: tuple[str, ...]) -> bool:
    return key is not None and any(hmac.compare_digest(key, k) for k in allowed)


def authenticate(request: Request, config: ServerConfig, admin: bool = False) -> Principal:
    """The caller's principal. Raises 401 for a missing/unknown key when keys are configured
    (admin endpoints: always, and 403 when the server has no admin key)."""
    key = _bearer(request)
    if admin:
        if config.admin_key is None:
            raise APIError(
                403,
                "admin endpoints are disabled; start the server with --admin-key",
                "PermissionDeniedError",
            )
        if not _matches(key, (config.admin_key,)):
            raise APIError(401, "invalid admin key", "AuthenticationError", code="invalid_api_key")
        return Principal(admin=True)
    if config.tenants is not None:
        tenant = config.tenants.tenant_for_key(key)
        if tenant is None:
            message = "Incorrect API key provided." if key else "An API key is required."
            raise APIError(401, message, "AuthenticationError", code="invalid_api_key")
        return Principal(tenant=tenant)
    if not config.api_keys:
        return Principal()
    if not _matches(key, config.api_keys):
        raise APIError(
            401, "Incorrect API key provided.", "AuthenticationError", code="invalid_api_key"
        )
    return Principal()
