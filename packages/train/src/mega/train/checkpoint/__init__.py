"""The checkpointer (when and what a run saves and loads) and the `mega checkpoint info/verify`
commands, on top of mega-core's checkpoint format (:mod:`mega.core.checkpoint`)."""
