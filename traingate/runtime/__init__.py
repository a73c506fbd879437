"""The in-process training stack, started by torchrun (or plain python). Never imports prefect."""
