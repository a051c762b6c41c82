"""``lens-evals capture``: activations of a prompt set written to disk while the engine runs
(sharded safetensors + a JSON manifest), resumable, in bounded host memory; and a streaming
loader (:class:`CaptureReader`). See docs/capture.md."""

from lens_evals.capture.loader import CaptureReader
from lens_evals.capture.manifest import CaptureError, CaptureManifest
from lens_evals.capture.runner import CaptureStopped, run_capture

__all__ = ["CaptureError", "CaptureManifest", "CaptureReader", "CaptureStopped", "run_capture"]
