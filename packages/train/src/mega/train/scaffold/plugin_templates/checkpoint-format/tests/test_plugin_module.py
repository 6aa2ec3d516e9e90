"""A model written in the installed format and opened again holds the same tensors and config,
and the model rebuilt from them computes the same logits."""

import torch

from mega.core.build import build_stage
from mega.core.plugins import get_plugins


class StateDictSource:
    def __init__(self, family, config, state):
        self.family, self.config, self.tokenizer, self.tokenizer_extras = family, config, None, {}
        self.state = state

    def names(self):
        return sorted(self.state)

    def get(self, name):
        return self.state[name]


def test_a_written_model_opens_as_the_same_model(tmp_path):
    plugins = get_plugins()
    checkpoint_format = plugins.checkpoint_formats.get("plugin_name")
    family = plugins.models.get("gpt")
    config = family.preset("tiny", vocab_size=512)
    model = build_stage(family, config, seed=5).eval()  # eval: no dropout
    state = {name: tensor for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)}
    assert checkpoint_format.write(StateDictSource("gpt", config, state), tmp_path, None) == []
    assert checkpoint_format.detect(tmp_path)
    with checkpoint_format.open(tmp_path) as source:
        assert source.config == config and source.names() == sorted(state)
        loaded = {name: source.get(name) for name in source.names()}
    rebuilt = build_stage(family, config, init=False).eval()
    rebuilt.load_state_dict(loaded)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    torch.testing.assert_close(rebuilt({"tokens": tokens})["logits"], model({"tokens": tokens})["logits"])
