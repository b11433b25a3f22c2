"""Text from configs and data (prompts, source names, paths, run names, filter rules) escaped for where it
lands: a model card's Markdown body and tables, a code span, a Python string in the card's snippet, the
report's HTML, and matplotlib's text (which reads ``$...$`` as math). A card's YAML metadata is not here:
huggingface_hub's ``ModelCardData.to_yaml`` dumps it with PyYAML (quoted values, never concatenated).

Each function is total (any string in, text that stays text out) and keeps what a reader sees: the
characters shown are the ones given, only a line break becomes a space (Markdown and tables have no room
for one) and a backtick inside a code span becomes ``'`` (a code span has no escape for it)."""

from __future__ import annotations

import html
import json
import re

from ..config.secrets import scrub

# Markdown's punctuation that opens or closes a construct anywhere in a line (emphasis, links, images,
# headings, code, tables, strike-through, math on the Hub): backslash-escaped. '<', '>' and '&' become
# entities so no tag (<script>, <img onerror=...>) or entity is ever read. A list, quote or setext
# marker only counts at the start of a line, before a space: escaped there (_MD_LEADING).
_MD_SPECIAL = re.compile(r"([\\`*_\[\]#!|~$])")
_MD_LEADING = re.compile(r"^(\s*)([-+](?=\s|$)|[-=]{2,}\s*$|\d+(?=[.)](?:\s|$)))")  # '>' is an entity already
_LINE_BREAKS = re.compile(r"\r\n|[\r\n\v\f\x85\u2028\u2029]")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")


def one_line(text) -> str:
    """``text`` on one line: line breaks become spaces, other control characters go."""
    return _CONTROL.sub("", _LINE_BREAKS.sub(" ", str(text)))


def markdown(text) -> str:
    """Plain text for a Markdown body or a table cell: one line, Markdown's specials backslash-escaped,
    ``<``/``>``/``&`` as entities; credentials scrubbed first (so the redaction mark is escaped too)."""
    text = _MD_SPECIAL.sub(r"\\\1", one_line(scrub(str(text))))
    text = _MD_LEADING.sub(lambda m: m.group(1) + (m.group(2) + "\\" if m.group(2)[0].isdigit() else
                                                    "\\" + m.group(2)), text)
    return html.escape(text, quote=False)


def code_span(text) -> str:
    """The inside of a single-backtick code span in a table cell: one line, ``|`` escaped (GFM tables read
    ``\\|`` as a pipe inside code), a backtick (which would end the span) as ``'``. Inside a code span HTML
    and Markdown are literal text."""
    return one_line(scrub(str(text))).replace("`", "'").replace("|", "\\|")


def python_string(text) -> str:
    """A Python string literal in double quotes that cannot end a Markdown code fence: JSON's escapes
    (Python's too), with a backtick written ``\\u0060``."""
    return json.dumps(str(text)).replace("`", "\\u0060")


def html_text(text) -> str:
    """Text for HTML, quotes included (attribute values are safe too)."""
    return html.escape(str(text), quote=True)


def mathtext(text) -> str:
    """A matplotlib label shown as given: ``$`` escaped (matplotlib would parse ``$...$`` as math and an
    unknown command in it raises while drawing), on one line."""
    return one_line(text).replace("$", r"\$")


def escape_tree(node, escape=markdown):
    """``node`` (dicts, lists, tuples) with every string escaped by ``escape``; numbers, booleans and None
    as they are."""
    if isinstance(node, str):
        return escape(node)
    if isinstance(node, dict):
        return {k: escape_tree(v, escape) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(escape_tree(v, escape) for v in node)
    return node
