"""What mega-rl registers with mega, through the entry-point group ``mega``: the built-in rewards,
by import path (nothing is imported until a run names one)."""

from mega.core.plugins import Command, hookimpl


@hookimpl
def register_commands(register):
    register("rl", Command(help="GRPO post-training on mega's trainer and engine in one process (Megatron-RL's flags)",
                           main="mega.rl.command:main"))


@hookimpl
def register_rewards(register):
    register("math", "mega.rl.builtin_rewards:math_answer",
             "1.0 when the completion's final answer (\\boxed{...} or after ####) equals the line's `answer` "
             "as a number (or as text), else 0.0")
    register("format", "mega.rl.builtin_rewards:regex_format",
             "1.0 when the completion matches the regular expression of the line's `format` field (default: a "
             "\\boxed{} answer), else 0.0")
    register("length", "mega.rl.builtin_rewards:length_penalty",
             "minus the completion's length in characters over the line's `target_length` (default 0), "
             "divided by 1000: a gentle push towards short answers")
