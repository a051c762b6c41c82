"""``lens-evals report LOG``: one self-contained HTML page per Inspect eval log.

Probe tasks (Roleplaying, coup): ROC with the 1%-FPR points, score histograms with the threshold
and the control distribution, the confusion matrix and flagged count, every transcript with its
response tokens coloured by probe score, a tab per probe. Activation-oracle tasks: accuracy per
family against the zero-vector baseline and every answer. The steering eval: its dose-response
curves (each measure against the scale, a line per layer) and every steered text. The page is written to a temporary
file and renamed, so a failure leaves no partial page.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lens_evals.report.reading import ReportError

__all__ = ["ReportError", "default_report_path", "write_report"]


def default_report_path(log: str | Path) -> Path:
    """``LOG.html`` beside the log (``x.eval`` -> ``x.html``)."""
    return Path(log).with_suffix(".html")


def write_report(log: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``log`` to ``out`` (default: beside the log); return its path.
    Raises :class:`ReportError` for a log the report cannot read."""
    from lens_evals.report.page import page_html
    from lens_evals.report.reading import report_data

    target = Path(out) if out is not None else default_report_path(log)
    if target.is_dir():
        raise ReportError(f"{target}: a directory; --out takes the HTML file to write")
    if target.exists() and Path(log).exists() and target.samefile(log):
        raise ReportError(f"{target}: that is the log itself; the page would overwrite it")
    html = page_html(report_data(log))
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(html)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes it private; a report is an ordinary file
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
