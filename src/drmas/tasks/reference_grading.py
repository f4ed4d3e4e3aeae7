"""The reference's math grader, as a choice (``task.grader: reference``; the paper recipes).

The authors' code counts a final answer right when either of two rules says so (the
DeepScaleR/rLLM grader, as the reference summary describes it; written here from that
description, not from its code):

1. ``mathd``: both answers normalised as the Hendrycks MATH grader does (``mathd_normalize``),
   then compared as text;
2. ``sympy``: both answers normalised more loosely (``sympy_normalize``), split into the
   elements of a tuple or interval (the brackets must agree), and compared element by
   element: a gold element that is an integer needs the same integer, a gold fraction that
   is not reduced needs the same fraction, and anything else is right when sympy
   simplifies the difference to 0.

Where this differs from the reference, and why:

- Parsing. The reference turns LaTeX into text and reads it with sympy's ``parse_expr``,
  which evaluates the text it is given: drmas never executes model output. Here LaTeX is
  read by ``latex2sympy`` (an ANTLR parse into sympy objects, as drmas's own grader does),
  so an answer only ``parse_expr`` would read (``sqrt(2)`` without a backslash) is no match.
- Time. The sympy rule runs behind the default grader's guards and deadline
  (``drmas.tasks.grading.refused`` and ``bounded``): a pathological answer counts as wrong
  instead of stalling a rollout.

drmas's own grader (``drmas.tasks.grading``) is stricter in ways the reference is not (an
unevaluated sum or a decimal approximation is no answer) and looser in others (any order of
a set, an equation's last side). ``tests/test_reference_grading.py`` measures both against
the labelled corpus.
"""

from __future__ import annotations

import functools
import re
from math import gcd

from drmas.tasks.grading import FALLBACK_TIMEOUT_S, bounded, braced_arguments, refused

__all__ = ["grade_answer_reference", "mathd_normalize", "sympy_normalize"]

# --------------------------------------------------------------------------------------
# Rule 1: the Hendrycks MATH normalisation, then equal text
# --------------------------------------------------------------------------------------

_UNITS_TEXT = "\\text{ "
"""Hendrycks's unit rule: everything from ``\\text{ `` (a space after the brace) on is a unit."""
_SLASH_FRACTION = re.compile(r"^(-?\d+)/(\d+)$")


def mathd_normalize(text: str) -> str:
    """``text`` as the Hendrycks MATH grader reads it: no line breaks, thin spaces,
    ``\\left``/``\\right``, degrees, dollars, trailing units or percent signs; ``tfrac`` and
    ``dfrac`` as ``frac``; a leading ``.5`` as ``0.5``; ``x = 5`` (a name of at most two
    characters) as ``5``; ``\\sqrt3`` as ``\\sqrt{3}`` and ``\\frac12`` as ``\\frac{1}{2}``;
    no spaces; ``0.5`` and ``a/b`` (integers) as fractions."""
    s = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.split(_UNITS_TEXT)[0] if _UNITS_TEXT in s else s
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = braced_arguments(s.replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    fraction = _SLASH_FRACTION.match(s)
    return f"\\frac{{{fraction.group(1)}}}{{{fraction.group(2)}}}" if fraction else s


# --------------------------------------------------------------------------------------
# Rule 2: looser normalisation, element by element, sympy
# --------------------------------------------------------------------------------------

_WHOLE_TEXT = re.compile(r"^\\text\{(.+?)\}$")
_UNIT_WORDS = re.compile(
    r"\s*\\?(?:text\{)?\s*(?:degrees?|cm|centimeters?|meters?|miles?|seconds?|minutes?|hours?|days?|weeks?"
    r"|months?|years?|foot|feet|inch(?:es)?|yards?)(?:\^[23])?\s*\}?\s*$"
)
_THOUSANDS = re.compile(r"(\d),(\d\d\d)(?=$|\D)")
_FORMATTING = re.compile(r"\\(?:text|mathbf|textbf|mathrm|boldsymbol)\{([^{}]*)\}")
"""Markup around text that LaTeX-to-text conversion drops (the reference's pylatexenc)."""
_FRACTION = re.compile(r"^\\frac\{(-?\d+)\}\{(\d+)\}$|^(-?\d+)/(\d+)$")
_INTEGER = re.compile(r"^-?\d+$")
_WHOLE_FLOAT = re.compile(r"^(-?\d+)\.0+$")


def sympy_normalize(text: str) -> str:
    """``text`` as the sympy rule reads it: an answer wholly in ``\\text{}`` unwrapped;
    dollars, percent signs, degrees and trailing unit words dropped; ``million`` and the like
    as powers of ten; ``or``/``and`` as commas; thousands separators dropped; other
    ``\\text{}``, ``\\mathbf{}`` and the like unwrapped; ``\\sqrt3`` and ``\\frac12`` braced; no
    spaces; lower case; ``5.0`` and ``080`` as ``5`` and ``80``."""
    s = text.strip()
    whole = _WHOLE_TEXT.match(s)
    s = whole.group(1) if whole else s
    for old, new in (("\\%", ""), ("\\$", ""), ("$", ""), ("%", ""), (" or ", ","), (" and ", ",")):
        s = s.replace(old, new)
    for word, power in (("million", 6), ("billion", 9), ("trillion", 12)):
        s = s.replace(f"\\text{{ {word}}}", f"*10^{power}").replace(f" {word}", f"*10^{power}")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "")
    s = _UNIT_WORDS.sub("", s)
    s = _THOUSANDS.sub(r"\1\2", s)
    s = _FORMATTING.sub(r"\1", s).replace("\\displaystyle", "").replace("\\!", "").replace(" ", "").lower()
    s = braced_arguments(s)
    s = s.replace("infinity", "\\infty").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    whole_float = _WHOLE_FLOAT.match(s)
    s = whole_float.group(1) if whole_float else s
    if _INTEGER.match(s):  # 080 -> 80, as int() reads it (without converting: a hostile answer has 8000 digits)
        sign, digits = ("-", s[1:]) if s.startswith("-") else ("", s)
        s = sign + (digits.lstrip("0") or "0")
    return s


def _elements(text: str) -> tuple[str, list[str]]:
    """(the brackets around a tuple or interval, or "", and its elements split at commas)."""
    if len(text) > 2 and text[0] in "([" and text[-1] in ")]":
        return text[0] + text[-1], [part for part in text[1:-1].split(",")]
    return "", text.split(",")


def _unreduced(text: str) -> bool:
    """A fraction of integers that is not in lowest terms (``\\frac{2}{4}``, ``6/8``)."""
    match = _FRACTION.match(text)
    if not match:
        return False
    numerator, denominator = (int(g) for g in match.groups() if g is not None)
    return denominator != 0 and gcd(numerator, denominator) > 1


def _sympy_equal(predicted: str, gold: str) -> bool:
    """Whether sympy simplifies ``gold - predicted`` to 0 (both read by ``latex2sympy``; run
    on the grader's thread, where a deadline can stop it)."""
    import sympy  # noqa: PLC0415 - sympy and ANTLR: only when this grader runs
    from latex2sympy2_extended import latex2sympy  # noqa: PLC0415

    return sympy.simplify(latex2sympy(gold) - latex2sympy(predicted)) == 0


@functools.lru_cache(maxsize=4096)
def _element_right(predicted: str, gold: str, timeout_s: float) -> bool:
    if predicted == gold:
        return True
    if _INTEGER.match(gold):
        return False  # an integer answer needs the same integer
    if _unreduced(gold):
        return False  # so does a fraction the question leaves unreduced
    if not predicted or refused(predicted) or refused(gold):
        return False
    return bounded(_sympy_equal, predicted, gold, timeout_s)


def _sympy_rule(predicted: str, gold: str, timeout_s: float) -> bool:
    truth, answer = sympy_normalize(gold), sympy_normalize(predicted)
    if not truth or not answer:
        return False
    if truth == answer:
        return True
    (gold_brackets, gold_parts), (brackets, parts) = _elements(truth), _elements(answer)
    if gold_brackets != brackets or len(gold_parts) != len(parts):
        return False
    return all(_element_right(p, g, timeout_s) for p, g in zip(parts, gold_parts, strict=True))


def grade_answer_reference(predicted: str, gold: str, timeout_s: float | None = None) -> bool:
    """Whether ``predicted`` (a final answer, unboxed) is right for ``gold`` by the
    reference's rules: ``mathd_normalize`` equal, or the sympy rule. Takes at most about
    ``timeout_s`` seconds per element (``FALLBACK_TIMEOUT_S`` when None)."""
    truth = mathd_normalize(gold)
    if truth and mathd_normalize(predicted) == truth:
        return True
    return _sympy_rule(predicted, gold, FALLBACK_TIMEOUT_S if timeout_s is None else timeout_s)
