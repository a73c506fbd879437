"""The stack's MLflow users, created by the auth app's admin (the compose stack's mlflow-users service).

    python infra/mlflow/users.py

Creates the platform identity ``$MLFLOW_TRACKING_USERNAME`` with ``$MLFLOW_PLATFORM_PASSWORD``, or sets
that password when the user exists (the stack's secrets are the one source; running it twice changes
nothing). The platform identity is not an admin: it owns what it creates (experiments, registered models,
so it alone moves their aliases) and reads the rest at the server's default permission.
"""

from __future__ import annotations

import os
import sys

from mlflow.exceptions import RestException
from mlflow.server.auth.client import AuthServiceClient


def ensure_user(client: AuthServiceClient, username: str, password: str) -> str:
    """Create ``username`` or set its password; returns what was done."""
    try:
        client.get_user(username)
    except RestException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_user(username, password)
        return "created"
    client.update_user_password(username, password)
    return "password set"


def main() -> int:
    need = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_PLATFORM_PASSWORD", "MLFLOW_ADMIN_PASSWORD")
    missing = [v for v in need if not os.environ.get(v)]
    if missing:
        print(f"mlflow-users: {', '.join(missing)} not set", file=sys.stderr)
        return 2
    platform = os.environ["MLFLOW_TRACKING_USERNAME"]
    # This process acts as the admin; MLflow's client reads its credentials from these two variables.
    os.environ["MLFLOW_TRACKING_USERNAME"] = os.environ.get("MLFLOW_AUTH_ADMIN_USERNAME") or "admin"
    os.environ["MLFLOW_TRACKING_PASSWORD"] = os.environ["MLFLOW_ADMIN_PASSWORD"]
    done = ensure_user(AuthServiceClient(os.environ["MLFLOW_TRACKING_URI"]), platform,
                       os.environ["MLFLOW_PLATFORM_PASSWORD"])
    print(f"mlflow-users: {platform}: {done}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
