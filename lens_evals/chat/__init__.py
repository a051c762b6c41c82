"""``lens-evals chat``: a local web page against a lens server (host side, HTTP only): chat with
the model, tokens coloured by a probe, a per-token lens view, steering, the activation oracle and
a self-contained HTML export (docs/chat.md)."""
