"""The runtime benchmark's report: its picture (p99 against offered rate, one panel per arrival
shape, every server's measured trials at its chosen setting, all repeats, the SLO line, and each
server's median goodput marked on it; plain SVG, no plotting library) and its table (markdown).

    .venv/bin/python bench/runtime_bench_report.py bench/results/runtime.json
    # writes runtime.svg beside the JSON and prints the table
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

COLORS = {
    "batchpilot": "#d62728",
    "batchpilot_b1": "#ff9896",
    "mlserver": "#1f77b4",
    "ray": "#2ca02c",
    "bentoml": "#9467bd",
}
PANEL_W, PANEL_H, PAD_L, PAD_B, PAD_T, PAD_R = 430, 300, 56, 40, 30, 14
Y_MIN, Y_MAX = 2.0, 2000.0  # ms; a failed trial (no p99) is drawn at the top


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _panel(shape: str, result: dict[str, Any], ox: float, oy: float) -> list[str]:
    runs = [r for r in result["runs"] if r["shape"] == shape and r.get("phase") == "measure" and "trials" in r]
    rates = [t["rate"] for r in runs for t in r["trials"]] or [1.0, 10.0]
    x_lo = 10 ** math.floor(math.log10(min(rates)))
    x_hi = 10 ** math.ceil(math.log10(max(rates)))
    w, h = PANEL_W - PAD_L - PAD_R, PANEL_H - PAD_T - PAD_B

    def x(v: float) -> float:
        return ox + PAD_L + w * (math.log10(v) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))

    def y(v: float | str | None) -> float:
        v = Y_MAX if not isinstance(v, int | float) else min(max(float(v), Y_MIN), Y_MAX)
        return oy + PAD_T + h * (1 - (math.log10(v) - math.log10(Y_MIN)) / (math.log10(Y_MAX) - math.log10(Y_MIN)))

    out = [
        f'<rect x="{ox + PAD_L}" y="{oy + PAD_T}" width="{w}" height="{h}" fill="none" stroke="#999"/>',
        f'<text x="{ox + PAD_L + w / 2}" y="{oy + 18}" text-anchor="middle" font-weight="bold">{_esc(shape)}</text>',
        f'<text x="{ox + PAD_L + w / 2}" y="{oy + PANEL_H - 6}" text-anchor="middle">offered rate (req/s)</text>',
        f'<text x="{ox + 14}" y="{oy + PAD_T + h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 {ox + 14} {oy + PAD_T + h / 2})">p99 (ms)</text>',
    ]
    decade = x_lo
    while decade <= x_hi:
        for k in (1, 2, 5):
            v = decade * k
            if x_lo <= v <= x_hi:
                out.append(f'<line x1="{x(v):.1f}" y1="{oy + PAD_T + h}" x2="{x(v):.1f}" y2="{oy + PAD_T + h + 4}" '
                           'stroke="#999"/>')  # fmt: skip
                out.append(f'<text x="{x(v):.1f}" y="{oy + PAD_T + h + 16}" text-anchor="middle" '
                           f'font-size="10">{v:g}</text>')  # fmt: skip
        decade *= 10
    for v in (2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000):
        out.append(f'<text x="{ox + PAD_L - 4}" y="{y(v) + 3:.1f}" text-anchor="end" font-size="10">{v}</text>')
    slo = result["slo"]["p99_ms"]
    out.append(f'<line x1="{ox + PAD_L}" y1="{y(slo):.1f}" x2="{ox + PAD_L + w}" y2="{y(slo):.1f}" '
               'stroke="#333" stroke-dasharray="5,4"/>')  # fmt: skip
    table = result.get("summary", {}).get("shapes", {}).get(shape, {}).get("contenders", {})
    legend_y = oy + PAD_T + 12
    for name, color in COLORS.items():
        # a trial with failures has p99 "inf" (drawn at the top)
        pts = sorted(
            ((t["rate"], t["slo_p99_ms"]) for r in runs if r["contender"] == name for t in r["trials"]),
            key=lambda p: p[0],
        )
        if not pts:
            continue
        path = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.2" opacity="0.6"/>')
        for a, b in pts:
            out.append(f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="2.6" fill="{color}"/>')
        good = table.get(name, {}).get("goodput_rps", {}).get("median")
        if good:
            gx = x(good)
            out.append(f'<path d="M{gx:.1f},{y(slo) - 9:.1f} l-5,-8 h10 z" fill="{color}"/>')
        label = f"{name}: {good:g} req/s" if good else f"{name}: none"
        out.append(f'<text x="{ox + PAD_L + w - 6}" y="{legend_y}" text-anchor="end" font-size="11" '
                   f'fill="{color}">{_esc(label)}</text>')  # fmt: skip
        legend_y += 13
    return out


def write_svg(result: dict[str, Any], path: Path) -> None:
    shapes = list(result.get("summary", {}).get("shapes", {})) or sorted({r["shape"] for r in result["runs"]})
    cols = 2
    rows = math.ceil(len(shapes) / cols)
    width, height = cols * PANEL_W, rows * PANEL_H + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle" font-size="11">p99 latency (from scheduled '
        f"send) against offered rate, every trial of each server's chosen setting, all repeats; dashed: the "
        f"{result['slo']['p99_ms']:g} ms SLO; triangles: median goodput</text>",
    ]
    for i, shape in enumerate(shapes):
        parts += _panel(shape, result, (i % cols) * PANEL_W, (i // cols) * PANEL_H)
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def _goodput_cell(entry: dict[str, Any]) -> str:
    g = entry["goodput_rps"]
    if not g["max"]:
        return f"< {entry['lowest_failing_rps']:.3g} (fails at every rate tried)"
    return f"{g['median']:g} ({g['min']:g}-{g['max']:g})"


def markdown_table(result: dict[str, Any]) -> str:
    """Goodput per shape and server (median of the repeats, their range), its fraction of the
    model-only ceiling, and batchpilot's ratio to batch-1 and to the best peer."""
    summary = result["summary"]
    names = [n for n in COLORS if any(n in e["contenders"] for e in summary["shapes"].values())]
    head = ["shape", *names, "over batch-1", "over best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, entry in summary["shapes"].items():
        cells = [shape]
        for n in names:
            e = entry["contenders"].get(n)
            cells.append("-" if e is None else f"{_goodput_cell(e)}; {e['fraction_of_ceiling']:.1%}")
        cells += [str(entry.get("over_batch1", "-")), f"{entry.get('over_best_peer', '-')} ({entry.get('best_peer')})"]
        lines.append("| " + " | ".join(cells) + " |")
    settings = []
    for shape, entry in summary["shapes"].items():
        chosen = ", ".join(
            f"{n} {' '.join(f'{k}={v:g}' for k, v in e['setting'].items())}" for n, e in entry["contenders"].items()
        )
        settings.append(f"- {shape}: {chosen}")
    return (
        "\n".join(lines)
        + "\n\nSettings (batchpilot's from its tuner; the peers' the best of their grid):\n"
        + "\n".join(settings)
    )


if __name__ == "__main__":
    src = Path(sys.argv[1])
    doc = json.loads(src.read_text())
    write_svg(doc, src.with_suffix(".svg"))
    print(markdown_table(doc))
