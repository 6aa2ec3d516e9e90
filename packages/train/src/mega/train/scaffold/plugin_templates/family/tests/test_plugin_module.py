"""The installed family is gpt with a ReLU MLP: same weights from the same seed, same logits."""

import torch

from mega.core.build import build_stage
from mega.core.plugins import get_plugins
from mega.models.gpt import family as gpt


def test_the_family_computes_what_gpt_with_a_relu_mlp_computes():
    family = get_plugins().models.get("plugin_name")
    config = family.preset("tiny", vocab_size=512)
    assert config.mlp_activation == "relu"
    ours = build_stage(family, config, seed=3).eval()  # eval: no dropout
    reference = build_stage(gpt.FAMILY, gpt.FAMILY.preset("tiny", vocab_size=512, activation="relu"), seed=3).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(ours({"tokens": tokens})["logits"], reference({"tokens": tokens})["logits"])
