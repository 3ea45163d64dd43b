"""app.settings: defaults, environment, derived values and validation.

(Lives here because this suite owns app/settings.py for now.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, get_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.upper().startswith("CHATGATE_"):
            monkeypatch.delenv(name)


def test_defaults():
    s = get_settings()
    assert (s.host, s.port, s.model, s.log_level) == ("127.0.0.1", 8000, "smollm2-135m-instruct", "info")
    assert (s.block_size, s.num_gpu_blocks, s.max_num_seqs, s.max_num_batched_tokens) == (16, None, 64, 2048)
    assert (s.max_model_len, s.dtype, s.device) == (None, "float32", "cpu")
    assert (s.auth_timeout_s, s.ws_max_message_bytes, s.ws_send_queue_size) == (5.0, 65536, 256)
    assert s.admin_token is None and s.data_dir == Path("data")


def test_database_url_derives_from_data_dir(tmp_path):
    s = get_settings(data_dir=tmp_path / "d")
    assert s.database_url == f"sqlite+aiosqlite:///{(tmp_path / 'd' / 'chatgate.db').resolve()}"


def test_allowed_origins_default_to_this_server():
    assert get_settings(port=9001).allowed_origins == ["http://localhost:9001", "http://127.0.0.1:9001"]


def test_environment_is_read_with_prefix(monkeypatch):
    monkeypatch.setenv("CHATGATE_PORT", "9100")
    monkeypatch.setenv("CHATGATE_DATABASE_URL", "postgresql+asyncpg://u@h/db")
    monkeypatch.setenv("CHATGATE_ALLOWED_ORIGINS", "https://a.example, https://b.example:8443")
    monkeypatch.setenv("CHATGATE_ADMIN_TOKEN", "s3cret")
    monkeypatch.setenv("CHATGATE_NUM_GPU_BLOCKS", "512")
    s = get_settings()
    assert s.port == 9100 and s.database_url == "postgresql+asyncpg://u@h/db"
    assert s.allowed_origins == ["https://a.example", "https://b.example:8443"]
    assert s.admin_token.get_secret_value() == "s3cret" and "s3cret" not in repr(s)
    assert s.num_gpu_blocks == 512


def test_overrides_beat_environment(monkeypatch):
    monkeypatch.setenv("CHATGATE_PORT", "9100")
    assert get_settings(port=9200).port == 9200


def test_origins_accept_a_json_list(monkeypatch):
    monkeypatch.setenv("CHATGATE_ALLOWED_ORIGINS", '["http://x:1"]')
    assert get_settings().allowed_origins == ["http://x:1"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"port": 0},
        {"port": 70000},
        {"block_size": 0},
        {"max_num_seqs": 0},
        {"dtype": "int8"},
        {"device": "tpu"},
        {"log_level": "loud"},
        {"auth_timeout_s": 0},
        {"allowed_origins": ["not a url"]},
        {"database_url": "mysql://x/y"},
        {"no_such_field": 1},
    ],
)
def test_invalid_values_are_rejected(overrides):
    with pytest.raises(ValidationError):
        get_settings(**overrides)


def test_settings_are_frozen():
    with pytest.raises(ValidationError):
        get_settings().port = 1  # type: ignore[misc]


def test_engine_options_are_plain_values():
    options = Settings(max_model_len=4096).engine_options()
    assert options["block_size"] == 16 and options["max_model_len"] == 4096
    assert options["tensor_parallel_size"] == 1 and options["tensor_parallel_timeout_s"] == 300.0
    from engine.llm_engine import EngineConfig

    EngineConfig(**{k: v for k, v in options.items() if k != "model"})  # every option is one the engine takes
