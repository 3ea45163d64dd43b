"""compose.yaml and the Dockerfile agree with the settings, the CLI and each other (Docker itself is not run)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _resolve(value: object) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``, as if nothing were set."""

    def sub(m: re.Match) -> str:
        op, arg = m.group(2), m.group(3)
        if op in (":-", "-"):
            return arg
        if op in (":?", "?"):
            return "set-by-the-operator"
        return ""

    return INTERPOLATION.sub(sub, str(value))


def _env(service: str) -> dict[str, str]:
    env = COMPOSE["services"][service].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: _resolve(v) for k, v in env.items()}


def _settings_from(env: dict[str, str]) -> Settings:
    fields = {k[len("CHATGATE_"):].lower(): v for k, v in env.items() if k.startswith("CHATGATE_")}
    return Settings(**fields)


def test_the_services_are_postgres_a_migration_and_the_gateway():
    assert set(COMPOSE["services"]) == {"postgres", "migrate", "gateway"}


def test_every_chatgate_variable_is_a_settings_field():
    text = (ROOT / "compose.yaml").read_text() + DOCKERFILE
    used = set(re.findall(r"\bCHATGATE_([A-Z0-9_]+)", text))
    fields = {name.upper() for name in Settings.model_fields}
    assert used and used <= fields, f"not settings fields: {sorted(used - fields)}"


def test_the_gateway_environment_is_valid_settings_pointing_at_the_postgres_service():
    settings = _settings_from(_env("gateway"))
    assert settings.database_url.startswith("postgresql+asyncpg://")
    assert _settings_from(_env("migrate")).database_url == settings.database_url
    pg = _env("postgres")
    m = re.match(r"postgresql\+asyncpg://([^:]+):([^@]+)@([^:/]+):(\d+)/(\w+)$", settings.database_url)
    assert m, settings.database_url
    user, password, host, port, db = m.groups()
    assert (user, password, db) == (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"])
    assert host == "postgres" and port == "5432"
    assert settings.host == "0.0.0.0" and settings.device.startswith("cuda")
    assert settings.admin_token is not None


def test_ports_match_the_gateway_setting():
    port = _settings_from(_env("gateway")).port
    gateway = COMPOSE["services"]["gateway"]
    published = [_resolve(p) for p in gateway["ports"]]
    assert [p.rsplit(":", 1)[1] for p in published] == [str(port)]
    assert f"127.0.0.1:{port}/health" in " ".join(gateway["healthcheck"]["test"])
    assert re.search(rf"^EXPOSE {port}$", DOCKERFILE, re.M)
    assert f"CHATGATE_PORT={port}" in DOCKERFILE


def test_start_order_and_health_checks():
    services = COMPOSE["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {
        "postgres": {"condition": "service_healthy"},
        "migrate": {"condition": "service_completed_successfully"},
    }
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert services["gateway"]["healthcheck"]["start_period"]


def test_the_gateway_reserves_a_gpu():
    devices = COMPOSE["services"]["gateway"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]


@pytest.mark.parametrize("service", ["migrate", "gateway"])
def test_the_commands_are_real_cli_commands(service: str):
    command = COMPOSE["services"][service]["command"]
    assert command[0] == "chatgate"
    done = subprocess.run([sys.executable, "-m", "app.cli", *command[1:], "--help"], cwd=ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_the_dockerfile_copies_every_package_the_project_ships():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {src for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.M) for src in line.split()[:-1]}
    for pattern in include:
        package = pattern.rstrip("*")
        assert package in copied or any((ROOT / c / package).is_dir() for c in copied), package
    assert {"migrations", "alembic.ini", "web", "pyproject.toml"} <= copied
    assert all((ROOT / src).exists() for src in copied)


def test_deploy_doc_names_every_variable_the_compose_file_sets():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for service in ("postgres", "migrate", "gateway"):
        for name in _env(service):
            assert name in doc, f"docs/deploy.md does not mention {name}"
