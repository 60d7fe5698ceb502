"""Read a HyperPyYAML file (``cosyvoice2.yaml``) as plain data.

The official yaml instantiates upstream classes through tags (``!new:``, ``!name:``,
``!apply:``) and references (``!ref <key>``). We never instantiate anything: a tagged
mapping becomes a :class:`Tagged` holding its tag and its arguments, and references are
resolved against the top-level keys, including upstream's arithmetic form
``!ref <a> * <b>``.
"""

import ast
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

_REF = re.compile(r"<([A-Za-z_][A-Za-z0-9_.]*)>")
_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


@dataclass(frozen=True)
class Tagged:
    """A ``!new:``/``!name:``/``!apply:`` node: the target's dotted name and its arguments."""

    tag: str
    args: Any


@dataclass(frozen=True)
class _Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if suffix == "ref":
        if not isinstance(node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(None, None, "!ref takes a scalar", node.start_mark)
        return _Ref(str(loader.construct_scalar(node)))
    args: Any
    if isinstance(node, yaml.MappingNode):
        args = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        args = loader.construct_sequence(node, deep=True)
    elif isinstance(node, yaml.ScalarNode):
        args = loader.construct_scalar(node)
    else:
        raise yaml.constructor.ConstructorError(None, None, f"unexpected node for !{suffix}", node.start_mark)
    return Tagged(suffix, args)


_Loader.add_multi_constructor("!", _tagged)
# PyYAML's resolver misses exponent floats without a dot (``1e-06``); YAML 1.2 does not.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _evaluate(expr: str, top: dict[str, Any], seen: frozenset[str]) -> Any:
    names = _REF.findall(expr)
    if _REF.fullmatch(expr.strip()):
        return _resolve(_lookup(top, names[0]), top, seen | {names[0]})
    values = {name: _resolve(_lookup(top, name), top, seen | {name}) for name in names}
    source = _REF.sub(lambda m: repr(values[m.group(1)]), expr)
    return _arith(ast.parse(source, mode="eval").body)


def _arith(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arith(node.operand)
    raise ValueError(f"unsupported expression in !ref: {ast.unparse(node)}")


def _lookup(top: dict[str, Any], dotted: str) -> Any:
    value: Any = top
    for part in dotted.split("."):
        value = value[part]
    return value


def _resolve(value: Any, top: dict[str, Any], seen: frozenset[str] = frozenset()) -> Any:
    if isinstance(value, _Ref):
        if any(name in seen for name in _REF.findall(value.expr)):
            raise ValueError(f"circular !ref {value.expr}")
        return _evaluate(value.expr, top, seen)
    if isinstance(value, Tagged):
        return Tagged(value.tag, _resolve(value.args, top, seen))
    if isinstance(value, dict):
        return {k: _resolve(v, top, seen) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, seen) for v in value]
    return value


def read_hyperpyyaml(text: str) -> dict[str, Any]:
    """Parse HyperPyYAML text into plain data with references resolved.

    Raises ``ValueError`` (or ``yaml.YAMLError``) on malformed input or a reference
    to a key that does not exist.
    """
    top = yaml.load(text, Loader=_Loader)
    if not isinstance(top, dict):
        raise ValueError("the yaml's top level is not a mapping")
    try:
        return {k: _resolve(v, top) for k, v in top.items()}
    except KeyError as exc:
        raise ValueError(f"!ref names a key that does not exist: {exc}") from None
