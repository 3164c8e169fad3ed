"""The YAML of configs: one reader and one writer that agree, so what flaxlight writes reads back the same.

The reader is PyYAML's safe loader with three changes: ``1e-3`` is a float (YAML 1.1 reads it as
text), ``1:30`` is text, as in YAML 1.2 (YAML 1.1 reads base-60 numbers: 90), and a key given twice
in one mapping is an error (PyYAML keeps the last silently); merge keys (``<<: *base``) work as in
PyYAML. The writer resolves plain scalars with the reader's rules, so a string the reader would take
for something else (``"3e-4"``, ``"null"``, ``"yes"``, ``"2026-11-26"``) is written quoted.

    >>> dump({"run_name": "3e-4", "lr": 3e-4})
    "run_name: '3e-4'\\nlr: 0.0003\\n"
    >>> load(dump({"run_name": "3e-4", "lr": 3e-4}))
    {'run_name': '3e-4', 'lr': 0.0003}
"""

from __future__ import annotations

import collections.abc
import re
from typing import Any

import yaml

__all__ = ["SafeLoader", "Dumper", "load", "dump", "problem"]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class SafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading ``1e-3`` as a float, YAML 1.1's base-60 numbers as
    strings (``max_time: 1:00:00:00`` is the duration text, not 216000), and refusing a key given
    twice in one mapping. Merge keys (``<<: *base``) give defaults that the mapping's own keys
    replace, as in PyYAML: that is no duplicate."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # SafeConstructor calls this first for every mapping (and for each mapping merged into
        # one): the mapping's own keys are checked before the merged ones are added to it.
        checked = self.__dict__.setdefault("_checked_mappings", set())
        if node not in checked:
            checked.add(node)
            self._refuse_duplicate_keys(node)
        super().flatten_mapping(node)

    def _refuse_duplicate_keys(self, node: yaml.MappingNode) -> None:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, collections.abc.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)


SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+)$"""),
    list("-+0123456789"),
)
for _first in "-+0123456789":  # before YAML 1.1's int and float resolvers, which read 1:30 as 90
    SafeLoader.yaml_implicit_resolvers[_first].insert(
        0, ("tag:yaml.org,2002:str", re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")))


class Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper with the reader's resolvers (a string it would read as a number, a
    boolean, null or a date is quoted); short lists of scalars in flow style (``[256, 256]``)."""


Dumper.yaml_implicit_resolvers = {first: list(resolvers)
                                  for first, resolvers in SafeLoader.yaml_implicit_resolvers.items()}


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.SequenceNode:
    flow = all(isinstance(v, (str, int, float, bool)) or v is None for v in data) and len(data) <= 16
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


Dumper.add_representer(list, _represent_list)


def dump(data: Any) -> str:
    """``data`` (plain dicts, lists and scalars) as YAML that :func:`load` reads back equal.

    Examples:
        >>> dump({"hidden_dims": [256, 256], "when": "2026-11-26"})
        "hidden_dims: [256, 256]\\nwhen: '2026-11-26'\\n"
    """
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, allow_unicode=True)


def load(text: str) -> Any:
    """YAML text read with :class:`SafeLoader` (raises ``yaml.YAMLError``; :func:`problem` says it on one line).

    Examples:
        >>> load("lr: 3e-4\\nmax_time: 1:30\\nbase: &b {x: 1}\\nmore: {<<: *b, y: 2}")
        {'lr': 0.0003, 'max_time': '1:30', 'base': {'x': 1}, 'more': {'x': 1, 'y': 2}}
    """
    return yaml.load(text, Loader=SafeLoader)  # noqa: S506 - a SafeLoader subclass


def problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: ``line 4, column 6: expected ',' or ']', but got ':' (while
    parsing a flow sequence started at line 3, column 15).``

    Examples:
        >>> try:
        ...     load("a: 1\\na: 2")
        ... except yaml.YAMLError as exc:
        ...     print(problem(exc))
        line 2, column 1: the key 'a' is given twice (while reading a mapping started at line 1, column 1).
    """
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    what, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if not what:
        return " ".join(str(exc).split())
    text = f"{at(mark)}: {what}" if mark is not None else what
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        text += f" ({context}" + (f" started at {at(context_mark)})" if context_mark is not None else ")")
    return text + "."
