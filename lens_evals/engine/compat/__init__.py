"""The ONE package that touches vLLM internals. vLLM 0.26 (GPU) and 0.32 (CPU build).

Everything else in ``lens_evals.engine`` talks to vLLM through the functions here:
patch points (request validation, offline/async result delivery, the model runner's
forward, the HTTP app) and accessors (the batch layout, a request's extra args, the
decoder layers, parallel ranks). A vLLM upgrade should only need edits here.

This package splits them by side (``admission``, ``frontend``, ``rpc``, ``worker``, ``lora``) and keeps the
per-architecture knowledge (``architectures``: how each decoder-layer class carries the stream); everything is re-exported
here, so callers use ``compat.<name>``.
"""

from lens_evals.engine.compat._base import *  # noqa: F401,F403
from lens_evals.engine.compat.admission import *  # noqa: F401,F403
from lens_evals.engine.compat.architectures import *  # noqa: F401,F403
from lens_evals.engine.compat.frontend import *  # noqa: F401,F403
from lens_evals.engine.compat.lora import *  # noqa: F401,F403
from lens_evals.engine.compat.rpc import *  # noqa: F401,F403
from lens_evals.engine.compat.worker import *  # noqa: F401,F403
