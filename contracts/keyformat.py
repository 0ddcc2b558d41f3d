"""API key format: a checksummed secret, so a mistyped or invented key is refused without
any lookup.

A key minted now is ``fw-k1_`` + 43 URL-safe characters (32 random bytes) + the CRC32 of
those 43 characters in six base62 digits: 55 characters in all. The gateway recomputes the
checksum before it hashes or looks anything up; a string with the new prefix and length
whose checksum does not match never reaches Redis. Keys minted before the checksum existed
(``fw-`` + anything else) keep working while ``legacy_allowed`` is on: they cannot be
checked offline, so the failed-authentication limiter and the bounded negative cache are
what protect the store from them.

No Django here: the control plane mints with ``mint`` and the gateway checks with
``classify``.
"""

from __future__ import annotations

import re
import secrets
import zlib
from typing import Literal

from contracts.schema import API_KEY_PREFIX

CHECKSUM_PREFIX = API_KEY_PREFIX + "k1_"
BODY_CHARS = 43  # secrets.token_urlsafe(32)
CHECKSUM_CHARS = 6  # 62**6 > 2**32
CHECKSUMMED_LEN = len(CHECKSUM_PREFIX) + BODY_CHARS + CHECKSUM_CHARS
_B62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_URLSAFE = re.compile(r"[A-Za-z0-9_-]+")

KeyShape = Literal["checksummed", "legacy", "malformed"]


def checksum(body: str) -> str:
    value = zlib.crc32(body.encode("ascii"))
    digits = []
    for _ in range(CHECKSUM_CHARS):
        value, rem = divmod(value, 62)
        digits.append(_B62[rem])
    return "".join(reversed(digits))


def mint() -> str:
    while True:
        body = secrets.token_urlsafe(32)
        if len(body) == BODY_CHARS:  # always, for 32 bytes; guards a changed stdlib
            return CHECKSUM_PREFIX + body + checksum(body)


def classify(secret: str, *, legacy_allowed: bool = True) -> KeyShape:
    """``checksummed`` (verified offline), ``legacy`` (look it up) or ``malformed``."""
    if not secret.startswith(API_KEY_PREFIX) or not _URLSAFE.fullmatch(secret, len(API_KEY_PREFIX)):
        return "malformed"
    if secret.startswith(CHECKSUM_PREFIX) and len(secret) == CHECKSUMMED_LEN:
        body = secret[len(CHECKSUM_PREFIX) : -CHECKSUM_CHARS]
        return "checksummed" if checksum(body) == secret[-CHECKSUM_CHARS:] else "malformed"
    return "legacy" if legacy_allowed else "malformed"
