"""``tracerl report MODEL_DIR``: a self-contained HTML report (inline SVG, no dependencies),
and with ``--png`` the curves as a PNG (matplotlib).

Reward, loss and step-health curves per step from ``history.jsonl``, each step's health
warnings (cause and fix), and the best and worst trajectories of a training step from
``trajectories/train/{step}.jsonl``. ``--serve`` is the live viewer (:mod:`tracerl.viewer`).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .core.errors import ConfigError
from .core.storage import atomic_write_bytes, atomic_write_text, read_jsonl
from .core.trajectory import read_groups_jsonl

WIDTH, HEIGHT, PAD = 640, 240, 40
COLOURS = {"train": "#1f77b4", "val": "#d62728"}
Band = list[tuple[int, float, float, float]]  # (step, mean, lowest, highest) over runs


def series(history: list[dict[str, Any]], metric: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        if metric in h and isinstance(h[metric], int | float):
            out.setdefault(h.get("split", "train"), []).append((int(h["step"]), float(h[metric])))
    return {k: sorted(v) for k, v in out.items()}


def svg_chart(title: str, series: dict[str, list[tuple[int, float]]],
              bands: dict[str, Band] | None = None) -> str:
    """A line chart with one polyline per split (and, given ``bands``, each split's band from
    its lowest to its highest run, shaded under the line)."""
    points = [p for s in series.values() for p in s]
    if not points:
        return f"<p>No {html.escape(title)} recorded.</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ys += [y for band in (bands or {}).values() for _, _, lo, hi in band for y in (lo, hi)]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

    def sy(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{html.escape(title)}">',
        f'<text x="{PAD}" y="20" font-size="14">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" '
        'stroke="#999"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#999"/>',
        f'<text x="4" y="{sy(y1) + 4:.1f}" font-size="10">{y1:.3g}</text>',
        f'<text x="4" y="{sy(y0) + 4:.1f}" font-size="10">{y0:.3g}</text>',
        f'<text x="{PAD}" y="{HEIGHT - 20}" font-size="10">step {x0}</text>',
        f'<text x="{WIDTH - PAD - 40}" y="{HEIGHT - 20}" font-size="10">step {x1}</text>',
    ]
    for split, band in sorted((bands or {}).items()):
        outline = [f"{sx(x):.1f},{sy(hi):.1f}" for x, _, _, hi in band]
        outline += [f"{sx(x):.1f},{sy(lo):.1f}" for x, _, lo, _ in reversed(band)]
        parts.append(f'<polygon class="band-{html.escape(split)}" fill="'
                     f'{COLOURS.get(split, "#2ca02c")}" fill-opacity="0.18" stroke="none" '
                     f'points="{" ".join(outline)}"/>')
    for k, (split, pts) in enumerate(sorted(series.items())):
        colour = COLOURS.get(split, "#2ca02c")
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series-{html.escape(split)}" fill="none" stroke="{colour}" '
                     f'stroke-width="2" points="{coords}"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>')
        parts.append(
            f'<text x="{WIDTH - PAD - 60}" y="{20 + 14 * k}" font-size="12" fill="{colour}">'
            f"{html.escape(split)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def seed_bands(histories: list[list[dict[str, Any]]], metric: str) -> dict[str, Band]:
    """Per split, the mean of ``metric`` over runs (seeds) at each step, with the lowest and
    highest run: the spread a learning curve is reported with. A step counts where every run
    that reached it logged the metric."""
    per_split: dict[str, dict[int, list[float]]] = {}
    for history in histories:
        for split, points in series(history, metric).items():
            for step, value in dict(points).items():  # a re-logged step: its last value
                per_split.setdefault(split, {}).setdefault(step, []).append(value)
    return {split: [(step, sum(v) / len(v), min(v), max(v)) for step, v in sorted(steps.items())]
            for split, steps in per_split.items()}


def svg_band_chart(title: str, bands: dict[str, Band], runs: int) -> str:
    """Mean curves with a shaded band from the lowest to the highest run."""
    return svg_chart(f"{title} (mean of {runs} runs, band: lowest to highest)",
                     {split: [(s, m) for s, m, _, _ in band] for split, band in bands.items()},
                     bands=bands)


SEED_CHARTS = ("metrics/success", "reward")


def build_comparison(model_dirs: list[Path]) -> str:
    """Train and held-out curves of several runs (seeds of one setup) with their spread, and
    a table of each run's held-out values."""
    histories = [read_history(Path(d)) for d in model_dirs]
    body = [f"<h1>{len(model_dirs)} runs</h1><p>" + ", ".join(
        html.escape(Path(d).name) for d in model_dirs) + "</p>"]
    for metric in SEED_CHARTS:
        bands = seed_bands(histories, metric)
        if bands:
            body.append(svg_band_chart(metric, bands, len(model_dirs)))
    rows = []
    for d, history in zip(model_dirs, histories, strict=True):
        val = series(history, "metrics/success").get("val", [])
        rows.append(f"<tr><td>{html.escape(Path(d).name)}</td>" + "".join(
            f"<td>{step}: {value:.3f}</td>" for step, value in val) + "</tr>")
    body.append("<h2>Held-out success per run</h2><table>" + "".join(rows) + "</table>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>tracerl runs</title>"
            "<style>body{font-family:sans-serif;max-width:900px;margin:2em auto}td{padding:"
            f"0 .6em}}</style></head><body>{''.join(body)}</body></html>")


def _render_trajectory(t: Any) -> str:
    rows = []
    for m in t.messages():
        content = m.get("content") or json.dumps(m.get("tool_calls") or "")
        rows.append(f"<div class='msg'><b>{html.escape(str(m.get('role')))}</b>: "
                    f"<pre>{html.escape(str(content))}</pre></div>")
    return (f"<div class='traj'><p>reward <b>{t.reward:.4g}</b> &middot; rollout "
            f"{html.escape(t.rollout_id or '-')}</p>{''.join(rows)}</div>")


CHARTS = ("reward", "loss")
TASK_CHARTS = ("metrics/success", "metrics/tool_call_valid")  # drawn when a task logs them
HEALTH_CHARTS = ("skipped_groups", "prefix_mismatch_fraction", "rendered_fraction", "engine_kl",
                 "length_clipped_fraction", "unattributed_calls")


def health_section(history: list[dict[str, Any]]) -> list[str]:
    """Each training step's health warnings (cause and fix), or a line saying all were healthy."""
    from .backend.training.health import step_warnings

    rows = [(h["step"], w) for h in history if h.get("split", "train") == "train"
            for w in step_warnings(h)]
    if not rows:
        return ["<h2>Step health</h2><p>No step-health warnings.</p>"]
    items = "".join(f"<li>step {step}: {html.escape(w.message)} &mdash; <i>fix:</i> "
                    f"{html.escape(w.fix)}</li>" for step, w in rows)
    return [f"<h2>Step health</h2><ul class='health'>{items}</ul>"]


def read_history(model_dir: Path) -> list[dict[str, Any]]:
    history_path = Path(model_dir) / "history.jsonl"
    if not history_path.exists():
        raise ConfigError(f"{model_dir} is not a model folder (no history.jsonl)")
    return read_jsonl(history_path)


def build_report(model_dir: Path, step: int | None = None, n: int = 2) -> str:
    model_dir = Path(model_dir)
    history = read_history(model_dir)
    steps = sorted(int(p.stem) for p in (model_dir / "trajectories" / "train").glob("*.jsonl"))
    health = [svg_chart(metric, series(history, metric)) for metric in HEALTH_CHARTS
              if series(history, metric)]
    body = [f"<h1>{html.escape(model_dir.name)}</h1>",
            *(svg_chart(metric, series(history, metric)) for metric in CHARTS),
            *(svg_chart(metric, series(history, metric)) for metric in TASK_CHARTS
              if series(history, metric)),
            *health_section(history), *health]
    if steps:
        step = steps[-1] if step is None else step
        path = model_dir / "trajectories" / "train" / f"{step:04d}.jsonl"
        if not path.exists():
            raise ConfigError(f"no trajectories were saved for step {step}; steps: {steps}")
        trajectories = sorted(
            (t for g in read_groups_jsonl(path) for t in g), key=lambda t: t.reward
        )
        body.append(f"<h2>Step {step}: best {min(n, len(trajectories))}</h2>")
        body += [_render_trajectory(t) for t in reversed(trajectories[-n:])]
        body.append(f"<h2>Step {step}: worst {min(n, len(trajectories))}</h2>")
        body += [_render_trajectory(t) for t in trajectories[:n]]
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto}pre{white-space:pre-wrap;"
             "margin:0}.traj{border:1px solid #ddd;padding:.5em;margin:.5em 0}.msg{margin:.2em 0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>tracerl report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def write_report(model_dir: Path, out: Path | None = None, step: int | None = None) -> Path:
    out = Path(out) if out else Path(model_dir) / "report.html"
    atomic_write_text(out, build_report(Path(model_dir), step=step))
    return out


def write_comparison(model_dirs: list[str] | list[Path], out: Path | str | None = None) -> Path:
    """:func:`build_comparison` of several model folders, written to ``out`` (./runs.html)."""
    path = Path(out) if out else Path("runs.html")
    atomic_write_text(path, build_comparison([Path(d) for d in model_dirs]))
    return path


def write_png(model_dir: Path, out: Path | None = None) -> Path:
    """The same curves as a PNG (needs matplotlib: ``pip install 'tracerl[report]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("PNG reports need matplotlib: pip install 'tracerl[report]'") from None
    import io

    history = read_history(Path(model_dir))
    fig = Figure(figsize=(5 * len(CHARTS), 3.5), dpi=100, layout="constrained")
    for ax, metric in zip(fig.subplots(1, len(CHARTS)), CHARTS, strict=True):
        for split, pts in sorted(series(history, metric).items()):
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=split,
                    color=COLOURS.get(split, "#2ca02c"))
        ax.set(title=metric, xlabel="step")
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, f"no {metric} recorded", ha="center", transform=ax.transAxes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    out = Path(out) if out else Path(model_dir) / "report.png"
    atomic_write_bytes(out, buf.getvalue())
    return out
