"""What `traingate sweep` prints: a password in the Optuna storage (or anything the sweep's summary holds)
reaches the terminal masked. The sweep flow itself is replaced (its runs are tested in test_sweep_flow.py); what is
tested here is the command's own output."""
from __future__ import annotations

import socket

from prefect.states import Completed

from sweep_helpers import sweep_spec  # noqa: F401 - fixture

PG_PW = "pg-pass-7f3a91"


def test_the_sweep_command_prints_its_stores_with_their_passwords_masked(sweep_spec, state_dir, monkeypatch, capsys):
    import flows.cli.sweep
    from flows.cli import main

    # The command checks that its storage's port answers before anything starts: a listening socket.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    monkeypatch.setenv("TRAINGATE_OPTUNA_STORAGE", f"postgresql://optuna:{PG_PW}@127.0.0.1:{port}/optuna")
    monkeypatch.setattr(flows.cli.sweep, "guard_this_process", lambda grace_s: None)
    import flows.sweep

    # The command imports the flow when it runs (after its checks), so the flow is replaced where it lives.
    monkeypatch.setattr(flows.sweep, "sweep", lambda spec, promote, return_state: Completed(
        message="2 trials", data={"study": "s", "best_params": {"storage": f"postgresql://o:{PG_PW}@db/x"}}))
    try:
        assert main(["sweep", str(sweep_spec())]) == 0
    finally:
        listener.close()
    out = capsys.readouterr().out
    assert PG_PW not in out, out
    assert f"optuna-dashboard postgresql://optuna:***@127.0.0.1:{port}/optuna" in out
    assert "best_params" in out and "postgresql://o:***@db/x" in out
