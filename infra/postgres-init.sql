-- One cluster, one database per service.
CREATE DATABASE mlflow OWNER traingate;
CREATE DATABASE optuna OWNER traingate;
