"""Whether a final answer equals a gold answer: a fast exact path, then math-verify.

1. Both answers are cleaned (``clean_answer``: units, spacing, Unicode symbols) and
   normalised (``normalize_answer``), then compared as text, as exact rationals when both
   are plain numbers, and item by item when both are lists, sets, tuples or intervals of
   plain numbers. A number against a number is decided here either way, and most rollouts
   (GSM8K, AIME, DAPO: integer answers) never go further.
2. What is left goes, unless a guard refuses it, to math-verify (the checker of open-r1,
   TRL and veRL), which reads LaTeX into sympy and compares the mathematics: ``2\\sqrt2``
   and ``\\sqrt8``, ``3, 5`` and ``5, 3``, ``x=5, y=3`` and ``(5,3)``, ``1+2x`` and ``2x+1``.

Rules a person applies that math-verify does not (each one a reward hack otherwise):
- a number's answer must be in final form: ``37+48`` is not an answer to "What is 37 + 48?"
  (powers, roots and factorials are: ``2^{10}`` for 1024);
- a decimal approximation is not an exact answer: ``1.414`` is not ``\\sqrt2``, and
  ``0.3333333`` is not ``\\frac13`` (math-verify rounds to 6 places);
- letters after a number are units only when wrapped in ``\\text{}`` or made of words:
  math-verify drops ``t``, ``h`` and ``ab`` as units, so ``2t`` would equal ``2``;
- an equation answers with its last side (``37+48=85``), but never with a number on the
  left (``84=85``).

Safety. Model text is never evaluated: only math-verify's LaTeX extraction is used (its
expression extraction goes through sympy ``parse_expr``, which evaluates text), and
``latex2sympy`` builds sympy objects from an ANTLR parse tree (its number tokens, digits
only, become ``sympy.Number(token)``, which passes them through ``parse_expr``: the only
text that function sees, as tests/test_grader.py checks). math-verify bounds its own
time with ``signal.alarm``, which only works in the main thread; here it is off, and every
call runs on one worker thread: the caller waits at most ``timeout_s`` seconds, and a
computation past its deadline is stopped by an exception raised in the worker thread, so
a slow simplification does not go on burning a core. A deadline cannot interrupt a single
long C call (a big-integer power holds the interpreter), so guards refuse such inputs
before parsing: long, deeply nested or non-ASCII text, towers and huge powers, factorials
or binomials of big numbers, sums, products, integrals and limits.

Why a thread and not a subprocess: a call costs ~0.1 ms of hand-over instead of a process
round trip with pickled sympy objects, no process is forked from a trainer that holds
torch and Ray threads, and sympy and the ANTLR tables are loaded once per process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = [
    "FALLBACK_TIMEOUT_S",
    "answers_match",
    "bounded",
    "braced_arguments",
    "clean_answer",
    "grade_answer",
    "normalize_answer",
    "refused",
]

FALLBACK_TIMEOUT_S = 1.0
"""How long one math-verify comparison may take (parsing included) before it counts as no
match. Measured on the corpus (bench/grading.py, a loaded 2-core machine): a pair seen for
the first time takes a median 13 ms, p95 160 ms, at most 240 ms; a cached one 0.1 ms."""

# --------------------------------------------------------------------------------------
# Cleaning: what a person ignores when reading an answer
# --------------------------------------------------------------------------------------

_UNICODE_MATH = str.maketrans(
    {
        "\u2212": "-",  # minus sign
        "\u2013": "-",  # en dash, often typed as a minus
        "\u00d7": r"\times ",
        "\u00f7": r"\div ",
        "\u22c5": r"\cdot ",
        "\u00b7": r"\cdot ",
        "\u03c0": r"\pi ",
        "\u221e": r"\infty ",
        "\u221a": r"\sqrt",
        "\u2264": r"\le ",
        "\u2265": r"\ge ",
        "\u00b0": r"^\circ",
    }
)
"""Unicode symbols a model writes for LaTeX commands (``−5`` for ``-5``)."""

_SPACING = re.compile(r"(\\\\)|\\(?:[!,;: ]|q?quad(?![A-Za-z]))|~")
"""A spacing command, or a ``\\\\`` (a row break) that must stay whole: ``\\\\ `` (row break
then space) is not the ``\\ `` spacing command."""
_EMPTY_SET = re.compile(r"\\varnothing(?![A-Za-z])|\u2205")
_DELETED = re.compile(r"\\(?:displaystyle|textstyle|left|right)(?![A-Za-z])|\\[()\[\]]|\\?\$")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])")
_UNIT_WORD_SET = r"[A-Za-z][A-Za-z .\-/]*"
_TEXT_UNIT = re.compile(
    rf"(?P<value>.*?[\w}}).])\s*\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{{(?P<unit>\s*{_UNIT_WORD_SET})\}}"
    r"(?:\s*\^\s*(?:\{\s*[23]\s*\}|[23]))?\s*\.?\s*",
    re.DOTALL,
)
"""``18\\text{ dollars}``, ``5 \\text{cm}^2``: a value then a ``\\text{}`` of words."""
_WORD_UNIT = re.compile(
    r"(?P<value>[-+]?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+))\s+(?P<unit>[A-Za-z][A-Za-z .]*?)"
    r"(?:\^\{?[23]\}?)?\s*\.?\s*"
)
"""``18 dollars``: a plain number then words (each of two letters or more)."""
_TWO_LETTER_UNITS = frozenset("cm mm km kg mg ml ft in lb oz hr yd mi".split())
_MAX_UNIT_CHARS = 200
"""Longer answers keep their words (bounds the unit patterns' cost)."""
_NOT_UNITS = frozenset("and or not no to than plus minus times over except but pi sqrt root squared cubed".split())
"""Words that change what the number means (``5 or more``, ``2 pi``, ``3 squared``)."""


def _are_units(words: list[str], shortest: int, short_units: frozenset[str] = frozenset()) -> bool:
    return all(
        (len(word) >= shortest or word.lower() in short_units) and word.lower() not in _NOT_UNITS for word in words
    )


def _strip_units(text: str) -> str:
    """``text`` without trailing units, as Hendrycks' MATH grader drops ``\\text{ ...}``.

    A ``\\text{}`` after a value is a unit when it starts with a space (``\\text{ m}``) or
    its words have two letters or more (``\\text{cm}``; but ``2\\mathrm{i}`` is a complex
    number); bare words after a plain number are units when they have three letters or
    more, or are in ``_TWO_LETTER_UNITS`` (``3 ab`` is a product). None is when a word such
    as "or" or "squared" changes the number's meaning.
    """
    if len(text) > _MAX_UNIT_CHARS:
        return text
    wrapped = _TEXT_UNIT.fullmatch(text)
    if wrapped:
        unit = wrapped.group("unit")
        if _are_units(re.findall(r"[A-Za-z]+", unit), 1 if unit.startswith(" ") else 2):
            return wrapped.group("value")
    bare = _WORD_UNIT.fullmatch(text)
    if bare and _are_units(re.findall(r"[A-Za-z]+", bare.group("unit")), 3, _TWO_LETTER_UNITS):
        return bare.group("value")
    return text


def clean_answer(text: str) -> str:
    """``text`` as a person reads it: Unicode symbols as LaTeX, no spacing commands,
    ``\\left``/``\\right``, ``\\displaystyle``, ``$`` or math delimiters, no degree sign and
    no trailing units; ``\\varnothing`` as ``\\emptyset``. Whitespace stays, one space for
    any run of it (the LaTeX still parses)."""
    text = " ".join(text.translate(_UNICODE_MATH).split())
    text = _SPACING.sub(lambda match: match.group(1) or " ", text)
    text = _DELETED.sub("", text)
    text = _DEGREES.sub("", text)
    text = _EMPTY_SET.sub(r"\\emptyset ", text)
    return _strip_units(text.strip()).strip()


# --------------------------------------------------------------------------------------
# The exact path: normalised text, exact rationals
# --------------------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|textsf|texttt|mathrm|mathbf|mathit|mathsf|mathtt"
    r"|boldsymbol|bm|mbox|hbox)\s*\{"
)
_DROPPED = ("\\%", "%")
_ASSIGNMENT = re.compile(r"(?:[A-Za-z]|\\[A-Za-z]+)=([^=]+)")
_CHOICE = re.compile(r"\(([A-E])\)")
_FRAC_TWO_TOKENS = re.compile(r"\\frac(\w)(\w)")
_FRAC_BARE_NUMERATOR = re.compile(r"\\frac(\w)\{")
_FRAC_BARE_DENOMINATOR = re.compile(r"(\\frac\{[^{}]*\})(\w)")
_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_THOUSANDS = re.compile(r"[+-]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


def _unwrap_text_commands(text: str) -> str:
    """Drop ``\\text{`` and friends with their closing brace, keeping the content.

    One pass with a stack of "keep this closing brace?" flags, so nested braces inside the
    wrapper survive and the cost stays linear.
    """
    if not _TEXT_WRAPPER.search(text):
        return text
    out: list[str] = []
    keep_closing: list[bool] = []
    i = 0
    while i < len(text):
        char = text[i]
        wrapper = _TEXT_WRAPPER.match(text, i) if char == "\\" else None
        if wrapper:
            keep_closing.append(False)
            i = wrapper.end()
            continue
        if char == "\\":
            out.append(text[i : i + 2])
            i += 2
            continue
        if char == "{":
            keep_closing.append(True)
        elif char == "}" and keep_closing and not keep_closing.pop():
            i += 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


def braced_arguments(text: str) -> str:
    """``\\frac12``, ``\\frac1{2}``, ``\\frac{1}2`` as ``\\frac{1}{2}`` and ``\\sqrt2`` as
    ``\\sqrt{2}``: one-token arguments get their braces (the MATH grader's rule too)."""
    text = _FRAC_TWO_TOKENS.sub(r"\\frac{\1}{\2}", text)
    text = _FRAC_BARE_NUMERATOR.sub(r"\\frac{\1}{", text)
    text = _FRAC_BARE_DENOMINATOR.sub(r"\1{\2}", text)
    return _SQRT_BARE.sub(r"\\sqrt{\1}", text)


def normalize_answer(text: str) -> str:
    """The text two answers are compared by on the exact path.

    After ``clean_answer``: no whitespace, text and font wrappers (``\\text{}``,
    ``\\mathbf{}``...) dropped with their content kept, no trailing period, no ``%``, a
    leading single-variable assignment dropped (``x = 5`` -> ``5``), thousands separators
    of plain numbers removed, ``\\dfrac``/``\\tfrac`` as ``\\frac``, and ``\\frac12``/``\\sqrt2``
    with braces. The MATH dataset's grader (Hendrycks et al.) does much the same; unlike
    it, ``0.5`` stays as it is: numbers are compared as exact rationals afterwards.
    """
    s = _unwrap_text_commands(clean_answer(text))
    s = "".join(s.split())
    for dropped in _DROPPED:
        s = s.replace(dropped, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.removesuffix(".")
    assignment = _ASSIGNMENT.fullmatch(s)
    if assignment:
        s = assignment.group(1)
    s = braced_arguments(s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
"""ASCII digits only: Fraction would read other scripts' digits (fullwidth ８５ as 85),
which a person may not see as a different text."""
_DECIMAL = re.compile(_NUMBER)
_SLASH = re.compile(rf"({_NUMBER})/({_NUMBER})")
_LATEX_FRAC = re.compile(rf"([+-]?)\\frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}")
_MIXED = re.compile(r"([+-]?)([0-9]+)\\frac\{([0-9]+)\}\{([0-9]+)\}")
"""``1\\frac{1}{2}``: a mixed number, as MATH writes them."""
_SCIENTIFIC = re.compile(rf"({_NUMBER})(?:\\times|\\cdot)10\^(?:\{{([+-]?[0-9]{{1,3}})\}}|([0-9]))")
_MAX_NUMBER_CHARS = 100
"""Longer strings are not parsed as numbers (they can still match as text); this also
keeps clear of int()'s digit limit."""


def _ratio(numerator: str, denominator: str) -> Fraction | None:
    """numerator / denominator, or None for a zero denominator (never an exception)."""
    bottom = Fraction(denominator)
    return None if bottom == 0 else Fraction(numerator) / bottom


def _parse_rational(s: str) -> Fraction | None:
    """The exact value of a normalised number: ``-3``, ``0.25``, ``1/4``, ``-\\frac{1}{4}``,
    ``1\\frac{1}{2}``, ``1.5\\times10^{3}``.

    A whitelist of forms matched by regular expressions and built with ``Fraction``: nothing
    is evaluated, so no input can run code or take long.
    """
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    slash = _SLASH.fullmatch(s)
    if slash:
        return _ratio(slash.group(1), slash.group(2))
    frac = _LATEX_FRAC.fullmatch(s)
    if frac:
        value = _ratio(frac.group(2), frac.group(3))
        return -value if value is not None and frac.group(1) == "-" else value
    mixed = _MIXED.fullmatch(s)
    if mixed:
        part = _ratio(mixed.group(3), mixed.group(4))
        value = None if part is None else int(mixed.group(2)) + part
        return -value if value is not None and mixed.group(1) == "-" else value
    scientific = _SCIENTIFIC.fullmatch(s)
    if scientific:
        return Fraction(scientific.group(1)) * Fraction(10) ** int(scientific.group(2) or scientific.group(3))
    return None


_INFINITY = re.compile(r"([+-]?)\\infty")
_UNORDERED = ("set", "list")
_MAX_COLLECTION_CHARS = 300
_Numbers = tuple[str, tuple[Fraction | str, ...]]
"""A collection of plain numbers: its kind (``set``, ``list``, or its brackets such as
``(]``) and its items (a Fraction, or ``inf``/``-inf``)."""


def _numbers(s: str) -> _Numbers | None:
    """``3,5``, ``\\{1,2\\}``, ``(5,3)``, ``(-\\infty,2]`` as a collection of numbers; None for
    anything else (a single number included: ``_parse_rational`` reads those), and for
    more than ``_MAX_COLLECTION_CHARS`` characters."""
    if len(s) > _MAX_COLLECTION_CHARS:
        return None
    if s.startswith("\\{") and s.endswith("\\}"):
        kind, inner = "set", s[2:-2]
    elif s[:1] in "([" and s[-1:] in ")]":
        kind, inner = s[0] + s[-1], s[1:-1]
    else:
        kind, inner = "list", s
    items: list[Fraction | str] = []
    for item in inner.split(","):
        infinity = _INFINITY.fullmatch(item)
        value = ("-inf" if infinity.group(1) == "-" else "inf") if infinity else _parse_rational(item)
        if value is None:
            return None
        items.append(value)
    return (kind, tuple(items)) if len(items) >= 2 else None


def _choice(s: str) -> str:
    """A multiple-choice letter without its parentheses: ``(C)`` -> ``C``."""
    choice = _CHOICE.fullmatch(s)
    return choice.group(1) if choice else s


def _exact_verdict(pred: str, truth: str) -> bool | None:
    """The exact path on two normalised answers: True or False when it decides, None when it
    cannot (math-verify's turn). It decides equal texts (a choice ``(C)`` equals ``C``), two
    plain numbers (exact rationals) and two collections of plain numbers (unordered for
    lists and sets, ordered with the same brackets for tuples and intervals)."""
    if not pred or not truth:
        return False
    if pred == truth or _choice(pred) == _choice(truth):
        return True
    pred_value, truth_value = _parse_rational(pred), _parse_rational(truth)
    if pred_value is not None and truth_value is not None:
        return pred_value == truth_value
    pred_numbers, truth_numbers = _numbers(pred), _numbers(truth)
    if pred_numbers is None or truth_numbers is None:
        return None
    (pred_kind, pred_items), (truth_kind, truth_items) = pred_numbers, truth_numbers
    if pred_kind in _UNORDERED and truth_kind in _UNORDERED:
        return set(pred_items) == set(truth_items)
    if pred_kind in _UNORDERED or truth_kind in _UNORDERED:
        return None  # a tuple against a list: is ``(5,3)`` the point or the two roots?
    return pred_kind == truth_kind and pred_items == truth_items


def answers_match(predicted: str, gold: str) -> bool:
    """Whether the exact path alone finds ``predicted`` right for ``gold``: the same
    normalised text, the same exact rational, or the same collection of plain numbers.

    Pure and thread-safe (no signals, no global state); an empty answer never matches.
    """
    return _exact_verdict(normalize_answer(predicted), normalize_answer(gold)) is True


# --------------------------------------------------------------------------------------
# The grader: the exact path, a person's rules, then math-verify
# --------------------------------------------------------------------------------------

_UNEVALUATED = re.compile(r"(?<=[\w})\]!.])\s*[-+*/]|\\(?:times|cdot|div|pm|mp)(?![A-Za-z])")
"""A binary operation: a number's answer written as a calculation (``37+48``, ``6\\times7``)."""
_MAX_ANSWER_CHARS = 1000
"""An answer longer than this (and than twice the gold answer) is wrong without being read."""
_EQUALS = re.compile(r"(?<![<>!\\])=")
_MAX_EQUALS = 4


def _answer_side(predicted: str, gold: str) -> str | None:
    """The side of an equation that answers: ``37+48=85`` -> ``85``, ``x = 5`` -> ``5``.

    Only when the gold answer is no equation and the prediction no list (``x=5, y=3`` is
    math-verify's to read). None when a side before the last is a plain number (``84=85``),
    or for a chain of more than ``_MAX_EQUALS`` signs: that is no answer.
    """
    if "=" in gold or "," in predicted or ";" in predicted or not _EQUALS.search(predicted):
        return predicted
    if predicted.count("=") > _MAX_EQUALS:
        return None
    *before, last = _EQUALS.split(predicted)
    if any(_parse_rational(normalize_answer(side)) is not None for side in before):
        return None
    return last


def grade_answer(predicted: str, gold: str, timeout_s: float | None = None) -> bool:
    """Whether ``predicted`` is a right final answer for ``gold``: exact path, then math-verify.

    Thread-safe; takes at most about ``timeout_s`` seconds (``FALLBACK_TIMEOUT_S`` when None,
    read at call time) and microseconds when the exact path decides. The rules are in the
    module docstring.
    """
    if len(predicted) > max(_MAX_ANSWER_CHARS, 2 * len(gold)):
        return False  # not read: no answer is right at that length
    side = _answer_side(predicted, gold)
    if side is None:
        return False
    pred, truth = normalize_answer(side), normalize_answer(gold)
    verdict = _exact_verdict(pred, truth)
    if verdict is not None:
        return verdict
    if _parse_rational(truth) is not None and _UNEVALUATED.search(pred):
        return False  # a calculation, not its result
    pred_value = _parse_rational(pred)
    if pred_value is not None and pred_value.denominator != 1 and "." in pred:
        return False  # a decimal approximation of an irrational or symbolic answer
    deadline = FALLBACK_TIMEOUT_S if timeout_s is None else timeout_s
    return _math_verify_equal(clean_answer(side), clean_answer(gold), deadline)


# --------------------------------------------------------------------------------------
# The fallback: math-verify on a worker thread, behind guards
# --------------------------------------------------------------------------------------

_MAX_FALLBACK_CHARS = 300
_MAX_DEPTH = 12
_BIG_OPERATOR = re.compile(r"\\(?:sum|prod|int|iint|iiint|oint|lim|limsup|liminf|coprod|bigcup|bigcap)(?![A-Za-z])")
_INTEGER = re.compile(r"[0-9]+")
_COMBINATORIAL = re.compile(r"!|binom|choose|Gamma|\)\s*_")
"""Factorials, binomials and the ``(n)_k`` falling factorial math-verify rewrites into
factorials: evaluated in big-integer C code that no deadline interrupts."""
_MAX_COMBINATORIAL_ARGUMENT = 1000
_MAX_POWER_DIGITS = 100_000
"""Bound on (longest digit run) x (product of the integer exponents): the digits a power
could produce. ``2^{10}``: 10; ``(2^{1000})^{1000}``: 10^6, refused."""


def _exponent(text: str, caret: int) -> tuple[str, int]:
    """The argument of the ``^`` at ``caret`` and the index after it."""
    i = caret + 1
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1 : j], j + 1
        return text[i + 1 :], len(text)
    digits = _INTEGER.match(text, i)
    end = digits.end() if digits else min(i + 1, len(text))
    return text[i:end], end


def _powers_too_big(text: str) -> bool:
    """A tower (``10^{10^{10}}``, ``2^3^4``) or powers that could produce huge integers."""
    product = 1
    caret = text.find("^")
    while caret >= 0:
        argument, end = _exponent(text, caret)
        if "^" in argument or text[end : end + 1] == "^":
            return True
        product *= max((int(n) for n in _INTEGER.findall(argument)), default=1)
        if product > _MAX_POWER_DIGITS:
            return True
        caret = text.find("^", end)
    longest_digits = max((len(n) for n in _INTEGER.findall(text)), default=1)
    return product * longest_digits > _MAX_POWER_DIGITS


def refused(text: str) -> bool:
    """Whether math-verify must not see ``text``: too long, not printable ASCII, nested too
    deeply, a big operator, or a power, factorial or binomial that could stall the interpreter."""
    if len(text) > _MAX_FALLBACK_CHARS or not (text.isascii() and text.isprintable()):
        return True
    depth = 0
    for char in text:
        depth += 1 if char in "{([" else -1 if char in "})]" else 0
        if depth > _MAX_DEPTH:
            return True
    if _BIG_OPERATOR.search(text) or _powers_too_big(text):
        return True
    combinatorial = len(_COMBINATORIAL.findall(text))
    if combinatorial > 1 or (combinatorial and "^" in text):
        return True  # (5!)!, \Gamma(10^{6}): arguments that are themselves big
    return combinatorial == 1 and any(
        len(n) > 4 or int(n) > _MAX_COMBINATORIAL_ARGUMENT for n in _INTEGER.findall(text)
    )


def _math_verify_equal(predicted: str, gold: str, timeout_s: float) -> bool:
    """math-verify's verdict on two cleaned answers; False when a guard refuses either one,
    when either does not parse, or past the deadline."""
    if refused(predicted) or refused(gold):
        return False
    return bounded(_verify, predicted, gold, timeout_s)


def bounded(check: Callable[[str, str], bool], predicted: str, gold: str, timeout_s: float) -> bool:
    """``check(predicted, gold)`` on the process's grader thread, waited for at most
    ``timeout_s`` seconds (then False, and the computation is stopped); False when it
    raises. For any sympy-based comparison of model text (``drmas.tasks.reference_grading``
    too); pass its inputs through ``refused`` first."""
    return _worker().compare(predicted, gold, timeout_s, check)


class _Deadline(BaseException):
    """Raised inside the worker thread when its job is past its deadline. A BaseException,
    so that math-verify's ``except Exception`` handlers let it through."""


@dataclass(eq=False)
class _Job:
    predicted: str
    gold: str
    check: Callable[[str, str], bool]
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    result: bool = False


_RESEND_S = 0.05
"""How often the watchdog raises ``_Deadline`` again while an abandoned job still runs."""


class _Worker:
    """One daemon thread that runs math-verify jobs in turn, and a watchdog that stops a job
    its caller abandoned.

    A caller that stops waiting marks its job abandoned under the lock and wakes the
    watchdog. While the running job is an abandoned one, the watchdog raises ``_Deadline``
    in the worker thread (PyThreadState_SetAsyncExc) every ``_RESEND_S`` seconds, which stops
    it at its next bytecode. Once is not always enough: when the exception lands in a
    weakref callback that the garbage collector runs on the worker thread (SQLAlchemy's, in
    a process that also tracks runs), Python reports it as unraisable and drops it, and the
    job would go on for minutes while every later job waits behind it.

    The worker marks a job running and finished under the same lock, so no job that is not
    abandoned is ever hit. A ``_Deadline`` that cuts the worker's own bookkeeping short is
    caught in ``_serve``, which clears the running job before taking the next one.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: _Job | None = None
        self._abandoned_running = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="drmas-grader", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watch, name="drmas-grader-watchdog", daemon=True).start()

    def compare(self, predicted: str, gold: str, timeout_s: float, check: Callable[[str, str], bool]) -> bool:
        job = _Job(predicted, gold, check)
        self._jobs.put(job)
        if job.done.wait(timeout_s):
            return job.result
        with self._lock:
            job.abandoned = True
            if self._running is job:
                self._abandoned_running.set()
        return job.done.is_set() and job.result

    def _watch(self) -> None:
        while True:
            self._abandoned_running.wait()
            with self._lock:
                running = self._running
                if running is None or not running.abandoned:
                    self._abandoned_running.clear()
                    continue
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(_Deadline)
                )
            time.sleep(_RESEND_S)

    def _serve(self) -> None:
        while True:
            try:
                with self._lock:
                    self._running = None
                while True:
                    self._run_next()
            except _Deadline:
                continue

    def _run_next(self) -> None:
        job = self._jobs.get()
        with self._lock:
            if job.abandoned:
                return
            self._running = job
        try:
            job.result = job.check(job.predicted, job.gold)
        except (_Deadline, Exception):  # past its deadline, or math-verify failed on this input
            job.result = False
        finally:
            with self._lock:
                self._running = None
            job.done.set()


_worker_lock = threading.Lock()
_the_worker: _Worker | None = None


def _forget_worker() -> None:
    """In a forked child: the worker thread did not come along (nor, maybe, a free lock)."""
    global _worker_lock, _the_worker
    _worker_lock, _the_worker = threading.Lock(), None


os.register_at_fork(after_in_child=_forget_worker)


def _worker() -> _Worker:
    """The process's worker, started on first use. math-verify is imported here, in the
    caller's thread, so that the import (about a second) never counts against a deadline."""
    global _the_worker
    with _worker_lock:
        if _the_worker is None:
            import math_verify  # noqa: F401, PLC0415  (sympy and ANTLR: only when a fallback is needed)

            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).addFilter(_drop_timeout_warning)
            _verify(r"\frac{x}{2}+\sqrt{3}", r"\frac{3}{\sqrt{3}}+\frac{x}{2}")  # warm-up, outside any deadline
            quiet_dropped_deadlines()
            _the_worker = _Worker()
        return _the_worker


def start_in_background() -> None:
    """Start the process's worker now, on a thread of its own: a stage that will grade (a
    rollout, an evaluation) then imports math-verify (about a second) while its first
    generations run in the pool, instead of after them. In a Kubeflow task, a fresh process
    per stage, that second was paid on every rollout. Does nothing once the worker runs."""
    if _the_worker is None:
        threading.Thread(target=_worker, name="drmas-grader-start", daemon=True).start()


def quiet_dropped_deadlines() -> None:
    """Keep a dropped ``_Deadline`` out of ``sys.unraisablehook``; report anything else.

    When the watchdog's exception lands in a garbage-collector or weakref callback on the
    worker thread, Python drops it and reports it as unraisable. That is expected (the
    watchdog raises it again), but the default hook prints a traceback, and pytest's turns it
    into an error of whichever test is running. The hook in place when this is called (the
    default, or pytest's) is wrapped once and still receives every other unraisable."""
    previous = sys.unraisablehook
    if getattr(previous, "_drmas_quiet_deadlines", False):
        return

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, _Deadline):
            previous(unraisable)

    hook._drmas_quiet_deadlines = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _drop_timeout_warning(record: logging.LogRecord) -> bool:
    """math-verify warns once that its timeouts are off: this module bounds the time."""
    return "Timeout is disabled" not in record.getMessage()


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple[Any, ...]:
    """math-verify's reading of one cleaned answer, with LaTeX extraction only and its
    units rule off (``_strip_units`` does that part). Cached: gold answers repeat over a
    group's samples, and so do the samples' answers."""
    from latex2sympy2_extended.latex2sympy2 import NormalizationConfig  # noqa: PLC0415
    from math_verify import LatexExtractionConfig, parse  # noqa: PLC0415

    config = LatexExtractionConfig(
        try_extract_without_anchor=False,
        boxed_match_priority=0,
        normalization_config=NormalizationConfig(
            basic_latex=True, units=False, malformed_operators=True, nits=True, boxed="all", equations=False
        ),
    )
    return tuple(parse(f"\\boxed{{{text}}}", [config], fallback_mode="no_fallback", parsing_timeout=None))


@functools.lru_cache(maxsize=4096)
def _verify(predicted: str, gold: str) -> bool:
    """math-verify's comparison, run on the worker thread only (its timeout off)."""
    from math_verify import verify  # noqa: PLC0415

    gold_parsed, predicted_parsed = _parsed(gold), _parsed(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(list(gold_parsed), list(predicted_parsed), allow_set_relation_comp=True, timeout_seconds=None))
