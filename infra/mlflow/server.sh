#!/usr/bin/env bash
# The stack's MLflow server with its basic-auth app (the compose stack's mlflow service; infra/local-stack.sh
# runs it too). The app reads its settings from an ini file: it is written here from the service's
# environment, so the same image serves any database. No secret goes into it: the admin password comes
# from MLFLOW_AUTH_ADMIN_PASSWORD, the auth database's password from PGPASSWORD (libpq).
set -euo pipefail
: "${MLFLOW_AUTH_DATABASE_URI:?set MLFLOW_AUTH_DATABASE_URI to the database of the auth app users}"
: "${MLFLOW_AUTH_ADMIN_PASSWORD:?set MLFLOW_AUTH_ADMIN_PASSWORD}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set MLFLOW_FLASK_SERVER_SECRET_KEY}"
conf="${MLFLOW_AUTH_CONFIG_PATH:-$HOME/mlflow-auth.ini}"
umask 077
mkdir -p "$(dirname "$conf")"
cat > "$conf" <<INI
[mlflow]
default_permission = ${MLFLOW_DEFAULT_PERMISSION:-READ}
database_uri = ${MLFLOW_AUTH_DATABASE_URI}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_SECONDS:-0}
INI
export MLFLOW_AUTH_CONFIG_PATH="$conf"
exec mlflow server --app-name basic-auth "$@"
