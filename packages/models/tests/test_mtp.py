"""Multi-token prediction against a reference written here from megatron-core's documented
definition (its ``GPTModel`` forward does not run on a CPU): for module k, the tokens and labels
shifted left k + 1 times with zeros coming in, RMSNorm(embedding) and RMSNorm(previous hidden)
concatenated in that order, ``eh_proj``, the module's transformer layer, its final norm, the
shared output layer, cross-entropy over the loss mask shifted as often; the loss adds
``--mtp-loss-scaling-factor`` times the modules' mean. Two modules, so the chaining counts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mega.core.build import build_stage
from mega.core.model_family import LossContext
from mega.models.deepseek_v3.family import FAMILY, PRESETS

CONFIG = dataclasses.replace(PRESETS["tiny"], vocab_size=256, seq_length=12, mtp_num_layers=2,
                             mtp_loss_scaling_factor=0.3)


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.layernorm_epsilon) * weight


def test_mtp_losses_follow_megatron_cores_definition(assert_close):
    model = build_stage(FAMILY, CONFIG, seed=4)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 256, (2, 12), generator=generator)
    labels = torch.randint(0, 256, (2, 12), generator=generator)
    loss_mask = (torch.rand(2, 12, generator=generator) > 0.2).float()
    with torch.no_grad():
        outputs = model({"tokens": tokens})
        loss, metrics = FAMILY.loss(outputs, {"labels": labels, "loss_mask": loss_mask},
                                    LossContext(config=CONFIG, kernels=model.kernels))
        hidden = model.decoder(model.embedding(tokens), None)  # the decoder's output, after its final norm
        words, output = model.embedding.word_embeddings.weight, model.output_layer.weight
        expected = []
        for layer in model.mtp.layers:
            tokens, labels, loss_mask = (torch.roll(t, -1, dims=1) for t in (tokens, labels, loss_mask))
            for t in (tokens, labels, loss_mask):
                t[:, -1] = 0
            embedded = words[tokens].transpose(0, 1)  # [s, b, h]
            joined = torch.cat((rms(embedded, layer.enorm.weight), rms(hidden, layer.hnorm.weight)), dim=-1)
            hidden = rms(layer.transformer_layer(joined @ layer.eh_proj.weight.t(), None), layer.final_layernorm.weight)
            logits = (hidden @ output.t())[..., :256].transpose(0, 1)  # [b, s, vocab]
            per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
            expected.append((per_token * loss_mask).sum() / loss_mask.sum())
    for number, mean in enumerate(expected, start=1):
        assert_close(metrics[f"mtp_{number} loss"], mean, what=f"mtp_{number} loss")
    lm_and_aux = loss - 0.3 * sum(expected) / 2
    assert_close(lm_and_aux, metrics["lm loss"] + CONFIG.moe_aux_loss_coeff * outputs["moe_stats"][:, 0].sum(),
                 what="the loss less the scaled MTP mean")
