"""The 400 for a body pydantic could not validate: one message, naming the field at fault.

pydantic reports a field that takes one of several shapes (``content``: a string or a
list of parts; ``tool_choice``: a word or an object; ``stop``; ``prompt``) with an
error for every shape it tried, each with the shape's tag in its location:

    messages.0.content.str                              Input should be a valid string
    messages.0.content.list[ContentPart].0.text         Input should be a valid string

Answering with the first, as a 400 once did, blamed the string form for a bad part and
named ``messages.0.content.str``, which is no field. So: the tags are dropped from the
path; shapes whose own ``type`` field was another value (``tool_choice: {"type":
"function"}`` is not an ``allowed_tools`` choice) are not the one meant; of the rest,
the error deepest in the body is the one the client got closest to, and where the
shapes all stop at the field itself (``content: 5``) the message lists what it may be.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from services.gateway.errors import BadRequest

__all__ = ["validation_error"]

_PREFIX = "Input should be "
# pydantic-core's names for a union's members when they are not a bracketed or
# capitalised name (``list[str]``, ``literal['none']``, ``NamedToolChoice``): no field
# of ours is called any of these.
_PLAIN_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes", "any"})
_MISDIRECTED = frozenset({"literal_error", "union_tag_invalid"})


def validation_error(errors: Sequence[Any], content_type: str = "") -> BadRequest:
    """The 400 for a body FastAPI could not validate: the error the client got closest
    to, naming its field; a body that is not JSON, or not a JSON object, is said to be
    so (pydantic's own words for those name no field, or a character offset as if it
    were one), and a body sent as another ``content_type`` than JSON (which FastAPI does
    not parse, whatever it holds) is told which to send."""
    first = errors[0] if errors else {}
    kind = first.get("type")
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error") or "cannot be decoded"
        at = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
        where = "" if at is None else f" (at character {at})"
        return BadRequest(f"the request body is not valid JSON: {reason}{where}")
    if loc == ("body",):
        if kind == "missing":
            return BadRequest("the request body is empty: send a JSON object")
        media = content_type.split(";")[0].strip().lower()
        if media and media != "application/json" and not media.endswith("+json"):
            return BadRequest(
                f"the request body must be JSON, sent as Content-Type: application/json "
                f"(it came as {media})"
            )
        return BadRequest("the request body must be a JSON object")
    path, message = _closest(errors) if errors else ((), "invalid request")
    fields = ".".join(map(str, path))
    return BadRequest(f"{message} ({fields})" if fields else message, fields or None)


def _closest(errors: Sequence[Any]) -> tuple[tuple[Any, ...], str]:
    """The path (tags dropped) and message of the error to answer with."""
    parsed = []
    for error in errors:
        branch, path = _parse(error)
        parsed.append((branch, path, error, _names_another_type(branch, path, error)))
    misdirected = {branch for branch, _, _, other in parsed if other}
    ranked = []
    for branch, path, e, other in parsed:
        if branch is None or (branch not in misdirected and len(path) > branch[1]):
            rank = 2  # inside the shape the client sent
        elif branch in misdirected:
            if not other:
                continue  # what else is wrong with a shape not meant: beside the point
            rank = 1  # its ``type`` field: say which values it may take
        else:
            rank = 0  # the field is not of this shape at all
        ranked.append((rank, branch, path, e))
    sizes = Counter(branch for _, branch, _, _ in ranked)
    # Rank, then depth, then the shape with the fewest complaints, then pydantic's order.
    rank, _, path, best = min(ranked, key=lambda r: (-r[0], -len(r[2]), sizes[r[1]]))
    # Every shape stopped at the same place (``content: 5``): say what it may be.
    here = [_message(e) for r, _, p, e in ranked if r == rank and p == path]
    if rank < 2 and len(here) > 1 and all(m.startswith(_PREFIX) for m in here):
        shapes = dict.fromkeys(m.removeprefix(_PREFIX) for m in here)
        return path, _PREFIX + " or ".join(shapes)
    return path, _message(best)


def _names_another_type(branch: Any, path: tuple[Any, ...], error: Any) -> bool:
    """An object shape whose own ``type`` (or other fixed) field the body gave another
    value: ``{"type": "function"}`` is not an ``allowed_tools`` choice."""
    return (
        branch is not None
        and error.get("type") in _MISDIRECTED
        and len(path) == branch[1] + 1
        and isinstance(path[-1], str)  # a field of the shape, not an item of a list
    )


def _parse(error: Any) -> tuple[tuple[tuple[Any, ...], int] | None, tuple[Any, ...]]:
    """(the union shape it belongs to: its location up to the tag and the number of
    fields before the tag, or None; its path with ``body`` and the tags dropped)."""
    branch = None
    path: list[Any] = []
    for i, part in enumerate(error.get("loc", ())):
        if i == 0 and part == "body":
            continue
        if _is_tag(part):
            if branch is None:
                branch = (tuple(error["loc"][: i + 1]), len(path))
            continue
        path.append(part)
    return branch, tuple(path)


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (
        part in _PLAIN_TAGS or part[:1].isupper() or "[" in part or "-" in part
    )


def _message(error: Any) -> str:
    """pydantic's message, without the ``Value error, `` it puts before a validator's
    or the name of one of our classes."""
    if error.get("type") == "value_error" and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    if error.get("type") == "model_type":  # it names our class: say what JSON it takes
        return _PREFIX + "an object"
    return str(error.get("msg", "invalid request"))
