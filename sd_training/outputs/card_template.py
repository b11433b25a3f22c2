"""A model card template (``experiment.model_card_template``) rendered in Jinja2's immutable sandbox.

A template may come with a config someone shared: it sees the card's variables and nothing else. The
sandbox refuses attributes that reach Python's internals (``cycler.__init__.__globals__``, ``__class__``,
``mro``...) and calls that change an object; the environment's globals (``cycler``, ``joiner``,
``namespace``, ``lipsum``) are removed, only ``range`` (bounded by the sandbox) is kept; the loader holds
the template alone (no ``include``/``import``/``extends`` of another file); ``*`` and ``**`` are bounded
so ``'x' * 10**12`` is an error, not an out-of-memory kill. Any refusal is a ConfigError naming the file,
the line and the expression, raised at start-up (``check_template``), before the run trains.
"""

from __future__ import annotations

import operator
import sys
from pathlib import Path

from ..config import ConfigError

MAX_PRODUCT = 1_000_000  # items (characters) a template's '*' may make
MAX_EXPONENT = 256  # the largest exponent a template's '**' may use


def _bounded_binop(op: str, left, right):
    """``left op right`` for the intercepted ``*`` and ``**``, refused beyond the bounds."""
    from jinja2.exceptions import SecurityError

    if op == "**":
        if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"an exponent of {right} is over the template's bound of {MAX_EXPONENT}")
        return operator.pow(left, right)
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_PRODUCT:
            raise SecurityError(f"a sequence of {len(seq) * times:,} items is over the template's bound of "
                                f"{MAX_PRODUCT:,}")
    return operator.mul(left, right)


def environment(name: str, source: str):
    """The sandboxed environment holding one template, ``name``, read from ``source``."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class CardEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, op, left, right):
            return _bounded_binop(op, left, right)

    env = CardEnvironment(loader=jinja2.DictLoader({name: source}), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals = {"range": env.globals["range"]}
    return env


def render(template: Path, variables: dict, key: str) -> str:
    """``template`` rendered with ``variables`` (already escaped for where they land); a ConfigError naming
    ``key``, the file, the line and its text for any problem."""
    import jinja2

    try:
        source = template.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"'{key}': the model card template {template} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"'{key}': the model card template {template} cannot be read: {e}") from None
    try:
        return environment(template.name, source).get_template(template.name).render(**variables)
    except jinja2.TemplateNotFound as e:  # an include/import/extends: the card's template stands alone
        raise ConfigError(f"'{key}': the model card template {template}{_where(template, source)} names another "
                          f"template ({e.name}): a card template cannot include, import or extend a file") from None
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"'{key}': the model card template {template}, line {e.lineno}: {e.message}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ConfigError(f"'{key}': the model card template {template}{_where(template, source)} does what a card "
                          f"template may not ({e}): it sees the card's variables only (see the default template, "
                          "sd_training/outputs/templates/model_card.md)") from None
    except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, ArithmeticError,
            RecursionError) as e:
        raise ConfigError(f"'{key}': the model card template {template}{_where(template, source)} does not "
                          f"render: {type(e).__name__}: {e}") from None


def _where(template: Path, source: str) -> str:
    """', line N: <its text>' of the exception being handled (Jinja2 rewrites tracebacks to the template)."""
    tb, line = sys.exc_info()[2], None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in (str(template), template.name, "<template>"):
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return ""
    lines = source.splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return f", line {line}" + (f": {text[:200]}" if text else "")
