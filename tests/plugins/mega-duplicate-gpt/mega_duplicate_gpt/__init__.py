"""A newcomer that registers `gpt` again (mega-models registered it first)."""

from mega.core.plugins import hookimpl


@hookimpl
def register_models(register):
    register("gpt", "mega_duplicate_gpt.family:FAMILY", "a second gpt")
