"""The encoder-decoder engine (T5) against Hugging Face's ``T5ForConditionalGeneration.generate``:
greedy tokens equal on a batch of mixed-length prompts (v1.0 and v1.1), log-probabilities equal
transformers' scores, seeded sampling reproduces and is independent of batch-mates, stop tokens
end sequences, and bad requests fail with one message."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mega.core.build import build_stage  # noqa: E402
from mega.core.checkpoint import load_model_weights  # noqa: E402
from mega.inference.engine import GenerationError, GenerationRequest  # noqa: E402
from mega.inference.engine.encoder_decoder import EncoderDecoderEngine, is_encoder_decoder  # noqa: E402
from mega.inference.engine.sampling import SamplingParams  # noqa: E402
from mega.inference.engine.stopping import StopRules  # noqa: E402
from mega.models import hf_mapping  # noqa: E402
from mega.models.t5.family import FAMILY  # noqa: E402
from mega.models.t5.hf_t5 import T5_MAPPING, t5_config  # noqa: E402

VOCAB, EOS, NEW_TOKENS = 100, 1, 10
PROMPTS = [[5, 17, 42, 8, 99, 3, 61, 1], [7, 20, 1], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 1], [50, 2, 77, 1]]


class _Tensors(dict):
    def get(self, name):
        return self[name]


@pytest.fixture(scope="module", params=["relu", "gated-gelu"])
def t5_pair(request):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   dropout_rate=0.0, feed_forward_proj=request.param,
                                   tie_word_embeddings=request.param == "relu", eos_token_id=EOS)
    torch.manual_seed(3)
    hf_model = transformers.T5ForConditionalGeneration(config).eval()
    if not config.scale_decoder_outputs:  # v1.1: its own lm_head (transformers 5 ties it)
        hf_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf_model.lm_head.weight))
    mega_config = t5_config(config.to_dict(), seq_length=32, decoder_seq_length=16)
    model = build_stage(FAMILY, mega_config, init=False, training=False).eval()
    load_model_weights(_Tensors(hf_mapping.hf_to_mega(T5_MAPPING, hf_model.state_dict(), mega_config)), [model])
    return hf_model, EncoderDecoderEngine(model, vocab_size=VOCAB, max_positions=32)


def hf_generate(hf_model, prompts, new_tokens=NEW_TOKENS, eos=EOS):
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=0, decoder_start_token_id=0, return_dict_in_generate=True,
                             output_scores=True)


def cut(row: list[int]) -> list[int]:
    """A Hugging Face output row without the start token, ended after its end token."""
    row = row[1:]
    return row[: row.index(EOS) + 1] if EOS in row else row


def requests(prompts, **options):
    return [GenerationRequest(p, NEW_TOKENS, stop=StopRules(stop_ids=frozenset({EOS})), **options) for p in prompts]


def test_greedy_batch_of_mixed_lengths_equals_transformers(t5_pair):
    hf_model, engine = t5_pair
    assert is_encoder_decoder(engine.model)
    expected = [cut(row) for row in hf_generate(hf_model, PROMPTS).sequences.tolist()]
    results = engine.generate(requests(PROMPTS))
    assert [r.generated for r in results] == expected
    assert [r.tokens[: r.prompt_length] for r in results] == PROMPTS
    # A short prompt alone (no padding) gives what it gives padded in the batch.
    assert engine.generate(requests([PROMPTS[1]]))[0].generated == results[1].generated


def test_logprobs_equal_transformers_scores(t5_pair, assert_close):
    hf_model, engine = t5_pair
    prompt = PROMPTS[0]
    output = hf_generate(hf_model, [prompt], new_tokens=6, eos=None)
    scores = torch.stack(output.scores)[:, 0].log_softmax(-1)  # [steps, vocab]
    tokens = output.sequences[0, 1:]
    result = engine.generate([GenerationRequest(prompt, 6, logprobs=True, top_logprobs=2)])[0]
    assert result.generated == tokens.tolist()
    assert result.logprobs[: len(prompt) - 1] == [None] * (len(prompt) - 1)
    assert_close(torch.tensor(result.logprobs[len(prompt) - 1:]), scores.gather(-1, tokens[:, None]).squeeze(-1),
                 what="logprobs")
    assert [top[0][0] for top in result.top_logprobs[len(prompt) - 1:]] == tokens.tolist()  # greedy: the best


def test_seeded_sampling_reproduces_and_ignores_batch_mates(t5_pair):
    _, engine = t5_pair
    sampling = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=11)
    alone = engine.generate([GenerationRequest(PROMPTS[1], NEW_TOKENS, sampling)])[0].generated
    batch = engine.generate([GenerationRequest(PROMPTS[0], 3), GenerationRequest(PROMPTS[1], NEW_TOKENS, sampling)])
    assert batch[1].generated == alone and len(batch[0].generated) == 3
    assert batch[0].finish_reason == "length"


def test_bad_requests_fail_with_one_message(t5_pair):
    _, engine = t5_pair
    with pytest.raises(GenerationError, match="prompt is empty"):
        engine.generate([GenerationRequest([], 3)])
    with pytest.raises(GenerationError, match="40 prompt tokens exceed the model's 32 positions"):
        engine.generate([GenerationRequest([5] * 40, 3)])
    with pytest.raises(GenerationError, match="token id 100 is outside"):
        engine.generate([GenerationRequest([100], 3)])


def test_megatron_lms_default_t5_generates_what_its_forward_computes():
    """Learned absolute positions (the decoder's cached steps continue at their own positions),
    LayerNorm and biases: greedy tokens of a mixed-length batch equal a cache-free greedy loop over
    the training forward, one prompt at a time."""
    from mega.inference.engine.encoder_decoder import DECODER_START_TOKEN

    config = FAMILY.config_class(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                                 ffn_hidden_size=48, seq_length=32, decoder_seq_length=16, vocab_size=VOCAB,
                                 position_embedding_type="learned_absolute", normalization="LayerNorm",
                                 add_bias_linear=True, feed_forward_proj="gelu", hidden_dropout=0.0,
                                 attention_dropout=0.0)
    torch.manual_seed(4)
    model = build_stage(FAMILY, config, training=False).eval()
    with torch.no_grad():  # biases and norms start at 0 and 1, positions near 0: make them count
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.5)
        model.embedding.position_embeddings.weight.normal_(0, 1)
    engine = EncoderDecoderEngine(model, vocab_size=VOCAB, max_positions=32)
    results = engine.generate([GenerationRequest(p, NEW_TOKENS) for p in PROMPTS])
    for prompt, result in zip(PROMPTS, results, strict=True):
        decoder = [DECODER_START_TOKEN]
        for _ in range(NEW_TOKENS):
            ids, decoder_ids = torch.tensor([prompt]), torch.tensor([decoder])
            with torch.no_grad():
                logits = model({"text_enc": ids, "text_dec": decoder_ids, "enc_mask": torch.ones_like(ids),
                                "dec_mask": torch.ones_like(decoder_ids)})["logits"]
            decoder.append(int(logits[-1, 0, :VOCAB].argmax()))
        assert result.generated == decoder[1:], prompt
