-- One cluster, one database per service, one login role per service that owns its database and
-- nothing else: no service connects as the superuser (POSTGRES_USER). A role is named after its
-- database; names come from infra/stack.env (the postgres service's env_file), passwords from the
-- service's secrets (infra/local-stack.sh passes the same environment). \getenv needs psql 15.
\getenv prefect_db POSTGRES_DB
\getenv mlflow_db MLFLOW_DB
\getenv mlflow_auth_db MLFLOW_AUTH_DB
\getenv optuna_db OPTUNA_DB
\getenv prefect_pw PREFECT_DB_PASSWORD
\getenv mlflow_pw MLFLOW_DB_PASSWORD
\getenv optuna_pw OPTUNA_DB_PASSWORD
CREATE ROLE :"prefect_db" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'prefect_pw';
CREATE ROLE :"mlflow_db" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'mlflow_pw';
CREATE ROLE :"optuna_db" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'optuna_pw';
-- The entrypoint created POSTGRES_DB (Prefect's) for the superuser: hand it over. PostgreSQL 15's
-- public schema belongs to the database owner, so each role creates its tables (and Prefect its
-- trusted pg_trgm extension) in its own database only.
ALTER DATABASE :"prefect_db" OWNER TO :"prefect_db";
CREATE DATABASE :"mlflow_db" OWNER :"mlflow_db";
CREATE DATABASE :"mlflow_auth_db" OWNER :"mlflow_db";
CREATE DATABASE :"optuna_db" OWNER :"optuna_db";
REVOKE ALL ON DATABASE :"prefect_db", :"mlflow_db", :"mlflow_auth_db", :"optuna_db" FROM PUBLIC;
