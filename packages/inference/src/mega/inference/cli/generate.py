"""``mega generate``: continue prompts with a checkpoint and print the continuations.

Prompts come from ``--prompt`` (repeatable), ``--prompt-file`` (one per line, or JSON lines;
``-`` is stdin), or stdin (:mod:`mega.inference.cli.prompt_sources`). With ``--chat`` each is a
conversation rendered by the checkpoint's chat template (or ``--chat-template``), the one the
server's chat route renders with (:mod:`mega.inference.chat_template`). Every prompt is a request to the engine's one loop (the continuous batching ``mega
serve`` runs, here on this thread until every request has finished), so a prompt gets the
tokens and log-probabilities the server would give it. Under ``torchrun --nproc-per-node N`` the
model is tensor-parallel over the N ranks; rank 0 reads the prompts and prints.
"""

from __future__ import annotations

import argparse
import json
import sys

from mega.core.cli.argparser import CommandParser
from mega.inference.chat_template import ChatTemplateError, chat_template_file
from mega.inference.cli.load_arguments import add_decoding_arguments, add_load_arguments
from mega.inference.cli.prompt_sources import Prompt, PromptError, read_prompts
from mega.inference.completion_text import completion_text


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="mega generate",
        description="Continue text prompts with a mega checkpoint or a Hugging Face model directory and "
                    "print each continuation (the prompt with --echo). Prompts: --prompt, --prompt-file, "
                    "or one per line on stdin; with --chat, conversations rendered by the chat template.",
    )
    add_load_arguments(parser)
    group = parser.add_argument_group("prompts")
    group.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    group.add_argument("--prompt-file", metavar="PATH",
                       help="one prompt per line; - reads stdin. With --chat, or a .jsonl file: one JSON object per "
                            "line, {\"prompt\": TEXT} (newlines and all) or, with --chat, {\"messages\": [{\"role\": "
                            "..., \"content\": ...}, ...]}")
    group.add_argument("--chat", action="store_true",
                       help="render each prompt with the chat template (the checkpoint tokenizer's, or "
                            "--chat-template) and the assistant's turn opened, as apply_chat_template("
                            "add_generation_prompt=True): --prompt is a user message (after --system's), "
                            "--prompt-file and stdin are JSON lines")
    group.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each --prompt")
    group.add_argument("--chat-template", metavar="FILE",
                       help="with --chat: a Jinja chat template (or a tokenizer_config.json holding one) instead "
                            "of the checkpoint tokenizer's")
    group.add_argument("--add-bos", action="store_true", help="prepend the beginning-of-sequence token")
    group = parser.add_argument_group("generation")
    group.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate per prompt (default 64)")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--greedy", action="store_true", help="always the most likely token")
    choice.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature (default 1.0); 0 is greedy, as --greedy (and as the server, "
                             "OpenAI and transformers take it)")
    group.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling probability (0: off)")
    group.add_argument("--seed", type=int, help="sampling seed (prompt i uses seed + i): runs reproduce")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when the continuation holds TEXT, left out of the output (repeatable)")
    group.add_argument("--stop-on-eol", action="store_true", help="stop at the first newline")
    group.add_argument("--stop-on-double-eol", action="store_true", help="stop at a blank line")
    group.add_argument("--max-batch-size", type=int, default=32,
                       help="prompts decoded together; the next prompt joins as one finishes (default 32)")
    add_decoding_arguments(group, "for decoder-only models (tensor-parallel too)")
    group = parser.add_argument_group("output")
    group.add_argument("--echo", action="store_true", help="print the prompt before its continuation")
    group.add_argument("--json", action="store_true",
                       help="one JSON object per prompt: prompt, text, tokens, finish_reason (and logprobs)")
    group.add_argument("--logprobs", action="store_true", help="with --json: log-probabilities of the tokens")
    return parser


def prompt_texts(prompts: list[Prompt], loaded, template_file: str | None) -> list[str]:
    """Each prompt's text: a conversation rendered by ``--chat-template`` or the tokenizer's template."""
    if all(prompt.messages is None for prompt in prompts):
        return [prompt.text for prompt in prompts]
    template = loaded.chat_template
    if template_file:
        template = chat_template_file(template_file, template.special_tokens if template else None)
    if template is None:
        raise ChatTemplateError("--chat: the checkpoint's tokenizer has no chat template (chat_template in "
                                "tokenizer_config.json, or chat_template.jinja): give --chat-template FILE")
    return [template.render(prompt.messages) for prompt in prompts]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if not args.chat and (args.system is not None or args.chat_template):
        parser.error("--system and --chat-template need --chat")
    # start-up cost: `mega --help` and the parser stay free of torch and the models
    from mega.inference.cli.engine_setup import setup_engine
    from mega.inference.engine import GenerationError, GenerationRequest
    from mega.inference.engine.sampling import GREEDY, SamplingError, SamplingParams
    from mega.inference.engine.stopping import StopRules
    from mega.inference.engine.tp_serving import lead

    setup = setup_engine(args, "generate")
    if setup is None:  # a follower: the leader's steps have ended
        return 0
    try:
        tokenizer = setup.loaded.tokenizer
        greedy = args.greedy or args.temperature == 0
        sampling = GREEDY if greedy else SamplingParams(args.temperature, args.top_k, args.top_p)
        stop = StopRules(stop_ids=frozenset({tokenizer.eod}), stop_strings=tuple(args.stop),
                         stop_on_eol=args.stop_on_eol, stop_on_double_eol=args.stop_on_double_eol)
        prompts = prompt_texts(read_prompts(args), setup.loaded, args.chat_template)
        requests = []
        for index, prompt in enumerate(prompts):
            ids = tokenizer.tokenize(prompt)
            if args.add_bos:
                ids = [tokenizer.bos if tokenizer.bos is not None else tokenizer.eod, *ids]
            seed = None if args.seed is None else args.seed + index
            requests.append(GenerationRequest(ids, args.max_tokens, SamplingParams(
                sampling.temperature, sampling.top_k, sampling.top_p, seed), stop, logprobs=args.logprobs,
                prompt_logprobs=False))  # the record lists the generated tokens' alone
        printed = 0
        results: list = [None] * len(requests)

        def print_in_order(index: int, result) -> None:  # each as soon as those before it are printed
            nonlocal printed
            results[index] = result
            while printed < len(results) and results[printed] is not None:
                print_result(args, tokenizer, prompts[printed], results[printed], stop)
                printed += 1

        setup.worker.run_to_completion(requests, on_finish=print_in_order, lead_followers=True)
    except (GenerationError, SamplingError, OSError, PromptError, ChatTemplateError) as error:
        print(f"mega generate: {error}", file=sys.stderr)
        return 2
    finally:
        lead(None, setup.tp_group)
    return 0


def print_result(args, tokenizer, prompt: str, result, stop) -> None:
    text = completion_text(tokenizer, result.generated, stop)
    if args.json:
        record = {"prompt": prompt, "text": text, "tokens": result.generated, "finish_reason": result.finish_reason}
        if args.logprobs:
            record["logprobs"] = result.logprobs[result.prompt_length - 1:]
        print(json.dumps(record), flush=True)
    else:
        print((prompt if args.echo else "") + text, flush=True)
