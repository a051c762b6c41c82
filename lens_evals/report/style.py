"""The report's stylesheet (inline in the page)."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#111827;background:#f9fafb}
header.page{padding:16px 24px;background:#fff;border-bottom:1px solid #e5e7eb}
h1{font-size:20px;margin:0 0 4px}h2{font-size:18px;margin:16px 0 8px}h3{font-size:15px;margin:12px 0 6px}h4{margin:0 0 4px;font-size:13px}
main{padding:8px 24px 40px}
code{font-size:12px}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #e5e7eb;padding:3px 8px;text-align:left;vertical-align:top}
table.card td:first-child,table.metrics td:first-child{color:#4b5563;white-space:nowrap}
.summary{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}.summary table.card{max-width:520px}
.figures{display:flex;flex-wrap:wrap;gap:16px;margin:12px 0}figure{margin:0;background:#fff;border:1px solid #e5e7eb;padding:8px}
figcaption{font-size:12px;color:#4b5563}
.flag-count{margin:6px 0}
.pair{background:#fff;border:1px solid #e5e7eb;margin:10px 0;padding:8px}
.columns{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.single{margin:10px 0}
.transcript{background:#fff;border:1px solid #e5e7eb;border-left:4px solid #9ca3af;padding:6px 8px}
.transcript.label-deceptive,.transcript.label-harmful{border-left-color:#dc2626}
.transcript.label-honest,.transcript.label-benign{border-left-color:#2563eb}
.transcript header{font-size:12px;color:#374151;margin-bottom:4px}
.flagged{color:#b91c1c;font-weight:700}.calm{color:#4b5563}
.turn{white-space:pre-wrap;margin:4px 0;font-size:13px}.turn.system,.turn.user{color:#374151}
.response{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;line-height:1.9;padding:4px;background:#fff}
.tok{border-radius:2px;padding:1px 0;unicode-bidi:isolate}.tok.above{outline:1px solid #7f1d1d}
.tok.excluded,.excluded-sample{color:#9ca3af;background:#f3f4f6}
.explanation{font-size:12px;color:#4b5563;margin:4px 0 0}
details.context summary{cursor:pointer;font-size:12px;color:#4b5563}
.legend{display:flex;align-items:center;gap:8px;font-size:12px;margin:8px 0}
.legend .bar{position:relative;display:inline-block;width:220px;height:12px;border:1px solid #d1d5db}
.legend .mark{position:absolute;left:50%;top:-3px;bottom:-3px;border-left:2px solid #111827}
.legend .note{color:#4b5563}
.tabs>input{display:none}.tabs>label{display:inline-block;padding:6px 14px;border:1px solid #d1d5db;border-bottom:none;
background:#f3f4f6;cursor:pointer;margin-right:4px}.tabs>input:checked+label{background:#fff;font-weight:600}
.tabs>.panel{display:none;border-top:1px solid #d1d5db}
.oracle .turn.zero{color:#6b7280}
.readouts .transcript{margin:10px 0}.grid{overflow-x:auto;margin:4px 0 8px}
table.readout{font:12px ui-monospace,Menlo,Consolas,monospace}table.readout td,table.readout th{white-space:pre;padding:1px 4px}
table.readout th{background:#f3f4f6;font-weight:600}table.readout.sae td{vertical-align:top}
.transcript.oracle.correct{border-left-color:#16a34a}.transcript.oracle.wrong{border-left-color:#dc2626}
"""
