"""The generic bridge (Llama-like decoders without a mapping of their own) against transformers, on
the CPU (gloo for the multi-rank layouts; in-process runs pinned there, so it passes on a GPU
machine too).

Tiny random Mistral (sliding window shorter than every sequence, GQA, head_dim apart from
hidden/heads), Qwen2 (q/k/v biases, tied, a sliding window on every layer) and OLMo2 (norms after
each sublayer, QK-norm over the whole projections) saved to disk are converted to mega; the
one-process model and the tp2 and pp2 layouts (OLMo2: pp2; its QK-norm needs whole projections)
give transformers' logits and loss (fp32, 1e-5); greedy generation over 32 tokens equals
transformers' ``generate`` through the engine's one loop (all prompts at once), ``mega generate``,
``mega serve``'s whole main (one ``PUT /api``) and the serving engine's paged and static caches
(requests joining a running batch), each sequence past the window; mega -> Hugging Face gives
back the files' tensors bit for bit, to their own class; the converted Qwen2 trains at tp2 x pp2
as one process does and exports back to Qwen2. What the shared blocks cannot express is refused
by config field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import (  # noqa: E402
    TEXT_PROMPTS,
    VOCAB,
    generation_engine,
    greedy_as_transformers,
    input_ids,
    mega_generate_records,
    save_hf_model,
    tiny_random_model,
)

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402
from mega.ckpt_convert.errors import ConversionError  # noqa: E402

pytestmark = pytest.mark.usefixtures("cpu_only")

TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64, initializer_range=0.1)
WINDOW = 4  # shorter than the test's sequences (16 tokens) and prompts
MODELS = {  # name -> (class, config class, settings, layouts (tp, pp) on 2 ranks)
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(head_dim=24, sliding_window=WINDOW),
                {"tp2": (2, 1), "pp2": (1, 2)}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(tie_word_embeddings=True, use_sliding_window=True, max_window_layers=0, sliding_window=WINDOW),
              {"tp2": (2, 1), "pp2": (1, 2)}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(rms_norm_eps=1e-6), {"pp2": (1, 2)}),
}
PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19], [7, 250]]
NEW_TOKENS = 32


@pytest.fixture
def cpu_only(monkeypatch):
    """In-process runs on the CPU (as transformers' reference and the gloo ranks) on a GPU machine too:
    a one-process run takes CUDA where torch says it is available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def make_model(name: str):
    class_name, config_name, settings, _ = MODELS[name]
    return tiny_random_model(class_name, config_name, {**TINY, **settings}, name)


def converted(name: str, root):
    """(the transformers model, its saved directory, its mega checkpoint written at tp2 (where the
    model allows) x pp2)."""
    hf_model = make_model(name)
    hf_dir = save_hf_model(hf_model, root / "hf")
    tp = 2 if "tp2" in MODELS[name][3] else 1
    convert(hf_dir, root / "mega", to_format="mega", options=WriteOptions(tensor_parallel_size=tp, pipeline_parallel_size=2))
    return hf_model, hf_dir, root / "mega"


@pytest.fixture(scope="module", params=list(MODELS))
def case(request, tmp_path_factory):
    return request.param, *converted(request.param, tmp_path_factory.mktemp(request.param))


def layout_logits(mega_dir: str, ids: torch.Tensor, layout: tuple):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    tp, pp = layout
    return stage_logits(mega_dir, ids, ParallelGroups(ParallelConfig(tp=tp, pp=pp)))


def test_logits_equal_transformers_at_every_layout(case, worlds, assert_close):
    name, hf_model, _, mega_dir = case
    ids = input_ids()
    with torch.no_grad():
        out = hf_model(ids, labels=ids)
    logits, loss = layout_logits(str(mega_dir), ids, (1, 1))
    assert_close(logits, out.logits, what=f"{name} one process")
    assert_close(loss, out.loss, what=f"{name} one process loss")
    for layout_name, layout in MODELS[name][3].items():
        last = [result for result in worlds.run(2, layout_logits, str(mega_dir), ids, layout) if result is not None]
        assert len(last) == 2 // layout[1], layout_name
        for logits, loss in last:
            assert_close(logits, out.logits, what=f"{name} {layout_name}")
            assert_close(loss, out.loss, what=f"{name} {layout_name} loss")


def test_greedy_generation_equals_transformers(case):
    """All prompts at once in the engine's loop (continuous batching over sequences of several
    lengths), each longer than the sliding window before it ends."""
    name, hf_model, _, mega_dir = case
    greedy_as_transformers(hf_model, generation_engine(mega_dir), PROMPTS, NEW_TOKENS, name)


def test_mega_generate_prints_transformers_greedy_text(case, capsys):
    """``mega generate`` on the converted checkpoint, prompts of several lengths in one run."""
    name, hf_model, hf_dir, mega_dir = case
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    records = mega_generate_records(mega_dir, TEXT_PROMPTS, NEW_TOKENS, capsys)
    for record in records:
        ids = torch.tensor([tokenizer.encode(record["prompt"])])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        assert record["tokens"] == out[0, ids.shape[1]:].tolist(), (name, record["prompt"])


def test_mega_serve_answers_transformers_greedy_tokens(case):
    """``mega serve``'s whole ``main`` on the converted checkpoint (its app taken from uvicorn.run,
    requests sent in this process): one ``PUT /api`` of prompts of several lengths, ids as text."""
    import httpx
    import uvicorn

    from mega.inference.cli import serve as serve_cli

    name, hf_model, _, mega_dir = case
    apps, done, outcome = [], threading.Event(), []

    def hold_the_app(app, **_):
        apps.append(app)
        done.wait()

    eod = VOCAB - 1  # NullTokenizer's end of document: it stops both sides
    argv = ["--load", str(mega_dir), "--device", "cpu", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(eod)]
    thread = threading.Thread(target=lambda: outcome.append(serve_cli.main(argv)), daemon=True)
    original, uvicorn.run = uvicorn.run, hold_the_app
    try:
        thread.start()
        deadline = time.monotonic() + 120
        while not apps:
            assert thread.is_alive() and time.monotonic() < deadline, f"mega serve did not start: {outcome}"
            time.sleep(0.05)
    finally:
        uvicorn.run = original

    async def put_api(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(apps[0]), base_url="http://mega") as client:
            return await client.put("/api", json=body, timeout=120)

    try:
        reply = asyncio.run(put_api({"prompts": [" ".join(map(str, prompt)) for prompt in PROMPTS],
                                     "tokens_to_generate": NEW_TOKENS, "top_k": 1}))
    finally:
        done.set()
        thread.join(timeout=30)
    assert reply.status_code == 200, reply.text
    assert outcome == [0]
    for prompt, tokens in zip(PROMPTS, reply.json()["tokens"], strict=True):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=eod, pad_token_id=eod)[0].tolist()
        assert tokens == expected, (name, prompt)


@pytest.mark.parametrize("static", [False, True], ids=["paged", "static"])
def test_serving_engine_joins_sequences_and_decodes_as_transformers(case, static):
    """``mega serve``'s engine path: requests join a running batch one after the other (the paged
    cache, or the static one of a slot per sequence), each past the sliding window before it ends."""
    from mega.inference.engine import GenerationRequest
    from mega.inference.engine.continuous import ContinuousBatchingWorker

    name, hf_model, _, mega_dir = case
    worker = ContinuousBatchingWorker(generation_engine(mega_dir), max_batch_size=3, max_num_tokens=3 * 64 if static else 96,
                                      block_size=8, static_cache=static)
    worker.start()
    try:
        results = asyncio.run(staggered(worker, [GenerationRequest(prompt, NEW_TOKENS) for prompt in PROMPTS]))
    finally:
        worker.stop()
    for prompt, result in zip(PROMPTS, results, strict=True):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.tokens[-NEW_TOKENS:] == expected, (name, prompt)


async def staggered(worker, requests):
    """Each request submitted once the one before has streamed a token: they join a running batch."""
    from mega.inference.engine.worker import Job

    loop = asyncio.get_running_loop()
    jobs = []
    for request in requests:
        job = Job([request], loop, stream=True)
        worker.submit(job)
        jobs.append(job)
        while (await job.events.get())[0] != "token":
            pass
    return [(await job.done)[0] for job in jobs]


def test_mega_to_hugging_face_is_bit_exact_to_its_own_class(case, tmp_path):
    from safetensors.torch import load_file

    name, _, hf_dir, mega_dir = case
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original), name
    for tensor_name, tensor in original.items():
        assert torch.equal(back[tensor_name], tensor), f"{name} {tensor_name}"
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["architectures"] == [MODELS[name][0]]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(reloaded).__name__ == MODELS[name][0]
    window = json.loads((hf_dir / "config.json").read_text()).get("sliding_window")
    assert getattr(reloaded.config, "sliding_window", None) == window


@pytest.mark.parametrize("name, settings, field", [
    ("olmo2", dict(attention_bias=True), "attention_bias"),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1, sliding_window=WINDOW), "layer_types"),
    ("mistral", dict(hidden_act="gelu"), "hidden_act"),
    ("mistral", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 12,
                                      "long_factor": [2.0] * 12, "original_max_position_embeddings": 32}),
     "rope_scaling.rope_type"),
])
def test_what_the_blocks_cannot_express_is_refused_by_field(name, settings, field, tmp_path):
    class_name, config_name, base, _ = MODELS[name]
    config = getattr(transformers, config_name)(**TINY, **{**base, **settings})
    getattr(transformers, class_name)(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=field):
        convert(tmp_path / "hf", tmp_path / "mega", to_format="mega")
    assert not (tmp_path / "mega").exists()


def test_whole_projection_qk_norm_is_refused_at_tp2(tmp_path):
    hf_dir = save_hf_model(make_model("olmo2"), tmp_path / "hf")
    with pytest.raises(ConversionError, match="qk-layernorm-scope"):
        convert(hf_dir, tmp_path / "tp2", to_format="mega", options=WriteOptions(tensor_parallel_size=2))


def test_list_architectures_names_the_bridged_classes(capsys):
    from mega.ckpt_convert.cli import main

    assert main(["--list-architectures"]) == 0
    listed = capsys.readouterr().out
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Olmo2ForCausalLM"):
        assert architecture in listed


def test_bridged_model_trains_at_tp2_pp2_as_one_process_and_exports_to_its_class(worlds, tmp_path, assert_close):
    """The converted Qwen2 (q/k/v biases, tied, a window shorter than the 16-token samples) trains
    from its weights at tp2 x pp2 with sequence parallelism on 4 ranks as one process does (fp32,
    1e-5 each step); the trained checkpoint goes back to Qwen2ForCausalLM, whose logits are the
    trained mega model's."""
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups
    from mega.train.testing.training_runs import assert_losses_close, train_losses

    _, _, mega_dir = converted("qwen2", tmp_path)
    argv = ["--mock-data", "--load", str(mega_dir), "--finetune", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--log-interval", "100", "--seed", "7"]
    reference = train_losses(argv + ["--save", str(tmp_path / "trained"), "--save-interval", "3"])
    assert reference[-1] < reference[0], "the model should learn the mock data"
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    results = worlds.run(4, train_losses, argv + layout)
    assert all(losses == results[0] for losses in results)
    assert_losses_close(results[0], reference, "tp2 x pp2 (sequence parallel)")

    convert(tmp_path / "trained", tmp_path / "back", to_format="hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    ids = input_ids()
    with torch.no_grad():
        expected = exported(ids).logits
    logits, _ = stage_logits(str(tmp_path / "trained"), ids, ParallelGroups(ParallelConfig()))
    assert_close(logits, expected, what="trained Qwen2 exported")


def test_parameter_count_formula_counts_the_bridged_model(case):
    """The config-only count (``mega plan``'s) counts post-norms and whole-projection QK-norms."""
    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.plugins import get_plugins

    name, hf_model, _, mega_dir = case
    with open_checkpoint(str(mega_dir)) as source:
        family, config = get_plugins().models.get(source.family), source.config
    model = build_stage(family, config, training=False)
    assert family.num_parameters(config) == sum(p.numel() for p in model.parameters()), name


def test_sliding_window_is_refused_with_context_parallelism():
    from mega.core.parallel import ParallelConfig
    from mega.models.blocks.context_parallel import check_context_parallel
    from mega.models.config import ModelConfigError
    from mega.models.llama.config import LlamaConfig

    config = LlamaConfig(sliding_window=WINDOW, attention_dropout=0.0)
    with pytest.raises(ModelConfigError, match="--sliding-window 4 with --context-parallel-size 2"):
        check_context_parallel(config, ParallelConfig(cp=2))


def test_export_picks_the_class_that_expresses_a_trained_config():
    """A llama-family checkpoint goes out as the class it came from when that class expresses it,
    else as the first of LLaMA, Mistral, Qwen2 and OLMo2 that does (a window added in training:
    Mistral, never a LLaMA that would drop it)."""
    from mega.ckpt_convert.hf_bridge import export_mapping
    from mega.core.plugins import get_plugins
    from mega.models.llama.config import LlamaConfig

    family = get_plugins().models.get("llama")
    from_llama = {"format": "hf", "architecture": "LlamaForCausalLM"}
    cases = [
        (LlamaConfig(), from_llama, "LlamaForCausalLM"),
        (LlamaConfig(sliding_window=WINDOW), from_llama, "MistralForCausalLM"),
        (LlamaConfig(add_qkv_bias=True), None, "Qwen2ForCausalLM"),
        (LlamaConfig(qk_layernorm=True, qk_layernorm_scope="projection", layernorm_placement="post"), None,
         "Olmo2ForCausalLM"),
        (LlamaConfig(), {"format": "hf", "architecture": "MistralForCausalLM"}, "MistralForCausalLM"),
    ]
    for config, origin, architecture in cases:
        assert export_mapping(family, config, origin).architecture == architecture, (config, origin)
    with pytest.raises(ValueError, match="sliding_window"):
        get_plugins().models.get("gpt").hf_mapping.config_to_hf(
            dataclasses.replace(get_plugins().models.get("gpt").presets["tiny"], sliding_window=WINDOW))
