"""The family: mega-models' gpt with other config defaults (every gpt flag still applies)."""

from mega.models import variant
from mega.models.gpt import family as gpt

FAMILY = variant(gpt.FAMILY, "plugin_name", activation="relu", description="GPT with a ReLU MLP")
