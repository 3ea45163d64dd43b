"""The admin API (``/admin``) on the real Starlette app and a real SQLite store.

The engine is a stub (the admin API never touches it); the app's lifespan
migrates and opens the store, as in production.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from app.server import create_app
from app.settings import Settings

ADMIN_TOKEN = "admin-test-token-0123456789"

# (method, path, json body) for every endpoint; {name} and {prefix} are filled in.
ENDPOINTS = [
    ("GET", "/admin/tenants", None),
    ("POST", "/admin/tenants", {"name": "newco"}),
    ("GET", "/admin/tenants/acme", None),
    ("PATCH", "/admin/tenants/acme", {"weight": 3}),
    ("POST", "/admin/tenants/acme/disable", None),
    ("POST", "/admin/tenants/acme/enable", None),
    ("GET", "/admin/tenants/acme/keys", None),
    ("POST", "/admin/tenants/acme/keys", None),
    ("GET", "/admin/tenants/acme/usage", None),
    ("DELETE", "/admin/keys/{prefix}", None),
    ("GET", "/admin/usage", None),
]


class StubLLM:
    model_name = "stub"
    max_model_len = 128

    def stats(self) -> dict:
        return {"model": "stub"}


def _client(tmp_path, token: str | None = ADMIN_TOKEN) -> TestClient:
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path / 'admin.db'}", admin_token=token)
    return TestClient(create_app(settings, llm=StubLLM()))


@pytest.fixture
def client(tmp_path):
    with _client(tmp_path) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        created = client.post("/admin/tenants", json={"name": "acme", "allowed_priorities": ["interactive", "batch"],
                                                       "quotas": {"tokens_per_day": 5000}})  # fmt: skip
        assert created.status_code == 201, created.text
        client.acme_key = created.json()["api_key"]
        client.acme_prefix = created.json()["keys"][0]["prefix"]
        yield client


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_every_endpoint_refuses_a_missing_credential_and_a_tenant_key(client, method, path, body):
    path = path.format(prefix=client.acme_prefix)
    for headers in ({"Authorization": ""}, {"Authorization": f"Bearer {client.acme_key}"},
                    {"Authorization": f"Basic {ADMIN_TOKEN}"}, {"Authorization": f"Bearer {ADMIN_TOKEN}x"}):  # fmt: skip
        answer = client.request(method, path, json=body, headers=headers)
        assert answer.status_code == 401, (headers, answer.text)
        assert answer.json()["error"]["code"] == "unauthorized"
        assert answer.headers["www-authenticate"].startswith("Bearer")
    # Nothing changed: the tenant is still there, enabled, with weight 1 and one live key.
    tenant = client.get("/admin/tenants/acme").json()
    assert tenant["weight"] == 1.0 and not tenant["disabled"] and not tenant["keys"][0]["revoked"]
    assert [t["name"] for t in client.get("/admin/tenants").json()["tenants"]] == ["acme"]


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_without_an_admin_token_every_endpoint_is_disabled(tmp_path, method, path, body):
    with _client(tmp_path, token=None) as client:
        answer = client.request(method, path.format(prefix="cg_aaaaaaaa"), json=body,
                                headers={"Authorization": "Bearer anything"})  # fmt: skip
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "admin_disabled"


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_every_endpoint_works_with_the_admin_token(client, method, path, body):
    answer = client.request(method, path.format(prefix=client.acme_prefix), json=body)
    assert answer.status_code in (200, 201), answer.text


def test_create_lists_masked_keys_and_quotas(client):
    [tenant] = client.get("/admin/tenants").json()["tenants"]
    assert tenant["allowed_priorities"] == ["interactive", "batch"]
    assert tenant["quotas"]["tokens_per_day"] == 5000 and tenant["quotas"]["requests_per_minute"] is None
    assert tenant["keys"][0]["masked"] == client.acme_prefix + "_…"
    assert client.acme_key not in client.get("/admin/tenants").text  # the plain key is shown once only
    assert tenant["usage"]["in_flight"] == 0


def test_patch_changes_only_the_given_fields(client):
    answer = client.patch("/admin/tenants/acme", json={"weight": 2.5, "quotas": {"requests_per_minute": 60}})
    assert answer.status_code == 200, answer.text
    quotas = answer.json()["quotas"]
    assert answer.json()["weight"] == 2.5
    assert quotas["requests_per_minute"] == 60 and quotas["tokens_per_day"] == 5000  # kept
    cleared = client.patch("/admin/tenants/acme", json={"quotas": {"tokens_per_day": None}}).json()["quotas"]
    assert cleared["tokens_per_day"] is None and cleared["requests_per_minute"] == 60


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"weight": 0}, "weight"),
        ({"weight": "heavy"}, "weight"),
        ({"allowed_priorities": ["urgent"]}, "allowed_priorities.0"),
        ({"allowed_priorities": []}, "allowed_priorities"),
        ({"quotas": {"tokens_per_day": -1}}, "quotas.tokens_per_day"),
        ({"quotas": {"tokens_per_year": 5}}, "quotas.tokens_per_year"),
        ({"name": "9lives"}, "name"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_invalid_input_is_a_422_naming_the_field(client, body, field):
    answer = client.patch("/admin/tenants/acme", json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and field in [f["field"] for f in error["fields"]]
    assert field in error["message"]


def test_bad_json_unknown_tenant_and_taken_name(client):
    answer = client.post("/admin/tenants", content=b"{nope", headers={"Content-Type": "application/json"})
    assert answer.status_code == 422 and "not valid JSON" in answer.json()["error"]["message"]
    assert client.get("/admin/tenants/ghost").status_code == 404
    assert client.post("/admin/tenants", json={"name": "acme"}).status_code == 409
    assert client.get("/admin/tenants/acme/usage?minutes=0").status_code == 422


def test_disable_revoke_and_usage(client):
    assert client.post("/admin/tenants/acme/disable").json()["disabled"] is True
    assert client.post("/admin/tenants/acme/enable").json()["disabled"] is False
    new = client.post("/admin/tenants/acme/keys").json()
    assert new["api_key"].startswith(new["prefix"] + "_")
    assert client.delete(f"/admin/keys/{new['prefix']}").json()["revoked"] is True
    usage = client.get("/admin/usage").json()["tenants"][0]
    assert usage["tenant"] == "acme" and usage["all_time"]["requests"] == 0
    series = client.get("/admin/tenants/acme/usage?minutes=30&bucket_minutes=5").json()
    assert series["bucket_minutes"] == 5 and 6 <= len(series["points"]) <= 7


def test_admin_page_is_served(client):
    page = client.get("/admin/", headers={"Authorization": ""})
    assert page.status_code == 200 and "admin.js" in page.text
    assert client.get("/admin", follow_redirects=False).status_code == 308
