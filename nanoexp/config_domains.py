"""What a key of the schema says about itself, and the checks of each key on its own. A field of nanoexp/config.py
is written with `key(default, domain, counts)`: its domain (a number's range, or the strings allowed) and when the
run reads it. Walking a composed config along the schema, each key must be one the schema knows (a key added with
Hydra's `+` is not checked by the schema), be set, hold a value of its domain (every number of the right type and
finite), and, where the run does not read it, stay at its default: nothing typed is silently ignored. Rules across
keys, and keys whose values are a registry's names, are nanoexp/validation.py's."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import typing
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

from omegaconf import MISSING, DictConfig, OmegaConf

Rule = tuple[bool, str]   # (condition, the message shown when it does not hold)


class Domain(NamedTuple):
    """A numeric key's allowed values; null passes where the schema types the key Optional."""
    ok: Callable[[Any], bool]
    allowed: str          # in words: "positive", ">= 0", "in [0, 1)"
    note: str = ""        # what a boundary value or null means, shown in parentheses
    item: str = "value"   # for a list: what its message calls an entry


class Counts(NamedTuple):
    """When the run reads a key: `when(cfg)`, and in words what would make it count."""
    when: Callable[[Any], bool]
    needs: str


def key(default: Any = MISSING, domain: Union[Domain, tuple, None] = None, counts: Optional[Counts] = None) -> Any:
    """A field of the schema: its default (a list's copied for each config), its domain (a Domain for a number,
    the allowed strings for a string) and when it counts (None: always)."""
    metadata = {"domain": domain, "counts": counts}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def at_least(low: int, note: str = "") -> Domain:
    return Domain(lambda value: value >= low, f">= {low}", note)


def positive(note: str = "") -> Domain:
    return Domain(lambda value: value > 0, "positive", note)


def between(low: float, high: float, allowed: str, note: str = "seconds") -> Domain:
    return Domain(lambda value: low <= value <= high, allowed, note)


SIZE = Domain(lambda value: value > 0, "a positive integer")
FRACTION = Domain(lambda value: 0 <= value < 1, "in [0, 1)")
# general.seed * 1_000_003 seeds torch's generators (nanoexp/model/init.py) and must fit in 64 bits; 2**32 keeps
# it well inside and is the usual range of a seed.
SEED = Domain(lambda seed: 0 <= seed < 2 ** 32, "in [0, 2**32)")
# time.sleep raises OverflowError from about 1e10 s; an hour is slower than any host or stall to imitate.
SLEEP = between(0, 3600, "between 0 and 3600")
RANK = at_least(0, "null: off")


def schema_rules(cfg: Any, schema: type) -> list[Rule]:
    """One rule per key of `cfg`: known to the schema, set, and in its domain."""
    return [key_rule(name, field, hint, value, schema) for name, field, hint, value in walk(cfg, schema)]


def effect_rules(cfg: Any, schema: type) -> list[Rule]:
    """One rule per key that differs from its default where the run does not read it (its `counts`)."""
    rules = []
    for name, field, _, value in walk(cfg, schema):
        counts = field.metadata.get("counts") if field else None
        if counts is None or counts.when(cfg):
            continue
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        rules.append((plain(value) == default, f"{name}={plain(value)} has no effect here: it counts with "
                      f"{counts.needs}; set that, or leave {name} at {default}"))
    return rules


def walk(node: Any, schema: type, prefix: str = "") -> Iterator[tuple[str, Optional[dataclasses.Field], Any, Any]]:
    """(key, its field, its type, value) of every leaf of config `node`, along the dataclass `schema`; the field
    is None for a key the schema does not know, the value MISSING for one not set (???)."""
    fields, types = {field.name: field for field in dataclasses.fields(schema)}, field_types(schema)
    for name in node:
        key_name, field, hint = f"{prefix}{name}", fields.get(name), types.get(name)
        if field is None or OmegaConf.is_missing(node, name):
            yield key_name, field, hint, MISSING
            continue
        value, inner = node[name], unwrap(hint)[0]
        if dataclasses.is_dataclass(inner) and isinstance(value, DictConfig):
            yield from walk(value, inner, key_name + ".")
        elif dataclasses.is_dataclass(element(inner)) and value is not None:
            for i, item in enumerate(value):
                yield from walk(item, element(inner), f"{key_name}[{i}].")
        else:
            yield key_name, field, hint, value


def key_rule(name: str, field: Optional[dataclasses.Field], hint: Any, value: Any, schema: type) -> Rule:
    if field is None:
        return False, unknown_key(name, schema)
    if value is MISSING:
        return False, f"{name}=???: must be set (it has no default)"
    domain = field.metadata.get("domain")
    if type(domain) is tuple:   # the strings allowed (a Domain is a tuple too)
        return value in domain, f"{name}={value}: allowed values are {', '.join(map(str, domain))}"
    number, optional = unwrap(hint)
    is_list = typing.get_origin(number) is list
    number = element(number) if is_list else number
    if number not in (int, float):
        return True, ""
    return number_rule(name, domain, number, is_list, optional, value)


def number_rule(name: str, domain: Domain, number: type, is_list: bool, optional: bool, value: Any) -> Rule:
    """The rule of a numeric key (a list's: of each entry) from its domain: the type, finite, the range."""
    allowed = domain.allowed + (" or null" if optional else "") + (f" ({domain.note})" if domain.note else "")
    if value is None:   # only a config the schema does not type (a checkpoint's) holds null in a non-Optional key
        return optional, f"{name}=None: must be {allowed}"
    values = list(value) if is_list else [value]
    wrong_type = [v for v in values if isinstance(v, bool) or not isinstance(v, int if number is int else (int, float))]
    nonfinite = [v for v in values if isinstance(v, float) and not math.isfinite(v)]
    if not wrong_type and not nonfinite and all(domain.ok(v) for v in values):
        return True, ""
    must = requirement(number, wrong_type, nonfinite)
    if is_list:
        return False, f"{name}={values}: every {domain.item} must be {must}{domain.allowed}"
    return False, f"{name}={value}: must be {must}{allowed}"


def requirement(number: type, wrong_type: list, nonfinite: list) -> str:
    """What a value failed before its range: its type (in a config the schema does not type), or being finite."""
    if wrong_type:
        return "an integer, " if number is int else "a number, "
    return "finite and " if nonfinite else ""


def unknown_key(name: str, schema: type) -> str:
    """The message for a key the schema does not know, with the nearest known key (in the same stage)."""
    if name == "plan":   # +plan=topK is a sweep's (hydra_plugins/nanoexp_sweeper.py)
        return "plan: +plan=topK runs the planner's top K layouts as a sweep: add -m (python train.py -m +plan=top4)"
    stage = re.match(r"data_stages\[\d+\]", name)
    nearest = difflib.get_close_matches(re.sub(r"\[\d+\]", "[]", name), schema_keys(schema), n=1)
    if not nearest:
        return f"{name}: not a key of nanoexp's config: remove it (nanoexp/config.py lists the keys)"
    suggestion = nearest[0].replace("data_stages[]", stage.group(0)) if stage else nearest[0]
    return f"{name}: not a key of nanoexp's config (did you mean {suggestion}?)"


@functools.cache
def schema_keys(schema: type, prefix: str = "") -> tuple[str, ...]:
    """Every key of the schema, dotted, with data_stages[] for a stage's."""
    keys: list[str] = []
    for name, hint in field_types(schema).items():
        dotted, inner = prefix + name, unwrap(hint)[0]
        keys.append(dotted)
        if dataclasses.is_dataclass(inner):
            keys += schema_keys(inner, dotted + ".")
        elif dataclasses.is_dataclass(element(inner)):
            keys += schema_keys(element(inner), dotted + "[].")
    return tuple(keys)


@functools.cache
def field_types(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type inside Optional, whether null is allowed)."""
    if typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return inner[0], len(inner) < len(typing.get_args(hint))
    return hint, False


def element(hint: Any) -> Optional[Any]:
    """A List[X]'s X (None for any other type)."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is list else None


def plain(value: Any) -> Any:
    """A config value comparable with ==: lists and dicts as Python's."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
