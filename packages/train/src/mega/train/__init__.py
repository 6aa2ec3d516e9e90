"""mega-train: the training loop and the `mega train` command (see trainer.py and command.py), with
the launcher, planning, doctor, bench, the checkpointer and the plugin scaffold beside it."""
