#!/bin/sh
# Wait for the database, bring its schema up to date, register the tokens given by the
# environment (secrets), then serve.  Several replicas may run this at once: Alembic upgrades
# are transactional on PostgreSQL, and token registration is idempotent.
set -eu
cmtune db wait --timeout "${CMTUNE_DB_WAIT_SECONDS:-60}"
cmtune db upgrade
if [ -n "${CMTUNE_ADMIN_TOKEN:-}" ]; then
    cmtune token create --role admin --name bootstrap-admin --value "$CMTUNE_ADMIN_TOKEN" >/dev/null
fi
if [ -n "${CMTUNE_WORKER_TOKEN:-}" ]; then
    cmtune token create --role worker --name bootstrap-worker --value "$CMTUNE_WORKER_TOKEN" >/dev/null
fi
exec cmtune serve --host "${CMTUNE_HOST:-0.0.0.0}" --port "${CMTUNE_PORT:-8470}"
