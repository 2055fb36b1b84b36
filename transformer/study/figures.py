"""Figures as files: matplotlib (imported only by what draws, with a backend that draws to
files) and a figure saved as PNG to a local path or a bucket URL. The pictures of a model
(pictures.py, position_pictures.py) and the reports' plots (report_plots.py,
report_grids.py) draw with them."""

import io

from transformer.core import storage


def save(fig, path: str, **savefig_kwargs) -> None:
  """Writes a matplotlib figure as PNG to `path` (local or a URL) and closes it."""
  png = io.BytesIO()
  fig.savefig(png, format="png", **savefig_kwargs)
  pyplot().close(fig)
  storage.write(path, png.getvalue())


def pyplot():
  """matplotlib.pyplot drawing to files (imported only by what draws)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt
