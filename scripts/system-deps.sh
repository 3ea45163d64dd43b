#!/usr/bin/env bash
# System services and packages the tests need; idempotent, safe to run often.
set -euo pipefail
# PostgreSQL for the tenancy tests (this kind of machine has one installed).
if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
  fi
fi
# Debian's Chromium for the browser tests (Playwright drives it; never `playwright install`).
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
