"""The training loop and the `mega train` command (see trainer.py and command.py)."""
