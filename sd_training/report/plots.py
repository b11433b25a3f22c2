"""The report's panels drawn with matplotlib: one PNG per panel (the report's page lays them out at a fixed
size) or all panels stacked in one PNG (``scripts/plot_metrics.py``). matplotlib's object API (``Figure``
on an Agg canvas): no pyplot, no global backend switch in the training process, no display needed. Every
text drawn from the run (source names, the run folder's name) has its ``$`` escaped: matplotlib would read
``$...$`` as math and stop the drawing at an unknown command."""

from __future__ import annotations

from pathlib import Path

from ..outputs.escape import mathtext
from .series import Panel

# A panel's PNG: 7 x 3.2 inches at 100 dpi (the page shows it at that size, 700 x 320 CSS pixels).
PANEL_INCHES = (7.0, 3.2)
PANEL_DPI = 100
PLOTS_EXTRA = "pip install 'sd-training[plots]'"


class MatplotlibMissing(ImportError):
    pass


def require_matplotlib() -> None:
    """Raise :class:`MatplotlibMissing` (naming the install command) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise MatplotlibMissing(f"the run report's plots need matplotlib, which is not installed: {PLOTS_EXTRA} "
                                f"(or pip install matplotlib) ({e})") from None


def _figure(inches: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=inches)
    FigureCanvasAgg(fig)
    return fig


LOG_SPAN = 30  # a panel marked log_y uses a log axis when its values span more than this factor


def _log_axis(ax) -> None:
    """A log y-axis ticked at 1, 2, 5 x 10^k and labelled in plain numbers (0.2, not 2 x 10^-1)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _draw(ax, panel: Panel, title: bool = True) -> None:
    """One panel on ``ax``: each series raw (thin when a smoothed curve is drawn over it) and smoothed."""
    spec = panel.spec
    scale = 100.0 if spec.percent else 1.0
    colours = [f"C{i}" for i in range(10)]
    for i, s in enumerate(panel.series):
        colour = colours[i % len(colours)]
        label = mathtext(s.label)  # a source named '$...$' is shown as named, not parsed as math
        ys = [v * scale for v in s.values]
        few = len(s.steps) < 30
        marker = "o" if few else None
        if s.smoothed is not None and panel.window > 1:
            ax.plot(s.steps, ys, color=colour, lw=0.7, alpha=0.35, marker=marker, ms=2)
            ax.plot(s.steps, [v * scale for v in s.smoothed], color=colour, lw=1.6,
                    label=f"{label} (mean of {panel.window})")
        else:
            ax.plot(s.steps, ys, color=colour, lw=1.4, label=label, marker=marker, ms=3)
    if title:
        ax.set_title(mathtext(spec.title), fontsize=10, loc="left")
    values = [v for s in panel.series for v in s.values]
    if spec.log_y and min(values) > 0 and max(values) > LOG_SPAN * min(values):
        _log_axis(ax)
    elif spec.count:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0, top=max(1.0, max(values) * 1.1))
    elif not spec.percent:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    if spec.percent:
        ax.set_ylabel("%", fontsize=8)
    elif spec.unit:
        ax.set_ylabel(spec.unit, fontsize=8)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)
    if len(panel.series) > 1 or panel.window > 1:
        ax.legend(fontsize=7, loc="best")


def draw_panel(panel: Panel, out: Path) -> Path:
    """``panel`` as a PNG of :data:`PANEL_INCHES` at :data:`PANEL_DPI`, written to ``out``."""
    fig = _figure(PANEL_INCHES)
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, panel)
    ax.set_xlabel("optimizer step", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=PANEL_DPI)
    return out


def draw_stacked(panels: list[Panel], out: str | Path, title: str = "") -> Path:
    """All ``panels`` stacked in one PNG with a shared step axis (``scripts/plot_metrics.py``)."""
    if not panels:
        raise ValueError("no known metric (loss, lr, images_per_sec_per_device, ...) in the file")
    fig = _figure((8, 2.6 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        _draw(ax, panel)
    axes[-1].set_xlabel("optimizer step")
    if title:
        fig.suptitle(mathtext(title))  # a run folder's name
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
