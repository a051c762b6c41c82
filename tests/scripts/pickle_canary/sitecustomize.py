"""Put on PYTHONPATH of a server under test (tests/engine/test_hardening_inputs.py): every call of
pickle.loads / pickle.load in that process and its children that sees the tests' canary bytes is
written to the file named by LENS_EVALS_PICKLE_CANARY_LOG. Unpickling itself goes on unchanged."""

import os
import pickle

CANARY = b"lens-evals-pickle-canary"
_log = os.environ.get("LENS_EVALS_PICKLE_CANARY_LOG")

if _log:
    _loads, _load = pickle.loads, pickle.load

    class _Recording:
        """A file as pickle.load reads it, keeping what was read (never reads ahead: a pipe stays
        open while the other side waits, e.g. multiprocessing's spawn)."""

        def __init__(self, file):  # type: ignore[no-untyped-def]
            self._file, self.seen = file, bytearray()

        def read(self, *args):  # type: ignore[no-untyped-def]
            data = self._file.read(*args)
            self.seen += data
            return data

        def readline(self, *args):  # type: ignore[no-untyped-def]
            data = self._file.readline(*args)
            self.seen += data
            return data

        def readinto(self, buffer):  # type: ignore[no-untyped-def]
            count = self._file.readinto(buffer)
            self.seen += bytes(memoryview(buffer)[:count])
            return count

    def _record(data: bytes) -> None:
        if CANARY in bytes(data):
            with open(_log, "a") as out:
                out.write(f"{os.getpid()}\n")

    def loads(data, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        _record(data)
        return _loads(data, *args, **kwargs)

    def load(file, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        recording = _Recording(file)
        try:
            return _load(recording, *args, **kwargs)
        finally:
            _record(recording.seen)

    pickle.loads, pickle.load = loads, load
