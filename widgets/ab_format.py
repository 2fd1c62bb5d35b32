"""The A/B lab's plain helpers: a token's text made visible, KL, percentages and MiB as text,
the colour of a token by how much A and B disagree there (its heat, its character format),
and a comparison's summary, divergence and per-token tooltip in words. They read the
report's JSON-like dicts (see :mod:`widgets.ab_view`); only colours and formats are Qt's."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import Any

from PySide6.QtGui import QColor, QFont, QTextCharFormat

SIDES = ("a", "b")
COLOUR_BY = ("KL(A‖B)", "A's probability of this token", "none")
#: KL is coloured on a log scale between these (nats): below the low end a token is left
#: plain, so the eye goes to the few tokens that matter rather than to rounding noise.
KL_LOW, KL_HIGH = 1e-4, 1.0
MIB = 1024 * 1024
ACCENT = "#4e9af1"
YELLOW, RED = (250, 210, 60), (230, 50, 40)


def visible(piece: str) -> str:
    """A token's text with whitespace made visible, so ``' the'`` and ``'the'`` differ in a
    tooltip: spaces as ``·``, newlines as ``⏎``, tabs as ``⇥``, other control characters
    escaped; an empty piece (part of a character still to come) as ``∅``."""
    if not piece:
        return "∅"
    marks = {" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"}
    return "".join(
        marks.get(ch, ch if ch.isprintable() else ch.encode("unicode_escape").decode())
        for ch in piece
    )


def format_kl(value: float | None) -> str:
    """KL in nats to 3 significant digits (``0.0123``, ``3.1e-07``); ``–`` when unknown
    (``None``, or NaN: a figure over no tokens)."""
    if value is None or math.isnan(value):
        return "–"
    return "0" if value == 0 else f"{value:.3g}"


def format_pct(value: float | None) -> str:
    """A probability or a rate as a percentage; small ones keep two significant digits."""
    if value is None or math.isnan(value):
        return "–"
    pct = 100.0 * value
    return f"{pct:.1f}%" if pct == 0 or abs(pct) >= 0.1 else f"{pct:.2g}%"


def format_mib(nbytes: float | None) -> str:
    return "–" if nbytes is None else f"{nbytes / MIB:.1f} MiB"


def kl_level(kl: float | None) -> float:
    """0…1 on a log scale from :data:`KL_LOW` to :data:`KL_HIGH` nats (0 below, 1 above)."""
    if kl is None or not kl > KL_LOW:
        return 0.0
    return min(1.0, math.log(kl / KL_LOW) / math.log(KL_HIGH / KL_LOW))


def probability_level(p: float | None) -> float:
    """0…1, linear: a token A was sure of (p = 1) is plain, an unlikely one (p → 0) red."""
    if p is None:
        return 0.0
    return min(1.0, max(0.0, 1.0 - p))


def heat_colour(level: float) -> QColor | None:
    """The background for a level in 0…1: none at 0, then a faint yellow that thickens and
    turns red. Lightness falls steadily along the ramp, so it reads in order in greyscale
    too; ``None`` means no colour at all (most tokens, most of the time)."""
    if not level > 0:
        return None
    level = min(level, 1.0)
    if level <= 0.5:
        return QColor(*YELLOW, int(40 + 170 * level / 0.5))
    t = (level - 0.5) / 0.5
    r, g, b = (round(y + (r_ - y) * t) for y, r_ in zip(YELLOW, RED, strict=True))
    return QColor(r, g, b, 210)


def token_level(figures: dict[str, Any], index: int, colour_by: int) -> float:
    """How strongly token ``index`` of a column (its ``figures``) is coloured, 0…1, by the
    :data:`COLOUR_BY` choice at ``colour_by``."""
    if colour_by == 0:
        return kl_level(_at(figures.get("kl"), index))
    if colour_by == 1:
        return probability_level(_at(figures.get("p_a"), index))
    return 0.0


def token_format(level: float, divergent: bool = False) -> QTextCharFormat:
    """A token's character format: the background :func:`heat_colour` gives its ``level``
    (dark text on a strong one), bold and underlined where the texts first diverge."""
    fmt = QTextCharFormat()
    colour = heat_colour(level)
    if colour is not None:
        fmt.setBackground(colour)
        if level > 0.3:  # light text on a strong yellow or red does not read
            fmt.setForeground(QColor(20, 20, 24))
    if divergent:
        fmt.setFontWeight(QFont.Weight.Bold)
        fmt.setFontUnderline(True)
        fmt.setUnderlineColor(QColor(ACCENT))
    return fmt


def marker_format() -> QTextCharFormat:
    """The divergence marker's format: bold, in the accent colour."""
    fmt = QTextCharFormat()
    fmt.setForeground(QColor(ACCENT))
    fmt.setFontWeight(QFont.Weight.Bold)
    return fmt


def quant_format(precision: str) -> str | None:
    """The weight format a layer scan quantizes blocks to, from a precision: ``int4-g32+head``
    (or ``+head8``) → ``int4-g32``, ``int8`` → ``int8``, ``w8a8`` → ``w8a8``; ``None`` for one
    that is not a single format a block can take alone (``fp32``, ``bf16``, a mixed spec,
    ``w8a8-sq``, whose smoothing is folded across blocks)."""
    match = re.fullmatch(r"(int8|int4-g\d+|w8a8)(\+head8?)?", precision.strip())
    return match.group(1) if match else None


def _escape(text: str) -> str:
    """Text for a rich-text tooltip (quotes stay quotes: they are not inside a tag)."""
    return html.escape(text, quote=False)


def _at(values: Sequence[Any] | None, index: int) -> Any:
    """``values[index]``, or ``None`` where the list is missing or short (a report cut off by
    a cancel may lack the last token's figures)."""
    return values[index] if values is not None and 0 <= index < len(values) else None


def _side_stats(side: dict[str, Any]) -> str:
    parts = []
    if side.get("ttft_s") is not None:
        parts.append(f"TTFT {1000 * side['ttft_s']:.0f} ms")
    if side.get("tokens_per_s") is not None:
        parts.append(f"{side['tokens_per_s']:.1f} tok/s")
    if side.get("remote"):  # what a client sees of a server: its clock, not its memory
        parts.append("client clock; weights and KV not seen from here")
    else:
        parts.append(f"weights {format_mib(side.get('weights_bytes'))}")
        parts.append(f"KV {format_mib(side.get('kv_bytes'))}")
    if side.get("finish_reason"):
        parts.append(f"finish: {side['finish_reason']}")
    return " · ".join(parts)


def divergence_text(divergence: dict[str, Any]) -> str:
    """What the first divergence means under vLLM's rule (its ``check_logprobs_close``: where
    two outputs first differ, each model's token must be in the other's top-N, or the models
    really behave differently; after that point the texts are not compared any more)."""
    index = divergence.get("index")
    if index is None:
        return "A and B chose the same token at every position both reached."
    n = divergence.get("top_n", 5)

    def said(flag: bool | None) -> str:
        return "unknown" if flag is None else ("yes" if flag else "no")

    def chose(name: str, token: str | None) -> str:
        return f"{name} had stopped" if token is None else f"{name} chose '{visible(token)}'"

    a_in_b, b_in_a = divergence.get("a_in_b_top"), divergence.get("b_in_a_top")
    lines = [
        f"First divergence at token {index}: {chose('A', divergence.get('a_token'))}, "
        f"{chose('B', divergence.get('b_token'))}.",
        f"A's token in B's top-{n}: {said(a_in_b)}; B's token in A's top-{n}: {said(b_in_a)}.",
    ]
    if a_in_b and b_in_a:
        lines.append(
            "vLLM's rule passes: each choice is among the other's top candidates, a near tie "
            "that sent the texts apart rather than a real change in behaviour."
        )
    elif a_in_b is None or b_in_a is None:
        lines.append("vLLM's rule cannot be checked here (top candidates missing).")
    else:
        lines.append(
            "vLLM's rule fails: one model's choice is outside the other's top candidates, a real "
            "difference in behaviour."
        )
    return "\n".join(lines)


SUMMARY_TIP = (
    "KLD: KL(A‖B) of the next-token distributions, in nats. RMS Δp: root mean square of "
    "p_A − p_B for the tokens of the text. Top-1 agreement: how often both would pick the "
    "same next token. Noise floor: A against a second run of A, what counts as no "
    "difference. Acceptance: how often B's drafts pass A's check in speculative decoding"
)
SPECULATION_TIP = (
    "Acceptance, predicted: from the two models' next-token distributions along A's answer: "
    "for greedy A, how often B's likeliest token is A's (top-1 agreement); for sampling, "
    "Σ min(p_A, p_B) = 1 − TV(p_A, p_B), the chance that rejection sampling keeps B's "
    "draft.\nMeasured: A answered once more, same prompt, sampling and seed, by "
    "speculative decoding with B's model drafting k tokens at every step: accepted drafts "
    "over accepted drafts plus rejections, the same figure as the prediction (vLLM's "
    "acceptance rate, accepted over drafted tokens, also counts the drafts a rejection "
    "leaves unchecked). Mean acceptance length: tokens per verified step, A's own included; "
    "predicted: what the predicted acceptance gives for the same drafts."
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _length(value: Any) -> str:
    number = _number(value)
    return "–" if number is None else f"{number:.2f}"


def measured_text(spec: dict[str, Any]) -> str:
    """The measured acceptance, for beside the predicted one (empty when not attempted)."""
    measured = spec.get("measured")
    if not isinstance(measured, dict):
        reason = spec.get("not_measured")
        return f"not measured: {reason}" if reason else ""
    mode = measured.get("mode", "?")
    text = (
        f"measured {format_pct(_number(measured.get('token_acceptance')))} ({mode}, "
        f"k={measured.get('k', '?')}: mean acceptance length "
        f"{_length(measured.get('mean_acceptance_length'))}, predicted "
        f"{_length(measured.get('predicted_mean_acceptance_length'))})"
    )
    if mode == "greedy" and measured.get("matches_a") is False:
        text += f", output differs from A's at token {measured.get('first_difference')}"
    return text


def speculation_tip(spec: dict[str, Any]) -> str:
    """:data:`SPECULATION_TIP` and this run's measured details (or why there are none)."""
    measured = spec.get("measured")
    if not isinstance(measured, dict):
        reason = spec.get("not_measured")
        return f"{SPECULATION_TIP}\n\nNot measured: {reason}" if reason else SPECULATION_TIP
    per_pos = measured.get("acceptance_per_pos")
    positions = (
        ", ".join(format_pct(_number(v)) for v in per_pos) if isinstance(per_pos, list) else "–"
    )
    matches = measured.get("matches_a")
    lines = [
        f"This run: {measured.get('accepted_tokens', '?')} of "
        f"{measured.get('draft_tokens', '?')} drafted tokens accepted "
        f"({format_pct(_number(measured.get('acceptance_rate')))}, vLLM's acceptance rate); "
        f"by draft position: {positions}.",
        "Output equals A's: " + ("unknown" if matches is None else "yes" if matches else "no")
        + (" (sampling: the same distribution, other draws)"
           if matches is False and measured.get("mode") == "sampling" else ""),
    ]  # fmt: skip
    return f"{SPECULATION_TIP}\n\n" + "\n".join(lines)


def summary_line(summary: dict[str, Any], divergence: dict[str, Any] | None = None) -> str:
    """The comparison in one line (KL in nats; "≥" where a server's top-k bounds it)."""
    spec = summary.get("speculative")
    spec = spec if isinstance(spec, dict) else {}
    if summary.get("text_only"):
        at = (divergence or {}).get("char_index")
        where = "the same text" if at is None else f"they part at character {at}"
        return f"compared as text (the tokenizers differ): {where}"
    measured = measured_text(spec)
    noise = summary.get("noise_kl_mean")
    bound = "≥ " if "outside_a_mean" in summary else ""  # a server's: a lower bound
    sampled = format_pct(spec.get("sampling_acceptance"))
    if spec.get("sampling_acceptance_high") is not None:
        sampled += f"–{format_pct(spec['sampling_acceptance_high'])}"
    parts = [
        f"{summary.get('tokens', 0)} tokens: mean KLD {bound}"
        f"{format_kl(summary.get('kl_mean'))} nats",
        f"p99 KLD {bound}{format_kl(summary.get('kl_p99'))}",
        f"RMS Δp {format_pct(summary.get('rms_dp'))}",
        f"top-1 agreement {format_pct(summary.get('top1_agreement'))}",
        f"flips (answers differ): {'yes' if summary.get('flips') else 'no'}",
        f"noise floor (A vs A′) {format_kl(noise) if noise is not None else 'n/a'}",
        f"B drafting for A would be accepted {format_pct(spec.get('greedy_acceptance'))} "
        f"(greedy) / {sampled} (sampling)" + (f", {measured}" if measured else ""),
    ]
    if bound:
        parts.append(f"A's probability outside the top-k {format_pct(summary['outside_a_mean'])}")
    if divergence is not None and divergence.get("index") is not None:
        parts.append(f"first divergence at token {divergence['index']}")
    return " · ".join(parts)


def token_tooltip(report: dict[str, Any], column: str, index: int) -> str:
    """Token ``index`` of ``column``'s text: its KL, both models' probability of it, and
    both models' top-5 next tokens there (rich text)."""
    pieces = report[column].get("pieces", [])
    figures = report.get("columns", {}).get(column, {})
    piece = _at(pieces, index)
    lines = [
        f"<b>{column.upper()}'s token {index}</b> '{_escape(visible(piece or ''))}'",
        f"KL(A‖B) {format_kl(_at(figures.get('kl'), index))} nats · "
        f"p_A {format_pct(_at(figures.get('p_a'), index))} · "
        f"p_B {format_pct(_at(figures.get('p_b'), index))}",
    ]
    k = (report.get("bounds") or {}).get("k")
    if k:  # a server's side: the KL over its top-k, each token's rank within them
        lines[1] = lines[1].replace("KL(A‖B) ", "KL(A‖B) ≥ ", 1)
        ranks = []
        for name in ("a", "b"):
            rank = _at(figures.get(f"rank_{name}"), index)
            ranks.append(f"rank in {name.upper()} " + (f"{rank}" if rank else f"beyond {k}"))
        outside = _at(figures.get("outside_a"), index)
        lines.append(" · ".join(ranks) + f" · A's probability outside {format_pct(outside)}")
    noise = _at(figures.get("noise_kl"), index)
    if noise is not None:
        lines.append(f"noise floor (A vs A′) {format_kl(noise)} nats")
    top_a = _at(figures.get("top_a"), index) or []
    top_b = _at(figures.get("top_b"), index) or []
    rows = []
    for i in range(max(len(top_a), len(top_b))):
        cells = []
        for top in (top_a, top_b):
            if i < len(top):
                text, p = top[i]
                cells.append(f"'{_escape(visible(text))}'</td><td align=right>{format_pct(p)}")
            else:
                cells.append("</td><td>")
        rows.append("<tr><td>" + "</td><td>&nbsp;&nbsp;</td><td>".join(cells) + "</td></tr>")
    names = [report[s].get("precision", s.upper()) for s in SIDES]
    head = (
        f"<tr><th colspan=2 align=left>A top-{len(top_a)} ({_escape(names[0])})</th>"
        f"<th></th><th colspan=2 align=left>B top-{len(top_b)} ({_escape(names[1])})"
        "</th></tr>"
    )
    table = f"<table cellspacing=0 cellpadding=1>{head}{''.join(rows)}</table>"
    out = "<br>".join(lines) + table
    divergence = report.get("divergence") or {}
    if divergence.get("index") == index:
        out += "<hr>" + _escape(divergence_text(divergence)).replace("\n", "<br>")
    return out
