"""TenancyStore behaviour, each test on SQLite and on PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging

import pytest
from sqlalchemy import text

from tenancy import (
    NotFoundError,
    Principal,
    Quotas,
    StoreUnavailableError,
    TenancyStore,
    TenantExistsError,
)
from tenancy.db import create_engine

pytestmark = pytest.mark.anyio


# ---- tenants -------------------------------------------------------------------------------


async def test_create_tenant_has_defaults(store):
    tenant = await store.create_tenant("acme")
    assert tenant.name == "acme" and tenant.weight == 1.0 and not tenant.disabled
    assert tenant.allowed_priorities == {"standard", "batch"}
    assert tenant.quotas == Quotas()
    assert tenant.created_at.tzinfo is not None
    assert dataclasses.is_dataclass(tenant)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tenant.name = "other"  # type: ignore[misc]


async def test_create_tenant_with_weight_priorities_and_quotas(store):
    quotas = Quotas(requests_per_minute=60, tokens_per_day=10**9)
    tenant = await store.create_tenant(
        "beta", weight=2.5, allowed_priorities=["interactive", "standard"], quotas=quotas
    )
    again = await store.get_tenant("beta")
    assert again == tenant
    assert again.weight == 2.5 and again.allowed_priorities == {"interactive", "standard"}
    assert again.quotas == quotas


async def test_duplicate_tenant_raises_tenant_exists(store):
    await store.create_tenant("acme")
    with pytest.raises(TenantExistsError):
        await store.create_tenant("acme")
    assert await store.count_tenants() == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": ""},
        {"name": "1abc"},
        {"name": "has space"},
        {"name": "x" * 65},
        {"name": "ok", "weight": 0},
        {"name": "ok", "weight": -1},
        {"name": "ok", "weight": float("nan")},
        {"name": "ok", "allowed_priorities": ["urgent"]},
        {"name": "ok", "allowed_priorities": []},
    ],
)
async def test_invalid_tenant_values_raise_value_error(store, kwargs):
    with pytest.raises(ValueError):
        await store.create_tenant(**kwargs)
    assert await store.count_tenants() == 0


async def test_get_tenant_by_name_or_id_and_not_found(store):
    tenant = await store.create_tenant("acme")
    assert await store.get_tenant(tenant.id) == tenant
    assert await store.get_tenant(str(tenant.id)) == tenant
    with pytest.raises(NotFoundError):
        await store.get_tenant("nobody")
    with pytest.raises(NotFoundError):
        await store.get_tenant(9999)


async def test_list_and_count_tenants(store):
    assert await store.list_tenants() == [] and await store.count_tenants() == 0
    for name in ("a", "b", "c"):
        await store.create_tenant(name)
    assert [t.name for t in await store.list_tenants()] == ["a", "b", "c"]
    assert await store.count_tenants() == 3


async def test_update_tenant_changes_only_given_fields(store):
    before = await store.create_tenant("acme", weight=1.0)
    after = await store.update_tenant("acme", weight=4.0, allowed_priorities="interactive")
    assert after.weight == 4.0 and after.allowed_priorities == {"interactive"}
    assert after.name == "acme" and after.created_at == before.created_at
    assert after.updated_at >= before.updated_at
    renamed = await store.update_tenant(after.id, name="acme2", quotas=Quotas(max_concurrent_chats=3))
    assert renamed.name == "acme2" and renamed.quotas.max_concurrent_chats == 3
    await store.create_tenant("other")
    with pytest.raises(TenantExistsError):
        await store.update_tenant("other", name="acme2")
    with pytest.raises(NotFoundError):
        await store.update_tenant("ghost", weight=2)


async def test_delete_tenant_deletes_its_keys(store):
    await store.create_tenant("acme")
    _, plain = await store.create_key("acme")
    await store.delete_tenant("acme")
    assert await store.authenticate(plain) is None
    with pytest.raises(NotFoundError):
        await store.list_keys("acme")


# ---- keys and authentication ---------------------------------------------------------------


async def test_authenticate_returns_principal(store):
    tenant = await store.create_tenant("acme", weight=3, allowed_priorities="interactive,batch")
    info, plain = await store.create_key("acme")
    principal = await store.authenticate(plain)
    assert principal == Principal(
        tenant_id=tenant.id,
        tenant_name="acme",
        key_id=info.id,
        key_prefix=info.prefix,
        weight=3.0,
        allowed_priorities=frozenset({"interactive", "batch"}),
        quotas=Quotas(),
    )


async def test_wrong_secret_with_a_real_prefix_is_rejected(store):
    await store.create_tenant("acme")
    info, plain = await store.create_key("acme")
    forged = plain[:-4] + ("AAAA" if not plain.endswith("AAAA") else "BBBB")
    assert forged.startswith(info.prefix)
    assert await store.authenticate(forged) is None


@pytest.mark.parametrize("bad", ["", "nonsense", "cg_", "cg_zzzzzzzz_" + "a" * 43, "Bearer x" * 10])
async def test_unknown_or_malformed_key_is_rejected(store, bad):
    await store.create_tenant("acme")
    await store.create_key("acme")
    assert await store.authenticate(bad) is None


async def test_revoked_key_is_rejected_and_others_still_work(store):
    await store.create_tenant("acme")
    first, first_plain = await store.create_key("acme")
    _, second_plain = await store.create_key("acme")
    revoked = await store.revoke_key(first.prefix)
    assert revoked.revoked and revoked.id == first.id
    assert await store.authenticate(first_plain) is None
    assert await store.authenticate(second_plain) is not None
    # Idempotent: the first revocation time stays.
    assert (await store.revoke_key(first.id)).revoked_at == revoked.revoked_at


async def test_revoke_unknown_key_raises_not_found(store):
    with pytest.raises(NotFoundError):
        await store.revoke_key("cg_00000000")
    with pytest.raises(NotFoundError):
        await store.revoke_key(424242)


async def test_disabled_tenant_is_rejected_until_enabled(store):
    await store.create_tenant("acme")
    _, plain = await store.create_key("acme")
    assert (await store.set_disabled("acme", True)).disabled
    assert await store.authenticate(plain) is None
    assert not (await store.set_disabled("acme", False)).disabled
    assert await store.authenticate(plain) is not None


async def test_authenticate_updates_last_used_at(store):
    await store.create_tenant("acme")
    info, plain = await store.create_key("acme")
    assert info.last_used_at is None
    await store.authenticate(plain)
    (first,) = await store.list_keys("acme")
    assert first.last_used_at is not None and first.last_used_at >= info.created_at
    await asyncio.sleep(0.01)
    await store.authenticate(plain)
    (second,) = await store.list_keys("acme")
    assert second.last_used_at > first.last_used_at


async def test_failed_authentication_does_not_touch_last_used_at(store):
    await store.create_tenant("acme")
    info, plain = await store.create_key("acme")
    await store.revoke_key(info.prefix)
    await store.authenticate(plain)
    (key,) = await store.list_keys("acme")
    assert key.last_used_at is None


async def test_database_holds_only_the_digest_never_the_key(store, migrated_url):
    await store.create_tenant("acme")
    info, plain = await store.create_key("acme")
    secret = plain[len(info.prefix) + 1 :]
    engine = create_engine(migrated_url)
    try:
        async with engine.connect() as conn:
            rows = []
            for table in ("tenants", "api_keys", "alembic_version"):
                rows += (await conn.execute(text(f"SELECT * FROM {table}"))).all()
            digest = (await conn.execute(text("SELECT digest FROM api_keys"))).scalar_one()
    finally:
        await engine.dispose()
    dump = repr(rows)
    assert plain not in dump and secret not in dump
    assert digest == hashlib.sha256(plain.encode()).hexdigest()


async def test_key_listing_is_masked(store):
    await store.create_tenant("acme")
    _, plain = await store.create_key("acme")
    listed = await store.list_keys("acme")
    assert len(listed) == 1
    assert plain not in repr(listed) and plain[12:] not in repr(listed)
    assert listed[0].masked.startswith(listed[0].prefix)


async def test_create_key_for_unknown_tenant_raises_not_found(store):
    with pytest.raises(NotFoundError):
        await store.create_key("ghost")


async def test_keys_and_digests_are_never_logged(store, caplog):
    caplog.set_level(logging.DEBUG)
    await store.create_tenant("acme")
    _, plain = await store.create_key("acme")
    await store.authenticate(plain)
    await store.authenticate(plain[:-1] + "x")
    digest = hashlib.sha256(plain.encode()).hexdigest()
    assert plain not in caplog.text and digest not in caplog.text


async def test_concurrent_authentications_all_succeed(store):
    await store.create_tenant("acme")
    pairs = [await store.create_key("acme") for _ in range(4)]
    results = await asyncio.gather(*(store.authenticate(plain) for _, plain in pairs * 10))
    assert all(r is not None for r in results)


# ---- availability --------------------------------------------------------------------------


async def test_closed_postgres_port_raises_store_unavailable():
    async with TenancyStore("postgresql+asyncpg://postgres@127.0.0.1:1/test") as store:
        with pytest.raises(StoreUnavailableError):
            await store.authenticate("cg_abcdefgh_" + "a" * 43)
        with pytest.raises(StoreUnavailableError):
            await store.create_tenant("acme")
        with pytest.raises(StoreUnavailableError):
            await store.ping()


async def test_unopenable_sqlite_file_raises_store_unavailable(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(StoreUnavailableError):
        async with TenancyStore(f"sqlite+aiosqlite:///{tmp_path / 'not-a-dir' / 'x.db'}") as store:
            await store.list_tenants()


async def test_ping_succeeds_on_a_live_database(store):
    await store.ping()


async def test_missing_postgres_database_or_role_raises_store_unavailable(postgresql_url):
    base = postgresql_url.rsplit("/", 1)[0]
    user_less = base.replace("postgres@", "no_such_role_cg@").replace("root@", "no_such_role_cg@")
    for url in (f"{base}/no_such_database_cg", f"{user_less}/test"):
        async with TenancyStore(url) as store:
            with pytest.raises(StoreUnavailableError):
                await store.list_tenants()


# ---- concurrency ---------------------------------------------------------------------------


async def test_racing_creates_of_one_name_yield_one_tenant(migrated_url):
    stores = [TenancyStore(migrated_url) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(s.create_tenant("acme") for s in stores for _ in range(3)), return_exceptions=True
        )
    finally:
        for s in stores:
            await s.close()
    created = [r for r in results if not isinstance(r, BaseException)]
    assert len(created) == 1
    assert all(isinstance(r, TenantExistsError) for r in results if isinstance(r, BaseException))


async def test_concurrent_writers_from_two_stores_all_commit(migrated_url):
    a, b = TenancyStore(migrated_url), TenancyStore(migrated_url)
    try:
        await asyncio.gather(*(s.create_tenant(f"t{i}_{j}") for j, s in enumerate((a, b)) for i in range(15)))
        assert await a.count_tenants() == 30
    finally:
        await a.close()
        await b.close()
