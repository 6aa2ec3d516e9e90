"""Many LoRA adapters served from one base, chosen per request (``mega serve --lora-modules``).

The reference is PEFT's, not ours: two adapters PEFT makes (random, different ranks and targets,
one rsLoRA) on a tiny transformers LLaMA; each request's greedy tokens must be those of
transformers' generate on the model PEFT merges the request's adapter into (fp32). A batch mixes
the base and both adapters, on the paged and the static KV cache; through ``mega serve`` the
``openai`` client picks adapters by ``model``, loads and unloads one at run time (behind the API
key), gets 404 for an unknown model, and a prompt cached under one adapter is not reused by another.

CPU only (pinned): a few forwards of a 2-layer, hidden-64 model.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import peft  # the [test] extra's: the reference, never skipped
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from in_process_server import serving  # noqa: E402
from tiny_models import VOCAB, hf_tiny, mega_from_hf  # noqa: E402

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from mega.core.plugins import get_plugins  # noqa: E402
from mega.inference.engine import GenerationEngine, GenerationRequest  # noqa: E402
from mega.inference.engine.continuous import ContinuousBatchingWorker  # noqa: E402
from mega.inference.engine.lora_registry import (  # noqa: E402
    AdapterError,
    AdapterRegistry,
    ServedAdapter,
    UnknownAdapter,
)
from mega.inference.engine.prefix_cache import prefix_keys  # noqa: E402
from mega.inference.engine.speculative import NgramProposer, Speculator  # noqa: E402
from mega.models.lora.adapter_files import read_adapter  # noqa: E402
from mega.models.lora.multi import adaptable_weight_shapes, apply_multi_lora  # noqa: E402

pytestmark = pytest.mark.usefixtures("on_cpu")
EOS = VOCAB - 1
NEW_TOKENS = 6
API_KEY = "multi-lora-key"
ADAPTERS = {  # name: PEFT's LoraConfig fields
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj"]),
    "beta": dict(r=8, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = [[5, 17, 42], [7, 3, 99, 12, 60, 1, 2, 200, 31], [100] * 5, [8, 9], [150, 40, 41, 42, 43, 44, 45], [11]]
MODELS = ["base", "alpha", "beta", "alpha", "beta", "base"]


@pytest.fixture
def on_cpu():
    with torch.device("cpu"):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base directory, {adapter name: directory}, {model name: transformers model, merged})."""
    directory = tmp_path_factory.mktemp("multi-lora")
    base = hf_tiny("llama")
    base.save_pretrained(directory / "base")
    references = {"base": base}
    for number, (name, fields) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + number)
        # init_lora_weights=False: B random too, so each adapter changes the function
        model = peft.get_peft_model(hf_tiny("llama"), peft.LoraConfig(init_lora_weights=False, **fields))
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.mul_(4.0)  # strong enough to change greedy tokens of a random model
        model.save_pretrained(directory / name)
        references[name] = model.merge_and_unload().eval()
    return directory, {name: directory / name for name in ADAPTERS}, references


def hf_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=EOS, eos_token_id=EOS)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(tiny):
    _, _, references = tiny
    return [hf_greedy(references[model], prompt) for model, prompt in zip(MODELS, PROMPTS, strict=True)]


def test_the_adapters_change_the_tokens(tiny, expected):
    """Else the comparisons below would not tell adapters apart."""
    _, _, references = tiny
    for model, prompt, tokens in zip(MODELS, PROMPTS, expected, strict=True):
        others = {hf_greedy(references[other], prompt) == tokens for other in references if other != model}
        assert others == {False}, f"{model}'s tokens for {prompt} are another model's too"


LOOPS = {  # the loop's ways to run a batch: each must take every row's adapter
    "paged": {}, "static": {"static_cache": True}, "chunked": {"max_num_batched_tokens": 8},
    "ngram": {"speculator": "ngram"},
}


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_mixed_batch_gives_each_request_its_adapters_tokens(tiny, expected, loop):
    _, directories, references = tiny
    family = get_plugins().models.get("llama")
    model, config = mega_from_hf(references["base"], "llama")
    shapes = adaptable_weight_shapes(model)
    lora = apply_multi_lora(model, max_loras=2, max_rank=24)
    registry = AdapterRegistry(lora, lambda path: read_adapter(path, family, config, shapes, None, "base"))
    for name, path in directories.items():
        registry.load(name, str(path))
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=64)
    engine.lora = lora
    requests = [GenerationRequest(prompt=prompt, max_new_tokens=NEW_TOKENS,
                                  adapter=None if name == "base" else registry.acquire(name))
                for name, prompt in zip(MODELS, PROMPTS, strict=True)]
    options = dict(LOOPS[loop])
    if options.get("speculator"):  # the verify forward takes every row's adapter too
        options["speculator"] = Speculator(NgramProposer(3, 1), 3)
    results = engine_results(engine, requests, **options)
    for model_name, result, tokens in zip(MODELS, results, expected, strict=True):
        assert result.generated == tokens, model_name


def test_a_gpt2_peft_adapter_with_transposed_weights(tmp_path):
    """GPT-2's Conv1D layers hold their weights transposed (PEFT's fan_in_fan_out): its adapter's
    B goes through the same tensor map back to mega's rows."""
    torch.manual_seed(3)
    made = peft.get_peft_model(hf_tiny("gpt2"), peft.LoraConfig(
        init_lora_weights=False, r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))
    with torch.no_grad():
        for parameter_name, parameter in made.named_parameters():
            if "lora_B" in parameter_name:
                parameter.mul_(4.0)
    made.save_pretrained(tmp_path)
    reference, base = made.merge_and_unload().eval(), hf_tiny("gpt2")
    model, config = mega_from_hf(base, "gpt")
    shapes = adaptable_weight_shapes(model)
    lora = apply_multi_lora(model, max_loras=1, max_rank=4)
    lora.write(1, read_adapter(tmp_path, get_plugins().models.get("gpt"), config, shapes, None, "base"))
    engine = GenerationEngine(model, vocab_size=VOCAB, max_positions=64)
    engine.lora = lora
    adapter = ServedAdapter("a", str(tmp_path), slot=1, salt=b"a")
    requests = [GenerationRequest(prompt=prompt, max_new_tokens=NEW_TOKENS, adapter=served)
                for prompt in PROMPTS[:2] for served in (adapter, None)]
    results = engine_results(engine, requests)
    assert any(a.generated != b.generated for a, b in zip(results[::2], results[1::2], strict=True))
    assert [r.generated for r in results] == [hf_greedy(reference if r.adapter else base, r.prompt) for r in requests]


def engine_results(engine, requests, **options):
    worker = ContinuousBatchingWorker(engine, max_batch_size=len(requests), max_num_tokens=len(requests) * 64,
                                      **options)
    return worker.run_to_completion(requests)  # all admitted at the first step: one mixed batch


def test_prefix_keys_depend_on_the_adapter():
    prompt = list(range(40))
    assert prefix_keys(prompt, 16) == prefix_keys(prompt, 16, b"")
    assert not set(prefix_keys(prompt, 16)) & set(prefix_keys(prompt, 16, b"lora:1:"))


class RecordedSlots:
    """The stacks' stand-in: which slot got which weights."""

    max_loras = 2

    def __init__(self):
        self.written = {}

    def write(self, slot, weights):
        if weights == "bad":
            raise ValueError("not an adapter")
        self.written[slot] = weights


def test_an_adapter_held_by_running_requests_keeps_its_slot_until_they_end():
    registry = AdapterRegistry(RecordedSlots(), read=lambda path: path, allow_runtime_updates=True)
    first = registry.load("a", "weights-a")
    held = registry.acquire("a")
    assert registry.unload("a") is True  # held: gone for new requests, its slot kept
    with pytest.raises(UnknownAdapter):
        registry.acquire("a")
    assert registry.load("b", "weights-b").slot != first.slot
    with pytest.raises(AdapterError, match="--max-loras"):
        registry.load("c", "weights-c")
    registry.release(held)  # the last holder answered: the slot is free
    with pytest.raises(AdapterError, match="lora_path bad: not an adapter"):
        registry.load("d", "bad")
    assert registry.load("c", "weights-c").slot == first.slot  # the failed load gave the slot back
    assert registry.unload("c") is False
    old_b = registry.acquire("b")
    replaced = registry.load("b", "weights-b2", replace=True)  # a new slot; the old one's requests finish on it
    assert replaced.slot == first.slot and replaced.salt != old_b.salt
    assert [(a.name, a.path) for a in registry.adapters] == [("b", "weights-b2")]
    with pytest.raises(AdapterError, match="--max-loras"):  # the old b's slot stays taken while held
        registry.load("e", "weights-e")
    registry.release(old_b)
    assert registry.load("e", "weights-e").slot == old_b.slot


def completion_tokens(choice_text: str) -> list[int]:
    return [int(word) for word in choice_text.split()]  # NullTokenizer's text: ids joined by spaces


def test_serving_adapters_by_model(tiny, expected):
    directory, directories, references = tiny
    flags = ["--load", str(directory / "base"), "--device", "cpu", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(VOCAB - 1), "--served-model-name", "base", "--api-key", API_KEY,
             "--lora-modules", f"alpha={directories['alpha']}",
             json.dumps({"name": "beta", "path": str(directories["beta"])}),
             "--max-loras", "3", "--allow-runtime-lora-updates", "--max-batch-size", "8"]
    with serving(flags) as send:
        client = openai.AsyncOpenAI(base_url="http://mega/v1", api_key=API_KEY, max_retries=0, http_client=httpx.AsyncClient(
            transport=httpx.ASGITransport(send.app), base_url="http://mega"))

        async def complete(model: str, prompt: list[int], **fields) -> list[int]:
            answer = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                     temperature=0, **fields)
            assert answer.model == model
            return completion_tokens(answer.choices[0].text)

        async def run():
            # the six requests at once, through continuous batching
            got = await asyncio.gather(*(complete(m, p) for m, p in zip(MODELS, PROMPTS, strict=True)))
            assert list(got) == expected
            models = await client.models.list()
            assert [(m.id, getattr(m, "parent", None)) for m in models.data] == [
                ("base", None), ("alpha", "base"), ("beta", "base")]
            assert models.data[1].root == str(directories["alpha"])
            assert (await client.models.retrieve("beta")).parent == "base"
            with pytest.raises(openai.NotFoundError) as missing:
                await complete("gamma", PROMPTS[0])
            assert missing.value.code == "model_not_found" and "'gamma'" in missing.value.message

            # load and unload at run time, behind the key
            unkeyed = httpx.AsyncClient(transport=httpx.ASGITransport(send.app), base_url="http://mega")
            load = {"lora_name": "gamma", "lora_path": str(directories["beta"])}
            assert (await unkeyed.post("/v1/load_lora_adapter", json=load)).status_code == 401
            keyed = httpx.AsyncClient(transport=httpx.ASGITransport(send.app), base_url="http://mega",
                                      headers={"Authorization": f"Bearer {API_KEY}"})
            answer = await keyed.post("/v1/load_lora_adapter", json=load)
            assert answer.status_code == 200, answer.text
            assert await complete("gamma", PROMPTS[4]) == expected[4]  # beta's weights under another name
            again = await keyed.post("/v1/load_lora_adapter", json=load)
            assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
            full = await keyed.post("/v1/load_lora_adapter", json={"lora_name": "delta",
                                                                   "lora_path": str(directories["alpha"])})
            assert full.status_code == 400 and "--max-loras" in full.json()["error"]["message"]
            assert (await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})).status_code == 200
            with pytest.raises(openai.NotFoundError):
                await complete("gamma", PROMPTS[4])
            gone = await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
            bad = await keyed.post("/v1/load_lora_adapter", json={"lora_name": "delta", "lora_path": str(directory)})
            assert bad.status_code == 400 and bad.json()["error"]["message"].startswith(f"lora_path {directory}: ")
            # gamma's slot is free again
            answer = await keyed.post("/v1/load_lora_adapter", json={"lora_name": "delta",
                                                                     "lora_path": str(directories["alpha"])})
            assert answer.status_code == 200, answer.text
            assert await complete("delta", PROMPTS[1]) == expected[1]
            # unloaded while a stream runs on it: the stream ends with its adapter's tokens
            stream = await client.completions.create(model="delta", prompt=PROMPTS[1], max_tokens=48, temperature=0,
                                                     stream=True)
            first = await stream.__anext__()
            unloaded = await keyed.post("/v1/unload_lora_adapter", json={"lora_name": "delta"})
            assert unloaded.status_code == 200, unloaded.text
            text = first.choices[0].text + "".join([chunk.choices[0].text async for chunk in stream])
            assert completion_tokens(text) == hf_greedy(references["alpha"], PROMPTS[1], 48)

            # a prompt cached under the base is not reused under an adapter (nor the reverse)
            long_prompt = [(7 * i) % (VOCAB - 1) for i in range(40)]
            hits = await prefix_hits(keyed)
            base_tokens = await complete("base", long_prompt)
            beta_tokens = await complete("beta", long_prompt)
            assert await prefix_hits(keyed) == hits
            assert base_tokens == hf_greedy(references["base"], long_prompt)
            assert beta_tokens == hf_greedy(references["beta"], long_prompt)
            assert await complete("beta", long_prompt) == beta_tokens
            assert await prefix_hits(keyed) == hits + 32  # its own two full blocks, from its own first run

        asyncio.run(run())


async def prefix_hits(client) -> int:
    text = (await client.get("/metrics")).text
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("mega_prefix_cache_hits_total")))


def test_bad_lora_flags_are_refused_by_name(tiny, capsys):
    directory, directories, _ = tiny
    from mega.inference.cli import serve as serve_cli

    base = ["--load", str(directory / "base"), "--device", "cpu", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1)]
    with pytest.raises(SystemExit, match="max-lora-rank 4"):
        serve_cli.main([*base, "--lora-modules", f"beta={directories['beta']}", "--max-lora-rank", "4"])
    with pytest.raises(SystemExit):
        serve_cli.main([*base, "--lora-modules", "alpha"])
    assert "give NAME=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="need --enable-lora"):
        serve_cli.main([*base, "--allow-runtime-lora-updates"])
