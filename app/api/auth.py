"""API keys and tenants. `API_KEYS="key1:tenant_a,key2:tenant_b"`; unset means open mode.

Keys are compared in constant time against every configured key, and never logged.
"""

from __future__ import annotations

import hmac

from app.core.errors import NotAuthenticated

OPEN_TENANT = "default"
"""The tenant every job belongs to when no API keys are configured."""


def parse_api_keys(text: str) -> dict[str, str]:
    """`key:tenant,...` -> {key: tenant}. Raises ValueError naming the bad entry's position."""
    keys: dict[str, str] = {}
    for position, entry in enumerate(filter(None, (e.strip() for e in text.split(","))), start=1):
        key, sep, tenant = entry.partition(":")
        if not sep or not key or not tenant or ":" in tenant:
            raise ValueError(f"API_KEYS entry {position} must be 'key:tenant'.")
        keys[key] = tenant
    return keys


def tenant_for(keys: dict[str, str], authorization: str | None) -> str:
    if not keys:
        return OPEN_TENANT
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise NotAuthenticated("Send 'Authorization: Bearer <key>'.")
    found = None
    for key, tenant in keys.items():  # no early exit: the time does not depend on which key matched
        if hmac.compare_digest(token.encode(), key.encode()):
            found = tenant
    if found is None:
        raise NotAuthenticated("That API key is not valid.")
    return found
