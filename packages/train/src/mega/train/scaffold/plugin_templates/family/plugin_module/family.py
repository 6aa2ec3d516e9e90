"""The family: mega-models' gpt with other config defaults (every gpt flag still applies)."""

from mega.models import gpt, variant

FAMILY = variant(gpt.FAMILY, "plugin_name", activation="relu", description="GPT with a ReLU MLP")
