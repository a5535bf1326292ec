"""Compare: two capture runs, tensor by tensor, to find the first module where they diverge
(``graphpass compare``, :func:`graphpass.compare`). A product of its own beside ``capturing/``: the
two meet only in the on-disk format, :mod:`graphpass.capture_format`, which this package reads and
never imports ``capturing/`` for.

Modules: ``compare_runs`` (:func:`compare`: the tree walk), ``compare_report`` (:class:`CompareReport`,
:class:`CompareRow`, :class:`CompareError`), ``compare_tensors`` (one tensor against another in
chunks), ``report_format`` (the table's text), ``completeness``
(what each side must hold, the steps' execution order), ``shards`` (across shardings; several
roots), ``compare_engines`` (an engine's captures against a ``graphpass reference`` run, aligned by
request and position), ``engine_families`` (per engine and model family, an engine's module outputs
rebuilt in transformers' terms), ``plots`` (the divergence plot and HTML page, matplotlib optional).
"""

from .compare_report import CompareError, CompareReport, CompareRow
from .compare_runs import compare

__all__ = ["compare", "CompareReport", "CompareRow", "CompareError"]
