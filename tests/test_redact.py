"""Secrets from the environment never reach logs or messages."""

from __future__ import annotations

import io
import logging

import httpx
import pytest
from discord_server import discord_server  # noqa: F401

from trainer.infra.redact import SECRET_ENV_VARS, install_log_redaction, redact, redact_obj

SECRETS = {
    "WANDB_API_KEY": "wandb-key-0123456789abcdef0123456789abcdef",
    "HF_TOKEN": "hf_SeCrEtToKeNvAlUe123456",
    "HUGGING_FACE_HUB_TOKEN": "hf_OtherSecretToken987654",
    "DISCORD_WEBHOOK_URL": "https://discord.com/api/webhooks/123456789/Abc-DEF_ghi.jkl+mno/p",
    "DISCORD_WEBHOOK": "https://discordapp.com/api/webhooks/42424242/legacyTokenValue",
    "SERVE_API_KEY": "sk-serve-0123456789abcdef",
}


@pytest.fixture
def secrets_env(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    return SECRETS


def test_every_secret_env_var_is_covered():
    assert set(SECRETS) == set(SECRET_ENV_VARS)


def test_redact_masks_every_secret_value(secrets_env):
    text = " | ".join(f"{k}={v}" for k, v in secrets_env.items())
    out = redact(text)
    for value in secrets_env.values():
        assert value not in out
    assert out.count("***") == len(secrets_env)
    assert "WANDB_API_KEY=***" in out


def test_redact_masks_url_encoded_values_and_bare_webhook_tokens(secrets_env):
    from urllib.parse import quote

    url = secrets_env["DISCORD_WEBHOOK_URL"]
    assert quote(url, safe="") not in redact(f"GET /proxy?target={quote(url, safe='')}")
    # The token alone (e.g. in an error message that shows only the path) is masked too.
    assert "Abc-DEF_ghi.jkl+mno" not in redact("token Abc-DEF_ghi.jkl+mno/p rejected")
    # Any webhook URL, even one not from the environment, loses its token.
    other = "see https://discord.com/api/v10/webhooks/987654321/someOtherToken_42 now"
    assert redact(other) == "see https://discord.com/api/v10/webhooks/987654321/*** now"


def test_short_or_unset_values_do_not_mangle_text(monkeypatch):
    for name in SECRET_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", "1")
    assert redact("step 1 of 10, loss 1.1") == "step 1 of 10, loss 1.1"


def test_redact_obj_walks_nested_structures(secrets_env):
    token = secrets_env["HF_TOKEN"]
    obj = {"a": [token, ("x", token)], token: 3, "n": 1.5, "none": None}
    assert redact_obj(obj) == {"a": ["***", ("x", "***")], "***": 3, "n": 1.5, "none": None}


def test_log_filter_masks_messages_args_and_tracebacks(secrets_env):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        install_log_redaction()
        install_log_redaction()  # idempotent
        assert len(handler.filters) == 1
        log = logging.getLogger("trainer.test_redact")
        log.warning(
            "posting to %s with key %s", secrets_env["DISCORD_WEBHOOK_URL"], secrets_env["WANDB_API_KEY"]
        )
        try:
            raise RuntimeError(f"hub refused token {secrets_env['HF_TOKEN']}")
        except RuntimeError:
            log.exception("download failed")
    finally:
        root.removeHandler(handler)
    out = stream.getvalue()
    assert "posting to *** with key ***" in out
    assert "RuntimeError: hub refused token ***" in out and "Traceback" in out
    for value in secrets_env.values():
        assert value not in out


def test_httpx_request_logs_do_not_show_the_webhook_url(discord_server, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv("DISCORD_WEBHOOK_URL", discord_server.url)
    install_log_redaction()
    with caplog.at_level(logging.DEBUG):
        # httpx logs "HTTP Request: POST <url>" at INFO; after install_log_redaction that is not shown.
        with httpx.Client() as client:
            client.post(discord_server.url, json={"content": "hi"})
        logging.getLogger("httpx").warning("explicit %s", discord_server.url)
    assert discord_server.token not in caplog.text
    assert "explicit ***" in caplog.text
