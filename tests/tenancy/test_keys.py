"""Key format, digests and the shape check that guards the database."""

from __future__ import annotations

import hashlib

import pytest

from tenancy import keys


def test_generated_key_has_visible_prefix_and_parses_back():
    prefix, plain = keys.generate_key()
    assert plain.startswith(prefix + "_")
    assert len(prefix) == keys.PREFIX_LEN and prefix.startswith("cg_")
    assert len(plain) == keys.KEY_LEN
    assert keys.parse_prefix(plain) == prefix
    assert keys.is_prefix(prefix)


def test_generated_keys_are_unique():
    drawn = [keys.generate_key() for _ in range(2000)]
    assert len({p for p, _ in drawn}) == len(drawn)
    assert len({k for _, k in drawn}) == len(drawn)


def test_digest_is_sha256_hex_of_the_whole_key():
    _, plain = keys.generate_key()
    assert keys.digest_key(plain) == hashlib.sha256(plain.encode()).hexdigest()
    assert keys.verify_digest(plain, keys.digest_key(plain))
    assert not keys.verify_digest(plain[:-1] + ("A" if plain[-1] != "A" else "B"), keys.digest_key(plain))


@pytest.mark.parametrize(
    "text",
    [
        "",
        "cg_",
        "Bearer cg_abcdefgh_" + "x" * 43,
        "xx_abcdefgh_" + "x" * 43,  # wrong scheme
        "cg_ABCDEFGH_" + "x" * 43,  # prefix must be lower-case
        "cg_abcdefgh-" + "x" * 43,  # wrong separator
        "cg_abcdefgh_" + "x" * 42,  # too short
        "cg_abcdefgh_" + "x" * 44,  # too long
        "cg_abcdefgh_" + "x" * 42 + "!",  # not url-safe base64
        "cg_abcdefgh_" + "x" * 42 + "\u00e9",
    ],
)
def test_malformed_keys_have_no_prefix(text):
    assert keys.parse_prefix(text) is None


def test_non_string_key_is_malformed():
    assert keys.parse_prefix(None) is None  # type: ignore[arg-type]
    assert keys.parse_prefix(b"cg_abcdefgh_" + b"x" * 43) is None  # type: ignore[arg-type]


from hypothesis import given, strategies as st  # noqa: E402


@given(st.text(max_size=80))
def test_parse_prefix_never_raises_and_only_accepts_key_shapes(text):
    prefix = keys.parse_prefix(text)
    assert prefix is None or (text.startswith(prefix + "_") and keys.is_prefix(prefix))
