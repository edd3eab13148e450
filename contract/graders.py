"""Graders: OpenAI's reward-source objects for reinforcement fine-tuning, as a reward source of a job.

Torch-free: the service validates graders with `parse_grader` (REST, gRPC and the OpenAI-compatible API),
the worker evaluates them (`worker.grpo.graders`) and the outbound chat client renders `score_model` inputs
with `render`. Semantics follow OpenAI's graders guide:

- templates: ``{{ item.<path> }}`` is a field of the dataset row (a JSON path: ``a.b``, ``a[0]``),
  ``{{ sample.output_text }}`` the completion, ``{{ sample.output_json.<path> }}`` the completion parsed as
  JSON (a sample that is not JSON scores the grader's lowest value); non-string values render as JSON;
- ``string_check``: ``eq`` / ``ne`` compare exactly, ``like`` is "input contains reference", ``ilike`` the
  same ignoring case; 1.0 or 0.0;
- ``text_similarity``: a score in [0, 1] (``fuzzy_match``, ``bleu``, ``gleu``, ``rouge_1``..``rouge_5``,
  ``rouge_l``); ``cosine`` and ``meteor`` are refused (see `UNSUPPORTED_METRICS`);
- ``score_model``: a chat model asked for a score within ``range``; here the model is a registered
  OpenAI-compatible chat endpoint, ``model = "<reward_function_id>/<model name>"``;
- ``multi``: named sub-graders combined by ``calculate_output``, an arithmetic formula over their names
  (``+ - * / ^``, ``min max abs floor ceil exp sqrt log``), parsed with `ast` and evaluated by a whitelist;
- ``python`` and ``label_model`` are refused: this service has no sandbox for user code, and label graders
  need a label set the training reward has no place for.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.fields import Text

MAX_TEMPLATE_CHARS = 20_000
MAX_RENDERED_CHARS = 256 * 1024  # default of GRPO_GRADER_MAX_RENDERED_CHARS
MAX_FUZZY_MATCH_CHARS = 4_096  # default of GRPO_GRADER_MAX_FUZZY_MATCH_CHARS
MAX_FORMULA_CHARS = 1_000
MAX_FORMULA_NODES = 200
MAX_SUB_GRADERS = 16
MAX_MODEL_MESSAGES = 32

TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_SEGMENT = re.compile(r"^([^.\[\]]+)((?:\[\d+\])*)$")
_INDEX = re.compile(r"\[(\d+)\]")

SIMILARITY_METRICS = ("fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l")
UNSUPPORTED_METRICS = {
    "cosine": "needs an embeddings endpoint, which this service does not have; use fuzzy_match, bleu, gleu or "
    "a rouge metric",
    "meteor": "needs the WordNet corpus, which is not installed on this service (it is not available offline); "
    "use bleu, gleu or a rouge metric",
}
UNSUPPORTED_TYPES = {
    "python": "python graders are not supported: this service has no sandbox to run user code in; express the "
    "score with string_check, text_similarity, score_model and multi, or register a remote reward endpoint",
    "label_model": "label_model graders are not supported as a training reward; use score_model",
}
FORMULA_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "exp": math.exp,
    "sqrt": math.sqrt,
    "log": math.log,
}


class GraderInvalid(ValueError):
    """A grader OpenAI's rules or ours refuse; `param` is the dotted path of the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


# --- templates ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """One ``{{ namespace.path }}``: the namespace and the path below it (keys and list indexes)."""

    namespace: Literal["item", "sample"]
    path: tuple[str | int, ...]
    text: str  # as written, for messages

    def __str__(self) -> str:
        return "{{" + self.text + "}}"


def parse_reference(text: str) -> Reference:
    """Parse the inside of ``{{ }}``; ValueError says why a reference is not one OpenAI documents."""
    parts = text.split(".")
    namespace, rest = parts[0], parts[1:]
    if namespace not in ("item", "sample"):
        raise ValueError(f"{{{{{text}}}}}: the namespace must be item or sample")
    path: list[str | int] = []
    for part in rest:
        match = _SEGMENT.match(part)
        if match is None:
            raise ValueError(f"{{{{{text}}}}}: {part!r} is not a field name (a.b or a[0])")
        path.append(match.group(1))
        path.extend(int(i) for i in _INDEX.findall(match.group(2)))
    if namespace == "item" and not path:
        raise ValueError(f"{{{{{text}}}}}: name a field of the item, e.g. {{{{item.answer}}}}")
    if namespace == "sample":
        if not path or path[0] not in ("output_text", "output_json"):
            raise ValueError(f"{{{{{text}}}}}: the sample namespace offers output_text and output_json")
        if path[0] == "output_text" and len(path) > 1:
            raise ValueError(f"{{{{{text}}}}}: output_text is a string and has no fields")
    return Reference(namespace, tuple(path), text)  # type: ignore[arg-type]


def references(template: str) -> list[Reference]:
    return [parse_reference(m.group(1)) for m in TEMPLATE.finditer(template)]


class MissingField(LookupError):
    """A template names a field the item (or the sample's JSON) does not have."""

    def __init__(self, reference: Reference, at: str) -> None:
        super().__init__(f"{reference} : no field {at!r}")
        self.reference = reference
        self.at = at

    def __reduce__(self) -> tuple[Any, ...]:  # crosses the grading process's boundary
        return (MissingField, (self.reference, self.at))


class SampleNotJson(ValueError):
    """``sample.output_json`` was referenced and the completion is not JSON."""


@dataclass(frozen=True)
class GraderLimits:
    """What one evaluation may be given: the bounds that keep a grader's time and memory linear in its input.

    `max_rendered_chars` bounds every rendered template (rendering stops as soon as it would pass it, so a
    template that repeats a large field costs at most the limit); `max_fuzzy_match_chars` bounds each text a
    ``fuzzy_match`` compares (its partial matching grows faster than the square of the length). The service
    takes both from its settings (`GRPO_GRADER_MAX_RENDERED_CHARS`, `GRPO_GRADER_MAX_FUZZY_MATCH_CHARS`)."""

    max_rendered_chars: int = MAX_RENDERED_CHARS
    max_fuzzy_match_chars: int = MAX_FUZZY_MATCH_CHARS


class GraderInputTooLarge(ValueError):
    """A rendered template, or a text a metric compares, is longer than its limit.

    `field` is the template's place in the grader (``input``, ``reference``, ``input.0.content``; the caller
    prefixes the sub-grader), `setting` the environment variable that sets `limit`."""

    def __init__(self, field: str, what: str, limit: int, setting: str) -> None:
        self.reason = f"{what} is longer than {limit} characters (the limit, {setting})"
        super().__init__(f"{field}: {self.reason}")
        self.field = field
        self.what = what
        self.limit = limit
        self.setting = setting

    def __reduce__(self) -> tuple[Any, ...]:
        return (GraderInputTooLarge, (self.field, self.what, self.limit, self.setting))

    def within(self, prefix: str) -> GraderInputTooLarge:
        """The same refusal, its field named from `prefix` (``grader.graders.name``)."""
        return GraderInputTooLarge(f"{prefix}.{self.field}", self.what, self.limit, self.setting)


def lookup(value: Any, reference: Reference, path: tuple[str | int, ...]) -> Any:
    for key in path:
        if isinstance(key, int) and isinstance(value, list) and key < len(value):
            value = value[key]
        elif isinstance(key, str) and isinstance(value, dict) and key in value:
            value = value[key]
        else:
            raise MissingField(reference, str(key))
    return value


@dataclass(frozen=True)
class Sample:
    """The sample namespace of one completion."""

    output_text: str

    def output_json(self) -> Any:
        """The completion parsed as JSON, parsed once however many references read it."""
        parsed: tuple[bool, Any] | None = self.__dict__.get("_json")
        if parsed is None:
            try:
                parsed = (True, json.loads(self.output_text))
            except ValueError:
                parsed = (False, None)
            object.__setattr__(self, "_json", parsed)
        if not parsed[0]:
            raise SampleNotJson("the sample is not valid JSON, so sample.output_json is not set")
        return parsed[1]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def resolve(reference: Reference, item: Mapping[str, Any], sample: Sample) -> Any:
    if reference.namespace == "item":
        return lookup(dict(item), reference, reference.path)
    if reference.path[0] == "output_text":
        return sample.output_text
    return lookup(sample.output_json(), reference, reference.path[1:])


def render(
    template: str, item: Mapping[str, Any], sample: Sample, *, field: str = "template",
    max_chars: int = MAX_RENDERED_CHARS,
) -> str:
    """Substitute every reference. Raises MissingField, SampleNotJson, or GraderInputTooLarge (naming `field`)
    as soon as the text would pass `max_chars`: the parts are counted as they are produced, so a template that
    repeats a large field never holds more than the limit."""
    parts: list[str] = []
    size = 0

    def add(text: str) -> None:
        nonlocal size
        size += len(text)
        if size > max_chars:
            raise GraderInputTooLarge(field, "the rendered template", max_chars, "GRPO_GRADER_MAX_RENDERED_CHARS")
        parts.append(text)

    end = 0
    for match in TEMPLATE.finditer(template):
        add(template[end:match.start()])
        add(_as_text(resolve(parse_reference(match.group(1)), item, sample)))
        end = match.end()
    add(template[end:])
    return "".join(parts)


# --- formulas -------------------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: lambda a, b: a**b,
    ast.BitXor: lambda a, b: a**b,  # OpenAI writes powers with ^
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a}


class FormulaError(ValueError):
    """A formula that evaluates to no finite number for these inputs (division by zero, log of 0...)."""


def parse_formula(formula: str, names: set[str]) -> ast.Expression:
    """Parse and check a calculate_output formula; ValueError names what is not allowed."""
    if len(formula) > MAX_FORMULA_CHARS:
        raise ValueError(f"is {len(formula)} characters; the limit is {MAX_FORMULA_CHARS}")
    try:
        tree = ast.parse(formula.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"is not a formula: {exc.msg}") from exc
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_FORMULA_NODES:
        raise ValueError(f"has {len(nodes)} terms; the limit is {MAX_FORMULA_NODES}")
    for node in nodes:
        _check_node(node, names)
    return tree


def _check_node(node: ast.AST, names: set[str]) -> None:
    if isinstance(node, ast.Expression | ast.Load):
        return
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"constant {node.value!r} is not a number")
    elif isinstance(node, ast.Name):
        if node.id not in names and node.id not in FORMULA_FUNCTIONS:
            raise ValueError(f"{node.id!r} is not one of the graders ({', '.join(sorted(names))})")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise ValueError(f"operator {type(node.op).__name__} is not allowed (use + - * / ^)")
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise ValueError(f"operator {type(node.op).__name__} is not allowed")
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FORMULA_FUNCTIONS or node.keywords:
            raise ValueError(f"only the functions {', '.join(FORMULA_FUNCTIONS)} may be called, positionally")
        if not node.args:
            raise ValueError(f"{node.func.id}() needs an argument")
    elif isinstance(node, ast.operator | ast.unaryop):
        return
    else:
        raise ValueError(f"{type(node).__name__} is not allowed in a formula")


def evaluate_formula(tree: ast.Expression, values: Mapping[str, float]) -> float:
    """The formula's value; FormulaError when it has no finite value for these inputs."""
    try:
        result = float(_evaluate(tree.body, values))
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise FormulaError(f"{type(exc).__name__}: {exc}") from exc
    if not math.isfinite(result):
        raise FormulaError(f"the formula evaluates to {result}")
    return result


def _evaluate(node: ast.expr, values: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # parse_formula admits only numbers
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.BinOp):
        return float(_BINARY[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values)))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return float(FORMULA_FUNCTIONS[node.func.id](*(_evaluate(a, values) for a in node.args)))
    raise ValueError(f"{type(node).__name__} is not allowed")  # parse_formula let nothing else through


# --- grader objects -------------------------------------------------------------------------------

TemplateText = Annotated[Text, Field(max_length=MAX_TEMPLATE_CHARS)]
GraderName = Annotated[Text, Field(min_length=1, max_length=128)]


class _Grader(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: GraderName


class StringCheckGrader(_Grader):
    type: Literal["string_check"] = "string_check"
    input: TemplateText
    reference: TemplateText
    operation: Literal["eq", "ne", "like", "ilike"]


class TextSimilarityGrader(_Grader):
    type: Literal["text_similarity"] = "text_similarity"
    input: TemplateText
    reference: TemplateText
    evaluation_metric: Literal[
        "fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"
    ]
    pass_threshold: float | None = Field(None, description="Accepted for evals; training uses the score itself.")


class ModelMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system", "developer"]
    content: TemplateText
    type: Literal["message"] | None = None


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    max_completions_tokens: int | None = Field(None, ge=1, le=32768)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class ScoreModelGrader(_Grader):
    type: Literal["score_model"] = "score_model"
    model: Text = Field(
        min_length=3, max_length=512, pattern=r"^[^/]+/.+$",
        description="<reward_function_id>/<model name>: a registered OpenAI-compatible chat endpoint and the "
        "model it serves.",
    )
    input: list[ModelMessage] = Field(min_length=1, max_length=MAX_MODEL_MESSAGES)
    range: tuple[float, float] = (0.0, 1.0)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    pass_threshold: float | None = None

    @property
    def reward_function_id(self) -> str:
        return self.model.split("/", 1)[0]

    @property
    def chat_model(self) -> str:
        return self.model.split("/", 1)[1]


SubGrader = StringCheckGrader | TextSimilarityGrader | ScoreModelGrader


class MultiGrader(_Grader):
    type: Literal["multi"] = "multi"
    graders: dict[str, SubGrader]
    calculate_output: Text

    def formula(self) -> ast.Expression:
        return parse_formula(self.calculate_output, set(self.graders))


Grader = StringCheckGrader | TextSimilarityGrader | ScoreModelGrader | MultiGrader
_MODELS: dict[str, type[_Grader]] = {
    "string_check": StringCheckGrader,
    "text_similarity": TextSimilarityGrader,
    "score_model": ScoreModelGrader,
}


def parse_grader(data: Any, param: str = "grader") -> Grader:
    """Validate an OpenAI grader object; GraderInvalid names the offending field as a dotted `param`."""
    if not isinstance(data, dict):
        raise GraderInvalid(param, f"must be a grader object, got {type(data).__name__}")
    kind = data.get("type")
    if kind == "multi":
        return _parse_multi(data, param)
    return _parse_single(data, param)


def _parse_single(data: dict[str, Any], param: str) -> SubGrader:
    kind = data.get("type")
    if kind in UNSUPPORTED_TYPES:
        raise GraderInvalid(f"{param}.type", UNSUPPORTED_TYPES[kind])
    if kind == "text_similarity" and data.get("evaluation_metric") in UNSUPPORTED_METRICS:
        metric = data["evaluation_metric"]
        raise GraderInvalid(f"{param}.evaluation_metric", f"{metric}: {UNSUPPORTED_METRICS[metric]}")
    model = _MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise GraderInvalid(
            f"{param}.type", f"{kind!r} is not a grader type; use string_check, text_similarity, score_model or multi"
        )
    grader = _validated(model, data, param)
    assert isinstance(grader, StringCheckGrader | TextSimilarityGrader | ScoreModelGrader)
    for field, template in templates(grader):
        try:
            references(template)
        except ValueError as exc:
            raise GraderInvalid(f"{param}.{field}", str(exc)) from exc
    if isinstance(grader, ScoreModelGrader) and not grader.range[0] < grader.range[1]:
        raise GraderInvalid(f"{param}.range", "must be [low, high] with low < high")
    return grader


def _parse_multi(data: dict[str, Any], param: str) -> MultiGrader:
    graders = data.get("graders")
    if isinstance(graders, dict) and graders.get("type") in (*_MODELS, *UNSUPPORTED_TYPES, "multi") and (
        "name" in graders
    ):
        graders = {str(graders["name"]): graders}  # one grader given bare (the SDK types it so): its name names it
    if not isinstance(graders, dict) or not graders:
        raise GraderInvalid(f"{param}.graders", "must be an object of named graders, e.g. {\"exact\": {...}}")
    if len(graders) > MAX_SUB_GRADERS:
        raise GraderInvalid(f"{param}.graders", f"{len(graders)} graders; the limit is {MAX_SUB_GRADERS}")
    parsed: dict[str, SubGrader] = {}
    for key, sub in graders.items():
        if not key.isidentifier():
            raise GraderInvalid(f"{param}.graders.{key}", "a grader key must be a name usable in calculate_output")
        if isinstance(sub, dict) and sub.get("type") == "multi":
            raise GraderInvalid(f"{param}.graders.{key}.type", "a multi grader cannot contain another multi grader")
        if not isinstance(sub, dict):
            raise GraderInvalid(f"{param}.graders.{key}", "must be a grader object")
        parsed[key] = _parse_single(sub, f"{param}.graders.{key}")
    rest = {k: v for k, v in data.items() if k != "graders"}
    shell = _validated(MultiGrader, {**rest, "graders": {}}, param)
    assert isinstance(shell, MultiGrader)
    grader = MultiGrader.model_construct(**{**shell.__dict__, "graders": parsed})
    try:
        grader.formula()
    except ValueError as exc:
        raise GraderInvalid(f"{param}.calculate_output", str(exc)) from exc
    return grader


def _validated(model: type[_Grader], data: dict[str, Any], param: str) -> _Grader:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise GraderInvalid(f"{param}.{where}" if where else param, error["msg"]) from exc


def templates(grader: SubGrader) -> Iterator[tuple[str, str]]:
    """(field, template) of each template the grader renders, the field as `GraderInvalid` names it."""
    if isinstance(grader, ScoreModelGrader):
        for i, message in enumerate(grader.input):
            yield f"input.{i}.content", message.content
    else:
        yield "input", grader.input
        yield "reference", grader.reference


def sub_graders(grader: Grader) -> dict[str, SubGrader]:
    """The graders that score (a multi grader's parts, or the grader itself under its name)."""
    return dict(grader.graders) if isinstance(grader, MultiGrader) else {grader.name: grader}


def item_references(grader: Grader) -> list[Reference]:
    """Every ``{{item.*}}`` the grader reads, each once, in order of appearance."""
    seen: dict[str, Reference] = {}
    for sub in sub_graders(grader).values():
        for _, template in templates(sub):
            for ref in references(template):
                if ref.namespace == "item":
                    seen.setdefault(ref.text, ref)
    return list(seen.values())


def missing_item_field(grader: Grader, item: Mapping[str, Any]) -> MissingField | None:
    """The first ``{{item.*}}`` reference this dataset row cannot satisfy, or None."""
    for ref in item_references(grader):
        try:
            lookup(dict(item), ref, ref.path)
        except MissingField as exc:
            return exc
    return None


def grader_dump(grader: Grader) -> dict[str, Any]:
    """The grader as JSON-ready data, with our defaults filled in."""
    if isinstance(grader, MultiGrader):
        return {
            "type": "multi",
            "name": grader.name,
            "graders": {k: v.model_dump(mode="json", exclude_none=True) for k, v in grader.graders.items()},
            "calculate_output": grader.calculate_output,
        }
    return grader.model_dump(mode="json", exclude_none=True)
