"""API key format, generation and verification.

A key reads ``cg_<8 chars>_<43 chars>``: the first 11 characters are the visible
prefix (stored, shown in listings, used to find the row), the rest is
``secrets.token_urlsafe(32)`` (256 random bits). Only ``sha256(full key)`` is
stored. A plain SHA-256 is enough here: the key is uniformly random with 256
bits of entropy, so neither a salt nor a slow hash adds anything (unlike
passwords). Digests are compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

KEY_SCHEME = "cg_"
PREFIX_ID_LEN = 8
PREFIX_LEN = len(KEY_SCHEME) + PREFIX_ID_LEN  # 11
SECRET_LEN = 43  # len(token_urlsafe(32))
KEY_LEN = PREFIX_LEN + 1 + SECRET_LEN

_PREFIX_ALPHABET = string.ascii_lowercase + string.digits
_SECRET_ALPHABET = frozenset(string.ascii_letters + string.digits + "-_")


def generate_key() -> tuple[str, str]:
    """A fresh key. Returns ``(prefix, plain_key)``; show the plain key once, then drop it."""
    prefix = KEY_SCHEME + "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_ID_LEN))
    return prefix, f"{prefix}_{secrets.token_urlsafe(32)}"


def digest_key(plain_key: str) -> str:
    """SHA-256 of the whole key, 64 hex characters."""
    return hashlib.sha256(plain_key.encode("utf-8")).hexdigest()


def parse_prefix(plain_key: str) -> str | None:
    """The visible prefix of a well-formed key, or ``None`` when the text cannot be a key.

    Checks shape only (no database), so malformed input never costs a query.
    """
    if not isinstance(plain_key, str) or len(plain_key) != KEY_LEN:
        return None
    prefix, sep, secret = plain_key[:PREFIX_LEN], plain_key[PREFIX_LEN], plain_key[PREFIX_LEN + 1 :]
    if not prefix.startswith(KEY_SCHEME) or sep != "_":
        return None
    if any(c not in _PREFIX_ALPHABET for c in prefix[len(KEY_SCHEME) :]):
        return None
    if any(c not in _SECRET_ALPHABET for c in secret):
        return None
    return prefix


def is_prefix(text: str) -> bool:
    """Whether ``text`` looks like a visible key prefix (``cg_`` + 8 of [a-z0-9])."""
    return (
        len(text) == PREFIX_LEN
        and text.startswith(KEY_SCHEME)
        and all(c in _PREFIX_ALPHABET for c in text[len(KEY_SCHEME) :])
    )


def verify_digest(plain_key: str, stored_digest: str) -> bool:
    """Constant-time comparison of the key's digest with the stored one."""
    return hmac.compare_digest(digest_key(plain_key).encode("ascii"), stored_digest.encode("ascii"))
