"""Request fields the OpenAI-style routes share (completions and chat), and how they become the
engine's sampling settings and stop rules.

Every field OpenAI defines is declared; a field it does not define is refused (400 naming it),
so a misspelled ``temprature`` is never silently ignored. Accepted and ignored, as documented:
``user`` (an end-user id for abuse tracking) and ``model`` when it names the served model.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from mega.inference.engine.grammar import Constraint
from mega.inference.engine.sampling import GREEDY, SEED_LIMIT, SamplingParams
from mega.inference.http.errors import RequestError

Number = Annotated[float, Strict()]  # an int or a float, never a string or a bool
Integer = Annotated[int, Strict()]
Flag = Annotated[bool, Strict()]

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_SEQUENCES = 256  # prompts x best_of in one request
LOGIT_BIAS_LIMIT = 100.0


def check_model(served: str, name: str | None) -> None:
    """A request's ``model``, if it names one, must be the served model's name (else 404)."""
    if name is not None and name != served:
        raise RequestError(f"model: the model {name!r} does not exist; this server serves {served!r}",
                           "model", status=404, kind="model_not_found")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: Flag = Field(False, description="a last chunk with the usage of the whole request")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(description="the schema's name")
    description: str | None = Field(None, description="accepted and ignored")
    json_schema: dict | None = Field(None, alias="schema", description="the JSON schema the answer follows")
    strict: Flag | None = Field(None, description="accepted: the answer always follows the schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: given exactly when type is 'json_schema'")
        return self


class SamplingFields(BaseModel):
    """The sampling, stopping and streaming fields of both routes."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model's name, or a LoRA adapter's served beside it "
                              "(see /v1/models); may be left out (the base)")
    temperature: Number | None = Field(1.0, ge=0.0, le=100.0, description="0 is greedy")
    top_p: Number | None = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1 is off")
    top_k: Integer = Field(0, ge=0, description="sample from the k most likely tokens; 0 is off (mega's extension)")
    n: Integer | None = Field(1, ge=1, le=MAX_SEQUENCES, description="completions per prompt")
    stop: str | list[str] | None = Field(None, validate_default=True,
                                         description=f"up to {MAX_STOP_STRINGS} stop strings, left out of the text")
    seed: Integer | None = Field(None, ge=0, lt=SEED_LIMIT,
                                 description="seed of the sampling, in [0, 2**64) (sequence i: seed + i)")
    stream: Flag = Field(False, description="send the completion as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="with stream: include_usage")
    presence_penalty: Number | None = Field(0.0, ge=-2.0, le=2.0,
                                            description="subtracted from the logit of every token generated so far")
    frequency_penalty: Number | None = Field(0.0, ge=-2.0, le=2.0,
                                             description="times each token's count so far, subtracted from its logit")
    logit_bias: dict[str, Number] | None = Field(None, description="token id (as a string) -> value in [-100, 100] "
                                                 "added to its logit")
    user: str | None = Field(None, description="accepted and ignored")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the answer is "
                                                   "JSON (of the schema)")
    guided_json: dict | str | None = Field(None, description="a JSON schema the answer follows (vLLM's field)")
    guided_regex: str | None = Field(None, description="a regular expression the whole answer matches (vLLM's)")
    guided_choice: list[str] | None = Field(None, min_length=1, description="the answer is one of these (vLLM's)")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        for key, value in (bias or {}).items():
            # ASCII digits only ("²" is a digit to str.isdigit, not to int()), and few of them
            # (int() refuses more than 4300 digits).
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"values must be in [-100, 100], got {value} for token {key}")
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("guided_json", "guided_regex", "guided_choice") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]}: at most one constraint on the answer")
        return self

    def constraint(self) -> tuple[Constraint, str] | None:
        """The constraint on the answer's text and the field that asked it, or None."""
        if self.guided_json is not None:
            return Constraint("json_schema", self.guided_json), "guided_json"
        if self.guided_regex is not None:
            return Constraint("regex", self.guided_regex), "guided_regex"
        if self.guided_choice is not None:
            return Constraint("choice", tuple(self.guided_choice)), "guided_choice"
        if self.response_format is None or self.response_format.type == "text":
            return None
        if self.response_format.type == "json_object":
            return Constraint("json_object"), "response_format"
        return Constraint("json_schema", self.response_format.json_schema.json_schema or {}), \
            "response_format.json_schema.schema"

    @property
    def copies(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def biases(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, value) pairs; a token outside the vocabulary is refused."""
        pairs = tuple((int(key), float(value)) for key, value in (self.logit_bias or {}).items())
        if bad := [token for token, _ in pairs if token >= vocab_size]:
            raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                               "logit_bias")
        return pairs

    def sampling(self, sequence: int, vocab_size: int) -> SamplingParams:
        """The sampling settings of the request's ``sequence``-th sequence."""
        adjustments = dict(logit_bias=self.biases(vocab_size), presence_penalty=self.presence_penalty or 0.0,
                           frequency_penalty=self.frequency_penalty or 0.0)
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature == 0 or self.top_k == 1:
            return SamplingParams(top_k=1, **adjustments) if any(adjustments.values()) else GREEDY
        seed = None if self.seed is None else (self.seed + sequence) % SEED_LIMIT
        top_p = 1.0 if self.top_p is None else self.top_p
        return SamplingParams(temperature=temperature, top_k=self.top_k, top_p=top_p, seed=seed, **adjustments)
