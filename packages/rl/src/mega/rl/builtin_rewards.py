"""The rewards mega-rl registers: a math answer check, a regular-expression format check and a
length penalty. Each is called once per completion with the prompt line's fields as keywords."""

from __future__ import annotations

import re
from fractions import Fraction

DEFAULT_FORMAT = r"\\boxed\{.+\}"
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$|^[-+]?\d+/\d+$")


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None  # unclosed: no answer


def final_answer(text: str) -> str | None:
    """A solution's final answer: its last ``\\boxed{}``, else what follows its last ``####``
    (GSM8K's marker) up to the end of that line."""
    boxed = boxed_answer(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else ""
    return None


def normalize(answer: str) -> Fraction | str:
    """A number as an exact fraction (``1,000``, ``$5``, ``50%``, ``3/4``, ``0.50``, ``\\frac{3}{4}``
    read as numbers), anything else as lower-case text without spaces or a final full stop."""
    text = answer.strip().strip("$").strip()
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    text = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"\1/\2", text)
    text = text.replace("\\!", "").replace("\\,", "").replace("\\%", "%").replace(" ", "").rstrip(".")
    number = text.replace(",", "").lstrip("$").rstrip("%")
    if _NUMBER.match(number):
        try:
            return Fraction(number)
        except (ValueError, ZeroDivisionError):
            pass
    return text.lower()


def math_answer(prompt: str, completion: str, answer=None, **fields) -> float:
    """1.0 when the completion's final answer equals the line's ``answer`` (itself a bare answer,
    or a solution ending in ``#### x`` or ``\\boxed{x}``), compared as numbers where both are."""
    if answer is None:
        raise ValueError("the math reward needs an `answer` field in each prompt line")
    given = final_answer(completion)
    if given is None:
        return 0.0
    expected = final_answer(str(answer))
    return 1.0 if normalize(given) == normalize(str(answer) if expected is None else expected) else 0.0


def regex_format(prompt: str, completion: str, format_regex: str = DEFAULT_FORMAT, **fields) -> float:
    """1.0 when the regular expression (the line's ``format_regex``, default a ``\\boxed{}`` answer)
    is found in the completion (``re.DOTALL``: ``.`` crosses lines), else 0.0."""
    return 1.0 if re.search(format_regex, completion, re.DOTALL) else 0.0


def length_penalty(prompt: str, completion: str, target_length: int = 0, length_scale: int = 1000,
                   **fields) -> float:
    """0.0 up to the line's ``target_length`` characters (default 0), then -1.0 per
    ``length_scale`` characters beyond (default 1000), down to -1.0 at most."""
    excess = max(0, len(completion) - int(target_length))
    return -min(1.0, excess / int(length_scale))
