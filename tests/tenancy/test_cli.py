"""``chatgate db|tenants|keys`` end to end through ``app.cli.main``."""

from __future__ import annotations

import asyncio
import re

import pytest

from app.cli import main
from tenancy import TenancyStore
from tenancy.migrate import head_revision

KEY_RE = re.compile(r"cg_[a-z0-9]{8}_[A-Za-z0-9_-]{43}")


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _authenticate(url: str, plain: str):
    async def run():
        async with TenancyStore(url) as store:
            return await store.authenticate(plain)

    return asyncio.run(run())


@pytest.fixture
def cli_url(database_url, capsys) -> str:
    code, _, err = _cli(capsys, "db", "upgrade", "--database-url", database_url)
    assert code == 0, err
    assert "revision" in err
    return database_url


def test_tenants_create_prints_the_key_once_with_a_warning(cli_url, capsys):
    code, out, err = _cli(
        capsys, "tenants", "create", "acme", "--weight", "2", "--priorities", "interactive,standard",
        "--database-url", cli_url,
    )
    assert code == 0, err
    keys = KEY_RE.findall(out + err)
    assert len(keys) == 1 and out.strip() == keys[0]  # stdout holds the key alone
    assert "will not be shown again" in err
    principal = _authenticate(cli_url, keys[0])
    assert principal.tenant_name == "acme" and principal.weight == 2.0
    assert principal.allowed_priorities == {"interactive", "standard"}


def test_tenants_list_and_keys_list_mask_keys(cli_url, capsys):
    _, first, _ = _cli(capsys, "tenants", "create", "acme", "--database-url", cli_url)
    code, second, _ = _cli(capsys, "keys", "create", "acme", "--database-url", cli_url)
    assert code == 0 and KEY_RE.fullmatch(second.strip())
    code, out, _ = _cli(capsys, "tenants", "list", "--database-url", cli_url)
    assert code == 0 and "acme" in out and "standard,batch" in out and "active" in out
    code, out, _ = _cli(capsys, "keys", "list", "acme", "--database-url", cli_url)
    assert code == 0
    assert not KEY_RE.search(out)
    for plain in (first.strip(), second.strip()):
        assert plain not in out and plain[:11] in out  # the visible prefix only


def test_keys_revoke_stops_the_key(cli_url, capsys):
    _, out, _ = _cli(capsys, "tenants", "create", "acme", "--database-url", cli_url)
    plain = out.strip()
    code, _, err = _cli(capsys, "keys", "revoke", plain[:11], "--database-url", cli_url)
    assert code == 0 and "revoked" in err
    assert _authenticate(cli_url, plain) is None
    _, out, _ = _cli(capsys, "keys", "list", "acme", "--database-url", cli_url)
    assert "revoked" in out


def test_tenants_disable_and_enable(cli_url, capsys):
    _, out, _ = _cli(capsys, "tenants", "create", "acme", "--database-url", cli_url)
    plain = out.strip()
    assert _cli(capsys, "tenants", "disable", "acme", "--database-url", cli_url)[0] == 0
    assert _authenticate(cli_url, plain) is None
    assert "disabled" in _cli(capsys, "tenants", "list", "--database-url", cli_url)[1]
    assert _cli(capsys, "tenants", "enable", "acme", "--database-url", cli_url)[0] == 0
    assert _authenticate(cli_url, plain) is not None


@pytest.mark.parametrize(
    "argv, message",
    [
        (("tenants", "disable", "ghost"), "no tenant"),
        (("keys", "create", "ghost"), "no tenant"),
        (("keys", "list", "ghost"), "no tenant"),
        (("keys", "revoke", "cg_00000000"), "no API key"),
        (("tenants", "create", "bad name"), "invalid tenant name"),
        (("tenants", "create", "x", "--weight", "0"), "weight"),
        (("tenants", "create", "x", "--priorities", "urgent"), "unknown priority"),
    ],
)
def test_failures_exit_1_with_a_clear_message(cli_url, capsys, argv, message):
    code, out, err = _cli(capsys, *argv, "--database-url", cli_url)
    assert code == 1 and message in err and "Traceback" not in err
    assert not KEY_RE.search(out)


def test_duplicate_tenant_exits_1(cli_url, capsys):
    _cli(capsys, "tenants", "create", "acme", "--database-url", cli_url)
    code, out, err = _cli(capsys, "tenants", "create", "acme", "--database-url", cli_url)
    assert code == 1 and "already exists" in err and out == ""


def test_unreachable_database_exits_3(capsys):
    code, _, err = _cli(capsys, "tenants", "list", "--database-url", "postgresql+asyncpg://postgres@127.0.0.1:1/x")
    assert code == 3 and "unavailable" in err


def test_missing_schema_exits_3_and_says_upgrade(sqlite_url, capsys):
    code, _, err = _cli(capsys, "tenants", "list", "--database-url", sqlite_url)
    assert code == 3 and "chatgate db upgrade" in err


def test_database_url_defaults_to_settings_from_any_cwd(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATGATE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("CHATGATE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _cli(capsys, "db", "upgrade")[0] == 0
    assert (tmp_path / "data" / "chatgate.db").is_file()
    code, out, _ = _cli(capsys, "tenants", "create", "acme")
    assert code == 0 and KEY_RE.fullmatch(out.strip())
    assert "acme" in _cli(capsys, "tenants", "list")[1]


def test_db_current_reports_head(cli_url, capsys):
    code, out, _ = _cli(capsys, "db", "current", "--database-url", cli_url)
    assert code == 0 and out.startswith(head_revision())


def test_tenants_update_sets_weight_classes_and_quotas(cli_url, capsys):
    assert _cli(capsys, "tenants", "create", "quotaco", "--database-url", cli_url)[0] == 0
    code, _, err = _cli(capsys, "tenants", "update", "quotaco", "--database-url", cli_url, "--weight", "3",
                        "--priorities", "interactive,batch", "--rpm", "60", "--tpm", "20000",
                        "--max-concurrent", "4", "--tokens-per-day", "none", "--tokens-per-month", "1000000")  # fmt: skip
    assert code == 0, err
    assert "weight 3" in err and "requests_per_minute=60" in err and "tokens_per_day=unlimited" in err
    # Only the given quota changes on a second update.
    code, _, err = _cli(capsys, "tenants", "update", "quotaco", "--database-url", cli_url, "--rpm", "none")
    assert code == 0 and "requests_per_minute=unlimited" in err and "max_concurrent_chats=4" in err
    assert "interactive,batch" in err


def test_tenants_update_rejects_a_negative_quota_and_unknown_tenant(cli_url, capsys):
    with pytest.raises(SystemExit) as info:
        _cli(capsys, "tenants", "update", "x", "--database-url", cli_url, "--rpm", "-5")
    assert info.value.code == 2
    assert _cli(capsys, "tenants", "update", "ghost", "--database-url", cli_url, "--weight", "2")[0] == 1


def test_usage_lists_every_tenant_and_one_tenant_in_detail(cli_url, capsys):
    assert _cli(capsys, "tenants", "create", "usageco", "--database-url", cli_url)[0] == 0
    assert _cli(capsys, "tenants", "update", "usageco", "--database-url", cli_url, "--tokens-per-day", "500")[0] == 0
    code, out, _ = _cli(capsys, "usage", "--database-url", cli_url)
    assert code == 0 and "usageco" in out and "0/500" in out
    code, out, _ = _cli(capsys, "usage", "usageco", "--database-url", cli_url, "--minutes", "5")
    assert code == 0 and "MINUTE (UTC)" in out and "REQUEST" in out
