-- One cluster, one database per service; the names come from infra/stack.env (the postgres service's
-- env_file; infra/local-stack.sh passes the same environment). \getenv needs psql 15.
\getenv owner POSTGRES_USER
\getenv mlflow_db MLFLOW_DB
\getenv optuna_db OPTUNA_DB
CREATE DATABASE :"mlflow_db" OWNER :"owner";
CREATE DATABASE :"optuna_db" OWNER :"owner";
