"""`infermux report`: one self-contained HTML file of stored runs, drawn from the store alone.

Each kind of run has a renderer (`report.kinds`, registered with `@register_kind`); kinds
without one are shown generically, as their stored records. From Python:
`build_report("infermux.db", [3, 4]).write("report.html")`.
"""

from infermux.report.build import Report, build_report, render_runs, write_report
from infermux.report.data import RunData, StoreReader, open_reader, parse_run_ids
from infermux.report.kinds import list_kinds, register_kind, renderer_for
from infermux.report.page import Page, Section

__all__ = [
    "Page", "Report", "RunData", "Section", "StoreReader", "build_report", "list_kinds",
    "open_reader", "parse_run_ids", "register_kind", "render_runs", "renderer_for",
    "write_report",
]
