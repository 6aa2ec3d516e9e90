"""The ``mixtral`` family against transformers' ``MixtralForCausalLM`` (4 experts, top-2, GQA):
converted Hugging Face -> mega, the logits and loss equal transformers' (fp32, 1e-5 relative) on
one process and at tp2, ep2, tp2 x ep2 and pp2 on one world of 4 gloo ranks; Hugging Face ->
mega (tp2, ep2) -> Hugging Face gives back the same tensors bit for bit; greedy generation, on
one process and tensor-parallel (tp2, leader and follower), equals transformers' ``generate``
token for token; so does `mega serve` (greedy /v1/completions)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_test_models import VOCAB, input_ids, save_hf_model, tensor_parallel_greedy  # noqa: E402

transformers = pytest.importorskip("transformers")

from mega.ckpt_convert import WriteOptions, convert  # noqa: E402

# name -> (tp, pp, ep, dispatcher), each on 4 ranks (dp takes the rest).
# (The training equivalence tests cover ep4 and the allgather dispatcher.)
LAYOUTS = {"tp2": (2, 1, 1, "alltoall"), "ep2": (1, 1, 2, "alltoall"), "tp2 x ep2": (2, 1, 2, "alltoall"),
           "pp2": (1, 2, 1, "alltoall")}


def make_mixtral():
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        initializer_range=0.1)
    torch.manual_seed(16)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: make every value count
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return make_mixtral()


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    hf_dir = save_hf_model(hf_model, root / "hf")
    mega_dir = root / "mega"
    convert(hf_dir, mega_dir, to_format="mega", options=WriteOptions(tensor_parallel_size=2, expert_parallel_size=2))
    return hf_dir, mega_dir


def hf_logits(model, ids):
    with torch.no_grad():
        out = model(ids, labels=ids)
    return out.logits, out.loss


def layout_logits(mega_dir, ids, name: str):
    """This rank's (logits, loss) at layout ``name`` (None off the last pipeline stage)."""
    import dataclasses

    from test_layout_logits import stage_logits

    from mega.ckpt_convert import open_checkpoint
    from mega.core.parallel import ParallelConfig, ParallelGroups

    tp, pp, ep, dispatcher = LAYOUTS[name]
    groups = ParallelGroups(ParallelConfig(tp=tp, pp=pp, ep=ep))
    with open_checkpoint(str(mega_dir)) as source:
        source.config = dataclasses.replace(source.config, moe_token_dispatcher_type=dispatcher)
        return stage_logits(source, ids, groups)


PROMPTS = [[5, 17, 42, 8, 99, 3, 61], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW_TOKENS = 12


def hf_greedy(model, prompt):
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()


def test_one_process_logits_equal_transformers(hf_model, converted, assert_close):
    from test_layout_logits import stage_logits

    from mega.core.parallel import ParallelConfig, ParallelGroups

    ids = input_ids()
    logits, loss = stage_logits(str(converted[1]), ids, ParallelGroups(ParallelConfig()))
    expected, expected_loss = hf_logits(hf_model, ids)
    assert_close(logits, expected, what="mixtral")
    assert_close(loss, expected_loss, what="mixtral loss")


def test_every_layout_logits_equal_transformers(worlds, hf_model, converted, assert_close):
    ids = input_ids(seed=1)
    expected, expected_loss = hf_logits(hf_model, ids)
    for name, (_, pp, _, _) in LAYOUTS.items():  # one call per layout: each within the world's timeout
        last = [result for result in worlds.run(4, layout_logits, str(converted[1]), ids, name) if result is not None]
        assert len(last) == 4 // pp, name
        for logits, loss in last:
            assert_close(logits, expected, what=name)
            assert_close(loss, expected_loss, what=f"{name} loss")
    leaders = [tokens for tokens in worlds.run(4, tensor_parallel_greedy, str(converted[1]), PROMPTS, NEW_TOKENS) if tokens is not None]
    assert len(leaders) == 2
    for tokens in leaders:
        assert tokens == [hf_greedy(hf_model, prompt) for prompt in PROMPTS], "tp2 greedy generation"


def test_mega_to_hugging_face_is_bit_exact(converted, tmp_path):
    from safetensors.torch import load_file

    hf_dir, mega_dir = converted
    convert(mega_dir, tmp_path / "back", to_format="hf")
    original, back = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_a_checkpoint_that_records_the_expert_tensor_parallel_size_in_its_model_still_loads(converted, tmp_path):
    """mega before expert tensor parallelism became a layout setting saved it with the model."""
    import json
    import shutil

    from safetensors.torch import load_file

    from mega.core.checkpoint.metadata import METADATA_FILE

    older = tmp_path / "older"
    shutil.copytree(converted[1], older)
    for metadata_path in older.rglob(METADATA_FILE):
        metadata = json.loads(metadata_path.read_text())
        metadata["model_config"]["expert_tensor_parallel_size"] = None
        metadata_path.write_text(json.dumps(metadata))
    convert(older, tmp_path / "hf", to_format="hf")
    original, back = load_file(converted[0] / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(back[name], tensor) for name, tensor in original.items())


def test_experts_that_do_not_split_over_the_target_ep_are_refused(converted, tmp_path):
    from mega.ckpt_convert import ConversionError

    with pytest.raises(ConversionError, match="--num-experts 4 is not divisible by --target-expert-parallel-size 3"):
        convert(converted[0], tmp_path / "ep3", to_format="mega", options=WriteOptions(expert_parallel_size=3))
    assert not (tmp_path / "ep3").exists()


def test_greedy_generation_equals_transformers(hf_model, converted):
    from mega.ckpt_convert import open_checkpoint
    from mega.core.build import build_stage
    from mega.core.checkpoint import load_model_weights
    from mega.core.plugins import get_plugins
    from mega.inference.engine import GenerationEngine, GenerationRequest

    with open_checkpoint(str(converted[1])) as source:
        family, config = get_plugins().models.get(source.family), source.config
    model = build_stage(family, config, init=False, training=False)
    load_model_weights(str(converted[1]), [model.eval()])
    engine = GenerationEngine(model, vocab_size=config.vocab_size, max_positions=config.max_position_embeddings)
    for prompt in PROMPTS:
        [result] = engine.generate([GenerationRequest(prompt, NEW_TOKENS)])
        assert result.tokens == hf_greedy(hf_model, prompt)


def test_mega_serve_completions_equal_transformers(hf_model, converted, monkeypatch):
    """``mega serve`` (its whole ``main``: the loader, the continuous-batching engine, the app) on
    the converted checkpoint, in this process on a real socket: greedy /v1/completions equal
    transformers' ``generate`` token for token. Tokens are ids as text (NullTokenizer: "5 17 42")."""
    import socket
    import threading
    import time

    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    from mega.inference.cli import serve as serve_cli

    servers = []

    def run_in_thread_server(app, host, port, log_level):  # uvicorn.run, but stoppable from the test
        servers.append(uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)))
        servers[-1].run()

    monkeypatch.setattr(uvicorn, "run", run_in_thread_server)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--load", str(converted[1]), "--device", "cpu", "--port", str(port), "--log-level", "warning",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(serve_cli.main(argv)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (servers and servers[0].started):
        assert thread.is_alive() and time.monotonic() < deadline, f"mega serve did not start: {outcome}"
        time.sleep(0.05)
    try:
        prompts = [" ".join(map(str, prompt)) for prompt in PROMPTS]
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 1})
        assert reply.status_code == 200, reply.text
        for prompt, choice in zip(PROMPTS, reply.json()["choices"], strict=True):
            expected = hf_greedy(hf_model, prompt)[len(prompt):]
            if VOCAB - 1 in expected:  # the tokenizer's end of document stops the server's answer
                expected = expected[:expected.index(VOCAB - 1) + 1]
            assert choice["logprobs"]["tokens"] == [str(token) for token in expected]
            assert choice["finish_reason"] == ("stop" if VOCAB - 1 in expected else "length")
    finally:
        servers[0].should_exit = True
        thread.join(timeout=30)
    assert outcome == [0]
